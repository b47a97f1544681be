#include "hps/narrow_linear.h"

#include <algorithm>
#include <cstddef>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "table/narrow_linear_versions.h"
#include "util/parallel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hps {
namespace detail {
namespace {

constexpr int64_t kLanes = kNarrowLinearMaxOutputs;
// A thread gets at least this many rows: fewer cost more to start than they save.
constexpr int64_t kMinRowsPerThread = 1024;

// Floats on a 64-byte boundary (a cache line, an AVX-512 vector): the kernels
// load the weight a vector at a time, and a load across two lines costs two.
class AlignedFloats {
 public:
  explicit AlignedFloats(size_t n) : storage_(n + kAlign, 0.0f) {
    const auto at = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((kAlign * sizeof(float) - at % (kAlign * sizeof(float))) % (kAlign * sizeof(float))) /
                                  sizeof(float);
  }
  float* data() { return data_; }

 private:
  static constexpr size_t kAlign = 16;  // floats
  std::vector<float> storage_;
  float* data_;
};

struct Forward {
  const float* x;
  int64_t inputs, x_stride;
  const float* weight_t;  // inputs x kLanes: weight transposed, lanes past `outputs` zero
  const float* bias;      // may be null
  int64_t outputs;
  float* out;
};

struct InputGrad {
  const float* grad;
  int64_t outputs;
  const float* weight;
  int64_t weight_stride, columns;
  float* out;
  int64_t out_stride;
};

// The weight's gradient as sums[i][o] (inputs x kLanes, zero at the start):
// a register holds one input column's sums for every output.
struct WeightGrad {
  const float* grad;  // rows x kLanes, zero past `outputs`: a row's loads need no mask
  int64_t rows, outputs;
  const float* x;
  int64_t x_stride;
  float* sums;
};

// The weight's gradient goes over the rows this many at a time, each block of
// columns' sums loaded into registers once for them all: the input is read
// row after row (a few streams the prefetcher follows) and the sums, 27 KB at
// 429 inputs, stay in L1.
constexpr int64_t kWeightGradRows = 8;

// ---- portable: the order every version keeps, one std::fma a term ----

void ForwardPortable(const Forward& a, int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    const float* x = a.x + j * a.x_stride;
    float acc[kLanes] = {};
    for (int64_t i = 0; i < a.inputs; ++i) {
      for (int64_t o = 0; o < a.outputs; ++o) acc[o] = std::fma(x[i], a.weight_t[i * kLanes + o], acc[o]);
    }
    for (int64_t o = 0; o < a.outputs; ++o) a.out[j * a.outputs + o] = a.bias ? acc[o] + a.bias[o] : acc[o];
  }
}

void InputGradPortable(const InputGrad& a, int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    const float* g = a.grad + j * a.outputs;
    float* out = a.out + j * a.out_stride;
    for (int64_t c = 0; c < a.columns; ++c) {
      float acc = 0.0f;
      for (int64_t o = 0; o < a.outputs; ++o) acc = std::fma(g[o], a.weight[o * a.weight_stride + c], acc);
      out[c] = acc;
    }
  }
}

void WeightGradPortable(const WeightGrad& a, int64_t begin, int64_t end) {
  for (int64_t j = 0; j < a.rows; ++j) {
    const float* g = a.grad + j * kLanes;
    const float* x = a.x + j * a.x_stride;
    for (int64_t i = begin; i < end; ++i) {
      float* sums = a.sums + i * kLanes;
      for (int64_t o = 0; o < a.outputs; ++o) sums[o] = std::fma(g[o], x[i], sums[o]);
    }
  }
}

#if defined(__x86_64__)

// ---- AVX-512: the 16 outputs are the lanes of one register ----

