// Router, cost model and host executor of include/hps/topology.h.
#include "hps/topology.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hps {
namespace {

int32_t Add(Topology& t, const std::string& name, DeviceKind k, int32_t numa) {
  t.devices.push_back({name, k, numa});
  return static_cast<int32_t>(t.devices.size() - 1);
}
void Link(Topology& t, int32_t a, int32_t b, double gbps, double us, const std::string& kind) {
  t.links.push_back({a, b, gbps, us, kind});
}

// Two sockets, GPUs 0-3 and 4-7 behind two PCIe switches each, NVLink as the
// DGX-1V cube mesh: quads fully meshed, i <-> i+4 across; GPU 0 has no link to 5.
Topology TwoSocket() {
  Topology t;
  for (int g = 0; g < 8; ++g) Add(t, "gpu" + std::to_string(g), DeviceKind::kGpu, g / 4);
  const int32_t cpu0 = Add(t, "cpu0", DeviceKind::kCpu, 0), cpu1 = Add(t, "cpu1", DeviceKind::kCpu, 1);
  for (int sw = 0; sw < 4; ++sw) {
    const int32_t s = Add(t, "sw" + std::to_string(sw), DeviceKind::kSwitch, sw / 2);
    Link(t, s, sw < 2 ? cpu0 : cpu1, 12, 1, "pcie");
    Link(t, 2 * sw, s, 12, 1, "pcie");
    Link(t, 2 * sw + 1, s, 12, 1, "pcie");
  }
  Link(t, cpu0, cpu1, 19, 1, "upi");
  auto nv = [&](int a, int b, int n) { Link(t, a, b, 25.0 * n, 2, "nvlink"); };
  nv(0, 1, 1), nv(0, 2, 1), nv(0, 3, 2), nv(1, 2, 2), nv(1, 3, 1), nv(2, 3, 1);
  nv(4, 5, 1), nv(4, 6, 1), nv(4, 7, 2), nv(5, 6, 2), nv(5, 7, 1), nv(6, 7, 1);
  nv(0, 4, 2), nv(1, 5, 2), nv(2, 6, 2), nv(3, 7, 2);
  return t;
}

std::vector<uint64_t> Even(size_t e, uint64_t b) {
  std::vector<uint64_t> m(e * e, b);
  for (size_t i = 0; i < e; ++i) m[i * e + i] = 0;
  return m;
}

TEST(Topology, RoutesAroundTheMissingLink) {
  const Topology t = TwoSocket();
  const auto m = Even(8, 1 << 20);
  const RoutePlan p = PlanRoutes(t, m, Schedule::kRelay);
  // 0 -> 1 has its own NVLink.
  EXPECT_EQ(p.routes[0 * 8 + 1].kind, RouteKind::kDirect);
  for (int d : {5, 6, 7}) {
    const Route& r = p.routes[0 * 8 + d];
    ASSERT_EQ(r.kind, RouteKind::kRelay) << r.reason;
    // The middleman has NVLinks to both ends: one of 0's quad mates linked
    // across to d, or 4, 0's partner across, linked to d.
    EXPECT_TRUE(r.via == d - 4 || r.via == 4) << r.reason;
    EXPECT_NE(r.reason.find("no direct link"), std::string::npos) << r.reason;
    EXPECT_NE(r.reason.find("host path"), std::string::npos) << r.reason;
    EXPECT_EQ(r.path.front(), 0);
    EXPECT_EQ(r.path.back(), d);
  }
  // Every pair without a link relays; the model says relaying beats the host.
  const RoutePlan host = PlanRoutes(t, m, Schedule::kHost);
  const RoutePlan direct = PlanRoutes(t, m, Schedule::kDirect);
  EXPECT_EQ(host.cost.route_count[static_cast<size_t>(RouteKind::kHost)], 56u);
  EXPECT_EQ(direct.cost.route_count[static_cast<size_t>(RouteKind::kDirect)], 32u);
  EXPECT_LT(p.cost.seconds, direct.cost.seconds);
  EXPECT_LT(direct.cost.seconds, host.cost.seconds);
  EXPECT_GT(p.cost.relayed_bytes, 0u);
}

TEST(Topology, FixedRulesCostNoLessThanTheRouter) {
  const Topology t = TwoSocket();
  const auto m = Even(8, 1 << 20);
  // Paddle's rule: a pair without a link relays via (src + 4) % 8.
  std::vector<int32_t> paddle(64, -1), mate(64, -1);
  for (int s = 0; s < 8; ++s)
    for (int d = 0; d < 8; ++d) {
      const bool linked = s / 4 == d / 4 || d == (s + 4) % 8;
      if (s == d || linked) continue;
      paddle[s * 8 + d] = (s + 4) % 8;
      mate[s * 8 + d] = (d + 4) % 8;  // the destination's partner across: in the source's quad
    }
  const RoutePlan router = PlanRoutes(t, m, Schedule::kRelay);
  const RoutePlan p = FixedRoutes(t, m, paddle);
  const RoutePlan q = FixedRoutes(t, m, mate);
  EXPECT_EQ(p.cost.route_count[static_cast<size_t>(RouteKind::kRelay)], 24u);
  EXPECT_EQ(p.routes[0 * 8 + 5].via, 4);
  EXPECT_EQ(q.routes[0 * 8 + 5].via, 1);
  EXPECT_LE(router.cost.seconds, p.cost.seconds * (1 + 1e-12));
  EXPECT_LE(router.cost.seconds, q.cost.seconds * (1 + 1e-12));
  // A fixed plan's cost is what CostOf says of its routes.
  EXPECT_DOUBLE_EQ(CostOf(t, m, p.routes).seconds, p.cost.seconds);
  // Routes CostOf cannot walk are refused, not read past their paths' ends.
  auto refused = [&](std::vector<Route> routes, const std::string& want) {
    try {
      CostOf(t, m, routes);
      ADD_FAILURE() << "CostOf took a route it cannot walk: " << want;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  std::vector<Route> unwalkable = p.routes;
  unwalkable[0 * 8 + 5].via = 6;  // relay via gpu4 -> says gpu6, which its path does not pass
  refused(unwalkable, "route 5 relays via endpoint 6, which its path does not pass");
  unwalkable = p.routes;
  unwalkable[0 * 8 + 5].path = {0, 5};  // gpu0 and gpu5 have no link
  refused(unwalkable, "route 5's path steps from device 0 to 5, which no link joins");
  unwalkable = p.routes;
  unwalkable[0 * 8 + 5].path.pop_back();
  refused(unwalkable, "route 5's path does not run from gpu0 to gpu5");
  // Errors name the pair.
  std::vector<int32_t> bad(64, -1);
  bad[0 * 8 + 5] = 6;  // gpu6 has no link to gpu0
  try {
    FixedRoutes(t, m, bad);
    FAIL() << "a middleman without a link was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("gpu0 -> gpu5 relays via gpu6, which has no direct path to gpu0"),
              std::string::npos)
        << e.what();
  }
  bad[0 * 8 + 5] = 5;
  EXPECT_THROW(FixedRoutes(t, m, bad), std::invalid_argument);
}

TEST(Topology, HostScheduleCostIsTheSlowestLink) {
  // Two GPUs behind one CPU: 0 -> 1 crosses pcie up (12 GB/s) then down.
  Topology t;
  const int32_t g0 = Add(t, "g0", DeviceKind::kGpu, 0), g1 = Add(t, "g1", DeviceKind::kGpu, 0);
  const int32_t c = Add(t, "cpu", DeviceKind::kCpu, 0);
  Link(t, g0, c, 12, 1, "pcie");
  Link(t, g1, c, 6, 3, "pcie");
  const std::vector<uint64_t> m = {0, 6000000000ull, 0, 0};
  const RoutePlan p = PlanRoutes(t, m, Schedule::kRelay);
  ASSERT_EQ(p.routes[1].kind, RouteKind::kHost);
  // 6e9 B over the 6 GB/s link: 1 s, plus 4 us of hop latency.
  EXPECT_NEAR(p.cost.seconds, 1.0 + 4e-6, 1e-9);
  EXPECT_EQ(p.cost.hops, 2u);
  // Contention: the same bytes both ways share no direction; twice one way do.
  const std::vector<uint64_t> both = {0, 6000000000ull, 6000000000ull, 0};
  EXPECT_NEAR(PlanRoutes(t, both, Schedule::kHost).cost.seconds, 1.0 + 4e-6, 1e-9);
  Link(t, g0, g1, 1, 0, "slow");
  const RoutePlan slow = PlanRoutes(t, m, Schedule::kRelay);
  EXPECT_EQ(slow.routes[1].kind, RouteKind::kHost) << slow.routes[1].reason;
}

// The direct schedule is the baseline of a pair's own link (topology.h): a
// pair with a link takes it even where the host path would be faster, and
// only a pair without one goes through the host.
TEST(Topology, DirectScheduleTakesThePairsOwnLink) {
  Topology t;
  const int32_t g0 = Add(t, "g0", DeviceKind::kGpu, 0), g1 = Add(t, "g1", DeviceKind::kGpu, 0);
  const int32_t g2 = Add(t, "g2", DeviceKind::kGpu, 0), c = Add(t, "cpu", DeviceKind::kCpu, 0);
  for (int32_t g : {g0, g1, g2}) Link(t, g, c, 12, 1, "pcie");
  Link(t, g0, g1, 1, 0, "slow");  // slower than the host path's 12 GB/s
  std::vector<uint64_t> m(9, 1000000);
  for (size_t i = 0; i < 3; ++i) m[i * 3 + i] = 0;
  const RoutePlan p = PlanRoutes(t, m, Schedule::kDirect);
  for (size_t i : {0 * 3 + 1, 1 * 3 + 0}) EXPECT_EQ(p.routes[i].kind, RouteKind::kDirect) << p.routes[i].reason;
  for (size_t i : {0 * 3 + 2, 2 * 3 + 0, 1 * 3 + 2, 2 * 3 + 1})
    EXPECT_EQ(p.routes[i].kind, RouteKind::kHost) << p.routes[i].reason;
  EXPECT_EQ(p.cost.route_count[static_cast<size_t>(RouteKind::kDirect)], 2u);
  // The router, free to choose, leaves the slow link.
  EXPECT_EQ(PlanRoutes(t, m, Schedule::kRelay).routes[1].kind, RouteKind::kHost);
}

TEST(Topology, ContentionSpreadsRelaysOverMiddlemen) {
  // a and b are joined only through three middlemen m0..m2, each by a
  // 10 GB/s link: one middleman alone would carry everything.
  Topology t;
  const int32_t a = Add(t, "a", DeviceKind::kGpu, 0), b = Add(t, "b", DeviceKind::kGpu, 0);
  std::vector<int32_t> mids;
  for (const char* name : {"m0", "m1", "m2"}) {
    mids.push_back(Add(t, name, DeviceKind::kGpu, 0));
    Link(t, a, mids.back(), 10, 0, "nvlink");
    Link(t, mids.back(), b, 10, 0, "nvlink");
  }
  std::vector<uint64_t> m(25, 0);
  m[0 * 5 + 1] = 3000000000ull;  // a -> b only
  const RoutePlan p = PlanRoutes(t, m, Schedule::kRelay);
  ASSERT_EQ(p.routes[1].kind, RouteKind::kRelay);
  // One pair takes one route: two phases of 0.3 s.
  EXPECT_NEAR(p.cost.seconds, 0.6, 1e-9);
  // a also sends to m0 and m1 over their links in phase 1: a relay through
  // either would share that link; through m2 it shares nothing.
  m[0 * 5 + 2] = 3000000000ull;
  m[0 * 5 + 3] = 3000000000ull;
  const RoutePlan q = PlanRoutes(t, m, Schedule::kRelay);
  EXPECT_EQ(q.routes[1].via, 4) << q.routes[1].reason;  // m2 is endpoint 4
  EXPECT_NEAR(q.cost.seconds, 0.6, 1e-9);
  EXPECT_EQ(q.routes[1].kind, RouteKind::kRelay);
}

TEST(Topology, RelayedBytesEqualDirect) {
  const Topology t = TwoSocket();
  std::mt19937_64 rng(7);
  std::vector<uint64_t> m(64);
  for (auto& v : m) v = rng() % 5000;
  m[0 * 8 + 5] = 0;  // an empty pair
  std::vector<std::vector<uint8_t>> send(8), want(8), got(8);
  std::vector<uint64_t> in(8, 0);
  for (size_t s = 0; s < 8; ++s) {
    uint64_t n = 0;
    for (size_t d = 0; d < 8; ++d) n += m[s * 8 + d], in[d] += m[s * 8 + d];
    send[s].resize(n);
    for (auto& c : send[s]) c = static_cast<uint8_t>(rng());
  }
  for (size_t d = 0; d < 8; ++d) want[d].assign(in[d], 0), got[d].assign(in[d], 0xAB);
  // What a direct copy of every segment delivers, computed by hand.
  for (size_t d = 0; d < 8; ++d) {
    uint64_t at = 0;
    for (size_t s = 0; s < 8; ++s) {
      uint64_t off = 0;
      for (size_t k = 0; k < d; ++k) off += m[s * 8 + k];
      std::copy(send[s].begin() + off, send[s].begin() + off + m[s * 8 + d], want[d].begin() + at);
      at += m[s * 8 + d];
    }
  }
  std::vector<const uint8_t*> sp;
  std::vector<uint8_t*> rp;
  for (size_t i = 0; i < 8; ++i) sp.push_back(send[i].data()), rp.push_back(got[i].data());
  for (Schedule sch : {Schedule::kHost, Schedule::kDirect, Schedule::kRelay}) {
    const RoutePlan p = PlanRoutes(t, m, sch);
    for (auto& g : got) std::fill(g.begin(), g.end(), 0xAB);
    const ExecStats st = ExecuteOnHost(p, m, sp, rp);
    for (size_t d = 0; d < 8; ++d) EXPECT_EQ(got[d], want[d]) << "schedule " << static_cast<int>(sch) << " dst " << d;
    if (sch == Schedule::kDirect) {
      EXPECT_GT(st.staged_bytes, 0u);  // pairs without a link go through the host
    }
    if (sch == Schedule::kRelay) {
      EXPECT_GE(st.staged_bytes, p.cost.relayed_bytes);
    }
  }
}

TEST(Topology, RejectsBadInput) {
  Topology t = TwoSocket();
  EXPECT_THROW(PlanRoutes(t, std::vector<uint64_t>(63, 1), Schedule::kRelay), std::invalid_argument);
  Topology dup = t;
  dup.links.push_back(dup.links.back());
  try {
    dup.Validate();
    FAIL() << "a repeated link passed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("repeats link"), std::string::npos) << e.what();
  }
  Topology zero = t;
  zero.links[3].gbps = 0;
  EXPECT_THROW(zero.Validate(), std::invalid_argument);
  Topology self = t;
  self.links[0].b = self.links[0].a;
  EXPECT_THROW(self.Validate(), std::invalid_argument);
  Topology out = t;
  out.links[0].b = 99;
  EXPECT_THROW(out.Validate(), std::invalid_argument);
  Topology name = t;
  name.devices[1].name = "gpu0";
  EXPECT_THROW(name.Validate(), std::invalid_argument);
  // Unreachable: an island GPU.
  Topology island = t;
  Add(island, "gpu8", DeviceKind::kGpu, 0);
  try {
    PlanRoutes(island, Even(9, 10), Schedule::kRelay);
    FAIL() << "an unreachable GPU was routed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no route from gpu0 to gpu8"), std::string::npos) << e.what();
  }
  const RoutePlan p = PlanRoutes(t, Even(8, 10), Schedule::kRelay);
  std::vector<std::vector<uint8_t>> bufs(8, std::vector<uint8_t>(70));
  std::vector<const uint8_t*> sp(7, bufs[0].data());
  std::vector<uint8_t*> rp(8, bufs[1].data());
  EXPECT_THROW(ExecuteOnHost(p, Even(8, 10), sp, rp), std::invalid_argument);
  if (!CudaExecutorAvailable()) {
    std::vector<const uint8_t*> s8(8, bufs[0].data());
    EXPECT_THROW(ExecuteOnCuda(p, Even(8, 10), std::vector<int32_t>(8, 0), s8, rp), std::runtime_error);
  }
}

