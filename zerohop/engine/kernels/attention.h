// Decode attention over the paged KV cache: one query token per sequence, its keys and values
// read in place from the cache slots (no gathered copy), parallel over (sequence, KV head).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "spin_pool.h"

namespace zerohop {

inline float dot(const float* a, const float* b, int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

// q: [B, H, D]; k_cache, v_cache: [slots, Hkv, D]; key_slots: [B, L] int64 (padded);
// context_lens: [B] int64 (<= L). Returns [B, H, D].
inline torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor key_slots, torch::Tensor context_lens,
                                      double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32,
              "q must be a contiguous float32 [B, H, D] tensor");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2),
              "k/v caches must be contiguous [slots, Hkv, D] tensors");
  TORCH_CHECK(key_slots.scalar_type() == torch::kInt64 && key_slots.is_contiguous() &&
                  key_slots.size(0) == q.size(0),
              "key_slots must be int64 [B, L]");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.numel() == q.size(0),
              "context_lens must be int64 [B]");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, width = key_slots.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty_like(q);
  const float *qd = q.data_ptr<float>(), *kd = k_cache.data_ptr<float>();
  const float* vd = v_cache.data_ptr<float>();
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  SpinPool::instance().run(batch * kv_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, h = pair % kv_heads;
      const int64_t len = std::min(lens[b], width);
      const int64_t* row_slots = slots + b * width;
      scores.assign(group * len, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* key = kd + (row_slots[t] * kv_heads + h) * dim;
        for (int64_t g = 0; g < group; ++g) {
          scores[g * len + t] = dot(qd + (b * heads + h * group + g) * dim, key, dim) * fscale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float top = len ? *std::max_element(s, s + len) : 0.0f;
        float total = 0.0f;
        for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - top));
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        float* o = od + (b * heads + h * group + g) * dim;
        std::fill(o, o + dim, 0.0f);
        for (int64_t t = 0; t < len; ++t) {
          const float* value = vd + (row_slots[t] * kv_heads + h) * dim;
          const float p = s[t] * inv;
          for (int64_t i = 0; i < dim; ++i) o[i] += p * value[i];
        }
      }
    }
  });
  return out;
}

}  // namespace zerohop
