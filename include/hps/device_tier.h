// The device tier (HBM-PS): the working parameters of the current batch,
// spread over G devices of one node (the MLSys 2020 paper's section 4).
//
// Each device holds two hash tables: the rows (embedding + optimizer state)
// of the keys it owns, and the gradients workers have sent it for them.
// (Host partitions that read in place may instead bind a batch's rows where
// MEM-PS pins them: BindHostRows.) A
// key's owner comes from the caller (a pluggable partition policy) or, by
// default, from a modulo hash. Devices are CUDA GPUs when the node has enough
// of them, otherwise host partitions: the same tables in host memory, run by
// the CPU launcher.
//
// A batch goes: Insert (load the working set) -> Get (each worker pulls the
// rows of its mini-batch from their owners) -> Accumulate (Algorithm 2:
// gradients partitioned by owner, sent, summed on the owner) -> Apply (the
// sparse optimizer, once per key) -> Rows of the updated keys (they go back
// to MEM-PS) -> Clear. Every row or gradient that moves from one device to
// another is counted in the transfer matrix, and, given routes (TierRoutes),
// on the links its route crosses. Rows that cross devices on GPUs, and on host
// partitions with executed routes, move through a row mover (ps/row_mover.h):
// each owner's segment in a buffer of its own, exchanged along the routes by
// ExecuteOnCuda or ExecuteOnHost (a relay in two phases through a staging
// buffer on its middleman; direct without a topology), which delivers the
// bytes a direct copy does, then put in the caller's order.
//
// Thread safety: one batch at a time; calls are serialised by the caller.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hps/mem_cache.h"
#include "hps/optimizer.h"
#include "hps/topology.h"

namespace hps {
namespace detail {
class BatchRows;
class KeyIndex;
}

// The routes a tier's transfers take through the node's topology (issue 17):
// planned once a run by PlanTierRoutes and shared, read-only, by every tier
// of the run (the pipeline's two, and those that replace a tier outgrown).
// Tier device g is the topology's endpoint g; endpoints past the tier's
// devices may still be middlemen.
struct TierRoutes {
  Topology topology;
  RoutePlan plan;        ///< (E * E,) over topology.Endpoints()
  bool execute = false;  ///< host partitions: the host executor moves the rows, relays staged on
                         ///< their middleman; false: the tier's own copy, counted along the routes.
                         ///< A CUDA tier of several GPUs always moves its rows along the routes.
  int32_t devices = 0;   ///< the tier's G (<= E)
  // Derived: for tier pair (s, d), at hops[phase][s * G + d], the link
  // directions (link * 2 + 0 for a->b, + 1 for b->a) its rows cross in
  // phase 1 (direct, host, a relay's first leg) and phase 2 (the second leg).
  std::vector<std::vector<int32_t>> hops[2];
};

// Routes for a tier of `devices` devices on `topology`, planned (Schedule::
// kRelay) for an even all-to-all of pair_bytes between every two of them: a
// batch's gets and accumulates have that shape, and one plan serves the run
// (planning per batch would cost milliseconds a batch). Throws
// std::invalid_argument naming the topology when it has fewer endpoints than
// devices, or as PlanRoutes does.
std::shared_ptr<const TierRoutes> PlanTierRoutes(const Topology& topology, int32_t devices, uint64_t pair_bytes,
                                                 bool execute);

// What a tier with routes moved over each link: rows and bytes per link
// direction and phase, a relay's rows counted on both of its hops.
struct LinkCounters {
  int32_t links = 0;
  std::vector<uint64_t> rows, bytes;  ///< (2, links, 2): [phase][link][a->b, b->a]
  std::vector<uint64_t> route_rows;   ///< (4,) rows between two devices by RouteKind
  uint64_t relayed_rows = 0, relayed_bytes = 0;  ///< staged on a middleman
};

struct DeviceTierOptions {
  int32_t devices = 1;           ///< G, > 0
  uint64_t capacity = 0;         ///< rows per device table; > 0
  SparseOptimizer optimizer;     ///< fixes the row width (embedding + state)
  bool use_cuda = true;          ///< GPUs when the node has those cuda_devices name; else host partitions
  int32_t threads = 0;           ///< CPU launcher threads per host partition; 0 = all cores
  std::shared_ptr<const TierRoutes> routes;  ///< null: no routes, no link counters (a CUDA tier
                                             ///< then copies directly between its GPUs)
  // The CUDA device of each endpoint: the tier's devices first, then (with
  // routes) the topology's other endpoints, which may be middlemen. Empty:
  // endpoint e on GPU e. Several may share a GPU, so a one-GPU machine runs
  // a tier of several devices (the tests of the GPUs' row mover do).
  std::vector<int32_t> cuda_devices;
  // Host partitions that read in place (no row mover) bind a working set's
  // rows where MEM-PS pins them (BindHostRows) instead of holding copies in
  // their tables: the partitions share the host's memory with MEM-PS, so a
  // copy in and out of it bought nothing but two passes over the rows (the
  // device-tier path ran W4s at 0.75x the in-place one with them). false:
  // copies, as a GPU must hold them (the tests run the copying path this way).
  bool bind_host_rows = true;
  // Keep each table row's trained bit (TakeTrained): Herald's caches, whose
  // rows outlive their batches, write only the rows trained since they last
  // wrote them. The bits lie beside the table's slots (a byte per slot, on
  // the host), so a call that finds a row's slot finds its bit. Off, the
  // calls on the bits throw and Apply costs nothing more.
  bool track_trained = false;
};

struct TransferMatrix {
  int32_t devices = 0;
  std::vector<uint64_t> rows;   ///< rows[from * devices + to]
  std::vector<uint64_t> bytes;  ///< bytes[from * devices + to]
};

// Where the n rows (dim floats each) of a positional Get or Accumulate lie
// (HostBatch, DeviceTier's GetAt and AccumulateAt):
// `group` rows one after another (one example's fields), groups
// `group_stride` floats apart. A model's input matrix can so take the
// embeddings in its first columns, beside the dense features, with no copy
// between the lookup and the first layer. The default is a compact (n, dim)
// block; n must be a multiple of group.
struct RowLayout {
  uint64_t group = 1;
  uint64_t group_stride = 0;  // 0: group * dim, no gap
};

class DeviceTier {
 public:
  // Throws std::invalid_argument for bad options.
  static std::unique_ptr<DeviceTier> New(const DeviceTierOptions& options);
  virtual ~DeviceTier() = default;

