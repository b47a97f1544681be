#include "hps/mem_cache.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>  // std::unique_ptr (SlideEntries's chunks)
#include <mutex>
#include <new>
#include <span>

#include "cache/broken_pins.h"
#include "cache/cache_policy.h"
#include "format/key_index.h"
#include "util/mix64.h"
#include "hps/keys.h"  // CheckKeys

namespace hps {
namespace {

using detail::CachePolicy;
using detail::kNoSlot;

// Bytes of bookkeeping per row besides the row itself: the hash map's node
// and bucket (~40), key, pins and flags (~14), the policy's links, counts and
// lists (~8 for lru; ~46 for tinylfu-lfu, whose sketch takes 18 of them; up
// to ~52 for lfu and lru+lfu, whose lists of one count take a list's ends,
// count and heap and table entries a slot; and 8 more for lru and tinylfu-lfu
// until the cache first fills: the deferred order's stamps),
// with some slack for the allocator.
constexpr uint64_t kOverheadPerRow = 112;
constexpr uint64_t kSinkBatchRows = 16384;
constexpr int kMpolInterleave = 3;  // <linux/mempolicy.h>; no libnuma needed

// A Fetch's missing keys, distinct in order of first appearance, each with
// the requests (indices into the call's keys) it answers, in call order:
// flat arrays where a map and a vector a key cost two allocations a miss.
class MissedKeys {
 public:
  MissedKeys(const uint64_t* keys, const std::vector<uint64_t>& missed) {
    std::vector<uint64_t> missing(missed.size());
    for (size_t j = 0; j < missed.size(); ++j) missing[j] = keys[missed[j]];
    std::vector<int64_t> inverse(missed.size());
    distinct_ = UniqueKeys(missing.data(), missing.size(), inverse.data());
    offsets_.assign(distinct_.size() + 1, 0);
    for (int64_t m : inverse) ++offsets_[m + 1];
    for (size_t m = 0; m < distinct_.size(); ++m) offsets_[m + 1] += offsets_[m];
    requests_.resize(missed.size());
    std::vector<uint64_t> next(offsets_.begin(), offsets_.end() - 1);
    for (size_t j = 0; j < missed.size(); ++j) requests_[next[inverse[j]]++] = missed[j];
  }
  const std::vector<uint64_t>& distinct() const { return distinct_; }
  // The requests key m answers.
  std::span<const uint64_t> requests(size_t m) const {
    return {requests_.data() + offsets_[m], requests_.data() + offsets_[m + 1]};
  }

 private:
  std::vector<uint64_t> distinct_;
  std::vector<uint64_t> offsets_;   // distinct_.size() + 1
  std::vector<uint64_t> requests_;  // missed.size(), grouped by key
};

int CountNumaNodes() {
  namespace fs = std::filesystem;
  std::error_code error;
  int nodes = 0;
  for (const auto& entry : fs::directory_iterator("/sys/devices/system/node", error)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 4 && name.compare(0, 4, "node") == 0 &&
        std::all_of(name.begin() + 4, name.end(), ::isdigit)) {
      ++nodes;
    }
  }
  return std::max(nodes, 1);
}

// The rows' memory: anonymous pages, interleaved over the NUMA nodes when
// there are several, so that no node's memory bus carries the whole cache.
class Arena {
 public:
  static constexpr uint64_t kPageBytes = 4096;  // the smallest page: one write faults in each

  Arena(uint64_t bytes, bool huge_pages, bool prefault) : bytes_(std::max<uint64_t>(bytes, 1)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<uint8_t*>(p);
    // A batch's rows are scattered over the arena, and with 4 KiB pages nearly every
    // row read missed the TLB as well as the cache. Best effort: THP may be off.
    if (huge_pages) madvise(data_, bytes_, MADV_HUGEPAGE);
    nodes_ = CountNumaNodes();
    if (nodes_ > 1) {
      unsigned long mask = nodes_ >= 64 ? ~0UL : (1UL << nodes_) - 1;
      // Best effort: a kernel without NUMA support leaves the default policy.
      syscall(SYS_mbind, data_, bytes_, kMpolInterleave, &mask, sizeof(mask) * 8, 0);
    }
    // After madvise and mbind, so that the pages come as huge and interleaved ones.
    if (prefault) {
      for (uint64_t b = 0; b < bytes_; b += kPageBytes) data_[b] = 0;
    }
  }
  ~Arena() { munmap(data_, bytes_); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  int nodes() const { return nodes_; }

 private:
  uint64_t bytes_;
  uint8_t* data_ = nullptr;
  int nodes_ = 1;
};

static_assert(kNoSlot == detail::KeyIndex::kNone, "a missing key reads as no slot");

// One shard's lookahead window: key -> the position of its first occurrence
// in the window's keys (smaller: needed sooner). Open addressing over a
// power-of-two table at most half full. Also an Access call's own keys in a
// shard, each at its next position in the call (Set as the call goes on).
// A sliding window (chained) also keeps, per key, the id of its last entry
// in the shard's Slide list, and drops keys that leave (Erase).
class Window {
 public:
  static constexpr uint32_t kAbsent = UINT32_MAX;
  static constexpr uint64_t kNone = UINT64_MAX;  // Find: no such key

  // Room for `n` distinct keys, none in yet; chained: with each key's last entry.
  void Reset(uint64_t n, bool chained = false) {
    uint64_t capacity = 16;
    while (capacity < 2 * n) capacity *= 2;
    keys_.assign(capacity, kEmptyKey);
    positions_.assign(capacity, kAbsent);
    if (chained) {
      lasts_.assign(capacity, kNone);
    } else {
      lasts_.clear();
    }
    mask_ = capacity - 1;
    size_ = 0;
  }
  // keys[i] at positions[i], in increasing positions: each key at its first.
  void Build(const std::vector<uint64_t>& keys, const std::vector<uint32_t>& positions) {
    Reset(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      uint32_t& at = positions_[Entry(keys[i])];
      if (at == kAbsent) at = positions[i];
    }
  }
  // Puts key at position (kAbsent: no longer in the window). REQUIRES: room
  // (Reset's n counts every key ever Set).
  void Set(uint64_t key, uint32_t position) { positions_[Entry(key)] = position; }
  // The key's position, or kAbsent.
  uint32_t Position(uint64_t key) const {
    const uint64_t at = Find(key);
    return at == kNone ? kAbsent : positions_[at];
  }
  // The key's entry in the table, or kNone.
  uint64_t Find(uint64_t key) const {
    if (size_ == 0) return kNone;
    for (uint64_t at = detail::Mix64(key) & mask_;; at = (at + 1) & mask_) {
      if (keys_[at] == key) return at;
      if (keys_[at] == kEmptyKey) return kNone;
    }
  }
  // The key's entry, inserted (at kAbsent) if new. REQUIRES: room.
  uint64_t Insert(uint64_t key) { return Entry(key); }
  uint32_t& PositionAt(uint64_t at) { return positions_[at]; }
  uint64_t& LastAt(uint64_t at) { return lasts_[at]; }  // REQUIRES: chained
  // Takes the key at entry `at` out (backward shift: no tombstones, so that
  // a sliding window's table stays as full as its keys).
  void EraseAt(uint64_t at) {
    for (uint64_t next = (at + 1) & mask_; keys_[next] != kEmptyKey; next = (next + 1) & mask_) {
      const uint64_t home = detail::Mix64(keys_[next]) & mask_;
      // The key at next stays unless `at` lies on its probe path (home..next, cyclic).
      const bool stays = at <= next ? (at < home && home <= next) : (at < home || home <= next);
      if (stays) continue;
      keys_[at] = keys_[next];
      positions_[at] = positions_[next];
      if (!lasts_.empty()) lasts_[at] = lasts_[next];
      at = next;
    }
    keys_[at] = kEmptyKey;
    positions_[at] = kAbsent;
    if (!lasts_.empty()) lasts_[at] = kNone;
    --size_;
  }
  // Whether `more` keys can enter without passing half the table.
  bool Fits(uint64_t more) const { return 2 * (size_ + more) <= keys_.size(); }
  // A chained copy with room for `more` keys entering.
  Window Grown(uint64_t more) const {
    Window grown;
    grown.Reset(size_ + more, /*chained=*/true);
    for (uint64_t at = 0; at < keys_.size(); ++at) {
      if (keys_[at] == kEmptyKey) continue;
      const uint64_t to = grown.Entry(keys_[at]);
      grown.positions_[to] = positions_[at];
      grown.lasts_[to] = lasts_.empty() ? kNone : lasts_[at];
    }
    return grown;
  }
  // visit(key, position) for each key in.
  template <class Visit>
  void ForEach(Visit visit) const {
    for (uint64_t at = 0; at < keys_.size(); ++at) {
      if (keys_[at] != kEmptyKey) visit(keys_[at], positions_[at]);
    }
  }
  uint64_t size() const { return size_; }  // keys ever Set (Build: distinct keys; a sliding window: its keys)
  // What the table holds: 12 bytes a slot, 20 chained.
  uint64_t Bytes() const {
    return keys_.capacity() * sizeof(uint64_t) + positions_.capacity() * sizeof(uint32_t) +
           lasts_.capacity() * sizeof(uint64_t);
  }
  void swap(Window& other) noexcept {
    keys_.swap(other.keys_);
    positions_.swap(other.positions_);
    lasts_.swap(other.lasts_);
    std::swap(mask_, other.mask_);
    std::swap(size_, other.size_);
  }

 private:
  uint64_t Entry(uint64_t key) {
    uint64_t at = detail::Mix64(key) & mask_;
    while (keys_[at] != kEmptyKey && keys_[at] != key) at = (at + 1) & mask_;
    if (keys_[at] == kEmptyKey) {
      keys_[at] = key;
      ++size_;
    }
    return at;
  }

  std::vector<uint64_t> keys_;
  std::vector<uint32_t> positions_;
  std::vector<uint64_t> lasts_;
  uint64_t mask_ = 0;
  uint64_t size_ = 0;
};

// Window positions count modulo 2^32 - 1 (kAbsent is never one), from a
// running counter that a sliding window advances batch by batch; a shard
// compares them relative to its window's head, so the counter may wrap.
// Every window starts just below the wrap, so that a long run (and the
// tests) cross it early rather than after 2^32 keys.
constexpr uint32_t kFirstPosition = Window::kAbsent - 4096;
// REQUIRES: by < kAbsent (a window holds fewer keys), so one wrap at most.
inline uint32_t AdvancePosition(uint32_t position, uint64_t by) {
  const uint64_t advanced = uint64_t{position} + by;  // no division: it runs once a key
  return static_cast<uint32_t>(advanced >= Window::kAbsent ? advanced - Window::kAbsent : advanced);
}
// position's distance from head (both in the window; kAbsent stays).
inline uint32_t RelativePosition(uint32_t position, uint32_t head) {
  if (position == Window::kAbsent) return Window::kAbsent;
  return position >= head ? position - head : position + (Window::kAbsent - head);
}

// A sliding window's record of one key's first occurrence in one batch (of
// one shard): the batch's keys are entries in a row, and each entry names the
// same key's entry in the next batch that has it, so that dropping a batch
// moves each of its keys to its next occurrence in O(its keys).
struct SlideEntry {
  uint64_t key = 0;
  uint32_t position = 0;
  uint64_t next = Window::kNone;  // entry id
};

// A vector's capacity once `needed` elements are in: Reserve's growth,
// which the window's memory check predicts before a change (see Shift).
inline uint64_t GrownCapacity(uint64_t capacity, uint64_t needed) {
  return needed <= capacity ? capacity : std::max(needed, 2 * capacity);
}

// Makes room for `more` elements in v as GrownCapacity says. May throw
// bad_alloc, having changed nothing.
template <class T>
void Reserve(std::vector<T>& v, uint64_t more) {
  v.reserve(GrownCapacity(v.capacity(), v.size() + more));
}

// A sliding window's entries of one shard, oldest first, in chunks of
// kChunk, so that a pop frees whole chunks and the memory held is known
// before a change (BytesAfter): a deque's blocks and map are its library's.
class SlideEntries {
 public:
  static constexpr uint64_t kChunk = 64;  // 1.5 KiB: a small cache's room need not hold a big one

