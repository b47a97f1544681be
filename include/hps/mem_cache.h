// MEM-PS: the host-memory cache of embedding rows between the device tier and
// SSD-PS (the MLSys 2020 paper's section 5).
//
// Rows live in a fixed arena of `capacity` slots. A row that is not cached
// comes from the loader (SSD-PS, or a fresh initialisation) and takes a free
// slot or evicts one chosen by the replacement policy; a dirty victim (its
// only copy) goes to the sink, which writes it to SSD-PS, before the call
// returns. Rows of the batches in flight are pinned: out of the policy's
// reach until they are written back or unpinned.
//
// Policies: "lru"; "lfu" (in-cache counts, ties to the least recent);
// "lru+lfu", the paper's: a visited row enters an LRU, the LRU's evictions
// enter an LFU, and the LFU's evictions leave the cache; "w-tinylfu": a 1%
// LRU window in front of a segmented LRU, whose admission compares the
// window's victim with the main victim by a count-min sketch of recent
// access frequency (aged by halving), so one-off keys cannot flush hot ones;
// "tinylfu-lfu": an LFU (ties to the least recent) whose counts are a wider,
// slowly aged count-min sketch's estimates of the whole history, also of keys
// not cached, so that a new row stays only if it is at least as frequent as
// the coldest cached one: close to an ideal whole-history LFU in bounded memory.
// "lru" and "tinylfu-lfu" build their order at a shard's first eviction (from
// each row's last visit, and for tinylfu-lfu its estimate then), so a cache
// that never fills, a table that fits in memory, pays no ordering per visit.
//
// Lookahead (SetLookahead): told the keys of the batches coming next, an
// eviction spares the rows they will need, Belady's rule inside that window,
// and leaves the rest of the choice to the policy.
//
// Concurrency: the keys are split over shards by hash, each with its own
// lock, policy and slots, so hits on different shards never contend. Misses
// are loaded under one miss lock: a row being evicted is in the sink before
// anyone can miss on it and read an older copy from SSD-PS.
//
// Failures: a dirty row is never only in a call's local batch. A call takes
// its victims' slots first and overwrites them only once the sink has their
// rows; if it throws before (CacheFullError when concurrent pins took the
// slots it counted, or the sink's or loader's exception), the victims are
// cached again, dirty, and the pins the call took are given back. A flush
// whose sink throws leaves its rows dirty. So a failed call can be retried.
// A release (WriteBack, Unpin, UnpinUpdated) that throws anything but
// BrokenPinError changed nothing (its change pass never allocates): its
// caller may retry it without unpinning any key twice.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hps/errors.h"  // CacheFullError