__attribute__((target("avx512f"))) void ForwardAvx512(const Forward& a, int64_t begin, int64_t end) {
  const auto mask = static_cast<__mmask16>((1u << a.outputs) - 1u);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias) : _mm512_setzero_ps();
  constexpr int kRows = 8;  // independent sums in flight: an FMA's latency over its throughput, and more
  int64_t j = begin;
  for (; j + kRows <= end; j += kRows) {
    __m512 acc[kRows];
    const float* x[kRows];
    for (int r = 0; r < kRows; ++r) {
      acc[r] = _mm512_setzero_ps();
      x[r] = a.x + (j + r) * a.x_stride;
    }
    for (int64_t i = 0; i < a.inputs; ++i) {
      const __m512 w = _mm512_loadu_ps(a.weight_t + i * kLanes);
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r][i]), w, acc[r]);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 v = a.bias ? _mm512_add_ps(acc[r], bias) : acc[r];
      _mm512_mask_storeu_ps(a.out + (j + r) * a.outputs, mask, v);
    }
  }
  for (; j < end; ++j) {
    const float* x = a.x + j * a.x_stride;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < a.inputs; ++i) {
      acc = _mm512_fmadd_ps(_mm512_set1_ps(x[i]), _mm512_loadu_ps(a.weight_t + i * kLanes), acc);
    }
    _mm512_mask_storeu_ps(a.out + j * a.outputs, mask, a.bias ? _mm512_add_ps(acc, bias) : acc);
  }
}

// A row's tail of columns (fewer than a block), 16 at a time, masked.
__attribute__((target("avx512f"))) void InputGradTailAvx512(const InputGrad& a, const float* g, float* out, int64_t c) {
  for (; c < a.columns; c += kLanes) {
    const int64_t left = std::min<int64_t>(kLanes, a.columns - c);
    const auto mask = static_cast<__mmask16>((1u << left) - 1u);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t o = 0; o < a.outputs; ++o) {
      acc = _mm512_fmadd_ps(_mm512_set1_ps(g[o]), _mm512_maskz_loadu_ps(mask, a.weight + o * a.weight_stride + c),
                            acc);
    }
    _mm512_mask_storeu_ps(out + c, mask, acc);
  }
}

__attribute__((target("avx512f"))) void InputGradAvx512(const InputGrad& a, int64_t begin, int64_t end) {
  // Two rows and four blocks of 16 columns at a time: eight sums in flight,
  // each weight vector loaded once for both rows.
  constexpr int64_t kBlock = 4 * kLanes;
  int64_t j = begin;
  for (; j + 2 <= end; j += 2) {
    const float* g0 = a.grad + j * a.outputs;
    const float* g1 = g0 + a.outputs;
    float* out0 = a.out + j * a.out_stride;
    float* out1 = out0 + a.out_stride;
    int64_t c = 0;
    for (; c + kBlock <= a.columns; c += kBlock) {
      __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, q0 = p0, q1 = p0, q2 = p0, q3 = p0;
      for (int64_t o = 0; o < a.outputs; ++o) {
        const __m512 x0 = _mm512_set1_ps(g0[o]), x1 = _mm512_set1_ps(g1[o]);
        const float* w = a.weight + o * a.weight_stride + c;
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + kLanes);
        const __m512 w2 = _mm512_loadu_ps(w + 2 * kLanes), w3 = _mm512_loadu_ps(w + 3 * kLanes);
        p0 = _mm512_fmadd_ps(x0, w0, p0);
        p1 = _mm512_fmadd_ps(x0, w1, p1);
        p2 = _mm512_fmadd_ps(x0, w2, p2);
        p3 = _mm512_fmadd_ps(x0, w3, p3);
        q0 = _mm512_fmadd_ps(x1, w0, q0);
        q1 = _mm512_fmadd_ps(x1, w1, q1);
        q2 = _mm512_fmadd_ps(x1, w2, q2);
        q3 = _mm512_fmadd_ps(x1, w3, q3);
      }
      _mm512_storeu_ps(out0 + c, p0);
      _mm512_storeu_ps(out0 + c + kLanes, p1);
      _mm512_storeu_ps(out0 + c + 2 * kLanes, p2);
      _mm512_storeu_ps(out0 + c + 3 * kLanes, p3);
      _mm512_storeu_ps(out1 + c, q0);
      _mm512_storeu_ps(out1 + c + kLanes, q1);
      _mm512_storeu_ps(out1 + c + 2 * kLanes, q2);
      _mm512_storeu_ps(out1 + c + 3 * kLanes, q3);
    }
    InputGradTailAvx512(a, g0, out0, c);
    InputGradTailAvx512(a, g1, out1, c);
  }
  for (; j < end; ++j) InputGradTailAvx512(a, a.grad + j * a.outputs, a.out + j * a.out_stride, 0);
}