  uint64_t size() const { return size_; }
  SlideEntry& operator[](uint64_t i) {
    const uint64_t at = head_ + i;
    return chunks_[at / kChunk][at % kChunk];
  }
  // May throw bad_alloc, having changed nothing.
  void push_back(const SlideEntry& entry) {
    if (head_ + size_ == chunks_.size() * kChunk) {
      Reserve(chunks_, 1);
      chunks_.push_back(std::make_unique<SlideEntry[]>(kChunk));  // (no throw after the reserve but the chunk's)
    }
    (*this)[size_] = entry;
    ++size_;
  }
  // Drops the first n entries.
  void pop_front(uint64_t n) {
    head_ += n;
    size_ -= n;
    const uint64_t dead = head_ / kChunk;
    chunks_.erase(chunks_.begin(), chunks_.begin() + static_cast<std::ptrdiff_t>(dead));
    head_ -= dead * kChunk;
  }
  // Keeps the first n entries (n <= size()).
  void truncate(uint64_t n) {
    size_ = n;
    chunks_.resize((head_ + n + kChunk - 1) / kChunk);
  }
  void swap(SlideEntries& other) noexcept {
    chunks_.swap(other.chunks_);
    std::swap(head_, other.head_);
    std::swap(size_, other.size_);
  }
  uint64_t Bytes() const { return BytesOf(chunks_.capacity(), chunks_.size()); }
  // Bytes() once `pushed` entries are appended, then the first `popped` dropped.
  uint64_t BytesAfter(uint64_t pushed, uint64_t popped) const {
    uint64_t chunks = chunks_.size(), capacity = chunks_.capacity();
    const uint64_t needed = (head_ + size_ + pushed + kChunk - 1) / kChunk;
    while (chunks < needed) capacity = GrownCapacity(capacity, ++chunks);  // as push_back grows it
    return BytesOf(capacity, chunks - (head_ + popped) / kChunk);
  }

 private:
  static uint64_t BytesOf(uint64_t capacity, uint64_t chunks) {
    return capacity * sizeof(std::unique_ptr<SlideEntry[]>) + chunks * kChunk * sizeof(SlideEntry);
  }

  std::vector<std::unique_ptr<SlideEntry[]>> chunks_;
  uint64_t head_ = 0;  // entries of chunks_[0] before the first
  uint64_t size_ = 0;
};

// A chained copy of a SetLookahead window (one batch, whose entries it never
// listed), with room for `more` keys entering: each of its keys gets an
// entry, appended to `entries` (ids from 0).
Window ChainedCopy(const Window& window, uint64_t more, SlideEntries* entries) {
  Window chained;
  chained.Reset(window.size() + more, /*chained=*/true);
  window.ForEach([&](uint64_t key, uint32_t position) {
    const uint64_t at = chained.Insert(key);
    chained.PositionAt(at) = position;
    chained.LastAt(at) = entries->size();
    entries->push_back({key, position});
  });
  return chained;
}

// The rest of an Access call's keys in one shard, the head of the lookahead
// window while the call runs: key -> its next position in the call.
struct CallWindow {
  Window next;                   // positions 0..length-1, kAbsent past a key's last
  std::vector<uint32_t> after;   // after[j]: the next position of the key at j, or kAbsent
  uint32_t length = 0;

  void Build(const uint64_t* keys, const std::vector<uint64_t>& mine) {
    length = static_cast<uint32_t>(mine.size());
    after.assign(mine.size(), Window::kAbsent);
    next.Reset(mine.size());
    for (size_t j = mine.size(); j-- > 0;) {  // from the back: each key ends at its first position
      const uint64_t key = keys[mine[j]];
      after[j] = next.Position(key);
      next.Set(key, static_cast<uint32_t>(j));
    }
  }
};

struct Shard {
  mutable std::mutex mutex;
  uint32_t capacity = 0;
  uint8_t* rows = nullptr;  // capacity x row_bytes, in the arena
  detail::KeyIndex where;  // key -> slot
  std::vector<uint64_t> keys;
  std::vector<uint32_t> pins;
  std::vector<uint8_t> dirty;
  std::vector<uint8_t> fresh;  // inserted pinned, never yet in the policy's order
  // Slots made dirty since the last flush (some since evicted). Room for
  // DirtySlotsBound(capacity) from the start, so that MarkDirty never
  // allocates: a release (ForPinned) and the undo paths (GiveBack, Redirty)
  // mark rows dirty midway through changes they cannot take back.
  std::vector<uint32_t> dirty_slots;
  std::vector<uint32_t> free;
  std::unique_ptr<CachePolicy> policy;
  Window window;  // the keys of the coming batches that hash here (SetLookahead, PushLookahead)
  uint32_t window_head = kFirstPosition;  // the position of the window's first key (all shards')
  // Changes with every change of the window: the policy's walk may skip the
  // runs a walk of the same epoch passed over (CachePolicy::WalkCandidates).
  uint64_t window_epoch = 1;
  // The epoch whose last walk found only window rows (0: none): its next
  // walks skip nothing, until one finds a row outside the window (see Victim).
  uint64_t unskipped_epoch = 0;
  // The sliding window's batches in this shard (see SlideEntry): guarded by
  // lookahead_mutex_ alone (only calls that change the window use them).
  SlideEntries entries;               // the batches' entries in a row
  uint64_t entries_base = 0;          // the id of entries[0]
  std::vector<uint64_t> batch_entries; // entries per batch, oldest first (a few: erased from the front)
  bool lookahead = false;  // SetLookahead was called, and ClearLookahead not since
  uint64_t pinned = 0, dirty_rows = 0;
  uint64_t hits = 0, misses = 0, evictions = 0, dirty_evictions = 0;
  uint64_t lookahead_spared = 0, lookahead_forced = 0, lookahead_no_room = 0;
  uint64_t lookahead_visited = 0, lookahead_skipped = 0;  // Victim's walks: rows looked up, rows skipped
  std::vector<uint32_t> passed;  // Victim's scratch: candidates passed over (reserved while a window is set)
  // Beyond the scan: every ordered row, so that a forced eviction is Belady's
  // over the whole shard (see Victim). Built at the first forced eviction of
  // a window; rows entering the order since are appended (Ordered). Entries
  // go stale as rows are pinned, evicted or erased, and are checked as they
  // come out (Live). Room for BeyondRoom(capacity) entries is reserved by
  // the build, so appending never allocates (a release appends midway), and
  // freed when the window is cleared.
  struct Beyond {
    bool built = false;
    std::vector<uint32_t> spares;  // rows outside the window, in the policy's order then as they entered it
    size_t head = 0;               // spares before it are taken or stale
    std::vector<uint64_t> ranked;  // rows in the window: a max-heap of position << 32 | slot
    std::vector<uint64_t> held;    // Victim's scratch: heap entries of the Access call's own keys
  } beyond;
  // What Beyond's spares, ranked and held hold (capacities), in the cache's
  // lookahead_bytes_: guarded by mutex, and changed only under miss_mutex_
  // too (every eviction holds it), so that Shift can take their room back.
  uint64_t beyond_bytes = 0;
};

// key's position in the shard's window from its head (kAbsent: not in it).
// REQUIRES: shard.mutex held.
inline uint32_t WindowRank(const Shard& shard, uint64_t key) {
  return RelativePosition(shard.window.Position(key), shard.window_head);
}

// A slot that TakeSlot gave for a new row: a free one, or a victim's, whose
// key and row stay in it until the caller overwrites them, so that GiveBack
// can still undo the eviction.
struct TakenSlot {
  uint32_t slot = kNoSlot;  // kNoSlot: every row of the shard is pinned
  bool victim = false;      // evicted from the policy's order (else off the free list)
  bool dirty = false;       // the victim was dirty: a copy of its row is in the SinkBatch
};

// Evicted or flushed dirty rows on their way to the sink.
struct SinkBatch {
  std::vector<uint64_t> keys;
  std::vector<uint8_t> rows;
  void Add(uint64_t key, const uint8_t* row, uint32_t row_bytes) {
    keys.push_back(key);
    rows.insert(rows.end(), row, row + row_bytes);
  }
};

class ShardedCache final : public MemCache {
  friend class MemCache;  // LookaheadBaseRoom: the sizes of the window's structures

 public:
  ShardedCache(const MemCacheOptions& o, RowLoader loader, RowSink sink)
      : row_bytes_(o.row_bytes),
        loader_(std::move(loader)),
        sink_(std::move(sink)),
        arena_(o.capacity * o.row_bytes, o.huge_pages, o.prefault),
        room_(o.lookahead_room) {
    const uint64_t shards = ShardCount(o.capacity, o.shards);
    shards_ = std::vector<Shard>(shards);
    uint64_t offset = 0;
    for (uint64_t s = 0; s < shards; ++s) {
      Shard& shard = shards_[s];
      shard.capacity = static_cast<uint32_t>(o.capacity / shards + (s < o.capacity % shards ? 1 : 0));
      shard.rows = arena_.data() + offset * row_bytes_;
      offset += shard.capacity;
      shard.keys.assign(shard.capacity, 0);
      shard.pins.assign(shard.capacity, 0);
      shard.dirty.assign(shard.capacity, 0);
      shard.fresh.assign(shard.capacity, 0);
      shard.free.resize(shard.capacity);
      // Address space only: its pages are touched as rows go dirty, as they were when it grew.
      shard.dirty_slots.reserve(DirtySlotsBound(shard.capacity));
      for (uint32_t i = 0; i < shard.capacity; ++i) shard.free[i] = shard.capacity - 1 - i;
      shard.policy = detail::NewCachePolicy(o.policy, shard.capacity, o.lru_fraction);
    }
  }

  // MemCacheOptions::shards as the cache takes it (0: one per 4096 rows, at most 64).
  static uint64_t ShardCount(uint64_t capacity, uint32_t shards) {
    const uint64_t count = shards == 0 ? std::clamp<uint64_t>(capacity / 4096, 1, 64) : shards;
    return std::min<uint64_t>(count, capacity);
  }

