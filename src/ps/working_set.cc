#include "hps/working_set.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include "hps/hash_table.h"
#include "format/key_index.h"

namespace hps {

// Up to 8 of `keys`, for an error message.
static std::string Named(const std::vector<uint64_t>& keys) {
  std::string which = "keys ";
  for (size_t j = 0; j < keys.size() && j < 8; ++j) which += (j > 0 ? ", " : "") + std::to_string(keys[j]);
  if (keys.size() > 8) which += ", ...";
  return which;
}

// Written once by the batch's Apply (or its release, empty), then read only.
struct WorkingSet::Updates {
  std::mutex mutex;
  std::condition_variable ready_cv;
  bool ready = false;  // GUARDED_BY(mutex); keys and rows are fixed once it is set
  std::vector<uint64_t> keys;
  std::vector<float> rows;     // (keys, row_floats); empty when in_mem_ps
  // Set by the batch's Load, for the next batch's: how it holds its rows.
  bool loaded = false;
  bool in_mem_ps = false;  // on a tier bound to host rows: it steps MEM-PS's rows where they lie
};

WorkingSet::WorkingSet(MemCache& cache, const SparseOptimizer& optimizer, int32_t devices, const uint64_t* keys,
                       uint64_t n)
    : cache_(cache), optimizer_(optimizer), devices_(devices), updates_(std::make_shared<Updates>()) {
  optimizer_.validate();
  if (devices <= 0) throw std::invalid_argument("working set: devices must be > 0");
  if (cache.row_bytes() != sizeof(float) * static_cast<uint64_t>(optimizer_.row_floats())) {
    throw std::invalid_argument("working set: MEM-PS rows are " + std::to_string(cache.row_bytes()) +
                                " bytes, the optimizer's " + std::to_string(sizeof(float) * optimizer_.row_floats()));
  }
  inverse_.resize(n);
  keys_ = UniqueKeys(keys, n, inverse_.data());  // names a reserved key
  if (keys_.size() >= detail::KeyIndex::kNone) throw std::invalid_argument("working set: more than 2^32 - 2 keys");
  CountPerDevice();
  // Last: from here on the pins are this object's to release.
  std::vector<uint8_t> hit(keys_.size());
  addresses_.resize(keys_.size());
  cache_.Pin(keys_.data(), keys_.size(), hit.data(), addresses_.data());
  hits_ = static_cast<uint64_t>(std::count(hit.begin(), hit.end(), uint8_t{1}));
}

WorkingSet::~WorkingSet() {
  if (released_) return;
  try {
    ReleaseAll();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hps: a working set of %zu keys released by its destructor: %s\n", keys_.size(), e.what());
  } catch (...) {
    std::fprintf(stderr, "hps: a working set of %zu keys released by its destructor: unknown error\n",
                 keys_.size());
  }
}

void WorkingSet::CountPerDevice() {
  per_device_.assign(static_cast<size_t>(devices_), 0);
  for (uint64_t i = 0; i < keys_.size(); ++i) {
    const int32_t d = owners_.empty() ? DeviceTier::ModuloOwner(keys_[i], devices_) : owners_[i];
    ++per_device_[static_cast<size_t>(d)];
  }
}

uint64_t WorkingSet::most_per_device() const {
  return per_device_.empty() ? 0 : *std::max_element(per_device_.begin(), per_device_.end());
}

void WorkingSet::SetOwners(const int32_t* owners) {
  if (released_ || tier_ != nullptr) throw std::logic_error("working set: owners are set before load");
  for (uint64_t i = 0; i < keys_.size(); ++i) {
    if (owners[i] < 0 || owners[i] >= devices_) {
      throw std::invalid_argument("working set: owners[" + std::to_string(i) + "] = " + std::to_string(owners[i]) +
                                  " (key " + std::to_string(keys_[i]) + ") is not a device in [0, " +
                                  std::to_string(devices_) + ")");
    }
  }
  Index();
  owners_.assign(owners, owners + keys_.size());
  CountPerDevice();
}

const detail::KeyIndex& WorkingSet::Index() const {
  if (!index_) {
    auto index = std::make_unique<detail::KeyIndex>(keys_.size());
    for (uint64_t i = 0; i < keys_.size(); ++i) index->Upsert(keys_[i], static_cast<uint32_t>(i));
    index_ = std::move(index);
  }
  return *index_;
}

void WorkingSet::Positions(const uint64_t* keys, uint64_t n, int64_t* positions) const {
  const detail::KeyIndex& index = Index();
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t at = index.Find(keys[i]);
    if (at == detail::KeyIndex::kNone) {
      throw std::out_of_range("working set positions: keys[" + std::to_string(i) + "] = " + std::to_string(keys[i]) +
                              " is not in the batch");
    }
    positions[i] = at;
  }
}