namespace hps {

enum class CachePolicyKind { kLru, kLfu, kLruLfu, kWTinyLfu, kTinyLfuLfu };

// "lru", "lfu", "lru+lfu", "w-tinylfu" or "tinylfu-lfu"; std::invalid_argument
// lists them.
CachePolicyKind ParseCachePolicy(const std::string& name);
std::string ToString(CachePolicyKind kind);
// The names ParseCachePolicy accepts, in that order.
std::vector<std::string> CachePolicyNames();

struct MemCacheOptions {
  uint32_t row_bytes = 0;      ///< bytes per row; > 0
  uint64_t capacity = 0;       ///< rows; > 0
  CachePolicyKind policy = CachePolicyKind::kTinyLfuLfu;  // the best of W3 (docs/benchmarks.md)
  double lru_fraction = 0.5;   ///< lru+lfu: the LRU's share of the slots, in (0, 1]
  uint32_t shards = 0;         ///< 0: one per 4096 rows of capacity, at most 64
  /// Transparent huge pages for the rows' arena: fewer TLB misses in a cache that
  /// fills, but a 2 MiB page is resident once one row in it is written. false where
  /// the resident set must follow the rows cached (hps.Lookup's budget counts them).
  bool huge_pages = true;
  /// Write every page of the rows' arena at construction: the whole budget is
  /// resident from the start, and no pull waits on the kernel for a fresh page
  /// (W4s's timed loop had spent much of its prefetch thread's CPU there: lines 9
  /// in docs/benchmarks.md).
  bool prefault = false;
  /// Bytes the lookahead window may hold (see SetLookahead, "Memory"): a share
  /// of the byte budget that the rows do not get (the rows' capacity is sized
  /// for the budget less this room). 0: no window may be set (a cache that
  /// never gets one); MemCache::kUnboundedRoom: no bound, for a cache sized in
  /// rows rather than bytes.
  uint64_t lookahead_room = 0;
};

struct MemCacheStats {
  uint64_t capacity = 0;         ///< slots, over all shards
  uint64_t size = 0;             ///< rows cached
  uint64_t pinned = 0;           ///< rows pinned now
  uint64_t dirty = 0;            ///< rows cached whose only copy is here
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t dirty_evictions = 0;  ///< evictions that went to the sink
  uint64_t rows_loaded = 0;      ///< rows asked of the loader
  uint64_t rows_flushed = 0;     ///< rows sent to the sink by FlushDirty
  uint64_t failed_releases = 0;  ///< HostBatch releases that failed (see HostBatch::Release)
  uint64_t lookahead_keys = 0;   ///< distinct keys in the lookahead window now (SetLookahead)
  uint64_t lookahead_spared = 0; ///< evictions whose policy victim was in the window: another row went
  uint64_t lookahead_forced = 0; ///< evictions that took a row in the window: every candidate scanned was
  uint64_t lookahead_slides = 0; ///< PopLookahead and SlideLookahead calls: the window moved on a batch
  uint64_t lookahead_bytes = 0;  ///< bytes the window holds now: tables, entries, Beyond, scratch (SetLookahead)
  uint64_t lookahead_room = 0;   ///< MemCacheOptions::lookahead_room: lookahead_bytes never passes it
  uint64_t lookahead_no_room = 0; ///< forced evictions that took the scan's choice: no room left for Beyond
  uint64_t lookahead_visited = 0; ///< candidates the evictions' walks looked up in the window (SetLookahead)
  uint64_t lookahead_skipped = 0; ///< candidates they skipped, unlooked: passed whole by a walk of the same window
  uint64_t shards = 0;
  uint64_t arena_bytes = 0;
  int numa_nodes = 1;            ///< the arena is interleaved across them when > 1
};

// A release (WriteBack, Unpin, UnpinUpdated) that found, past its check that
// every key was pinned, keys that something else had unpinned meanwhile: a
// broken pin contract (a concurrent caller released a pin it did not own, or
// the call names a key more often than it is pinned). The call released every
// other key and kept what it could of the named keys' updates (see WriteBack
// and UnpinUpdated), so it must not be retried: unlike std::invalid_argument
// (refused, nothing changed), this one has changed the cache. It is thrown
// even if memory runs out while the call keeps and names those keys (then
// with a shorter message, and every update of theirs counted in lost()).
class BrokenPinError : public std::runtime_error {
 public:
  BrokenPinError(const std::string& what, std::vector<uint64_t> unpinned, std::vector<uint64_t> lost)
      : std::runtime_error(what), unpinned_(std::move(unpinned)), lost_(std::move(lost)) {}
  // Indices into the call's keys of the occurrences it found no longer
  // pinned, increasing.
  const std::vector<uint64_t>& unpinned() const { return unpinned_; }
  // Those of them whose update the call could not keep (see WriteBack,
  // UnpinUpdated); their caller's copy, if any, is all that is left.
  const std::vector<uint64_t>& lost() const { return lost_; }
  // The same lists moved out, leaving them empty: for a handler that must
  // record them without allocating (the call cannot be made again).
  std::vector<uint64_t> TakeUnpinned() noexcept { return std::move(unpinned_); }
  std::vector<uint64_t> TakeLost() noexcept { return std::move(lost_); }

