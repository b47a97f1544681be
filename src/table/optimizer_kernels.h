// The optimizers' maths on one row: initialisation from (seed, key, column)
// and the update step. HPS_HD and free of allocation, so the CPU launcher, the
// CUDA kernels and SparseOptimizer's host calls run the same bodies; apart
// from the probe engine (table_kernels.h), which includes this file.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

// The optimizer state of a new row, each of its floats: InitRow's, and the
// step check's for a key a table lacks (InitialRowValue).
HPS_HD inline float InitialState(const SparseOptimizer& o) {
  switch (o.opt.kind) {
    case OptimizerKind::kAdaGrad:
    case OptimizerKind::kRowWiseAdaGrad:
      return o.opt.initial_accumulator;
    default:
      return 0.0f;  // Adam: m, v and the step count
  }
}

HPS_HD inline void InitRow(const SparseOptimizer& o, uint64_t key, float* row) {
  const uint32_t dim = static_cast<uint32_t>(o.dim);
  InitEmbedding(o, key, row);
  uint32_t floats = 0;  // of optimizer state (StateFloats, which is host code)
  switch (o.opt.kind) {
    case OptimizerKind::kSgd:
      break;
    case OptimizerKind::kAdaGrad:
      floats = dim;
      break;
    case OptimizerKind::kRowWiseAdaGrad:
      floats = 1;
      break;
    case OptimizerKind::kAdam:
      floats = 2 * dim + 1;
      break;
  }
  float* state = row + dim;
  const float value = InitialState(o);
  for (uint32_t j = 0; j < floats; ++j) state[j] = value;
}

// ---- the step ----

// One optimizer step of a row with its summed gradient, through `row`: its
// get(i) reads float i of the row, its set(i, v) takes float i's new value.
// The formulas follow torch.optim (Adagrad: lr * g / (sqrt(h) + eps); Adam:
// bias-corrected moments). Each float is read before it is set and never read
// after, so a `row` that stores nothing (StepStaysFinite's) sees the very
// values that ApplyUpdate writes.
template <class Row>
HPS_HD inline void StepRow(const SparseOptimizer& o, Row& row, const float* grad) {
  const uint32_t dim = static_cast<uint32_t>(o.dim);
  // Where each part of the row starts, as 64-bit offsets: an index dim + j of
  // 32 bits could wrap, as far as the compiler knows, and kept the loops
  // from vectorizing.
  const uint64_t state = dim, second = 2 * uint64_t{dim}, count = 3 * uint64_t{dim};
  const float lr = o.opt.lr;
  const float eps = o.opt.eps;
  switch (o.opt.kind) {
    case OptimizerKind::kSgd:
      for (uint32_t j = 0; j < dim; ++j) row.set(j, row.get(j) - lr * grad[j]);
      break;
    case OptimizerKind::kAdaGrad:
      for (uint32_t j = 0; j < dim; ++j) {
        const float h = row.get(state + j) + grad[j] * grad[j];
        row.set(state + j, h);
        row.set(j, row.get(j) - lr * grad[j] / (sqrtf(h) + eps));
      }
      break;
    case OptimizerKind::kRowWiseAdaGrad: {
      float sum_sq = 0.0f;
      for (uint32_t j = 0; j < dim; ++j) sum_sq += grad[j] * grad[j];
      const float h = row.get(state) + sum_sq / static_cast<float>(dim);
      row.set(state, h);
      const float scale = lr / (sqrtf(h) + eps);
      for (uint32_t j = 0; j < dim; ++j) row.set(j, row.get(j) - scale * grad[j]);
      break;
    }
    case OptimizerKind::kAdam: {
      // Row: embedding (dim), m (dim), v (dim), step count (1).
      const float step = row.get(count) + 1.0f;
      row.set(count, step);
      const float b1 = o.opt.beta1;
      const float b2 = o.opt.beta2;
      const float bias1 = 1.0f - powf(b1, step);
      const float bias2_sqrt = sqrtf(1.0f - powf(b2, step));
      const float step_size = lr / bias1;
      for (uint32_t j = 0; j < dim; ++j) {
        const float m = b1 * row.get(state + j) + (1.0f - b1) * grad[j];
        const float v = b2 * row.get(second + j) + (1.0f - b2) * grad[j] * grad[j];
        row.set(state + j, m);
        row.set(second + j, v);
        row.set(j, row.get(j) - step_size * m / (sqrtf(v) / bias2_sqrt + eps));
      }
      break;
    }
  }
}

