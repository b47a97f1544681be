// The CUDA executor of include/hps/topology.h: the host executor's schedule
// with cudaMemcpyPeerAsync. Built only when HPS_CUDA finds nvcc; topology.cc
// holds the stand-in that says CUDA is absent.
#include <cuda_runtime.h>

#include <chrono>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hps/hash_table.h"  // CudaDeviceCount
#include "hps/topology.h"
#include "ps/route_checks.h"
#include "ps/row_mover.h"  // HostStaging
#include "util/cuda_buffer.h"
#include "util/cuda_check.h"

namespace hps {
namespace {

// Device memory freed on scope exit, on its own device.
struct DeviceBuffer {
  int device = 0;
  void* ptr = nullptr;
  DeviceBuffer(int dev, size_t n) : device(dev) {
    HPS_CUDA_TRY(cudaSetDevice(dev));
    if (n > 0) HPS_CUDA_TRY(cudaMalloc(&ptr, n));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) {
      const detail::CurrentDevice keep;
      cudaSetDevice(device);
      cudaFree(ptr);
    }
  }
};

}  // namespace

// Grown, never shrunk; the streams follow the endpoints' GPUs.
struct CudaExchangeBuffers::State {
  std::vector<detail::GrowingBuffer> stage;  // a relay's staging on its middleman, by endpoint
  std::unique_ptr<detail::HostStaging> host = detail::NewHostStaging(/*page_locked=*/true);
  std::vector<int32_t> stream_gpus;          // the GPU each stream was made on
  std::vector<cudaStream_t> streams;         // one an endpoint

  ~State() { DestroyStreams(); }

  // Room for endpoints on gpu_ids: staging slots and a stream each.
  void Fit(const std::vector<int32_t>& gpu_ids) {
    if (stage.size() != gpu_ids.size()) stage = std::vector<detail::GrowingBuffer>(gpu_ids.size());
    if (stream_gpus == gpu_ids) return;
    DestroyStreams();
    for (int32_t gpu : gpu_ids) {
      HPS_CUDA_TRY(cudaSetDevice(gpu));
      cudaStream_t s = nullptr;
      HPS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams.push_back(s);
      stream_gpus.push_back(gpu);
    }
  }

  void DestroyStreams() {
    const detail::CurrentDevice keep;
    for (size_t i = 0; i < streams.size(); ++i) {
      cudaSetDevice(stream_gpus[i]);
      cudaStreamDestroy(streams[i]);
    }
    streams.clear();
    stream_gpus.clear();
  }
};

CudaExchangeBuffers::CudaExchangeBuffers() : state_(std::make_unique<State>()) {}
CudaExchangeBuffers::~CudaExchangeBuffers() = default;

// CudaDeviceCount clears the error a machine without a GPU leaves, which a
// later launch would otherwise report as its own.
bool CudaExecutorAvailable() { return CudaDeviceCount() > 0; }

