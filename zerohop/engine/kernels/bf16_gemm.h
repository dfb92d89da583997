// x @ W.T for bfloat16 W with AVX-512 BF16's vdpbf16ps: the activations rounded to bfloat16
// (round to nearest even, as _mm512_cvtneps_pbh does), each instruction 32 products summed
// pairwise into 16 float32 lanes. Where the CPU lacks the instruction the dense kernel's
// exact widening path (dense_gemm.h) multiplies the same weights instead.
//
// W is packed once (bf16_pack) into panels of 16 rows with k in pairs: [N / 16, K / 2, 16, 2],
// so a k-pair step of a panel is one 64-byte vector, lane j holding W[16p + j][2q, 2q + 1].
// A tile is R activation rows x one panel; every output sums its k pairs in one fixed order
// (even pairs into one accumulator, odd pairs into another, then the two added) whatever R,
// the tile or the thread split, so a row's result does not depend on the rows beside it.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "spin_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZH_BF16_DOT 1
#endif

namespace zerohop {
namespace bf16 {

constexpr int64_t kPanel = 16;
constexpr int64_t kRows = 6;       // activation rows per tile
constexpr int64_t kRowBlock = 96;  // activation rows kept in L2 while the panels pass

// W [N, K] bfloat16 (K even) in panels [ceil(N / 16), K / 2, 16, 2]; rows past N are zero.
inline torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0,
              "bf16_pack takes a bfloat16 matrix with an even number of columns");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kPanel, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#ifdef ZH_BF16_DOT
// count floats rounded to bfloat16 (nearest even), 16 at a time, the tail masked.
inline void round_to_bf16(const float* x, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t left = std::min<int64_t>(16, count - i);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
    __m256i bits;
    std::memcpy(&bits, &rounded, sizeof(bits));
    _mm256_mask_storeu_epi16(out + i, mask, bits);
  }
}

inline __m512bh as_bh(__m512i v) {
  __m512bh out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

inline __m512bh pair_of(const uint16_t* x) {  // x[0], x[1] in every 32-bit lane
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return as_bh(_mm512_set1_epi32(pair));
}

template <int R>
void panel_tile(const uint16_t* panel, const uint16_t* x, int64_t k_len, float* out,
                int64_t out_stride, int64_t width) {
  __m512 even[R], odd[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const int64_t pairs = k_len / 2;
  int64_t q = 0;
  for (; q + 2 <= pairs; q += 2) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(panel + q * 2 * kPanel));
    const __m512bh w1 = as_bh(_mm512_loadu_si512(panel + (q + 1) * 2 * kPanel));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], pair_of(x + r * k_len + 2 * q), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], pair_of(x + r * k_len + 2 * q + 2), w1);
    }
  }
  if (q < pairs) {  // an odd number of pairs: the last one joins the even sums
    const __m512bh w0 = as_bh(_mm512_loadu_si512(panel + q * 2 * kPanel));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], pair_of(x + r * k_len + 2 * q), w0);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * out_stride, mask, _mm512_add_ps(even[r], odd[r]));
  }
}

inline void panel_rows(int64_t rows, const uint16_t* panel, const uint16_t* x, int64_t k_len,
                       float* out, int64_t out_stride, int64_t width) {
  switch (rows) {
    case 6: return panel_tile<6>(panel, x, k_len, out, out_stride, width);
    case 5: return panel_tile<5>(panel, x, k_len, out, out_stride, width);
    case 4: return panel_tile<4>(panel, x, k_len, out, out_stride, width);
    case 3: return panel_tile<3>(panel, x, k_len, out, out_stride, width);
    case 2: return panel_tile<2>(panel, x, k_len, out, out_stride, width);
    default: return panel_tile<1>(panel, x, k_len, out, out_stride, width);
  }
}

inline void panel_range(const uint16_t* w, const uint16_t* x, int64_t m, int64_t k_len,
                        float* out, int64_t n_out, int64_t begin, int64_t end) {
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t width = std::min(kPanel, n_out - p * kPanel);
      for (int64_t r = m0; r < m1; r += kRows) {
        panel_rows(std::min(kRows, m1 - r), w + p * k_len * kPanel, x + r * k_len, k_len,
                   out + r * n_out + p * kPanel, n_out, width);
      }
    }
  }
}
#endif

}  // namespace bf16

// Whether this build multiplies bfloat16 with vdpbf16ps (bf16_linear); else the dense path.
inline bool bf16_dot() {
#ifdef ZH_BF16_DOT
  return true;
#else
  return false;
#endif
}

inline torch::Tensor bf16_pack(torch::Tensor w) { return bf16::pack(w); }

// x [M, K] float32 @ W.T, W packed by bf16_pack, N = out_features; x rounded to bfloat16.
inline torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == bf16::kPanel &&
                  packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "weights must be packed [N / 16, K / 2, 16, 2] (bf16_pack) for this input");
  TORCH_CHECK(n_out > (packed.size(0) - 1) * bf16::kPanel &&
                  n_out <= packed.size(0) * bf16::kPanel,
              "out_features does not match the packed weights");
#ifdef ZH_BF16_DOT
  const int64_t m = x.size(0), k_len = x.size(1);
  auto out = torch::empty({m, n_out}, x.options());
  auto rounded = torch::empty({m, k_len}, packed.options());
  auto* x16 = reinterpret_cast<uint16_t*>(rounded.data_ptr());
  bf16::round_to_bf16(x.data_ptr<float>(), m * k_len, x16);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* out_data = out.data_ptr<float>();
  SpinPool::instance().run(packed.size(0), [&](int64_t begin, int64_t end) {
    bf16::panel_range(w, x16, m, k_len, out_data, n_out, begin, end);
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_linear needs AVX-512 BF16 (bf16_dot() is false here)");
#endif
}

}  // namespace zerohop
