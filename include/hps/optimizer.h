// Sparse optimizers fused into the embedding-row update.
//
// A row is [embedding (dim) | optimizer state]. The state layout per kind:
//   SGD              -> nothing
//   AdaGrad          -> per-dimension sum of squared gradients (dim)
//   RowWiseAdaGrad   -> one running mean of squared gradients (1)
//   Adam             -> first moment (dim), second moment (dim), step count (1)
// Adam counts steps per row, so bias correction follows how often *that* row was
// updated; the count is a float and stays exact up to 2^24 updates of one row.
//
// A row that does not exist yet is initialised as a pure function of (seed, key):
// the same key gets the same initial row on any device, node or thread.
//
// SparseOptimizer is trivially copyable so that CUDA kernels take it by value.
#pragma once

#include <cstdint>
#include <string>

namespace hps {

// DO NOT CHANGE THESE ENUM VALUES: they are stored in checkpoint metadata.
enum class OptimizerKind : int32_t { kSgd = 0, kAdaGrad = 1, kRowWiseAdaGrad = 2, kAdam = 3 };
enum class InitKind : int32_t { kZeros = 0, kUniform = 1, kNormal = 2 };

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.01f;                  ///< learning rate, > 0
  float beta1 = 0.9f;                ///< Adam first-moment decay, in [0, 1)
  float beta2 = 0.999f;              ///< Adam second-moment decay, in [0, 1)
  float eps = 1e-8f;                 ///< added to the denominator, > 0 (0 / 0 at a zero gradient); SGD: unused
  float initial_accumulator = 0.0f;  ///< AdaGrad starting sum of squares, >= 0
};

struct InitializerOptions {
  InitKind kind = InitKind::kUniform;
  float scale = 0.01f;  ///< uniform: half-width of [-scale, scale); normal: standard deviation
  uint64_t seed = 0;    ///< with the key, the only input of a new row's values
};

struct SparseOptimizer {
  int32_t dim = 0;  ///< embedding width, > 0
  OptimizerOptions opt;
  InitializerOptions init;

  // Floats per row: the embedding plus this optimizer's state.
  int32_t row_floats() const;
  // Throws std::invalid_argument naming the bad field: lr and eps finite and
  // > 0 (SGD's eps, unused, >= 0), betas in [0, 1), initial_accumulator and
  // the initializer's scale finite and >= 0. Every table, tier and batch validates the optimizer it
  // is given, and the Python API's (hps.optim.native_optimizer) is made here.
  void validate() const;
  // Writes the initial rows (n, row_floats) of `keys`; the reference for what
  // lookup_or_init stores. Pure and thread-safe.
  void initial_rows(const uint64_t* keys, uint64_t n, float* rows) const;
  // Writes the embeddings (n, dim) of `keys`' initial rows, bit for bit the
  // first dim floats of initial_rows' rows, without making the optimizer state
  // (for a caller that needs only the embeddings). Pure and thread-safe.
  void initial_embeddings(const uint64_t* keys, uint64_t n, float* embeddings) const;
};

// Floats of optimizer state per row for an embedding of width `dim`.
int32_t StateFloats(OptimizerKind kind, int32_t dim);
std::string ToString(OptimizerKind kind);

}  // namespace hps