__attribute__((target("avx512f"))) void WeightGradAvx512(const WeightGrad& a, int64_t begin, int64_t end) {
  const auto mask = static_cast<__mmask16>((1u << a.outputs) - 1u);
  constexpr int64_t kBlock = 16;  // columns a pass: 16 sums in registers, each a row's product of the 16 outputs
  for (int64_t j0 = 0; j0 < a.rows; j0 += kWeightGradRows) {
    const int64_t rows = std::min(kWeightGradRows, a.rows - j0);
    const float* g0 = a.grad + j0 * kLanes;
    const float* x0 = a.x + j0 * a.x_stride;
    int64_t c = begin;
    for (; c + kBlock <= end; c += kBlock) {
      __m512 acc[kBlock];
      float* sums = a.sums + c * kLanes;
      for (int64_t k = 0; k < kBlock; ++k) acc[k] = _mm512_load_ps(sums + k * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 g = _mm512_maskz_loadu_ps(mask, g0 + r * kLanes);
        const float* x = x0 + r * a.x_stride + c;
        for (int64_t k = 0; k < kBlock; ++k) acc[k] = _mm512_fmadd_ps(g, _mm512_set1_ps(x[k]), acc[k]);
      }
      for (int64_t k = 0; k < kBlock; ++k) _mm512_store_ps(sums + k * kLanes, acc[k]);
    }
    for (; c < end; ++c) {
      float* sums = a.sums + c * kLanes;
      __m512 acc = _mm512_load_ps(sums);
      for (int64_t r = 0; r < rows; ++r) {
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, g0 + r * kLanes), _mm512_set1_ps(x0[r * a.x_stride + c]),
                              acc);
      }
      _mm512_store_ps(sums, acc);
    }
  }
}

// ---- AVX2: the outputs in two registers of 8 lanes ----