  virtual int32_t devices() const = 0;
  // The floats of a row (embedding + optimizer state: Insert, Assign, Rows,
  // ReadBack) and of an embedding or gradient (Get, Accumulate).
  virtual int32_t row_floats() const = 0;
  virtual int32_t dim() const = 0;
  // "cpu" (host partitions) or "cuda".
  virtual std::string kind() const = 0;
  // Whether Get's embeddings and Accumulate's grads may lie in the memory of
  // the worker's GPU as well as in host memory: a CUDA tier, whose tables (one
  // device) or row mover (several: peer copies along the routes) read and
  // write either. Host partitions take host memory only.
  virtual bool accepts_gpu_memory() const = 0;
  virtual uint64_t size() const = 0;

  // `owners` (n entries in [0, devices), or null for the modulo hash) says
  // which device holds each key; the caller passes the same for a key every
  // time within a batch.
  //
  // A host buffer of at least `floats` floats that the tier keeps for the
  // rows of its next Insert (the working set's load reads MEM-PS into it):
  // reused batch after batch instead of allocated and freed (13 MB a batch on
  // W4, each page faulted in anew), and page-locked on a CUDA tier, so that
  // the upload is a DMA. Valid until the next call; its contents are not kept.
  // One caller at a time: the batch that holds the tier.
  virtual float* StagingRows(uint64_t floats) = 0;
  // Loads rows (n, row_floats) of the batch's working set onto their owners.
  // Throws TableFullError when a device's table has no room.
  virtual void Insert(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners) = 0;
  // Overwrites the rows (n, row_floats) of the keys that are loaded and skips
  // the others; returns how many were loaded. (The pipeline brings a batch
  // loaded early up to date with the previous batch's updates.)
  virtual uint64_t Assign(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners) = 0;
  // Worker device `worker` pulls the embeddings (n, dim) of keys from their
  // owners. std::out_of_range names a key that was not loaded.
  virtual void Get(int32_t worker, const uint64_t* keys, uint64_t n, float* embeddings,
                   const int32_t* owners) = 0;
  // Worker `worker` sends gradients (n, dim) of keys to their owners, which
  // sum them (duplicates and other workers' included) until Apply. A call is
  // all or nothing: refused, it adds nothing on any device. After Bind, keys
  // are the bound ones: std::out_of_range names one that is not ("device tier
  // accumulate: keys[1] = 999 is not among the 19 keys bound"), and, where
  // the gradients sum in tables (!reads_in_place), std::invalid_argument one
  // whose owner here is not a device it is bound on. TableFullError where a
  // device's gradient table has fewer free slots than the call's keys it
  // lacks (each counted once).
  virtual void Accumulate(int32_t worker, const uint64_t* keys, uint64_t n, const float* grads,
                          const int32_t* owners) = 0;
  // Applies the optimizer once to every key with gradients and clears them;
  // returns those keys (each once). A key whose sum holds a NaN or an
  // infinity (finite gradients can overflow in their sum) makes it throw
  // DivergedError, naming the key, before any row steps; so does a device
  // whose table has fewer free slots than the keys with gradients that it
  // lacks, TableFullError. Refused, the gradients still wait.
  virtual std::vector<uint64_t> Apply() = 0;
  // The full rows (n, row_floats) of loaded keys, read on their owners (the
  // write-back's read; not counted as transfers). std::out_of_range names a
  // key that is not loaded.
  virtual void Rows(const uint64_t* keys, uint64_t n, float* rows, const int32_t* owners) const = 0;
  // Writes up to max_rows (key, row) pairs of all devices; returns how many.
  virtual uint64_t ReadBack(uint64_t* keys, float* rows, uint64_t max_rows) const = 0;
  // Empties every device for the next batch.
  virtual void Clear() = 0;
  // Gives device `device`'s gradient table `capacity` slots (> 0, rounded up
  // to a multiple of 8), between batches: std::logic_error while gradients wait
  // for Apply. Apply reads every slot of a gradient table, so a tier whose rows
  // persist between batches (Herald's caches) sizes these for the keys a batch
  // sums on each device, not for its rows (an Accumulate or AccumulateAt they
  // have no room for is refused whole, TableFullError). At first they have
  // `capacity` slots, as the rows do.
  virtual void SetGradientCapacity(int32_t device, uint64_t capacity) = 0;

