// x @ W.T for dense weights: float32, or float16 / bfloat16 kept at 16 bits in memory and
// widened to float32 in registers (exact: every 16-bit value is a float32 value), so a
// 16-bit file's decode reads half the bytes of its float32 copy.
//
// W is packed once (dense_pack) into panels of 16 rows, k-major, as BLAS libraries pack it:
// a k step of a panel is 16 contiguous weights. The micro-kernel multiplies six activation
// rows by one panel into twelve sums kept in registers (per k: two weight vectors and six
// broadcasts feed twelve multiply-adds), so it runs at the FMA rate where the weights are
// reused and at the memory rate at one row; the weights stream sequentially either way.
// Threads split the panels; x is taken 96 rows (in L2) at a time. Measured on SmolLM2's
// shapes, 2 threads, weights cold: float32 1.0x oneDNN's packed GEMM at 1-2 rows (both at
// the memory rate), 1.3-1.7x at 4-64, 1.1-1.2x at 128-256, 0.9x at 2,048 rows.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "spin_pool.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ZH_DENSE_SIMD 1
#endif

namespace zerohop {
namespace dense {

constexpr int64_t kRows = 6;        // activation rows per tile
constexpr int64_t kRowBlock = 96;   // activation rows kept in L2 while the panels pass

struct F32 {
  using T = float;
  static constexpr auto dtype = torch::kFloat32;
#ifdef ZH_DENSE_SIMD
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
#endif
  static float scalar(float v) { return v; }
};

struct F16 {
  using T = at::Half;
  static constexpr auto dtype = torch::kFloat16;
#ifdef ZH_DENSE_SIMD
  static __m256 load(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#endif
  static float scalar(at::Half v) { return static_cast<float>(v); }
};

struct BF16 {
  using T = at::BFloat16;
  static constexpr auto dtype = torch::kBFloat16;
#ifdef ZH_DENSE_SIMD
  // A bfloat16 is the top half of a float32.
  static __m256 load(const at::BFloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
#endif
  static float scalar(at::BFloat16 v) { return static_cast<float>(v); }
};

// Weights packed in panels of 16 rows, k-major: panel p holds rows 16p..16p+15, element
// [k][j] = W[16p + j][k] (rows past N are zero). A k step of a panel is 16 contiguous values.
constexpr int64_t kPanel = 16;

#ifdef ZH_DENSE_SIMD
// R activation rows x one panel (16 outputs), over all K: per k, two weight vectors and R
// broadcasts feed 2R multiply-adds. Every R sums k in the same order, so a row's result does
// not depend on the rows beside it (one row alone is memory-bound: two chains suffice).
template <int R, typename W>
void panel_tile(const typename W::T* panel, const float* x, int64_t k_len, float* out,
                int64_t out_stride, int64_t width) {
  // Plain loops over a local array (no lambda capturing it): the compiler then keeps every
  // sum in a register; through a capture it stored all twelve each step.
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    const __m256 w0 = W::load(panel + k * kPanel), w1 = W::load(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k_len + k);
      acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* row = out + r * out_stride;
    if (width == kPanel) {
      _mm256_storeu_ps(row, acc[r][0]);
      _mm256_storeu_ps(row + 8, acc[r][1]);
    } else {  // the last panel of a matrix whose N is not a multiple of 16
      alignas(32) float tail[kPanel];
      _mm256_store_ps(tail, acc[r][0]);
      _mm256_store_ps(tail + 8, acc[r][1]);
      std::copy(tail, tail + width, row);
    }
  }
}

template <typename W>
void panel_rows(int64_t rows, const typename W::T* panel, const float* x, int64_t k_len,
                float* out, int64_t out_stride, int64_t width) {
  switch (rows) {
    case 6: return panel_tile<6, W>(panel, x, k_len, out, out_stride, width);
    case 5: return panel_tile<5, W>(panel, x, k_len, out, out_stride, width);
    case 4: return panel_tile<4, W>(panel, x, k_len, out, out_stride, width);
    case 3: return panel_tile<3, W>(panel, x, k_len, out, out_stride, width);
    case 2: return panel_tile<2, W>(panel, x, k_len, out, out_stride, width);
    default: return panel_tile<1, W>(panel, x, k_len, out, out_stride, width);
  }
}
#else
template <typename W>
void panel_rows(int64_t rows, const typename W::T* panel, const float* x, int64_t k_len,
                float* out, int64_t out_stride, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      float total = 0.0f;
      for (int64_t k = 0; k < k_len; ++k) total += W::scalar(panel[k * kPanel + j]) * x[r * k_len + k];
      out[r * out_stride + j] = total;
    }
  }
}
#endif

// Panels [begin, end) against every row of x, a block of x rows (in L2) at a time.
template <typename W>
void panel_range(const typename W::T* w, const float* x, int64_t m, int64_t k_len, float* out,
                 int64_t n_out, int64_t begin, int64_t end) {
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t width = std::min(kPanel, n_out - p * kPanel);
      for (int64_t r = m0; r < m1; r += kRows) {
        panel_rows<W>(std::min(kRows, m1 - r), w + p * k_len * kPanel, x + r * k_len, k_len,
                      out + r * n_out + p * kPanel, n_out, width);
      }
    }
  }
}

template <typename W>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == W::dtype && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(1) == x.size(1),
              "weights must be packed [N / 16, K, 16] (dense_pack) for this input");
  TORCH_CHECK(n_out > (packed.size(0) - 1) * kPanel && n_out <= packed.size(0) * kPanel,
              "out_features does not match the packed weights");
  const int64_t m = x.size(0), k_len = x.size(1);
  auto out = torch::empty({m, n_out}, x.options());
  const auto* w_data = reinterpret_cast<const typename W::T*>(packed.data_ptr());
  const float* x_data = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  SpinPool::instance().run(packed.size(0), [&](int64_t begin, int64_t end) {
    panel_range<W>(w_data, x_data, m, k_len, out_data, n_out, begin, end);
  });
  return out;
}

}  // namespace dense

// W [N, K] (float32, float16 or bfloat16) in panels: [ceil(N / 16), K, 16], same dtype.
inline torch::Tensor dense_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "weights must be a matrix");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + dense::kPanel - 1) / dense::kPanel;
  auto padded = torch::zeros({panels * dense::kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, dense::kPanel, k}).transpose(1, 2).contiguous();
}

// x [M, K] float32 @ W.T, W packed by dense_pack, N = out_features.
inline torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  switch (packed.scalar_type()) {
    case torch::kFloat16: return dense::product<dense::F16>(x, packed, out_features);
    case torch::kBFloat16: return dense::product<dense::BF16>(x, packed, out_features);
    default: return dense::product<dense::F32>(x, packed, out_features);
  }
}

}  // namespace zerohop