const int32_t* WorkingSet::OwnersOf(const uint64_t* keys, uint64_t n, std::vector<int32_t>* out,
                                    const char* what) const {
  if (owners_.empty()) return nullptr;  // the tier's own modulo hash
  out->resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t at = Index().Find(keys[i]);
    if (at == detail::KeyIndex::kNone) {
      throw std::out_of_range("working set " + std::string(what) + ": keys[" + std::to_string(i) + "] = " +
                              std::to_string(keys[i]) + " is not in the batch");
    }
    (*out)[i] = owners_[at];
  }
  return out->data();
}

void WorkingSet::Load(DeviceTier& tier, std::shared_ptr<Updates> previous) {
  if (released_) throw std::logic_error("working set: load after release");
  if (tier_ != nullptr) throw std::logic_error("working set: loaded twice");
  try {
    if (tier.devices() != devices_ || tier.row_floats() != optimizer_.row_floats() || tier.size() != 0) {
      throw std::invalid_argument("working set load: the tier has " + std::to_string(tier.devices()) +
                                  " devices, rows of " + std::to_string(tier.row_floats()) + " floats and " +
                                  std::to_string(tier.size()) + " rows; the batch needs an empty one of " +
                                  std::to_string(devices_) + " devices and rows of " +
                                  std::to_string(optimizer_.row_floats()) + " floats");
    }
    const int32_t* owners = owners_.empty() ? nullptr : owners_.data();
    if (previous) {
      // A copying batch writes its rows into MEM-PS at its write-back, which
      // may come after a bound batch stepped them; a bound one steps MEM-PS's
      // rows while a copying one may be reading them in: the pipeline's tiers
      // are of one kind, and a mix is refused.
      bool previous_loaded, previous_in_mem_ps;
      {
        std::lock_guard lock(previous->mutex);
        previous_loaded = previous->loaded;
        previous_in_mem_ps = previous->in_mem_ps;
      }
      if (previous_loaded && previous_in_mem_ps != tier.binds_host_rows()) {
        throw std::invalid_argument(std::string("working set load: the batch before this one ") +
                                    (previous_in_mem_ps ? "is bound to MEM-PS's rows" : "holds copies of its rows") +
                                    ", this tier " + (tier.binds_host_rows() ? "binds them" : "copies them") +
                                    "; pipelined batches need tiers of one kind");
      }
    }
    if (tier.binds_host_rows()) {
      // The tier reads and steps MEM-PS's pinned rows where they lie: nothing
      // to copy in now or out at the write-back.
      tier.BindHostRows(keys_.data(), keys_.size(), owners, addresses_.data());
      in_mem_ps_ = true;
    } else {
      // MEM-PS's rows as they are now, not as the prefetch found them: a batch
      // written back since may have updated some (they are pinned, so cached).
      float* rows = tier.StagingRows(keys_.size() * static_cast<uint64_t>(optimizer_.row_floats()));
      cache_.ReadPinned(keys_.data(), keys_.size(), reinterpret_cast<uint8_t*>(rows), addresses_.data());
      tier.Insert(keys_.data(), keys_.size(), rows, owners);
      tier.Bind(keys_.data(), keys_.size(), owners);
    }
    std::lock_guard lock(updates_->mutex);
    updates_->loaded = true;
    updates_->in_mem_ps = in_mem_ps_;
  } catch (...) {
    try {
      tier.Clear();
      ReleaseAll();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "hps: a working set whose load failed was not released: %s\n", e.what());
    }
    throw;
  }
  tier_ = &tier;
  previous_ = std::move(previous);
}

void WorkingSet::CheckLoaded(const char* what) const {
  if (released_) throw std::logic_error(std::string("working set: ") + what + " after release");
  if (tier_ == nullptr) throw std::logic_error(std::string("working set: ") + what + " before load");
}