// Lanes [0, n) of an AVX2 mask for n in [0, 8]: the 8 words from kMaskWords + 8 - n.
constexpr int32_t kMaskWords[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
#define HPS_AVX2_MASK(n) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskWords + 8 - (n)))

__attribute__((target("avx2,fma"))) void ForwardAvx2(const Forward& a, int64_t begin, int64_t end) {
  const int64_t high_lanes = std::max<int64_t>(0, a.outputs - 8);
  const __m256i low_mask = HPS_AVX2_MASK(std::min<int64_t>(8, a.outputs)), high_mask = HPS_AVX2_MASK(high_lanes);
  const __m256 bias_low = a.bias ? _mm256_maskload_ps(a.bias, low_mask) : _mm256_setzero_ps();
  const __m256 bias_high = a.bias && high_lanes ? _mm256_maskload_ps(a.bias + 8, high_mask) : _mm256_setzero_ps();
  constexpr int kRows = 4;
  // (A macro, not a lambda: a lambda would not take the function's target.)
#define HPS_STORE_ROW(row, low, high)                                                                          \
  do {                                                                                                         \
    float* row_out = a.out + (row) * a.outputs;                                                                \
    _mm256_maskstore_ps(row_out, low_mask, a.bias ? _mm256_add_ps(low, bias_low) : (low));                     \
    if (high_lanes) _mm256_maskstore_ps(row_out + 8, high_mask, a.bias ? _mm256_add_ps(high, bias_high) : (high)); \
  } while (0)
  int64_t j = begin;
  for (; j + kRows <= end; j += kRows) {
    __m256 low[kRows], high[kRows];
    const float* x[kRows];
    for (int r = 0; r < kRows; ++r) {
      low[r] = high[r] = _mm256_setzero_ps();
      x[r] = a.x + (j + r) * a.x_stride;
    }
    for (int64_t i = 0; i < a.inputs; ++i) {
      // The next group's rows, a line of each per 16 inputs: four streams
      // 1.7 KB apart outran the hardware's prefetch (cold x: 1.01 -> 0.69 ms
      // at 4096 x 429 on an AMD EPYC; x is read once, after the gather).
      if (i % 16 == 0 && j + 2 * kRows <= end) {
        for (int r = 0; r < kRows; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(x[r] + kRows * a.x_stride + i), _MM_HINT_T0);
        }
      }
      const __m256 wl = _mm256_loadu_ps(a.weight_t + i * kLanes), wh = _mm256_loadu_ps(a.weight_t + i * kLanes + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 xi = _mm256_broadcast_ss(x[r] + i);
        low[r] = _mm256_fmadd_ps(xi, wl, low[r]);
        high[r] = _mm256_fmadd_ps(xi, wh, high[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) HPS_STORE_ROW(j + r, low[r], high[r]);
  }
  for (; j < end; ++j) {
    const float* x = a.x + j * a.x_stride;
    __m256 low = _mm256_setzero_ps(), high = low;
    for (int64_t i = 0; i < a.inputs; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i);
      low = _mm256_fmadd_ps(xi, _mm256_loadu_ps(a.weight_t + i * kLanes), low);
      high = _mm256_fmadd_ps(xi, _mm256_loadu_ps(a.weight_t + i * kLanes + 8), high);
    }
    HPS_STORE_ROW(j, low, high);
  }
#undef HPS_STORE_ROW
}

__attribute__((target("avx2,fma"))) void InputGradAvx2(const InputGrad& a, int64_t begin, int64_t end) {
  constexpr int64_t kWidth = 8, kBlock = 4 * kWidth;
  for (int64_t j = begin; j < end; ++j) {
    const float* g = a.grad + j * a.outputs;
    float* out = a.out + j * a.out_stride;
    int64_t c = 0;
    for (; c + kBlock <= a.columns; c += kBlock) {
      __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      for (int64_t o = 0; o < a.outputs; ++o) {
        const __m256 go = _mm256_set1_ps(g[o]);
        const float* w = a.weight + o * a.weight_stride + c;
        acc0 = _mm256_fmadd_ps(go, _mm256_loadu_ps(w), acc0);
        acc1 = _mm256_fmadd_ps(go, _mm256_loadu_ps(w + kWidth), acc1);
        acc2 = _mm256_fmadd_ps(go, _mm256_loadu_ps(w + 2 * kWidth), acc2);
        acc3 = _mm256_fmadd_ps(go, _mm256_loadu_ps(w + 3 * kWidth), acc3);
      }
      _mm256_storeu_ps(out + c, acc0);
      _mm256_storeu_ps(out + c + kWidth, acc1);
      _mm256_storeu_ps(out + c + 2 * kWidth, acc2);
      _mm256_storeu_ps(out + c + 3 * kWidth, acc3);
    }
    for (; c < a.columns; c += kWidth) {
      const __m256i mask = HPS_AVX2_MASK(std::min<int64_t>(kWidth, a.columns - c));
      __m256 acc = _mm256_setzero_ps();
      for (int64_t o = 0; o < a.outputs; ++o) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(g[o]), _mm256_maskload_ps(a.weight + o * a.weight_stride + c, mask),
                              acc);
      }
      _mm256_maskstore_ps(out + c, mask, acc);
    }
  }
}

