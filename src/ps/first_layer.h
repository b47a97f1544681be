// The MLP's first layer on a block of a batch's input rows, for a batch that
// runs it while the rows are in the cache (BatchRows::GetProjected and
// AccumulateProjected): the forward product and the embedding columns'
// gradient, for a narrow layer. torch's BLAS (MKL here) copies its (4096,
// 429) operand into packed panels before it multiplies: on W4s's train thread
// (16 outputs) its copy routines took nearly as many perf samples as its
// kernel. These read each row once, from the cache, right after the gather.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>

namespace hps::detail {

// out (rows, outputs) = bias + x (rows, inputs; row i at x + i * x_stride) times
// weight_t (inputs, outputs), the layer's weight transposed.
void ProjectRows(const float* x, uint64_t rows, uint64_t inputs, uint64_t x_stride, const float* weight_t,
                 uint64_t outputs, const float* bias, float* out);

// grad_x (rows, columns) = grad_out (rows, outputs) times weight (outputs, its
// first `columns` columns; row j at weight + j * weight_stride).
void ProjectBack(const float* grad_out, uint64_t rows, uint64_t outputs, const float* weight,
                 uint64_t weight_stride, uint64_t columns, float* grad_x);

// Whether the two run vector kernels for a layer of `outputs` outputs here
// (AVX2 and FMA, outputs = 16); elsewhere they run plain loops, which torch's
// BLAS beats, so a caller takes them only where this says so.
bool ProjectionIsFast(uint64_t outputs);

// The plain loops the two fall back on (the tests hold the vector kernels to them).
void ProjectRowsPlain(const float* x, uint64_t rows, uint64_t inputs, uint64_t x_stride, const float* weight_t,
                      uint64_t outputs, const float* bias, float* out);
void ProjectBackPlain(const float* grad_out, uint64_t rows, uint64_t outputs, const float* weight,
                      uint64_t weight_stride, uint64_t columns, float* grad_x);

}  // namespace hps::detail
