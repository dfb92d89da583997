// Matrix products straight from block-quantized weights, three ways. Weights are never
// dequantized in memory.
//   16-bit activations (the default with AVX-512 VNNI, panel_product.h): each block of 32
//     activations rounded to int16 with its own scale (int16_rows.h), multiplied exactly in
//     integers with weights packed in panels of 16 rows; within ~2e-5 of the float product,
//     1.4x the float path's rate at one row and 2-3x at 8-128 on SmolLM2's shapes. Here the
//     weights are packed per call; the engine packs them once (q4_1_pack, q8_0_pack).
//   float activations (the default elsewhere): each block of 32 weights is expanded to
//     float32 in registers and multiplied with float32 activations, for up to eight
//     activation rows at a time; equal to a float32 product with the dequantized weights up
//     to summation order.
//   int8 activations (opt-in, with AVX2, decode rows, row by row, see by_rows): the
//     activations are rounded to int8 per block of 32 as llama.cpp does (q8_0, with block
//     sums for q4_1) and multiplied in integers; within about 1% of the float product.
// Either default computes each row alone, in one summation order whatever rows share its
// product, and treats decode and prompt rows alike.
//
//   q8_0: w = d * q,      q int8, one d per block of 32
//   q4_1: w = d * q + m,  q in 0..15 (two per byte: element j low nibble, j + 16 high), d, m
//
// x: [M, K] float32, output [M, N] float32. K is a multiple of 32. The rows of x go in tiles
// of up to eight, each tile in L1 while the weight rows of a chunk stream past.

#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "bf16_gemm.h"
#include "decode_step.h"
#include "dense_gemm.h"
#include "kquant.h"
#include "pointwise.h"
#include "spin_pool.h"
#include "token_mask.h"
#include "panel_product.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ZH_AVX2 1
#endif

// The quantized products sum in the order written: with -ffast-math's reassociation and
// contraction GCC summed a row's blocks differently by tile size (a row alone and the same
// row among 2-4 differed in the last bits, and a speculative step's greedy output on the
// default model drifted from the plain decode's after ~40 tokens).
#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "fp-contract=off")

namespace {

namespace panels = zerohop::panels;

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 8;  // activation rows sharing one expansion of a weight block
constexpr int64_t kIntRowTile = 4;  // the same for int8 activations (see int_dot_tile)
// Threads' ranges of weight rows start on multiples of 16: their output columns then share no
// cache line (64 bytes) where out_features is a multiple of 16.
constexpr int64_t kOutputAlign = 16;

struct Q8Row {
  const int8_t* q;
  const float* d;
};

struct Q4Row {
  const uint8_t* q;
  const float* d;
  const float* m;
};

// The same q4_1 row, its nibbles unpacked with variable shifts into a permuted order (the
// activations are permuted to match): 15-20% faster than byte shuffles at one to three
// activation rows; the float path uses it at every row count, so that a row's lanes sum the
// same elements whatever its tile.
struct Q4ShiftRow : Q4Row {};

#ifdef ZH_AVX2
using Block = __m256[4];

// Blocks are expanded unscaled (q as float); each row's block sum is scaled by d once.
inline void expand(const Q8Row& row, int64_t b, Block& w) {
  const int8_t* q = row.q + b * kBlock;
  for (int k = 0; k < 4; ++k) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k));
    w[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}

// Vector k holds byte k of each of the block's four 32-bit words: low nibbles in lanes 0-3,
// high nibbles in lanes 4-7 (see permute_for_shifts).
inline void expand(const Q4ShiftRow& row, int64_t b, Block& w) {
  const __m256i packed = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.q + b * 16)));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m256i shift = _mm256_setr_epi32(8 * k, 8 * k, 8 * k, 8 * k, 8 * k + 4, 8 * k + 4,
                                            8 * k + 4, 8 * k + 4);
    w[k] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(packed, shift), mask));
  }
}

inline float horizontal_sum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// sum_b m_b * sums_b: q4_1's min term, from the activation row's block sums, since
// sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j.
inline float min_term(const float* m, const float* sums, int64_t blocks) {
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= blocks; i += 8)
    total = _mm256_fmadd_ps(_mm256_loadu_ps(m + i), _mm256_loadu_ps(sums + i), total);
  float rest = horizontal_sum(total);
  for (; i < blocks; ++i) rest += m[i] * sums[i];
  return rest;
}

