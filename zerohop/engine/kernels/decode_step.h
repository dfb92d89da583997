// A whole decode step of the decoder in one C++ call: every layer's norms, products, rotary
// embedding, cache write and attention, then the final norm and the output layer. It is the
// CPU counterpart of replaying a captured CUDA graph: the ~25 Python-level calls a layer makes
// on the fused path (~2 ms a step at one sequence) collapse into one. Built once per model
// (zerohop/engine/model/decode_step.py) from the same weight tensors the Python path uses.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "attention.h"
#include "bf16_gemm.h"
#include "dense_gemm.h"
#include "kquant.h"
#include "panel_product.h"
#include "pointwise.h"

namespace zerohop {

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);

// One weight matrix as zerohop's kernels hold it: "dense" (dense_pack's panels of a float32,
// float16 or bfloat16 W), "q8_0" (qs, d), "q4_1" (qs, d, m), "q8_0_panels" and "q4_1_panels"
// (q8_0_pack's and q4_1_pack's: the products on AVX-512 VNNI), and the K-quants q4_k, q5_k,
// q6_k (with q5_0, q5_1) and their "_panels" (kquant.h: six tensors each), "bf16_panels"
// (bf16_pack's: the bfloat16 product on AVX-512 BF16).
class Product {
 public:
  enum class Kind { kDense, kBf16, kQ8_0, kQ4_1, kQ8_0Panels, kQ4_1Panels, kKQuant, kStack };

  Product(const std::string& kind, std::vector<torch::Tensor> tensors,
          c10::optional<torch::Tensor> bias, int64_t out_features = 0)
      : kind_(parse(kind)), name_(kind), tensors_(std::move(tensors)), bias_(std::move(bias)),
        out_features_(out_features) {
    const size_t expected = kind_ == Kind::kStack                                   ? 0
                            : kind_ == Kind::kKQuant                                ? 6
                            : kind_ == Kind::kDense || kind_ == Kind::kBf16        ? 1
                            : kind_ == Kind::kQ8_0 || kind_ == Kind::kQ8_0Panels ? 2
                                                                                 : 3;
    TORCH_CHECK(tensors_.size() == expected, kind, " takes ", expected, " tensors");
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor out;
    switch (kind_) {
      case Kind::kDense: out = dense_linear(x, tensors_[0], out_features_); break;
      case Kind::kBf16: out = bf16_linear(x, tensors_[0], out_features_); break;
      case Kind::kQ8_0: out = q8_0_linear(x, tensors_[0], tensors_[1]); break;
      case Kind::kQ4_1: out = q4_1_linear(x, tensors_[0], tensors_[1], tensors_[2]); break;
      case Kind::kQ8_0Panels:
      case Kind::kQ4_1Panels: out = panel_linear(x); break;
      case Kind::kKQuant: out = kquant::linear(name_, x, tensors_, out_features_); break;
      case Kind::kStack: {
        std::vector<torch::Tensor> outs;
        for (const auto& part : parts_) outs.push_back(part(x));
        out = torch::cat(outs, 1);
        break;
      }
    }
    if (bias_) out.add_(*bias_);
    return out;
  }

  // Products of different kinds that read the same input (a Q4_K_M file's Q4_K q and k beside
  // its Q6_K v), their outputs side by side.
  static Product stacked(std::vector<Product> parts) {
    Product out("stack", {}, c10::nullopt);
    out.parts_ = std::move(parts);
    return out;
  }

 private:
  torch::Tensor panel_linear(const torch::Tensor& x) const {
#ifdef ZH_WIDE
    if (kind_ == Kind::kQ8_0Panels) {
      return panels::q8_0_linear(x, tensors_[0], tensors_[1], out_features_);
    }
    return panels::q4_1_linear(x, tensors_[0], tensors_[1], tensors_[2], out_features_);
#else
    TORCH_CHECK(false, "panels need AVX-512 VNNI");
    return x;
#endif
  }

