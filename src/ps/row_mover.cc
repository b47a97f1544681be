#include "ps/row_mover.h"

#include <stdexcept>
#include <string>

namespace hps::detail {
namespace {

class PlainHostStaging final : public HostStaging {
 public:
  float* Get(uint64_t floats) override {
    if (floats > size_) {
      data_ = std::make_unique_for_overwrite<float[]>(floats);  // (no zeroing: it is written before read)
      size_ = floats;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<float[]> data_;
  uint64_t size_ = 0;
};

// Host partitions: buffers in host memory, rows moved by the row bodies' loops.
class HostRowMover final : public RowMover {
 public:
  explicit HostRowMover(int32_t devices) : buffers_(static_cast<size_t>(devices) * kSlots) {}

  float* Buffer(int32_t device, Slot slot, uint64_t floats) override {
    return buffers_.at(static_cast<size_t>(device) * kSlots + slot).Get(floats);
  }

  void Exchange(const RoutePlan& plan, const std::vector<uint64_t>& bytes, const std::vector<const uint8_t*>& send,
                const std::vector<uint8_t*>& receive) override {
    ExecuteOnHost(plan, bytes, send, receive);
  }

  void ScatterOut(int32_t, const uint64_t* index, uint64_t n, uint32_t dim, const float* in, float* out) override {
    for (uint64_t j = 0; j < n; ++j) ScatterRow(out, in, index, j, dim);
  }

  void GatherIn(int32_t, const uint64_t* index, uint64_t n, uint32_t dim, const float* in, float* out) override {
    for (uint64_t j = 0; j < n; ++j) GatherRow(out, in, index, j, dim);
  }

 private:
  std::vector<PlainHostStaging> buffers_;  // [device * kSlots + slot]
};

}  // namespace

std::unique_ptr<HostStaging> NewPlainHostStaging() { return std::make_unique<PlainHostStaging>(); }

std::unique_ptr<RowMover> NewHostRowMover(int32_t devices) { return std::make_unique<HostRowMover>(devices); }

RoutePlan DirectPlan(int32_t endpoints) {
  RoutePlan plan;
  const auto e = static_cast<size_t>(endpoints);
  plan.routes.resize(e * e);
  for (size_t i = 0; i < e * e; ++i) {
    Route& r = plan.routes[i];
    r.src = static_cast<int32_t>(i / e);
    r.dst = static_cast<int32_t>(i % e);
    r.kind = r.src == r.dst ? RouteKind::kNone : RouteKind::kDirect;
    if (r.kind == RouteKind::kDirect) {
      r.path = {r.src, r.dst};
      r.reason = "direct (no topology given)";
    }
  }
  return plan;
}

#if !HPS_HAVE_CUDA
std::unique_ptr<HostStaging> NewHostStaging(bool) { return NewPlainHostStaging(); }

std::unique_ptr<RowMover> NewCudaRowMover(const std::vector<int32_t>&) {
  throw std::runtime_error("device tier: moving rows between GPUs needs CUDA, and this build of hps has none "
                           "(configure with HPS_CUDA=ON and nvcc on the PATH)");
}
#endif

}  // namespace hps::detail