// ROWS activation rows against one weight row, every row summed the same way whatever ROWS
// is: per block, the eight-lane partial w . x (unscaled q), scaled by d into the row's one
// running sum; q4_1's min term from the row's block sums at the end. So a row's result is a
// function of that row alone: one row decoding, the same row in a tile of a batch, or a prompt
// row in any chunk (a single sum chain per row costs nothing here: the expansion and the
// loads take longer than the chain's latency).
template <int ROWS, typename Row>
void dot_rows(const Row& row, int64_t blocks, const float* x, const float* sums, int64_t cols,
              float* out) {
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    Block w;
    expand(row, b, w);
    const __m256 d = _mm256_set1_ps(row.d[b]);
    for (int r = 0; r < ROWS; ++r) {
      const float* xb = x + r * cols + b * kBlock;
      __m256 partial = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
      for (int k = 1; k < 4; ++k) {
        partial = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xb + 8 * k), partial);
      }
      acc[r] = _mm256_fmadd_ps(partial, d, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    out[r] = horizontal_sum(acc[r]);
    if constexpr (std::is_base_of_v<Q4Row, Row>) {
      out[r] += min_term(row.m, sums + r * blocks, blocks);
    }
  }
}

template <typename Row>
void dot_tile(const Row& row, int64_t blocks, const float* x, const float* sums, int64_t cols,
              int64_t rows, float* out) {
  switch (rows) {
    case 8: return dot_rows<8>(row, blocks, x, sums, cols, out);
    case 7: return dot_rows<7>(row, blocks, x, sums, cols, out);
    case 6: return dot_rows<6>(row, blocks, x, sums, cols, out);
    case 5: return dot_rows<5>(row, blocks, x, sums, cols, out);
    case 4: return dot_rows<4>(row, blocks, x, sums, cols, out);
    case 3: return dot_rows<3>(row, blocks, x, sums, cols, out);
    case 2: return dot_rows<2>(row, blocks, x, sums, cols, out);
    default: return dot_rows<1>(row, blocks, x, sums, cols, out);
  }
}

// -- Integer dot products (llama.cpp's way) ------------------------------------------------
// Each block of 32 activations is rounded to int8 with its own scale (q8_0: x ~= dx * qx,
// dx = max |x| / 127) and multiplied with the weights' integers: unsigned x signed bytes
// summed in pairs (maddubs), then in fours (madd), one float multiply-add per block with
// dw * dx. For q4_1 the activations also keep dx * sum qx per block (llama.cpp's q8_1), and
// sum_j (dw q_j + m) x_j ~= dw dx sum_j q_j qx_j + m dx sum_j qx_j. Rounded sums rather than
// exact ones: the rounding errors then meet the weights w_j themselves, not w_j - m (all of
// one sign), which measured 2-3x the relative error on Q4_0 and Q4_1 weights.

// Activation rows rounded to int8 per block: q [rows, K], d and (for q4_1) d * sum q
// [rows, K / 32].
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
};

inline float horizontal_max(__m256 v) {
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// One block of 32 floats to int8, as llama.cpp's quantize_row_q8_0 rounds it (to nearest).
inline void quantize_block(const float* x, int8_t* q, float* d, float* sum) {
  __m256 v[4];
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign_bit, v[k]));
  }
  const float amax = horizontal_max(top);
  *d = amax / 127.0f;
  const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
  if (sum != nullptr) {
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]),
                                           _mm256_add_epi32(i[2], i[3]));
    *sum = *d * horizontal_sum(_mm256_cvtepi32_ps(total));
  }
  // The packs interleave 128-bit lanes; the permute puts the 32 bytes back in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                            _mm256_packs_epi32(i[2], i[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, order));
}

Int8Rows quantize_rows(const float* x, int64_t rows, int64_t cols, bool with_sums) {
  const int64_t blocks = rows * (cols / kBlock);
  Int8Rows out{std::vector<int8_t>(rows * cols), std::vector<float>(blocks),
               std::vector<float>(with_sums ? blocks : 0)};
  for (int64_t b = 0; b < blocks; ++b) {
    quantize_block(x + b * kBlock, out.q.data() + b * kBlock, out.d.data() + b,
                   with_sums ? out.sums.data() + b : nullptr);
  }
  return out;
}

