// The Herald scheduler declared in include/hps/herald.h.
#include "hps/herald.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hps/keys.h"
#include "util/huge_pages.h"
#include "util/mix64.h"

namespace hps {
namespace {

// Set bits of a holder mask: masks hold a few bits, and std::popcount is a
// library call without -mpopcnt.
template <class Mask>
inline uint32_t Holders(Mask m) {
  uint32_t n = 0;
  for (; m != 0; m &= static_cast<Mask>(m - 1)) ++n;
  return n;
}

// std::popcount without the library call (the build does not assume -mpopcnt).
inline uint64_t Popcount64(uint64_t x) {
  x -= (x >> 1) & 0x5555555555555555ULL;
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
  return (x * 0x0101010101010101ULL) >> 56;
}

// Compaction's rank of a log position: its block's live records (a bit each)
// and the live records before the block.
struct RankBlock {
  uint64_t bits;
  uint64_t base;
};

// kSpread[m]: byte w is bit w of m (a worker's count, for 8-bit masks).
constexpr auto kSpread = [] {
  std::array<uint64_t, 256> t{};
  for (uint64_t m = 0; m < 256; ++m) {
    for (int w = 0; w < 8; ++w) t[m] |= ((m >> w) & 1) << (8 * w);
  }
  return t;
}();

// Sorts keys ascending and drops repeats, as std::sort and std::unique do:
// a pass places each key in one of about n / 4 buckets by its offset from the
// lowest key (buckets in key order), then each small bucket is sorted. tmp and
// count are scratch.
constexpr uint64_t kMinBucketSort = 1024;  // fewer keys: std::sort
uint64_t SortBuckets(uint64_t n) {
  uint64_t buckets = 1;
  while (buckets < n / 4) buckets *= 2;
  return buckets;
}
void SortUnique(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp, std::vector<uint32_t>& count) {
  const uint64_t n = keys.size();
  if (n < kMinBucketSort) {
    std::sort(keys.begin(), keys.end());
  } else {
    const auto [lo, hi] = std::minmax_element(keys.begin(), keys.end());
    const uint64_t low = *lo, span = *hi - *lo;
    const uint64_t buckets = SortBuckets(n);
    int shift = 0;
    while (shift < 64 && (span >> shift) >= buckets) ++shift;
    count.assign(buckets + 1, 0);
    for (uint64_t k : keys) ++count[((k - low) >> shift) + 1];
    for (uint64_t b = 0; b < buckets; ++b) count[b + 1] += count[b];
    tmp.resize(n);
    for (uint64_t k : keys) tmp[count[(k - low) >> shift]++] = k;  // count[b]: the end of bucket b after
    for (uint64_t b = 0, begin = 0; b < buckets; begin = count[b++]) {
      std::sort(tmp.begin() + static_cast<int64_t>(begin), tmp.begin() + count[b]);
    }
    keys.swap(tmp);
  }
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
}

// Room in SortUnique's scratch for up to n keys: a SortUnique of them then
// allocates nothing (it cannot fail).
void ReserveSortUnique(uint64_t n, std::vector<uint64_t>& tmp, std::vector<uint32_t>& count) {
  if (n < kMinBucketSort) return;
  tmp.reserve(n);
  count.reserve(SortBuckets(n) + 1);
}

// A log record: a key and its holders, packed in 9 bytes, so that the one
// read that confirms a fingerprint match also gives the holders. `holders`
// is the holder mask itself for W <= 8; for wider masks (most keys have one
// holder) it is 1 + the holder's index, or kShared where two or more hold the
// key (their mask in a SharedMasks table); 0 for no holder (a dead record).
struct __attribute__((packed)) LogRecord {
  uint64_t key;
  uint8_t holders;
};
constexpr uint8_t kShared = 0xff;

// The holder masks of the keys that two or more workers hold, for W > 8:
// open addressing with linear probing on Mix64, keys and masks together, at
// load 0.25 to 0.7 (a power-of-two size); an erase shifts the probe run back
// (a key says where its home is), so there are no tombstones. A batch's
// commit must not fail, so the table changes size only before it: Sized
// gives the table its Puts need (Adopt moves the keys in), and its Erases do
// not shrink the table; the room they leave goes at the next batch's Sized.
template <class Mask>
class SharedMasks {
  struct Entry {
    uint64_t key;
    Mask mask;
  };

 public:
  using Table = std::vector<Entry>;

  SharedMasks() { Resize(kMinSize); }

  // The mask of a key the table holds.
  Mask Get(uint64_t key) const {
    uint64_t i = Home(key);
    while (table_[i].key != key) i = (i + 1) & (table_.size() - 1);
    return table_[i].mask;
  }
  void Put(uint64_t key, Mask mask) {
    if (10 * (count_ + 1) > 7 * table_.size()) Resize(2 * table_.size());
    uint64_t i = Home(key);
    for (; table_[i].key != kEmptyKey; i = (i + 1) & (table_.size() - 1)) {
      if (table_[i].key == key) {
        table_[i].mask = mask;
        return;
      }
    }
    table_[i] = {key, mask};
    ++count_;
  }
  // Erases a key the table holds, moving back the keys after it that its
  // slot would have found. The table keeps its size (Sized shrinks it).
  void Erase(uint64_t key) {
    const uint64_t last = table_.size() - 1;
    uint64_t i = Home(key);
    while (table_[i].key != key) i = (i + 1) & last;
    for (uint64_t j = (i + 1) & last; table_[j].key != kEmptyKey; j = (j + 1) & last) {
      const uint64_t home = Home(table_[j].key);
      if (((j - home) & last) >= ((j - i) & last)) {  // its home is at or before i: it may move to i
        table_[i] = table_[j];
        i = j;
      }
    }
    table_[i].key = kEmptyKey;
    --count_;
  }
  // An empty table for a batch that holds at most `keys` keys at once: grown
  // to hold them below load 0.7 (so that Puts up to that count, and an
  // update's check of one more, do not grow it), or halved while the keys
  // held now are below load 0.25 and the batch's stay below 0.7; none where
  // this one's size is that.
  Table Sized(uint64_t keys) const {
    uint64_t size = table_.size();
    while (10 * (keys + 1) > 7 * size) size *= 2;
    while (size > kMinSize && 4 * count_ < size && 10 * (keys + 1) <= 7 * (size / 2)) size /= 2;
    return size == table_.size() ? Table() : Table(size, Entry{kEmptyKey, 0});
  }
  // Moves the keys into `table` (empty, from Sized) and keeps it.
  void Adopt(Table table) noexcept {
    table.swap(table_);
    shift_ = 64 - std::countr_zero(table_.size());
    for (const Entry& e : table) {
      if (e.key == kEmptyKey) continue;
      uint64_t i = Home(e.key);
      while (table_[i].key != kEmptyKey) i = (i + 1) & (table_.size() - 1);
      table_[i] = e;
    }
  }
  uint64_t count() const { return count_; }
  uint64_t MemoryBytes() const { return table_.capacity() * sizeof(Entry); }

