// NarrowLinear's versions by name, for the test that holds them to the same
// bits (tests/native/narrow_linear_test.cc); the public functions run the best
// one this CPU has.
#pragma once

#include <cstdint>

namespace hps::detail {

enum class NarrowLinearVersion { kPortable, kAvx2, kAvx512 };

// Whether this CPU runs `version`.
bool NarrowLinearRuns(NarrowLinearVersion version);

void NarrowLinearForwardAs(NarrowLinearVersion version, const float* x, int64_t rows, int64_t inputs,
                           int64_t x_stride, const float* weight, const float* bias, int64_t outputs, float* out,
                           int threads);

void NarrowLinearInputGradAs(NarrowLinearVersion version, const float* grad, int64_t rows, int64_t outputs,
                             const float* weight, int64_t weight_stride, int64_t columns, float* out,
                             int64_t out_stride, int threads);

void NarrowLinearWeightGradAs(NarrowLinearVersion version, const float* grad, int64_t rows, int64_t outputs,
                              const float* x, int64_t inputs, int64_t x_stride, float* grad_weight, float* grad_bias,
                              int threads);

}  // namespace hps::detail