  // Positional access to one batch's working set, as a HostBatch has it.
  // Bind names the batch's rows (n keys, each loaded, owners as Insert was
  // given them), between its Insert and its first Get or Accumulate;
  // position i is (keys[i], owners[i]) until Clear. Each (key, owner) pair
  // is bound once (not checked: a pair bound twice is stepped twice). A key
  // may be bound on several devices, a copy on each (Herald's caches: each
  // trainer reads its own copy, the gradients sum on one); reach such a
  // binding by position: where the tier reads in place, Accumulate by key
  // throws std::logic_error naming the key, as does ApplyBound elsewhere
  // (its positions of keys stepped by key). std::out_of_range
  // names a key not loaded; std::logic_error when gradients already wait for
  // Apply.
  // On host partitions whose rows cross no row mover (reads_in_place), the
  // positional calls read and step the rows where the tables hold them, each
  // key looked up once (at Bind) instead of once a call; elsewhere they go by
  // key. Either way transfers are counted as Get and Accumulate count them,
  // and a key's gradients sum into one step whichever way they came.
  virtual void Bind(const uint64_t* keys, uint64_t n, const int32_t* owners) = 0;
  virtual bool reads_in_place() const = 0;
  // Get and Accumulate by position; `layout` other than compact only where
  // reads_in_place (else std::invalid_argument). std::out_of_range names a
  // position outside the bound keys; std::logic_error before Bind.
  virtual void GetAt(int32_t worker, const int64_t* positions, uint64_t n, float* embeddings,
                     RowLayout layout) = 0;
  virtual void AccumulateAt(int32_t worker, const int64_t* positions, uint64_t n, const float* grads,
                            RowLayout layout) = 0;
  // Apply on a bound tier, with each updated key's position among the bound
  // keys appended to `positions` (in the order of the keys returned).
  virtual std::vector<uint64_t> ApplyBound(std::vector<int64_t>* positions) = 0;
  // The full rows (n, row_floats) of the bound keys at positions.
  virtual void RowsAt(const int64_t* positions, uint64_t n, float* rows) const = 0;
  // Overwrites the full row at to[i] with the row at from[i], for each i in
  // order (a key's updated copy onto its other copies after Apply); not
  // counted as transfers (the caller counts what it moves). Gradients waiting
  // at a position stay there. std::out_of_range names a position outside the
  // bound keys; std::logic_error before Bind.
  virtual void CopyRowsAt(const int64_t* from, const int64_t* to, uint64_t n) = 0;
  // Whether BindHostRows may be called: host partitions that read in place,
  // with options.bind_host_rows.
  virtual bool binds_host_rows() const = 0;
  // Bind without Insert: the batch's rows stay where they lie in host memory
  // (rows[i] holds keys[i]'s row_floats floats: MEM-PS's pinned slots, which
  // must stay valid and unmoved until Clear), each key on its owner. The
  // positional calls read and step them there, the calls by key find them
  // through the bound keys (Get, Rows, Assign: a key not bound is named, or
  // skipped by Assign; Insert throws std::logic_error), size() counts them,
  // and transfers are counted as for rows in the tables. TableFullError when
  // a device would own more keys than its capacity, as Insert's; std::logic_error
  // where !binds_host_rows(). Clear forgets them (the caller writes nothing back:
  // Apply stepped them where they lie).
  virtual void BindHostRows(const uint64_t* keys, uint64_t n, const int32_t* owners, uint8_t* const* rows) = 0;