 private:
  static constexpr uint64_t kMinSize = 64;
  uint64_t Home(uint64_t key) const { return detail::Mix64(key) >> shift_; }
  void Resize(uint64_t size) { Adopt(Table(size, Entry{kEmptyKey, 0})); }
  std::vector<Entry> table_;
  uint64_t count_ = 0;
  int shift_ = 64;
};

// Tunables of the snapshot's memory (the header's Memory paragraph).
constexpr double kMaxLoad = 0.8;     // the key index grows past this load...
constexpr double kGrownLoad = 0.55;  // ...to this one
constexpr double kLogRoom = 1.25;    // a compacted log has room for 1.25 x (live records + the batch)...
constexpr double kRoomBand = 0.1;    // ...or up to 10% more: it is reallocated only outside that band
constexpr uint64_t kMinSlots = 64;
// The greedy's load term (Partition): a worker's score less lambda x an
// example's mean key count x the fraction of its share already taken, with
// lambda = kLoadWarm / kLoadDen for an example some cache holds a key of and
// kLoadCold / kLoadDen (2) for one no cache does. Chosen on W7's Criteo
// sample (pulls 0.713x -> 0.676x of naive's); its Zipf traces were not tuned on.
constexpr int64_t kLoadDen = 4, kLoadWarm = 1, kLoadCold = 8;
// HeraldOptions::example_cost's fixed point: 1/256 of a key.
constexpr int kCostBits = 8;
constexpr double kMaxExampleCost = 65536;

}  // namespace

struct Herald::Impl {
  virtual ~Impl() = default;
  // Plans a batch whose offsets were checked, and updates the snapshot.
  // upcoming: the lookahead window (n_upcoming keys, checked); origin: null
  // or each example's worker (checked).
  virtual HeraldPlan Plan(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys,
                          const uint64_t* upcoming, uint64_t n_upcoming, const int32_t* origin) = 0;
  virtual std::vector<uint64_t> Cached(int32_t worker) const = 0;
  virtual std::vector<uint64_t> CachedByWorker(std::vector<uint64_t>& offsets) const = 0;
  virtual uint64_t Held(int32_t worker) const = 0;
  virtual uint64_t MemoryBytes() const = 0;
  virtual void Clear() = 0;
};

// The snapshot for holder masks of type Mask (W <= its bits).
//
// log: a record (key and holders, LogRecord) per (key, batch that last trained it), in
// training order, a run per batch starting at runs[r] (with a capacity; the
// runs order the records by their batch). A record is live while it has a
// holder, dead once it lost them to a later batch (which appended a new
// record) or to eviction. For W > 8 `shared` holds the mask of each key whose
// live record (or, while a batch is planned, whose old record that died in
// Find) says kShared: Commit's and Evict's Encode keep it so.
//
// index: open addressing with linear probing, a 4-byte slot per live record
// (half the 8 of a 32-bit hash and a 32-bit position, which made the index
// half the snapshot's memory): the record's position in its low `pos_bits`
// bits and, above them, a fingerprint of the key (bits of Mix64 that do not
// place the slot), so that a probe reads the log only on a fingerprint match.
// pos_bits is the fewest bits that hold every position until the next
// rebuild (about 21 for a million records, leaving an 11-bit fingerprint: a
// probe past a slot of another key reads the log once in 2,048). The home
// slot is multiply-shift of Mix64's high 32 bits (any table size). A slot
// does not say where its key's home is, so an erase cannot shift the probe
// run back: it leaves a tombstone, and the index is rebuilt from the log
// (live records only, no tombstones) when the log is compacted or the index
// is out of room, which is where the old index's positions were rewritten
// anyway.
//
// A batch's keys are found with one probe each, in the snapshot index itself
// (no table of the batch's distinct keys): a key's first appearance points
// its slot at the record it will get at the log's end (log.size() + u
// for the u-th distinct key, "pending"), inserting the slot if the key is
// new, so the key's later appearances find u there. The old record (if any)
// dies there and then (its holders, read into latest[u], are zeroed while the
// record is in cache), its position kept in old[u]. Until the batch is
// committed the pass can be undone (Undo revives the old records and puts
// back the index's slots, or the index the batch grew), so a failed
// allocation leaves the snapshot as it was, memory included. Everything the
// commit allocates is allocated before it (PrepareCommit), so that the
// commit, which changes the counts, the log and the index, cannot fail
// halfway.
template <class Mask>
struct Herald::Snapshot final : Herald::Impl {
  static constexpr uint32_t kFree = ~uint32_t{0};
  static constexpr uint32_t kTomb = ~uint32_t{0} - 1;
  static constexpr uint32_t kNoRecord = ~uint32_t{0};  // old[u] of a key the snapshot did not hold
  static constexpr uint32_t kNoRecordInTomb = kNoRecord - 1;  // the same, whose slot was a tombstone
  // Positions are at most 2^pos_bits - 3, so that no slot equals kFree or
  // kTomb whatever its fingerprint; with 32 bits (no fingerprint) that allows
  // 2^32 - 2 records, as the 8-byte slots did.
  static constexpr uint64_t kMaxRecords = UINT32_MAX - 1;

  explicit Snapshot(const HeraldOptions& options)
      : opt(options),
        cost(static_cast<int64_t>(std::llround(options.example_cost * (1 << kCostBits)))),
        held(options.workers, 0),
        cursor(options.workers, 0),
        score(options.workers, 0),
        gains(options.workers, 0),
        losses(options.workers, 0) {
    Rebuild(TableFor(kMinSlots), kMinSlots, 0);
  }

  using Record = LogRecord;
  // The index and the log are read at random positions, a batch's keys each:
  // on huge pages (util/huge_pages.h), not a TLB miss a probe.
  using Index = std::vector<uint32_t, detail::HugePageAllocator<uint32_t>>;
  using Log = std::vector<Record, detail::HugePageAllocator<Record>>;
  static constexpr bool kMaskInRecord = sizeof(Mask) == 1;

  // A record's holders byte for holder mask m (LogRecord).
  static uint8_t HoldersByte(Mask m) {
    if constexpr (kMaskInRecord) {
      return m;
    } else {
      if ((m & (m - 1)) != 0) return kShared;
      return m == 0 ? 0 : static_cast<uint8_t>(std::countr_zero(m) + 1);
    }
  }
  // The holder mask of record r.
  Mask HoldersOf(const Record& r) const {
    if constexpr (kMaskInRecord) {
      return r.holders;
    } else {
      if (r.holders == kShared) return shared.Get(r.key);
      return r.holders == 0 ? Mask{0} : static_cast<Mask>(uint64_t{1} << (r.holders - 1));
    }
  }
  // Whether worker w (bit: its bit) holds record r.
  bool HeldBy(const Record& r, int32_t w, Mask bit) const {
    if constexpr (kMaskInRecord) {
      return (r.holders & bit) != 0;
    } else {
      return r.holders == w + 1 || (r.holders == kShared && (shared.Get(r.key) & bit) != 0);
    }
  }
  // A record of `key` held by `now`, the shared table updated: `was` is the
  // mask of the key's last record (the table holds it where it is shared).
  Record Encode(uint64_t key, Mask now, Mask was) {
    if constexpr (!kMaskInRecord) {
      if ((now & (now - 1)) != 0) {
        shared.Put(key, now);
      } else if ((was & (was - 1)) != 0) {
        shared.Erase(key);
      }
    }
    return {key, HoldersByte(now)};
  }

  // Fetches the record at `pos` (both lines where it straddles two).
  void Touch(uint64_t pos) const {
    const char* r = reinterpret_cast<const char*>(log.data() + pos);
    __builtin_prefetch(r);
    const char* last = r + sizeof(Record) - 1;
    if (((reinterpret_cast<uintptr_t>(r) ^ reinterpret_cast<uintptr_t>(last)) & ~uintptr_t{63}) != 0) __builtin_prefetch(last);
  }

  // ---- the key index ----
  static uint64_t Hash(uint64_t key) { return detail::Mix64(key); }
  uint64_t Home(uint64_t hash) const { return ((hash >> 32) * index.size()) >> 32; }
  uint64_t Next(uint64_t i) const { return i + 1 == index.size() ? 0 : i + 1; }
  // The fingerprint bits of a slot (Mix64's low bits, above the position).
  uint32_t Print(uint64_t hash) const { return static_cast<uint32_t>((hash & 0xffffffffULL) << pos_bits); }
  uint32_t PosOf(uint32_t v) const { return v & pos_mask; }
  uint32_t PrintOf(uint32_t v) const { return v & ~pos_mask; }
  // The highest position slots can hold now.
  uint64_t MaxPos() const { return uint64_t{pos_mask} - 2; }
  void SetPosBits(int bits) {
    pos_bits = bits;
    pos_mask = bits == 32 ? ~uint32_t{0} : static_cast<uint32_t>((uint64_t{1} << bits) - 1);
  }