__attribute__((target("avx2,fma"))) void WeightGradAvx2(const WeightGrad& a, int64_t begin, int64_t end) {
  // Columns a pass: 12 registers of sums, which with a grad row's two halves
  // and the broadcast input make 15 of the 16. Eight columns (16 sums) spilled
  // three of them to the stack, each FMA then waiting on a store's forwarding.
  constexpr int64_t kBlock = 6;
  for (int64_t j0 = 0; j0 < a.rows; j0 += kWeightGradRows) {
    const int64_t rows = std::min(kWeightGradRows, a.rows - j0);
    const float* g0 = a.grad + j0 * kLanes;
    const float* x0 = a.x + j0 * a.x_stride;
    int64_t c = begin;
    for (; c + kBlock <= end; c += kBlock) {
      // The next rows' line about every 16 columns, as the forward does
      // (cold x: 1.03 -> 0.88 ms at 4096 x 429).
      if (c % 16 < kBlock && j0 + 2 * kWeightGradRows <= a.rows) {
        for (int64_t r = 0; r < kWeightGradRows; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(x0 + (kWeightGradRows + r) * a.x_stride + c), _MM_HINT_T0);
        }
      }
      __m256 low[kBlock], high[kBlock];
      float* sums = a.sums + c * kLanes;
#pragma GCC unroll 6
      for (int64_t k = 0; k < kBlock; ++k) {
        low[k] = _mm256_load_ps(sums + k * kLanes);
        high[k] = _mm256_load_ps(sums + k * kLanes + 8);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* g = g0 + r * kLanes;
        const __m256 gl = _mm256_loadu_ps(g), gh = _mm256_loadu_ps(g + 8);
        const float* x = x0 + r * a.x_stride + c;
#pragma GCC unroll 6
        for (int64_t k = 0; k < kBlock; ++k) {
          const __m256 xk = _mm256_broadcast_ss(x + k);
          low[k] = _mm256_fmadd_ps(gl, xk, low[k]);
          high[k] = _mm256_fmadd_ps(gh, xk, high[k]);
        }
      }
#pragma GCC unroll 6
      for (int64_t k = 0; k < kBlock; ++k) {
        _mm256_store_ps(sums + k * kLanes, low[k]);
        _mm256_store_ps(sums + k * kLanes + 8, high[k]);
      }
    }
    for (; c < end; ++c) {
      float* sums = a.sums + c * kLanes;
      __m256 low = _mm256_load_ps(sums), high = _mm256_load_ps(sums + 8);
      for (int64_t r = 0; r < rows; ++r) {
        const float* g = g0 + r * kLanes;
        const __m256 xc = _mm256_broadcast_ss(x0 + r * a.x_stride + c);
        low = _mm256_fmadd_ps(_mm256_loadu_ps(g), xc, low);
        high = _mm256_fmadd_ps(_mm256_loadu_ps(g + 8), xc, high);
      }
      _mm256_store_ps(sums, low);
      _mm256_store_ps(sums + 8, high);
    }
  }
}

#undef HPS_AVX2_MASK

bool CpuHas(NarrowLinearVersion version) {
  switch (version) {
    case NarrowLinearVersion::kAvx512:
      return __builtin_cpu_supports("avx512f");
    case NarrowLinearVersion::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case NarrowLinearVersion::kPortable:
      return true;
  }
  return false;
}

#else

bool CpuHas(NarrowLinearVersion version) { return version == NarrowLinearVersion::kPortable; }

#endif

NarrowLinearVersion Best() {
  if (CpuHas(NarrowLinearVersion::kAvx512)) return NarrowLinearVersion::kAvx512;
  if (CpuHas(NarrowLinearVersion::kAvx2)) return NarrowLinearVersion::kAvx2;
  return NarrowLinearVersion::kPortable;
}

const NarrowLinearVersion kBest = Best();

void CheckSizes(const char* what, int64_t rows, int64_t outputs, int64_t width, int64_t stride,
                const char* width_name, const char* stride_name) {
  if (outputs < 1 || outputs > kNarrowLinearMaxOutputs) {
    throw std::invalid_argument(std::string(what) + ": outputs must be in [1, " +
                                std::to_string(kNarrowLinearMaxOutputs) + "], got " + std::to_string(outputs));
  }
  if (rows < 0 || width < 0) {
    throw std::invalid_argument(std::string(what) + ": rows and " + width_name + " must be >= 0, got " +
                                std::to_string(rows) + " and " + std::to_string(width));
  }
  if (stride < width) {
    throw std::invalid_argument(std::string(what) + ": " + stride_name + " (" + std::to_string(stride) +
                                ") is less than " + width_name + " (" + std::to_string(width) + ")");
  }
}

