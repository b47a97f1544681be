// OldHerald over the baseline's hps_old::Herald (old_api.h).
#include "old_api.h"

#include <utility>

#include "hps/herald.h"  // the baseline's header, its namespace renamed hps_old

namespace {

OldPlan Convert(hps_old::HeraldPlan&& p) {
  OldPlan o;
  o.assignment = std::move(p.assignment);
  o.fetch_offsets = std::move(p.fetch_offsets);
  o.fetch_keys = std::move(p.fetch_keys);
  o.fetch_from = std::move(p.fetch_from);
  o.comm_offsets = std::move(p.comm_offsets);
  o.comm_keys = std::move(p.comm_keys);
  o.evicted = std::move(p.evicted);
  o.lost_keys = std::move(p.lost_keys);
  o.lost_from = std::move(p.lost_from);
  o.pulls = p.pulls;
  o.peer_pulls = p.peer_pulls;
  o.pushes = p.pushes;
  o.evict_pushes = p.evict_pushes;
  o.shared = p.shared;
  o.distinct = p.distinct;
  return o;
}

hps_old::Herald* H(void* p) { return static_cast<hps_old::Herald*>(p); }

}  // namespace

OldHerald::OldHerald(int32_t workers, uint64_t capacity, bool location_aware, bool on_demand) {
  hps_old::HeraldOptions o;
  o.workers = workers;
  o.capacity = capacity;
  o.location_aware = location_aware;
  o.on_demand = on_demand;
  impl_ = new hps_old::Herald(o);
}
OldHerald::~OldHerald() { delete H(impl_); }
OldPlan OldHerald::Schedule(const uint64_t* offsets, uint64_t n, const uint64_t* keys, const uint64_t* upcoming,
                            uint64_t n_upcoming) {
  return Convert(H(impl_)->Schedule(offsets, n, keys, upcoming, n_upcoming));
}
OldPlan OldHerald::Schedule(const uint64_t* keys, uint64_t n, int32_t fields) {
  return Convert(H(impl_)->Schedule(keys, n, fields));
}
uint64_t OldHerald::cached(int32_t worker) const { return H(impl_)->cached(worker); }
std::vector<uint64_t> OldHerald::Cached(int32_t worker) const { return H(impl_)->Cached(worker); }
uint64_t OldHerald::memory_bytes() const { return H(impl_)->memory_bytes(); }
void OldHerald::Clear() { H(impl_)->Clear(); }
