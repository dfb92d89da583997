// exp over float arrays, eight lanes at a time on AVX2 (Cephes' polynomial, within ~2 ulp
// of expf): glibc's expf is scalar here, and softmax and SiLU call it once per element.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace zerohop {

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  // x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two for an exact n ln2.
  const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                   _mm256_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

// s[i] = exp(s[i] - shift); returns the sum.
inline float exp_shifted(float* s, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 sum = _mm256_setzero_ps();
  const __m256 by = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), by));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  for (float lane : lanes) total += lane;
#endif
  for (; i < n; ++i) total += (s[i] = std::exp(s[i] - shift));
  return total;
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// out[i] = gelu_tanh(gate[i]) * up[i] (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(u)) with
// u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2u)).
inline void gelu_tanh_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  constexpr float k2 = -2.0f * 0.7978845608028654f, cube = 0.044715f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(cube), g),
                                         _mm256_mul_ps(g, g), g);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(k2), inner));
    const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i], inner = cube * g * (g * g) + g;
    out[i] = g / (1.0f + std::exp(k2 * inner)) * up[i];
  }
}

}  // namespace zerohop