  // Places a key known to be absent (no tombstones: a rebuild's index).
  void Place(uint64_t hash, uint64_t pos) {
    uint64_t i = Home(hash);
    while (index[i] != kFree) i = Next(i);
    index[i] = Print(hash) | static_cast<uint32_t>(pos);
  }

  // The table a rebuild to `slots` slots fills: a new one (room only: its
  // pages are touched when it is filled), or none where the index has that
  // size (refilled in place: fresh pages would cost a page fault each).
  Index TableFor(uint64_t slots) const {
    Index table;
    if (slots != index.size()) table.reserve(slots);
    return table;
  }

  // Rebuilds the index with `slots` slots (in `table`, from TableFor) from
  // the live records and the pending ones (uniq[0 : pending) at positions
  // log.size() + u), with position bits for positions up to `limit`. Returns
  // the table it replaced (none where it refilled the index in place).
  Index Rebuild(Index table, uint64_t slots, uint64_t limit, uint64_t pending = 0) {
    if (slots == index.size()) {
      std::fill(index.begin(), index.end(), kFree);
    } else {
      table.assign(slots, kFree);  // within its room: allocates nothing
      index.swap(table);
    }
    int bits = 2;
    while (bits < 32 && (uint64_t{1} << bits) - 2 <= limit) ++bits;  // limit <= 2^bits - 3
    SetPosBits(bits);
    tombs = 0;
    used = 0;
    // Each live record's home slot is fetched kAhead live records ahead of
    // its insert (ahead[] keeps their hashes and positions). Newest first:
    // the batch's pending keys, then the log from its end, so that the keys a
    // batch is likeliest to probe (the recently trained ones) sit nearest
    // their home slots and the old ones take the longer runs.
    constexpr uint64_t kAhead = 32;
    std::array<std::pair<uint64_t, uint64_t>, kAhead> ahead;
    uint64_t queued = 0, done = 0;
    // Inlined: a call a record made the rebuild a tenth slower.
    auto add = [&](uint64_t key, uint64_t pos) __attribute__((always_inline)) {
      const uint64_t hash = Hash(key);
      __builtin_prefetch(&index[Home(hash)], 1);
      if (queued - done == kAhead) {
        const auto& [h, q] = ahead[done++ % kAhead];
        Place(h, q);
      }
      ahead[queued++ % kAhead] = {hash, pos};
    };
    const uint64_t n = log.size();
    for (uint64_t u = pending; u-- > 0;) add(uniq[u], n + u);
    for (uint64_t p = n; p-- > 0;) {
      if (log[p].holders != 0) add(log[p].key, p);
    }
    for (; done < queued; ++done) Place(ahead[done % kAhead].first, ahead[done % kAhead].second);
    used = queued;
    return table;
  }

  // Slots for `entries` keys below kMaxLoad with room for `tombstones` more:
  // the erases since the last rebuild, as many as are likely before the next.
  // The same size where both fit, else grown to kGrownLoad of the entries, or
  // past it to fit the tombstones as well. (Sized for the entries alone, an
  // index rebuilt for room that the erases had filled was refilled in place,
  // full again a batch or two later: a full rebuild every other batch.)
  uint64_t SlotsFor(uint64_t entries, uint64_t tombstones) const {
    const auto room = static_cast<double>(entries + tombstones);
    if (room <= kMaxLoad * static_cast<double>(index.size())) return index.size();
    return std::max({kMinSlots, static_cast<uint64_t>(static_cast<double>(entries) / kGrownLoad),
                     static_cast<uint64_t>(room / kMaxLoad) + 1});
  }

  // The slot holding the record at `pos` (key hashing to `hash`).
  uint64_t SlotOf(uint64_t hash, uint64_t pos) const {
    const uint32_t v = Print(hash) | static_cast<uint32_t>(pos);
    uint64_t i = Home(hash);
    while (index[i] != v) i = Next(i);
    return i;
  }

  // Erases the slot of the record at `pos` (key hashing to `hash`): a tombstone.
  void Erase(uint64_t hash, uint64_t pos) {
    index[SlotOf(hash, pos)] = kTomb;
    --used;
    ++tombs;
  }

  // ---- the log ----
  // What a compaction allocates (PrepareCompact), before it changes anything.
  struct CompactSpace {
    std::vector<RankBlock> blocks;  // (log.size() / 64 + 1,)
    Log records;                    // room for the new log; none where the log keeps its own
    std::vector<uint64_t> runs;     // room for the runs kept and extra_runs more
    Index table;                    // TableFor(slots)
    uint64_t slots = 0, limit = 0, pending = 0;
  };

  // A compaction's buffers: a log with room for `more` records beyond the
  // live ones (kLogRoom x) where that room differs, and an index for them
  // and the `pending` keys of the batch; runs with room for `extra_runs`
  // more after it.
  CompactSpace PrepareCompact(uint64_t more, uint64_t pending, uint64_t extra_runs) const {
    const uint64_t live = log.size() - dead;
    CompactSpace space;
    space.blocks.resize(log.size() / 64 + 1);
    // Room for kLogRoom x (live + more), give or take kRoomBand: a log within
    // the band keeps its pages (new ones would cost a page fault each, most
    // of a compaction's time).
    const uint64_t want = static_cast<uint64_t>(kLogRoom * static_cast<double>(live + more)) + 64;
    const uint64_t cap = log.capacity();
    const bool keep = cap >= want && static_cast<double>(cap) <= (1 + kRoomBand) * static_cast<double>(want);
    const uint64_t room =
        std::min(kMaxRecords, keep ? cap : static_cast<uint64_t>((1 + kRoomBand / 2) * static_cast<double>(want)));
    if (cap != room) space.records.reserve(room);
    space.runs.reserve(runs.size() + extra_runs);
    space.slots = SlotsFor(live + pending + largest, tombs);
    space.limit = room + largest;
    space.pending = pending;
    space.table = TableFor(space.slots);
    return space;
  }

  // Drops the dead records in place, then moves the live ones to the new
  // log (space.records) if there is one, rewriting the positions runs and
  // cursors hold (a record's new position is the number of live ones before
  // it: a bit a record and a count a block of 64), and rebuilds the index
  // with the pending keys of the batch after the live records. Allocates
  // nothing (PrepareCompact did).
  void Compact(CompactSpace& space) {
    const uint64_t n = log.size();
    const uint64_t live = n - dead;
    std::vector<RankBlock>& blocks = space.blocks;
    uint64_t at = 0;
    for (uint64_t b = 0; b < blocks.size(); ++b) {
      blocks[b].base = at;
      uint64_t bits = 0;
      for (uint64_t p = 64 * b, end = std::min(n, p + 64); p < end; ++p) {
        const bool has_holders = log[p].holders != 0;
        log[at] = log[p];  // at <= p: in place
        bits |= uint64_t{has_holders} << (p % 64);
        at += has_holders;
      }
      blocks[b].bits = bits;
    }
    auto moved = [&](uint64_t p) {
      const RankBlock& b = blocks[p / 64];
      return b.base + Popcount64(b.bits & ((uint64_t{1} << (p % 64)) - 1));
    };
    log.resize(live);
    if (space.records.capacity() != 0) {
      space.records.assign(log.begin(), log.end());  // within its room
      log.swap(space.records);
      Log().swap(space.records);  // the old log goes before the new index is filled
    }
    std::vector<uint64_t>& kept = space.runs;
    for (uint64_t r = 0; r < runs.size(); ++r) {
      const uint64_t begin = moved(runs[r]);
      if (begin == live) break;  // this run and the later ones are empty
      if (!kept.empty() && kept.back() == begin) kept.pop_back();  // the run before was empty
      kept.push_back(begin);
    }
    runs.swap(kept);
    for (uint64_t& c : cursor) c = moved(c);
    dead = 0;
    Rebuild(std::move(space.table), space.slots, space.limit, space.pending);
  }

