// The CPU launcher's parallel loop: a bulk call splits into `parts` pieces run
// on their own threads, the caller running the first. Threads are started per
// call rather than pooled: a call moves thousands of rows, which dwarfs the
// ~20 us a start costs, and there is no shared pool state to get wrong when
// several Python threads call at once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace hps::detail {

// Below this many items per thread, starting a thread costs more than it saves.
inline constexpr uint64_t kMinItemsPerThread = 4096;

inline int HardwareThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

inline int PartsFor(uint64_t items, int max_threads) {
  const uint64_t by_work = std::max<uint64_t>(1, items / kMinItemsPerThread);
  return static_cast<int>(std::min<uint64_t>(by_work, static_cast<uint64_t>(max_threads)));
}

// [begin, end) of part `part` when n items are cut into `parts` near-equal pieces.
inline uint64_t PartBegin(uint64_t n, int part, int parts) {
  __extension__ using U128 = unsigned __int128;
  return static_cast<uint64_t>((static_cast<U128>(n) * part) / parts);
}

// Runs body(part) for part in [0, parts) and rethrows the first exception.
template <class Body>
void RunParts(int parts, const Body& body) {
  if (parts <= 1) {
    body(0);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
  auto guarded = [&](int part) {
    try {
      body(part);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(parts - 1));
  for (int part = 1; part < parts; ++part) workers.emplace_back(guarded, part);
  guarded(0);
  for (auto& w : workers) w.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace hps::detail