  // The trained bits (options.track_trained; else std::logic_error), for
  // rows that stay in the tables between batches (Herald's caches): a row's
  // bit says it changed since it was last written below the tier (to MEM-PS).
  // Apply sets the bits of the rows it steps; CopyRowsAt gives each row it
  // overwrites its source's bit (a replica is as new as its primary); Insert
  // and Assign clear the bits of the rows they write (a row from MEM-PS), and
  // Clear every bit. A row fetched from a peer is as new as its source: the
  // caller reads the source's bit (Trained) and sets the copy's (SetTrained).
  // A key's bit is its row's on `owners` (null: the modulo hash), as Insert's;
  // a key not in that table reads 0 and is not set. Rows bound from MEM-PS
  // (BindHostRows) have no bits. Each call costs O(n), never a scan of a table;
  // Apply and CopyRowsAt on bound positions reach the bits with no lookup.
  virtual void Trained(const uint64_t* keys, uint64_t n, const int32_t* owners, uint8_t* trained) const = 0;
  virtual void SetTrained(const uint64_t* keys, uint64_t n, const int32_t* owners, bool trained) = 0;
  // The (key, device) of every row whose bit is set, each device's in no fixed
  // order, and clears them all (the caller writes those rows below, or sets
  // them again if it could not). A row that stayed in a table after its cache
  // dropped the key (stale) keeps its bit: the caller knows which copies are live.
  // It costs a pass over the bits (a byte per table slot), never the tables' rows.
  virtual void TakeTrained(std::vector<uint64_t>* keys, std::vector<int32_t>* owners) = 0;
  // Rows and Trained in one call, each key looked up once on its owner: a
  // peer fetch reads its source's row and bit together (std::logic_error
  // without track_trained; std::out_of_range names a key not loaded; rows
  // bound from MEM-PS read 0).
  virtual void RowsTrained(const uint64_t* keys, uint64_t n, const int32_t* owners, float* rows,
                           uint8_t* trained) const = 0;
  // Assign, Insert and SetTrained in one call: writes rows (n, row_floats)
  // onto the keys' owners, overwriting a loaded key's row (a stale copy) and
  // inserting the others, and gives each row the bit trained[i] (null: 0, a
  // row from MEM-PS; a row from a peer takes its source's). Fewer lookups than
  // the three: a key is found once by the insert, and once more only if it was
  // loaded already or takes a set bit. Which row and bit a key repeated on
  // one owner keeps is not defined. TableFullError as Insert's;
  // std::logic_error on a tier bound to host rows, or for trained given
  // without track_trained.
  virtual void Upsert(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners,
                      const uint8_t* trained) = 0;

