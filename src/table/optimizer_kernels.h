// The optimizers' maths on one row: initialisation from (seed, key, column)
// and the update step. HPS_HD and free of allocation, so the CPU launcher, the
// CUDA kernels and SparseOptimizer's host calls run the same bodies; apart
// from the probe engine (table_kernels.h), which includes this file.
#pragma once

#include <cmath>
#include <cstdint>

#include "hps/config.h"
#include "hps/optimizer.h"
#include "util/mix64.h"

namespace hps::detail {

// ---- initialisation: a pure function of (seed, key, column) ----

// A uniform float in [0, 1) from 24 well-mixed bits.
HPS_HD inline float UnitFloat(uint64_t seed, uint64_t key, uint32_t column) {
  const uint64_t h = Mix64(Mix64(key ^ Mix64(seed)) + 0x9e3779b97f4a7c15ULL * (column + 1));
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

HPS_HD inline float InitialValue(const InitializerOptions& init, uint64_t key, uint32_t column) {
  switch (init.kind) {
    case InitKind::kZeros:
      return 0.0f;
    case InitKind::kUniform:
      return init.scale * (2.0f * UnitFloat(init.seed, key, column) - 1.0f);
    case InitKind::kNormal: {
      // Box-Muller on two independent streams of the same (seed, key, column).
      const float u1 = 1.0f - UnitFloat(init.seed, key, 2 * column);  // (0, 1]
      const float u2 = UnitFloat(init.seed, key, 2 * column + 1);
      return init.scale * sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
    }
  }
  return 0.0f;
}

// The embedding part (dim floats) of a key's initial row: InitRow's first dim
// floats, the same code, so the two cannot drift apart.
HPS_HD inline void InitEmbedding(const SparseOptimizer& o, uint64_t key, float* embedding) {
  const uint32_t dim = static_cast<uint32_t>(o.dim);
  for (uint32_t j = 0; j < dim; ++j) embedding[j] = InitialValue(o.init, key, j);
}

HPS_HD inline void InitRow(const SparseOptimizer& o, uint64_t key, float* row) {
  const uint32_t dim = static_cast<uint32_t>(o.dim);
  InitEmbedding(o, key, row);
  float* state = row + dim;
  switch (o.opt.kind) {
    case OptimizerKind::kSgd:
      break;
    case OptimizerKind::kAdaGrad:
      for (uint32_t j = 0; j < dim; ++j) state[j] = o.opt.initial_accumulator;
      break;
    case OptimizerKind::kRowWiseAdaGrad:
      state[0] = o.opt.initial_accumulator;
      break;
    case OptimizerKind::kAdam:
      for (uint32_t j = 0; j < 2 * dim + 1; ++j) state[j] = 0.0f;
      break;
  }
}

// One optimizer step of a row with its summed gradient. The formulas follow
// torch.optim (Adagrad: lr * g / (sqrt(h) + eps); Adam: bias-corrected moments).
HPS_HD inline void ApplyUpdate(const SparseOptimizer& o, float* row, const float* grad) {
  const uint32_t dim = static_cast<uint32_t>(o.dim);
  const float lr = o.opt.lr;
  const float eps = o.opt.eps;
  float* state = row + dim;
  switch (o.opt.kind) {
    case OptimizerKind::kSgd:
      for (uint32_t j = 0; j < dim; ++j) row[j] -= lr * grad[j];
      break;
    case OptimizerKind::kAdaGrad:
      for (uint32_t j = 0; j < dim; ++j) {
        state[j] += grad[j] * grad[j];
        row[j] -= lr * grad[j] / (sqrtf(state[j]) + eps);
      }
      break;
    case OptimizerKind::kRowWiseAdaGrad: {
      float sum_sq = 0.0f;
      for (uint32_t j = 0; j < dim; ++j) sum_sq += grad[j] * grad[j];
      state[0] += sum_sq / static_cast<float>(dim);
      const float scale = lr / (sqrtf(state[0]) + eps);
      for (uint32_t j = 0; j < dim; ++j) row[j] -= scale * grad[j];
      break;
    }
    case OptimizerKind::kAdam: {
      float* m = state;
      float* v = state + dim;
      float& step = state[2 * dim];
      step += 1.0f;
      const float b1 = o.opt.beta1;
      const float b2 = o.opt.beta2;
      const float bias1 = 1.0f - powf(b1, step);
      const float bias2_sqrt = sqrtf(1.0f - powf(b2, step));
      const float step_size = lr / bias1;
      for (uint32_t j = 0; j < dim; ++j) {
        m[j] = b1 * m[j] + (1.0f - b1) * grad[j];
        v[j] = b2 * v[j] + (1.0f - b2) * grad[j] * grad[j];
        row[j] -= step_size * m[j] / (sqrtf(v[j]) / bias2_sqrt + eps);
      }
      break;
    }
  }
}

}  // namespace hps::detail
