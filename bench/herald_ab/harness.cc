// A/B harness for the Herald scheduler: the working tree's hps::Herald and a
// baseline revision's (OldHerald, old_api.h) in one binary (run.sh builds it).
//
//   harness check SEEDS   both schedulers on the same seeded batches (W of 1
//                         to 64, capacities 0 to 2,000, both partitions and
//                         sync modes, ragged and empty examples, windows,
//                         Clear()); every plan field and cache must match.
//   harness time W REPS BATCHES
//                         batches of 4096 x 26 Zipf(1.05) keys over 1M ids,
//                         caches of 100,000 keys; each batch is scheduled by
//                         both, alternating which goes first, timed by thread
//                         CPU time; the last half of each repeat's batches
//                         count. One JSON line: per-batch ms of each (median,
//                         min, max, mean, p90), the median of the per-batch
//                         ratio new / old, and snapshot bytes a cached key.
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "hps/herald.h"
#include "old_api.h"

namespace {

double CpuMs() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}

struct Zipf {
  std::vector<double> cdf;
  std::vector<uint64_t> perm;
  std::mt19937_64 rng;
  Zipf(uint64_t vocab, double a, uint64_t seed) : rng(seed) {
    cdf.resize(vocab);
    double s = 0;
    for (uint64_t r = 0; r < vocab; ++r) cdf[r] = s += 1.0 / std::pow(static_cast<double>(r + 1), a);
    for (auto& c : cdf) c /= s;
    perm.resize(vocab);
    for (uint64_t i = 0; i < vocab; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  uint64_t Draw() {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const auto r = static_cast<uint64_t>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
    return perm[std::min<uint64_t>(r, cdf.size() - 1)];
  }
};

bool Same(const hps::HeraldPlan& a, const OldPlan& b) {
  return a.assignment == b.assignment && a.fetch_offsets == b.fetch_offsets && a.fetch_keys == b.fetch_keys &&
         a.fetch_from == b.fetch_from && a.comm_offsets == b.comm_offsets && a.comm_keys == b.comm_keys &&
         a.evicted == b.evicted && a.lost_keys == b.lost_keys && a.lost_from == b.lost_from && a.pulls == b.pulls &&
         a.peer_pulls == b.peer_pulls && a.pushes == b.pushes && a.evict_pushes == b.evict_pushes &&
         a.shared == b.shared && a.distinct == b.distinct;
}

int Check(uint64_t seeds) {
  uint64_t total = 0, fails = 0;
  const int32_t kWorkers[] = {1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64};
  const uint64_t kCaps[] = {0, 1, 7, 50, 300, 2000};
  const uint64_t kVocab[] = {20, 200, 3000, 50000};
  for (uint64_t seed = 0; seed < seeds; ++seed) {
    std::mt19937_64 rng(seed * 7919 + 1);
    for (const int32_t W : kWorkers) {
      for (int cfg = 0; cfg < 8; ++cfg) {
        const bool aware = cfg & 1, on_demand = cfg & 2;
        const uint64_t cap = (cfg & 4) ? kCaps[rng() % 6] : kCaps[rng() % 3 + 2];
        const uint64_t vocab = kVocab[rng() % 4];
        const double skew = 0.8 + static_cast<double>(rng() % 5) * 0.15;
        Zipf z(vocab, skew, rng());
        hps::Herald nh({.workers = W, .capacity = cap, .location_aware = aware, .on_demand = on_demand});
        OldHerald oh(W, cap, aware, on_demand);
        const int batches = 12 + static_cast<int>(rng() % 20);
        const uint64_t window_batches = rng() % 4;
        std::vector<std::vector<uint64_t>> bk, bo;
        for (int b = 0; b < batches + 4; ++b) {
          // One draw a statement: the operands of % are unsequenced.
          const bool empty = rng() % 10 == 0;
          const uint64_t most = rng() % 3 == 0 ? 600 : 80;
          const uint64_t n = empty ? 0 : 1 + rng() % most;
          std::vector<uint64_t> off(1, 0), keys;
          const bool ragged = rng() % 2;
          const uint64_t fields = 1 + rng() % 30;
          for (uint64_t i = 0; i < n; ++i) {
            const uint64_t f = ragged ? rng() % (fields + 1) : fields;
            for (uint64_t j = 0; j < f; ++j) keys.push_back(rng() % 50 == 0 ? rng() % 3 : z.Draw() * 31 + j % 3);
            off.push_back(keys.size());
          }
          bk.push_back(keys);
          bo.push_back(off);
        }
        for (int b = 0; b < batches; ++b) {
          if (rng() % 40 == 0) {
            nh.Clear();
            oh.Clear();
          }
          std::vector<uint64_t> win;
          for (uint64_t k = 1; k <= window_batches; ++k) win.insert(win.end(), bk[b + k].begin(), bk[b + k].end());
          if (window_batches > 0 && rng() % 5 == 0) {
            for (int e = 0; e < 50; ++e) win.push_back(rng() % 100000);  // keys no cache holds
          }
          const bool use = window_batches > 0 && rng() % 4 != 0;
          const uint64_t* up = use ? win.data() : nullptr;
          const uint64_t n_up = use ? win.size() : 0;
          const hps::HeraldPlan p = nh.Schedule(bo[b].data(), bo[b].size() - 1, bk[b].data(), up, n_up);
          const OldPlan q = oh.Schedule(bo[b].data(), bo[b].size() - 1, bk[b].data(), up, n_up);
          ++total;
          bool ok = Same(p, q);
          for (int32_t w = 0; w < W && ok; ++w) ok = nh.cached(w) == oh.cached(w);
          for (int32_t w = 0; w < W && ok && b % 7 == 0; ++w) ok = nh.Cached(w) == oh.Cached(w);
          if (!ok && fails++ < 5) {
            printf("MISMATCH seed %llu W %d cfg %d cap %llu batch %d\n", static_cast<unsigned long long>(seed), W, cfg,
                   static_cast<unsigned long long>(cap), b);
          }
        }
      }
    }
  }
  printf("{\"check\": {\"batches\": %llu, \"mismatches\": %llu}}\n", static_cast<unsigned long long>(total),
         static_cast<unsigned long long>(fails));
  return fails != 0;
}

struct Stats {
  double median, min, max, mean, p90;
};

Stats Summary(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double s = 0;
  for (const double x : v) s += x;
  return {v[v.size() / 2], v.front(), v.back(), s / static_cast<double>(v.size()),
          v[static_cast<size_t>(0.9 * static_cast<double>(v.size() - 1))]};
}

void Print(const char* name, const Stats& s) {
  printf("\"%s\": {\"median_ms\": %.3f, \"min_ms\": %.3f, \"max_ms\": %.3f, \"mean_ms\": %.3f, \"p90_ms\": %.3f}", name,
         s.median, s.min, s.max, s.mean, s.p90);
}

int Time(int32_t W, int reps, uint64_t batches) {
  const uint64_t batch = 4096, fields = 26, capacity = 100000;
  Zipf z(1000000, 1.05, 11);
  std::vector<uint64_t> keys(batch * fields * batches);
  for (uint64_t i = 0; i < keys.size(); ++i) keys[i] = z.Draw() * fields + i % fields;
  std::vector<double> t_new, t_old, ratio;
  double bytes_new = 0, bytes_old = 0;
  for (int r = 0; r < reps; ++r) {
    hps::Herald nh({.workers = W, .capacity = capacity});
    OldHerald oh(W, capacity, true, true);
    for (uint64_t b = 0; b < batches; ++b) {
      const uint64_t* k = keys.data() + b * batch * fields;
      double tn, to;
      if ((b + static_cast<uint64_t>(r)) % 2 != 0) {
        const double a = CpuMs();
        nh.Schedule(k, batch, static_cast<int32_t>(fields));
        const double c = CpuMs();
        oh.Schedule(k, batch, static_cast<int32_t>(fields));
        tn = c - a;
        to = CpuMs() - c;
      } else {
        const double a = CpuMs();
        oh.Schedule(k, batch, static_cast<int32_t>(fields));
        const double c = CpuMs();
        nh.Schedule(k, batch, static_cast<int32_t>(fields));
        to = c - a;
        tn = CpuMs() - c;
      }
      if (b >= batches / 2) {  // the first half fills the caches
        t_new.push_back(tn);
        t_old.push_back(to);
        ratio.push_back(tn / to);
      }
    }
    uint64_t cached = 0;
    for (int32_t w = 0; w < W; ++w) cached += nh.cached(w);
    bytes_new = static_cast<double>(nh.memory_bytes()) / static_cast<double>(cached);
    bytes_old = static_cast<double>(oh.memory_bytes()) / static_cast<double>(cached);
  }
  printf("{\"workers\": %d, \"reps\": %d, \"batches\": %llu, ", W, reps, static_cast<unsigned long long>(batches));
  Print("old", Summary(t_old));
  printf(", ");
  Print("new", Summary(t_new));
  printf(", \"median_ratio_new_over_old\": %.3f, \"bytes_per_cached_key_old\": %.2f, \"bytes_per_cached_key_new\": %.2f}\n",
         Summary(ratio).median, bytes_old, bytes_new);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  if (mode == "check") return Check(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 3);
  if (mode == "time") {
    return Time(argc > 2 ? std::atoi(argv[2]) : 8, argc > 3 ? std::atoi(argv[3]) : 3,
                argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 60);
  }
  fprintf(stderr, "usage: %s check [SEEDS] | time [W] [REPS] [BATCHES]\n", argv[0]);
  return 2;
}
