// W2 of BENCHMARKS.md: the native hash table against absl::flat_hash_map and
// boost::unordered_flat_map, in the same run and on the same data.
//
// For each row width W (floats) and N distinct random uint64 keys (fixed seed,
// never ~0ull), every implementation is built fresh per repeat and measured on:
//   insert      all N keys with their rows, one bulk call (or --batch calls)
//   find_hit    all N keys in a shuffled order, rows copied to an output buffer
//   find_mix    N keys, half present (shuffled) and half absent; zero rows on miss
//   accumulate  a row of deltas added to every key, in another shuffled order
// find/accumulate run on the table the insert of the same repeat loaded.
//
// Implementations:
//   hps_t1, hps_t2  hps::NewHashTable with threads = 1 and 2; capacity N / 0.8
//   absl, boost     absl::flat_hash_map / boost::unordered_flat_map of
//                   uint64_t -> std::array<float, W>, reserved to the same
//                   capacity up front, driven by the plain single-threaded loop
//                   (try_emplace, find + copy, try_emplace + add). They are not
//                   concurrent containers, so they run on one thread.
//   absl_pf         the absl map driven by the same loop, but calling its own
//                   flat_hash_map::prefetch(key) --peer-prefetch keys ahead
//                   (default 8), so that a bulk call of ours, which prefetches
//                   its slots in batches, meets a batched peer, not only a
//                   key-at-a-time one. Distances 2-32 were swept with --quick
//                   on a busy 2-core VM: 8 to 16 did best, closer together than
//                   that machine's noise; rerun the sweep on a quiet one. boost::unordered_flat_map 1.81 has no
//                   public prefetch nor a documented way to reach the group a
//                   key hashes to (it has no bucket interface), so boost runs
//                   unprefetched only.
// Our table mmaps its memory with MADV_HUGEPAGE; with --peer-hugepages (the
// default) the peers get an allocator that does the same for large blocks, so
// neither side wins on TLB reach alone.
//
// stderr: progress. stdout: one JSON line with every figure (Mops/s: median,
// min, max, runs), ratios hps_t1 / best peer and hps_t2 / hps_t1 per op, and
// the machine and configuration they were measured under.
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/hash/hash.h>
#include <boost/unordered/unordered_flat_map.hpp>
#include <boost/version.hpp>

#include "hps/hash_table.h"

#ifndef HPS_BENCH_CXX_FLAGS
#define HPS_BENCH_CXX_FLAGS "unknown"
#endif

namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------- memory ----

void* MapBytes(size_t bytes, bool huge) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
#else
  (void)huge;
#endif
  return p;
}

// A prefaulted array for the benchmark's own inputs and outputs. Shared by all
// implementations, so its page size favours none of them.
template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t n) : n_(n), bytes_(std::max<size_t>(n, 1) * sizeof(T)) {
    p_ = static_cast<T*>(MapBytes(bytes_, /*huge=*/true));
    std::memset(static_cast<void*>(p_), 0, bytes_);  // fault every page in now, not in a timed op
  }
  ~Buffer() { Release(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      Release();
      std::swap(p_, o.p_);
      std::swap(n_, o.n_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_[i]; }
  const T& operator[](size_t i) const { return p_[i]; }

 private:
  void Release() {
    if (p_) munmap(p_, bytes_);
    p_ = nullptr;
    n_ = bytes_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
  size_t bytes_ = 0;
};

// Set once, before any peer map exists (allocate and deallocate must agree).
bool g_peer_hugepages = true;
constexpr size_t kPeerMapThreshold = size_t{2} << 20;  // blocks from 2 MiB up

// The peers' allocator: operator new (so malloc, as std::allocator) unless
// --peer-hugepages, in which case blocks of >= 2 MiB are anonymous mappings
// advised MADV_HUGEPAGE, exactly as our table's storage is.
template <class T>
struct PeerAllocator {
  using value_type = T;
  PeerAllocator() noexcept = default;
  template <class U>
  PeerAllocator(const PeerAllocator<U>&) noexcept {}  // NOLINT: rebinding is implicit

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (g_peer_hugepages && bytes >= kPeerMapThreshold) return static_cast<T*>(MapBytes(bytes, true));
    if constexpr (alignof(T) > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
      return static_cast<T*>(::operator new(bytes, std::align_val_t{alignof(T)}));
    } else {
      return static_cast<T*>(::operator new(bytes));
    }
  }
  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (g_peer_hugepages && bytes >= kPeerMapThreshold) {
      munmap(p, bytes);
      return;
    }
    if constexpr (alignof(T) > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
      ::operator delete(p, std::align_val_t{alignof(T)});
    } else {
      ::operator delete(p);
    }
  }
};
template <class T, class U>
bool operator==(const PeerAllocator<T>&, const PeerAllocator<U>&) noexcept {
  return true;
}

// --------------------------------------------------------------- machine ----

std::string ReadFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return "";
  return line;
}

// "always [madvise] never" -> "madvise".
std::string Bracketed(const std::string& s) {
  const auto a = s.find('[');
  const auto b = s.find(']');
  if (a == std::string::npos || b == std::string::npos || b < a) return s.empty() ? "unknown" : s;
  return s.substr(a + 1, b - a - 1);
}

// A "Key:   value kB" field of /proc/meminfo or /proc/self/smaps_rollup, in kB.
int64_t ProcFieldKb(const char* path, const char* field) {
  std::ifstream f(path);
  std::string line;
  const size_t len = std::strlen(field);
  while (std::getline(f, line)) {
    if (line.compare(0, len, field) == 0 && line.size() > len && line[len] == ':') {
      return std::strtoll(line.c_str() + len + 1, nullptr, 10);
    }
  }
  return -1;
}

