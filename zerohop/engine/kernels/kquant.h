// K-quant products (q4_k, q5_k, q6_k: zerohop/engine/model/kquant.py has the layouts), never
// widened to another type in memory.
//
// With AVX-512 VNNI, from panels of 16 rows (kquant.py's pack_panels) on 16-bit activations,
// as panel_product.h multiplies q4_1: a pair of columns of 16 rows widens to 32 int16 (the low
// nibble, OR the fifth bit or the top two bits from their planes; q6_k minus 32), and one
// vpdpwssd multiplies it with the activation pair broadcast. Per block of 32 and row, the
// float scale d * sc (and min dmin * m) comes from the uint8 scales and the float16 d: a few
// instructions a block, for 16 rows at once. q6_k's halves of 16 have their own scales, so
// they sum into two integer dots, each scaled by its own.
//
// Elsewhere (or forced, for the tests), a plain float path from the row-major tensors: each
// block's 32 weights as floats, dotted with the float activations in eight lanes.
//
// Either way a row's result is the same at every row count and tile: the blocks are summed in
// order, one fma (two for q6_k, or the min term) a block, whatever rows share the pass.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "int16_rows.h"
#include "panel_product.h"
#include "spin_pool.h"

#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "fp-contract=off")

namespace zerohop::kquant {

constexpr int64_t kBlock = 32, kSuper = 256, kPanel = 16;

// q5_0 and q5_1 (w = d (q - 16), w = d q - dmin, fp16 d and dmin per block of 32) share
// q5_k's planes, with no sub-block scales.
enum class Kind { kQ4K, kQ5K, kQ6K, kQ5_0, kQ5_1 };

// Weights along K per d.
constexpr int64_t span_of(Kind k) { return k == Kind::kQ5_0 || k == Kind::kQ5_1 ? 32 : kSuper; }
constexpr bool has_sums(Kind k) { return k == Kind::kQ4K || k == Kind::kQ5K || k == Kind::kQ5_1; }

inline Kind parse_kind(const std::string& name) {
  if (name == "q4_k") return Kind::kQ4K;
  if (name == "q5_k") return Kind::kQ5K;
  if (name == "q5_0") return Kind::kQ5_0;
  if (name == "q5_1") return Kind::kQ5_1;
  TORCH_CHECK(name == "q6_k", "unknown K-quant kind ", name);
  return Kind::kQ6K;
}

// -- The float path: row-major tensors (qs, high, scales, mins, d, dmin) -------------------

struct Rows {
  Kind kind;
  int64_t cols;
  const uint8_t *qs, *high, *scales, *mins;
  const at::Half *d, *dmin;
};

// Row n's block b as 32 floats.
inline void block_values(const Rows& w, int64_t n, int64_t b, float* out) {
  const int64_t cols = w.cols, span = span_of(w.kind), s = b * kBlock / span;
  const uint8_t* nib = w.qs + n * cols / 2 + b * 16;
  int q[kBlock];
  for (int j = 0; j < 16; ++j) {
    q[j] = nib[j] & 0x0F;
    q[j + 16] = nib[j] >> 4;
  }
  const int64_t first = n * cols + b * kBlock;  // the block's first element in the row-major K
  if (w.kind == Kind::kQ5K || w.kind == Kind::kQ5_0 || w.kind == Kind::kQ5_1) {
    for (int j = 0; j < kBlock; ++j) {
      const int64_t e = first + j;
      q[j] |= ((w.high[e / 8] >> (e % 8)) & 1) << 4;
    }
  } else if (w.kind == Kind::kQ6K) {
    for (int j = 0; j < kBlock; ++j) {
      const int64_t e = first + j;
      q[j] |= ((w.high[e / 4] >> (2 * (e % 4))) & 3) << 4;
    }
  }
  const float d = static_cast<float>(w.d[n * (cols / span) + s]);
  if (w.kind == Kind::kQ5_0) {
    for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(q[j] - 16);
    return;
  }
  if (w.kind == Kind::kQ5_1) {
    const float dmin = static_cast<float>(w.dmin[n * (cols / span) + s]);
    for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(q[j]) - dmin;
    return;
  }
  if (w.kind == Kind::kQ6K) {
    const auto* sc = reinterpret_cast<const int8_t*>(w.scales) + n * (cols / 16) + 2 * b;
    const float lo = d * static_cast<float>(sc[0]), hi = d * static_cast<float>(sc[1]);
    for (int j = 0; j < kBlock; ++j) out[j] = (j < 16 ? lo : hi) * static_cast<float>(q[j] - 32);
    return;
  }
  const int64_t at = n * (cols / kBlock) + b;
  const float scale = d * static_cast<float>(w.scales[at]);
  const float offset = static_cast<float>(w.dmin[n * (cols / kSuper) + s]) *
                       static_cast<float>(w.mins[at]);
  for (int j = 0; j < kBlock; ++j) out[j] = scale * static_cast<float>(q[j]) - offset;
}

// One block's dot in eight independent lanes (vectorized without reassociating: each lane's
// sum has one order), then the lanes in a fixed tree.
inline float block_dot(const float* w, const float* x) {
  float lanes[8] = {};
  for (int k = 0; k < kBlock; k += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += w[k + l] * x[k + l];
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

inline torch::Tensor rows_linear(const torch::Tensor& x, const Rows& w, int64_t n_out) {
  const int64_t rows = x.size(0), cols = x.size(1), blocks = cols / kBlock;
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xd = x.data_ptr<float>();
  float* od = out.data_ptr<float>();
  SpinPool::instance().run(n_out, [&](int64_t begin, int64_t end) {
    float values[kBlock];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r = 0; r < rows; ++r) od[r * n_out + n] = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        block_values(w, n, b, values);
        for (int64_t r = 0; r < rows; ++r) {
          od[r * n_out + n] += block_dot(values, xd + r * cols + b * kBlock);
        }
      }
    }
  }, kPanel);
  return out;
}

