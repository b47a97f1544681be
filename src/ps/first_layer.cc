#include "ps/first_layer.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hps::detail {

void ProjectRowsPlain(const float* x, uint64_t rows, uint64_t inputs, uint64_t x_stride, const float* weight_t,
                      uint64_t outputs, const float* bias, float* out) {
  for (uint64_t i = 0; i < rows; ++i) {
    float* o = out + i * outputs;
    for (uint64_t j = 0; j < outputs; ++j) o[j] = bias[j];
    const float* xi = x + i * x_stride;
    for (uint64_t k = 0; k < inputs; ++k) {
      const float v = xi[k];
      const float* w = weight_t + k * outputs;
      for (uint64_t j = 0; j < outputs; ++j) o[j] += v * w[j];
    }
  }
}

void ProjectBackPlain(const float* grad_out, uint64_t rows, uint64_t outputs, const float* weight,
                      uint64_t weight_stride, uint64_t columns, float* grad_x) {
  for (uint64_t i = 0; i < rows; ++i) {
    float* o = grad_x + i * columns;
    for (uint64_t c = 0; c < columns; ++c) o[c] = 0.0f;
    for (uint64_t j = 0; j < outputs; ++j) {
      const float g = grad_out[i * outputs + j];
      const float* w = weight + j * weight_stride;
      for (uint64_t c = 0; c < columns; ++c) o[c] += g * w[c];
    }
  }
}

namespace {

#if defined(__x86_64__)
// 16 outputs are two 8-float vectors. Four rows at a time keep eight sums in
// flight (one row's two would wait on each FMA's latency) and load each
// weight row once for the four.
__attribute__((target("avx2,fma"))) void ProjectRows16(const float* x, uint64_t rows, uint64_t inputs,
                                                        uint64_t x_stride, const float* weight_t, const float* bias,
                                                        float* out) {
  const __m256 b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8);
  uint64_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    const float* x0 = x + i * x_stride;
    const float* x1 = x0 + x_stride;
    const float* x2 = x1 + x_stride;
    const float* x3 = x2 + x_stride;
    __m256 s00 = b0, s01 = b1, s10 = b0, s11 = b1, s20 = b0, s21 = b1, s30 = b0, s31 = b1;
    for (uint64_t k = 0; k < inputs; ++k) {
      const __m256 w0 = _mm256_loadu_ps(weight_t + k * 16), w1 = _mm256_loadu_ps(weight_t + k * 16 + 8);
      const __m256 v0 = _mm256_broadcast_ss(x0 + k), v1 = _mm256_broadcast_ss(x1 + k);
      const __m256 v2 = _mm256_broadcast_ss(x2 + k), v3 = _mm256_broadcast_ss(x3 + k);
      s00 = _mm256_fmadd_ps(v0, w0, s00);
      s01 = _mm256_fmadd_ps(v0, w1, s01);
      s10 = _mm256_fmadd_ps(v1, w0, s10);
      s11 = _mm256_fmadd_ps(v1, w1, s11);
      s20 = _mm256_fmadd_ps(v2, w0, s20);
      s21 = _mm256_fmadd_ps(v2, w1, s21);
      s30 = _mm256_fmadd_ps(v3, w0, s30);
      s31 = _mm256_fmadd_ps(v3, w1, s31);
    }
    float* o = out + i * 16;
    _mm256_storeu_ps(o, s00);
    _mm256_storeu_ps(o + 8, s01);
    _mm256_storeu_ps(o + 16, s10);
    _mm256_storeu_ps(o + 24, s11);
    _mm256_storeu_ps(o + 32, s20);
    _mm256_storeu_ps(o + 40, s21);
    _mm256_storeu_ps(o + 48, s30);
    _mm256_storeu_ps(o + 56, s31);
  }
  if (i < rows) ProjectRowsPlain(x + i * x_stride, rows - i, inputs, x_stride, weight_t, 16, bias, out + i * 16);
}

// Two rows at a time, 32 columns at a time: eight sums in flight, each weight
// vector loaded once for both rows.
__attribute__((target("avx2,fma"))) void ProjectBack16(const float* grad_out, uint64_t rows, const float* weight,
                                                        uint64_t weight_stride, uint64_t columns, float* grad_x) {
  const uint64_t whole = columns & ~uint64_t{31};
  uint64_t i = 0;
  for (; i + 2 <= rows; i += 2) {
    const float* g0 = grad_out + i * 16;
    const float* g1 = g0 + 16;
    float* o0 = grad_x + i * columns;
    float* o1 = o0 + columns;
    for (uint64_t c = 0; c < whole; c += 32) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (uint64_t j = 0; j < 16; ++j) {
        const float* w = weight + j * weight_stride + c;
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        const __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);
        const __m256 u = _mm256_broadcast_ss(g0 + j), v = _mm256_broadcast_ss(g1 + j);
        a0 = _mm256_fmadd_ps(u, w0, a0);
        a1 = _mm256_fmadd_ps(u, w1, a1);
        a2 = _mm256_fmadd_ps(u, w2, a2);
        a3 = _mm256_fmadd_ps(u, w3, a3);
        b0 = _mm256_fmadd_ps(v, w0, b0);
        b1 = _mm256_fmadd_ps(v, w1, b1);
        b2 = _mm256_fmadd_ps(v, w2, b2);
        b3 = _mm256_fmadd_ps(v, w3, b3);
      }
      _mm256_storeu_ps(o0 + c, a0);
      _mm256_storeu_ps(o0 + c + 8, a1);
      _mm256_storeu_ps(o0 + c + 16, a2);
      _mm256_storeu_ps(o0 + c + 24, a3);
      _mm256_storeu_ps(o1 + c, b0);
      _mm256_storeu_ps(o1 + c + 8, b1);
      _mm256_storeu_ps(o1 + c + 16, b2);
      _mm256_storeu_ps(o1 + c + 24, b3);
    }
    for (uint64_t c = whole; c < columns; ++c) {  // the last columns short of 32
      float s0 = 0.0f, s1 = 0.0f;
      for (uint64_t j = 0; j < 16; ++j) {
        s0 += g0[j] * weight[j * weight_stride + c];
        s1 += g1[j] * weight[j * weight_stride + c];
      }
      o0[c] = s0;
      o1[c] = s1;
    }
  }
  if (i < rows) ProjectBackPlain(grad_out + i * 16, rows - i, 16, weight, weight_stride, columns, grad_x + i * columns);
}

bool HasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#else
bool HasAvx2Fma() { return false; }
#endif

}  // namespace

bool ProjectionIsFast(uint64_t outputs) { return outputs == 16 && HasAvx2Fma(); }

void ProjectRows(const float* x, uint64_t rows, uint64_t inputs, uint64_t x_stride, const float* weight_t,
                 uint64_t outputs, const float* bias, float* out) {
#if defined(__x86_64__)
  if (ProjectionIsFast(outputs)) return ProjectRows16(x, rows, inputs, x_stride, weight_t, bias, out);
#endif
  ProjectRowsPlain(x, rows, inputs, x_stride, weight_t, outputs, bias, out);
}

void ProjectBack(const float* grad_out, uint64_t rows, uint64_t outputs, const float* weight,
                 uint64_t weight_stride, uint64_t columns, float* grad_x) {
#if defined(__x86_64__)
  if (ProjectionIsFast(outputs)) return ProjectBack16(grad_out, rows, weight, weight_stride, columns, grad_x);
#endif
  ProjectBackPlain(grad_out, rows, outputs, weight, weight_stride, columns, grad_x);
}

}  // namespace hps::detail
