// The device tier's row mover on host partitions: what the GPUs' mover does
// with kernels and peer copies, here with the same row bodies and memcpy.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "ps/row_mover.h"

namespace hps::detail {
namespace {

TEST(RowMover, DirectPlanExchangesEverySegmentAsACopyWould) {
  const int32_t e = 3;
  const RoutePlan plan = DirectPlan(e);
  ASSERT_EQ(plan.routes.size(), 9u);
  EXPECT_EQ(plan.routes[0].kind, RouteKind::kNone);  // the diagonal copies in place
  EXPECT_EQ(plan.routes[1].kind, RouteKind::kDirect);
  EXPECT_EQ(plan.routes[5].src, 1);
  EXPECT_EQ(plan.routes[5].dst, 2);
  auto mover = NewHostRowMover(e);
  // Source s sends (s + 1) * (d + 1) floats to d, each float naming (s, d, i).
  std::vector<uint64_t> bytes(9);
  std::vector<const uint8_t*> send(e);
  std::vector<uint8_t*> receive(e);
  for (int32_t s = 0; s < e; ++s) {
    std::vector<float> all;
    for (int32_t d = 0; d < e; ++d) {
      const int32_t n = (s + 1) * (d + 1);
      bytes[static_cast<size_t>(s * e + d)] = n * sizeof(float);
      for (int32_t i = 0; i < n; ++i) all.push_back(static_cast<float>(100 * s + 10 * d + i));
    }
    float* buf = mover->Buffer(s, RowMover::kSend, all.size());
    std::memcpy(buf, all.data(), all.size() * sizeof(float));
    send[static_cast<size_t>(s)] = reinterpret_cast<const uint8_t*>(buf);
  }
  for (int32_t d = 0; d < e; ++d) {
    uint64_t floats = 0;
    for (int32_t s = 0; s < e; ++s) floats += (s + 1) * (d + 1);
    receive[static_cast<size_t>(d)] = reinterpret_cast<uint8_t*>(mover->Buffer(d, RowMover::kReceive, floats));
  }
  mover->Exchange(plan, bytes, send, receive);
  for (int32_t d = 0; d < e; ++d) {
    const float* got = reinterpret_cast<const float*>(receive[static_cast<size_t>(d)]);
    for (int32_t s = 0; s < e; ++s) {  // by source, in order
      for (int32_t i = 0; i < (s + 1) * (d + 1); ++i) EXPECT_EQ(*got++, static_cast<float>(100 * s + 10 * d + i));
    }
  }
}

// Without a topology each pair's route is the one link from its source to
// its destination (topology.h's paths: source first, destination last); a
// device's rows to itself take no route.
TEST(RowMover, DirectPlanRoutesEachPairOverItsOwnLink) {
  const int32_t e = 3;
  const RoutePlan plan = DirectPlan(e);
  ASSERT_EQ(plan.routes.size(), 9u);
  for (int32_t s = 0; s < e; ++s) {
    for (int32_t d = 0; d < e; ++d) {
      const Route& r = plan.routes[static_cast<size_t>(s * e + d)];
      EXPECT_EQ(r.src, s);
      EXPECT_EQ(r.dst, d);
      EXPECT_EQ(r.via, -1) << s << " -> " << d;
      if (s == d) {
        EXPECT_EQ(r.kind, RouteKind::kNone);
        EXPECT_TRUE(r.path.empty()) << s << " -> " << d;
      } else {
        EXPECT_EQ(r.kind, RouteKind::kDirect);
        EXPECT_EQ(r.path, (std::vector<int32_t>{s, d})) << s << " -> " << d;
        EXPECT_FALSE(r.reason.empty()) << s << " -> " << d;
      }
    }
  }
}

TEST(RowMover, ScatterOutAndGatherInAreInversesByIndex) {
  auto mover = NewHostRowMover(2);
  const uint32_t dim = 3;
  const std::vector<uint64_t> index = {2, 0, 3, 1};  // row j of the buffer is row index[j] of the caller's
  std::vector<float> buffer(4 * dim), out(4 * dim, -1.0f), back(4 * dim, -1.0f);
  for (uint64_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<float>(i);
  mover->ScatterOut(1, index.data(), 4, dim, buffer.data(), out.data());
  for (uint64_t j = 0; j < 4; ++j) {
    for (uint32_t c = 0; c < dim; ++c) EXPECT_EQ(out[index[j] * dim + c], buffer[j * dim + c]);
  }
  mover->GatherIn(1, index.data(), 4, dim, out.data(), back.data());
  EXPECT_EQ(back, buffer);
}

TEST(RowMover, ABufferKeepsItsAddressUntilItMustGrow) {
  auto mover = NewHostRowMover(1);
  float* a = mover->Buffer(0, RowMover::kSend, 16);
  EXPECT_EQ(mover->Buffer(0, RowMover::kSend, 8), a);
  EXPECT_EQ(mover->Buffer(0, RowMover::kSend, 16), a);  // exactly its size is not too small
  EXPECT_NE(mover->Buffer(0, RowMover::kReceive, 8), a);  // slots are apart
  EXPECT_THROW(mover->Buffer(1, RowMover::kSend, 8), std::out_of_range);  // no device 1
}

}  // namespace
}  // namespace hps::detail