// Rows cut into parts of at least kMinRowsPerThread, at most `threads`.
template <class Body>
void ByRows(int64_t rows, int threads, const Body& body) {
  const int64_t by_work = std::max<int64_t>(1, rows / kMinRowsPerThread);
  const int parts = static_cast<int>(std::min<int64_t>(by_work, std::max(1, threads)));
  RunParts(parts, [&](int part) {
    const auto n = static_cast<uint64_t>(rows);
    body(static_cast<int64_t>(PartBegin(n, part, parts)), static_cast<int64_t>(PartBegin(n, part + 1, parts)));
  });
}

// Inputs cut into parts of whole 16-column blocks, at most `threads`, and one
// part when the rows are too few to pay for a thread.
template <class Body>
void ByColumns(int64_t rows, int64_t inputs, int threads, const Body& body) {
  const uint64_t blocks = static_cast<uint64_t>((inputs + kLanes - 1) / kLanes);
  const int parts = rows < kMinRowsPerThread ? 1 : static_cast<int>(std::max<uint64_t>(
                                                       1, std::min<uint64_t>(blocks, std::max(1, threads))));
  RunParts(parts, [&](int part) {
    body(std::min(inputs, static_cast<int64_t>(PartBegin(blocks, part, parts)) * kLanes),
         std::min(inputs, static_cast<int64_t>(PartBegin(blocks, part + 1, parts)) * kLanes));
  });
}

}  // namespace

bool NarrowLinearRuns(NarrowLinearVersion version) { return CpuHas(version); }

void NarrowLinearForwardAs(NarrowLinearVersion version, const float* x, int64_t rows, int64_t inputs,
                           int64_t x_stride, const float* weight, const float* bias, int64_t outputs, float* out,
                           int threads) {
  CheckSizes("narrow linear forward", rows, outputs, inputs, x_stride, "inputs", "x_stride");
  if (!CpuHas(version)) throw std::invalid_argument("narrow linear forward: this CPU lacks the version asked for");
  // The weight transposed into rows of 16 lanes (27 KB at 429 inputs): the
  // kernel's one vector load a term, from L1.
  AlignedFloats weight_t(static_cast<size_t>(inputs * kLanes));
  for (int64_t o = 0; o < outputs; ++o) {
    for (int64_t i = 0; i < inputs; ++i) weight_t.data()[i * kLanes + o] = weight[o * inputs + i];
  }
  const Forward a{x, inputs, x_stride, weight_t.data(), bias, outputs, out};
  ByRows(rows, threads, [&](int64_t begin, int64_t end) {
    switch (version) {
#if defined(__x86_64__)
      case NarrowLinearVersion::kAvx512:
        return ForwardAvx512(a, begin, end);
      case NarrowLinearVersion::kAvx2:
        return ForwardAvx2(a, begin, end);
#endif
      default:
        return ForwardPortable(a, begin, end);
    }
  });
}

void NarrowLinearInputGradAs(NarrowLinearVersion version, const float* grad, int64_t rows, int64_t outputs,
                             const float* weight, int64_t weight_stride, int64_t columns, float* out,
                             int64_t out_stride, int threads) {
  CheckSizes("narrow linear input grad", rows, outputs, columns, weight_stride, "columns", "weight_stride");
  CheckSizes("narrow linear input grad", rows, outputs, columns, out_stride, "columns", "out_stride");
  if (!CpuHas(version)) throw std::invalid_argument("narrow linear input grad: this CPU lacks the version asked for");
  // The weight's first `columns` columns, each row on a cache line's start.
  const int64_t stride = (columns + kLanes - 1) / kLanes * kLanes;
  AlignedFloats weight_rows(static_cast<size_t>(outputs * stride));
  for (int64_t o = 0; o < outputs; ++o) {
    std::copy(weight + o * weight_stride, weight + o * weight_stride + columns, weight_rows.data() + o * stride);
  }
  const InputGrad a{grad, outputs, weight_rows.data(), stride, columns, out, out_stride};
  ByRows(rows, threads, [&](int64_t begin, int64_t end) {
    switch (version) {
#if defined(__x86_64__)
      case NarrowLinearVersion::kAvx512:
        return InputGradAvx512(a, begin, end);
      case NarrowLinearVersion::kAvx2:
        return InputGradAvx2(a, begin, end);
#endif
      default:
        return InputGradPortable(a, begin, end);
    }
  });
}