void WorkingSet::CatchUp() {
  if (!previous_) return;
  Updates& p = *previous_;
  {
    std::unique_lock lock(p.mutex);
    p.ready_cv.wait(lock, [&] { return p.ready; });
  }
  // Bound to host rows, both batches step MEM-PS's rows: waiting was all.
  if (!p.in_mem_ps && !p.keys.empty()) {
    if (owners_.empty()) {
      tier_->Assign(p.keys.data(), p.keys.size(), p.rows.data(), nullptr);  // skips keys not in this batch
    } else {
      // On this batch's owners: a policy may place a key on another device
      // than the batch before did, and the tier looks a key up on the owner
      // it is given only.
      const detail::KeyIndex& index = Index();
      const auto width = static_cast<uint64_t>(optimizer_.row_floats());
      std::vector<uint64_t> keys;
      std::vector<int32_t> owners;
      std::vector<float> rows;
      for (uint64_t j = 0; j < p.keys.size(); ++j) {
        const uint32_t at = index.Find(p.keys[j]);
        if (at == detail::KeyIndex::kNone) continue;  // not in this batch
        keys.push_back(p.keys[j]);
        owners.push_back(owners_[at]);
        rows.insert(rows.end(), p.rows.begin() + j * width, p.rows.begin() + (j + 1) * width);
      }
      if (!keys.empty()) tier_->Assign(keys.data(), keys.size(), rows.data(), owners.data());
    }
  }
  previous_.reset();
}

void WorkingSet::CheckMemory(Memory memory, const char* what) const {
  if (memory == Memory::kWorkerGpu && !tier_->accepts_gpu_memory()) {
    throw std::invalid_argument(std::string("working set ") + what + ": the " + tier_->kind() + " tier of " +
                                std::to_string(tier_->devices()) + " device(s) takes host memory only; a GPU's " +
                                "memory needs a CUDA tier of one device");
  }
}

void WorkingSet::Get(int32_t worker, const uint64_t* keys, uint64_t n, float* embeddings, Memory memory) {
  CheckLoaded("get");
  CheckMemory(memory, "get");
  CatchUp();
  std::vector<int32_t> owners;
  tier_->Get(worker, keys, n, embeddings, OwnersOf(keys, n, &owners, "get"));
}

void WorkingSet::Accumulate(int32_t worker, const uint64_t* keys, uint64_t n, const float* grads, Memory memory) {
  CheckLoaded("accumulate");
  CheckMemory(memory, "accumulate");
  CatchUp();
  std::vector<int32_t> owners;
  tier_->Accumulate(worker, keys, n, grads, OwnersOf(keys, n, &owners, "accumulate"));
}

void WorkingSet::GetAt(int32_t worker, const int64_t* positions, uint64_t n, float* embeddings, RowLayout layout,
                       Memory memory) {
  CheckLoaded("get");
  CheckMemory(memory, "get");
  CatchUp();
  tier_->GetAt(worker, positions, n, embeddings, layout);
}

void WorkingSet::AccumulateAt(int32_t worker, const int64_t* positions, uint64_t n, const float* grads,
                              RowLayout layout, Memory memory) {
  CheckLoaded("accumulate");
  CheckMemory(memory, "accumulate");
  CatchUp();
  tier_->AccumulateAt(worker, positions, n, grads, layout);
}

bool WorkingSet::reads_in_place() const {
  CheckLoaded("reads_in_place");
  return tier_->reads_in_place();
}

uint64_t WorkingSet::Apply() {
  CheckLoaded("apply");
  if (applied_) return 0;
  try {
    CatchUp();
    std::vector<int64_t> at;  // positions among keys_ (the tier's bound keys)
    std::vector<uint64_t> updated = tier_->ApplyBound(&at);
    // The updated rows, for the next batch's CatchUp to assign on its own
    // owners; bound to host rows, it reads them in MEM-PS and needs none.
    std::vector<float> rows;
    if (!in_mem_ps_) {
      rows.resize(updated.size() * static_cast<uint64_t>(optimizer_.row_floats()));
      tier_->RowsAt(at.data(), at.size(), rows.data());
    }
    updated_positions_ = std::move(at);
    std::lock_guard lock(updates_->mutex);
    updates_->keys = std::move(updated);
    updates_->rows = std::move(rows);
    updates_->ready = true;
  } catch (...) {
    apply_failed_ = true;
    try {
      ReleaseAll();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "hps: a working set whose apply failed was not released: %s\n", e.what());
    }
    throw;
  }
  updates_->ready_cv.notify_all();
  applied_ = true;
  return updates_->keys.size();
}

const std::vector<uint64_t>& WorkingSet::updated_keys() const { return updates_->keys; }

void WorkingSet::PublishEmpty() {
  {
    std::lock_guard lock(updates_->mutex);
    if (updates_->ready) return;
    updates_->ready = true;  // the batch after this one has nothing to take from it
  }
  updates_->ready_cv.notify_all();
}

