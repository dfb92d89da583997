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

// A q4_1 weight from the row-major nibbles: column k of row `row`.
inline uint8_t nibble(const uint8_t* row_major, int64_t half_cols, int64_t row, int64_t k) {
  const uint8_t byte = row_major[row * half_cols + (k / kBlock) * 16 + (k % kBlock) % 16];
  return (k % kBlock) < 16 ? (byte & 0x0F) : (byte >> 4);
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
  const int64_t rows = qs.size(0), half = qs.size(1), cols = 2 * half, blocks = cols / kBlock;
  TORCH_CHECK(cols % kBlock == 0, "the inner dimension must be a multiple of 32");
  TORCH_CHECK(d.sizes() == m.sizes() && d.size(0) == rows && d.size(1) == blocks &&
                  d.scalar_type() == torch::kFloat32 && m.scalar_type() == torch::kFloat32,
              "scales and mins must be float32 [N, K / 32]");
  const int64_t panels = (rows + kPanel - 1) / kPanel;
  auto packed = torch::zeros({panels, blocks, 8, 2 * kPanel}, qs.options());
  auto dp = torch::zeros({panels, blocks, kPanel}, d.options());
  auto mp = torch::zeros({panels, blocks, kPanel}, d.options());
  const uint8_t* src = qs.data_ptr<uint8_t>();
  const auto dc = d.contiguous(), mc = m.contiguous();
  const float *ds = dc.data_ptr<float>(), *ms = mc.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float *dout = dp.data_ptr<float>(), *mout = mp.data_ptr<float>();
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = out + (p * blocks + b) * kPanelBlockBytes;
      for (int64_t g = 0; g < 8; ++g) {
        for (int64_t t = 0; t < 2 * kPanel; ++t) {
          const int64_t row = p * kPanel + t / 2, k = b * kBlock + 4 * g + t % 2;
          if (row >= rows) continue;
          const uint8_t low = nibble(src, half, row, k), high = nibble(src, half, row, k + 2);
          block[g * 2 * kPanel + t] = static_cast<uint8_t>(low | (high << 4));
        }
      }
      for (int64_t i = 0; i < kPanel && p * kPanel + i < rows; ++i) {
        dout[(p * blocks + b) * kPanel + i] = ds[(p * kPanel + i) * blocks + b];
        mout[(p * blocks + b) * kPanel + i] = ms[(p * kPanel + i) * blocks + b];
      }
    }
  }
  return {packed, dp, mp};
}

// qs [N, K] int8 (q8_0), d [N, K / 32] float32 into panels: qs [P, blocks, 16, 32] int8 (for
// each pair of columns, [row 0 k, row 0 k+1, row 1 k, ..., row 15 k+1]), d [P, blocks, 16].
inline std::tuple<torch::Tensor, torch::Tensor> pack_q8_0(const torch::Tensor& qs,
                                                          const torch::Tensor& d) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kInt8 && qs.is_contiguous(),
              "q8_0 weights must be a contiguous int8 matrix");
  const int64_t rows = qs.size(0), cols = qs.size(1), blocks = cols / kBlock;
  TORCH_CHECK(cols % kBlock == 0, "the inner dimension must be a multiple of 32");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == rows && d.size(1) == blocks &&
                  d.scalar_type() == torch::kFloat32,
              "scales must be float32 [N, K / 32]");
  const int64_t panels = (rows + kPanel - 1) / kPanel;
  auto packed = torch::zeros({panels, blocks, kPanel, 2 * kPanel}, qs.options());
  auto dp = torch::zeros({panels, blocks, kPanel}, d.options());
  const int8_t* src = qs.data_ptr<int8_t>();
  const auto dc = d.contiguous();
  const float* ds = dc.data_ptr<float>();
  int8_t* out = packed.data_ptr<int8_t>();
  float* dout = dp.data_ptr<float>();
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t b = 0; b < blocks; ++b) {
      int8_t* block = out + (p * blocks + b) * kPanel * 2 * kPanel;
      for (int64_t i = 0; i < kPanel && p * kPanel + i < rows; ++i) {
        const int8_t* row = src + (p * kPanel + i) * cols + b * kBlock;
        for (int64_t j = 0; j < 16; ++j) {
          block[j * 2 * kPanel + 2 * i] = row[2 * j];
          block[j * 2 * kPanel + 2 * i + 1] = row[2 * j + 1];
        }
        dout[(p * blocks + b) * kPanel + i] = ds[(p * kPanel + i) * blocks + b];
      }
    }
  }
  return {packed, dp};
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
