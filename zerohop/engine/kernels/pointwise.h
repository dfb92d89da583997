// The small per-token operations of a decoder layer, each one pass over the rows instead of
// the five to twelve torch ops (and their dispatch) they replace: RMSNorm with the residual
// add, rotary embedding applied in place, SiLU(gate) * up.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "spin_pool.h"
#include "vec_math.h"

namespace zerohop {

// Rows in parallel only when there is enough work to pay for waking a worker.
template <typename Fn>
void for_rows(int64_t rows, int64_t row_cost, Fn fn) {
  if (rows * row_cost < (1 << 15)) {
    fn(0, rows);
  } else {
    SpinPool::instance().run(rows, fn);
  }
}

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == torch::kFloat32, name,
              " must be a contiguous float32 matrix");
}

// With `residual`: residual += x first (in place), then normalize residual. Returns the norm.
inline torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                              c10::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(weight.numel() == cols && weight.is_contiguous(), "weight must match the rows");
  float* in = x.data_ptr<float>();
  float* sum = nullptr;
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must match x");
    sum = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for_rows(rows, cols, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = in + r * cols;
      if (sum != nullptr) {
        float* acc = sum + r * cols;
        for (int64_t i = 0; i < cols; ++i) acc[i] += row[i];
        row = acc;
      }
      float squares = 0.0f;
      for (int64_t i = 0; i < cols; ++i) squares += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(cols) + static_cast<float>(eps));
      for (int64_t i = 0; i < cols; ++i) o[r * cols + i] = w[i] * (row[i] * inv);
    }
  });
  return out;
}

// x: [T, heads, D] rows (any heads), cos/sin: [T, D] in the rotate_half layout. In place.
inline void rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be float32 [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == x.size(2),
              "cos/sin must be contiguous [T, D]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  float* data = x.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  for_rows(tokens, heads * dim, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *ct = c + t * dim, *st = s + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = data + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * ct[i] - b * st[i];
          v[i + half] = b * ct[i + half] + a * st[i + half];
        }
      }
    }
  });
}

// gate_up: [T, 2 I] (gate then up) -> [T, I] act(gate) * up, row by row by `row`.
template <typename GatedRow>
inline torch::Tensor gated_rows(const torch::Tensor& gate_up, GatedRow row) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for_rows(rows, width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = in + r * 2 * width;
      row(g, g + width, o + r * width, width);
    }
  });
  return out;
}

// silu(gate) * up.
inline torch::Tensor silu_mul(torch::Tensor gate_up) {
  return gated_rows(gate_up, silu_mul_row);
}

// gelu_tanh(gate) * up (Gemma).
inline torch::Tensor gelu_mul(torch::Tensor gate_up) {
  return gated_rows(gate_up, gelu_tanh_mul_row);
}

}  // namespace zerohop