 private:
  std::vector<uint64_t> unpinned_;
  std::vector<uint64_t> lost_;
};

// Fills rows (n, row_bytes) for keys that are not cached; dirty[i] = 1 marks a
// row that exists nowhere else yet (0: it can be loaded again).
using RowLoader = std::function<void(const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t* dirty)>;
// Receives evicted or flushed dirty rows: their only copy, to be stored.
using RowSink = std::function<void(const uint64_t* keys, uint64_t n, const uint8_t* rows)>;

class MemCache {
 public:
  // Throws std::invalid_argument for bad options. The loader and sink may be
  // empty for a cache that only replays traces (Access).
  static std::unique_ptr<MemCache> New(const MemCacheOptions& options, RowLoader loader, RowSink sink);
  // Rows that a byte budget holds, counting each row's bookkeeping. A cache
  // with a lookahead room is given the rows of its budget less the room.
  static uint64_t CapacityForBudget(uint64_t budget_bytes, uint32_t row_bytes);
  // MemCacheOptions::lookahead_room: no bound.
  static constexpr uint64_t kUnboundedRoom = UINT64_MAX;
  // The most a window holds in a cache of `capacity` rows and `shards` (0:
  // the default count) besides its keys' tables and entries: Beyond and the
  // eviction scratch (see SetLookahead, "Memory"). A room of this plus the
  // keys' share never leaves a forced eviction without Beyond.
  static uint64_t LookaheadBaseRoom(uint64_t capacity, uint32_t shards = 0);
  // The most a window of `batches` batches of at most `batch_keys` keys each
  // (repeats counted) holds in such a cache besides LookaheadBaseRoom: its
  // tables, entries and batch counts, through any set, push, pop or slide
  // that keeps it at `batches` batches or fewer (a slide's table has room
  // for the batch entering too). A room of this plus LookaheadBaseRoom never
  // refuses such a window: a caller that knows its batches' size sizes the
  // room from it rather than from its budget.
  static uint64_t LookaheadWindowRoom(uint64_t batch_keys, uint32_t batches, uint64_t capacity,
                                      uint32_t shards = 0);

  virtual ~MemCache() = default;