void WorkingSet::WriteBack() {
  if (released_) return;
  CheckLoaded("write back");
  if (!applied_) throw std::logic_error("working set: write back before apply");
  ReleaseAll();
}

void WorkingSet::Abort() {
  if (released_) return;
  ReleaseAll();
}

void WorkingSet::ReleaseAll() {
  // Every failure counted, once, wherever it came from: also those before
  // any key's release (the room for a step's addresses), which release
  // nothing and leave the whole release to the retry.
  try {
    ReleaseRemaining();
  } catch (...) {
    cache_.CountFailedRelease();
    throw;
  }
}

void WorkingSet::ReleaseRemaining() {
  if (!applied_) PublishEmpty();
  const std::vector<uint64_t>& updated = updates_->keys;  // empty unless applied
  const uint32_t row_bytes = cache_.row_bytes();
  const auto* rows = reinterpret_cast<const uint8_t*>(updates_->rows.data());
  // Positions, in the keys of the step, of keys something else unpinned:
  // those refused (their updates still to be kept), and those unpinned during
  // the call (BrokenPinError: it kept their updates but for `unkept`'s),
  // both increasing in `unpinned_at`. Members: a step that some failure
  // stops once it has released keys keeps them, for its retry.
  std::vector<uint64_t>& refused = step_refused_;
  std::vector<uint64_t>& unkept = step_unkept_;
  std::vector<uint64_t>& unpinned_at = step_unpinned_at_;
  // Bulk first; a key something else unpinned makes MemCache refuse the
  // whole call (changing nothing), and then they go one by one. *called is
  // set once the step is done, with room for naming what it found (the
  // bookkeeping after it cannot fail): from then on the step is never
  // called again (a second release of a key would take the pin of the next
  // batch that holds it). A step stopped before that, once it has released
  // keys, is unfinished: its retry goes on from next_key_ without calling
  // again for any key before it. Key by key, a call that fails with
  // anything but BrokenPinError or std::invalid_argument (bad_alloc) has
  // released nothing (MemCache's contract): next_key_ stays at it, so that
  // every key is released exactly once. A bulk call's BrokenPinError has
  // released every key: what it found is moved (not copied: no room
  // needed), and next_key_ is past the last key.
  const auto each = [&](const std::vector<uint64_t>& keys, bool* called, auto&& one) {
    if (!step_unfinished_) {
      refused.clear();
      unkept.clear();
      unpinned_at.clear();
      try {
        one(0, keys.size());
        *called = true;
        return;
      } catch (BrokenPinError& e) {  // the call released the others
        unkept = e.TakeLost();
        unpinned_at = e.TakeUnpinned();
        next_key_ = keys.size();
      } catch (const std::invalid_argument&) {
        // Room first, while nothing is released: the bookkeeping below
        // cannot fail.
        refused.reserve(keys.size());
        unkept.reserve(keys.size());
        unpinned_at.reserve(keys.size());
        next_key_ = 0;
      }  // anything else: nothing of this step released, and a retry does it again
      step_unfinished_ = true;
    }
    for (; next_key_ < keys.size(); ++next_key_) {
      const uint64_t i = next_key_;
      try {
        one(i, 1);
        continue;
      } catch (const BrokenPinError& e) {
        if (!e.lost().empty()) unkept.push_back(i);
      } catch (const std::invalid_argument&) {
        refused.push_back(i);
      }  // anything else: key i released nothing, and a retry goes on from it
      unpinned_at.push_back(i);
    }
    // Room for naming what the step found, before it counts as done: each
    // key is in one step and named once, so the bookkeeping after it cannot
    // fail.
    unpinned_.reserve(keys_.size());
    lost_.reserve(keys_.size());
    step_unfinished_ = false;
    *called = true;
  };
  if (!written_ && in_mem_ps_) {
    // The rows were stepped where they lie: one unpin, the updated ones dirty
    // (every one after a failed Apply, which may have stepped some).
    std::vector<uint8_t> dirty(keys_.size(), apply_failed_ ? 1 : 0);
    for (int64_t p : updated_positions_) dirty[static_cast<uint64_t>(p)] = 1;
    each(keys_, &written_, [&](uint64_t at, uint64_t n) {
      cache_.UnpinUpdated(keys_.data() + at, n, dirty.data() + at, addresses_.data() + at);
    });
    // A refused key's row was unpinned by something else, so UnpinUpdated did
    // not mark its step: the rows still in their slots are marked below.
    // Marking here, not in Apply, keeps the batch path free of a second pass
    // over its keys for what only a broken pin contract needs. (Swapped, not
    // copied: no allocation before the steps to keep are recorded.)
    refused.erase(std::remove_if(refused.begin(), refused.end(), [&](uint64_t p) { return dirty[p] == 0; }),
                  refused.end());
    to_keep_.swap(refused);
    for (uint64_t p : unpinned_at) unpinned_.push_back(keys_[p]);
    for (uint64_t p : unkept) lost_.push_back(keys_[p]);
  } else if (!written_ && !updated.empty()) {
    // The pins' row addresses: MemCache finds the slots from them instead of looking each key up.
    std::vector<uint8_t*> where(updated.size());
    for (size_t j = 0; j < where.size(); ++j) where[j] = addresses_[static_cast<uint64_t>(updated_positions_[j])];
    each(updated, &written_, [&](uint64_t at, uint64_t n) {
      cache_.WriteBack(updated.data() + at, n, rows + at * row_bytes, where.data() + at);
    });
    // The batch's copies are these rows' only copies: kept below (those of
    // keys unpinned during the write-back are kept already, unless its
    // keeping failed).
    // Swapped, not copied: no allocation before the rows to keep are
    // recorded (one by one, refused has room for unkept too; a
    // BrokenPinError refuses none).
    to_keep_.swap(refused.empty() ? unkept : refused);
    if (!unkept.empty()) {
      to_keep_.insert(to_keep_.end(), unkept.begin(), unkept.end());
      std::sort(to_keep_.begin(), to_keep_.end());
    }
    for (uint64_t j : unpinned_at) unpinned_.push_back(updated[j]);
  }
  written_ = true;
  if (!to_keep_.empty()) {
    // Until it passes, a retry's first step too (keeping an update twice is
    // harmless); if it throws, it kept nothing, and the retry keeps them and
    // releases what is left (the rows without steps stay pinned till then),
    // without releasing any key again.
    std::vector<uint64_t> keys;
    if (in_mem_ps_) {
      // A row that left its slot meanwhile (unpinned, then evicted clean)
      // took its step with it, and is named.
      std::vector<uint8_t*> where;
      for (uint64_t p : to_keep_) {
        keys.push_back(keys_[p]);
        where.push_back(addresses_[p]);
      }
      for (uint64_t j : cache_.MarkUpdated(keys.data(), keys.size(), where.data())) lost_.push_back(keys[j]);
    } else {
      // Into MEM-PS (or the store, if evicted since), dirty.
      std::vector<uint8_t> kept;
      for (uint64_t j : to_keep_) {
        keys.push_back(updated[j]);
        kept.insert(kept.end(), rows + j * row_bytes, rows + (j + 1) * row_bytes);
      }
      cache_.KeepUpdated(keys.data(), keys.size(), kept.data());
    }
    to_keep_.clear();
  }
  if (!in_mem_ps_ && !rest_released_ && updated.size() < keys_.size()) {
    std::vector<uint64_t> rest;
    std::vector<uint8_t> is_updated(keys_.size(), 0);
    for (int64_t p : updated_positions_) is_updated[static_cast<uint64_t>(p)] = 1;
    std::vector<uint8_t*> where;
    rest.reserve(keys_.size() - updated.size());
    where.reserve(rest.capacity());
    for (uint64_t i = 0; i < keys_.size(); ++i) {
      if (is_updated[i]) continue;
      rest.push_back(keys_[i]);
      where.push_back(addresses_[i]);
    }
    each(rest, &rest_released_, [&](uint64_t at, uint64_t n) { cache_.Unpin(rest.data() + at, n, where.data() + at); });
    for (uint64_t p : unpinned_at) unpinned_.push_back(rest[p]);
  }
  // The error is built before the batch counts as released: if that runs
  // out of memory, the retry reports it.
  std::optional<std::runtime_error> error;
  if (!unpinned_.empty()) {
    error.emplace("working set release: " + std::to_string(unpinned_.size()) + " of " +
                  std::to_string(keys_.size()) + " keys were no longer pinned by this batch (" + Named(unpinned_) +
                  "): something else unpinned them; " +
                  (lost_.empty() ? std::string("their steps were kept")
                                 : "the steps of " + Named(lost_) +
                                       " are lost (their rows left MEM-PS before the release), the others' were "
                                       "kept") +
                  " (dirty in MEM-PS or stored), and the other keys were released");
  }
  released_ = true;
  previous_.reset();
  if (tier_ != nullptr) tier_->Clear();
  if (!error) return;
  throw *error;  // a copy that shares the message: nothing to allocate
}

}  // namespace hps