// A weight block's 32 integers in element order: signed for q8_0, 0..15 for q4_1.
inline __m256i int_block(const Q8Row& row, int64_t b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.q + b * kBlock));
}

inline __m256i int_block(const Q4Row& row, int64_t b) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.q + b * 16));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm256_set_m128i(high, low);
}

// maddubs multiplies unsigned by signed bytes: q8_0 weights give their magnitude, and their
// sign moves to the activations. Pair sums stay within int16: 2 * 128 * 127 < 32768.
inline __m256i unsigned_part(const Q8Row&, __m256i w) { return _mm256_sign_epi8(w, w); }
inline __m256i unsigned_part(const Q4Row&, __m256i w) { return w; }
inline __m256i signed_part(const Q8Row&, __m256i w, __m256i x) { return _mm256_sign_epi8(x, w); }
inline __m256i signed_part(const Q4Row&, __m256i, __m256i x) { return x; }

// Eight int32 partial sums of w . x over one block: one instruction with AVX-VNNI (or
// AVX512-VNNI's 256-bit form), else the int16 pair sums widened.
inline __m256i block_dot(__m256i unsigned_w, __m256i signed_x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), unsigned_w, signed_x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), unsigned_w, signed_x);
#else
  const __m256i pairs = _mm256_maddubs_epi16(unsigned_w, signed_x);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// ROWS quantized activation rows (from row `first` of xq) against one weight row, ACC
// independent sums per row.
template <int ROWS, int ACC, typename Row>
void int_dot_rows(const Row& row, int64_t blocks, const Int8Rows& xq, int64_t first,
                  float* out) {
  const int64_t cols = blocks * kBlock;
  __m256 acc[ROWS][ACC];
  for (int r = 0; r < ROWS; ++r)
    for (int a = 0; a < ACC; ++a) acc[r][a] = _mm256_setzero_ps();
  const int8_t* x = xq.q.data() + first * cols;
  const float* dx = xq.d.data() + first * blocks;
  auto step = [&](int64_t b, int a) {
    const __m256i w = int_block(row, b);
    const __m256i uw = unsigned_part(row, w);
    for (int r = 0; r < ROWS; ++r) {
      const __m256i xb =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * cols + b * kBlock));
      const __m256 dot = _mm256_cvtepi32_ps(block_dot(uw, signed_part(row, w, xb)));
      acc[r][a] = _mm256_fmadd_ps(dot, _mm256_set1_ps(row.d[b] * dx[r * blocks + b]), acc[r][a]);
    }
  };
  int64_t b = 0;
  for (; b + ACC <= blocks; b += ACC)
    for (int a = 0; a < ACC; ++a) step(b + a, a);
  for (; b < blocks; ++b) step(b, 0);
  for (int r = 0; r < ROWS; ++r) {
    __m256 total = acc[r][0];
    for (int a = 1; a < ACC; ++a) total = _mm256_add_ps(total, acc[r][a]);
    out[r] = horizontal_sum(total);
    if constexpr (std::is_same_v<Row, Q4Row>) {
      out[r] += min_term(row.m, xq.sums.data() + (first + r) * blocks, blocks);
    }
  }
}

// Every tile size sums a row's blocks in the same order (four interleaved sums: one row alone
// needs four chains to keep the FMA units busy), so a row's result is the same whatever tile
// it falls in: one row alone, a speculative step's 1 + N, a batch of other requests. The
// price, measured on SmolLM2 Q4_1 at 2 threads: 0.83x the float path's time at one row, but
// 1.1-1.2x at 4-32 rows, where eight-row tiles with one sum each were level with it.
template <typename Row>
void int_dot_tile(const Row& row, int64_t blocks, const Int8Rows& xq, int64_t first,
                  int64_t rows, float* out) {
  switch (rows) {
    case 4: return int_dot_rows<4, 4>(row, blocks, xq, first, out);
    case 3: return int_dot_rows<3, 4>(row, blocks, xq, first, out);
    case 2: return int_dot_rows<2, 4>(row, blocks, xq, first, out);
    default: return int_dot_rows<1, 4>(row, blocks, xq, first, out);
  }
}
#else
inline float weight_at(const Q8Row& row, int64_t i) { return row.d[i / kBlock] * row.q[i]; }

