// Herald (APNet 2022): location-aware partition of a synchronous batch over W
// workers with embedding caches, and on-demand synchronisation of the rows
// those caches hold. Algorithm 1 of the paper for one batch at a time.
//
// The scheduler keeps a snapshot of every worker's cache and plans a batch:
//
//   partition     example i goes to a worker with the most of keys(i) cached
//                 (Score(i, w) = |cache(w) ∩ keys(i)|, repeats counted), each
//                 worker taking its share (below); or, sequential, example i
//                 to worker i / share as a naive data-parallel split does
//   fetch(w)      the distinct keys worker w trains on whose latest version
//                 is not in its cache, each with its source: the lowest-index
//                 worker holding the latest version, or the PS (-1)
//   comm_plan(w)  the keys other workers fetch from w this batch
//   snapshot      after the batch the workers that trained a key hold its
//                 latest version (BSP: they sum their gradients and apply one
//                 update); every other copy is stale and dropped
//
// Shares: a batch of n examples gives each worker n / W, and the first n % W
// workers one more, in either partition.
//
// Greedy order: examples by their regret on the snapshot, the lead of their
// best score over their second best, highest first (then by best score,
// highest first, then in batch order): the examples with most to lose to a
// full worker choose first, and those whose keys every worker holds, which
// lose nothing wherever they go, last. Each goes to the worker of highest
// value that still has room, ties to the lowest worker index, and its keys
// count as cached by that worker for the examples after it (so examples that
// share a key no cache holds land together). A worker's value is its score
// less a load term (past the paper): lambda x the batch's mean keys an
// example x the fraction of its share it has taken, lambda 1/4, or 2 for an
// example none of whose keys any cache holds. Without it a cold batch went
// as the sequential partition: worker 0 took the first example, then scored
// highest for every example after it (their hot keys), until its share was
// full. Origins (past the paper): where a batch's examples were read on
// different workers (the ranks of an MPI job), an example may come with its
// origin worker, which then earns example_cost keys of score for it (and,
// for an example no cache holds a key of, no load term: origins already
// spread a cold batch): moving an example costs what pulling that many rows
// does, so an example whose keys are no better cached elsewhere stays where
// it was read. example_cost 0 ignores origins.
// Everything is a function of the snapshot and the batch, in integers (the
// cost in 1/256 of a key), so every rank that runs the same batches computes
// the same plans.
//
// Capacity and eviction: each worker's cache holds at most `capacity` keys
// (0: unbounded). A key's last use is the batch that last trained it (a
// worker holds a key's latest version only if it trained the key in that
// batch), so one tick per key orders every cache: after a batch, a worker
// above capacity drops its least recently used keys (oldest tick, then lowest
// key) down to capacity, the batch's own keys included if it needs more room
// than it has. A dropped dirty row whose latest version no other worker holds
// is pushed to the PS.
//
// Lookahead: a batch may come with a window, the keys of the batches after it
// (upcoming; any count, repeats allowed). After the batch is committed and
// before any cache evicts, every key of the window that some cache holds
// (trained by this batch or not) counts as used once more, after the batch's
// own keys: its tick is the batch's plus a half, for every holder; no holder
// is added or dropped. So a worker drops, in order, its keys of older ticks
// (oldest first), then the batch's keys outside the window, then its window
// keys; within one tick, lowest key first. A cache that holds more than
// `capacity` window keys drops window keys too, lowest first. The refreshed
// tick stays (a later batch orders the key by it, as by a batch's), so a
// window key outlives keys trained in its batch. Keys of the window no cache
// holds are ignored (a window fetches nothing), and so is the window without
// a capacity. An empty window plans every batch as no window does. Cost: a
// sort of the window and an index probe or two per distinct key; a held key
// refreshed leaves a dead record (compacted as retrained keys' are).
//
// Synchronisation (what is counted):
//   pull   a worker trains on a key whose latest version is not in its cache
//          (from a peer's cache or the PS)
//   push   on demand: a dirty row another worker fetches (pushed once, however
//          many fetch it), and a dirty row evicted from its last holder;
//          write-through (on_demand = false): every row trained in a batch,
//          once, at the batch's end, so the PS always holds the latest
//   shared a key trained by several workers in one batch: their gradient
//          exchange, sum(|trainers| - 1) rows, the same in every mode
//
// Eviction reads no more of the snapshot than it must: the snapshot is a log
// of (key, holders) records in training order, a run per batch, so a worker's
// least recently used keys are the oldest records with its bit, read in order
// from where its last eviction stopped, with no probe of the key index.
//
// Memory: a key some cache holds is one live log record, stored once however
// many workers hold it: 8 bytes of key and a holders byte, packed together so
// that one read gives both. For W <= 8 the byte is the holder mask; for wider
// masks it names the one holder most keys have, or says the key is shared,
// and the masks of shared keys (two or more holders) sit in a side table of
// key and mask (16 bytes an entry) at load 0.25 to 0.7 (below 0.25 after a
// batch that stopped sharing many keys, until the next batch sizes the
// table), so a key costs a mask only where it has more than one holder. Retraining a key moves its record to
// the log's end and leaves a dead one; a log out of room is compacted into
// room for 1.25 x (its live records + the batch's keys), up to 10% more where
// its old room is in that band. The key index takes 4 bytes a slot (the
// record's position and, above it, a fingerprint of the key in the bits
// positions leave free) at load 0.55 to 0.8, erased slots (tombstones)
// counted until the index is rebuilt from the log at the next compaction; a
// rebuild leaves room for as many erased slots as came since the one before
// (sized without them, an index the erases had filled was refilled at its
// size, full again a batch later: a rebuild every batch or two). So
// a key takes 1.25 to 1.4 x 9 bytes of log and 5 to 7.5 bytes of index, and
// a shared one some 23 to 64 bytes more of side table: about 19 bytes a
// cached key for W = 8 and 17 to 18 for W = 64 (a replay of Zipf(1.05)
// batches over caches of 100,000 keys, bench/herald_ab and herald_replay.py,
// where 1 to 2% of the keys are shared), a little more while a batch is large
// against the caches. At W = 8 the index (load near 0.5, where its probes
// stay short: at 0.6 to 0.7 a batch took 5 to 15% longer) and the log's room
// between compactions (each rebuilds the index, some 5 ms) are what is left.
// An index of 16-slot buckets (a cache line compared at once, where an erase
// can free its slot outright) probes short at loads up to 0.9, a smaller
// index, but its compares cost more instructions than these short linear
// probes, and Find is bound by instructions once its prefetches land: a batch
// took longer than the budget allows (measured, not kept).
// memory_bytes() counts all of it: every slot and record allocated, live,
// dead or spare. The index and the log, read at random a key each, sit on
// transparent huge pages where the kernel gives them (no more memory: a
// buffer's tail past its last whole huge page keeps small pages). It leaves
// out the per-batch scratch (some 36 bytes a key of the largest batch so
// far), which does not grow with the caches. No dirty
// bit is kept: on demand every held row is dirty (a worker trained it),
// write-through every one is clean (the PS got it at the batch's end).
//
// Thread safety: none; one thread schedules (the pipeline's partition stage).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace hps {

