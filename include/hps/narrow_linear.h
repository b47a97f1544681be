// A dense layer of at most 16 outputs on the CPU: the forward product, the
// input's gradient and the weight's of CtrModel's first layer when it is that
// narrow (W4s: 16 hidden units on 429 input columns).
//
// Why not the BLAS: at these shapes torch's sgemm (MKL on an AMD EPYC) spends
// more time around the product than in it. The forward packs the whole input
// (4096 x 429 floats, 7 MB) before multiplying (the copy took twice the
// multiply's time), and the input's gradient clears its 4096 x 416 output
// before adding into it (as long as the multiply); the weight's gradient, a
// (16 x 4096) by (4096 x 429) product, took it 1.7 ms from cold caches with
// the bias's sum, about the forward's time (W4l line 3). Here each output is
// summed in registers and written once, and the input is read where it lies.
//
// Every output is a sum in a fixed order, one fused multiply-add a term from
// zero, so the AVX-512, AVX2 and portable versions give the same bits and a
// run's bits do not depend on the machine's vector width or on `threads`.
#pragma once

#include <cstdint>

namespace hps {

inline constexpr int64_t kNarrowLinearMaxOutputs = 16;

// out (rows, outputs), contiguous = x (rows, inputs; rows x_stride floats
// apart) times weight^T (weight: outputs x inputs, contiguous), plus bias
// (outputs; may be null). out[j][o] = (sum over i in order of x[j][i] *
// weight[o][i], each term fused) + bias[o]. `threads` splits the rows.
// Throws std::invalid_argument for outputs outside [1, 16], a negative
// size, or x_stride < inputs.
void NarrowLinearForward(const float* x, int64_t rows, int64_t inputs, int64_t x_stride, const float* weight,
                         const float* bias, int64_t outputs, float* out, int threads = 1);

// out (rows, columns; rows out_stride floats apart) = grad (rows, outputs,
// contiguous) times the first `columns` columns of weight (outputs x
// weight_stride): out[j][c] = sum over o in order of grad[j][o] * weight[o][c],
// each term fused. Throws std::invalid_argument as NarrowLinearForward, and
// for columns > weight_stride or out_stride < columns.
void NarrowLinearInputGrad(const float* grad, int64_t rows, int64_t outputs, const float* weight,
                           int64_t weight_stride, int64_t columns, float* out, int64_t out_stride, int threads = 1);

// grad_weight (outputs x inputs, contiguous) = grad^T times x, with grad
// (rows, outputs) contiguous and x (rows, inputs; rows x_stride floats apart):
// grad_weight[o][i] = sum over rows j in order of grad[j][o] * x[j][i], each
// term fused, from zero. grad_bias (outputs; may be null) = sum over j in
// order of grad[j][o]. `threads` splits the inputs, so each sum keeps its
// order. Throws std::invalid_argument as NarrowLinearForward.
void NarrowLinearWeightGrad(const float* grad, int64_t rows, int64_t outputs, const float* x, int64_t inputs,
                            int64_t x_stride, float* grad_weight, float* grad_bias, int threads = 1);

// Which version runs on this CPU: "avx512", "avx2" or "portable".
const char* NarrowLinearKernel();

}  // namespace hps