  uint64_t Pull(const uint64_t* keys, uint64_t n, uint8_t* out, bool pin, uint8_t* hit) override {
    return Fetch(keys, n, out, pin, hit, nullptr);
  }

  uint64_t Pin(const uint64_t* keys, uint64_t n, uint8_t* hit, uint8_t** addresses) override {
    return Fetch(keys, n, nullptr, /*pin=*/true, hit, addresses);
  }

  // Pull, and with `addresses` where each (pinned) row is. A call that throws
  // gives back every pin it took, so that it changes nothing the caller can
  // see; FetchPinning says where it can throw.
  uint64_t Fetch(const uint64_t* keys, uint64_t n, uint8_t* out, bool pin, uint8_t* hit, uint8_t** addresses) {
    CheckKeys(keys, n);
    if (hit) std::memset(hit, 0, n);
    std::vector<uint64_t> held;  // a key for each pin taken so far
    if (pin) held.reserve(n);  // push_back cannot throw below
    try {
      return FetchPinning(keys, n, out, pin, hit, addresses, &held);
    } catch (...) {
      if (!held.empty()) Unpin(held.data(), held.size(), nullptr);
      throw;
    }
  }

  // Fetch, appending to *held the key of each pin it takes. The slots of new
  // rows are taken first, the dirty victims' rows left where they are; only
  // once the sink has stored those rows do the new ones overwrite them. So a
  // call that finds too few slots (concurrent pins took the ones it counted)
  // or whose sink throws puts its victims back, cached and dirty as they
  // were: a dirty row is never only in a local batch.
  uint64_t FetchPinning(const uint64_t* keys, uint64_t n, uint8_t* out, bool pin, uint8_t* hit,
                        uint8_t** addresses, std::vector<uint64_t>* held) {
    const std::vector<std::vector<uint64_t>> by_shard = GroupByShard(keys, n);
    // Hits, shard by shard; misses wait for the miss lock.
    std::vector<uint64_t> missed;
    std::vector<uint64_t> missed_in(shards_.size(), 0);  // misses per shard, counted by Count on success
    uint64_t hits = 0;
    std::vector<uint32_t> slots;
    for (size_t s = 0; s < shards_.size(); ++s) {
      if (by_shard[s].empty()) continue;
      Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      const std::vector<uint64_t>& mine = by_shard[s];
      // Two passes, each asking for its cache lines kLookahead keys ahead: the
      // index's probes, then the policy's counters and the slots' pins (which
      // only the probe names). In one pass the probe still waited on memory for
      // half of Fetch's time (W5 prefetch thread, perf).
      slots.resize(mine.size());
      for (size_t j = 0; j < mine.size(); ++j) {
        if (j + kLookahead < mine.size()) shard.where.Prefetch(keys[mine[j + kLookahead]]);
        slots[j] = shard.where.Find(keys[mine[j]]);
      }
      for (size_t j = 0; j < mine.size(); ++j) {
        if (j + kLookahead < mine.size()) {
          const uint64_t key = keys[mine[j + kLookahead]];
          if (!pin) shard.policy->Prefetch(key);
          const uint32_t ahead = slots[j + kLookahead];
          if (ahead != kNoSlot) {
            __builtin_prefetch(&shard.pins[ahead]);
            shard.policy->PrefetchVisit(ahead, key);  // a first pin detaches it (unpinned: a touch)
          }
        }
        const uint64_t i = mine[j];
        // A pinning call's rows leave the policy's order until unpinned, so
        // that its visits can wait until it has succeeded (Count); an
        // unpinned hit is reordered now, by its count with this visit.
        if (!pin) shard.policy->Record(keys[i]);
        const uint32_t slot = slots[j];
        if (slot == kNoSlot) {
          ++missed_in[s];
          missed.push_back(i);
          continue;
        }
        ++hits;
        if (hit) hit[i] = 1;
        Deliver(shard, slot, out ? out + i * row_bytes_ : nullptr, pin);
        if (pin) held->push_back(keys[i]);
        if (addresses) addresses[i] = RowAt(shard, slot);
      }
    }
    if (missed.empty()) {
      Count(keys, by_shard, missed_in, pin);
      return hits;
    }

    std::lock_guard miss_lock(miss_mutex_);
    const MissedKeys missing(keys, missed);
    const std::vector<uint64_t>& load_keys = missing.distinct();
    // Another caller may have loaded some meanwhile; the rest need slots.
    std::vector<std::vector<size_t>> new_by_shard(shards_.size());
    for (size_t m = 0; m < load_keys.size(); ++m) {
      const size_t s = ShardOf(load_keys[m]);
      Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      const uint32_t slot = shard.where.Find(load_keys[m]);
      if (slot == kNoSlot) {
        new_by_shard[s].push_back(m);
        continue;
      }
      for (uint64_t i : missing.requests(m)) {
        Deliver(shard, slot, out ? out + i * row_bytes_ : nullptr, pin);
        if (pin) held->push_back(keys[i]);
        if (addresses) addresses[i] = RowAt(shard, slot);
      }
    }
    // Pinned rows must all fit; unpinned ones may pass through uncached.
    for (size_t s = 0; s < shards_.size() && pin; ++s) {
      const Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      if (new_by_shard[s].size() + shard.pinned > shard.capacity) {
        throw CacheFullError(
            "MEM-PS budget too small: a shard of " + std::to_string(shard.capacity) + " rows has " +
            std::to_string(shard.pinned) + " pinned and this call needs " + std::to_string(new_by_shard[s].size()) +
            " more (" + std::to_string(load_keys.size()) + " new rows of " + std::to_string(row_bytes_) +
            " bytes over " + std::to_string(shards_.size()) +
            " shards); raise the budget above the pinned working set of the batches in flight");
      }
    }
    std::vector<uint8_t> rows(load_keys.size() * row_bytes_);
    std::vector<uint8_t> dirty(load_keys.size(), 0);
    if (!load_keys.empty()) {
      if (!loader_) throw std::logic_error("MEM-PS: a miss with no loader");
      loader_(load_keys.data(), load_keys.size(), rows.data(), dirty.data());
      rows_loaded_ += load_keys.size();
    }
    // A slot for each new row (kNoSlot: served uncached), in new_by_shard's order.
    std::vector<std::vector<TakenSlot>> taken(shards_.size());
    SinkBatch evicted;
    try {
      for (size_t s = 0; s < shards_.size(); ++s) {
        if (new_by_shard[s].empty()) continue;
        Shard& shard = shards_[s];
        taken[s].reserve(new_by_shard[s].size());
        std::lock_guard lock(shard.mutex);
        for (size_t j = 0; j < new_by_shard[s].size(); ++j) {
          const TakenSlot t = TakeSlot(shard, &evicted);
          if (t.slot == kNoSlot && pin) {  // concurrent pins took the slots counted above
            throw CacheFullError("MEM-PS budget too small: every row of a shard of " +
                                 std::to_string(shard.capacity) + " rows is pinned (" + std::to_string(shard.pinned) +
                                 " pinned, this call needs " + std::to_string(new_by_shard[s].size() - j) +
                                 " more); raise the budget above the pinned working set of the batches in flight");
          }
          taken[s].push_back(t);  // kNoSlot and not pin: every row pinned, this one is served uncached
        }
      }
      // A row served uncached that the loader marked dirty exists nowhere
      // else: the sink stores it with the victims, under the miss lock, so
      // that the key's next miss loads this row rather than a new one.
      for (size_t s = 0; s < shards_.size(); ++s) {
        for (size_t j = 0; j < taken[s].size(); ++j) {
          const size_t m = new_by_shard[s][j];
          if (taken[s][j].slot == kNoSlot && dirty[m]) {
            evicted.Add(load_keys[m], rows.data() + m * row_bytes_, row_bytes_);
          }
        }
      }
      Sink(&evicted);
    } catch (...) {
      for (size_t s = 0; s < shards_.size(); ++s) {
        if (taken[s].empty()) continue;
        Shard& shard = shards_[s];
        std::lock_guard lock(shard.mutex);
        for (const TakenSlot& t : taken[s]) GiveBack(shard, t);
      }
      throw;
    }
    // The victims are stored: their slots take the new rows. Only growing
    // the index can throw here, bad_alloc:
    // the slots not yet filled are then freed, and the rows placed so far
    // are pins in *held like the others.
    for (size_t s = 0; s < shards_.size(); ++s) {
      if (new_by_shard[s].empty()) continue;
      Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      size_t j = 0;
      try {
        for (; j < new_by_shard[s].size(); ++j) {
          const size_t m = new_by_shard[s][j];
          const uint8_t* row = rows.data() + m * row_bytes_;
          const uint32_t slot = taken[s][j].slot;
          if (slot == kNoSlot) {
            if (out) {
              for (uint64_t i : missing.requests(m)) std::memcpy(out + i * row_bytes_, row, row_bytes_);
            }
            continue;
          }
          shard.where.Upsert(load_keys[m], slot);
          std::memcpy(RowAt(shard, slot), row, row_bytes_);
          shard.keys[slot] = load_keys[m];
          shard.dirty[slot] = 0;
          if (dirty[m]) MarkDirty(shard, slot);
          if (pin) {
            shard.fresh[slot] = 1;
            shard.pins[slot] = static_cast<uint32_t>(missing.requests(m).size());
            ++shard.pinned;
            for (uint64_t i : missing.requests(m)) held->push_back(keys[i]);
          } else {
            shard.policy->Add(slot, load_keys[m]);
            Ordered(shard, slot);
          }
          if (out) {
            for (uint64_t i : missing.requests(m)) std::memcpy(out + i * row_bytes_, row, row_bytes_);
          }
          if (addresses) {
            for (uint64_t i : missing.requests(m)) addresses[i] = RowAt(shard, slot);
          }
        }
      } catch (...) {
        for (size_t rest = s; rest < shards_.size(); ++rest) {
          Shard& other = shards_[rest];
          std::unique_lock other_lock(other.mutex, std::defer_lock);
          if (rest != s) other_lock.lock();
          for (size_t k = rest == s ? j : 0; k < taken[rest].size(); ++k) {
            if (taken[rest][k].slot != kNoSlot) other.free.push_back(taken[rest][k].slot);
          }
        }
        throw;
      }
    }
    Count(keys, by_shard, missed_in, pin);
    return hits;
  }

  // A Fetch that succeeded counts its hits and misses and, pinning, records
  // its keys' visits in the admission sketch; one that threw counts nothing,
  // so that the pipeline's retry of a prefetch that met CacheFullError is one
  // lookup per key in the hit rate and in the sketch, not one per attempt.
  // (An unpinned Fetch recorded its visits as it went: it is never retried.)
  void Count(const uint64_t* keys, const std::vector<std::vector<uint64_t>>& by_shard,
             const std::vector<uint64_t>& missed_in, bool pin) {
    for (size_t s = 0; s < shards_.size(); ++s) {
      const std::vector<uint64_t>& mine = by_shard[s];
      if (mine.empty()) continue;
      Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      shard.misses += missed_in[s];
      shard.hits += mine.size() - missed_in[s];
      if (!pin) continue;
      for (size_t j = 0; j < mine.size(); ++j) {
        if (j + kLookahead < mine.size()) shard.policy->Prefetch(keys[mine[j + kLookahead]]);
        shard.policy->Record(keys[mine[j]]);
      }
    }
  }