#ifdef ZH_WIDE

// -- The VNNI path: panels ------------------------------------------------------------------

struct Panel {
  const uint8_t *q, *high, *scales, *mins;
  const uint16_t *d, *dmin;
};

// Pairs 2g and 2g + 1 of block b (32 int16 each).
template <Kind K>
inline void widen(const Panel& w, int64_t b, int64_t g, __m512i& first, __m512i& second) {
  const __m512i bytes = _mm512_cvtepu8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (b * 8 + g) * 2 * kPanel)));
  first = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
  second = _mm512_srli_epi16(bytes, 4);
  if constexpr (K == Kind::kQ5K || K == Kind::kQ5_0 || K == Kind::kQ5_1) {
    const __m512i plane = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(w.high + (b * 2 + g / 4) * 2 * kPanel)));
    const __m512i top = _mm512_srl_epi16(plane, _mm_cvtsi32_si128(static_cast<int>(2 * (g % 4))));
    const __m512i fifth = _mm512_and_si512(top, _mm512_set1_epi16(1));
    const __m512i next = _mm512_and_si512(top, _mm512_set1_epi16(2));
    first = _mm512_or_si512(first, _mm512_slli_epi16(fifth, 4));
    second = _mm512_or_si512(second, _mm512_slli_epi16(next, 3));
    if constexpr (K == Kind::kQ5_0) {
      first = _mm512_sub_epi16(first, _mm512_set1_epi16(16));
      second = _mm512_sub_epi16(second, _mm512_set1_epi16(16));
    }
  } else if constexpr (K == Kind::kQ6K) {
    const __m512i plane = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(w.high + (b * 4 + g / 2) * 2 * kPanel)));
    const __m512i top = _mm512_srl_epi16(plane, _mm_cvtsi32_si128(static_cast<int>(4 * (g % 2))));
    const __m512i bias = _mm512_set1_epi16(32);
    first = _mm512_sub_epi16(
        _mm512_or_si512(first, _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi16(3)), 4)),
        bias);
    second = _mm512_sub_epi16(
        _mm512_or_si512(second,
                        _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi16(12)), 2)),
        bias);
  }
}

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 bytes16(const uint8_t* p, bool is_signed) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
}