int64_t AnonHugeKb() { return ProcFieldKb("/proc/self/smaps_rollup", "AnonHugePages"); }

// CPU time of the whole machine and of this process, in clock ticks, so that
// the CPUs other work took during a measurement can be told apart from ours.
struct CpuSample {
  uint64_t busy = 0, total = 0, self = 0;
  bool ok = false;
};

CpuSample SampleCpu() {
  CpuSample c;
  std::ifstream st("/proc/stat");
  std::string label;
  uint64_t v[8] = {};  // user nice system idle iowait irq softirq steal (guest is inside user)
  if (!(st >> label) || label != "cpu") return c;
  for (uint64_t& x : v) st >> x;
  for (uint64_t x : v) c.total += x;
  c.busy = c.total - v[3] - v[4];  // steal counts as busy: the hypervisor ran someone else
  std::ifstream me("/proc/self/stat");
  std::string line;
  if (!std::getline(me, line)) return c;
  const auto paren = line.rfind(')');  // comm may hold spaces
  if (paren == std::string::npos) return c;
  std::istringstream rest(line.substr(paren + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {  // field 3 is state; 14 utime, 15 stime
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  c.self = utime + stime;
  c.ok = true;
  return c;
}

// Average CPUs busy with something other than this process between a and b.
double OtherCpus(const CpuSample& a, const CpuSample& b, long cpus) {
  if (!a.ok || !b.ok || b.total <= a.total || cpus <= 0) return NAN;
  const double per_cpu = static_cast<double>(b.total - a.total) / static_cast<double>(cpus);
  const double others = static_cast<double>(b.busy - a.busy) - static_cast<double>(b.self - a.self);
  return std::max(0.0, others / per_cpu);
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto c = line.find(':');
      if (c != std::string::npos) return line.substr(line.find_first_not_of(" \t", c + 1));
    }
  }
  return "unknown";
}

double PeakRssGib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is in KiB
}

// ------------------------------------------------------------------ json ----

std::string JsonString(const std::string& s) {
  std::string o = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else {
      o += c;
    }
  }
  return o + "\"";
}

