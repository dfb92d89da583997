// Activations rounded to 16-bit integers per block of 32, for the panel products (panel_product.h)
// on AVX-512 VNNI.
//
// Each block of 32 activations is rounded to int16 with its own scale (dx = max |x| / 32767),
// so an entry is off by at most 1/65534 of its block's largest: ~2e-5 of a product, against
// ~5e-3 for llama.cpp's int8 rounding and ~4e-3 for bfloat16. Weight integers (q4_1's nibbles,
// q8_0's bytes) then widen to int16 in registers and multiply these exactly in int32.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define ZH_WIDE 1
#endif

namespace zerohop::wide {

constexpr int64_t kBlock = 32;

// Activation rows rounded: q [rows, K] int16, scales [rows, blocks] dx, and for q4_1 weights
// sums [rows, blocks] dx * sum q (their min term's).
struct Int16Rows {
  int64_t cols = 0, blocks = 0;
  std::vector<int16_t> q;
  std::vector<float> scales, sums;
};

#ifdef ZH_WIDE

inline void round_block(const float* x, Int16Rows& rows, int64_t row, int64_t block) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float dx = amax / 32767.0f;
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  int16_t* q = rows.q.data() + row * rows.cols + block * kBlock;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(qa));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(qb));
  const int64_t at = row * rows.blocks + block;
  rows.scales[at] = dx;
  if (!rows.sums.empty()) {
    rows.sums[at] = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

// x [count, cols] float32 rounded; with_sums for q4_1 weights.
inline Int16Rows round_rows(const float* x, int64_t count, int64_t cols, bool with_sums) {
  Int16Rows rows;
  rows.cols = cols;
  rows.blocks = cols / kBlock;
  rows.q.resize(count * cols);
  rows.scales.resize(count * rows.blocks);
  if (with_sums) rows.sums.resize(count * rows.blocks);
  for (int64_t r = 0; r < count; ++r)
    for (int64_t b = 0; b < rows.blocks; ++b) round_block(x + r * cols + b * kBlock, rows, r, b);
  return rows;
}

#endif  // ZH_WIDE

}  // namespace zerohop::wide