inline float weight_at(const Q4Row& row, int64_t i) {
  const int64_t b = i / kBlock, j = i % kBlock;
  const uint8_t byte = row.q[b * 16 + j % 16];
  const int q = j < 16 ? (byte & 0x0F) : (byte >> 4);
  return row.d[b] * q + row.m[b];
}

template <typename Row>
void dot_tile(const Row& row, int64_t blocks, const float* x, const float* /*sums*/, int64_t cols,
              int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float total = 0.0f;
    for (int64_t i = 0; i < blocks * kBlock; ++i) total += weight_at(row, i) * x[r * cols + i];
    out[r] = total;
  }
}
#endif

// x [M, K] against weight rows of `packed_cols` elements each (K, or K / 2 for nibbles).
void check_weight_rows(const torch::Tensor& x, const torch::Tensor& qs, int64_t packed_cols) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(1) % kBlock == 0, "the inner dimension must be a multiple of 32");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == packed_cols,
              "weight blocks do not match the input's inner dimension");
}

void check_args(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                int64_t packed_cols) {
  check_weight_rows(x, qs, packed_cols);
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() &&
                  d.size(0) == qs.size(0) && d.size(1) == x.size(1) / kBlock,
              "scales must be float32 [N, K / 32]");
}

// Each block of x in the order expand(Q4ShiftRow) produces weights: position 8k + l holds
// element 4l + k for l < 4 and 16 + 4(l - 4) + k for l >= 4.
std::vector<float> permute_for_shifts(const float* x, int64_t rows, int64_t cols) {
  std::vector<float> out(rows * cols);
  for (int64_t base = 0; base < rows * cols; base += kBlock) {
    for (int k = 0; k < 4; ++k) {
      for (int l = 0; l < 8; ++l) {
        out[base + 8 * k + l] = x[base + (l < 4 ? 4 * l + k : 16 + 4 * (l - 4) + k)];
      }
    }
  }
  return out;
}

// Each row's sums over blocks of 32: [rows, blocks].
std::vector<float> block_sums(const float* x, int64_t rows, int64_t cols) {
  std::vector<float> sums(rows * (cols / kBlock));
  for (int64_t i = 0; i < static_cast<int64_t>(sums.size()); ++i) {
    float total = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) total += x[i * kBlock + j];
    sums[i] = total;
  }
  return sums;
}

// Parallel over weight rows. For each tile of activation rows (kept in L1), every weight row
// of a chunk streams past once.
template <typename RowAt>
torch::Tensor blocked_product(const torch::Tensor& x, int64_t out_features, RowAt row_at) {
  const int64_t rows = x.size(0), cols = x.size(1), blocks = cols / kBlock;
  auto out = torch::empty({rows, out_features}, x.options());
  const float* x_data = x.data_ptr<float>();
  using Row = decltype(row_at(0));
  constexpr bool q4 = std::is_base_of_v<Q4Row, Row>;
  const std::vector<float> sums = q4 ? block_sums(x_data, rows, cols) : std::vector<float>();
#ifdef ZH_AVX2
  constexpr bool shifts = std::is_same_v<Row, Q4ShiftRow>;
  const std::vector<float> permuted =
      shifts ? permute_for_shifts(x_data, rows, cols) : std::vector<float>();
  if (shifts) x_data = permuted.data();
#endif
  float* out_data = out.data_ptr<float>();
  // A tile of x stays within L1 (32 KiB): eight rows of up to 768 floats, else four.
  const int64_t row_tile = cols <= 768 ? kRowTile : kRowTile / 2;
  zerohop::SpinPool::instance().run(out_features, [&](int64_t begin, int64_t end) {
    float tile[kRowTile];
    for (int64_t row0 = 0; row0 < rows; row0 += row_tile) {
      const int64_t tile_rows = std::min(row_tile, rows - row0);
      for (int64_t n = begin; n < end; ++n) {
        dot_tile(row_at(n), blocks, x_data + row0 * cols,
                 sums.empty() ? nullptr : sums.data() + row0 * blocks, cols, tile_rows, tile);
        for (int64_t r = 0; r < tile_rows; ++r) out_data[(row0 + r) * out_features + n] = tile[r];
      }
    }
  }, kOutputAlign);
  return out;
}

