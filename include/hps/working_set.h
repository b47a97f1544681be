// One batch's working set on the device tier, from pin to release, in native
// code: the MLSys 2020 paper's Algorithm 1 for one batch.
//
// Composed in Python, a batch's rows crossed into C++ about 16 times and
// through numpy four times (read pinned -> insert -> rows -> write back).
// Here each stage is one call:
//
//   WorkingSet(keys)  the batch's distinct keys pinned in MEM-PS (misses come
//                     from its loader: the BackingStore), owners chosen
//   Load(tier)        the pinned rows, as MEM-PS holds them now, onto the
//                     owners' tables of an empty device tier; on host
//                     partitions that bind host rows (DeviceTier::
//                     binds_host_rows), the pinned rows themselves, uncopied
//   Get / Accumulate  per worker: embeddings pulled from the owners,
//                     gradients sent to them (Algorithm 2)
//   Apply             one optimizer step per key on its owner; the updated
//                     rows are read back and published to the next batch
//                     (bound to host rows: stepped in MEM-PS, nothing to read)
//   WriteBack         the updated rows into their MEM-PS slots (dirty), every
//                     pin released, the tier emptied (bound to host rows: the
//                     stepped rows marked dirty as they are unpinned)
//
// Abort (or the destructor) releases a batch that will not finish.
//
// Pipelining: a batch loaded while the one before it still trains (Load's
// `previous`) takes that one's updated rows onto its tier (each on this
// batch's owner of the key, which a partition policy may choose otherwise
// than for the batch before) before its first Get, Accumulate or Apply
// (or their positional forms), waiting for that Apply if needed; so the
// pipelined run computes what the sequential one does. (Bound to host rows,
// both step MEM-PS's rows, and the wait is all.) The two batches' tiers must
// be of one kind, both bound to host rows or both holding copies: a copying
// batch writes its rows into MEM-PS at its write-back, which may come after
// the bound batch behind it stepped them. Load refuses a mix
// (std::invalid_argument), releasing the batch.
//
// A failed Apply of a batch bound to host rows may have stepped some rows in
// MEM-PS; its release marks every row dirty, so none of those steps is lost
// (HostBatch keeps partial steps the same way).
//
// Failures keep HostBatch's guarantees (device_tier.h, mem_cache.h): a call
// that throws holds no pin it did not hold before and loses no dirty row.
// A failed Load or Apply releases the batch (every pin, the tier emptied, the
// next batch told there is nothing to take). WriteBack is HostBatch::Release,
// but keeps what steps it can: a key something else unpinned is named (std::
// runtime_error) and the others are released, and its updated row is kept all
// the same (holding copies, MemCache::KeepUpdated: dirty in MEM-PS, or stored
// if evicted since; bound to MEM-PS's rows, MemCache::MarkUpdated marks the
// stepped row dirty where it still lies, and a row evicted between the unpin
// and the release took its step with it: the error names it lost); any other
// failure can be retried: one before any key was released releases nothing,
// one after (the sink's error keeping a refused key's row; bad_alloc while
// the keys go one by one, while recording the keys a release call found
// unpinned during it, or while naming them) leaves what it had not done
// (that row to keep, the keys after it pinned, the error), and the retry does
// only that, never releasing a key twice (another batch may hold a pin on it
// by then). Each failed release is counted in MEM-PS's
// stats().failed_releases.
//
// Thread safety: one thread at a time per working set (the pipeline pins the
// next batch on another thread while this one trains: different objects).
// The tier belongs to one loaded working set until its WriteBack or Abort.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "hps/device_tier.h"
#include "hps/mem_cache.h"
#include "hps/optimizer.h"

namespace hps {
namespace detail {
class KeyIndex;
}

class WorkingSet {
 public:
  // What Apply publishes to the batch after it (opaque to callers).
  struct Updates;

  // Pins the distinct keys of keys (n, repeats allowed, the batch's keys as
  // the examples give them) in cache, which must outlive this. Owners come
  // from DeviceTier::ModuloOwner among `devices` until SetOwners. Throws like
  // CheckKeys for a reserved key and like MemCache::Pull (CacheFullError, the
  // loader's errors); then nothing is pinned.
  WorkingSet(MemCache& cache, const SparseOptimizer& optimizer, int32_t devices, const uint64_t* keys, uint64_t n);
  // Releases a batch that was not written back: applied updates are written
  // back (as HostBatch's destructor keeps its steps), else the pins are
  // dropped. A failure is counted and written to stderr (a destructor cannot throw).
  ~WorkingSet();
  WorkingSet(const WorkingSet&) = delete;
  WorkingSet& operator=(const WorkingSet&) = delete;

  // The distinct keys in order of first appearance, and inverse (n of the
  // constructor): where each given key is among them.
  const std::vector<uint64_t>& keys() const { return keys_; }
  const std::vector<int64_t>& inverse() const { return inverse_; }
  uint64_t size() const { return keys_.size(); }
  uint64_t hits() const { return hits_; }  // of the distinct keys, found in MEM-PS
  int32_t devices() const { return devices_; }
  int32_t dim() const { return optimizer_.dim; }
  // The most distinct keys one device owns: a tier's tables must hold them.
  uint64_t most_per_device() const;

  // Owners chosen by a partition policy: owners[i] in [0, devices) for
  // keys()[i]. Before Load only; std::invalid_argument names a bad one.
  void SetOwners(const int32_t* owners);