// Both executors index their staging by a relay's middleman: a plan whose
// middleman is no endpoint is refused before a byte moves (the CUDA executor
// wrote past its staging sizes), checked before the GPU is touched, so without
// one too.
TEST(Topology, BothExecutorsRefuseARelayViaNoEndpoint) {
  const RoutePlan planned = PlanRoutes(TwoSocket(), Even(8, 10), Schedule::kRelay);
  std::vector<std::vector<uint8_t>> bufs(8, std::vector<uint8_t>(70));
  std::vector<const uint8_t*> sp(8, bufs[0].data());
  std::vector<uint8_t*> rp(8, bufs[1].data());
  for (int32_t via : {-1, 8}) {
    RoutePlan p = planned;
    p.routes[1].kind = RouteKind::kRelay;  // (0, 1)
    p.routes[1].via = via;
    const std::string want = "route 1 relays via endpoint " + std::to_string(via) + " of 8";
    try {
      ExecuteOnHost(p, Even(8, 10), sp, rp);
      FAIL() << "the host executor relayed via " << via;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("host executor: " + want), std::string::npos) << e.what();
    }
    try {
      ExecuteOnCuda(p, Even(8, 10), std::vector<int32_t>(8, 0), sp, rp);
      FAIL() << "the CUDA executor relayed via " << via;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("CUDA executor: " + want), std::string::npos) << e.what();
    }
  }
  RoutePlan swapped = planned;
  std::swap(swapped.routes[1], swapped.routes[2]);
  EXPECT_THROW(ExecuteOnCuda(swapped, Even(8, 10), std::vector<int32_t>(8, 0), sp, rp), std::invalid_argument);
}