struct HeraldOptions {
  int32_t workers = 8;         ///< W, 1 to 64 (a key's holders are a 64-bit mask)
  uint64_t capacity = 0;       ///< keys a worker's cache holds; 0: unbounded
  bool location_aware = true;  ///< Algorithm 1's partition; false: sequential
  bool on_demand = true;       ///< push only what another worker needs or an eviction loses; false: write-through
  /// Keys of score an example earns on its origin worker (Schedule's origin):
  /// the bytes of an example over those of a pulled row. 0 to 65,536, in steps
  /// of 1/256; 0: examples move for free (the paper's partition).
  double example_cost = 0;
};

// What one batch does: the partition, the fetches and comm plans, the counts.
struct HeraldPlan {
  std::vector<int32_t> assignment;  // (n_examples,) the worker of each example
  // fetch(w) = fetch_keys[fetch_offsets[w] : fetch_offsets[w + 1]], its sources
  // in fetch_from (a worker, or -1 for the PS); keys in first-appearance order.
  std::vector<uint64_t> fetch_offsets;  // (W + 1,)
  std::vector<uint64_t> fetch_keys;
  std::vector<int32_t> fetch_from;
  // comm_plan(w) = comm_keys[comm_offsets[w] : comm_offsets[w + 1]], distinct.
  std::vector<uint64_t> comm_offsets;  // (W + 1,)
  std::vector<uint64_t> comm_keys;
  std::vector<uint64_t> evicted;  // keys some cache dropped after the batch (a key once)
  // Of them, those no cache holds any more, each with the worker whose
  // eviction dropped its last copy (on demand: the row to push to the PS from
  // there); in eviction order: worker by worker, each one's oldest batch
  // first, a batch's keys in the snapshot's order (the order the batch first
  // had them), but for the batch an eviction stops inside, whose lowest keys
  // go in the order their selection leaves them. So the list is not sorted by
  // key within a batch; it is the same on every run of the same batches.
  std::vector<uint64_t> lost_keys;
  std::vector<int32_t> lost_from;