#ifdef ZH_AVX2
// The same loop as blocked_product over activations rounded to int8 per block (quantized
// once per call, by the caller).
template <typename RowAt>
torch::Tensor integer_product(const torch::Tensor& x, int64_t out_features, RowAt row_at) {
  const int64_t rows = x.size(0), cols = x.size(1), blocks = cols / kBlock;
  using Row = decltype(row_at(0));
  const Int8Rows xq = quantize_rows(x.data_ptr<float>(), rows, cols, std::is_same_v<Row, Q4Row>);
  auto out = torch::empty({rows, out_features}, x.options());
  float* out_data = out.data_ptr<float>();
  zerohop::SpinPool::instance().run(out_features, [&](int64_t begin, int64_t end) {
    float tile[kIntRowTile];
    for (int64_t row0 = 0; row0 < rows; row0 += kIntRowTile) {
      const int64_t tile_rows = std::min(kIntRowTile, rows - row0);
      for (int64_t n = begin; n < end; ++n) {
        int_dot_tile(row_at(n), blocks, xq, row0, tile_rows, tile);
        for (int64_t r = 0; r < tile_rows; ++r) out_data[(row0 + r) * out_features + n] = tile[r];
      }
    }
  }, kOutputAlign);
  return out;
}
#endif

// Whether q8_0 and q4_1 products round decode rows' activations to int8 (see
// integer_product); off (the default), every row multiplies float32 activations, exact up to
// summation order. Off because a position must compute the same whether it is decoded or
// prefilled (a prompt, a continuation replayed after a failover), and prompt rows rounded to
// int8 change what the model reads of the prompt. Only with AVX2.
std::atomic<bool> integer_dots{false};

// Rows with outliers (largest |x| above 50 times the mean |x|: the "massive activations" of
// some channels and tokens, e.g. in the MLP's down projection) keep float32 activations: per
// block, rounding to int8 drops their small entries. Measured on SmolLM2 (greedy agreement
// with float32, teacher-forced): 98.4% rounding every row, 99.4% keeping these.
constexpr float kOutlierRatio = 50.0f;

bool has_outliers(const float* row, int64_t cols) {
  float top = 0.0f, total = 0.0f;
  for (int64_t i = 0; i < cols; ++i) {
    top = std::max(top, std::fabs(row[i]));
    total += std::fabs(row[i]);
  }
  return top * static_cast<float>(cols) > kOutlierRatio * total;
}

torch::Tensor row_index(const std::vector<int64_t>& rows) {
  return torch::tensor(c10::ArrayRef<int64_t>(rows), torch::kLong);
}

// Rows from this index on are prompt rows (the Python pass sets it around a step with
// prefill chunks, decode rows first; -1: every row decodes). Prompt rows keep float32
// activations: rounded to int8, what the model reads of the prompt changes (the README's
// question to the default model got another answer than "Paris").
std::atomic<int64_t> decode_rows{-1};

// int8 activations for decode rows where AVX2 is there (measured on SmolLM2's shapes, AVX2
// without VNNI: 1.0-1.3x the float path at 1-512 rows), decided row by row: a decode row with
// outliers takes the float path, alone. So a decode row's numerics do not depend on how many
// rows share its product (a speculative step's proposals, other requests).
template <typename IntegerProduct, typename FloatProduct>
torch::Tensor by_rows(const torch::Tensor& x, IntegerProduct integer, FloatProduct floating) {
#ifdef ZH_AVX2
  const int64_t rows = x.size(0), cols = x.size(1), limit = decode_rows.load();
  const int64_t decoding = limit < 0 ? rows : std::min(limit, rows);
  if (!integer_dots.load(std::memory_order_relaxed) || decoding == 0) return floating(x);
  const float* data = x.data_ptr<float>();
  std::vector<int64_t> plain, outliers;
  for (int64_t r = 0; r < decoding; ++r) {
    (has_outliers(data + r * cols, cols) ? outliers : plain).push_back(r);
  }
  if (outliers.empty() && decoding == rows) return integer(x);
  torch::Tensor out;
  const auto put = [&](const std::vector<int64_t>& where, const torch::Tensor& part) {
    if (!out.defined()) out = torch::empty({rows, part.size(1)}, x.options());
    out.index_copy_(0, row_index(where), part);
  };
  if (!plain.empty()) put(plain, integer(x.index_select(0, row_index(plain))));
  // Outlier rows one at a time: the float path's tiles sum in an order of their own size.
  for (const int64_t r : outliers) put({r}, floating(x.narrow(0, r, 1).contiguous()));
  if (decoding < rows) {
    std::vector<int64_t> prompt(rows - decoding);
    for (int64_t i = 0; i < rows - decoding; ++i) prompt[i] = decoding + i;
    put(prompt, floating(x.narrow(0, decoding, rows - decoding).contiguous()));
  }
  return out;
#else
  (void)integer;
  return floating(x);
#endif
}

}  // namespace