void NarrowLinearWeightGradAs(NarrowLinearVersion version, const float* grad, int64_t rows, int64_t outputs,
                              const float* x, int64_t inputs, int64_t x_stride, float* grad_weight, float* grad_bias,
                              int threads) {
  CheckSizes("narrow linear weight grad", rows, outputs, inputs, x_stride, "inputs", "x_stride");
  if (!CpuHas(version)) throw std::invalid_argument("narrow linear weight grad: this CPU lacks the version asked for");
  AlignedFloats sums(static_cast<size_t>(inputs * kLanes));  // zeros
  // grad's rows kLanes floats apart, zeros after the outputs (a copy unless
  // there are kLanes outputs): the versions load a row whole.
  std::vector<float> padded;
  const float* grad_rows = grad;
  if (outputs < kLanes) {
    padded.assign(static_cast<size_t>(rows * kLanes), 0.0f);
    for (int64_t j = 0; j < rows; ++j) {
      std::copy(grad + j * outputs, grad + (j + 1) * outputs, padded.data() + j * kLanes);
    }
    grad_rows = padded.data();
  }
  const WeightGrad a{grad_rows, rows, outputs, x, x_stride, sums.data()};
  ByColumns(rows, inputs, threads, [&](int64_t begin, int64_t end) {
    switch (version) {
#if defined(__x86_64__)
      case NarrowLinearVersion::kAvx512:
        WeightGradAvx512(a, begin, end);
        break;
      case NarrowLinearVersion::kAvx2:
        WeightGradAvx2(a, begin, end);
        break;
#endif
      default:
        WeightGradPortable(a, begin, end);
    }
    for (int64_t o = 0; o < outputs; ++o) {
      for (int64_t i = begin; i < end; ++i) grad_weight[o * inputs + i] = sums.data()[i * kLanes + o];
    }
  });
  if (grad_bias == nullptr) return;
  // Plain adds in row order, outside the versions: the same code for all.
  std::fill(grad_bias, grad_bias + outputs, 0.0f);
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t o = 0; o < outputs; ++o) grad_bias[o] += grad[j * outputs + o];
  }
}

}  // namespace detail

void NarrowLinearForward(const float* x, int64_t rows, int64_t inputs, int64_t x_stride, const float* weight,
                         const float* bias, int64_t outputs, float* out, int threads) {
  detail::NarrowLinearForwardAs(detail::kBest, x, rows, inputs, x_stride, weight, bias, outputs, out, threads);
}

void NarrowLinearInputGrad(const float* grad, int64_t rows, int64_t outputs, const float* weight,
                           int64_t weight_stride, int64_t columns, float* out, int64_t out_stride, int threads) {
  detail::NarrowLinearInputGradAs(detail::kBest, grad, rows, outputs, weight, weight_stride, columns, out, out_stride,
                                  threads);
}

void NarrowLinearWeightGrad(const float* grad, int64_t rows, int64_t outputs, const float* x, int64_t inputs,
                            int64_t x_stride, float* grad_weight, float* grad_bias, int threads) {
  detail::NarrowLinearWeightGradAs(detail::kBest, grad, rows, outputs, x, inputs, x_stride, grad_weight, grad_bias,
                                   threads);
}

const char* NarrowLinearKernel() {
  switch (detail::kBest) {
    case detail::NarrowLinearVersion::kAvx512:
      return "avx512";
    case detail::NarrowLinearVersion::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

}  // namespace hps