  // Worker w drops its `drop` least recently used keys: its records from its
  // cursor on, a run at a time; the run the count ends in gives its lowest keys.
  // A record it empties goes to plan.lost_keys (from w) and to emptied, with
  // its key's hash (the index erases it after every worker has evicted).
  void Evict(int32_t w, uint64_t drop, HeraldPlan& plan) {
    const auto bit = static_cast<Mask>(uint64_t{1} << w);
    held[w] -= drop;
    uint64_t p = cursor[w];
    uint64_t r = static_cast<uint64_t>(std::upper_bound(runs.begin(), runs.end(), p) - runs.begin()) - 1;
    auto lose = [&](uint64_t q) {
      const uint64_t key = log[q].key;
      if constexpr (kMaskInRecord) {
        log[q].holders = static_cast<uint8_t>(log[q].holders & ~bit);
      } else {
        const Mask was = HoldersOf(log[q]);
        log[q] = Encode(key, static_cast<Mask>(was & ~bit), was);
      }
      plan.evicted.push_back(key);
      if (log[q].holders == 0) {
        plan.lost_keys.push_back(key);
        plan.lost_from.push_back(w);
        emptied.push_back(q);
        emptied_hash.push_back(Hash(key));
      }
    };
    while (drop > 0) {  // held counts live records: the log cannot run dry first
      const uint64_t end = r + 1 < runs.size() ? runs[r + 1] : log.size();
      // Branch-free: whether a record is w's is a coin flip the predictor loses.
      mine.resize(end - p);
      uint64_t count = 0;
      for (uint64_t q = p; q < end; ++q) {
        mine[count] = q;
        count += HeldBy(log[q], w, bit) ? 1 : 0;
      }
      mine.resize(count);
      if (mine.size() <= drop) {
        for (uint64_t q : mine) lose(q);
        drop -= mine.size();
        p = end;
        ++r;
        continue;
      }
      const auto cut = mine.begin() + static_cast<int64_t>(drop);
      std::nth_element(mine.begin(), cut, mine.end(), [&](uint64_t a, uint64_t b) { return log[a].key < log[b].key; });
      for (auto it = mine.begin(); it != cut; ++it) lose(*it);
      p = *std::min_element(cut, mine.end());
      drop = 0;
    }
    cursor[w] = p;
  }

  // score[w] = the batch keys j in [begin, end) whose masks[inverse[j]] has bit w.
  void Tally(uint64_t begin, uint64_t end, const Mask* masks) {
    std::fill(score.begin(), score.end(), 0);
    AddBits(end - begin, [&](uint64_t j) { return masks[inverse[begin + j]]; }, score);
  }

  // out[w] += the j in [0, n) whose mask_of(j) has bit w. Each byte of a mask
  // adds kSpread[byte] to its accumulator, a byte a worker (no branch on how
  // many bits are set), and the bytes are spilled before they can overflow.
  template <class MaskOf>
  static void AddBits(uint64_t n, MaskOf mask_of, std::vector<uint32_t>& out) {
    constexpr int kBytes = sizeof(Mask);
    const auto W = static_cast<int32_t>(out.size());
    for (uint64_t j = 0; j < n;) {
      std::array<uint64_t, kBytes> acc{};
      for (const uint64_t stop = std::min(n, j + 255); j < stop; ++j) {
        const Mask m = mask_of(j);
        for (int b = 0; b < kBytes; ++b) acc[b] += kSpread[static_cast<uint8_t>(m >> (8 * b))];
      }
      for (int32_t w = 0; w < W; ++w) out[w] += static_cast<uint32_t>((acc[w / 8] >> (8 * (w % 8))) & 0xff);
    }
  }

  // For byte masks, Partition's counts without a branch a key (which workers
  // lack a key, and whether a peer holds it, are coin flips the predictor
  // loses): fetch_offsets[w + 1] and comm_offsets[w + 1] += each worker's
  // fetches and the fetches it serves, and the plan's pulls, peer_pulls,
  // pushes and shared, as the loop for wider masks counts them. Four masks a
  // key add their kSpread bytes to four accumulators (AddBits' scheme).
  void CountFetches(HeraldPlan& plan, uint64_t U) const {
    static_assert(sizeof(Mask) == 1);
    const int32_t W = opt.workers;
    // On demand a held key's source is its lowest holder; write-through the PS.
    const Mask sources = opt.on_demand ? static_cast<Mask>(~Mask{0}) : Mask{0};
    uint64_t fetched = 0, needed = 0, served = 0, from_peers = 0;
    for (uint64_t u = 0; u < U;) {
      uint64_t lacking_acc = 0, need_acc = 0, served_acc = 0, peer_acc = 0;
      for (const uint64_t stop = std::min(U, u + 255); u < stop; ++u) {
        const Mask lacking = static_cast<Mask>(need[u] & ~latest[u]);
        const auto source = static_cast<Mask>(latest[u] & sources);
        const auto lowest = static_cast<Mask>(source & (0u - source));
        lacking_acc += kSpread[lacking];
        need_acc += kSpread[need[u]];
        served_acc += kSpread[lacking != 0 ? lowest : 0];
        peer_acc += kSpread[source != 0 ? lacking : 0];
      }
      for (int32_t w = 0; w < W; ++w) {
        const int shift = 8 * w;
        plan.fetch_offsets[w + 1] += (lacking_acc >> shift) & 0xff;
        plan.comm_offsets[w + 1] += (served_acc >> shift) & 0xff;
        fetched += (lacking_acc >> shift) & 0xff;
        needed += (need_acc >> shift) & 0xff;
        served += (served_acc >> shift) & 0xff;
        from_peers += (peer_acc >> shift) & 0xff;
      }
    }
    plan.pulls += fetched;
    plan.peer_pulls += from_peers;
    plan.pushes += opt.on_demand ? served : U;  // on demand: a row a fetch from a peer needs, once
    plan.shared += needed - U;                  // every batch key is needed by someone
  }

  // ---- the batch's keys, found in the index ----
  // uniq (distinct keys in order of first appearance), inverse (each key's
  // index among them), latest (the snapshot's holders of uniq[u]) and old (its
  // record, or kNoRecord), with each key's slot pointed at its pending record
  // (the class comment). Returns the distinct count.
  // REQUIRES: the keys were checked (CheckKeys), the index has room for n
  // more slots below kMaxLoad, and log.size() + n - 1 <= MaxPos().
  uint64_t Find(const uint64_t* keys, uint64_t n) {
    const uint64_t end = log.size();
    uint64_t count = 0;
    // The index is far larger than L2: each key's home slot is fetched kAhead
    // keys ahead of its probe, and kPeek keys ahead the record that slot names
    // where its fingerprint matches (ahead[] keeps their hashes).
    constexpr uint64_t kAhead = 32, kPeek = 16;
    std::array<uint64_t, kAhead> ahead;
    for (uint64_t k = 0; k < std::min(n, kAhead); ++k) {
      ahead[k] = Hash(keys[k]);
      __builtin_prefetch(&index[Home(ahead[k])]);
    }
    for (uint64_t k = 0; k < n; ++k) {
      const uint64_t key = keys[k];
      const uint64_t hash = ahead[k % kAhead];
      if (k + kAhead < n) __builtin_prefetch(&index[Home(ahead[k % kAhead] = Hash(keys[k + kAhead]))]);
      if (k + kPeek < n) {  // the first slot from home with the fingerprint, within a few
        const uint64_t h = ahead[(k + kPeek) % kAhead];
        const uint32_t print = Print(h);
        uint64_t i = Home(h);
        for (int s = 0; s < 4; ++s, i = Next(i)) {
          const uint32_t v = index[i];
          if (v == kFree) break;
          if (v != kTomb && PrintOf(v) == print) {
            if (PosOf(v) < end) {
              Touch(PosOf(v));
            }
            break;
          }
        }
      }
      const uint32_t print = Print(hash);
      uint64_t i = Home(hash), hole = kNone;
      for (;; i = Next(i)) {
        const uint32_t v = index[i];
        if (v == kFree) break;
        if (v == kTomb) {
          if (hole == kNone) hole = i;
          continue;
        }
        if (PrintOf(v) != print) continue;
        const uint64_t pos = PosOf(v);
        if (pos >= end) {  // pending: a key seen before in this batch
          if (uniq[pos - end] == key) break;
        } else if (log[pos].key == key) {  // the snapshot's record: the key's first appearance
          break;
        }
      }
      const uint32_t v = index[i];
      if (v != kFree && PosOf(v) >= end) {
        inverse[k] = static_cast<uint32_t>(PosOf(v) - end);
        continue;
      }
      const uint64_t u = count++;
      uniq[u] = key;
      inverse[k] = static_cast<uint32_t>(u);
      if (v == kFree) {  // new to the snapshot: a slot, the first tombstone passed if any
        old[u] = kNoRecord;
        latest[u] = 0;
        if (hole != kNone) {
          i = hole;
          --tombs;
          old[u] = kNoRecordInTomb;
        }
        ++used;
      } else {  // the old record dies here, while it is in cache (Rollback revives it)
        old[u] = PosOf(v);
        latest[u] = HoldersOf(log[PosOf(v)]);
        log[PosOf(v)].holders = 0;  // a shared key keeps its mask in the table until Commit
        ++dead;
      }
      index[i] = print | static_cast<uint32_t>(end + u);
    }
    return count;
  }

