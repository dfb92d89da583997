// The paged KV cache's CPU operations: writing new tokens' keys and values into their slots,
// decode attention (one query token per sequence) reading keys and values in place from the
// slots, with no gathered copy, and prompt attention, which gives each row of a prefill chunk
// exactly the decode arithmetic over the keys up to its position (so a position computes the
// same decoded, prefilled in any chunking, or replayed). Parallel over (row, KV head) pairs
// (with AVX2: the query heads sharing a KV head go together, reading its keys and values
// once), so even one sequence uses every thread. Prompt rows go in tiles of consecutive rows
// that share each pass over the keys and values (each row's arithmetic unchanged): a row at
// a time re-read the whole context per row, which made a 2,000-token prefill 1.37x slower.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "spin_pool.h"
#include "vec_math.h"

namespace zerohop {

// [T, heads, D] with each token's heads contiguous; tokens may be strided (views of qkv).
inline void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat32 && t.stride(2) == 1 &&
                  t.stride(1) == t.size(2),
              name, " must be float32 [T, heads, D] with each token's heads contiguous");
}

inline void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              "k/v caches must be contiguous float32 [slots, Hkv, D] tensors");
}

// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t].
inline void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor slots) {
  check_heads(k, "k");
  check_heads(v, "v");
  check_cache(k_cache, v_cache);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) &&
                  k.size(2) == k_cache.size(2),
              "k and v must match the cache's [Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() &&
                  slots.numel() == k.size(0),
              "slots must be int64 [T]");
  const int64_t tokens = k.size(0), width = k.size(1) * k.size(2), num_slots = k_cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "cache slot out of range");
    std::memcpy(kc + slot[t] * width, kd + t * k.stride(0), width * sizeof(float));
    std::memcpy(vc + slot[t] * width, vd + t * v.stride(0), width * sizeof(float));
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

// One query head of one sequence: out = softmax(scale * q K^T) V over `len` cached keys.
// `scores` has room for len floats.
inline void attend(const float* q, const float* keys, const float* values, const int64_t* slots,
                   int64_t len, int64_t slot_stride, int64_t dim, float scale, float* scores,
                   float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) {
    scores[t] = dot(q, keys + slots[t] * slot_stride, dim) * scale;
    top = std::max(top, scores[t]);
  }
  const float total = len ? exp_shifted(scores, len, top) : 0.0f;
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  std::fill(out, out + dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const float* value = values + slots[t] * slot_stride;
    const float p = scores[t] * inv;
    for (int64_t i = 0; i < dim; ++i) out[i] += p * value[i];
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The scores of the `group` query heads (q: group x dim, contiguous) for the keys of the
// four-key blocks in [from, to) (both multiples of 4 from key 0), each `scale`d, into
// scores[g * stride + t]. A key's score is the same whatever block range computes it.
inline void block_scores(const float* q, const float* keys, const int64_t* slots, int64_t from,
                         int64_t to, int64_t slot_stride, int64_t dim, int64_t group, float scale,
                         float* scores, int64_t stride) {
  for (int64_t t = from; t + 4 <= to; t += 4) {  // one horizontal sum for four scores
    const float* k0 = keys + slots[t] * slot_stride;
    const float* k1 = keys + slots[t + 1] * slot_stride;
    const float* k2 = keys + slots[t + 2] * slot_stride;
    const float* k3 = keys + slots[t + 3] * slot_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
      }
      const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 four = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
      _mm_storeu_ps(scores + g * stride + t, _mm_mul_ps(four, _mm_set1_ps(scale)));
    }
  }
}

// A row's scores over its `len` keys: the four-key blocks from `from` (a multiple of 4; the
// blocks before it computed already), then the keys after the last whole block one by one;
// then each head's scores exponentiated and its normalizer in weight[g].
inline void row_scores(const float* q, const float* keys, const int64_t* slots, int64_t from,
                       int64_t len, int64_t slot_stride, int64_t dim, int64_t group, float scale,
                       float* scores, float* weight) {
  block_scores(q, keys, slots, from, len, slot_stride, dim, group, scale, scores, len);
  for (int64_t t = len / 4 * 4; t < len; ++t) {
    const float* key = keys + slots[t] * slot_stride;
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(q + g * dim, key, dim) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    const float top = *std::max_element(sg, sg + len);
    const float total = exp_shifted(sg, len, top);
    weight[g] = total > 0.0f ? 1.0f / total : 0.0f;
  }
}

// acc[0..63] += p[t] * values[t][i0 .. i0 + 63] for t in [from, to), in t's order.
inline void add_values64(const float* p, const float* values, const int64_t* slots, int64_t from,
                         int64_t to, int64_t slot_stride, int64_t i0, float* acc_out) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_loadu_ps(acc_out + 8 * j);
  for (int64_t t = from; t < to; ++t) {
    const float* value = values + slots[t] * slot_stride + i0;
    const __m256 pt = _mm256_set1_ps(p[t]);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(value + 8 * j), acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc_out + 8 * j, acc[j]);
}

// out[0..63] = acc[0..63] * norm.
inline void scale64(const float* acc, float norm, float* out) {
  const __m256 n = _mm256_set1_ps(norm);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), n));
}