  // Copies the rows of keys into out (n, row_bytes): cached ones are hits,
  // the others come from the loader (one call, distinct keys) and enter the
  // cache. With pin, every row of keys is pinned once per occurrence and
  // stays cached until WriteBack or Unpin. hit[i] (optional) = 1 for hits.
  // Without pin, a new row whose shard has every slot pinned is copied out
  // uncached; if the loader marked it dirty (its only copy), the sink stores
  // it before the call returns.
  // Throws CacheFullError when a shard has too few unpinned slots for its
  // share of the new rows, and passes on what the loader or sink throws;
  // either way the call holds no pin and no dirty row is lost (the victims
  // stay cached, dirty): nothing the caller can see changed but the
  // contents of out and hit, and the counts of stats().
  // out may be null: the rows are pinned (or visited) and not copied.
  virtual uint64_t Pull(const uint64_t* keys, uint64_t n, uint8_t* out, bool pin, uint8_t* hit) = 0;
  // Pull(keys, n, nullptr, pin = true, hit) that also gives the address of
  // each row (addresses[i]), valid while it stays pinned: see PinnedRows.
  virtual uint64_t Pin(const uint64_t* keys, uint64_t n, uint8_t* hit, uint8_t** addresses) = 0;
  // Overwrites the rows of pinned keys, marks them dirty and unpins them.
  // std::invalid_argument names a key that is not pinned (nothing changes).
  // `addresses` (or null): the rows' addresses that Pin or PinnedRows gave,
  // which spare looking the keys up again, as UnpinUpdated's do.
  // A key that passed the check and that something else unpinned before its
  // row was written keeps its row all the same (KeepUpdated: dirty in MEM-PS,
  // or stored if evicted since), and BrokenPinError names it (lost: those
  // rows the sink refused) once the other keys are written back.
  virtual void WriteBack(const uint64_t* keys, uint64_t n, const uint8_t* rows,
                         uint8_t* const* addresses = nullptr) = 0;
  // Unpins keys, leaving their rows as they are; `addresses` (or null) as
  // WriteBack's. A key that something else unpinned during the call is
  // named by BrokenPinError, once the other keys are unpinned.
  virtual void Unpin(const uint64_t* keys, uint64_t n, uint8_t* const* addresses = nullptr) = 0;
  // Trace replay: hits are visits; misses enter the cache with zero rows,
  // clean, unpinned, without the loader. hit[i] (optional). Returns hits.
  // With a lookahead window set, the call's own later keys are its head
  // (see SetLookahead).
  // A dirty victim goes to the sink before its slot is reused; if the sink
  // throws, it stays cached and dirty, and the keys after it are not visited.
  virtual uint64_t Access(const uint64_t* keys, uint64_t n, uint8_t* hit) = 0;
  // Sends every dirty row to the sink, in batches; they stay cached, clean.
  // If the sink throws, the rows it was given are dirty again (and the
  // shards not reached yet still are): a later flush sends them.
  virtual void FlushDirty() = 0;
  // Copies the rows of pinned keys into out (n, row_bytes), without counting
  // a visit: the rows of a batch in flight, re-read after an earlier batch's
  // write-back. std::invalid_argument names a key that is not pinned.
  // `addresses` (or null) as WriteBack's.
  virtual void ReadPinned(const uint64_t* keys, uint64_t n, uint8_t* out,
                          uint8_t* const* addresses = nullptr) const = 0;
  // Addresses of the rows of pinned keys, valid while they stay pinned: for
  // a batch that trains on MEM-PS's rows where they are (HostBatch) instead
  // of on a copy. Only the holder of a pin writes such a row, and it says so
  // with UnpinUpdated. std::invalid_argument names a key that is not pinned.
  virtual void PinnedRows(const uint64_t* keys, uint64_t n, uint8_t** rows) const = 0;
  // Unpin, marking dirty the rows of keys with updated[i] = 1: rows written
  // in place through PinnedRows. `addresses` (or null) are the rows' addresses
  // that Pin or PinnedRows gave, which spare looking the keys up again; a key
  // whose address does not hold its pinned row is refused like an unpinned one.
  // A key that something else unpinned during the call is named by
  // BrokenPinError, once the other keys are unpinned; if updated, its row is
  // marked dirty where it still lies (MarkUpdated), and lost() names it if
  // its row left its slot meanwhile (its step with it).
  virtual void UnpinUpdated(const uint64_t* keys, uint64_t n, const uint8_t* updated,
                            uint8_t* const* addresses) = 0;
  // Keeps the updates of a batch whose release was refused for keys that
  // something else unpinned, so that none is lost:
  //  * KeepUpdated: rows (n, row_bytes), the batch's copies of its updated
  //    rows. A key cached (pinned or not) gets its row, dirty; one evicted
  //    since gives its row to the sink (its only copy), with no load of the
  //    key meanwhile. Pins are left as they are. Passes on what the sink
  //    throws (those rows are not kept).
  //  * MarkUpdated: rows stepped in place at `addresses` (from Pin or
  //    PinnedRows). Each row still at its address under its key, pinned or
  //    not, is marked dirty; returns the indices of the keys whose row left
  //    its slot (evicted since: their steps are lost, and may have landed in
  //    the slot's new row). A batch bound to MEM-PS's rows calls it at its
  //    release for the stepped keys whose unpin was refused.
  // Both throw std::invalid_argument for the reserved key, changing nothing.
  virtual void KeepUpdated(const uint64_t* keys, uint64_t n, const uint8_t* rows) = 0;
  virtual std::vector<uint64_t> MarkUpdated(const uint64_t* keys, uint64_t n, uint8_t* const* addresses) = 0;
  // Lookahead eviction. keys (n, repeats allowed) are the keys of the
  // batches coming next, in the order they will be needed. The pipeline's
  // prefetch thread calls it before it pins batch i, with the keys of batches
  // i+1..i+K of its queue, concatenated (n = 0 at the end of the data: none
  // comes); batch i itself needs no window, its pins keep it. Each call
  // replaces the window the last one set. Until the first call, and after
  // ClearLookahead, eviction is exactly as without lookahead (K = 0).
  //
  // While a window is set, each eviction (by Pull, Pin or Access) walks the
  // policy's candidates in its eviction order (the policy's victim first) and
  // takes the first one whose key is not in the window. The rows so passed
  // over go behind the others of their rank (as recent as a visit would
  // make them; no visit is counted, and the others keep their order), so
  // that the next eviction's walk starts past them. If the first
  // kLookaheadScan candidates are all in the window, the eviction is forced
  // to look at the whole shard: it takes a row outside the window there if
  // one is cached and unpinned (the first in the policy's order as it was at
  // the window's first forced eviction, then in the order rows were loaded
  // or unpinned since), else the shard's row needed latest (the latest first
  // occurrence): Belady's choice inside the window. Access, which pins
  // nothing, also counts the rest of its own keys as the window's head, each
  // at its next occurrence in the call: a replayed batch is one the pipeline
  // would have pinned whole (so a forced eviction passes them over, and
  // takes the latest of those scanned if only they are left, or more than
  // kLookaheadScan of them come first). (A trace replay with a window of K
  // batches sets the keys of batches i+1..i+K before batch i's Access.)
  //
  // Cost: the call is O(n), its keys hashed into per-shard tables outside
  // any lock. A sliding window (PushLookahead, SlideLookahead below) costs
  // instead the keys of the batches entering and leaving: hashed outside any
  // lock, then each shard's table changed under its lock in O(its distinct
  // keys entering and leaving), without allocating (a table short of room is
  // grown outside the lock first), so a slide per batch costs O(batch), not
  // O(K x batch). An eviction looks up at most kLookaheadScan keys more than
  // without a window (a cost bound, not a tuned rule: on W3's tuning Zipf
  // trace at 1% a limit of 256 often met only window rows and kept 0.976 of
  // Belady at K = 4, 4096 kept 0.995), and an Access with one hashes its own
  // keys once. Outside Access, a walk skips the candidates that an earlier
  // walk under the same window passed over whole, in runs the policy keeps
  // (until a row enters them: lfu's rows of one count, lru+lfu's LFU rows of
  // one count and its LRU, w-tinylfu's segments, tinylfu-lfu's rows of one
  // estimate; lru's passed rows go to its front, behind every other): a
  // shard whose coldest rows are all in the window walks them once a
  // window, not once an eviction (it evicts alike; stats().lookahead_visited
  // and lookahead_skipped count the rows). A walk that skipped some and
  // found only window rows is made again, unskipped (the latest needed may
  // be among those skipped), and the walks after it skip nothing until one
  // finds a row outside the window. The first forced
  // eviction after each change of the window
  // (set, push, pop or slide: the positions changed) lists the shard's rows
  // (O(shard)); later ones take theirs from that list, kept as rows enter
  // the order, in amortized O(log shard) (plus the Access call's own keys
  // passed over, at most kLookaheadScan). The list takes up to 24 bytes a
  // slot of the shard, reserved at the first forced eviction (a window whose
  // evictions all find a row outside it takes none) and kept until
  // ClearLookahead, or until a change of the window needs its room.
  //
  // Memory: what the window holds between calls is stats().lookahead_bytes,
  // which never passes MemCacheOptions::lookahead_room (a share of the
  // budget: the rows get the rest): the shards' tables (12 bytes a slot, 20
  // once the window slides; a power of two at least twice the shard's keys,
  // at least 16), the sliding window's entries (see PushLookahead), the
  // eviction scratch (4 bytes a slot, up to kLookaheadScan: at most 16 KiB a
  // shard) and Beyond (24 bytes a slot of the shard, and 8 bytes for two
  // slots, up to kLookaheadScan, of its own scratch). A change of the window
  // whose tables, entries and scratch would pass the room throws
  // CacheFullError naming both, changing nothing. Beyond takes the room left:
  // a change drops it if the window needs that room (every change makes
  // the next forced eviction rebuild it anyway), and a forced eviction that
  // finds too little room left takes the scan's choice instead
  // (stats().lookahead_no_room). Not counted: a call's scratch, O(its keys),
  // freed before it returns (as a Pull's is).
  // Throws std::invalid_argument for the reserved key (naming its index) or
  // n >= 2^32 - 1, and CacheFullError for a window that would pass its room,
  // changing nothing.
  //
  // Thread safety: each shard's window is guarded by the shard's lock, like
  // its slots: a call builds the new windows without a lock, then swaps each
  // in under its shard's lock, so a concurrent Pull, Pin, Unpin or Access
  // sees, in each shard, the old window or the new one, whole (an Access
  // keeps, shard by shard, whether a window was set when it took the lock).
  // SetLookahead and ClearLookahead calls are serialised with each other:
  // the last one stands in every shard.
  static constexpr uint32_t kLookaheadScan = 4096;
  virtual void SetLookahead(const uint64_t* keys, uint64_t n) = 0;
  // A sliding window, batch by batch: the window as SetLookahead of its
  // batches' keys concatenated would set it (the same positions, so the
  // same evictions), at the cost of the batches entering and leaving
  // rather than of the whole window. PushLookahead appends one batch's keys
  // (n, repeats allowed) at the window's end (after ClearLookahead or
  // before any call: a window of that batch); PopLookahead drops its first
  // batch (a SetLookahead window is one batch); SlideLookahead is a push
  // then a pop in one change, so that a concurrent eviction never sees the
  // window between them: the pipeline's step from batches i+1..i+K to
  // i+2..i+K+1 (n = 0: no batch enters, at the end of the data).
  // Memory (in stats().lookahead_bytes, see SetLookahead): each batch's
  // distinct keys of a shard keep an entry (24 bytes: the key's next batch,
  // so that a pop moves it there; held in chunks of 64 a shard), beside
  // each shard's table (20 bytes a slot, at most half full), and 8 bytes a
  // batch a shard; a SetLookahead window gets its entries, as one batch, at
  // the first push or pop after it (O(its keys) then, not at each set).
  // Throws std::invalid_argument for the reserved key (naming its index),
  // a window of 2^32 - 1 keys or more, or a pop of a window with no batch,
  // and CacheFullError for a window that would pass its room (a pop too,
  // the first after a SetLookahead: it lists the set window's entries),
  // changing nothing. Thread safety as SetLookahead's.
  virtual void PushLookahead(const uint64_t* keys, uint64_t n) = 0;
  virtual void PopLookahead() = 0;
  virtual void SlideLookahead(const uint64_t* keys, uint64_t n) = 0;
  // Back to eviction without lookahead; the window is dropped and its memory
  // freed (lookahead_bytes 0).
  virtual void ClearLookahead() = 0;
  // Drops the cached rows of keys, clean or dirty, without the sink: keys
  // that SSD-PS erased (SsdStore::Bound), whose next Pull loads them anew.
  // A pinned row (a prefetch made beside the erase holds it) stays, pinned
  // where it is, but gets what the loader gives for its key now (for a key
  // SSD-PS erased, its initial row), clean or dirty as the loader says: the
  // key comes back as a new key would, never with the row erased. Without a
  // loader it keeps its row, marked dirty. Absent keys are skipped. Returns
  // the rows dropped (not those reloaded).
  // Throws std::invalid_argument for the reserved key (naming its index),
  // changing nothing.
  virtual uint64_t Erase(const uint64_t* keys, uint64_t n) = 0;
  // Whether key is cached, without counting a visit (never the reserved key).
  virtual bool Contains(uint64_t key) const = 0;
  // Counts a HostBatch release that failed, in stats().failed_releases: the
  // one record of a failure that a batch's destructor cannot throw.
  virtual void CountFailedRelease() = 0;

  virtual uint32_t row_bytes() const = 0;
  virtual MemCacheStats stats() const = 0;
};

}  // namespace hps