  // Undoes Find's changes (uniq[0 : count) pending): revives the old
  // records and puts back each slot as it was, the last key's first (a slot
  // a later key passed is occupied until that key's is put back). With
  // `index_before` (the index before the batch grew it, and its position
  // bits and counts) that index comes back instead, the batch's slots with it.
  void Undo(uint64_t count, Index& index_before, int pos_bits_before, uint64_t used_before, uint64_t tombs_before) {
    const uint64_t end = log.size();
    const bool grown = index_before.capacity() != 0;
    for (uint64_t u = count; u-- > 0;) {
      if (old[u] < kNoRecordInTomb) {
        log[old[u]].holders = HoldersByte(latest[u]);
        --dead;
      }
      if (grown) continue;
      const uint64_t hash = Hash(uniq[u]);
      const uint64_t s = SlotOf(hash, end + u);
      if (old[u] == kNoRecord) {
        index[s] = kFree;
        --used;
      } else if (old[u] == kNoRecordInTomb) {
        index[s] = kTomb;
        --used;
        ++tombs;
      } else {
        index[s] = Print(hash) | old[u];
      }
    }
    if (grown) {
      index.swap(index_before);
      SetPosBits(pos_bits_before);
      used = used_before;
      tombs = tombs_before;
    }
  }

  HeraldPlan Plan(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys, const uint64_t* upcoming,
                  uint64_t n_upcoming, const int32_t* origin) override {
    const uint64_t total = offsets[n_examples];
    CheckKeys(keys, total);
    // Indices are uint32 with UINT32_MAX kept free, as in UniqueKeys.
    if (total >= UINT32_MAX) throw std::invalid_argument("Herald::Schedule: more than 2^32 - 2 keys");
    // Every key of the batch may be new: the pending positions log.size()
    // + u must fit the slots, and the live records with them kMaxRecords
    // (compacted first if that is what it takes; compaction changes no plan).
    // Where the live records and the batch's keys (not its distinct keys, not
    // known yet) pass 2^32 - 2, the batch is refused. A batch that fails
    // leaves `largest` (which sizes the index and the log) as it was; that
    // compaction, the only change it keeps, changes no plan and no cache.
    const uint64_t largest_before = largest;
    largest = std::max(largest, total);
    // The index before the batch grew it (with its position bits and
    // counts): kept until the batch is committed, so that a failure puts it
    // back (a rebuild in place keeps its size: nothing to put back).
    Index index_before;
    int pos_bits_before = 0;
    uint64_t used_before = 0, tombs_before = 0;
    try {
      if (log.size() + total > kMaxRecords) {
        CompactSpace space = PrepareCompact(total, 0, 0);
        Compact(space);
      }
      if (log.size() + total > kMaxRecords) {
        throw std::length_error("Herald::Schedule: the snapshot would pass 2^32 - 2 keys");
      }
      inverse.resize(total);
      uniq.resize(total);
      old.resize(total);
      latest.resize(total);
      // The inserts must find room (tombstones count against the load) and
      // positions up to log.size() + total - 1.
      if (total > 0 && (static_cast<double>(used + tombs + total) > kMaxLoad * static_cast<double>(index.size()) ||
                        log.size() + total - 1 > MaxPos())) {
        const uint64_t slots = SlotsFor(used + total, tombs);
        pos_bits_before = pos_bits;
        used_before = used;
        tombs_before = tombs;
        index_before = Rebuild(TableFor(slots), slots, std::max<uint64_t>(log.capacity(), log.size() + total) + largest);
      }
    } catch (...) {
      largest = largest_before;
      throw;
    }
    const uint64_t U = Find(keys, total);
    HeraldPlan plan;
    uint64_t m = 0;
    CommitSpace space;
    try {
      Partition(plan, offsets, n_examples, U, origin);
      // The window matters only where caches evict.
      if (opt.capacity > 0 && n_upcoming > 0) m = Window(upcoming, n_upcoming);
      space = PrepareCommit(plan, U, m);
    } catch (...) {  // out of memory: the snapshot is left as it was
      Undo(U, index_before, pos_bits_before, used_before, tombs_before);
      largest = largest_before;
      throw;
    }
    Index().swap(index_before);  // before the commit's allocations are filled
    Commit(plan, U, space);
    return plan;
  }