// The `group` query heads that share one KV head (q: group x dim, contiguous), over `len`
// cached keys: each key and value row is read once for all of them, not once per head.
// `scores` has room for group x len floats, `weight` for group; out: group x dim, contiguous.
// dim % 8 == 0.
inline void attend_group(const float* q, const float* keys, const float* values,
                         const int64_t* slots, int64_t len, int64_t slot_stride, int64_t dim,
                         int64_t group, float scale, float* scores, float* weight, float* out) {
  row_scores(q, keys, slots, 0, len, slot_stride, dim, group, scale, scores, weight);
  if (dim % 64 == 0) {  // each head's output 64 lanes at a time, summed in registers
    alignas(32) float acc[64];
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i0 = 0; i0 < dim; i0 += 64) {
        std::fill(acc, acc + 64, 0.0f);
        add_values64(scores + g * len, values, slots, 0, len, slot_stride, i0, acc);
        scale64(acc, weight[g], out + g * dim + i0);
      }
    }
    return;
  }
  std::fill(out, out + group * dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const float* value = values + slots[t] * slot_stride;
    for (int64_t g = 0; g < group; ++g) {
      const __m256 p = _mm256_set1_ps(scores[g * len + t] * weight[g]);
      float* og = out + g * dim;
      for (int64_t i = 0; i < dim; i += 8) {
        _mm256_storeu_ps(og + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(value + i),
                                                 _mm256_loadu_ps(og + i)));
      }
    }
  }
}

// Rows first_row .. first_row + tile - 1 of a prefill chunk, row r over the first
// first_len + r keys (lengths one apart), by attend_group's arithmetic to the bit, but with
// the rows sharing each pass over the keys and values in blocks of KEY_BLOCK keys: a long
// prompt reads each key and value row once per tile from memory, not once per row.
// q: the first row's group heads (rows q_stride apart); scores: tile x group x width floats;
// acc: tile x group x dim floats; weight: tile x group; out: the first row's group heads (rows
// out_stride apart). dim % 64 == 0.
constexpr int64_t PROMPT_TILE = 8, KEY_BLOCK = 64;
inline void attend_prompt_tile(const float* q, int64_t q_stride, const float* keys,
                               const float* values, const int64_t* slots, int64_t first_len,
                               int64_t tile, int64_t slot_stride, int64_t dim, int64_t group,
                               float scale, int64_t width, float* scores, float* acc,
                               float* weight, float* out, int64_t out_stride) {
  const int64_t shared = first_len / 4 * 4;  // whole four-key blocks of every row
  for (int64_t k0 = 0; k0 < shared; k0 += KEY_BLOCK) {
    const int64_t k1 = std::min(k0 + KEY_BLOCK, shared);
    for (int64_t r = 0; r < tile; ++r)
      block_scores(q + r * q_stride, keys, slots, k0, k1, slot_stride, dim, group, scale,
                   scores + r * group * width, first_len + r);
  }
  for (int64_t r = 0; r < tile; ++r)
    row_scores(q + r * q_stride, keys, slots, shared, first_len + r, slot_stride, dim, group,
               scale, scores + r * group * width, weight + r * group);
  std::fill(acc, acc + tile * group * dim, 0.0f);
  const int64_t longest = first_len + tile - 1;
  for (int64_t k0 = 0; k0 < longest; k0 += KEY_BLOCK) {
    for (int64_t r = 0; r < tile; ++r) {
      const int64_t len = first_len + r, k1 = std::min(k0 + KEY_BLOCK, len);
      if (k0 >= k1) continue;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i0 = 0; i0 < dim; i0 += 64)
          add_values64(scores + r * group * width + g * len, values, slots, k0, k1, slot_stride, i0,
                       acc + (r * group + g) * dim + i0);
    }
  }
  for (int64_t r = 0; r < tile; ++r)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i0 = 0; i0 < dim; i0 += 64)
        scale64(acc + (r * group + g) * dim + i0, weight[r * group + g],
                out + r * out_stride + g * dim + i0);
}
#endif

// q [T, H, D] against k_cache, v_cache [slots, Hkv, D]; out contiguous [T, H, D].
inline void check_query(const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& out) {
  check_heads(q, "q");
  check_cache(k_cache, v_cache);
  TORCH_CHECK(k_cache.size(2) == q.size(2), "the cache's head size must match q's");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == torch::kFloat32,
              "out must be a contiguous float32 tensor shaped like q");
}

// Each query row t of q over the `len_of(t)` keys whose slots start at `slots_of(t)`, with
// room for `width` scores: the one per-row routine decode and prompt attention share, so a
// row's result depends on its query and keys alone. Parallel over (row, KV head) pairs.
template <typename SlotsOf, typename LenOf>
void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache,
                 const torch::Tensor& v_cache, int64_t width, SlotsOf slots_of, LenOf len_of,
                 double scale, torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const float *qd = q.data_ptr<float>(), *kd = k_cache.data_ptr<float>();
  const float* vd = v_cache.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), slot_stride = kv_heads * dim;
  const float fscale = static_cast<float>(scale);
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 8 == 0) {
    SpinPool::instance().run(rows * kv_heads, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores, weight;
      scores.resize(group * width);
      weight.resize(group);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t = pair / kv_heads, kv = pair % kv_heads, h = kv * group;
        attend_group(qd + t * q_stride + h * dim, kd + kv * dim, vd + kv * dim, slots_of(t),
                     len_of(t), slot_stride, dim, group, fscale, scores.data(), weight.data(),
                     od + (t * heads + h) * dim);
      }
    });
    return;
  }