// A float's bits (memcpy: the host's type pun, which the vectorizer reads as one).
HPS_HD inline uint32_t FloatBits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
#endif
}

// Its exponent bits all ones: a NaN or an infinity.
HPS_HD inline bool NotFinite(float v) { return (FloatBits(v) & 0x7f800000u) == 0x7f800000u; }

// The exponent bits plus one at their lowest: 0x80000000 set exactly where
// they were all ones (a NaN or an infinity). ORed over many values, one test
// at the end: integer adds and ORs, which vectorize where a bool's OR did not.
HPS_HD inline uint32_t NotFiniteBit(float v) { return (FloatBits(v) & 0x7f800000u) + 0x00800000u; }

// A row stepped where it lies. kCheck: noting whether each new value is
// finite (NotFiniteBit, ORed in `bits`).
template <bool kCheck>
struct InPlaceRow {
  float* row;
  uint32_t bits = 0;
  HPS_HD bool bad() const { return (bits & 0x80000000u) != 0; }
  HPS_HD float get(uint64_t i) const { return row[i]; }
  HPS_HD void set(uint64_t i, float v) {
    row[i] = v;
    if constexpr (kCheck) bits |= NotFiniteBit(v);
  }
};

HPS_HD inline void ApplyUpdate(const SparseOptimizer& o, float* row, const float* grad) {
  InPlaceRow<false> in_place{row};
  StepRow(o, in_place, grad);
}

// ApplyUpdate that returns whether every new value of the row is finite: the
// CPU launchers' step, which keeps the rows it stepped (a journal) until the
// whole call's steps are known to be finite, and puts them back otherwise.
HPS_HD inline bool ApplyUpdateFinite(const SparseOptimizer& o, float* row, const float* grad) {
  InPlaceRow<true> in_place{row};
  StepRow(o, in_place, grad);
  return !in_place.bad();
}

// The values of a stored row (RowValues) or of a key's initial row
// (InitialRowValue, computed as InitRow writes them): a dry step's input.
struct RowValues {
  const float* row;
  HPS_HD float operator()(uint64_t i) const { return row[i]; }
};

struct InitialRowValue {
  const SparseOptimizer* o;
  uint64_t key;
  HPS_HD float operator()(uint64_t i) const {
    return i < static_cast<uint64_t>(o->dim) ? InitialValue(o->init, key, static_cast<uint32_t>(i)) : InitialState(*o);
  }
};

// A step that stores nothing: it notes whether any new value is not finite
// (branch-free), and, with kFirst, which was the first and what it was.
template <class Values, bool kFirst = false>
struct DryRow {
  Values values;
  uint32_t bits = 0;  // NotFiniteBit of every value set, ORed
  uint32_t first = 0;
  float first_value = 0.0f;
  HPS_HD bool bad() const { return (bits & 0x80000000u) != 0; }
  HPS_HD float get(uint64_t i) const { return values(i); }
  HPS_HD void set(uint64_t i, float v) {
    if constexpr (kFirst) {
      if (!bad() && NotFinite(v)) {
        first = static_cast<uint32_t>(i);
        first_value = v;
      }
    }
    bits |= NotFiniteBit(v);
  }
};

// Whether the step of the row whose floats `values` gives (RowValues,
// InitialRowValue) leaves every float of it finite: ApplyUpdate's arithmetic
// on the same values, storing nothing. Where a step cannot be put back (the
// CUDA table's, a device tier's places stepped one after another), the check
// that refuses it before any row of it changes.
template <class Values>
HPS_HD inline bool StepStaysFinite(const SparseOptimizer& o, const Values& values, const float* grad) {
  DryRow<Values> dry{values};
  StepRow(o, dry, grad);
  return !dry.bad();
}

}  // namespace hps::detail