  // The partition, fetches, comm plans and counts of a batch whose keys Find
  // found (U distinct); changes nothing in the snapshot. origin: null or each
  // example's worker (-1: none).
  void Partition(HeraldPlan& plan, const uint64_t* offsets, uint64_t n_examples, uint64_t U, const int32_t* origin) {
    const int32_t W = opt.workers;
    plan.distinct = U;
    need.assign(U, 0);

    // ---- partition: shares of n / W, the first n % W workers one more ----
    share.resize(W);
    for (int32_t w = 0; w < W; ++w) share[w] = n_examples / W + (static_cast<uint64_t>(w) < n_examples % W ? 1 : 0);
    plan.assignment.resize(n_examples);
    if (opt.location_aware) {
      placed.assign(latest.begin(), latest.begin() + static_cast<int64_t>(U));  // the snapshot, plus the keys of examples placed so far
      // Examples with the most to lose to a full worker choose first: the widest
      // gap between their best and second-best scores on the snapshot (regret),
      // then the highest best score, then batch order. Keys every worker holds
      // (hot keys) raise every worker's score alike: ordered by the best score
      // alone, examples rich in them chose first, filling the workers that the
      // examples after them needed (regret order: W7's Criteo sample pulled
      // 1.4% less and pushed 6% less). Both scores are at most the example's
      // key count, so two stable counting sorts (best, then regret) order them
      // where the scores span no more than about the batch; else a sort of
      // (-regret, -best, i).
      best_of.resize(n_examples);
      regret_of.resize(n_examples);
      uint32_t top = 0;
      for (uint64_t i = 0; i < n_examples; ++i) {
        Tally(offsets[i], offsets[i + 1], latest.data());
        uint32_t first = 0, second = 0;
        for (const uint32_t s : score) {  // branch-free: which score leads is unpredictable
          second = std::max(second, std::min(first, s));
          first = std::max(first, s);
        }
        best_of[i] = first;
        regret_of[i] = first - second;
        top = std::max(top, first);
      }
      order.resize(n_examples);
      if (top <= n_examples + 64) {
        by_best.resize(n_examples);
        // Stable, highest first: from `from` (examples) into `to` by key[].
        auto counting_sort = [&](const auto& from, auto& to, const std::vector<uint32_t>& key) {
          by_score.assign(top + 2, 0);
          for (uint64_t k = 0; k < n_examples; ++k) ++by_score[top - key[from(k)] + 1];
          for (uint32_t b = 0; b <= top; ++b) by_score[b + 1] += by_score[b];
          for (uint64_t k = 0; k < n_examples; ++k) to[by_score[top - key[from(k)]]++] = from(k);
        };
        counting_sort([](uint64_t k) { return k; }, by_best, best_of);
        counting_sort([&](uint64_t k) { return by_best[k]; }, order, regret_of);
      } else {
        std::vector<std::tuple<uint32_t, uint32_t, uint64_t>> keyed(n_examples);  // (-regret, -best, i) as kMax - x
        for (uint64_t i = 0; i < n_examples; ++i) keyed[i] = {UINT32_MAX - regret_of[i], UINT32_MAX - best_of[i], i};
        std::sort(keyed.begin(), keyed.end());
        for (uint64_t i = 0; i < n_examples; ++i) order[i] = std::get<2>(keyed[i]);
      }
      // A worker's value: its score less the load term (kLoadDen above), in
      // integers, times kLoadDen x n x 2^16: score x kLoadDen x n x 2^16 -
      // lambda x keys x filled_w, where filled_w = floor(taken_w x 2^16 /
      // share_w) (128 bits: no product wraps). Without the term a cold batch
      // (no example's keys in any cache) fills worker 0 first, in batch
      // order: the examples it took hold most of the batch's keys, so each
      // example after them scores highest there, and the batch went as the
      // sequential partition does (W7's Criteo sample: its first batch pulled
      // 11,459 rows both ways; 9,571 with the term).
      __extension__ typedef __int128 Wide;
      constexpr int kFillBits = 16;
      const Wide scale = static_cast<Wide>(kLoadDen) * static_cast<Wide>(n_examples) << kFillBits;
      // An example's origin worker earns example_cost keys of score (kCostBits: its fixed point).
      const Wide stay = origin == nullptr ? 0 : (static_cast<Wide>(cost) * scale) >> kCostBits;
      const auto keys_in_batch = static_cast<Wide>(offsets[n_examples]);
      full.assign(share.begin(), share.end());
      // (W,) keys x filled_w, kept as workers fill (a division a placement, not a worker).
      std::vector<Wide> load(W, 0);
      for (const uint64_t i : order) {
        Tally(offsets[i], offsets[i + 1], placed.data());
        const Wide lambda = best_of[i] == 0 ? kLoadCold : kLoadWarm;
        // A cold example's origin is spared the load term, which is there to
        // spread a cold batch's examples, as their origins already do: it stays
        // where it was read while there is room. (Sparing a warm one's too
        // kept examples home that up to the term's weight more keys wanted
        // elsewhere: SyntheticCriteo on 4 workers pulled 17% more at a cost of 1.)
        const int32_t home = stay == 0 ? -1 : origin[i];
        const bool spared = best_of[i] == 0;
        int32_t best = -1;
        Wide best_value = 0;
        for (int32_t w = 0; w < W; ++w) {
          if (share[w] == 0) continue;
          const Wide value =
              static_cast<Wide>(score[w]) * scale + (w == home ? stay - (spared ? 0 : lambda * load[w]) : -lambda * load[w]);
          if (best < 0 || value > best_value) {
            best = w;
            best_value = value;
          }
        }
        plan.assignment[i] = best;
        --share[best];
        load[best] = keys_in_batch * static_cast<Wide>(((full[best] - share[best]) << kFillBits) / full[best]);
        const auto bit = static_cast<Mask>(uint64_t{1} << best);
        for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) {
          const auto u = inverse[j];
          placed[u] |= bit;
          need[u] |= bit;
        }
      }
    } else {
      int32_t w = 0;
      for (uint64_t i = 0; i < n_examples; ++i) {
        while (share[w] == 0) ++w;
        plan.assignment[i] = w;
        --share[w];
        const auto bit = static_cast<Mask>(uint64_t{1} << w);
        for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) need[inverse[j]] |= bit;
      }
    }

    if (origin != nullptr) {
      for (uint64_t i = 0; i < n_examples; ++i) plan.examples_moved += origin[i] >= 0 && origin[i] != plan.assignment[i];
    }