  void WriteBack(const uint64_t* keys, uint64_t n, const uint8_t* rows, uint8_t* const* addresses) override {
    ForPinned(
        detail::Release::kWriteBack, keys, n, "write back",
        [&](Shard& shard, uint32_t slot, uint64_t i) {
          std::memcpy(RowAt(shard, slot), rows + i * row_bytes_, row_bytes_);
          if (!shard.dirty[slot]) MarkDirty(shard, slot);
        },
        rows, addresses);
  }

  void Unpin(const uint64_t* keys, uint64_t n, uint8_t* const* addresses) override {
    ForPinned(detail::Release::kUnpin, keys, n, "unpin", [](Shard&, uint32_t, uint64_t) {}, nullptr, addresses);
  }

  uint64_t Access(const uint64_t* keys, uint64_t n, uint8_t* hit) override {
    CheckKeys(keys, n);
    std::lock_guard miss_lock(miss_mutex_);  // evictions only under it
    const std::vector<std::vector<uint64_t>> by_shard = GroupByShard(keys, n);
    SinkBatch evicted;
    uint64_t hits = 0;
    for (size_t s = 0; s < shards_.size(); ++s) {
      if (by_shard[s].empty()) continue;
      Shard& shard = shards_[s];
      std::unique_lock lock(shard.mutex);
      // With a window, the rest of this call's keys come before it (a
      // replayed batch is one the pipeline would have pinned whole).
      // (Fixed for the call: a window set meanwhile, while the lock is let go
      // for the sink, counts from the next call on.)
      const bool own = shard.lookahead && by_shard[s].size() < Window::kAbsent;
      CallWindow call;
      if (own) call.Build(keys, by_shard[s]);
      for (size_t j = 0; j < by_shard[s].size(); ++j) {
        const uint64_t i = by_shard[s][j];
        const uint64_t key = keys[i];
        if (own) call.next.Set(key, call.after[j]);
        shard.policy->Record(key);
        const uint32_t at = shard.where.Find(key);
        const bool found = at != kNoSlot;
        if (hit) hit[i] = found;
        if (found) {
          ++shard.hits;
          ++hits;
          if (shard.pins[at] == 0) shard.policy->Touch(at);
          continue;
        }
        ++shard.misses;
        const TakenSlot t = TakeSlot(shard, &evicted, own ? &call : nullptr);
        if (t.slot == kNoSlot) continue;  // all pinned: the access is served uncached
        if (t.dirty) {
          // Traces have no dirty rows; a cache that also has some stores
          // each victim before its slot is reused, so that a sink that
          // throws loses nothing (the victim is put back).
          lock.unlock();
          try {
            Sink(&evicted);
          } catch (...) {
            lock.lock();
            GiveBack(shard, t);
            throw;
          }
          lock.lock();
        }
        try {
          shard.where.Upsert(key, t.slot);
        } catch (...) {  // bad_alloc as the index grows
          GiveBack(shard, t);
          throw;
        }
        std::memset(RowAt(shard, t.slot), 0, row_bytes_);
        shard.keys[t.slot] = key;
        shard.policy->Add(t.slot, key);
        Ordered(shard, t.slot);
      }
    }
    return hits;
  }

  void FlushDirty() override {
    std::lock_guard miss_lock(miss_mutex_);  // no eviction drops a row between marking and sinking
    SinkBatch batch;
    // The rows of a batch are marked clean before the sink has them; if it
    // throws, they are dirty again (they are still cached: evictions wait
    // for the miss lock), so that the next flush or eviction retries them.
    auto sink = [&] {
      try {
        Sink(&batch);
      } catch (...) {
        Redirty(batch);
        throw;
      }
    };
    for (Shard& shard : shards_) {
      {
        std::lock_guard lock(shard.mutex);
        for (uint32_t slot : shard.dirty_slots) {  // a slot reused since is dirty only if listed again
          if (!shard.dirty[slot]) continue;
          batch.Add(shard.keys[slot], RowAt(shard, slot), row_bytes_);
          shard.dirty[slot] = 0;
          --shard.dirty_rows;
        }
        shard.dirty_slots.clear();
      }
      if (batch.keys.size() >= kSinkBatchRows) {
        const uint64_t rows = batch.keys.size();
        sink();
        rows_flushed_ += rows;
      }
    }
    const uint64_t rows = batch.keys.size();
    sink();
    rows_flushed_ += rows;
  }

  void ReadPinned(const uint64_t* keys, uint64_t n, uint8_t* out, uint8_t* const* addresses) const override {
    ForEachPinnedRow(
        keys, n, "read", [&](uint64_t i, const uint8_t* row) { std::memcpy(out + i * row_bytes_, row, row_bytes_); },
        addresses);
  }

  void PinnedRows(const uint64_t* keys, uint64_t n, uint8_t** rows) const override {
    // A pinned slot keeps its row where it is until unpinned, so the address outlives the lock.
    ForEachPinnedRow(keys, n, "rows", [&](uint64_t i, const uint8_t* row) { rows[i] = const_cast<uint8_t*>(row); });
  }

  void UnpinUpdated(const uint64_t* keys, uint64_t n, const uint8_t* updated,
                    uint8_t* const* addresses) override {
    ForPinned(
        detail::Release::kUnpinUpdated, keys, n, "unpin",
        [&](Shard& shard, uint32_t slot, uint64_t i) {
          if (updated[i] && !shard.dirty[slot]) MarkDirty(shard, slot);
        },
        updated, addresses);
  }

  void KeepUpdated(const uint64_t* keys, uint64_t n, const uint8_t* rows) override {
    CheckKeys(keys, n);
    std::lock_guard miss_lock(miss_mutex_);  // no load reads a key's stored row before the sink has the new one
    SinkBatch evicted;
    for (uint64_t i = 0; i < n; ++i) {
      Shard& shard = shards_[ShardOf(keys[i])];
      std::lock_guard lock(shard.mutex);
      const uint32_t slot = shard.where.Find(keys[i]);
      if (slot == kNoSlot) {
        evicted.Add(keys[i], rows + i * row_bytes_, row_bytes_);
        continue;
      }
      std::memcpy(RowAt(shard, slot), rows + i * row_bytes_, row_bytes_);
      if (!shard.dirty[slot]) MarkDirty(shard, slot);
    }
    Sink(&evicted);  // not counted in rows_flushed, which is FlushDirty's
  }

  std::vector<uint64_t> MarkUpdated(const uint64_t* keys, uint64_t n, uint8_t* const* addresses) override {
    CheckKeys(keys, n);
    const std::vector<std::vector<uint64_t>> by_shard = GroupByShard(keys, n);
    std::vector<uint64_t> gone;
    for (size_t s = 0; s < shards_.size(); ++s) {
      if (by_shard[s].empty()) continue;
      Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      for (uint64_t i : by_shard[s]) {
        const uint32_t slot = SlotOf(shard, keys[i], addresses[i]);
        if (slot == kNoSlot) {
          gone.push_back(i);
        } else if (!shard.dirty[slot]) {
          MarkDirty(shard, slot);
        }
      }
    }
    std::sort(gone.begin(), gone.end());
    return gone;
  }

  uint64_t Erase(const uint64_t* keys, uint64_t n) override {
    // The index marks its empty buckets with the reserved key: looked up, it
    // finds one, whose stale value names some slot.
    CheckKeys(keys, n);
    std::lock_guard miss_lock(miss_mutex_);  // no eviction moves a row meanwhile
    uint64_t dropped = 0;
    std::vector<uint64_t> held;  // pinned: their rows are reloaded below
    for (uint64_t i = 0; i < n; ++i) {
      Shard& shard = shards_[ShardOf(keys[i])];
      std::lock_guard lock(shard.mutex);
      const uint32_t slot = shard.where.Find(keys[i]);
      if (slot == kNoSlot) continue;
      if (shard.pins[slot] > 0) {
        if (loader_) {
          held.push_back(keys[i]);
        } else if (!shard.dirty[slot]) {
          MarkDirty(shard, slot);
        }
        continue;
      }
      shard.policy->Detach(slot);  // unpinned rows are in the order: out of it for good
      if (shard.dirty[slot]) {
        shard.dirty[slot] = 0;  // its entry in dirty_slots is skipped by the next flush
        --shard.dirty_rows;
      }
      shard.where.Erase(keys[i]);
      shard.free.push_back(slot);  // never past its initial capacity: cannot throw
      ++dropped;
    }
    if (!held.empty()) ReloadPinned(&held);
    return dropped;
  }

  // Erase's pinned rows: each gets what the loader gives for its key now, clean
  // or dirty as the loader says, in its slot (its pins hold it there).
  // REQUIRES: miss_mutex_ held (no other load or eviction meanwhile).
  void ReloadPinned(std::vector<uint64_t>* held) {
    std::sort(held->begin(), held->end());
    held->erase(std::unique(held->begin(), held->end()), held->end());
    std::vector<uint8_t> rows(held->size() * row_bytes_);
    std::vector<uint8_t> dirty(held->size(), 0);
    loader_(held->data(), held->size(), rows.data(), dirty.data());
    rows_loaded_ += held->size();
    for (size_t m = 0; m < held->size(); ++m) {
      Shard& shard = shards_[ShardOf((*held)[m])];
      std::lock_guard lock(shard.mutex);
      const uint32_t slot = shard.where.Find((*held)[m]);
      if (slot == kNoSlot) continue;  // (cannot happen: a pinned row stays)
      std::memcpy(RowAt(shard, slot), rows.data() + m * row_bytes_, row_bytes_);
      if (dirty[m] && !shard.dirty[slot]) {
        MarkDirty(shard, slot);
      } else if (!dirty[m] && shard.dirty[slot]) {
        shard.dirty[slot] = 0;  // its entry in dirty_slots is skipped by the next flush
        --shard.dirty_rows;
      }
    }
  }

  bool Contains(uint64_t key) const override {
    if (key == kEmptyKey) return false;  // never cached; the index would find an empty bucket (see Erase)
    const Shard& shard = shards_[ShardOf(key)];
    std::lock_guard lock(shard.mutex);
    return shard.where.Find(key) != kNoSlot;
  }

  void SetLookahead(const uint64_t* keys, uint64_t n) override { Shift(keys, n, WindowChange::kSet); }
  void PushLookahead(const uint64_t* keys, uint64_t n) override { Shift(keys, n, WindowChange::kPush); }
  void PopLookahead() override { Shift(nullptr, 0, WindowChange::kPop); }
  void SlideLookahead(const uint64_t* keys, uint64_t n) override { Shift(keys, n, WindowChange::kSlide); }

