#include "hps/optimizer.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "table/optimizer_kernels.h"  // InitRow, InitEmbedding

namespace hps {

int32_t StateFloats(OptimizerKind kind, int32_t dim) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return 0;
    case OptimizerKind::kAdaGrad:
      return dim;
    case OptimizerKind::kRowWiseAdaGrad:
      return 1;
    case OptimizerKind::kAdam:
      return 2 * dim + 1;
  }
  throw std::invalid_argument("unknown optimizer kind " + std::to_string(static_cast<int>(kind)));
}

std::string ToString(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdaGrad:
      return "adagrad";
    case OptimizerKind::kRowWiseAdaGrad:
      return "rowwise_adagrad";
    case OptimizerKind::kAdam:
      return "adam";
  }
  return "unknown";
}

int32_t SparseOptimizer::row_floats() const { return dim + StateFloats(opt.kind, dim); }

void SparseOptimizer::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("optimizer: " + what); };
  if (dim <= 0) fail("dim must be > 0, got " + std::to_string(dim));
  // Adam's row is 3 x dim + 1 floats, counted in int32_t: past this it overflows.
  constexpr int32_t kMaxDim = (INT32_MAX - 1) / 3;
  if (dim > kMaxDim) fail("dim must be at most " + std::to_string(kMaxDim) + ", got " + std::to_string(dim));
  StateFloats(opt.kind, dim);  // throws on an unknown kind
  if (!(opt.lr > 0.0f) || !std::isfinite(opt.lr)) fail("lr must be a finite number > 0");
  // eps = 0 divides 0 by 0 where a row's sum of squares (AdaGrad's, from
  // initial_accumulator 0) or second moment (Adam's) is still 0 and its
  // gradient is 0 (a key pushed with a zero gradient: NaN for good). SGD does
  // not read it.
  if (opt.kind == OptimizerKind::kSgd) {
    if (!(opt.eps >= 0.0f) || !std::isfinite(opt.eps)) fail("eps must be a finite number >= 0");
  } else if (!(opt.eps > 0.0f) || !std::isfinite(opt.eps)) {
    fail("eps must be a finite number > 0 (with eps = 0, " + ToString(opt.kind) +
         " can step a zero gradient by 0 / 0)");
  }
  if (!(opt.beta1 >= 0.0f && opt.beta1 < 1.0f)) fail("beta1 must be in [0, 1)");
  if (!(opt.beta2 >= 0.0f && opt.beta2 < 1.0f)) fail("beta2 must be in [0, 1)");
  if (!(opt.initial_accumulator >= 0.0f) || !std::isfinite(opt.initial_accumulator)) {
    fail("initial_accumulator must be a finite number >= 0");
  }
  if (init.kind != InitKind::kZeros && init.kind != InitKind::kUniform &&
      init.kind != InitKind::kNormal) {
    fail("unknown initializer kind " + std::to_string(static_cast<int>(init.kind)));
  }
  if (!(init.scale >= 0.0f) || !std::isfinite(init.scale)) {
    fail("initializer scale must be a finite number >= 0");
  }
}

void SparseOptimizer::initial_rows(const uint64_t* keys, uint64_t n, float* rows) const {
  validate();
  const int64_t stride = row_floats();
  for (uint64_t i = 0; i < n; ++i) detail::InitRow(*this, keys[i], rows + i * stride);
}

void SparseOptimizer::initial_embeddings(const uint64_t* keys, uint64_t n, float* embeddings) const {
  validate();
  const int64_t stride = dim;
  for (uint64_t i = 0; i < n; ++i) detail::InitEmbedding(*this, keys[i], embeddings + i * stride);
}

}  // namespace hps
