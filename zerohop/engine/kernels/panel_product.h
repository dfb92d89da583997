// q4_1 and q8_0 products from weights packed in panels of 16 rows, on 16-bit activations
// (AVX-512 VNNI): the default where the CPU has it.
//
// A panel holds 16 weight rows block by block; within a block, each pair of columns (k, k + 1)
// widens to the 32 int16 [row 0 k, row 0 k+1, row 1 k, ..., row 15 k+1] (q8_0: 32 bytes
// sign-extended; q4_1: two pairs' nibbles share 32 bytes, split by a mask and a shift). One
// vpdpwssd then multiplies that with the activation pair (x_k, x_k+1) broadcast, for all 16
// rows at once: 32 products an instruction, the scaling by dw * dx and the min term once per
// block and row, not once per pair of blocks (a row-major kernel spends three float operations
// per two integer ones). Measured on one core: ~90 GMAC/s at eight activation rows, 0.8 of the
// vpdpwssd peak, against ~39 row-major.
//
// A row's result is the same at every row count and tile: each block's integer dot is exact,
// and the float sum adds the blocks in order, fma(dot, dw * dx, sum) then fma(m, dx sum q,
// sum), whatever rows share the panel's pass.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "int16_rows.h"
#include "spin_pool.h"

namespace zerohop::panels {

constexpr int64_t kPanel = 16;  // weight rows a panel holds
constexpr int64_t kBlock = 32;
constexpr int64_t kPanelBlockBytes = kPanel * kBlock / 2;  // 256

// A [N, C] matrix with zero rows added up to whole panels, as [P, 16, C].
inline torch::Tensor by_panel(const torch::Tensor& matrix, int64_t panels) {
  const int64_t missing = panels * kPanel - matrix.size(0);
  return torch::constant_pad_nd(matrix, {0, 0, 0, missing}).view({panels, kPanel, -1});
}

// Scales (or mins) [N, blocks] as the panels hold them: [P, blocks, 16].
inline torch::Tensor panel_scales(const torch::Tensor& scales, int64_t panels) {
  return by_panel(scales, panels).transpose(1, 2).contiguous();
}

// Weights [N, K], one integer each, as [P, blocks, 16 pairs of columns j, 16 rows i, 2]:
// element [.., j, i, t] is row i's column 2j + t of the block (a view, not a copy).
inline torch::Tensor column_pairs(const torch::Tensor& weights, int64_t panels) {
  const int64_t blocks = weights.size(1) / kBlock;
  return by_panel(weights, panels).view({panels, kPanel, blocks, 16, 2}).permute({0, 2, 3, 1, 4});
}

inline void check_scales(const torch::Tensor& d, int64_t rows, int64_t blocks,
                         const char* name) {
  TORCH_CHECK(d.dim() == 2 && d.size(0) == rows && d.size(1) == blocks &&
                  d.scalar_type() == torch::kFloat32,
              name, " must be float32 [N, K / 32]");
}

// qs [N, K / 2] uint8 (q4_1 nibbles), d, m [N, K / 32] float32 into panels: qs [P, blocks,
// 8, 32] uint8, d and m [P, blocks, 16] float32, P = ceil(N / 16) (missing rows zero). The 32
// bytes of group g hold the pairs of columns 2g (low nibbles) and 2g + 1 (high nibbles), byte
// t the weight of row t / 2 at column k + t % 2 of its pair k: one load widens to both pairs'
// vectors with a mask and a shift.
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> pack_q4_1(
    const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kUInt8 && qs.is_contiguous(),
              "q4_1 weights must be a contiguous uint8 matrix");
  const int64_t rows = qs.size(0), blocks = 2 * qs.size(1) / kBlock;
  TORCH_CHECK(qs.size(1) % (kBlock / 2) == 0, "the inner dimension must be a multiple of 32");
  check_scales(d, rows, blocks, "scales");
  check_scales(m, rows, blocks, "mins");
  const int64_t panels = (rows + kPanel - 1) / kPanel;
  // Nibbles to one value a column (element j low, j + 16 high in each block's 16 bytes).
  const auto packed = qs.view({rows, blocks, 16});
  const auto values = torch::cat({packed.bitwise_and(0x0F), packed.bitwise_right_shift(4)}, 2);
  const auto pairs = column_pairs(values.view({rows, -1}), panels)
                         .reshape({panels, blocks, 8, 2, kPanel, 2});
  const auto bytes = pairs.select(3, 0).bitwise_or(pairs.select(3, 1).bitwise_left_shift(4));
  return {bytes.contiguous().view({panels, blocks, 8, 2 * kPanel}), panel_scales(d, panels),
          panel_scales(m, panels)};
}

