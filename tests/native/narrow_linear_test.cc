// The narrow linear kernels: every version this CPU runs gives the portable
// version's bits (the order of the sums is the contract, not the vector width),
// near the exact products, at any row count, stride and thread count.
#include "hps/narrow_linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "table/narrow_linear_versions.h"

namespace {

using hps::detail::NarrowLinearVersion;

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& f : v) f = dist(gen);
  return v;
}

// Bit for bit (memcmp: a NaN or -0 compares as its bits).
bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

const NarrowLinearVersion kVersions[] = {NarrowLinearVersion::kPortable, NarrowLinearVersion::kAvx2,
                                         NarrowLinearVersion::kAvx512};

struct Shape {
  int64_t rows, inputs, outputs, stride_pad;
};

// Row counts around the kernels' groups (8, 4 and 2 rows; 64 for the weight's
// gradient), outputs below, at and between the register widths, input counts
// not a multiple of a vector.
const Shape kShapes[] = {{0, 5, 3, 0},      {1, 1, 1, 0},    {7, 13, 16, 3},    {9, 429, 16, 0},
                         {33, 40, 8, 1},    {130, 17, 9, 5}, {2500, 64, 12, 0}, {1100, 429, 16, 2}};

TEST(NarrowLinear, ForwardVersionsGiveThePortableBitsNearTheExactProduct) {
  for (const Shape& s : kShapes) {
    const int64_t stride = s.inputs + s.stride_pad;
    const auto x = Random(static_cast<size_t>(std::max<int64_t>(1, s.rows * stride)), 1);
    const auto w = Random(static_cast<size_t>(s.outputs * s.inputs), 2);
    const auto b = Random(static_cast<size_t>(s.outputs), 3);
    std::vector<float> want(static_cast<size_t>(s.rows * s.outputs));
    hps::detail::NarrowLinearForwardAs(NarrowLinearVersion::kPortable, x.data(), s.rows, s.inputs, stride, w.data(),
                                       b.data(), s.outputs, want.data(), 1);
    for (int64_t j = 0; j < s.rows; ++j) {
      for (int64_t o = 0; o < s.outputs; ++o) {
        double exact = b[static_cast<size_t>(o)], scale = std::fabs(exact);
        for (int64_t i = 0; i < s.inputs; ++i) {
          const double term = double{x[static_cast<size_t>(j * stride + i)]} * w[static_cast<size_t>(o * s.inputs + i)];
          exact += term;
          scale += std::fabs(term);
        }
        EXPECT_NEAR(want[static_cast<size_t>(j * s.outputs + o)], exact, 1e-6 * scale * (s.inputs + 1))
            << "row " << j << " output " << o;
      }
    }
    for (NarrowLinearVersion v : kVersions) {
      if (!hps::detail::NarrowLinearRuns(v)) continue;
      for (int threads : {1, 3}) {
        for (bool with_bias : {true, false}) {
          std::vector<float> got(want.size(), -1.0f), base(want.size());
          hps::detail::NarrowLinearForwardAs(v, x.data(), s.rows, s.inputs, stride, w.data(),
                                             with_bias ? b.data() : nullptr, s.outputs, got.data(), threads);
          hps::detail::NarrowLinearForwardAs(NarrowLinearVersion::kPortable, x.data(), s.rows, s.inputs, stride,
                                             w.data(), with_bias ? b.data() : nullptr, s.outputs, base.data(), 1);
          EXPECT_TRUE(SameBits(got, base))
              << "version " << static_cast<int>(v) << " threads " << threads << " bias " << with_bias << " rows "
              << s.rows << " inputs " << s.inputs << " outputs " << s.outputs;
        }
      }
    }
  }
}

TEST(NarrowLinear, InputGradVersionsGiveThePortableBitsAndLeaveTheOtherColumns) {
  for (const Shape& s : kShapes) {
    const int64_t columns = std::max<int64_t>(0, s.inputs - 3);  // the embedding columns: not the last ones
    const int64_t out_stride = s.inputs + s.stride_pad;
    const auto g = Random(static_cast<size_t>(std::max<int64_t>(1, s.rows * s.outputs)), 4);
    const auto w = Random(static_cast<size_t>(s.outputs * s.inputs), 5);
    std::vector<float> want(static_cast<size_t>(std::max<int64_t>(1, s.rows * out_stride)), 7.0f);
    hps::detail::NarrowLinearInputGradAs(NarrowLinearVersion::kPortable, g.data(), s.rows, s.outputs, w.data(),
                                         s.inputs, columns, want.data(), out_stride, 1);
    for (int64_t j = 0; j < s.rows; ++j) {
      for (int64_t c = 0; c < out_stride; ++c) {
        const float got = want[static_cast<size_t>(j * out_stride + c)];
        if (c >= columns) {
          EXPECT_EQ(got, 7.0f) << "column " << c << " past `columns` was written";
          continue;
        }
        double exact = 0, scale = 0;
        for (int64_t o = 0; o < s.outputs; ++o) {
          const double term = double{g[static_cast<size_t>(j * s.outputs + o)]} * w[static_cast<size_t>(o * s.inputs + c)];
          exact += term;
          scale += std::fabs(term);
        }
        EXPECT_NEAR(got, exact, 1e-6 * scale * (s.outputs + 1)) << "row " << j << " column " << c;
      }
    }
    for (NarrowLinearVersion v : kVersions) {
      if (!hps::detail::NarrowLinearRuns(v)) continue;
      for (int threads : {1, 3}) {
        std::vector<float> got(want.size(), 7.0f);
        hps::detail::NarrowLinearInputGradAs(v, g.data(), s.rows, s.outputs, w.data(), s.inputs, columns, got.data(),
                                             out_stride, threads);
        EXPECT_TRUE(SameBits(got, want))
            << "version " << static_cast<int>(v) << " threads " << threads << " rows " << s.rows;
      }
    }
  }
}