  void ClearLookahead() override {
    std::vector<Window> windows(shards_.size());
    std::vector<Shard::Beyond> dropped(shards_.size());  // freed after, outside the locks
    std::vector<std::vector<uint32_t>> passed(shards_.size());
    std::vector<SlideEntries> entries(shards_.size());
    std::vector<std::vector<uint64_t>> batch_entries(shards_.size());
    std::vector<uint64_t> batch_lengths;
    std::lock_guard lookahead_lock(lookahead_mutex_);
    for (size_t s = 0; s < shards_.size(); ++s) {
      Shard& shard = shards_[s];
      {
        std::lock_guard lock(shard.mutex);
        shard.window.swap(windows[s]);
        shard.window_head = kFirstPosition;
        shard.lookahead = false;
        ++shard.window_epoch;
        DropBeyond(shard);
        std::swap(shard.beyond, dropped[s]);  // no window, no forced eviction: its room goes
        shard.passed.swap(passed[s]);
        lookahead_bytes_ -= shard.beyond_bytes;
        shard.beyond_bytes = 0;
      }
      entries[s].swap(shard.entries);
      shard.entries_base = 0;
      shard.batch_entries.swap(batch_entries[s]);
    }
    batch_lengths_.swap(batch_lengths);
    lookahead_bytes_ -= window_bytes_;
    window_bytes_ = 0;
    unlisted_ = false;
    window_length_ = 0;
    window_head_ = kFirstPosition;
  }

 private:
  enum class WindowChange { kSet, kPush, kPop, kSlide };

  // A shard's entering keys at their first occurrence in the batch (Shift).
  struct Plan {
    Window seen;                    // the entering keys (a set: the new window)
    std::vector<std::pair<uint64_t, uint32_t>> distinct;  // each key at its first position (not for a set)
    Window grown;                   // the shard's window with room for them (if short of it, or listed)
    bool grow = false;
    // A window that SetLookahead gave, listed (ChainedCopy) at the first push or pop after it.
    SlideEntries listed;
    std::vector<uint64_t> listed_batches;
  };

  // SetLookahead (the window anew: one batch), PushLookahead (a batch at its
  // end), PopLookahead (its first batch out) or SlideLookahead (push, then
  // pop). The entering keys are hashed and the entries listed without a
  // lock; each shard then takes its share of the change under its lock:
  // the whole table for a set, else O(its distinct keys entering and
  // leaving) table updates, which never allocate (a table short of room is
  // grown outside the lock first). The leaving batch's entries are freed
  // after. Beyond is dropped, as a window's positions changed.
  void Shift(const uint64_t* keys, uint64_t n, WindowChange change) {
    if (n > 0) CheckKeys(keys, n);
    const bool set = change == WindowChange::kSet;
    const bool push = change != WindowChange::kPop;
    const bool pop = change == WindowChange::kPop || change == WindowChange::kSlide;
    std::lock_guard lookahead_lock(lookahead_mutex_);
    if (pop && batch_lengths_.empty()) throw std::invalid_argument("MEM-PS lookahead: no batch in the window to drop");
    const uint64_t length = (set ? 0 : window_length_) + n;
    if (length >= uint64_t{UINT32_MAX}) {
      throw std::invalid_argument("MEM-PS lookahead: " + std::to_string(length) +
                                  " keys in the window; at most 2^32 - 2");
    }
    const uint32_t head = set ? kFirstPosition : window_head_;
    const uint32_t tail = AdvancePosition(head, set ? 0 : window_length_);  // the entering batch's first position
    std::vector<Plan> plans(shards_.size());
    {
      // Each shard's keys (their indices, in order) grouped in one array by
      // a counting sort, so that the shards' passes below read their own
      // keys, not all of them. (Per-shard vectors grown key by key cost a
      // quarter of a slide's instructions.) n < 2^32 - 1: the check above.
      std::vector<uint32_t> shard_of(n), order(n);
      std::vector<uint64_t> starts(shards_.size() + 1, 0);
      for (uint64_t i = 0; i < n; ++i) {  // n = 0 for a pop
        shard_of[i] = static_cast<uint32_t>(ShardOf(keys[i]));
        ++starts[shard_of[i] + 1];
      }
      for (size_t s = 0; s < shards_.size(); ++s) starts[s + 1] += starts[s];
      {
        std::vector<uint64_t> next(starts.begin(), starts.end() - 1);
        for (uint64_t i = 0; i < n; ++i) order[next[shard_of[i]]++] = static_cast<uint32_t>(i);
      }
      for (size_t s = 0; s < shards_.size(); ++s) {
        Plan& plan = plans[s];
        plan.seen.Reset(starts[s + 1] - starts[s]);
        for (uint64_t j = starts[s]; j < starts[s + 1]; ++j) {
          const uint64_t key = keys[order[j]];
          uint32_t& first = plan.seen.PositionAt(plan.seen.Insert(key));
          if (first != Window::kAbsent) continue;  // a repeat in the batch
          first = AdvancePosition(tail, order[j]);
          if (!set) plan.distinct.emplace_back(key, first);
        }
        if (set) continue;
        // The shard's window is read without its lock: only the holder of
        // lookahead_mutex_ writes a window.
        if (unlisted_) {
          plan.grown = ChainedCopy(shards_[s].window, plan.distinct.size(), &plan.listed);
          plan.listed_batches.assign(1, plan.listed.size());
          plan.grow = true;
        } else if (!shards_[s].window.Fits(plan.distinct.size())) {
          plan.grown = shards_[s].window.Grown(plan.distinct.size());
          plan.grow = true;
        }
      }
    }
    const uint64_t need = WindowBytesAfter(plans, set, push, pop);
    if (need > room_) {
      throw CacheFullError("MEM-PS lookahead: the window would hold " + std::to_string(need) +
                           " bytes (its keys' tables and entries, and the eviction scratch), more than its room of " +
                           std::to_string(room_) + " bytes in the budget (lookahead_room); give it more room, "
                           "or a shorter window (the window stays as it was)");
    }
    const uint64_t reserved = TakeWindowRoom(need);
    try {
      ShiftWithin(n, set, push, pop, head, plans);
    } catch (...) {
      SettleWindowRoom(reserved);
      throw;
    }
    SettleWindowRoom(reserved);
  }

  // Shift's change, once its memory is in the room. REQUIRES: lookahead_mutex_ held.
  void ShiftWithin(uint64_t n, bool set, bool push, bool pop, uint32_t head, std::vector<Plan>& plans) {
    for (Shard& shard : shards_) {  // may throw bad_alloc: before any change
      std::lock_guard lock(shard.mutex);
      shard.passed.reserve(ScanSlots(shard.capacity));  // Victim's push_back never allocates
    }
    if (unlisted_ && !set) {  // the set window's entries, as its one batch (its table swaps in below)
      for (size_t s = 0; s < shards_.size(); ++s) {
        shards_[s].entries.swap(plans[s].listed);
        shards_[s].entries_base = 0;
        shards_[s].batch_entries.swap(plans[s].listed_batches);
      }
    }
    if (push && !set) {
      // Appended here, outside the locks; taken back if memory runs out.
      const size_t batches = batch_lengths_.size();
      std::vector<std::pair<size_t, size_t>> sizes;  // each shard's entries and batch_entries before
      try {
        sizes.reserve(shards_.size());
        for (const Shard& shard : shards_) sizes.emplace_back(shard.entries.size(), shard.batch_entries.size());
        Reserve(batch_lengths_, 1);  // as WindowBytesAfter predicts
        batch_lengths_.push_back(n);
        for (size_t s = 0; s < shards_.size(); ++s) {
          Shard& shard = shards_[s];
          for (const auto& [key, position] : plans[s].distinct) shard.entries.push_back({key, position});
          Reserve(shard.batch_entries, 1);
          shard.batch_entries.push_back(plans[s].distinct.size());
        }
      } catch (...) {
        batch_lengths_.resize(std::min(batches, batch_lengths_.size()));
        for (size_t s = 0; s < sizes.size(); ++s) {
          shards_[s].entries.truncate(sizes[s].first);
          shards_[s].batch_entries.resize(sizes[s].second);
        }
        throw;
      }
    }
    std::vector<uint64_t> set_lengths(set ? 1 : 0, n);  // a set's one batch (allocated before any change)
    const uint32_t new_head = pop ? AdvancePosition(head, batch_lengths_.front()) : head;
    for (size_t s = 0; s < shards_.size(); ++s) {
      Shard& shard = shards_[s];
      Plan& plan = plans[s];
      std::lock_guard lock(shard.mutex);
      if (set) {
        shard.window.swap(plan.seen);
      } else {
        if (plan.grow) shard.window.swap(plan.grown);
        Window& window = shard.window;
        // The entering keys: new ones at their position, the others linked from their last entry.
        uint64_t id = shard.entries_base + shard.entries.size() - plan.distinct.size();
        for (const auto& [key, position] : plan.distinct) {
          uint64_t at = window.Find(key);
          if (at == Window::kNone) {
            at = window.Insert(key);
            window.PositionAt(at) = position;
          } else {
            shard.entries[window.LastAt(at) - shard.entries_base].next = id;
          }
          window.LastAt(at) = id++;
        }
        // The leaving keys: each to its next occurrence, or out.
        for (uint64_t e = 0; pop && e < shard.batch_entries.front(); ++e) {
          const SlideEntry& leaving = shard.entries[e];
          const uint64_t at = window.Find(leaving.key);
          if (leaving.next == Window::kNone) {
            window.EraseAt(at);
          } else {
            window.PositionAt(at) = shard.entries[leaving.next - shard.entries_base].position;
          }
        }
      }
      shard.window_head = new_head;
      shard.lookahead = true;
      ++shard.window_epoch;
      DropBeyond(shard);  // ranked by the old positions: rebuilt at the next forced eviction
    }
    for (size_t s = 0; s < shards_.size(); ++s) {  // the old tables and the leaving entries go, outside the locks
      Shard& shard = shards_[s];
      if (set) {
        shard.entries.swap(plans[s].listed);  // none: listed at the first push or pop
        shard.entries_base = 0;
        shard.batch_entries.swap(plans[s].listed_batches);
      } else if (pop) {
        const uint64_t leaving = shard.batch_entries.front();
        shard.entries.pop_front(leaving);
        shard.entries_base += leaving;
        shard.batch_entries.erase(shard.batch_entries.begin());
      }
    }
    unlisted_ = set;
    if (set) {
      batch_lengths_.swap(set_lengths);
      window_length_ = n;
    } else {
      window_length_ += n;
      if (pop) {
        window_length_ -= batch_lengths_.front();
        batch_lengths_.erase(batch_lengths_.begin());
        ++lookahead_slides_;
      }
    }
    window_head_ = new_head;
  }

  // Slots of Victim's scratch: `passed` holds at most the candidates one
  // walk visits, and Beyond's `held` at most the entries of `ranked`.
  static uint64_t ScanSlots(uint32_t capacity) { return std::min<uint64_t>(kLookaheadScan, capacity); }
  static uint64_t HeldSlots(uint32_t capacity) { return std::min<uint64_t>(kLookaheadScan, BeyondRoom(capacity)); }
  static uint64_t ScratchBytes(uint32_t capacity) { return ScanSlots(capacity) * sizeof(uint32_t); }
  // Beyond's spares, ranked and held, reserved (at the first forced eviction).
  static uint64_t BeyondBytes(uint32_t capacity) {
    return BeyondRoom(capacity) * (sizeof(uint32_t) + sizeof(uint64_t)) + HeldSlots(capacity) * sizeof(uint64_t);
  }