#endif
  SpinPool::instance().run(rows * heads, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    scores.resize(width);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t = pair / heads, h = pair % heads, kv = (h / group) * dim;
      attend(qd + t * q_stride + h * dim, kd + kv, vd + kv, slots_of(t), len_of(t), slot_stride,
             dim, fscale, scores.data(), od + pair * dim);
    }
  });
}

// A row whose query sits at position len - 1 attends to the keys at positions > len - 1 -
// window (a sliding window, Gemma 3's local layers): the last `window` of its `len` keys.
// window 0: all of them. The keys a row reads depend on its position alone.
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

// q: [B, H, D] (tokens may be strided); k_cache, v_cache: [slots, Hkv, D]; key_slots: [B, L]
// int64 (padded); context_lens: [B] int64 (<= L); out: contiguous [B, H, D], written.
// window > 0: each row over its last `window` keys only.
inline void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor key_slots, torch::Tensor context_lens, double scale,
                             torch::Tensor out, int64_t window = 0) {
  check_query(q, k_cache, v_cache, out);
  TORCH_CHECK(key_slots.scalar_type() == torch::kInt64 && key_slots.is_contiguous() &&
                  key_slots.dim() == 2 && key_slots.size(0) == q.size(0),
              "key_slots must be int64 [B, L]");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens must be int64 [B]");
  const int64_t width = key_slots.size(1);
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  attend_rows(
      q, k_cache, v_cache, width,
      [&](int64_t b) {
        return slots + b * width + window_start(std::min(lens[b], width), window);
      },
      [&](int64_t b) {
        const int64_t len = std::min(lens[b], width);
        return len - window_start(len, window);
      },
      scale, out);
}

#if defined(__AVX2__) && defined(__FMA__)
// Prompt attention in tiles of PROMPT_TILE rows, parallel over (tile, KV head) pairs.
inline void prompt_tiles(const torch::Tensor& q, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const int64_t* slots, int64_t width,
                         int64_t first_len, double scale, torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t tiles = (rows + PROMPT_TILE - 1) / PROMPT_TILE;
  const float *qd = q.data_ptr<float>(), *kd = k_cache.data_ptr<float>();
  const float* vd = v_cache.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), slot_stride = kv_heads * dim;
  const float fscale = static_cast<float>(scale);
  SpinPool::instance().run(tiles * kv_heads, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores, acc, weight;
    scores.resize(PROMPT_TILE * group * width);
    acc.resize(PROMPT_TILE * group * dim);
    weight.resize(PROMPT_TILE * group);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t first = (pair / kv_heads) * PROMPT_TILE, kv = pair % kv_heads, h = kv * group;
      const int64_t tile = std::min(PROMPT_TILE, rows - first);
      attend_prompt_tile(qd + first * q_stride + h * dim, q_stride, kd + kv * dim, vd + kv * dim,
                         slots, first_len + first, tile, slot_stride, dim, group, fscale, width,
                         scores.data(), acc.data(), weight.data(), od + (first * heads + h) * dim,
                         heads * dim);
    }
  });
}
#endif

// Each query row of one prefill chunk over its sequence's cached keys (the chunk's own
// already written): row i attends to the first first_len + i slots of key_slots, by the same
// per-row routine as decode_attention. q: [T, H, D] (tokens may be strided); key_slots: [L]
// int64 with L >= first_len + T - 1; out: contiguous [T, H, D], written. window > 0: each row
// over its last `window` keys, row by row as decode_attention (the tiles share one start).
inline void prompt_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor key_slots, int64_t first_len, double scale,
                             torch::Tensor out, int64_t window = 0) {
  check_query(q, k_cache, v_cache, out);
  TORCH_CHECK(key_slots.scalar_type() == torch::kInt64 && key_slots.is_contiguous() &&
                  key_slots.dim() == 1,
              "key_slots must be int64 [L]");
  TORCH_CHECK(first_len >= 1 && first_len + q.size(0) - 1 <= key_slots.numel(),
              "key_slots must cover every row's context");
  const int64_t* slots = key_slots.data_ptr<int64_t>();
#if defined(__AVX2__) && defined(__FMA__)
  if (q.size(2) % 64 == 0 && window_start(first_len + q.size(0) - 1, window) == 0) {
    prompt_tiles(q, k_cache, v_cache, slots, key_slots.numel(), first_len, scale, out);
    return;
  }
#endif
  attend_rows(
      q, k_cache, v_cache, key_slots.numel(),
      [&](int64_t i) { return slots + window_start(first_len + i, window); },
      [&](int64_t i) { return first_len + i - window_start(first_len + i, window); }, scale,
      out);
}

}  // namespace zerohop