// Segment offsets and staging sizes are sums of matrix entries: entries whose
// sums wrap to 0 would have passed a caller's buffer-size check with empty
// buffers and sent memcpy 2^63 bytes. Both executors refuse the matrix first.
TEST(Topology, BothExecutorsRefuseAMatrixWhoseSumsOverflow) {
  Topology t;
  const int32_t mem = Add(t, "memory", DeviceKind::kCpu, 0);
  for (int h = 0; h < 3; ++h) Link(t, Add(t, "host" + std::to_string(h), DeviceKind::kHost, 0), mem, 10, 0, "memcpy");
  // Every row, column and the one host staging sum 2 or 6 x 2^63: 0 mod 2^64.
  std::vector<uint64_t> m(9, uint64_t{1} << 63);
  for (size_t i = 0; i < 3; ++i) m[i * 3 + i] = 0;
  const RoutePlan p = PlanRoutes(t, m, Schedule::kHost);
  uint8_t byte = 0;
  const std::vector<const uint8_t*> sp(3, &byte);
  const std::vector<uint8_t*> rp(3, &byte);
  try {
    ExecuteOnHost(p, m, sp, rp);
    FAIL() << "the host executor ran an exchange whose offsets wrap";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("host executor: the transfer matrix's bytes overflow 64 bits at pair (0, 2)"),
              std::string::npos) << e.what();
  }
  try {
    ExecuteOnCuda(p, m, std::vector<int32_t>(3, 0), sp, rp);
    FAIL() << "the CUDA executor ran an exchange whose offsets wrap";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA executor: the transfer matrix's bytes overflow"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace hps