  // What the window holds now, Beyond's lists aside: the shards' tables,
  // entries and scratch, and the batches' counts. REQUIRES: lookahead_mutex_
  // held (only its holder changes these, or the scratch's capacity).
  uint64_t WindowBytes() const {
    uint64_t bytes = batch_lengths_.capacity() * sizeof(uint64_t);
    for (const Shard& shard : shards_) {
      bytes += shard.window.Bytes() + shard.entries.Bytes() + shard.batch_entries.capacity() * sizeof(uint64_t) +
               shard.passed.capacity() * sizeof(uint32_t);
    }
    return bytes;
  }

  // WindowBytes() once Shift has made its change (exactly: each structure
  // grows as Reserve says). REQUIRES: lookahead_mutex_ held.
  uint64_t WindowBytesAfter(const std::vector<Plan>& plans, bool set, bool push, bool pop) const {
    uint64_t bytes = sizeof(uint64_t) * (set    ? 1  // set_lengths
                                         : push ? GrownCapacity(batch_lengths_.capacity(), batch_lengths_.size() + 1)
                                                : batch_lengths_.capacity());
    for (size_t s = 0; s < shards_.size(); ++s) {
      const Shard& shard = shards_[s];
      const Plan& plan = plans[s];
      bytes += set ? plan.seen.Bytes() : plan.grow ? plan.grown.Bytes() : shard.window.Bytes();
      if (!set) {  // (a set's entries are none until the next push or pop)
        const SlideEntries& entries = unlisted_ ? plan.listed : shard.entries;
        const std::vector<uint64_t>& batches = unlisted_ ? plan.listed_batches : shard.batch_entries;
        bytes += entries.BytesAfter(push ? plan.distinct.size() : 0, pop ? batches.front() : 0);
        bytes += sizeof(uint64_t) *
                 (push ? GrownCapacity(batches.capacity(), batches.size() + 1) : batches.capacity());
      }
      bytes += std::max<uint64_t>(shard.passed.capacity(), ScanSlots(shard.capacity)) * sizeof(uint32_t);
    }
    return bytes;
  }

  // Takes `delta` bytes of the room for the window if they are free.
  bool TryTakeRoom(uint64_t delta) {
    uint64_t used = lookahead_bytes_.load();
    do {
      if (delta > room_ - used) return false;  // (used <= room_: every increase comes through here)
    } while (!lookahead_bytes_.compare_exchange_weak(used, used + delta));
    return true;
  }

  // Takes what a change of the window to `need` bytes (<= room_) adds, and
  // returns what the window is counted at since: max(need, its bytes now).
  // If Beyond's lists hold that room, they go first: the change drops them
  // anyway, and the next forced eviction rebuilds them in the room left.
  // REQUIRES: lookahead_mutex_ held.
  uint64_t TakeWindowRoom(uint64_t need) {
    if (need <= window_bytes_) return window_bytes_;
    if (TryTakeRoom(need - window_bytes_)) return need;
    std::vector<Shard::Beyond> freed(shards_.size());  // outside the locks
    {
      std::lock_guard miss_lock(miss_mutex_);  // no eviction lists a shard meanwhile
      for (size_t s = 0; s < shards_.size(); ++s) {
        Shard& shard = shards_[s];
        std::lock_guard lock(shard.mutex);
        DropBeyond(shard);
        shard.beyond.spares.swap(freed[s].spares);
        shard.beyond.ranked.swap(freed[s].ranked);
        shard.beyond.held.swap(freed[s].held);
        lookahead_bytes_ -= shard.beyond_bytes;
        shard.beyond_bytes = 0;
      }
      // The room holds the window's need alone, and no Beyond is left to take it.
      lookahead_bytes_ += need - window_bytes_;
    }
    return need;
  }

  // Counts the window at what it holds after a change for which `reserved`
  // bytes were counted. REQUIRES: lookahead_mutex_ held.
  void SettleWindowRoom(uint64_t reserved) {
    const uint64_t held = WindowBytes();
    lookahead_bytes_ += held - reserved;  // (modulo 2^64: a decrease too)
    window_bytes_ = held;
  }

 public:
  void CountFailedRelease() override { ++failed_releases_; }

  uint32_t row_bytes() const override { return row_bytes_; }

  MemCacheStats stats() const override {
    MemCacheStats st;
    st.shards = shards_.size();
    st.arena_bytes = arena_.bytes();
    st.numa_nodes = arena_.nodes();
    for (const Shard& shard : shards_) {
      std::lock_guard lock(shard.mutex);
      st.capacity += shard.capacity;
      st.size += shard.where.size();
      st.pinned += shard.pinned;
      st.dirty += shard.dirty_rows;
      st.hits += shard.hits;
      st.misses += shard.misses;
      st.evictions += shard.evictions;
      st.dirty_evictions += shard.dirty_evictions;
      st.lookahead_keys += shard.window.size();
      st.lookahead_spared += shard.lookahead_spared;
      st.lookahead_forced += shard.lookahead_forced;
      st.lookahead_no_room += shard.lookahead_no_room;
      st.lookahead_visited += shard.lookahead_visited;
      st.lookahead_skipped += shard.lookahead_skipped;
    }
    st.lookahead_slides = lookahead_slides_.load();
    st.lookahead_bytes = lookahead_bytes_.load();
    st.lookahead_room = room_;
    std::lock_guard miss_lock(miss_mutex_);
    st.rows_loaded = rows_loaded_;
    st.rows_flushed = rows_flushed_;
    st.failed_releases = failed_releases_;
    return st;
  }

 private:
  size_t ShardOf(uint64_t key) const {
    __extension__ using U128 = unsigned __int128;
    return static_cast<size_t>((static_cast<U128>(detail::Mix64(key)) * shards_.size()) >> 64);
  }

  std::vector<std::vector<uint64_t>> GroupByShard(const uint64_t* keys, uint64_t n) const {
    std::vector<std::vector<uint64_t>> by_shard(shards_.size());
    for (uint64_t i = 0; i < n; ++i) by_shard[ShardOf(keys[i])].push_back(i);
    return by_shard;
  }

  // Copies a cached row out and, with pin, pins it (once per request).
  // REQUIRES: shard.mutex held.
  // out == nullptr: pin (or visit) only, the caller wants no copy.
  void Deliver(Shard& shard, uint32_t slot, uint8_t* out, bool pin) {
    if (out) std::memcpy(out, RowAt(shard, slot), row_bytes_);
    if (!pin) {
      if (shard.pins[slot] == 0) shard.policy->Touch(slot);
      return;
    }
    if (shard.pins[slot]++ == 0) {
      ++shard.pinned;
      shard.policy->Detach(slot);
    }
  }

  // The most entries dirty_slots ever holds: MarkDirty rebuilds it once it
  // passes twice the slots, right after the push that took it there.
  static uint64_t DirtySlotsBound(uint32_t capacity) { return 2 * uint64_t{capacity} + 1; }

  // REQUIRES: shard.mutex held; the slot is clean. Never allocates or throws
  // (dirty_slots has room for DirtySlotsBound), so a release's change pass
  // cannot stop midway with some keys unpinned and others not.
  void MarkDirty(Shard& shard, uint32_t slot) noexcept {
    shard.dirty_slots.push_back(slot);
    shard.dirty[slot] = 1;
    ++shard.dirty_rows;
    if (shard.dirty_slots.size() >= DirtySlotsBound(shard.capacity)) {  // mostly evicted since: rebuild
      shard.dirty_slots.clear();
      for (uint32_t s = 0; s < shard.capacity; ++s) {
        if (shard.dirty[s]) shard.dirty_slots.push_back(s);
      }
    }
  }

  // A free slot, or the policy's victim's, whose row (if dirty) joins
  // `evicted`. The victim's key and row stay in the slot (see TakenSlot).
  // Throws only bad_alloc, having changed nothing.
  // REQUIRES: shard.mutex and miss_mutex_ held.
  TakenSlot TakeSlot(Shard& shard, SinkBatch* evicted, const CallWindow* call = nullptr) {
    TakenSlot t;
    if (!shard.free.empty()) {
      t.slot = shard.free.back();
      shard.free.pop_back();
      return t;
    }
    t.slot = Victim(shard, call);
    if (t.slot == kNoSlot) return t;
    t.victim = true;
    t.dirty = shard.dirty[t.slot] != 0;
    if (t.dirty) {
      try {
        evicted->Add(shard.keys[t.slot], RowAt(shard, t.slot), row_bytes_);
      } catch (...) {
        shard.policy->Add(t.slot, shard.keys[t.slot]);
        Ordered(shard, t.slot);
        throw;
      }
      shard.dirty[t.slot] = 0;
      --shard.dirty_rows;
      ++shard.dirty_evictions;
    }
    ++shard.evictions;
    shard.where.Erase(shard.keys[t.slot]);
    return t;
  }

  // Takes the policy's victim out of its order, or with a lookahead window,
  // the first candidate not in the window, else (BeyondVictim) a row of the
  // shard not in it or the one needed latest: see MemCache::SetLookahead.
  // `call` (or null): an Access call's keys still to come, the window's head.
  // kNoSlot when none is ordered.
  // REQUIRES: shard.mutex held.
  uint32_t Victim(Shard& shard, const CallWindow* call) {
    if (!shard.lookahead || (shard.window.size() == 0 && call == nullptr)) return shard.policy->Evict();
    struct Scan {
      Shard& shard;
      const CallWindow* call;
      uint32_t seen = 0, spare = kNoSlot, latest = kNoSlot;
      uint64_t latest_rank = 0;
      bool Visit(uint32_t slot) {
        ++seen;
        shard.passed.push_back(slot);
        const uint64_t key = shard.keys[slot];
        uint64_t rank = call ? call->next.Position(key) : Window::kAbsent;
        if (rank == Window::kAbsent) {
          const uint32_t position = WindowRank(shard, key);
          if (position == Window::kAbsent) {
            spare = slot;
            return false;
          }
          rank = uint64_t{position} + (call ? call->length : 0);
        }
        if (latest == kNoSlot || rank > latest_rank) {
          latest = slot;
          latest_rank = rank;
        }
        return true;
      }
    } scan{shard, call};
    shard.passed.clear();
    // One pointer captured: the std::function holds it without allocating.
    const std::function<bool(uint32_t)> visit = [s = &scan](uint32_t slot) { return s->Visit(slot); };
    // An Access call's own keys change as it goes: its walks promise nothing.
    // Nor does a walk right after one that found only window rows: the next
    // likely finds only them too, and would be made again (below) after
    // skipping, a shard that holds little but the window's rows walking
    // twice an eviction.
    const bool skip = call == nullptr && shard.unskipped_epoch != shard.window_epoch;
    CachePolicy::Walk walk = shard.policy->WalkCandidates(kLookaheadScan, skip ? shard.window_epoch : 0, visit);
    shard.unskipped_epoch = scan.spare == kNoSlot ? shard.window_epoch : 0;
    if (scan.spare == kNoSlot && walk.skipped > 0) {
      // Every row is in the window, and those skipped may hold the one needed
      // latest: the walk again, each row visited.
      shard.lookahead_visited += scan.seen;
      scan.seen = 0;
      scan.spare = scan.latest = kNoSlot;
      scan.latest_rank = 0;
      shard.passed.clear();
      walk = shard.policy->WalkCandidates(kLookaheadScan, 0, visit);
    }
    const uint32_t seen = scan.seen + walk.skipped;
    shard.lookahead_visited += scan.seen;
    shard.lookahead_skipped += walk.skipped;
    if (seen == 0) return kNoSlot;
    if (scan.spare != kNoSlot && seen == 1) return shard.policy->Evict();  // the policy's victim, its own way
    uint32_t slot = scan.spare != kNoSlot ? scan.spare : scan.latest;
    if (scan.spare == kNoSlot && seen == kLookaheadScan) {  // rows may lie past the scan: look at them all
      const uint32_t beyond = BeyondVictim(shard, call, &scan.spare);
      if (beyond != kNoSlot) slot = beyond;
    }
    // The rows passed over go behind the others of their rank, coldest
    // first, so that they keep their order and the next walk starts past them
    // (those of whole runs are there already).
    for (size_t i = walk.whole; i < shard.passed.size(); ++i) {
      if (shard.passed[i] != slot) shard.policy->Defer(shard.passed[i]);
    }
    if (scan.spare != kNoSlot) {
      ++shard.lookahead_spared;
    } else {
      ++shard.lookahead_forced;
    }
    shard.policy->Detach(slot);
    return slot;
  }