// qs [N, K] int8 (q8_0), d [N, K / 32] float32 into panels: qs [P, blocks, 16, 32] int8 (for
// each pair of columns, [row 0 k, row 0 k+1, row 1 k, ..., row 15 k+1]), d [P, blocks, 16].
inline std::tuple<torch::Tensor, torch::Tensor> pack_q8_0(const torch::Tensor& qs,
                                                          const torch::Tensor& d) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kInt8 && qs.is_contiguous(),
              "q8_0 weights must be a contiguous int8 matrix");
  const int64_t rows = qs.size(0), blocks = qs.size(1) / kBlock;
  TORCH_CHECK(qs.size(1) % kBlock == 0, "the inner dimension must be a multiple of 32");
  check_scales(d, rows, blocks, "scales");
  const int64_t panels = (rows + kPanel - 1) / kPanel;
  const auto pairs = column_pairs(qs, panels).contiguous();
  return {pairs.view({panels, blocks, kPanel, 2 * kPanel}), panel_scales(d, panels)};
}

#ifdef ZH_WIDE

// How each kind's panel widens pairs 2g and 2g + 1 of a block to 32 int16 each, and whether
// it has mins.
struct Q4_1Panel {
  static constexpr bool kMins = true;
  static constexpr int64_t kBlockBytes = kPanelBlockBytes;
  static void widen(const uint8_t* block, int64_t g, __m512i& first, __m512i& second) {
    const __m512i bytes = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + g * 2 * kPanel)));
    first = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
    second = _mm512_srli_epi16(bytes, 4);
  }
};

struct Q8_0Panel {
  static constexpr bool kMins = false;
  static constexpr int64_t kBlockBytes = kPanel * kBlock;
  static void widen(const uint8_t* block, int64_t g, __m512i& first, __m512i& second) {
    const uint8_t* pairs = block + g * 4 * kPanel;
    first = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs)));
    second = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 2 * kPanel)));
  }
};

// Two int16 activations (a pair of columns) in every 32-bit lane: one load the compiler folds
// into vpdpwssd's broadcast operand.
inline __m512i broadcast_pair(const int16_t* columns) {
  int32_t pair;
  std::memcpy(&pair, columns, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

constexpr int64_t kRows = 8;  // activation rows sharing each widened pair of columns

// ROWS activation rows of x (natural order) against one panel: 16 outputs a row, stored to
// out[r * out_stride + 0..15] (masked to `valid` outputs).
template <int ROWS, typename Kind>
void panel_rows(const uint8_t* q, const float* d, const float* m, const wide::Int16Rows& x,
                int64_t first, float* out, int64_t out_stride, __mmask16 valid) {
  const int64_t cols = x.cols, blocks = x.blocks;
  __m512 sum[ROWS];
  for (int r = 0; r < ROWS; ++r) sum[r] = _mm512_setzero_ps();
  const int16_t* xq = x.q.data() + first * cols;
  const float* dx = x.scales.data() + first * blocks;
  const float* sx = Kind::kMins ? x.sums.data() + first * blocks : nullptr;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[ROWS];
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_si512();
    const uint8_t* qb = q + b * Kind::kBlockBytes;
    for (int64_t g = 0; g < 8; ++g) {
      __m512i first, second;
      Kind::widen(qb, g, first, second);
      for (int r = 0; r < ROWS; ++r) {
        const int16_t* columns = xq + r * cols + b * kBlock + 4 * g;
        dot[r] = _mm512_dpwssd_epi32(dot[r], first, broadcast_pair(columns));
        dot[r] = _mm512_dpwssd_epi32(dot[r], second, broadcast_pair(columns + 2));
      }
    }
    const __m512 dw = _mm512_loadu_ps(d + b * kPanel);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * blocks + b]));
      sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, sum[r]);
      if constexpr (Kind::kMins) {
        const __m512 mw = _mm512_loadu_ps(m + b * kPanel);
        sum[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * blocks + b]), sum[r]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(out + r * out_stride, valid, sum[r]);
}