template <int ROWS, Kind K>
void panel_rows(const Panel& w, const wide::Int16Rows& x, int64_t first_row, float* out,
                int64_t out_stride, __mmask16 valid) {
  constexpr bool kSix = K == Kind::kQ6K;
  const int64_t cols = x.cols, blocks = x.blocks;
  __m512 sum[ROWS];
  for (int r = 0; r < ROWS; ++r) sum[r] = _mm512_setzero_ps();
  const int16_t* xq = x.q.data() + first_row * cols;
  const float* dx = x.scales.data() + first_row * blocks;
  const float* sx = has_sums(K) ? x.sums.data() + first_row * blocks : nullptr;
  constexpr int64_t kPer = span_of(K) / kBlock;  // blocks per d
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[ROWS], dot2[ROWS];
    for (int r = 0; r < ROWS; ++r) dot[r] = dot2[r] = _mm512_setzero_si512();
    for (int64_t g = 0; g < 8; ++g) {
      __m512i first, second;
      widen<K>(w, b, g, first, second);
      for (int r = 0; r < ROWS; ++r) {
        const int16_t* columns = xq + r * cols + b * kBlock + 4 * g;
        __m512i& acc = kSix && g >= 4 ? dot2[r] : dot[r];
        acc = _mm512_dpwssd_epi32(acc, first, panels::broadcast_pair(columns));
        acc = _mm512_dpwssd_epi32(acc, second, panels::broadcast_pair(columns + 2));
      }
    }
    const __m512 d = half16(w.d + (b / kPer) * kPanel);
    if constexpr (K == Kind::kQ5_0 || K == Kind::kQ5_1) {
      for (int r = 0; r < ROWS; ++r) {
        const __m512 dxr = _mm512_set1_ps(dx[r * blocks + b]);
        sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, dxr), sum[r]);
        if constexpr (K == Kind::kQ5_1) {
          const __m512 offset = half16(w.dmin + b * kPanel);
          sum[r] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sx[r * blocks + b]), sum[r]);
        }
      }
    } else if constexpr (kSix) {
      const __m512 lo = _mm512_mul_ps(d, bytes16(w.scales + b * 2 * kPanel, true));
      const __m512 hi = _mm512_mul_ps(d, bytes16(w.scales + b * 2 * kPanel + kPanel, true));
      for (int r = 0; r < ROWS; ++r) {
        const __m512 dxr = _mm512_set1_ps(dx[r * blocks + b]);
        sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(lo, dxr), sum[r]);
        sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2[r]), _mm512_mul_ps(hi, dxr), sum[r]);
      }
    } else {
      const __m512 scale = _mm512_mul_ps(d, bytes16(w.scales + b * kPanel, false));
      const __m512 offset = _mm512_mul_ps(half16(w.dmin + (b / kPer) * kPanel),
                                          bytes16(w.mins + b * kPanel, false));
      for (int r = 0; r < ROWS; ++r) {
        const __m512 dxr = _mm512_set1_ps(dx[r * blocks + b]);
        sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, dxr), sum[r]);
        sum[r] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sx[r * blocks + b]), sum[r]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(out + r * out_stride, valid, sum[r]);
}

template <Kind K>
void panel_tile(const Panel& w, const wide::Int16Rows& x, int64_t first, int64_t rows,
                float* out, int64_t out_stride, __mmask16 valid) {
  switch (rows) {
    case 8: return panel_rows<8, K>(w, x, first, out, out_stride, valid);
    case 7: return panel_rows<7, K>(w, x, first, out, out_stride, valid);
    case 6: return panel_rows<6, K>(w, x, first, out, out_stride, valid);
    case 5: return panel_rows<5, K>(w, x, first, out, out_stride, valid);
    case 4: return panel_rows<4, K>(w, x, first, out, out_stride, valid);
    case 3: return panel_rows<3, K>(w, x, first, out, out_stride, valid);
    case 2: return panel_rows<2, K>(w, x, first, out, out_stride, valid);
    default: return panel_rows<1, K>(w, x, first, out, out_stride, valid);
  }
}