ExecStats ExecuteOnCuda(const RoutePlan& plan, const std::vector<uint64_t>& bytes, const std::vector<int32_t>& gpu_ids,
                        const std::vector<const uint8_t*>& send, const std::vector<uint8_t*>& recv,
                        CudaExchangeBuffers& kept) {
  const detail::CurrentDevice keep;
  const size_t e = send.size();
  if (recv.size() != e || gpu_ids.size() != e || bytes.size() != e * e || plan.routes.size() != e * e)
    throw std::invalid_argument("CUDA executor: " + std::to_string(send.size()) + " send, " +
                                std::to_string(recv.size()) + " receive buffers, " + std::to_string(gpu_ids.size()) +
                                " GPUs, " + std::to_string(bytes.size()) + " matrix entries and " +
                                std::to_string(plan.routes.size()) + " routes do not describe one E x E exchange");
  // Before a relay's middleman indexes the staging below.
  detail::CheckRoutes("CUDA executor", plan, bytes, e);
  std::vector<uint64_t> send_off(e * e, 0), recv_off(e * e, 0);
  for (size_t s = 0; s < e; ++s)
    for (size_t d = 1; d < e; ++d) send_off[s * e + d] = send_off[s * e + d - 1] + bytes[s * e + d - 1];
  for (size_t d = 0; d < e; ++d)
    for (size_t s = 1; s < e; ++s) recv_off[s * e + d] = recv_off[(s - 1) * e + d] + bytes[(s - 1) * e + d];
  // A relay stages on its middleman; a host route stages in pinned host memory.
  std::vector<uint64_t> need(e, 0), stage_off(e * e, 0);
  uint64_t host_need = 0;
  for (size_t i = 0; i < e * e; ++i) {
    const Route& r = plan.routes[i];
    if (bytes[i] == 0 || i / e == i % e) continue;
    if (r.kind == RouteKind::kRelay) {
      stage_off[i] = need[r.via];
      need[r.via] += bytes[i];
    } else if (r.kind == RouteKind::kHost) {
      stage_off[i] = host_need;
      host_need += bytes[i];
    }
  }
  CudaExchangeBuffers::State& k = kept.state();
  k.Fit(gpu_ids);
  std::vector<uint8_t*> stage(e, nullptr);
  for (size_t m = 0; m < e; ++m) stage[m] = static_cast<uint8_t*>(k.stage[m].Get(gpu_ids[m], need[m]));
  uint8_t* host_stage = nullptr;
  if (host_need > 0) host_stage = reinterpret_cast<uint8_t*>(k.host->Get((host_need + 3) / sizeof(float)));
  const std::vector<cudaStream_t>& streams = k.streams;
  ExecStats st;
  st.phase_seconds.assign(2, 0);
  try {
    using Clock = std::chrono::steady_clock;
    for (int ph = 0; ph < 2; ++ph) {
      const auto t0 = Clock::now();
      for (size_t i = 0; i < e * e; ++i) {
        const size_t s = i / e, d = i % e;
        const uint64_t b = bytes[i];
        if (b == 0) continue;
        const Route& r = plan.routes[i];
        const RouteKind k = s == d ? RouteKind::kDirect : r.kind;
        const uint8_t* from = send[s] + send_off[i];
        uint8_t* to = recv[d] + recv_off[i];
        // Phase 2 runs on the stream of the device that holds the staged rows.
        if (k == RouteKind::kDirect) {
          if (ph == 0) HPS_CUDA_TRY(cudaMemcpyPeerAsync(to, gpu_ids[d], from, gpu_ids[s], b, streams[s]));
        } else if (k == RouteKind::kRelay) {
          uint8_t* buf = stage[r.via] + stage_off[i];
          if (ph == 0) {
            HPS_CUDA_TRY(cudaMemcpyPeerAsync(buf, gpu_ids[r.via], from, gpu_ids[s], b, streams[s]));
          } else {
            HPS_CUDA_TRY(cudaMemcpyPeerAsync(to, gpu_ids[d], buf, gpu_ids[r.via], b, streams[r.via]));
            st.staged_bytes += b;
          }
        } else {
          uint8_t* buf = host_stage + stage_off[i];
          if (ph == 0) {
            HPS_CUDA_TRY(cudaSetDevice(gpu_ids[s]));
            HPS_CUDA_TRY(cudaMemcpyAsync(buf, from, b, cudaMemcpyDeviceToHost, streams[s]));
          } else {
            HPS_CUDA_TRY(cudaSetDevice(gpu_ids[d]));
            HPS_CUDA_TRY(cudaMemcpyAsync(to, buf, b, cudaMemcpyHostToDevice, streams[d]));
            st.staged_bytes += b;
          }
        }
        if (ph == 0 || k != RouteKind::kDirect) st.bytes_copied += b;
      }
      // The phases meet here: every stream drains before the second legs start.
      for (size_t s = 0; s < e; ++s) HPS_CUDA_TRY(cudaStreamSynchronize(streams[s]));
      st.phase_seconds[ph] = std::chrono::duration<double>(Clock::now() - t0).count();
      st.seconds += st.phase_seconds[ph];
    }
  } catch (...) {
    // The kept staging outlives this call: nothing still copying may use it
    // when the next one starts.
    for (size_t s = 0; s < e; ++s) cudaStreamSynchronize(streams[s]);
    throw;
  }
  return st;
}

ExecStats ExecuteOnCudaFromHost(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                                const std::vector<int32_t>& gpu_ids, const std::vector<const uint8_t*>& send,
                                const std::vector<uint8_t*>& recv) {
  const detail::CurrentDevice keep;
  const size_t e = send.size();
  if (recv.size() != e || gpu_ids.size() != e || bytes.size() != e * e)
    throw std::invalid_argument("CUDA executor: " + std::to_string(send.size()) + " send, " +
                                std::to_string(recv.size()) + " receive buffers, " + std::to_string(gpu_ids.size()) +
                                " GPUs and " + std::to_string(bytes.size()) + " matrix entries do not describe one "
                                "E x E exchange");
  std::vector<std::unique_ptr<DeviceBuffer>> out(e), in(e);
  std::vector<const uint8_t*> d_send(e, nullptr);
  std::vector<uint8_t*> d_recv(e, nullptr);
  std::vector<uint64_t> sends(e, 0), receives(e, 0);
  for (size_t s = 0; s < e; ++s) {
    for (size_t d = 0; d < e; ++d) {
      sends[s] += bytes[s * e + d];
      receives[d] += bytes[s * e + d];
    }
  }
  for (size_t i = 0; i < e; ++i) {
    out[i] = std::make_unique<DeviceBuffer>(gpu_ids[i], sends[i]);
    in[i] = std::make_unique<DeviceBuffer>(gpu_ids[i], receives[i]);
    if (sends[i] > 0) HPS_CUDA_TRY(cudaMemcpy(out[i]->ptr, send[i], sends[i], cudaMemcpyHostToDevice));
    d_send[i] = static_cast<const uint8_t*>(out[i]->ptr);
    d_recv[i] = static_cast<uint8_t*>(in[i]->ptr);
  }
  const ExecStats st = ExecuteOnCuda(plan, bytes, gpu_ids, d_send, d_recv);
  for (size_t i = 0; i < e; ++i) {
    if (receives[i] > 0) HPS_CUDA_TRY(cudaMemcpy(recv[i], in[i]->ptr, receives[i], cudaMemcpyDeviceToHost));
  }
  return st;
}

}  // namespace hps