#pragma GCC pop_options

namespace zerohop {

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  check_args(x, qs, d, x.size(1));
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_0 weights must be int8");
  const int64_t blocks = x.size(1) / kBlock, cols = x.size(1), n = qs.size(0);
  const int8_t* q = qs.data_ptr<int8_t>();
  const float* scales = d.data_ptr<float>();
  const auto row_at = [&](int64_t i) { return Q8Row{q + i * cols, scales + i * blocks}; };
  return by_rows(
      x,
      [&](const torch::Tensor& part) {
#ifdef ZH_AVX2
        return integer_product(part, n, row_at);
#else
        return blocked_product(part, n, row_at);
#endif
      },
      [&](const torch::Tensor& part) {
#ifdef ZH_WIDE
        // Packed per call here; the engine packs its weights once (q8_0_pack).
        const auto [panel_qs, panel_d] = panels::pack_q8_0(qs, d);
        return panels::q8_0_linear(part, panel_qs, panel_d, n);
#else
        return blocked_product(part, n, row_at);
#endif
      });
}

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  check_args(x, qs, d, x.size(1) / 2);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8, "q4_1 weights must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == torch::kFloat32 && m.is_contiguous(),
              "q4_1 mins must match the scales");
  const int64_t blocks = x.size(1) / kBlock, half = x.size(1) / 2, n = qs.size(0);
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* scales = d.data_ptr<float>();
  const float* mins = m.data_ptr<float>();
  const auto row_at = [&](int64_t i) {
    return Q4Row{q + i * half, scales + i * blocks, mins + i * blocks};
  };
  return by_rows(
      x,
      [&](const torch::Tensor& part) {
#ifdef ZH_AVX2
        return integer_product(part, n, row_at);
#else
        return blocked_product(part, n, row_at);
#endif
      },
      [&](const torch::Tensor& part) {
#ifdef ZH_WIDE
        // Packed per call here; the engine packs its weights once (q4_1_pack).
        const auto [panel_qs, panel_d, panel_m] = panels::pack_q4_1(qs, d, m);
        return panels::q4_1_linear(part, panel_qs, panel_d, panel_m, n);
#else
        // One expansion at every row count: the two sum a block's lanes in different orders.
        return blocked_product(part, n, [&](int64_t i) { return Q4ShiftRow{row_at(i)}; });
#endif
      });
}

}  // namespace zerohop