  virtual TransferMatrix transfers() const = 0;
  // Empty (links = 0) without routes.
  virtual LinkCounters link_counters() const = 0;
  // Zeroes the transfer matrix and the link counters.
  virtual void ResetTransfers() = 0;
  // The owner the modulo hash gives a key among `devices`.
  static int32_t ModuloOwner(uint64_t key, int32_t devices);
};

// With no GPU and one host partition, a device table would hold a second
// copy of rows that already sit pinned in MEM-PS's host memory, copied in at
// load and back at write-back. A HostBatch trains a batch on those pinned
// rows where they are: the same steps as a DeviceTier batch (get,
// accumulate, apply), addressed by position in the batch's distinct keys.
// Rows change only in Apply; Release unpins the keys and marks the updated
// rows dirty, so MEM-PS stores them when it evicts or flushes them.
//
// Thread safety: one thread at a time per batch. Two batches in flight may
// share keys (each holds its own pin); the caller orders them: the later one
// reads those rows only after the earlier one applied its step.
class HostBatch {
 public:
  // keys (n, distinct) must each be pinned in cache, which must outlive the
  // batch; std::invalid_argument names one that is not, or a repeated key.
  HostBatch(MemCache& cache, const uint64_t* keys, uint64_t n, const SparseOptimizer& optimizer);
  // The same with the rows' addresses from the MemCache::Pin of keys, which
  // spares looking each key up again; the check for repeated keys then waits
  // for the first Positions, the one call that needs the keys' index.
  HostBatch(MemCache& cache, const uint64_t* keys, uint64_t n, uint8_t* const* addresses,
            const SparseOptimizer& optimizer);
  // Releases the keys if Release has not (the updates applied are kept). A
  // destructor cannot throw: a failure is counted in the cache's
  // stats().failed_releases (by Release) and written to stderr.
  ~HostBatch();
  HostBatch(const HostBatch&) = delete;
  HostBatch& operator=(const HostBatch&) = delete;

  uint64_t size() const { return keys_.size(); }
  int32_t dim() const { return optimizer_.dim; }
  int32_t row_floats() const { return optimizer_.row_floats(); }
  // positions[i]: where keys[i] is among the batch's keys. std::out_of_range
  // names a key that is not in the batch.
  void Positions(const uint64_t* keys, uint64_t n, int64_t* positions) const;
  // The embeddings (n, dim) of the keys at positions (repeats allowed: one
  // row per example, gathered straight from MEM-PS), laid out as `layout` says.
  void Get(const int64_t* positions, uint64_t n, float* embeddings, RowLayout layout = {}) const;
  // Adds gradients (n, dim), laid out as `layout` says, to the keys at
  // positions (repeats sum up).
  void Accumulate(const int64_t* positions, uint64_t n, const float* grads, RowLayout layout = {});
  // One optimizer step per key that got gradients, on its MEM-PS row; the
  // gradients are cleared. Returns how many keys it stepped. DivergedError,
  // naming the key, for a sum that holds a NaN or an infinity: no row steps.
  uint64_t Apply();
  // The full rows (n, row_floats) at positions, as they are now.
  void Rows(const int64_t* positions, uint64_t n, float* rows) const;
  // Keys stepped by any Apply so far, in batch order.
  std::vector<uint64_t> UpdatedKeys() const;
  // Unpins every key, the updated ones dirty. Later calls do nothing; no
  // other call is valid after it. A failure is counted in the cache's
  // stats().failed_releases and thrown:
  //  * a key no longer pinned (something else unpinned it, before the
  //    release or during it): the other keys are released all the same,
  //    and std::runtime_error names the keys refused; an updated one's step
  //    is marked dirty where its row still lies (MemCache::MarkUpdated), and
  //    one whose row was evicted meanwhile (clean: its step with it) is
  //    named lost;
  //  * anything else (bad_alloc): a later Release or the destructor does
  //    what it had not done (all of it, if it failed before any key was
  //    released; else the keys still pinned, the refused steps to mark, the
  //    error), never releasing a key twice (another batch may hold a pin on
  //    it by then).
  void Release();

 private:
  void CheckLive(const char* what) const;
  void Setup(uint8_t* const* addresses);
  void BuildIndex() const;
  void ReleaseRemaining();

  MemCache& cache_;
  const SparseOptimizer optimizer_;
  std::vector<uint64_t> keys_;
  std::unique_ptr<detail::BatchRows> rows_;  // in MEM-PS's arena, as MemCache::Pin gave them
  mutable std::unique_ptr<detail::KeyIndex> index_;  // key -> position, built when first needed
  bool released_ = false;
  // A release that a failure stopped once it had released keys: the
  // position of its next key to release (past the last: none left), and
  // the positions it found so far of keys something else unpinned, of
  // steps lost, and of refused steps still to mark.
  bool unfinished_ = false;
  uint64_t next_key_ = 0;
  std::vector<uint64_t> refused_, lost_, to_mark_;
};

}  // namespace hps
