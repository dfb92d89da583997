// A grammar's token bitmask applied to logits in place: bit t of a row's mask clear means
// token t is not allowed next, and its logit becomes -inf. Words that allow all 32 tokens
// (common inside JSON strings) are skipped; words that allow none (common between JSON
// tokens) are filled whole.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace zerohop {

inline void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 &&
                  logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 &&
                  bitmask.is_contiguous(),
              "the bitmask must be contiguous int32 [masked rows, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 &&
                  rows.size(0) == bitmask.size(0),
              "rows must be int64, one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "the bitmask is narrower than the vocabulary");
  const float ban = -std::numeric_limits<float>::infinity();
  const int64_t* row_index = rows.data_ptr<int64_t>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  for (int64_t j = 0; j < rows.size(0); ++j) {
    TORCH_CHECK(row_index[j] >= 0 && row_index[j] < logits.size(0), "row out of range");
    float* out = logits.data_ptr<float>() + row_index[j] * logits.stride(0);
    const uint32_t* mask = masks + j * words;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t m = mask[w];
      if (m == 0xFFFFFFFFu) continue;
      const int64_t start = w * 32, end = start + 32 < vocab ? start + 32 : vocab;
      if (m == 0) {
        std::fill(out + start, out + end, ban);
        continue;
      }
      for (int64_t t = start; t < end; ++t) {
        if (!((m >> (t - start)) & 1u)) out[t] = ban;
      }
    }
  }
}

}  // namespace zerohop