  static Kind parse(const std::string& kind) {
    if (kind == "stack") return Kind::kStack;
    if (kind == "dense") return Kind::kDense;
    if (kind == "bf16_panels") return Kind::kBf16;
    if (kind == "q8_0") return Kind::kQ8_0;
    if (kind == "q8_0_panels") return Kind::kQ8_0Panels;
    if (kind == "q4_1_panels") return Kind::kQ4_1Panels;
    for (const char* k_kind : {"q4_k", "q5_k", "q6_k", "q5_0", "q5_1"}) {
      if (kind.rfind(k_kind, 0) == 0) return Kind::kKQuant;
    }
    TORCH_CHECK(kind == "q4_1", "unknown product kind ", kind);
    return Kind::kQ4_1;
  }

  Kind kind_;
  std::string name_;
  std::vector<torch::Tensor> tensors_;
  c10::optional<torch::Tensor> bias_;
  std::vector<Product> parts_;  // kStack's
  int64_t out_features_;  // dense and panel kinds: N (their panels pad it to a multiple of 16)
};

struct DecodeLayer {
  torch::Tensor input_norm, post_norm;
  Product qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;
};

class DecodeStep {
 public:
  DecodeStep(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
             double scale, torch::Tensor final_norm, Product lm_head)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), final_norm_(std::move(final_norm)), lm_head_(std::move(lm_head)) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, Product qkv, Product o,
                 Product gate_up, Product down, torch::Tensor k_cache, torch::Tensor v_cache) {
    check_cache(k_cache, v_cache);
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(qkv),
                       std::move(o), std::move(gate_up), std::move(down), std::move(k_cache),
                       std::move(v_cache)});
  }

  // hidden: [B, H] embedded tokens (updated in place); cos/sin: [B, R] (R <= D); one new token
  // per sequence, written to slot_mapping; returns logits [len(logits_rows), vocab].
  torch::Tensor run(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor slot_mapping, torch::Tensor key_slots,
                    torch::Tensor context_lens, torch::Tensor logits_rows) {
    TORCH_CHECK(!layers_.empty(), "the decode step has no layers");
    const int64_t batch = hidden.size(0), q_dim = heads_ * head_dim_;
    const int64_t kv_dim = kv_heads_ * head_dim_;
    auto attended = torch::empty({batch, heads_, head_dim_}, hidden.options());
    torch::Tensor normed = rms_norm(hidden, layers_[0].input_norm, eps_, c10::nullopt);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecodeLayer& layer = layers_[i];
      const torch::Tensor qkv = layer.qkv(normed);
      const torch::Tensor q = qkv.narrow(1, 0, q_dim).view({batch, heads_, head_dim_});
      const torch::Tensor k = qkv.narrow(1, q_dim, kv_dim).view({batch, kv_heads_, head_dim_});
      const torch::Tensor v =
          qkv.narrow(1, q_dim + kv_dim, kv_dim).view({batch, kv_heads_, head_dim_});
      // A partial rotary (Phi-3): cos/sin cover only the leading dims that turn.
      rotate(q.narrow(2, 0, cos.size(1)), cos, sin);
      rotate(k.narrow(2, 0, cos.size(1)), cos, sin);
      write_kv(k, v, layer.k_cache, layer.v_cache, slot_mapping);
      decode_attention(q, layer.k_cache, layer.v_cache, key_slots, context_lens, scale_,
                       attended);
      normed = rms_norm(layer.o(attended.view({batch, q_dim})), layer.post_norm, eps_, hidden);
      const torch::Tensor mlp = layer.down(silu_mul(layer.gate_up(normed)));
      if (i + 1 < layers_.size()) {
        normed = rms_norm(mlp, layers_[i + 1].input_norm, eps_, hidden);
      } else {
        hidden.add_(mlp);
      }
    }
    const torch::Tensor last = rms_norm(hidden.index_select(0, logits_rows).contiguous(),
                                        final_norm_, eps_, c10::nullopt);
    return lm_head_(last);
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  Product lm_head_;
  std::vector<DecodeLayer> layers_;
};

}  // namespace zerohop
