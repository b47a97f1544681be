// A node's topology, the router that picks each transfer's route through it,
// the cost model that predicts an all-to-all's time, and the executors that
// carry out a routed schedule (issue 17; the terabyte-scale paper's section 3).
//
// Topology: devices (GPUs, CPU sockets, PCIe switches, host partitions) and
// full-duplex links between them, each with a bandwidth per direction and a
// latency per hop. Devices that hold data ("endpoints": GPUs and host
// partitions) are what a transfer matrix indexes, in device order. Python
// builds a Topology from a TOML file or from sysfs (hps.topology) and hands it
// over as plain vectors; this file never parses text.
//
// Routes (one per ordered endpoint pair with bytes to move):
//   direct   over the endpoints' own link (NVLink, a host partition's memcpy)
//   host     through the CPUs' memory: the shortest path over non-endpoint
//            devices (PCIe switches, sockets, the inter-socket link); what a
//            peer copy without peer access does
//   relay    two phases: src -> middleman over their link, then middleman ->
//            dst over theirs (the paper's two-phase transfer); the middleman
//            stages the rows in its own memory between the phases
//
// Cost model of a schedule (every pair's route fixed):
//   A schedule runs in phases; phase 1 holds every direct and host transfer
//   and the first leg of every relay, phase 2 the second legs. Within a phase
//   all transfers stream at once, so a link direction carrying L bytes at B
//   bytes/s needs L / B; the phase takes the slowest link direction's time
//   plus the largest sum of hop latencies of a path in it. The schedule takes
//   the sum of its phases. This is a bandwidth-sharing (contention) model, not
//   a simulator: no protocol overhead, no DMA-engine limits, no congestion
//   beyond sharing.
//
// Router: starts from each pair's best route alone (the cheapest of direct,
// host and every relay for its bytes alone), and again from every pair that
// can relay on its cheapest relay (a single move rarely shortens the slowest
// link, and the first relay opens a second phase); from each start, pair by
// pair, it moves a pair to another route when that lowers the whole
// schedule's modelled time (ties broken by the sum of squared link loads, so
// load spreads over links the slowest one does not yet feel), until a round
// changes nothing; the better of the two results wins. Every step
// is a function of the topology and the matrix, so the plan is deterministic.
//
// Cost of planning: each move evaluates the whole schedule, so a plan takes
// O(rounds x pairs x candidates x pairs x hops): milliseconds for one node's 8
// GPUs, too slow for hundreds of endpoints (an incremental evaluation would be
// needed there).
//
// Thread safety: Topology and a RoutePlan are values; the router, the cost
// functions and the executors are pure functions of their arguments.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hps {

enum class DeviceKind : int32_t {
  kGpu = 0,     ///< holds data; transfers start and end here
  kHost = 1,    ///< a host partition (a CPU-memory "device"); holds data
  kCpu = 2,     ///< a socket and its memory: host-path transfers stage here
  kSwitch = 3,  ///< a PCIe switch: forwards only
};

struct TopoDevice {
  std::string name;
  DeviceKind kind = DeviceKind::kGpu;
  int32_t numa = -1;  ///< NUMA node, -1 unknown
};

struct TopoLink {
  int32_t a = 0, b = 0;        ///< device indices
  double gbps = 0;             ///< GB/s (1e9 bytes) per direction, all bridges together
  double latency_us = 0;       ///< per hop
  std::string kind;            ///< "nvlink", "pcie", "upi", "memcpy"...: reported, never interpreted
};

struct Topology {
  std::vector<TopoDevice> devices;
  std::vector<TopoLink> links;

  // Throws std::invalid_argument naming the link or device at fault: a link
  // to a missing device or itself, a non-positive bandwidth, a negative
  // latency, two links between one pair, an empty name or a repeated one.
  void Validate() const;
  // Indices of the endpoints (GPUs and host partitions) in device order.
  std::vector<int32_t> Endpoints() const;
};

enum class RouteKind : int32_t { kNone = 0, kDirect = 1, kHost = 2, kRelay = 3 };

struct Route {
  int32_t src = 0, dst = 0;  ///< endpoint indices (into Endpoints())
  RouteKind kind = RouteKind::kNone;
  int32_t via = -1;          ///< the middleman endpoint of a relay, else -1
  std::vector<int32_t> path; ///< device indices, src first, dst last
  std::string reason;        ///< why this route: its cost alone and the alternatives'
};

// What a schedule costs under the model, and what it puts on each link.
struct ScheduleCost {
  double seconds = 0;
  std::vector<double> phase_seconds;           // (2,) phase 1, phase 2
  std::vector<double> link_bytes;              // (links, 2) a->b then b->a, both phases
  std::vector<uint64_t> route_count;           // (4,) pairs by RouteKind
  uint64_t relayed_bytes = 0;                  // bytes staged on middlemen
  uint64_t hops = 0;                           // sum over pairs with bytes of links crossed
};