  // Loads the rows onto `tier` (empty, of `devices` devices and this
  // optimizer's row width), which must outlive the load. `previous`: the
  // Updates of the batch loaded before this one, if it may not have been
  // written back yet (null otherwise). A failure (TableFullError, ...)
  // releases the batch: see the file comment.
  void Load(DeviceTier& tier, std::shared_ptr<Updates> previous);
  // What this batch's Apply publishes: for the Load of the batch after it.
  std::shared_ptr<Updates> updates() const { return updates_; }

  // Where Get's embeddings and Accumulate's grads lie: host memory, or the
  // memory of the worker's GPU (a torch CUDA tensor's), which only a tier
  // that accepts_gpu_memory() reads and writes (else std::invalid_argument).
  enum class Memory { kHost, kWorkerGpu };
  // Worker `worker` pulls the embeddings (n, dim) of keys (each a key of the
  // batch; std::out_of_range names one that is not).
  void Get(int32_t worker, const uint64_t* keys, uint64_t n, float* embeddings, Memory memory = Memory::kHost);
  // Worker `worker` sends gradients (n, dim) of keys to their owners (each a
  // key of the batch; std::out_of_range names one that is not, and nothing of
  // the call is sent).
  void Accumulate(int32_t worker, const uint64_t* keys, uint64_t n, const float* grads,
                  Memory memory = Memory::kHost);
  // positions[i]: where keys[i] is among keys(). std::out_of_range names a
  // key that is not in the batch. (inverse() has the constructor's keys'.)
  void Positions(const uint64_t* keys, uint64_t n, int64_t* positions) const;
  // Get and Accumulate of the keys at positions (among keys()): on host
  // partitions (DeviceTier::reads_in_place) the tier reads and steps the
  // rows where it holds them, with no lookup a key, and `layout` may place
  // them in a wider matrix's columns; elsewhere the rows are compact.
  void GetAt(int32_t worker, const int64_t* positions, uint64_t n, float* embeddings, RowLayout layout = {},
             Memory memory = Memory::kHost);
  void AccumulateAt(int32_t worker, const int64_t* positions, uint64_t n, const float* grads,
                    RowLayout layout = {}, Memory memory = Memory::kHost);
  // Whether GetAt and AccumulateAt take layouts other than compact (the tier loaded reads in place).
  bool reads_in_place() const;
  // One optimizer step per key with gradients; returns how many. Later calls
  // do nothing and return 0. A failure releases the batch.
  uint64_t Apply();
  bool applied() const { return applied_; }
  // Keys stepped by Apply, in the tier's order.
  const std::vector<uint64_t>& updated_keys() const;
  // The updated rows into MEM-PS (dirty), every pin released, the tier
  // emptied. std::logic_error before Apply; later calls do nothing.
  void WriteBack();
  // Drops the gradients Apply has not applied and releases the batch: pins,
  // tier. Steps already applied are kept, written back as WriteBack does (the
  // batch after this one may have taken them already; HostBatch keeps its
  // steps too). Later calls do nothing; fails as WriteBack does.
  void Abort();
  bool released() const { return released_; }

 private:
  void CheckLoaded(const char* what) const;
  void CheckMemory(Memory memory, const char* what) const;
  void CheckWorker(int32_t worker) const;
  // The owners of keys (n) for the tier, or null for the modulo hash.
  const int32_t* OwnersOf(const uint64_t* keys, uint64_t n, std::vector<int32_t>* out, const char* what) const;
  void CatchUp();
  const detail::KeyIndex& Index() const;
  void PublishEmpty();
  void ReleaseAll();  // ReleaseRemaining, each failure counted in MEM-PS's stats().failed_releases
  void ReleaseRemaining();
  void CountPerDevice();

  MemCache& cache_;
  const SparseOptimizer optimizer_;
  const int32_t devices_;
  std::vector<uint64_t> keys_;
  std::vector<int64_t> inverse_;
  std::vector<int32_t> owners_;  // per key of keys_, when a policy chose them
  mutable std::unique_ptr<detail::KeyIndex> index_;  // key -> position: with owners_, or when Positions needs it
  std::vector<uint64_t> per_device_;  // distinct keys each device owns
  std::vector<int64_t> updated_positions_;  // of Apply's keys, in their order
  std::vector<uint8_t*> addresses_;  // each key's row in MEM-PS, as its pin gave it (valid while pinned)
  uint64_t hits_ = 0;
  // Release progress, so that a retry (WriteBack, Abort, the destructor)
  // after a failure past some keys' release finishes the rest and releases
  // no key twice.
  bool written_ = false;  // the updated rows' release (WriteBack, or UnpinUpdated bound to host rows) was called
  std::vector<uint64_t> to_keep_;  // positions (in updated_keys(), or in keys_ bound to host rows) of updates still to keep
  bool rest_released_ = false;  // the rows without steps were unpinned (holding copies)
  std::vector<uint64_t> unpinned_, lost_;  // keys something else unpinned, and those whose steps are lost: the error names them
  // A step that a failure stopped once it had released keys (key by key, its
  // bulk call refused; or its bulk call released them all, and naming what
  // it found ran out of memory): the position of its next key (past the
  // last: none left to call), and what it found so far.
  bool step_unfinished_ = false;
  uint64_t next_key_ = 0;
  std::vector<uint64_t> step_refused_, step_unkept_, step_unpinned_at_;
  bool in_mem_ps_ = false;  // loaded onto a tier bound to host rows: the rows are MEM-PS's own
  bool apply_failed_ = false;  // (then, with in_mem_ps_, some rows may be stepped: all go back dirty)
  DeviceTier* tier_ = nullptr;
  std::shared_ptr<Updates> previous_;
  std::shared_ptr<Updates> updates_;
  bool applied_ = false;
  bool released_ = false;
};

}  // namespace hps
