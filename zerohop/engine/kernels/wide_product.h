// Block-quantized products on 16-bit activations, with AVX-512 VNNI (vpdpwssd): the default
// where the CPU has it.
//
// Each block of 32 activations is rounded to int16 with its own scale (dx = max |x| / 32767),
// so an entry is off by at most 1/65534 of its block's largest: ~2e-5 of the product, against
// ~5e-3 for llama.cpp's int8 rounding and ~4e-3 for bfloat16. Weight integers (q4_1's nibbles,
// q8_0's bytes) widen to int16 in registers and multiply the activations exactly in int32; a
// block's integer dot is then scaled by dw * dx into the row's float sum. A row's result
// depends on that row alone, in one summation order whatever rows share its tile: one row
// decoding, a batch, a prompt chunk. So decode rows and prompt rows compute alike, and a
// position computes the same decoded or prefilled.
//
// Why not floats: expanding each weight to float32 costs a convert per weight and an FMA per
// 8 products, against one vpdpwssd per 32 products here (1.5-2.5x the float path's rate).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define ZH_WIDE 1
#endif

namespace zerohop::wide {

constexpr int64_t kBlock = 32;

// Activation rows rounded to int16 per block of 32.
//   q: [rows, K] int16 in the weights' lane order (see position);
//   pair_scales: per pair of blocks 16 floats, dx of the first block in lanes 0-7 and of the
//     second in 8-15 (the lanes of that pair's integer dots);
//   scales: [rows, blocks] dx; sums: q4_1 only, [rows, blocks] dx * sum q (the min term's).
struct Int16Rows {
  int64_t cols = 0, blocks = 0;
  std::vector<int16_t> q;
  std::vector<float> pair_scales, scales, sums;
};

#ifdef ZH_WIDE

// A pair of blocks widens to [b e0-15, b+1 e0-15] and [b e16-31, b+1 e16-31] (q4_1: the
// low and the high nibbles of the pair's 32 bytes): its activations go in that order, 64
// entries per pair, so that one vpdpwssd per half sums 16 lanes, 0-7 of block b and 8-15 of
// b+1. A last unpaired block keeps element order.
inline int64_t position(int64_t blocks, int64_t block, int64_t element) {
  if (block % 2 == 0 && block + 1 == blocks) return block * kBlock + element;
  return (block / 2) * 2 * kBlock + (element < 16 ? 0 : 32) + 16 * (block % 2) + element % 16;
}

inline void round_block(const float* x, Int16Rows& rows, int64_t row, int64_t block) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float dx = amax / 32767.0f;
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  int16_t* q = rows.q.data() + row * rows.cols;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + position(rows.blocks, block, 0)),
                      _mm512_cvtepi32_epi16(qa));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + position(rows.blocks, block, 16)),
                      _mm512_cvtepi32_epi16(qb));
  const int64_t at = row * rows.blocks + block, pairs = rows.blocks / 2;
  rows.scales[at] = dx;
  if (!rows.sums.empty()) {
    rows.sums[at] = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
  if (block / 2 < pairs) {
    float* lanes = rows.pair_scales.data() + (row * pairs + block / 2) * 16 + 8 * (block % 2);
    _mm256_storeu_ps(lanes, _mm256_set1_ps(dx));
  }
}

// x [count, cols] float32 rounded; with_sums for q4_1 weights (their min term).
inline Int16Rows round_rows(const float* x, int64_t count, int64_t cols, bool with_sums) {
  Int16Rows rows;
  rows.cols = cols;
  rows.blocks = cols / kBlock;
  rows.q.resize(count * cols);
  rows.scales.resize(count * rows.blocks);
  rows.pair_scales.resize(count * (rows.blocks / 2) * 16);
  if (with_sums) rows.sums.resize(count * rows.blocks);
  for (int64_t r = 0; r < count; ++r)
    for (int64_t b = 0; b < rows.blocks; ++b) round_block(x + r * cols + b * kBlock, rows, r, b);
  return rows;
}

