// The paged KV cache's CPU operations: writing new tokens' keys and values into their slots,
// decode attention (one query token per sequence) reading keys and values in place from the
// slots, with no gathered copy, and prompt attention, which gives each row of a prefill chunk
// exactly the decode arithmetic over the keys up to its position (so a position computes the
// same decoded, prefilled in any chunking, or replayed). Parallel over (row, KV head) pairs
// (with AVX2: the query heads sharing a KV head go together, reading its keys and values
// once), so even one sequence uses every thread.
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
// The `group` query heads that share one KV head (q: group x dim, contiguous), over `len`
// cached keys: each key and value row is read once for all of them, not once per head.
// `scores` has room for group x len floats, `weight` for group; out: group x dim, contiguous.
// dim % 8 == 0.
inline void attend_group(const float* q, const float* keys, const float* values,
                         const int64_t* slots, int64_t len, int64_t slot_stride, int64_t dim,
                         int64_t group, float scale, float* scores, float* weight, float* out) {
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {  // four keys at a time: one horizontal sum for four scores
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
      _mm_storeu_ps(scores + g * len + t, _mm_mul_ps(four, _mm_set1_ps(scale)));
    }
  }
  for (; t < len; ++t) {
    const float* key = keys + slots[t] * slot_stride;
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(q + g * dim, key, dim) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    const float top = *std::max_element(sg, sg + len);
    const float total = exp_shifted(sg, len, top);
    weight[g] = total > 0.0f ? 1.0f / total : 0.0f;
  }
  if (dim % 64 == 0) {  // each head's output 64 lanes at a time, summed in registers
    for (int64_t g = 0; g < group; ++g) {
      const float* pg = scores + g * len;
      const __m256 norm = _mm256_set1_ps(weight[g]);
      for (int64_t i0 = 0; i0 < dim; i0 += 64) {
        __m256 acc[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (t = 0; t < len; ++t) {
          const float* value = values + slots[t] * slot_stride + i0;
          const __m256 p = _mm256_set1_ps(pg[t]);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * j), acc[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          _mm256_storeu_ps(out + g * dim + i0 + 8 * j, _mm256_mul_ps(acc[j], norm));
      }
    }
    return;
  }
  std::fill(out, out + group * dim, 0.0f);
  for (t = 0; t < len; ++t) {
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

// q: [B, H, D] (tokens may be strided); k_cache, v_cache: [slots, Hkv, D]; key_slots: [B, L]
// int64 (padded); context_lens: [B] int64 (<= L); out: contiguous [B, H, D], written.
inline void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor key_slots, torch::Tensor context_lens, double scale,
                             torch::Tensor out) {
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
      q, k_cache, v_cache, width, [&](int64_t b) { return slots + b * width; },
      [&](int64_t b) { return std::min(lens[b], width); }, scale, out);
}

// Each query row of one prefill chunk over its sequence's cached keys (the chunk's own
// already written): row i attends to the first first_len + i slots of key_slots, by the same
// per-row routine as decode_attention. q: [T, H, D] (tokens may be strided); key_slots: [L]
// int64 with L >= first_len + T - 1; out: contiguous [T, H, D], written.
inline void prompt_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor key_slots, int64_t first_len, double scale,
                             torch::Tensor out) {
  check_query(q, k_cache, v_cache, out);
  TORCH_CHECK(key_slots.scalar_type() == torch::kInt64 && key_slots.is_contiguous() &&
                  key_slots.dim() == 1,
              "key_slots must be int64 [L]");
  TORCH_CHECK(first_len >= 1 && first_len + q.size(0) - 1 <= key_slots.numel(),
              "key_slots must cover every row's context");
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  attend_rows(
      q, k_cache, v_cache, key_slots.numel(), [&](int64_t) { return slots; },
      [&](int64_t i) { return first_len + i; }, scale, out);
}

}  // namespace zerohop