  // Room for Shard::Beyond's entries: the build puts in at most one per
  // slot; past twice that, Ordered drops them and the next forced eviction
  // builds them anew (O(capacity), amortized over as many appends).
  static uint64_t BeyondRoom(uint32_t capacity) { return 2 * uint64_t{capacity} + 1; }

  // Counts Beyond's lists at what they hold, `reserved` having been counted.
  // REQUIRES: shard.mutex and miss_mutex_ held.
  void SettleBeyondRoom(Shard& shard, uint64_t reserved) noexcept {
    const uint64_t held = shard.beyond.spares.capacity() * sizeof(uint32_t) +
                          (shard.beyond.ranked.capacity() + shard.beyond.held.capacity()) * sizeof(uint64_t);
    lookahead_bytes_ += held - reserved;  // (modulo 2^64)
    shard.beyond_bytes = held;
  }

  static void DropBeyond(Shard& shard) noexcept {
    shard.beyond.built = false;
    shard.beyond.spares.clear();  // keeps the room reserved
    shard.beyond.ranked.clear();
    shard.beyond.head = 0;
  }

  // A row entered the policy's order (inserted, unpinned, or put back): into
  // Beyond, if built. Never allocates or throws (a release calls it midway).
  // REQUIRES: shard.mutex held.
  void Ordered(Shard& shard, uint32_t slot) noexcept {
    Shard::Beyond& b = shard.beyond;
    if (!b.built) return;
    if (b.spares.size() + b.ranked.size() + 1 > BeyondRoom(shard.capacity)) {
      DropBeyond(shard);
      return;
    }
    const uint32_t position = WindowRank(shard, shard.keys[slot]);
    if (position == Window::kAbsent) {
      b.spares.push_back(slot);
    } else {
      b.ranked.push_back(uint64_t{position} << 32 | slot);
      std::push_heap(b.ranked.begin(), b.ranked.end());
    }
  }

  // Whether slot holds an ordered row (cached, unpinned) at window position
  // `position` (kAbsent: outside the window). REQUIRES: shard.mutex held.
  static bool Live(const Shard& shard, uint32_t slot, uint32_t position) {
    if (slot == kNoSlot) return false;
    const uint64_t key = shard.keys[slot];
    return shard.pins[slot] == 0 && shard.where.Find(key) == slot && WindowRank(shard, key) == position;
  }

  // A forced eviction's victim over the whole shard: the first row outside
  // the window (in the policy's order as of the build, then in the order rows
  // entered it), else the window's row needed latest; neither an Access
  // call's own key. kNoSlot when every ordered row is one of those (or more
  // than kLookaheadScan of the call's keys come first): the scan's choice
  // stands. *spared: set to the slot when it is outside the window.
  // Amortized O(log capacity) per eviction, plus at most kLookaheadScan of
  // the call's own keys looked at. Throws nothing: Beyond's room is reserved
  // by the build, at a window's first forced eviction (not with the window,
  // so that a window whose evictions all find a row outside it in the scan
  // costs no room); a build that finds no memory leaves the scan's choice.
  // REQUIRES: shard.mutex held; the window set.
  uint32_t BeyondVictim(Shard& shard, const CallWindow* call, uint32_t* spared) {
    Shard::Beyond& b = shard.beyond;
    if (!b.built) {
      DropBeyond(shard);
      const uint64_t want = BeyondBytes(shard.capacity);  // (Shift's fallback frees it whole, or none)
      if (want > shard.beyond_bytes && !TryTakeRoom(want - shard.beyond_bytes)) {
        ++shard.lookahead_no_room;
        return kNoSlot;
      }
      try {
        b.spares.reserve(BeyondRoom(shard.capacity));  // Ordered's push_back never allocates
        b.ranked.reserve(BeyondRoom(shard.capacity));
        b.held.reserve(HeldSlots(shard.capacity));     // nor the walk's below
      } catch (const std::bad_alloc&) {
        SettleBeyondRoom(shard, std::max(want, shard.beyond_bytes));
        return kNoSlot;
      }
      SettleBeyondRoom(shard, std::max(want, shard.beyond_bytes));
      struct Build {
        Shard& shard;
        bool Visit(uint32_t slot) {
          const uint32_t position = WindowRank(shard, shard.keys[slot]);
          if (position == Window::kAbsent) {
            shard.beyond.spares.push_back(slot);
          } else {
            shard.beyond.ranked.push_back(uint64_t{position} << 32 | slot);
          }
          return true;
        }
      } build{shard};
      try {
        shard.policy->ForEachCandidate(shard.capacity, [p = &build](uint32_t slot) { return p->Visit(slot); });
      } catch (const std::bad_alloc&) {
        DropBeyond(shard);  // the next forced eviction starts over
        return kNoSlot;
      }
      std::make_heap(b.ranked.begin(), b.ranked.end());
      b.built = true;
    }
    auto own = [&](uint32_t slot) {
      return call != nullptr && call->next.Position(shard.keys[slot]) != Window::kAbsent;
    };
    // The spares from head on: taken or stale ones go; the call's own keys
    // stay, moved up to the first entry not walked, so that head passes all
    // the others and the next walk meets only those again.
    uint32_t victim = kNoSlot, skipped = 0;
    size_t end = b.head;  // entries [head, end) walked
    for (; end < b.spares.size() && skipped < kLookaheadScan && victim == kNoSlot; ++end) {
      const uint32_t slot = b.spares[end];
      if (Live(shard, slot, Window::kAbsent)) {
        if (own(slot)) {
          ++skipped;
          continue;
        }
        victim = slot;
      }
      b.spares[end] = kNoSlot;
    }
    size_t to = end;
    for (size_t i = end; i-- > b.head;) {
      if (b.spares[i] != kNoSlot) b.spares[--to] = b.spares[i];
    }
    b.head = to;
    if (victim != kNoSlot) {
      *spared = victim;
      return victim;
    }
    b.held.clear();
    while (!b.ranked.empty() && b.held.size() < kLookaheadScan) {
      std::pop_heap(b.ranked.begin(), b.ranked.end());
      const uint64_t entry = b.ranked.back();
      b.ranked.pop_back();
      const uint32_t slot = static_cast<uint32_t>(entry);
      if (!Live(shard, slot, static_cast<uint32_t>(entry >> 32))) continue;  // stale
      if (own(slot)) {
        b.held.push_back(entry);
        continue;
      }
      victim = slot;
      break;
    }
    for (const uint64_t entry : b.held) {  // back where they were: popped just now, so there is room
      b.ranked.push_back(entry);
      std::push_heap(b.ranked.begin(), b.ranked.end());
    }
    return victim;
  }

  // Undoes TakeSlot while the slot still holds its victim: the victim is
  // cached again (dirty if it was), or a free slot goes back to the list.
  // No row can have taken the victim's key meanwhile: inserts wait for the
  // miss lock, and its holder stores or gives back its victims first.
  // REQUIRES: shard.mutex and miss_mutex_ held.
  void GiveBack(Shard& shard, const TakenSlot& t) {
    if (t.slot == kNoSlot) return;
    if (!t.victim) {
      shard.free.push_back(t.slot);  // never past its initial capacity: cannot throw
      return;
    }
    --shard.evictions;
    if (t.dirty) --shard.dirty_evictions;
    const uint64_t key = shard.keys[t.slot];
    shard.where.Upsert(key, t.slot);  // the key left this index just now: no growth
    shard.policy->Add(t.slot, key);
    Ordered(shard, t.slot);
    if (t.dirty) MarkDirty(shard, t.slot);
  }

  // Marks dirty again the cached rows of a flush whose sink threw, unless a
  // write-back did meanwhile. REQUIRES: miss_mutex_ held (so each is still cached).
  void Redirty(const SinkBatch& batch) {
    for (const uint64_t key : batch.keys) {
      Shard& shard = shards_[ShardOf(key)];
      std::lock_guard lock(shard.mutex);
      const uint32_t slot = shard.where.Find(key);
      if (slot != kNoSlot && !shard.dirty[slot]) MarkDirty(shard, slot);
    }
  }

  // Hands dirty rows to the sink, then empties the batch; if the sink throws,
  // the batch keeps them. REQUIRES: miss_mutex_ held, so that no miss reads
  // an older copy of them before they are stored.
  void Sink(SinkBatch* batch) {
    if (batch->keys.empty()) return;
    if (!sink_) throw std::logic_error("MEM-PS: dirty rows with no sink");
    sink_(batch->keys.data(), batch->keys.size(), batch->rows.data());
    batch->keys.clear();
    batch->rows.clear();
  }

  uint8_t* RowAt(const Shard& shard, uint32_t slot) const { return shard.rows + uint64_t{slot} * row_bytes_; }

  [[noreturn]] static void NotPinned(const char* what, const uint64_t* keys, uint64_t i) {
    throw std::invalid_argument("MEM-PS " + std::string(what) + ": keys[" + std::to_string(i) + "] = " +
                                std::to_string(keys[i]) + " is not pinned");
  }

  // visit(i, row) for each key, under its shard's lock; std::invalid_argument
  // names the first key that is not pinned.
  template <typename Visit>
  void ForEachPinnedRow(const uint64_t* keys, uint64_t n, const char* what, Visit visit,
                        uint8_t* const* addresses = nullptr) const {
    CheckKeys(keys, n);
    const std::vector<std::vector<uint64_t>> by_shard = GroupByShard(keys, n);
    for (size_t s = 0; s < shards_.size(); ++s) {
      if (by_shard[s].empty()) continue;
      const Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      for (uint64_t i : by_shard[s]) {
        const uint32_t slot = SlotOf(shard, keys[i], addresses == nullptr ? nullptr : addresses[i]);
        if (slot == kNoSlot || shard.pins[slot] == 0) NotPinned(what, keys, i);
        visit(i, RowAt(shard, slot));
      }
    }
  }