// sum_b m_b * sums_b over a row's blocks: q4_1's min term.
inline float min_term(const float* m, const float* sums, int64_t blocks) {
  __m512 total = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 16 <= blocks; b += 16)
    total = _mm512_fmadd_ps(_mm512_loadu_ps(m + b), _mm512_loadu_ps(sums + b), total);
  if (b < blocks) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (blocks - b)) - 1);
    total = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, m + b),
                            _mm512_maskz_loadu_ps(rest, sums + b), total);
  }
  return _mm512_reduce_add_ps(total);
}

// One q4_1 weight row (q: K / 2 bytes, d, m) widened a pair of blocks at a time.
struct Q4_1Weights {
  const uint8_t* q;
  const float* d;
  const float* m;

  void pair(int64_t p, __m512i& low, __m512i& high) const {
    const __m512i bytes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 32)));
    low = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
    high = _mm512_srli_epi16(bytes, 4);
  }

  void last(int64_t b, __m256i& low, __m256i& high) const {
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
    low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    high = _mm256_srli_epi16(bytes, 4);
  }
};

// One q8_0 weight row (q: K int8, d).
struct Q8_0Weights {
  const int8_t* q;
  const float* d;

  static __m512i widen(const int8_t* first, const int8_t* second) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(first));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(second));
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(b, a));
  }

  void pair(int64_t p, __m512i& low, __m512i& high) const {
    const int8_t* b = q + p * 2 * kBlock;
    low = widen(b, b + kBlock);
    high = widen(b + 16, b + kBlock + 16);
  }

  void last(int64_t b, __m256i& low, __m256i& high) const {
    low = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 32)));
    high = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 32 + 16)));
  }
};

// ROWS activation rows (from `first`) against one weight row.
template <int ROWS, typename Weights>
void dot_rows(const Weights& w, const Int16Rows& x, int64_t first, float* out) {
  const int64_t cols = x.cols, blocks = x.blocks, pairs = blocks / 2;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int16_t* xq = x.q.data() + first * cols;
  const float* xs = x.pair_scales.data() + first * pairs * 16;
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i low, high;
    w.pair(p, low, high);
    const __m512 dw = _mm512_permutexvar_ps(
        lanes, _mm512_castps128_ps512(
                   _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(w.d + 2 * p)))));
    for (int r = 0; r < ROWS; ++r) {
      const int16_t* xp = xq + r * cols + p * 64;
      __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(xp));
      dot = _mm512_dpwssd_epi32(dot, high, _mm512_loadu_si512(xp + 32));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(xs + (r * pairs + p) * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  }
  if (blocks % 2 == 1) {  // the last block alone, in element order
    const int64_t b = blocks - 1;
    __m256i low, high;
    w.last(b, low, high);
    for (int r = 0; r < ROWS; ++r) {
      const int16_t* xb = xq + r * cols + b * kBlock;
      __m256i dot = _mm256_dpwssd_epi32(_mm256_setzero_si256(), low,
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
      dot = _mm256_dpwssd_epi32(
          dot, high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
      const __m256 scale = _mm256_set1_ps(w.d[b] * x.scales[(first + r) * blocks + b]);
      acc[r] = _mm512_add_ps(
          acc[r], _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), scale)));
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    out[r] = _mm512_reduce_add_ps(acc[r]);
    if constexpr (std::is_same_v<Weights, Q4_1Weights>) {
      out[r] += min_term(w.m, x.sums.data() + (first + r) * blocks, blocks);
    }
  }
}

constexpr int64_t kMaxRows = 8;

template <typename Weights>
void dot_tile(const Weights& w, const Int16Rows& x, int64_t first, int64_t rows, float* out) {
  switch (rows) {
    case 8: return dot_rows<8>(w, x, first, out);
    case 7: return dot_rows<7>(w, x, first, out);
    case 6: return dot_rows<6>(w, x, first, out);
    case 5: return dot_rows<5>(w, x, first, out);
    case 4: return dot_rows<4>(w, x, first, out);
    case 3: return dot_rows<3>(w, x, first, out);
    case 2: return dot_rows<2>(w, x, first, out);
    default: return dot_rows<1>(w, x, first, out);
  }
}

#endif  // ZH_WIDE

}  // namespace zerohop::wide