  uint64_t pulls = 0;         // fetches, from peers and the PS
  uint64_t peer_pulls = 0;    // of them, served by a peer's cache
  // The replay's model of pushes (bench/herald_replay.py), where every row a
  // batch trained is dirty: the scheduler does not see which rows were written
  // since (hps.worker_caches writes the trained ones only, and counts those).
  uint64_t pushes = 0;        // rows sent to the PS, eviction pushes included
  uint64_t evict_pushes = 0;  // of them, rows evicted from their last holder (each taken as dirty)
  uint64_t shared = 0;        // gradient rows exchanged for keys several workers train
  uint64_t distinct = 0;      // distinct keys in the batch
  uint64_t examples_moved = 0;  // examples given an origin that go to another worker
};

class Herald {
 public:
  // Throws std::invalid_argument for workers outside [1, 64] or example_cost
  // outside [0, 65536] (or not a number).
  explicit Herald(const HeraldOptions& options);
  ~Herald();
  Herald(const Herald&) = delete;
  Herald& operator=(const Herald&) = delete;

  // Plans one batch and updates the snapshot. Example i has the keys
  // keys[offsets[i] : offsets[i + 1]] (offsets: n_examples + 1 entries, from 0,
  // non-decreasing). Throws std::invalid_argument (naming the index) for bad
  // offsets or a reserved key (CheckKeys), before changing anything.
  // upcoming[0 : n_upcoming): the lookahead window (the header comment),
  // typically the keys of the next K batches; none by default. A reserved key
  // there throws std::invalid_argument naming upcoming[i]. origin: null, or
  // (n_examples,) the worker that holds each example now (-1: none), which
  // the location-aware partition weighs by example_cost (the header comment);
  // one outside [-1, W) throws std::invalid_argument naming origin[i].
  // Out of memory it throws std::bad_alloc and leaves the snapshot as it was
  // (its caches, counts and memory), so the batch can be retried.
  HeraldPlan Schedule(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys,
                      const uint64_t* upcoming = nullptr, uint64_t n_upcoming = 0, const int32_t* origin = nullptr);
  // The same for examples of `fields` keys each: keys (n_examples, fields).
  HeraldPlan Schedule(const uint64_t* keys, uint64_t n_examples, int32_t fields, const uint64_t* upcoming = nullptr,
                      uint64_t n_upcoming = 0, const int32_t* origin = nullptr);

  const HeraldOptions& options() const { return options_; }
  // The keys worker w's cache holds now (its latest versions), ascending.
  std::vector<uint64_t> Cached(int32_t worker) const;
  // Every worker's at once, in one pass over the snapshot (Cached reads all
  // of it for each worker): worker w's keys are keys[offsets[w] :
  // offsets[w + 1]], least recently trained first (eviction order).
  // std::logic_error if the log and the per-worker counts disagree (a bug).
  std::vector<uint64_t> CachedByWorker(std::vector<uint64_t>& offsets) const;
  uint64_t cached(int32_t worker) const;  // how many
  uint64_t batches() const { return batches_; }
  uint64_t memory_bytes() const;

  // Drops every cached copy, pushing none (a fresh start: the PS holds all).
  // std::bad_alloc leaves the caches as they were.
  void Clear();

 private:
  struct Impl;  // the snapshot, by the width of a holder mask (src/ps/herald.cc)
  template <class Mask>
  struct Snapshot;

  HeraldOptions options_;
  std::unique_ptr<Impl> impl_;
  uint64_t batches_ = 0;
};

}  // namespace hps