namespace {

bool simd() {
#ifdef ZH_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q8_0_linear", &zerohop::q8_0_linear, "x @ W.T for q8_0 blocks");
  module.def("q4_1_linear", &zerohop::q4_1_linear, "x @ W.T for q4_1 blocks");
  module.def("q4_1_pack", &zerohop::panels::pack_q4_1,
             "q4_1 (qs, d, m) in panels of 16 rows for q4_1_panel_linear");
  module.def("q8_0_pack", &zerohop::panels::pack_q8_0,
             "q8_0 (qs, d) in panels of 16 rows for q8_0_panel_linear");
#ifdef ZH_WIDE
  module.def("q4_1_panel_linear", &zerohop::panels::q4_1_linear,
             "x @ W.T for q4_1 panels (q4_1_pack's), with out_features");
  module.def("q8_0_panel_linear", &zerohop::panels::q8_0_linear,
             "x @ W.T for q8_0 panels (q8_0_pack's), with out_features");
#endif
  module.def("kquant_linear", &zerohop::kquant::linear,
             "x @ W.T for a K-quant kind (q4_k/q5_k/q6_k: six row-major tensors, the float"
             " path) or its _panels (kquant.py's pack_panels; AVX-512 VNNI), with out_features");
  module.def("dense_pack", &zerohop::dense_pack,
             "a float32/float16/bfloat16 W [N, K] in the dense kernel's panels [N / 16, K, 16]");
  module.def("dense_linear", &zerohop::dense_linear,
             "x @ W.T with W packed by dense_pack (float32, float16 or bfloat16)");
  module.def("bf16_pack", &zerohop::bf16_pack,
             "a bfloat16 W [N, K] in the bf16 product's panels [N / 16, K / 2, 16, 2]");
  module.def("bf16_linear", &zerohop::bf16_linear,
             "x @ W.T with W packed by bf16_pack, x rounded to bfloat16 (vdpbf16ps)");
  module.def("bf16_dot", &zerohop::bf16_dot,
             "whether bfloat16 weights can be multiplied with AVX-512 BF16 (bf16_linear)");
  module.def("decode_attention", &zerohop::decode_attention,
             "one query token per sequence over the paged KV cache, into out");
  module.def("prompt_attention", &zerohop::prompt_attention,
             "a prefill chunk's rows over the paged KV cache, each as decode_attention would");
  module.def("write_kv", &zerohop::write_kv, "new tokens' keys and values into cache slots");
  module.def("rms_norm", &zerohop::rms_norm, "RMSNorm, after residual += x when given");
  module.def("rotate", &zerohop::rotate, "rotary embedding in place (rotate_half layout)");
  module.def("silu_mul", &zerohop::silu_mul, "silu(gate) * up of a [T, 2I] gate|up matrix");
  module.def("gelu_mul", &zerohop::gelu_mul, "gelu_tanh(gate) * up of a [T, 2I] gate|up matrix");
  pybind11::class_<zerohop::Product>(module, "Product")
      .def(pybind11::init<const std::string&, std::vector<torch::Tensor>,
                          c10::optional<torch::Tensor>, int64_t>(),
           pybind11::arg("kind"), pybind11::arg("tensors"), pybind11::arg("bias"),
           pybind11::arg("out_features") = 0,
           "a weight matrix: kind dense (dense_pack's panels, with out_features), q8_0 (qs, d)"
           " or q4_1 (qs, d, m), and a bias");
  module.def(
      "stacked_product",
      [](std::vector<zerohop::Product> parts) {
        return zerohop::Product::stacked(std::move(parts));
      },
      "Products that read the same input, their outputs side by side");
  pybind11::class_<zerohop::DecodeStep>(module, "DecodeStep")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor,
                          zerohop::Product>())
      .def("add_layer", &zerohop::DecodeStep::add_layer)
      .def("__call__", &zerohop::DecodeStep::run, "one decode step over every layer");
  module.def("apply_token_bitmask", &zerohop::apply_token_bitmask,
             "set to -inf the logits of tokens a grammar's bitmask does not allow");
  module.def("simd", &simd, "whether the AVX2 paths were compiled in");
  module.def(
      "set_integer_dots", [](bool on) { integer_dots.store(on); },
      "q8_0/q4_1 products on int8-rounded activations (default) or on float32 ones");
  module.def(
      "set_decode_rows", [](int64_t rows) { decode_rows.store(rows); },
      "rows from this index on are prompt rows (float activations); -1: every row decodes");
  module.def(
      "wide",
      [] {
#ifdef ZH_WIDE
        return true;
#else
        return false;
#endif
      },
      "whether q8_0/q4_1 products default to 16-bit activations (AVX-512 VNNI), else float32");
  module.def(
      "integer_dots", [] { return simd() && integer_dots.load(); },
      "whether q8_0/q4_1 products round activations to int8");
  module.def(
      "set_threads", [](int threads) { zerohop::SpinPool::instance().resize(threads); },
      "threads the products run on (the caller's included)");
  module.def(
      "threads", [] { return zerohop::SpinPool::instance().threads(); },
      "threads the products run on");
}