  // A shard's lookups of a key wait on cache misses: the index's probe and
  // the policy's counters. Asking for them kLookahead keys ahead overlaps
  // those misses instead of taking them one after another.
  static constexpr size_t kLookahead = 16;

  // The slot whose row is at `address` in shard, or kNoSlot.
  uint32_t SlotAt(const Shard& shard, const uint8_t* address) const {
    const auto offset = static_cast<uint64_t>(address - shard.rows);
    if (address < shard.rows || offset >= uint64_t{shard.capacity} * row_bytes_ || offset % row_bytes_ != 0) {
      return kNoSlot;
    }
    return static_cast<uint32_t>(offset / row_bytes_);
  }

  // key's slot in shard: where its row is at `address` (from Pin or
  // PinnedRows; kNoSlot if another key's row is there), else looked up.
  uint32_t SlotOf(const Shard& shard, uint64_t key, const uint8_t* address) const {
    if (address == nullptr) return shard.where.Find(key);
    const uint32_t slot = SlotAt(shard, address);
    return slot != kNoSlot && shard.keys[slot] == key ? slot : kNoSlot;
  }

  // Checks that every key is pinned, then applies `change` and unpins each.
  // With `addresses` (rows of the keys, from Pin), the slots come from them
  // instead of the index. The occurrences that something else unpinned
  // between the check and the change (a broken pin contract, or more
  // occurrences of a key than pins) get no change: once the others are
  // released, detail::ReportUnpinned keeps their updates (`data`: WriteBack's
  // rows, UnpinUpdated's updated) and throws BrokenPinError naming them.
  // Only the check can fail (NotPinned, bad_alloc), having changed nothing:
  // the change pass allocates nothing (MarkDirty has its room, the policy's
  // Add and Reattach never allocate, and a broken pin is recorded in the
  // pass's own lists). A failure midway would leave some keys unpinned and
  // others not, and the caller's retry would unpin the next batch's pins on
  // the first ones.
  template <typename Change>
  void ForPinned(detail::Release release, const uint64_t* keys, uint64_t n, const char* what, Change change,
                 const uint8_t* data, uint8_t* const* addresses) {
    CheckKeys(keys, n);
    std::vector<std::vector<uint64_t>> by_shard = GroupByShard(keys, n);
    std::vector<std::vector<uint32_t>> slots(shards_.size());  // found in the check, used in the change
    for (size_t s = 0; s < shards_.size(); ++s) {
      Shard& shard = shards_[s];
      std::lock_guard lock(shard.mutex);
      slots[s].reserve(by_shard[s].size());
      const std::vector<uint64_t>& mine = by_shard[s];
      for (size_t j = 0; j < mine.size(); ++j) {
        const uint64_t i = mine[j];
        if (addresses == nullptr && j + kLookahead < mine.size()) shard.where.Prefetch(keys[mine[j + kLookahead]]);
        const uint32_t slot = SlotOf(shard, keys[i], addresses == nullptr ? nullptr : addresses[i]);
        if (slot == kNoSlot || shard.pins[slot] == 0) NotPinned(what, keys, i);
        slots[s].push_back(slot);
      }
    }
    // A broken pin's occurrence is moved to the front of its shard's lists,
    // which the pass has read past (it is never ahead of the pass), and the
    // lists are cut to those once the shard is done: a record that needs no
    // room, so that the pass cannot stop midway, and costs the common case
    // nothing per key.
    uint64_t broken = 0;
    for (size_t s = 0; s < shards_.size(); ++s) {
      Shard& shard = shards_[s];
      std::vector<uint64_t>& mine = by_shard[s];
      std::vector<uint32_t>& their_slots = slots[s];
      size_t unpinned = 0;
      std::lock_guard lock(shard.mutex);
      for (size_t j = 0; j < mine.size(); ++j) {
        if (j + kLookahead < mine.size()) {
          const uint32_t ahead = their_slots[j + kLookahead];
          __builtin_prefetch(&shard.pins[ahead]);
          __builtin_prefetch(&shard.keys[ahead]);
          __builtin_prefetch(&shard.dirty[ahead]);
          __builtin_prefetch(&shard.fresh[ahead]);
          shard.policy->PrefetchVisit(ahead, keys[mine[j + kLookahead]]);  // the last unpin reattaches it
        }
        const uint64_t i = mine[j];
        const uint32_t slot = their_slots[j];
        // A concurrent caller may have unpinned it meanwhile (and the slot moved on).
        if (shard.pins[slot] == 0 || shard.keys[slot] != keys[i]) [[unlikely]] {
          mine[unpinned] = i;
          their_slots[unpinned] = slot;
          ++unpinned;
          continue;
        }
        change(shard, slot, i);
        if (--shard.pins[slot] > 0) continue;
        --shard.pinned;
        if (shard.fresh[slot]) {
          shard.fresh[slot] = 0;
          shard.policy->Add(slot, keys[i]);
        } else {
          shard.policy->Reattach(slot);
        }
        Ordered(shard, slot);
      }
      mine.resize(unpinned);  // shrinking: never allocates
      their_slots.resize(unpinned);
      broken += unpinned;
    }
    if (broken != 0) [[unlikely]] {
      detail::ReportUnpinned(*this, release, what, keys, n, data, {by_shard, slots, broken, &RowOfSlot});
    }
  }

  // Where slot's row of shard s is (detail::UnpinnedRecord's row_of).
  static uint8_t* RowOfSlot(const MemCache& cache, size_t s, uint32_t slot) {
    const auto& self = static_cast<const ShardedCache&>(cache);
    return self.RowAt(self.shards_[s], slot);
  }

  const uint32_t row_bytes_;
  RowLoader loader_;
  RowSink sink_;
  Arena arena_;
  std::vector<Shard> shards_;
  mutable std::mutex miss_mutex_;  // loads, inserts, evictions and flushes
  std::mutex lookahead_mutex_;     // one SetLookahead swaps its windows in at a time
  // The lookahead window's batches (guarded by lookahead_mutex_): each one's
  // keys, oldest first; their sum; the position of the first one's first key.
  std::vector<uint64_t> batch_lengths_;  // (a few: erased from the front)
  bool unlisted_ = false;  // the window is SetLookahead's, its entries not listed yet
  uint64_t window_length_ = 0;
  uint32_t window_head_ = kFirstPosition;
  // The window's memory (see MemCache::SetLookahead, "Memory"): its room, and
  // what it holds, Beyond's lists (Shard::beyond_bytes) and the rest
  // (window_bytes_, guarded by lookahead_mutex_) together.
  const uint64_t room_;
  std::atomic<uint64_t> lookahead_bytes_{0};
  uint64_t window_bytes_ = 0;
  std::atomic<uint64_t> lookahead_slides_{0};  // PopLookahead and SlideLookahead calls
  uint64_t rows_loaded_ = 0, rows_flushed_ = 0;  // guarded by miss_mutex_
  std::atomic<uint64_t> failed_releases_{0};
};

}  // namespace

CachePolicyKind ParseCachePolicy(const std::string& name) {
  if (name == "lru") return CachePolicyKind::kLru;
  if (name == "lfu") return CachePolicyKind::kLfu;
  if (name == "lru+lfu") return CachePolicyKind::kLruLfu;
  if (name == "w-tinylfu") return CachePolicyKind::kWTinyLfu;
  if (name == "tinylfu-lfu") return CachePolicyKind::kTinyLfuLfu;
  throw std::invalid_argument("unknown cache policy '" + name +
                              "'; choose one of lru, lfu, lru+lfu, w-tinylfu, tinylfu-lfu");
}

std::string ToString(CachePolicyKind kind) {
  switch (kind) {
    case CachePolicyKind::kLru: return "lru";
    case CachePolicyKind::kLfu: return "lfu";
    case CachePolicyKind::kLruLfu: return "lru+lfu";
    case CachePolicyKind::kWTinyLfu: return "w-tinylfu";
    case CachePolicyKind::kTinyLfuLfu: return "tinylfu-lfu";
  }
  return "?";
}

std::vector<std::string> CachePolicyNames() { return {"lru", "lfu", "lru+lfu", "w-tinylfu", "tinylfu-lfu"}; }

uint64_t MemCache::CapacityForBudget(uint64_t budget_bytes, uint32_t row_bytes) {
  return budget_bytes / (row_bytes + kOverheadPerRow);
}

uint64_t MemCache::LookaheadBaseRoom(uint64_t capacity, uint32_t shards) {
  if (capacity == 0) return 0;
  const uint64_t count = ShardedCache::ShardCount(capacity, shards);
  uint64_t bytes = 0;
  for (uint64_t s = 0; s < count; ++s) {
    const auto shard_capacity = static_cast<uint32_t>(capacity / count + (s < capacity % count ? 1 : 0));
    bytes += ShardedCache::BeyondBytes(shard_capacity) + ShardedCache::ScratchBytes(shard_capacity);
  }
  return bytes;
}

uint64_t MemCache::LookaheadWindowRoom(uint64_t batch_keys, uint32_t batches, uint64_t capacity, uint32_t shards) {
  if (capacity == 0 || batches == 0) return 0;
  const uint64_t count = ShardedCache::ShardCount(capacity, shards);
  const uint64_t keys = (uint64_t{batches} + 1) * batch_keys;  // a slide's table has room for the entering batch
  // Tables: a shard's is a power of two at least twice its keys (and 16): under
  // four times its keys, or 16; 20 bytes a slot chained (12 before).
  const uint64_t slots = 4 * keys + 16 * count;
  // Entries: 24 bytes for each batch's distinct keys, in chunks of kChunk a shard,
  // the first and last partly used (and one more while a change's are appended);
  // the chunk list's capacity at most twice the chunks it ever held.
  const uint64_t chunks = keys / SlideEntries::kChunk + 3 * count;
  // Batch counts: each shard's and the window's, a vector of at most twice batches + 1.
  const uint64_t counts = 2 * (uint64_t{batches} + 1) * (count + 1);
  return slots * (2 * sizeof(uint64_t) + sizeof(uint32_t)) + chunks * SlideEntries::kChunk * sizeof(SlideEntry) +
         2 * chunks * sizeof(std::unique_ptr<SlideEntry[]>) + counts * sizeof(uint64_t);
}

std::unique_ptr<MemCache> MemCache::New(const MemCacheOptions& options, RowLoader loader, RowSink sink) {
  if (options.row_bytes == 0) throw std::invalid_argument("MEM-PS: row_bytes must be > 0");
  if (options.capacity == 0) {
    throw std::invalid_argument("MEM-PS: capacity must be > 0 rows (the budget holds no row)");
  }
  if (options.capacity >= (uint64_t{1} << 32) * std::max<uint64_t>(options.shards, 1)) {
    throw std::invalid_argument("MEM-PS: capacity must be < 2^32 rows per shard");
  }
  if (!(options.lru_fraction > 0.0 && options.lru_fraction <= 1.0)) {
    throw std::invalid_argument("MEM-PS: lru_fraction must be in (0, 1]");
  }
  return std::make_unique<ShardedCache>(options, std::move(loader), std::move(sink));
}

}  // namespace hps