std::string JsonNum(double v, int decimals = 3) {
  if (!std::isfinite(v)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", decimals, v);
  return b;
}

// ------------------------------------------------------------------ data ----

// splitmix64: the outputs of consecutive states are distinct (the finaliser is
// a bijection), so N draws give N distinct keys without a duplicate check.
class KeyStream {
 public:
  explicit KeyStream(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    for (;;) {
      uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      z ^= z >> 31;
      if (z != hps::kEmptyKey) return z;  // reserved; skipping keeps the rest distinct
    }
  }

 private:
  uint64_t state_;
};

// Exactly representable, so sums after accumulate compare exactly.
inline float RowValue(uint64_t i, uint32_t j) {
  return static_cast<float>((i * 131 + j * 7) & 4095) * 0.25f;
}

struct KeyData {
  uint64_t n = 0;
  uint64_t mix_hits = 0;         // present keys in the mix
  Buffer<uint64_t> keys;         // insert order; key i owns row i
  Buffer<uint64_t> hit_keys;     // keys[hit_perm[p]]
  Buffer<uint32_t> hit_perm;
  Buffer<uint64_t> mix_keys;     // mix_idx[p] < n: keys[mix_idx[p]]; else absent key
  Buffer<uint32_t> mix_idx;
  Buffer<uint64_t> acc_keys;     // keys[acc_perm[p]]
  Buffer<uint32_t> acc_perm;
};

KeyData MakeKeys(uint64_t n, uint64_t seed) {
  KeyData d;
  d.n = n;
  d.mix_hits = n / 2;
  const uint64_t absent = n - d.mix_hits;
  d.keys = Buffer<uint64_t>(n);
  Buffer<uint64_t> missing(absent);
  KeyStream ks(seed);
  for (uint64_t i = 0; i < n; ++i) d.keys[i] = ks.Next();
  for (uint64_t i = 0; i < absent; ++i) missing[i] = ks.Next();

  std::mt19937_64 rng(seed ^ 0x5eed5eed5eed5eedULL);
  auto permutation = [&](Buffer<uint32_t>& p) {
    p = Buffer<uint32_t>(n);
    for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<uint32_t>(i);
    std::shuffle(p.data(), p.data() + n, rng);
  };
  permutation(d.hit_perm);
  permutation(d.acc_perm);
  d.hit_keys = Buffer<uint64_t>(n);
  d.acc_keys = Buffer<uint64_t>(n);
  for (uint64_t p = 0; p < n; ++p) {
    d.hit_keys[p] = d.keys[d.hit_perm[p]];
    d.acc_keys[p] = d.keys[d.acc_perm[p]];
  }
  // The mix: n/2 present keys chosen at random, the rest absent, shuffled.
  permutation(d.mix_idx);
  for (uint64_t p = d.mix_hits; p < n; ++p) d.mix_idx[p] = static_cast<uint32_t>(n + (p - d.mix_hits));
  std::shuffle(d.mix_idx.data(), d.mix_idx.data() + n, rng);
  d.mix_keys = Buffer<uint64_t>(n);
  for (uint64_t p = 0; p < n; ++p) {
    const uint64_t idx = d.mix_idx[p];
    d.mix_keys[p] = idx < n ? d.keys[idx] : missing[idx - n];
  }
  return d;
}

// ------------------------------------------------------- implementations ----

class Impl {
 public:
  virtual ~Impl() = default;
  virtual uint64_t Insert(const uint64_t* keys, uint64_t n, const float* rows) = 0;
  virtual uint64_t Find(const uint64_t* keys, uint64_t n, float* out) = 0;
  virtual void Accumulate(const uint64_t* keys, uint64_t n, const float* deltas) = 0;
  virtual uint64_t Size() const = 0;
  virtual uint64_t Slots() const = 0;
};

class HpsImpl final : public Impl {
 public:
  HpsImpl(uint64_t capacity, int32_t width, int32_t threads)
      : t_(hps::NewHashTable(hps::HashTableOptions{capacity, width, threads, -1})) {}
  uint64_t Insert(const uint64_t* keys, uint64_t n, const float* rows) override {
    return t_->insert(keys, n, rows, nullptr);
  }
  uint64_t Find(const uint64_t* keys, uint64_t n, float* out) override {
    return t_->find(keys, n, out, nullptr);
  }
  void Accumulate(const uint64_t* keys, uint64_t n, const float* deltas) override {
    t_->accumulate(keys, n, deltas);
  }
  uint64_t Size() const override { return t_->size(); }
  uint64_t Slots() const override { return t_->capacity(); }

 private:
  std::unique_ptr<hps::HashTable> t_;
};

// The natural single-threaded loops over a map of inline rows. With a
// prefetch distance D > 0 (only for maps with a public prefetch(key)), each
// step first asks the map to prefetch key i + D, so D lookups are in flight.
template <class Map, int W>
class PeerImpl final : public Impl {
  using Row = std::array<float, W>;
  static_assert(sizeof(Row) == W * sizeof(float));

 public:
  explicit PeerImpl(uint64_t capacity, uint64_t prefetch = 0) : prefetch_(prefetch) { m_.reserve(capacity); }
  uint64_t Insert(const uint64_t* keys, uint64_t n, const float* rows) override {
    uint64_t inserted = 0;
    for (uint64_t i = 0; i < n; ++i) {
      Ahead(keys, n, i);
      Row r;
      std::memcpy(r.data(), rows + i * W, sizeof(Row));
      inserted += m_.try_emplace(keys[i], r).second;
    }
    return inserted;
  }
  uint64_t Find(const uint64_t* keys, uint64_t n, float* out) override {
    uint64_t hits = 0;
    for (uint64_t i = 0; i < n; ++i) {
      Ahead(keys, n, i);
      float* o = out + i * W;
      const auto it = m_.find(keys[i]);
      if (it != m_.end()) {
        std::memcpy(o, it->second.data(), sizeof(Row));
        ++hits;
      } else {
        std::memset(o, 0, sizeof(Row));
      }
    }
    return hits;
  }
  void Accumulate(const uint64_t* keys, uint64_t n, const float* deltas) override {
    for (uint64_t i = 0; i < n; ++i) {
      Ahead(keys, n, i);
      Row& r = m_.try_emplace(keys[i]).first->second;  // value-initialised: a zero row
      const float* d = deltas + i * W;
      for (int j = 0; j < W; ++j) r[j] += d[j];
    }
  }
  uint64_t Size() const override { return m_.size(); }
  uint64_t Slots() const override { return m_.bucket_count(); }

 private:
  void Ahead(const uint64_t* keys, uint64_t n, uint64_t i) const {
    if constexpr (requires(const Map& m, uint64_t k) { m.prefetch(k); }) {
      if (prefetch_ != 0 && i + prefetch_ < n) m_.prefetch(keys[i + prefetch_]);
    }
  }

  Map m_;
  uint64_t prefetch_;  // keys ahead; 0: none
};

template <int W>
using AbslMap = absl::flat_hash_map<uint64_t, std::array<float, W>, absl::Hash<uint64_t>,
                                    std::equal_to<uint64_t>,
                                    PeerAllocator<std::pair<const uint64_t, std::array<float, W>>>>;
template <int W>
using BoostMap =
    boost::unordered_flat_map<uint64_t, std::array<float, W>, boost::hash<uint64_t>,
                              std::equal_to<uint64_t>,
                              PeerAllocator<std::pair<const uint64_t, std::array<float, W>>>>;

// --------------------------------------------------------------- harness ----

const std::vector<std::string> kAllImpls = {"hps_t1", "hps_t2", "absl", "absl_pf", "boost"};
const std::vector<std::string> kPeers = {"absl", "absl_pf", "boost"};
const std::vector<std::string> kPlainPeers = {"absl", "boost"};  // driven key at a time, no prefetch
std::vector<std::string> kImpls = kAllImpls;  // those selected by --impls, in this order
const std::vector<std::string> kOps = {"insert", "find_hit", "find_mix", "accumulate"};

struct Options {
  uint64_t keys = 10'000'000;
  int repeats = 3;
  std::vector<int> widths = {16, 64};
  uint64_t seed = 20240607;
  uint64_t batch = 0;  // 0: one call over all keys
  bool quick = false;
  double load = 0.8;
  uint64_t peer_prefetch = 8;  // absl_pf's prefetch distance, in keys
};

struct WidthResult {
  int width = 0;
  std::map<std::string, std::map<std::string, std::vector<double>>> mops;  // op -> impl -> runs
  std::map<std::string, std::vector<double>> construct_ms;                  // impl -> runs
  std::map<std::string, uint64_t> slots;                                    // impl -> slots
  std::map<std::string, double> huge_mib;  // impl -> AnonHugePages gained by build + insert
  std::map<std::string, std::vector<double>> other_cpus;  // impl -> CPUs others used, per run
};

template <class Op>
double TimeBatched(uint64_t n, uint64_t batch, const Op& op) {
  const auto t0 = Clock::now();
  if (batch == 0 || batch >= n) {
    op(0, n);
  } else {
    for (uint64_t off = 0; off < n; off += batch) op(off, std::min(batch, n - off));
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "hash_table_bench: VERIFICATION FAILED: %s\n", what.c_str());
  std::exit(2);
}

constexpr uint64_t kSamples = 4096;

template <int W>
WidthResult RunWidth(const Options& opt, const KeyData& d, uint64_t capacity) {
  const uint64_t n = d.n;
  WidthResult res;
  res.width = W;
  std::fprintf(stderr, "[W=%d] filling rows (%.2f GiB in, %.2f GiB out)\n", W,
               n * W * 4.0 / (1 << 30), n * W * 4.0 / (1 << 30));
  Buffer<float> rows(n * W);  // row i of keys[i]; also the deltas of accumulate (row p for acc_keys[p])
  for (uint64_t i = 0; i < n; ++i) {
    for (uint32_t j = 0; j < W; ++j) rows[i * W + j] = RowValue(i, j);
  }
  Buffer<float> out(n * W);

  std::map<std::string, std::function<std::unique_ptr<Impl>()>> make = {
      {"hps_t1", [&] { return std::make_unique<HpsImpl>(capacity, W, 1); }},
      {"hps_t2", [&] { return std::make_unique<HpsImpl>(capacity, W, 2); }},
      {"absl", [&] { return std::make_unique<PeerImpl<AbslMap<W>, W>>(capacity); }},
      {"absl_pf", [&] { return std::make_unique<PeerImpl<AbslMap<W>, W>>(capacity, opt.peer_prefetch); }},
      {"boost", [&] { return std::make_unique<PeerImpl<BoostMap<W>, W>>(capacity); }},
  };

  auto check_row = [&](const std::string& what, const float* got, const float* want, uint64_t p) {
    for (uint32_t j = 0; j < W; ++j) {
      const float w = want ? want[j] : 0.0f;
      if (got[j] != w) {
        Fail(what + ": position " + std::to_string(p) + " column " + std::to_string(j) + " got " +
             std::to_string(got[j]) + " want " + std::to_string(w));
      }
    }
  };

  for (int r = 0; r < opt.repeats; ++r) {
    for (size_t k = 0; k < kImpls.size(); ++k) {
      // Rotate the order each repeat so no implementation always runs first.
      const std::string& name = kImpls[(k + static_cast<size_t>(r)) % kImpls.size()];
      const std::string tag = "W=" + std::to_string(W) + " " + name;
      const int64_t huge_before = AnonHugeKb();
      const CpuSample cpu_before = SampleCpu();

      auto t0 = Clock::now();
      std::unique_ptr<Impl> impl = make[name]();
      const double construct_s = std::chrono::duration<double>(Clock::now() - t0).count();
      res.slots[name] = impl->Slots();

      uint64_t inserted = 0;
      const double t_insert = TimeBatched(n, opt.batch, [&](uint64_t off, uint64_t m) {
        inserted += impl->Insert(d.keys.data() + off, m, rows.data() + off * W);
      });
      if (inserted != n || impl->Size() != n) {
        Fail(tag + " insert: inserted " + std::to_string(inserted) + ", size " +
             std::to_string(impl->Size()) + ", want " + std::to_string(n));
      }
      const int64_t huge_after = AnonHugeKb();
      if (huge_before >= 0 && huge_after >= 0) res.huge_mib[name] = (huge_after - huge_before) / 1024.0;

      uint64_t hits = 0;
      const double t_hit = TimeBatched(n, opt.batch, [&](uint64_t off, uint64_t m) {
        hits += impl->Find(d.hit_keys.data() + off, m, out.data() + off * W);
      });
      if (hits != n) Fail(tag + " find_hit: " + std::to_string(hits) + " hits of " + std::to_string(n));
      for (uint64_t s = 0; s < kSamples; ++s) {
        const uint64_t p = s * n / kSamples;
        check_row(tag + " find_hit", out.data() + p * W, rows.data() + uint64_t{d.hit_perm[p]} * W, p);
      }

      hits = 0;
      const double t_mix = TimeBatched(n, opt.batch, [&](uint64_t off, uint64_t m) {
        hits += impl->Find(d.mix_keys.data() + off, m, out.data() + off * W);
      });
      if (hits != d.mix_hits) {
        Fail(tag + " find_mix: " + std::to_string(hits) + " hits, want " + std::to_string(d.mix_hits));
      }
      for (uint64_t s = 0; s < kSamples; ++s) {
        const uint64_t p = s * n / kSamples;
        const uint64_t idx = d.mix_idx[p];
        check_row(tag + " find_mix", out.data() + p * W, idx < n ? rows.data() + idx * W : nullptr, p);
      }

      const double t_acc = TimeBatched(n, opt.batch, [&](uint64_t off, uint64_t m) {
        impl->Accumulate(d.acc_keys.data() + off, m, rows.data() + off * W);
      });
      if (impl->Size() != n) Fail(tag + " accumulate changed the size to " + std::to_string(impl->Size()));
      {
        std::vector<uint64_t> sk(kSamples);
        std::vector<float> so(kSamples * W);
        for (uint64_t s = 0; s < kSamples; ++s) sk[s] = d.acc_keys[s * n / kSamples];
        if (impl->Find(sk.data(), kSamples, so.data()) != kSamples) Fail(tag + " accumulate: keys lost");
        std::vector<float> want(W);
        for (uint64_t s = 0; s < kSamples; ++s) {
          const uint64_t p = s * n / kSamples;
          const uint64_t idx = d.acc_perm[p];
          for (uint32_t j = 0; j < W; ++j) want[j] = rows[idx * W + j] + rows[p * W + j];
          check_row(tag + " accumulate", so.data() + s * W, want.data(), p);
        }
      }

      const double others = OtherCpus(cpu_before, SampleCpu(), sysconf(_SC_NPROCESSORS_ONLN));
      res.other_cpus[name].push_back(others);
      const double mops[4] = {n / t_insert / 1e6, n / t_hit / 1e6, n / t_mix / 1e6, n / t_acc / 1e6};
      for (size_t o = 0; o < kOps.size(); ++o) res.mops[kOps[o]][name].push_back(mops[o]);
      res.construct_ms[name].push_back(construct_s * 1e3);
      std::fprintf(stderr,
                   "[W=%d rep %d/%d] %-6s construct %7.1f ms | insert %7.2f | find_hit %7.2f | "
                   "find_mix %7.2f | accumulate %7.2f Mops/s | +%.0f MiB huge pages | "
                   "others used %.2f CPUs\n",
                   W, r + 1, opt.repeats, name.c_str(), construct_s * 1e3, mops[0], mops[1], mops[2],
                   mops[3], res.huge_mib.count(name) ? res.huge_mib[name] : -1.0, others);
      impl.reset();  // free before the next structure is built
    }
  }
  return res;
}

WidthResult RunWidthDispatch(int w, const Options& opt, const KeyData& d, uint64_t capacity) {
  switch (w) {
    case 8: return RunWidth<8>(opt, d, capacity);
    case 16: return RunWidth<16>(opt, d, capacity);
    case 32: return RunWidth<32>(opt, d, capacity);
    case 64: return RunWidth<64>(opt, d, capacity);
    case 128: return RunWidth<128>(opt, d, capacity);
    default: break;
  }
  std::fprintf(stderr, "hash_table_bench: unsupported width %d (compiled: 8, 16, 32, 64, 128)\n", w);
  std::exit(1);
}

struct Stats {
  double median = 0, min = 0, max = 0;
};

Stats Summarise(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  s.median = v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
  s.min = v.front();
  s.max = v.back();
  return s;
}

// Bytes the peers' reserve() allocates at most: a power-of-two slot count for
// load <= 7/8, slot = key + row, plus one control byte per slot.
uint64_t PeerBytesEstimate(uint64_t capacity, int w) {
  const uint64_t slots = std::bit_ceil(capacity * 8 / 7 + 16);
  return slots * (8 + 4 * static_cast<uint64_t>(w) + 1);
}

void Usage(FILE* f) {
  std::fprintf(f,
               "usage: hash_table_bench [--quick] [--keys N] [--repeats R] [--widths 16,64]\n"
               "                        [--peer-hugepages | --no-peer-hugepages] [--load L]\n"
               "                        [--impls LIST] [--batch B] [--seed S] [--peer-prefetch D]\n"
               "  --quick              1M keys, 1 repeat (unless --keys/--repeats say otherwise)\n"
               "  --keys N             distinct keys (default 10000000)\n"
               "  --repeats R          runs per measurement, fresh table per run (default 3)\n"
               "  --widths LIST        row widths in floats, of 8,16,32,64,128 (default 16,64)\n"
               "  --peer-hugepages     peers allocate blocks >= 2 MiB with mmap + MADV_HUGEPAGE\n"
               "                       like our table (default); --no-peer-hugepages or\n"
               "                       --peer-hugepages=off gives them plain operator new\n"
               "  --load L             our table's capacity is keys / L (default 0.8); the peers\n"
               "                       are reserved to the same capacity\n"
               "  --impls LIST         run only these, of hps_t1,hps_t2,absl,absl_pf,boost (default all;\n"
               "                       ratios whose sides are missing are null)\n"
               "  --batch B            keys per call (default 0: one call over all keys)\n"
               "  --seed S             key and shuffle seed (default 20240607)\n"
               "  --peer-prefetch D    absl_pf calls prefetch(key) D keys ahead (default 8, >= 1)\n"
               "Progress goes to stderr; one JSON line with all figures to stdout.\n");
}

bool ParseOnOff(const std::string& v, bool* out) {
  if (v == "on" || v == "1" || v == "true" || v == "yes") return *out = true, true;
  if (v == "off" || v == "0" || v == "false" || v == "no") return *out = false, true;
  return false;
}

Options Parse(int argc, char** argv) {
  Options o;
  bool keys_set = false, repeats_set = false;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) {
      std::fprintf(stderr, "hash_table_bench: %s needs a value\n", argv[i]);
      std::exit(1);
    }
    return argv[++i];
  };
  auto number = [](const std::string& s, const char* what) -> uint64_t {
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);  // accepts 1e7
    if (end == s.c_str() || *end != '\0' || v < 0 || v != std::floor(v)) {
      std::fprintf(stderr, "hash_table_bench: bad %s '%s'\n", what, s.c_str());
      std::exit(1);
    }
    return static_cast<uint64_t>(v);
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string val;
    const auto eq = a.find('=');
    const bool has_val = a.rfind("--", 0) == 0 && eq != std::string::npos;
    if (has_val) {
      val = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto value = [&]() { return has_val ? val : need(i); };
    if (a == "--help" || a == "-h") {
      Usage(stderr);
      std::exit(0);
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--keys") {
      o.keys = number(value(), "--keys");
      keys_set = true;
    } else if (a == "--repeats") {
      o.repeats = static_cast<int>(number(value(), "--repeats"));
      repeats_set = true;
    } else if (a == "--widths") {
      o.widths.clear();
      std::stringstream ss(value());
      std::string w;
      while (std::getline(ss, w, ',')) o.widths.push_back(static_cast<int>(number(w, "width")));
    } else if (a == "--peer-hugepages") {
      if (has_val) {
        if (!ParseOnOff(val, &g_peer_hugepages)) {
          std::fprintf(stderr, "hash_table_bench: --peer-hugepages=on|off, not '%s'\n", val.c_str());
          std::exit(1);
        }
      } else {
        g_peer_hugepages = true;
      }
    } else if (a == "--no-peer-hugepages") {
      g_peer_hugepages = false;
    } else if (a == "--load") {
      char* end = nullptr;
      const std::string v = value();
      o.load = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(o.load > 0.0 && o.load <= 1.0)) {
        std::fprintf(stderr, "hash_table_bench: --load must be in (0, 1], not '%s'\n", v.c_str());
        std::exit(1);
      }
    } else if (a == "--impls") {
      std::vector<std::string> want;
      std::stringstream ss(value());
      std::string w;
      while (std::getline(ss, w, ',')) {
        if (std::find(kAllImpls.begin(), kAllImpls.end(), w) == kAllImpls.end()) {
          std::fprintf(stderr, "hash_table_bench: unknown implementation '%s' (hps_t1,hps_t2,absl,absl_pf,boost)\n",
                       w.c_str());
          std::exit(1);
        }
        want.push_back(w);
      }
      kImpls.clear();
      for (const auto& impl : kAllImpls) {
        if (std::find(want.begin(), want.end(), impl) != want.end()) kImpls.push_back(impl);
      }
      if (kImpls.empty()) {
        std::fprintf(stderr, "hash_table_bench: --impls selects nothing\n");
        std::exit(1);
      }
    } else if (a == "--batch") {
      o.batch = number(value(), "--batch");
    } else if (a == "--seed") {
      o.seed = number(value(), "--seed");
    } else if (a == "--peer-prefetch") {
      o.peer_prefetch = number(value(), "--peer-prefetch");
      if (o.peer_prefetch == 0) {
        std::fprintf(stderr, "hash_table_bench: --peer-prefetch must be >= 1 (absl runs the unprefetched loop)\n");
        std::exit(1);
      }
    } else {
      std::fprintf(stderr, "hash_table_bench: unknown argument '%s'\n", argv[i]);
      Usage(stderr);
      std::exit(1);
    }
  }
  if (o.quick) {
    if (!keys_set) o.keys = 1'000'000;
    if (!repeats_set) o.repeats = 1;
  }
  if (o.keys < 2 || o.keys > (uint64_t{1} << 31)) {
    std::fprintf(stderr, "hash_table_bench: --keys must be in [2, 2^31]\n");
    std::exit(1);
  }
  if (o.repeats < 1 || o.widths.empty()) {
    std::fprintf(stderr, "hash_table_bench: need --repeats >= 1 and at least one width\n");
    std::exit(1);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const auto wall0 = Clock::now();
  const Options opt = Parse(argc, argv);
  // Other work on a shared machine skews every figure; keep the evidence.
  const std::string loadavg_start = ReadFirstLine("/proc/loadavg");
  const uint64_t n = opt.keys;
  const uint64_t capacity = static_cast<uint64_t>(std::ceil(static_cast<double>(n) / opt.load));

  // ---- machine facts ----
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus_allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : -1;
  const long cores_online = sysconf(_SC_NPROCESSORS_ONLN);
  const std::string thp_raw = ReadFirstLine("/sys/kernel/mm/transparent_hugepage/enabled");
  const std::string thp_defrag_raw = ReadFirstLine("/sys/kernel/mm/transparent_hugepage/defrag");
  const int64_t mem_total_kb = ProcFieldKb("/proc/meminfo", "MemTotal");
  const int64_t mem_avail_kb = ProcFieldKb("/proc/meminfo", "MemAvailable");
  utsname un{};
  uname(&un);

  // ---- memory plan: key data + two row buffers + the largest one structure ----
  int wmax = 0;
  for (int w : opt.widths) wmax = std::max(wmax, w);
  const uint64_t key_bytes = n * (8 * 4 + 4 * 3) + (n - n / 2) * 8;
  const uint64_t buf_bytes = 2 * n * static_cast<uint64_t>(wmax) * 4;
  const uint64_t table_bytes = std::max<uint64_t>(capacity * (8 + 4 * static_cast<uint64_t>(wmax)),
                                                  PeerBytesEstimate(capacity, wmax));
  const double plan_gib = static_cast<double>(key_bytes + buf_bytes + table_bytes) / (1ull << 30);
  std::fprintf(stderr,
               "hash_table_bench (W2): %" PRIu64 " keys, widths", n);
  for (int w : opt.widths) std::fprintf(stderr, " %d", w);
  std::fprintf(stderr,
               ", %d repeat(s), our capacity %" PRIu64 " (load %.2f), batch %s, peer hugepages %s\n"
               "  machine: %ld cores online, %d allowed, THP '%s', %.1f GiB available; "
               "planned peak %.2f GiB\n"
               "  peers (absl, absl_pf, boost) are single-threaded: they are not concurrent containers;\n"
               "  absl_pf prefetches %" PRIu64 " keys ahead\n",
               opt.repeats, capacity, opt.load,
               opt.batch ? std::to_string(opt.batch).c_str() : "all keys in one call",
               g_peer_hugepages ? "on" : "off", cores_online, cpus_allowed, Bracketed(thp_raw).c_str(),
               mem_avail_kb / 1048576.0, plan_gib, opt.peer_prefetch);
  if (mem_avail_kb > 0 && plan_gib * 1048576.0 > 0.9 * static_cast<double>(mem_avail_kb)) {
    std::fprintf(stderr, "hash_table_bench: planned peak %.2f GiB exceeds 90%% of available memory; "
                         "use fewer --keys or narrower --widths\n", plan_gib);
    return 3;
  }

  const CpuSample idle0 = SampleCpu();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double others_at_start = OtherCpus(idle0, SampleCpu(), cores_online);
  if (others_at_start > 0.1) {
    std::fprintf(stderr, "  warning: other work is using %.2f CPUs; it will skew the figures\n",
                 others_at_start);
  }
  const CpuSample run0 = SampleCpu();
  const auto g0 = Clock::now();
  const KeyData data = MakeKeys(n, opt.seed);
  std::fprintf(stderr, "  keys generated and shuffled in %.2f s\n",
               std::chrono::duration<double>(Clock::now() - g0).count());

  std::vector<WidthResult> results;
  for (int w : opt.widths) results.push_back(RunWidthDispatch(w, opt, data, capacity));

  // ---- the JSON line ----
  std::ostringstream j;
  j << "{\"benchmark\":\"W2\",\"name\":\"hash_table\",\"unit\":\"Mops/s\",\"quick\":"
    << (opt.quick ? "true" : "false");
  j << ",\"config\":{\"keys\":" << n << ",\"repeats\":" << opt.repeats << ",\"widths\":[";
  for (size_t i = 0; i < opt.widths.size(); ++i) j << (i ? "," : "") << opt.widths[i];
  j << "],\"impls\":[";
  for (size_t i = 0; i < kImpls.size(); ++i) j << (i ? "," : "") << JsonString(kImpls[i]);
  j << "],\"seed\":" << opt.seed << ",\"batch\":" << (opt.batch ? opt.batch : n)
    << ",\"hps_capacity\":" << capacity << ",\"hps_load\":" << JsonNum(static_cast<double>(n) / capacity, 4)
    << ",\"hps_capacity_rule\":" << JsonString("ceil(keys / " + JsonNum(opt.load, 2) + ")")
    << ",\"peer_reserve\":" << capacity << ",\"peer_hugepages\":" << (g_peer_hugepages ? "true" : "false")
    << ",\"peer_threads\":1,\"peer_prefetch\":" << opt.peer_prefetch
    << ",\"hps_threads\":{\"hps_t1\":1,\"hps_t2\":2}"
    << ",\"notes\":[" << JsonString("peers are single-threaded: absl::flat_hash_map and boost::unordered_flat_map are not concurrent containers")
    << "," << JsonString("hps mmaps its slots with MADV_HUGEPAGE; peer_hugepages=true gives the peers an allocator doing mmap + MADV_HUGEPAGE for blocks >= 2 MiB, false gives them operator new (malloc)")
    << "," << JsonString("absl_pf: the absl loop calling flat_hash_map::prefetch(key) peer_prefetch keys ahead; boost::unordered_flat_map 1.81 has no public prefetch nor bucket interface, so boost runs unprefetched only")
    << "," << JsonString("hps_t1_over_best_peer takes the best of every peer, absl_pf included; hps_t1_over_best_plain_peer only the unprefetched absl and boost")
    << "," << JsonString("peers hold std::array<float, W> inline after the key (one array of key+row slots); hps keeps a key array and a separate row array")
    << "," << JsonString("each repeat builds every structure fresh: insert on an empty reserved table, then find_hit, find_mix, accumulate on the loaded table; order of implementations rotates per repeat")
    << "," << JsonString("find_hit: all keys, shuffled; find_mix: half present (random), half absent, shuffled; accumulate: a delta row to every (present) key, shuffled; all outputs verified on 4096 samples")
    << "]}";
  j << ",\"machine\":{\"cores_online\":" << cores_online << ",\"cpus_allowed\":" << cpus_allowed
    << ",\"hardware_concurrency\":" << std::thread::hardware_concurrency()
    << ",\"cpu_model\":" << JsonString(CpuModel())
    << ",\"l2_cache_kib\":" << sysconf(_SC_LEVEL2_CACHE_SIZE) / 1024
    << ",\"l3_cache_kib\":" << sysconf(_SC_LEVEL3_CACHE_SIZE) / 1024
    << ",\"mem_total_gib\":" << JsonNum(mem_total_kb / 1048576.0, 2)
    << ",\"thp_enabled\":" << JsonString(Bracketed(thp_raw))
    << ",\"thp_enabled_raw\":" << JsonString(thp_raw)
    << ",\"thp_defrag\":" << JsonString(Bracketed(thp_defrag_raw))
    << ",\"kernel\":" << JsonString(std::string(un.release))
    << ",\"compiler\":" << JsonString(std::string("gcc/clang ") + __VERSION__)
    << ",\"cxx_flags\":" << JsonString(HPS_BENCH_CXX_FLAGS)
    << ",\"absl_lts\":" << JsonString(std::to_string(ABSL_LTS_RELEASE_VERSION))
    << ",\"boost\":" << JsonString(BOOST_LIB_VERSION) << "}";

  j << ",\"results\":{";
  std::vector<std::string> fails;
  for (size_t wi = 0; wi < results.size(); ++wi) {
    const WidthResult& r = results[wi];
    const std::string ws = std::to_string(r.width);
    j << (wi ? "," : "") << "\"" << ws << "\":{\"slots\":{";
    for (size_t k = 0; k < kImpls.size(); ++k) {
      j << (k ? "," : "") << "\"" << kImpls[k] << "\":" << r.slots.at(kImpls[k]);
    }
    j << "},\"load\":{";
    for (size_t k = 0; k < kImpls.size(); ++k) {
      j << (k ? "," : "") << "\"" << kImpls[k]
        << "\":" << JsonNum(static_cast<double>(n) / r.slots.at(kImpls[k]), 4);
    }
    j << "},\"huge_pages_mib\":{";
    for (size_t k = 0; k < kImpls.size(); ++k) {
      const auto it = r.huge_mib.find(kImpls[k]);
      j << (k ? "," : "") << "\"" << kImpls[k] << "\":" << JsonNum(it == r.huge_mib.end() ? NAN : it->second, 0);
    }
    j << "},\"other_cpus_max\":{";
    for (size_t k = 0; k < kImpls.size(); ++k) {
      j << (k ? "," : "") << "\"" << kImpls[k] << "\":" << JsonNum(Summarise(r.other_cpus.at(kImpls[k])).max, 2);
    }
    j << "},\"construct_ms\":{";
    for (size_t k = 0; k < kImpls.size(); ++k) {
      const Stats s = Summarise(r.construct_ms.at(kImpls[k]));
      j << (k ? "," : "") << "\"" << kImpls[k] << "\":{\"median\":" << JsonNum(s.median, 2)
        << ",\"min\":" << JsonNum(s.min, 2) << ",\"max\":" << JsonNum(s.max, 2) << "}";
    }
    j << "},\"ops\":{";
    std::map<std::string, std::map<std::string, double>> med;
    for (size_t o = 0; o < kOps.size(); ++o) {
      j << (o ? "," : "") << "\"" << kOps[o] << "\":{";
      for (size_t k = 0; k < kImpls.size(); ++k) {
        const auto& runs = r.mops.at(kOps[o]).at(kImpls[k]);
        const Stats s = Summarise(runs);
        med[kOps[o]][kImpls[k]] = s.median;
        j << (k ? "," : "") << "\"" << kImpls[k] << "\":{\"median\":" << JsonNum(s.median)
          << ",\"min\":" << JsonNum(s.min) << ",\"max\":" << JsonNum(s.max) << ",\"runs\":[";
        for (size_t x = 0; x < runs.size(); ++x) j << (x ? "," : "") << JsonNum(runs[x]);
        j << "]}";
      }
      j << "}";
    }
    // Ratios of medians; null where --impls left out a side.
    auto has = [&](const char* impl) { return std::find(kImpls.begin(), kImpls.end(), impl) != kImpls.end(); };
    auto over_best = [&](const std::vector<std::string>& peers, bool target) {
      for (size_t o = 0; o < kOps.size(); ++o) {
        const auto& m = med[kOps[o]];
        const std::string* best_peer = nullptr;
        for (const std::string& peer : peers) {
          if (has(peer.c_str()) && (!best_peer || m.at(peer) > m.at(*best_peer))) best_peer = &peer;
        }
        j << (o ? "," : "") << "\"" << kOps[o] << "\":";
        if (!best_peer || !has("hps_t1")) {
          j << "null";
          continue;
        }
        const double ratio = m.at("hps_t1") / m.at(*best_peer);
        j << "{\"ratio\":" << JsonNum(ratio) << ",\"best_peer\":\"" << *best_peer << "\"}";
        if (target && kOps[o].rfind("find", 0) == 0 && !(ratio >= 1.0)) {
          fails.push_back("W=" + ws + " " + kOps[o] + " hps_t1/best_peer " + JsonNum(ratio) + " < 1.0");
        }
      }
    };
    j << "},\"ratios\":{\"hps_t1_over_best_peer\":{";
    over_best(kPeers, /*target=*/true);
    j << "},\"hps_t1_over_best_plain_peer\":{";
    over_best(kPlainPeers, /*target=*/false);
    j << "},\"absl_pf_over_absl\":{";
    for (size_t o = 0; o < kOps.size(); ++o) {
      const auto& m = med[kOps[o]];
      j << (o ? "," : "") << "\"" << kOps[o] << "\":";
      if (has("absl") && has("absl_pf")) {
        j << JsonNum(m.at("absl_pf") / m.at("absl"));
      } else {
        j << "null";
      }
    }
    j << "},\"hps_t2_over_hps_t1\":{";
    for (size_t o = 0; o < kOps.size(); ++o) {
      const auto& m = med[kOps[o]];
      j << (o ? "," : "") << "\"" << kOps[o] << "\":";
      if (!has("hps_t1") || !has("hps_t2")) {
        j << "null";
        continue;
      }
      const double ratio = m.at("hps_t2") / m.at("hps_t1");
      j << JsonNum(ratio);
      if (!(ratio >= 1.7)) {
        fails.push_back("W=" + ws + " " + kOps[o] + " scaling hps_t2/hps_t1 " + JsonNum(ratio) + " < 1.7");
      }
    }
    j << "}}}";
  }
  j << "}";
  j << ",\"targets\":{\"rule\":" << JsonString("find (hit and mix) hps_t1 >= 1.0x the best peer, absl_pf included; hps_t2/hps_t1 >= 1.7 for every op")
    << ",\"met\":" << (kImpls.size() < kAllImpls.size() ? "null" : fails.empty() ? "true" : "false")
    << ",\"misses\":[";
  for (size_t i = 0; i < fails.size(); ++i) j << (i ? "," : "") << JsonString(fails[i]);
  j << "]}";
  const double wall = std::chrono::duration<double>(Clock::now() - wall0).count();
  rusage self{};
  getrusage(RUSAGE_SELF, &self);
  const double cpu_s = self.ru_utime.tv_sec + self.ru_utime.tv_usec / 1e6 + self.ru_stime.tv_sec +
                       self.ru_stime.tv_usec / 1e6;
  j << ",\"other_cpus\":{\"before\":" << JsonNum(others_at_start, 2)
    << ",\"during\":" << JsonNum(OtherCpus(run0, SampleCpu(), cores_online), 2)
    << ",\"note\":" << JsonString("average CPUs busy with other processes (incl. steal); ~0 means a quiet machine") << "}";
  j << ",\"loadavg_start\":" << JsonString(loadavg_start)
    << ",\"loadavg_end\":" << JsonString(ReadFirstLine("/proc/loadavg"))
    << ",\"process_cpu_s\":" << JsonNum(cpu_s, 1);
  j << ",\"planned_peak_gib\":" << JsonNum(plan_gib, 2) << ",\"peak_rss_gib\":" << JsonNum(PeakRssGib(), 2)
    << ",\"wall_s\":" << JsonNum(wall, 1) << "}";

  std::fprintf(stderr, "done in %.1f s, peak RSS %.2f GiB; targets %s\n", wall, PeakRssGib(),
               fails.empty() ? "met" : "missed (see targets.misses)");
  std::printf("%s\n", j.str().c_str());
  return 0;
}