    // ---- fetches, comm plans and counts ----
    // The source of a fetch: on demand every held row is dirty (a worker
    // trained it), so its lowest holder; write-through the PS holds them all.
    auto source_of = [&](uint64_t u) -> int32_t {
      return latest[u] != 0 && opt.on_demand ? std::countr_zero(latest[u]) : -1;
    };
    plan.fetch_offsets.assign(W + 1, 0);
    plan.comm_offsets.assign(W + 1, 0);
    if constexpr (sizeof(Mask) == 1) {
      CountFetches(plan, U);
    } else {
      for (uint64_t u = 0; u < U; ++u) {
        const auto lacking = static_cast<Mask>(need[u] & ~latest[u]);
        uint32_t pulls = 0;
        for (Mask m = lacking; m != 0; m &= static_cast<Mask>(m - 1)) {
          ++plan.fetch_offsets[std::countr_zero(m) + 1];
          ++pulls;
        }
        const int32_t from = source_of(u);
        if (lacking != 0 && from >= 0) ++plan.comm_offsets[from + 1];
        plan.pulls += pulls;
        if (from >= 0) plan.peer_pulls += pulls;
        if (opt.on_demand ? (lacking != 0 && from >= 0) : true) ++plan.pushes;
        plan.shared += Holders(need[u]) - 1;  // every batch key is needed by someone
      }
    }
    for (int32_t w = 0; w < W; ++w) {
      plan.fetch_offsets[w + 1] += plan.fetch_offsets[w];
      plan.comm_offsets[w + 1] += plan.comm_offsets[w];
    }
    plan.fetch_keys.resize(plan.fetch_offsets[W]);
    plan.fetch_from.resize(plan.fetch_offsets[W]);
    plan.comm_keys.resize(plan.comm_offsets[W]);
    fetch_at.assign(plan.fetch_offsets.begin(), plan.fetch_offsets.end() - 1);
    comm_at.assign(plan.comm_offsets.begin(), plan.comm_offsets.end() - 1);
    for (uint64_t u = 0; u < U; ++u) {
      const auto lacking = static_cast<Mask>(need[u] & ~latest[u]);
      if (lacking == 0) continue;
      const int32_t from = source_of(u);
      for (Mask m = lacking; m != 0; m &= static_cast<Mask>(m - 1)) {
        const uint64_t at = fetch_at[std::countr_zero(m)]++;
        plan.fetch_keys[at] = uniq[u];
        plan.fetch_from[at] = from;
      }
      if (from >= 0) plan.comm_keys[comm_at[from]++] = uniq[u];
    }
  }

  // ---- the lookahead window ----
  // The slot of `key` (hashing to `hash`), or kNone: a live record, or
  // (before the batch is appended) a pending one at log.size() + u.
  uint64_t Lookup(uint64_t key, uint64_t hash) const {
    const uint32_t print = Print(hash);
    const uint64_t end = log.size();
    for (uint64_t i = Home(hash);; i = Next(i)) {
      const uint32_t v = index[i];
      if (v == kFree) return kNone;
      if (v == kTomb || PrintOf(v) != print) continue;
      const uint64_t pos = PosOf(v);
      if ((pos < end ? log[pos].key : uniq[pos - end]) == key) return i;
    }
  }

  // win = the distinct window keys some cache holds after the batch (its
  // trainers included), ascending, and win_slot their slots; the index must
  // hold the batch's keys as pending records (Find), and changes nothing in
  // the snapshot. Returns how many.
  uint64_t Window(const uint64_t* upcoming, uint64_t n) {
    win.assign(upcoming, upcoming + n);
    SortUnique(win, sort_tmp, sort_count);
    win_slot.resize(win.size());
    uint64_t m = 0;
    for (uint64_t j = 0; j < win.size(); ++j) {
      const uint64_t s = Lookup(win[j], Hash(win[j]));
      if (s == kNone) continue;
      win[m] = win[j];
      win_slot[m++] = s;
    }
    win.resize(m);
    return m;
  }

  // Moves the records of win[0 : m) to a run of their own at the log's end,
  // masks unchanged (used after the batch's own keys: evicted last). The log
  // has room. rebuilt: the index was rebuilt since Window found the slots.
  void Refresh(uint64_t m, bool rebuilt) {
    runs.push_back(log.size());
    for (uint64_t j = 0; j < m; ++j) {
      const uint64_t key = win[j], hash = Hash(key);
      const uint64_t s = rebuilt ? Lookup(key, hash) : win_slot[j];
      const uint64_t p = PosOf(index[s]);
      const Record moved = log[p];  // the same key: a shared one's mask stays in the table
      index[s] = Print(hash) | static_cast<uint32_t>(log.size());
      log.push_back(moved);
      log[p].holders = 0;
      ++dead;
    }
  }

  // ---- the snapshot: the trainers hold the latest version, other copies go ----
  // What a commit allocates, and what it was worked out from.
  struct CommitSpace {
    bool compact = false;
    CompactSpace compaction;                        // where compact
    typename SharedMasks<Mask>::Table shared_table;  // W > 8: the side table's new size, if it changes
    uint64_t held_window = 0;                       // the window keys it refreshes
  };

  // The commit's allocations (it makes none itself, so it cannot fail
  // halfway): a compaction's buffers where the log is out of room, room for
  // the runs, the side table's room, and eviction's lists and scratch. Sets
  // gains and losses (W,): the batch keys each cache trains, and those it
  // held before. held_window: the held window keys Window found. Changes
  // nothing in the snapshot.
  CommitSpace PrepareCommit(HeraldPlan& plan, uint64_t U, uint64_t held_window) {
    const int32_t W = opt.workers;
    // The trainers hold the batch's keys now, and the other holders (the old
    // records died in Find) do not: a cache gains the batch keys it trains
    // and loses those it held. A byte mask's bits are counted branch-free
    // (AddBits); a wider one's, a few of many, one by one, with the most
    // keys the side table holds while the batch's records are appended.
    CommitSpace space;
    std::fill(gains.begin(), gains.end(), 0);
    std::fill(losses.begin(), losses.end(), 0);
    if constexpr (sizeof(Mask) == 1) {
      AddBits(U, [&](uint64_t u) { return need[u]; }, gains);
      AddBits(U, [&](uint64_t u) { return latest[u]; }, losses);
    } else {
      uint64_t shared_keys = shared.count(), most_shared = shared_keys;
      for (uint64_t u = 0; u < U; ++u) {
        const Mask was = latest[u], now = need[u];
        for (Mask m = static_cast<Mask>(now & ~was); m != 0; m &= static_cast<Mask>(m - 1)) ++gains[std::countr_zero(m)];
        for (Mask m = static_cast<Mask>(was & ~now); m != 0; m &= static_cast<Mask>(m - 1)) ++losses[std::countr_zero(m)];
        // Encode puts a key shared now and erases one shared only before.
        shared_keys = shared_keys + ((now & (now - 1)) != 0) - ((was & (was - 1)) != 0);
        most_shared = std::max(most_shared, shared_keys);
      }
      space.shared_table = shared.Sized(most_shared);
    }
    space.compact = log.size() + U + held_window > std::min<uint64_t>(log.capacity(), kMaxRecords);
    const uint64_t new_runs = (opt.capacity > 0 && U > 0 ? 1 : 0) + (held_window > 0 ? 1 : 0);
    if (space.compact) space.compaction = PrepareCompact(U + held_window, U, new_runs);
    // Past 2^32 - 2 records the window's highest keys are not refreshed.
    const uint64_t records = space.compact ? log.size() - dead : log.size();
    space.held_window = std::min(held_window, kMaxRecords - std::min(kMaxRecords, records + U));
    if (opt.capacity > 0) {
      // Eviction drops, from each cache above capacity, its keys past it
      // (a key once for each), and gives at most as many to lost_keys.
      uint64_t drops = 0;
      for (int32_t w = 0; w < W; ++w) {
        const uint64_t after = held[w] + gains[w] - losses[w];
        drops += after > opt.capacity ? after - opt.capacity : 0;
      }
      plan.evicted.reserve(drops);
      plan.lost_keys.reserve(drops);
      plan.lost_from.reserve(drops);
      emptied.reserve(drops);
      emptied_hash.reserve(drops);
      ReserveSortUnique(drops, sort_tmp, sort_count);
      // Evict reads a run at a time into mine: no run is longer than the one
      // a commit appended (this one's are the batch's U records and the
      // window's; a compaction only shortens runs), and mine never gives
      // back its room.
      mine.reserve(std::max(U, space.held_window));
      // Last, as it changes the snapshot's memory: nothing after it fails.
      if (!space.compact && runs.capacity() < runs.size() + new_runs) {
        runs.reserve(std::max(2 * runs.capacity(), runs.size() + new_runs));
      }
    }
    return space;
  }

  // Each batch key gets a new record at the log's end, a run for the batch
  // (its slot already points there); its old record (if any) dies. Then the
  // held keys of the window move to a run after it, before eviction. Every
  // buffer it fills has its room (PrepareCommit's space): it allocates
  // nothing and cannot fail.
  void Commit(HeraldPlan& plan, uint64_t U, CommitSpace& space) {
    const int32_t W = opt.workers;
    constexpr uint64_t kAhead = 16;
    for (int32_t w = 0; w < W; ++w) held[w] = held[w] + gains[w] - losses[w];
    if (space.compact) Compact(space.compaction);
    if constexpr (!kMaskInRecord) {
      if (space.shared_table.capacity() != 0) shared.Adopt(std::move(space.shared_table));
    }
    if (opt.capacity > 0 && U > 0) runs.push_back(log.size());
    for (uint64_t u = 0; u < U; ++u) log.push_back(Encode(uniq[u], need[u], latest[u]));
    if (space.held_window > 0) Refresh(space.held_window, space.compact);

    // ---- eviction: a cache above capacity drops its least recently used keys ----
    if (opt.capacity > 0) {
      emptied.clear();
      emptied_hash.clear();
      for (int32_t w = 0; w < W; ++w) {
        if (held[w] > opt.capacity) Evict(w, held[w] - opt.capacity, plan);
      }
      // The last holder dropped these: on demand, a dirty row goes to the PS.
      // Their hashes were taken while Evict read the records (no second read).
      const uint64_t lost = emptied.size();
      if (opt.on_demand) {
        plan.pushes += lost;
        plan.evict_pushes += lost;
      }
      for (uint64_t e = 0; e < lost; ++e) {
        if (e + kAhead < lost) __builtin_prefetch(&index[Home(emptied_hash[e + kAhead])], 1);
        Erase(emptied_hash[e], emptied[e]);
      }
      dead += lost;
      SortUnique(plan.evicted, sort_tmp, sort_count);
    }
  }

  std::vector<uint64_t> Cached(int32_t worker) const override {
    const auto bit = static_cast<Mask>(uint64_t{1} << worker);
    std::vector<uint64_t> out;
    for (uint64_t p = 0; p < log.size(); ++p) {
      if (HeldBy(log[p], worker, bit)) out.push_back(log[p].key);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // held[w] sizes each worker's part; a part that does not come out at its
  // size would mean the counts and the log disagree (checked: cheap).
  std::vector<uint64_t> CachedByWorker(std::vector<uint64_t>& offsets) const override {
    const int32_t W = opt.workers;
    offsets.assign(W + 1, 0);
    for (int32_t w = 0; w < W; ++w) offsets[w + 1] = offsets[w] + held[w];
    std::vector<uint64_t> out(offsets[W]);
    std::vector<uint64_t> at(offsets.begin(), offsets.end() - 1);
    for (uint64_t p = 0; p < log.size(); ++p) {
      if (log[p].holders == 0) continue;
      for (Mask m = HoldersOf(log[p]); m != 0; m &= static_cast<Mask>(m - 1)) {
        const int w = std::countr_zero(m);
        if (at[w] == offsets[w + 1]) {
          throw std::logic_error("Herald::CachedByWorker: the log holds more keys than the counts");
        }
        out[at[w]++] = log[p].key;
      }
    }
    for (int32_t w = 0; w < W; ++w) {
      if (at[w] != offsets[w + 1]) {
        throw std::logic_error("Herald::CachedByWorker: the log holds fewer keys than the counts");
      }
    }
    return out;
  }

  uint64_t Held(int32_t worker) const override { return held[worker]; }

  uint64_t MemoryBytes() const override {
    return index.capacity() * sizeof(uint32_t) + log.capacity() * sizeof(Record) + runs.capacity() * sizeof(uint64_t) +
           (kMaskInRecord ? 0 : shared.MemoryBytes());
  }

  void Clear() override {
    // The fresh start's tables first: a Clear that runs out of memory leaves
    // the caches as they were.
    Index table;
    table.reserve(kMinSlots);
    SharedMasks<Mask> no_shared;
    // Swapped out, not assigned {} (which keeps a vector's capacity): a fresh
    // start holds no memory of the caches before it.
    Log().swap(log);
    std::vector<uint64_t>().swap(runs);
    dead = 0;
    shared = std::move(no_shared);
    Index().swap(index);
    Rebuild(std::move(table), kMinSlots, 0);  // within the table's room: allocates nothing
    std::fill(held.begin(), held.end(), 0);
    std::fill(cursor.begin(), cursor.end(), 0);
  }

  static constexpr uint64_t kNone = ~uint64_t{0};

  HeraldOptions opt;
  int64_t cost;  // example_cost in 1/2^kCostBits of a key
  Index index;
  int pos_bits = 32;                 // the index's position bits (the class comment)
  uint32_t pos_mask = ~uint32_t{0};  // their mask
  uint64_t used = 0;                 // occupied index slots: the live and pending records
  uint64_t tombs = 0;                // erased slots since the last rebuild
  uint64_t largest = 0;              // the most keys a batch had so far
  Log log;
  SharedMasks<Mask> shared;    // W > 8: the masks of the keys two or more workers hold
  uint64_t dead = 0;           // records with no holder
  std::vector<uint64_t> runs;  // with a capacity: where each batch's records begin, oldest first
  std::vector<uint64_t> held;    // (W,) keys each cache holds
  std::vector<uint64_t> cursor;  // (W,) no record before it has the worker's bit
  // Per-batch scratch, kept for the next batch (not in MemoryBytes).
  std::vector<uint32_t> inverse, score, old;  // inverse: a batch has under 2^32 - 1 keys
  std::vector<uint32_t> gains, losses;        // (W,) Commit's: batch keys each cache trains, and held before
  std::vector<uint64_t> uniq, share, full, fetch_at, comm_at, emptied, mine;  // full: the shares before the greedy
  std::vector<uint64_t> emptied_hash;  // Hash of emptied[e]'s key
  std::vector<uint64_t> win, win_slot;  // the window's held keys and their slots (Window)
  std::vector<uint64_t> sort_tmp;     // SortUnique's
  std::vector<uint32_t> sort_count;
  std::vector<Mask> latest, need, placed;
  std::vector<uint32_t> best_of, regret_of;  // each example's best score on the snapshot, and its lead over the second
  std::vector<uint32_t> by_score;            // a count a score (the counting sorts)
  std::vector<uint64_t> by_best, order;      // the examples by best score; in the order they choose
};

Herald::Herald(const HeraldOptions& options) : options_(options) {
  const int32_t W = options.workers;
  if (W < 1 || W > 64) {
    throw std::invalid_argument("Herald: workers = " + std::to_string(W) +
                                " is outside [1, 64] (a key's holders are a 64-bit mask)");
  }
  if (!(options.example_cost >= 0 && options.example_cost <= kMaxExampleCost)) {  // NaN fails too
    throw std::invalid_argument("Herald: example_cost = " + std::to_string(options.example_cost) +
                                " is outside [0, 65536] keys");
  }
  if (W <= 8) {
    impl_ = std::make_unique<Snapshot<uint8_t>>(options);
  } else if (W <= 16) {
    impl_ = std::make_unique<Snapshot<uint16_t>>(options);
  } else if (W <= 32) {
    impl_ = std::make_unique<Snapshot<uint32_t>>(options);
  } else {
    impl_ = std::make_unique<Snapshot<uint64_t>>(options);
  }
}

Herald::~Herald() = default;

HeraldPlan Herald::Schedule(const uint64_t* keys, uint64_t n_examples, int32_t fields, const uint64_t* upcoming,
                            uint64_t n_upcoming, const int32_t* origin) {
  if (fields < 0) throw std::invalid_argument("Herald::Schedule: fields = " + std::to_string(fields) + " is negative");
  std::vector<uint64_t> offsets(n_examples + 1);
  for (uint64_t i = 0; i <= n_examples; ++i) offsets[i] = i * static_cast<uint64_t>(fields);
  return Schedule(offsets.data(), n_examples, keys, upcoming, n_upcoming, origin);
}

HeraldPlan Herald::Schedule(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys,
                            const uint64_t* upcoming, uint64_t n_upcoming, const int32_t* origin) {
  if (offsets[0] != 0) {
    throw std::invalid_argument("Herald::Schedule: offsets[0] = " + std::to_string(offsets[0]) + ", must be 0");
  }
  for (uint64_t i = 0; i < n_examples; ++i) {
    if (offsets[i + 1] < offsets[i]) {
      throw std::invalid_argument("Herald::Schedule: offsets[" + std::to_string(i + 1) + "] = " +
                                  std::to_string(offsets[i + 1]) + " is below offsets[" + std::to_string(i) +
                                  "] = " + std::to_string(offsets[i]));
    }
  }
  if (n_upcoming > 0 && upcoming == nullptr) {
    throw std::invalid_argument("Herald::Schedule: upcoming is null with n_upcoming = " + std::to_string(n_upcoming));
  }
  for (uint64_t i = 0; i < n_upcoming; ++i) {
    if (upcoming[i] == kEmptyKey) {
      throw std::invalid_argument("Herald::Schedule: upcoming[" + std::to_string(i) +
                                  "] is 0xffffffffffffffff (-1 as int64), the reserved empty-slot key");
    }
  }
  for (uint64_t i = 0; origin != nullptr && i < n_examples; ++i) {
    if (origin[i] < -1 || origin[i] >= options_.workers) {
      throw std::invalid_argument("Herald::Schedule: origin[" + std::to_string(i) + "] = " + std::to_string(origin[i]) +
                                  " is outside [-1, " + std::to_string(options_.workers) + ")");
    }
  }
  HeraldPlan plan = impl_->Plan(offsets, n_examples, keys, upcoming, n_upcoming, origin);
  ++batches_;
  return plan;
}

std::vector<uint64_t> Herald::Cached(int32_t worker) const {
  if (worker < 0 || worker >= options_.workers) {
    throw std::out_of_range("Herald::Cached: worker " + std::to_string(worker) + " is outside [0, " +
                            std::to_string(options_.workers) + ")");
  }
  return impl_->Cached(worker);
}

std::vector<uint64_t> Herald::CachedByWorker(std::vector<uint64_t>& offsets) const {
  return impl_->CachedByWorker(offsets);
}

uint64_t Herald::cached(int32_t worker) const {
  if (worker < 0 || worker >= options_.workers) {
    throw std::out_of_range("Herald::cached: worker " + std::to_string(worker) + " is outside [0, " +
                            std::to_string(options_.workers) + ")");
  }
  return impl_->Held(worker);
}

uint64_t Herald::memory_bytes() const { return impl_->MemoryBytes(); }

void Herald::Clear() { impl_->Clear(); }

}  // namespace hps