template <Kind K>
torch::Tensor panels_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& t,
                            int64_t out_features) {
  const int64_t rows = x.size(0), cols = x.size(1), blocks = cols / kBlock;
  const int64_t panels = t[0].size(0);
  TORCH_CHECK(t[0].dim() == 4 && t[0].size(1) == blocks && t[0].numel() == panels * blocks * 256,
              "the K-quant panels do not match the input's inner dimension");
  TORCH_CHECK(t[4].numel() == panels * (cols / span_of(K)) * kPanel,
              "the panels' d do not match");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the panels");
  const wide::Int16Rows xq = wide::round_rows(x.data_ptr<float>(), rows, cols, has_sums(K));
  auto out = torch::empty({rows, out_features}, x.options());
  float* out_data = out.data_ptr<float>();
  const auto bytes = [](const torch::Tensor& v) {
    return static_cast<const uint8_t*>(v.data_ptr());
  };
  const auto halves = [](const torch::Tensor& v) {
    return static_cast<const uint16_t*>(v.data_ptr());
  };
  constexpr bool kSubScales = K == Kind::kQ4K || K == Kind::kQ5K || K == Kind::kQ6K;
  const int64_t high_bytes = K == Kind::kQ4K ? 0 : K == Kind::kQ6K ? 128 : 64;
  const int64_t scale_bytes = K == Kind::kQ6K ? 32 : 16;
  const int64_t supers = cols / span_of(K);
  SpinPool::instance().run(panels * kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin / kPanel; p < (end + kPanel - 1) / kPanel; ++p) {
      const Panel w{bytes(t[0]) + p * blocks * 256,
                    high_bytes ? bytes(t[1]) + p * blocks * high_bytes : nullptr,
                    kSubScales ? bytes(t[2]) + p * blocks * scale_bytes : nullptr,
                    K == Kind::kQ4K || K == Kind::kQ5K ? bytes(t[3]) + p * blocks * kPanel
                                                       : nullptr,
                    halves(t[4]) + p * supers * kPanel,
                    has_sums(K) ? halves(t[5]) + p * supers * kPanel : nullptr};
      const int64_t live = std::min(kPanel, out_features - p * kPanel);
      const auto valid = static_cast<__mmask16>((1u << live) - 1);
      for (int64_t row0 = 0; row0 < rows; row0 += panels::kRows) {
        panel_tile<K>(w, xq, row0, std::min(panels::kRows, rows - row0),
                      out_data + row0 * out_features + p * kPanel, out_features, valid);
      }
    }
  }, kPanel);
  return out;
}

#endif  // ZH_WIDE

// x [M, K] float32 against a K-quant weight: kind "q4_k" / "q5_k" / "q6_k" with the six
// row-major tensors (the float path), or "<kind>_panels" with pack_panels' six (AVX-512 VNNI).
inline torch::Tensor linear(const std::string& kind, const torch::Tensor& x,
                            const std::vector<torch::Tensor>& t, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(t.size() == 6, "K-quant weights take six tensors");
  for (const auto& part : t) TORCH_CHECK(part.is_contiguous(), "K-quant tensors are contiguous");
  const std::string suffix = "_panels";
  const bool is_panels = kind.size() > suffix.size() &&
                         kind.compare(kind.size() - suffix.size(), suffix.size(), suffix) == 0;
  const Kind k = parse_kind(is_panels ? kind.substr(0, kind.size() - suffix.size()) : kind);
  TORCH_CHECK(x.size(1) % span_of(k) == 0, "the inner dimension must be a multiple of ",
              span_of(k));
  if (is_panels) {
#ifdef ZH_WIDE
    switch (k) {
      case Kind::kQ4K: return panels_linear<Kind::kQ4K>(x, t, out_features);
      case Kind::kQ5K: return panels_linear<Kind::kQ5K>(x, t, out_features);
      case Kind::kQ6K: return panels_linear<Kind::kQ6K>(x, t, out_features);
      case Kind::kQ5_0: return panels_linear<Kind::kQ5_0>(x, t, out_features);
      case Kind::kQ5_1: return panels_linear<Kind::kQ5_1>(x, t, out_features);
    }
#endif
    TORCH_CHECK(false, "K-quant panels need AVX-512 VNNI");
  }
  const int64_t cols = x.size(1);
  TORCH_CHECK(t[0].dim() == 2 && t[0].size(1) == cols / 2 && t[0].size(0) == out_features,
              "the K-quant weight does not match the input's inner dimension");
  TORCH_CHECK(t[4].scalar_type() == torch::kFloat16, "K-quant d must be float16");
  const auto bytes = [](const torch::Tensor& v) {
    return v.numel() == 0 ? nullptr : static_cast<const uint8_t*>(v.data_ptr());
  };
  const auto halves = [](const torch::Tensor& v) {
    return v.numel() == 0 ? nullptr : static_cast<const at::Half*>(v.data_ptr());
  };
  const Rows w{k, cols, bytes(t[0]), bytes(t[1]), bytes(t[2]), bytes(t[3]), halves(t[4]),
               halves(t[5])};
  return rows_linear(x, w, out_features);
}

}  // namespace zerohop::kquant

#pragma GCC pop_options