TEST(NarrowLinear, WeightGradVersionsGiveThePortableBitsNearTheExactProduct) {
  for (const Shape& s : kShapes) {
    const int64_t stride = s.inputs + s.stride_pad;
    const auto g = Random(static_cast<size_t>(std::max<int64_t>(1, s.rows * s.outputs)), 8);
    const auto x = Random(static_cast<size_t>(std::max<int64_t>(1, s.rows * stride)), 9);
    std::vector<float> want(static_cast<size_t>(s.outputs * s.inputs), 7.0f), want_bias(s.outputs, 7.0f);
    hps::detail::NarrowLinearWeightGradAs(NarrowLinearVersion::kPortable, g.data(), s.rows, s.outputs, x.data(),
                                          s.inputs, stride, want.data(), want_bias.data(), 1);
    for (int64_t o = 0; o < s.outputs; ++o) {
      double exact_bias = 0, bias_scale = 0;
      for (int64_t j = 0; j < s.rows; ++j) {
        exact_bias += g[static_cast<size_t>(j * s.outputs + o)];
        bias_scale += std::fabs(g[static_cast<size_t>(j * s.outputs + o)]);
      }
      EXPECT_NEAR(want_bias[static_cast<size_t>(o)], exact_bias, 1e-6 * bias_scale * (s.rows + 1)) << "output " << o;
      for (int64_t i = 0; i < s.inputs; ++i) {
        double exact = 0, scale = 0;
        for (int64_t j = 0; j < s.rows; ++j) {
          const double term = double{g[static_cast<size_t>(j * s.outputs + o)]} * x[static_cast<size_t>(j * stride + i)];
          exact += term;
          scale += std::fabs(term);
        }
        EXPECT_NEAR(want[static_cast<size_t>(o * s.inputs + i)], exact, 1e-6 * scale * (s.rows + 1))
            << "output " << o << " input " << i;
      }
    }
    for (NarrowLinearVersion v : kVersions) {
      if (!hps::detail::NarrowLinearRuns(v)) continue;
      for (int threads : {1, 3}) {
        std::vector<float> got(want.size(), -1.0f), got_bias(want_bias.size(), -1.0f);
        hps::detail::NarrowLinearWeightGradAs(v, g.data(), s.rows, s.outputs, x.data(), s.inputs, stride, got.data(),
                                              got_bias.data(), threads);
        EXPECT_TRUE(SameBits(got, want)) << "version " << static_cast<int>(v) << " threads " << threads << " rows "
                                         << s.rows << " inputs " << s.inputs << " outputs " << s.outputs;
        EXPECT_TRUE(SameBits(got_bias, want_bias)) << "version " << static_cast<int>(v) << " threads " << threads;
        std::vector<float> no_bias(want.size(), -1.0f);
        hps::detail::NarrowLinearWeightGradAs(v, g.data(), s.rows, s.outputs, x.data(), s.inputs, stride,
                                              no_bias.data(), nullptr, threads);
        EXPECT_TRUE(SameBits(no_bias, want)) << "version " << static_cast<int>(v) << " without the bias";
      }
    }
  }
}

TEST(NarrowLinear, TheBestVersionIsOneThisCpuRuns) {
  const std::string name = hps::NarrowLinearKernel();
  const NarrowLinearVersion v = name == "avx512" ? NarrowLinearVersion::kAvx512
                                : name == "avx2" ? NarrowLinearVersion::kAvx2
                                                 : NarrowLinearVersion::kPortable;
  EXPECT_TRUE(hps::detail::NarrowLinearRuns(v)) << name;
  EXPECT_TRUE(hps::detail::NarrowLinearRuns(NarrowLinearVersion::kPortable));
}

TEST(NarrowLinear, BadSizesAreRefusedByName) {
  float x[4] = {}, w[64] = {}, out[64] = {};
  EXPECT_THROW(hps::NarrowLinearForward(x, 1, 2, 2, w, nullptr, 0, out), std::invalid_argument);
  EXPECT_THROW(hps::NarrowLinearForward(x, 1, 2, 2, w, nullptr, 17, out), std::invalid_argument);
  try {
    hps::NarrowLinearForward(x, 1, 4, 3, w, nullptr, 2, out);
    FAIL() << "a stride under the inputs was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("x_stride (3) is less than inputs (4)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(hps::NarrowLinearInputGrad(x, 1, 2, w, 3, 4, out, 4), std::invalid_argument);  // columns > stride
  EXPECT_THROW(hps::NarrowLinearInputGrad(x, 1, 2, w, 4, 4, out, 3), std::invalid_argument);  // out_stride
  EXPECT_THROW(hps::NarrowLinearInputGrad(x, -1, 2, w, 4, 4, out, 4), std::invalid_argument);
  EXPECT_THROW(hps::NarrowLinearWeightGrad(x, 1, 17, w, 2, 2, out, nullptr), std::invalid_argument);  // outputs
  try {
    hps::NarrowLinearWeightGrad(x, 1, 2, w, 4, 3, out, nullptr);
    FAIL() << "a stride under the inputs was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("weight grad: x_stride (3) is less than inputs (4)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