template <typename Kind>
void panel_tile(const uint8_t* q, const float* d, const float* m, const wide::Int16Rows& x,
                int64_t first, int64_t rows, float* out, int64_t out_stride, __mmask16 valid) {
  switch (rows) {
    case 8: return panel_rows<8, Kind>(q, d, m, x, first, out, out_stride, valid);
    case 7: return panel_rows<7, Kind>(q, d, m, x, first, out, out_stride, valid);
    case 6: return panel_rows<6, Kind>(q, d, m, x, first, out, out_stride, valid);
    case 5: return panel_rows<5, Kind>(q, d, m, x, first, out, out_stride, valid);
    case 4: return panel_rows<4, Kind>(q, d, m, x, first, out, out_stride, valid);
    case 3: return panel_rows<3, Kind>(q, d, m, x, first, out, out_stride, valid);
    case 2: return panel_rows<2, Kind>(q, d, m, x, first, out, out_stride, valid);
    default: return panel_rows<1, Kind>(q, d, m, x, first, out, out_stride, valid);
  }
}

// x [M, K] float32 against a kind's panels (qs, d, and m for q4_1), [M, out_features]
// float32. Threads split the panels; each panel stays in L1 while every tile of activation
// rows takes it.
template <typename Kind>
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& qs,
                           const torch::Tensor& d, const float* m, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  const int64_t rows = x.size(0), cols = x.size(1), blocks = cols / kBlock;
  TORCH_CHECK(cols % kBlock == 0, "the inner dimension must be a multiple of 32");
  TORCH_CHECK(qs.dim() == 4 && qs.size(1) == blocks &&
                  qs.size(2) * qs.size(3) == Kind::kBlockBytes && qs.is_contiguous(),
              "the panels do not match the input's inner dimension");
  const int64_t panels = qs.size(0);
  TORCH_CHECK(d.numel() == panels * blocks * kPanel && d.is_contiguous(),
              "the panels' scales do not match them");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the panels");
  const wide::Int16Rows xq =
      wide::round_rows(x.data_ptr<float>(), rows, cols, Kind::kMins);
  auto out = torch::empty({rows, out_features}, x.options());
  float* out_data = out.data_ptr<float>();
  const auto* q = static_cast<const uint8_t*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  SpinPool::instance().run(panels * kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin / kPanel; p < (end + kPanel - 1) / kPanel; ++p) {
      const int64_t live = std::min(kPanel, out_features - p * kPanel);
      const auto valid = static_cast<__mmask16>((1u << live) - 1);
      for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
        panel_tile<Kind>(q + p * blocks * Kind::kBlockBytes, dp + p * blocks * kPanel,
                         m == nullptr ? nullptr : m + p * blocks * kPanel, xq, row0,
                         std::min(kRows, rows - row0),
                         out_data + row0 * out_features + p * kPanel, out_features, valid);
      }
    }
  }, kPanel);
  return out;
}

inline torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& qs,
                                 const torch::Tensor& d, const torch::Tensor& m,
                                 int64_t out_features) {
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && m.sizes() == d.sizes() && m.is_contiguous(),
              "q4_1 panels are uint8, with mins beside their scales");
  return panel_linear<Q4_1Panel>(x, qs, d, m.data_ptr<float>(), out_features);
}

inline torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& qs,
                                 const torch::Tensor& d, int64_t out_features) {
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_0 panels are int8");
  return panel_linear<Q8_0Panel>(x, qs, d, nullptr, out_features);
}

#endif  // ZH_WIDE

}  // namespace zerohop::panels