struct RoutePlan {
  std::vector<Route> routes;  // (E * E,) row-major by (src, dst); kNone on the diagonal and for 0 bytes
  ScheduleCost cost;
};

// Which routes a schedule may use: kHost only host paths (the baseline the
// paper compares with), kDirect the endpoints' link where there is one and the
// host path elsewhere, kRelay whatever the router finds cheapest.
enum class Schedule : int32_t { kHost = 0, kDirect = 1, kRelay = 2 };

// bytes: (E, E) row-major, bytes[s * E + d] from endpoint s to endpoint d.
// Throws std::invalid_argument if its size is not E * E or E < 1.
RoutePlan PlanRoutes(const Topology& t, const std::vector<uint64_t>& bytes, Schedule schedule);

// A fixed rule's plan, to compare with the router's: pair (s, d) relays via
// endpoint via[s * E + d], or, where that is -1, takes its direct path if it has
// one and the host path otherwise (Paddle's GPU PS relays every pair without a
// link via (s + 4) % 8). Throws std::invalid_argument naming the pair when a
// middleman lacks a direct path to either end or a pair has no route.
RoutePlan FixedRoutes(const Topology& t, const std::vector<uint64_t>& bytes, const std::vector<int32_t>& via);

// The modelled cost of routes already chosen (same layout as RoutePlan::routes).
// Throws std::invalid_argument naming the route when one with bytes is not a
// walk over the topology's links from its source to its destination, or is a
// relay whose path does not pass its middleman.
ScheduleCost CostOf(const Topology& t, const std::vector<uint64_t>& bytes, const std::vector<Route>& routes);

// Executes a plan between buffers in host memory with memcpy: for endpoint s,
// send[s] holds its segments to every d in order (bytes[s*E+d] each); for
// endpoint d, recv[d] receives every s's segment in order. Relays copy into a
// staging buffer owned by the middleman in phase 1 and out of it in phase 2;
// host routes stage in a host buffer the same way (one per first hop). The result equals a
// direct copy of every segment, whatever the routes.
struct ExecStats {
  double seconds = 0;               // wall time of both phases
  std::vector<double> phase_seconds;// (2,)
  uint64_t bytes_copied = 0;        // memcpy bytes, staging included
  uint64_t staged_bytes = 0;        // bytes that went through a staging buffer
};
ExecStats ExecuteOnHost(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                        const std::vector<const uint8_t*>& send, const std::vector<uint8_t*>& recv);

// The same schedule on GPUs (cudaMemcpyPeerAsync; a relay stages in a buffer
// on the middleman, one stream per source, an event between the phases).
// Endpoint e is CUDA device gpu_ids[e]; send/recv point to device memory.
// Throws std::runtime_error when hps was built without CUDA or on a CUDA
// error (with file:line and the call).
ExecStats ExecuteOnCuda(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                        const std::vector<int32_t>& gpu_ids,
                        const std::vector<const uint8_t*>& send, const std::vector<uint8_t*>& recv);
// What ExecuteOnCuda allocates for an exchange: a relay's staging on its
// middleman, a host route's in page-locked memory, a stream an endpoint. A
// caller that exchanges often (the GPUs' row mover: twice a batch) keeps them
// from one call to the next, grown when a call needs more, instead of paying
// for cudaMalloc, cudaMallocHost and stream creation (each of which may
// synchronise the device) on every call. One exchange at a time uses them.
class CudaExchangeBuffers {
 public:
  CudaExchangeBuffers();
  ~CudaExchangeBuffers();
  CudaExchangeBuffers(const CudaExchangeBuffers&) = delete;
  CudaExchangeBuffers& operator=(const CudaExchangeBuffers&) = delete;
  struct State;  // the CUDA build's; empty without CUDA
  State& state() { return *state_; }

 private:
  std::unique_ptr<State> state_;
};
// ExecuteOnCuda with its buffers and streams kept in `kept`.
ExecStats ExecuteOnCuda(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                        const std::vector<int32_t>& gpu_ids, const std::vector<const uint8_t*>& send,
                        const std::vector<uint8_t*>& recv, CudaExchangeBuffers& kept);
// ExecuteOnCuda between host buffers (laid out as ExecuteOnHost's): each
// endpoint's segments are copied to a buffer on its GPU, exchanged there, and
// copied back; the stats are the exchange's. For tests and benchmarks of the
// executor, where gpu_ids may repeat a GPU (a one-GPU machine standing for a
// node). Throws as ExecuteOnCuda does.
ExecStats ExecuteOnCudaFromHost(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                                const std::vector<int32_t>& gpu_ids, const std::vector<const uint8_t*>& send,
                                const std::vector<uint8_t*>& recv);
bool CudaExecutorAvailable();

const char* RouteKindName(RouteKind k);

}  // namespace hps
