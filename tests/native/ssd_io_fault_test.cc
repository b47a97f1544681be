// SSD-PS's row I/O under faults a healthy disk never shows, on both paths:
// io_uring_submit refused for now (-EAGAIN: no memory for the requests;
// -EBUSY: completions to reap first), a completion of -EAGAIN (the operation
// did nothing: ask again) or -EINTR (interrupted before it moved anything), a read or write that moves fewer bytes than asked,
// and on the pread path a call interrupted (EINTR) or cut short; on both, a
// read the device fails (EIO), once or, for a bad sector, at every try. A put must
// still write every byte (a reopen reads each row back), a get must read
// every byte, and a refusal that does not pass must fail naming the file,
// neither hang nor leave requests behind for the next call.
//
// This binary defines io_uring_submit, pread and pwrite itself: the store
// (linked in statically) calls them here; they inject what a test asks for
// and go on to liburing (a shared library, found with dlsym) or the kernel.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "hps/config.h"
#include "hps/ssd_store.h"
#include "temp_dir.h"

#if HPS_HAVE_LIBURING
#include <liburing.h>
#endif

namespace {

// Faults a test injects; each counts down as it is used.
std::atomic<int> submit_refusals{0};      // io_uring_submit returns -submit_error, submitting nothing
std::atomic<int> submit_error{EAGAIN};
std::atomic<int> again_completions{0};    // the next reads or writes complete with -EAGAIN, moving nothing
std::atomic<int> interrupted_completions{0};  // ... with -EINTR (with both, the two take turns)
std::atomic<int> short_completions{0};    // the next reads or writes of 8 KiB or more move half
std::atomic<int> interrupted_calls{0};    // pread or pwrite fails with EINTR
std::atomic<int> short_calls{0};          // pread or pwrite of 8 KiB or more moves half
std::atomic<int> failed_reads{0};         // the next reads (io_uring or pread) fail with EIO

// A bad sector: every read (io_uring or pread) of the file named
// bad_sector_file that overlaps bytes [bad_sector_begin, bad_sector_end)
// fails with EIO, for as long as it is set. Set and reset with no call of
// the store under way (the store's own threads read it under the mutex).
std::mutex bad_sector_mutex;
std::string bad_sector_file;  // "": none
uint64_t bad_sector_begin = 0, bad_sector_end = 0;
std::atomic<int> bad_sector_reads{0};  // the reads it failed

void SetBadSector(const std::string& file, uint64_t begin, uint64_t end) {
  std::lock_guard lock(bad_sector_mutex);
  bad_sector_file = file;
  bad_sector_begin = begin;
  bad_sector_end = end;
}

// Whether a read of `bytes` at `offset` of `fd` meets the bad sector.
bool OnBadSector(int fd, uint64_t offset, uint64_t bytes) {
  std::lock_guard lock(bad_sector_mutex);
  if (bad_sector_file.empty() || offset >= bad_sector_end || offset + bytes <= bad_sector_begin) return false;
  char link[64], path[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, path, sizeof path - 1);
  if (n <= 0 || std::string(path, static_cast<size_t>(n)) != bad_sector_file) return false;
  ++bad_sector_reads;
  return true;
}

// Half of `bytes`, a multiple of 4 KiB (as O_DIRECT needs); 0 below 8 KiB.
uint64_t Half(uint64_t bytes) { return bytes >= 8192 ? bytes / 2 / 4096 * 4096 : 0; }

bool Take(std::atomic<int>& faults) {
  int left = faults.load();
  while (left > 0 && !faults.compare_exchange_weak(left, left - 1)) {
  }
  return left > 0;
}

#if HPS_HAVE_LIBURING
// A read's buffer gets garbage where the read is not to land, so that a
// caller that takes a short or refused read as done reads that garbage.
void Scribble(const io_uring_sqe* sqe, uint64_t from, uint64_t to) {
  if (sqe->opcode == IORING_OP_READ) std::memset(reinterpret_cast<uint8_t*>(sqe->addr) + from, 0xee, to - from);
}

#endif
}  // namespace

#if HPS_HAVE_LIBURING
extern "C" int io_uring_submit(io_uring* ring) {
  static const auto real = reinterpret_cast<int (*)(io_uring*)>(dlsym(RTLD_NEXT, "io_uring_submit"));
  if (Take(submit_refusals)) return -submit_error.load();
  // The queued operations, not yet handed to the kernel: refused,
  // interrupted and failed ones become reads or writes of 0 bytes, whose
  // completions are rewritten below.
  std::vector<uint64_t> refused, interrupted, failed;
  for (unsigned i = ring->sq.sqe_head; i != ring->sq.sqe_tail; ++i) {
    io_uring_sqe* sqe = &ring->sq.sqes[i & ring->sq.ring_mask];
    if (sqe->opcode != IORING_OP_READ && sqe->opcode != IORING_OP_WRITE) continue;
    if (sqe->opcode == IORING_OP_READ && (OnBadSector(sqe->fd, sqe->off, sqe->len) || Take(failed_reads))) {
      Scribble(sqe, 0, sqe->len);
      sqe->len = 0;
      failed.push_back(sqe->user_data);
    } else if (std::atomic<int>& answer =  // both asked for: they take turns
                   interrupted_completions > again_completions ? interrupted_completions : again_completions;
               Take(answer)) {
      Scribble(sqe, 0, sqe->len);
      sqe->len = 0;
      (&answer == &again_completions ? refused : interrupted).push_back(sqe->user_data);
    } else if (Half(sqe->len) > 0 && Take(short_completions)) {
      const unsigned asked = sqe->len;
      sqe->len = static_cast<unsigned>(Half(asked));
      Scribble(sqe, sqe->len, asked);
    }
  }
  const int submitted = real(ring);
  // Each refused operation's completion (0 bytes moved) becomes -EAGAIN,
  // each interrupted one's -EINTR, each failed one's -EIO, before the caller
  // can see it; the completion ring is the caller's memory.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!refused.empty() || !interrupted.empty() || !failed.empty()) {
    const unsigned tail = __atomic_load_n(ring->cq.ktail, __ATOMIC_ACQUIRE);
    for (unsigned i = *ring->cq.khead; i != tail; ++i) {
      io_uring_cqe* cqe = &ring->cq.cqes[i & ring->cq.ring_mask];
      for (auto* list : {&refused, &interrupted, &failed}) {
        const auto it = std::find(list->begin(), list->end(), cqe->user_data);
        if (it == list->end()) continue;
        if (cqe->res == 0) cqe->res = list == &refused ? -EAGAIN : list == &interrupted ? -EINTR : -EIO;
        list->erase(it);
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "io_uring_submit: a refused operation never completed\n");
      std::abort();
    }
  }
  return submitted;
}
#endif

extern "C" ssize_t pread(int fd, void* data, size_t bytes, off_t offset) {
  if (Take(interrupted_calls)) {
    errno = EINTR;
    return -1;
  }
  if (OnBadSector(fd, static_cast<uint64_t>(offset), bytes) || Take(failed_reads)) {
    errno = EIO;
    return -1;
  }
  if (Half(bytes) > 0 && Take(short_calls)) bytes = Half(bytes);
  return syscall(SYS_pread64, fd, data, bytes, offset);
}

extern "C" ssize_t pwrite(int fd, const void* data, size_t bytes, off_t offset) {
  if (Take(interrupted_calls)) {
    errno = EINTR;
    return -1;
  }
  if (Half(bytes) > 0 && Take(short_calls)) bytes = Half(bytes);
  return syscall(SYS_pwrite64, fd, data, bytes, offset);
}

namespace hps {
namespace {

namespace fs = std::filesystem;

class SsdIoFaultTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test_support::FreshTestDir("hps-ssd-io-fault-test"); }
  void TearDown() override {
    submit_refusals = again_completions = interrupted_completions = short_completions = interrupted_calls =
        short_calls = failed_reads = 0;
    SetBadSector("", 0, 0);
    fs::remove_all(dir_);
  }

  // 1024 records a file: 16 KiB of rows, read whole by a get of all its keys.
  std::unique_ptr<SsdStore> Open(bool uring, double compaction_trigger = 100) const {
    SsdStoreOptions o;
    o.path = dir_;
    o.row_bytes = kRowBytes;
    o.file_records = 1024;
    o.background_compaction = false;
    o.compaction_trigger = compaction_trigger;
    o.use_io_uring = uring;
    return SsdStore::Open(o);
  }

  static bool OnUring(const SsdStore& store) { return store.stats().io_path.rfind("io_uring", 0) == 0; }

  // Row of `key`: its 8 bytes, then its bitwise complement.
  static std::vector<uint8_t> Rows(const std::vector<uint64_t>& keys) {
    std::vector<uint8_t> rows(keys.size() * kRowBytes);
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint64_t words[2] = {keys[i], ~keys[i]};
      std::memcpy(rows.data() + i * kRowBytes, words, sizeof words);
    }
    return rows;
  }

  static void Put(SsdStore& store, const std::vector<uint64_t>& keys) {
    store.Put(keys.data(), keys.size(), Rows(keys).data());
  }

  // Whether every key is found with its own row.
  static void ExpectRows(SsdStore& store, const std::vector<uint64_t>& keys) {
    std::vector<uint8_t> out(keys.size() * kRowBytes), found(keys.size());
    ASSERT_EQ(store.Get(keys.data(), keys.size(), out.data(), found.data()), keys.size());
    EXPECT_TRUE(out == Rows(keys)) << "rows read back differ from those put";
  }

  static std::vector<uint64_t> Range(uint64_t first, uint64_t end) {
    std::vector<uint64_t> keys(end - first);
    std::iota(keys.begin(), keys.end(), first);
    return keys;
  }

  static constexpr uint32_t kRowBytes = 16;
  std::string dir_;
};

// Each fault on a few of a put's writes (several files) and of a get's reads:
// every byte still moves, as a reopened store shows.
TEST_F(SsdIoFaultTest, IoUringCompletionsOfEagainOrCutShortAreAskedAgain) {
  const std::vector<uint64_t> keys = Range(1, 4097);  // four files
  {
    auto store = Open(true);
    if (!OnUring(*store)) GTEST_SKIP() << "no io_uring here";
    again_completions = 2;
    short_completions = 2;
    Put(*store, keys);
    EXPECT_EQ(again_completions + short_completions, 0) << "the put's writes took fewer faults than asked";
    store->Commit();
  }
  auto store = Open(true);
  again_completions = 2;
  short_completions = 2;
  ExpectRows(*store, keys);
  EXPECT_EQ(again_completions + short_completions, 0) << "the get's reads took fewer faults than asked";
}

// A submit the kernel refuses for now (-EAGAIN: short of memory; -EBUSY:
// completions waiting) is tried again, not raised as the get's or put's failure.
TEST_F(SsdIoFaultTest, IoUringSubmitRefusedForNowIsTriedAgain) {
  const std::vector<uint64_t> keys = Range(1, 2049);
  for (const int error : {EAGAIN, EBUSY}) {
    SCOPED_TRACE(std::strerror(error));
    fs::remove_all(dir_);
    {
      auto store = Open(true);
      if (!OnUring(*store)) GTEST_SKIP() << "no io_uring here";
      submit_error = error;
      submit_refusals = 3;
      Put(*store, keys);
      EXPECT_EQ(submit_refusals, 0);
      store->Commit();
    }
    auto store = Open(true);
    submit_refusals = 3;
    ExpectRows(*store, keys);
    EXPECT_EQ(submit_refusals, 0);
  }
}

// A refusal that does not pass fails the call naming the file, in bounded
// time (waiting for operations the kernel never took would hang); the
// operations left unsubmitted in that ring never reach a later call, whose
// buffers they do not point at: the next put and get, fault-free, are whole.
TEST_F(SsdIoFaultTest, IoUringSubmitRefusedForGoodFailsNamingTheFileAndLeavesNothingBehind) {
  auto store = Open(true);
  if (!OnUring(*store)) GTEST_SKIP() << "no io_uring here";
  const std::vector<uint64_t> keys = Range(1, 2049);
  Put(*store, keys);
  store->Commit();
  submit_error = EAGAIN;
  submit_refusals = 1 << 30;
  const auto start = std::chrono::steady_clock::now();
  std::vector<uint8_t> out(keys.size() * kRowBytes);
  try {
    store->Get(keys.data(), keys.size(), out.data(), nullptr);
    ADD_FAILURE() << "a get whose every submit was refused succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(dir_), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(".hpf: io_uring submit: "), std::string::npos) << e.what();
  }
  try {
    Put(*store, Range(3001, 3011));
    ADD_FAILURE() << "a put whose every submit was refused succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(".hpf: io_uring submit: "), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  submit_refusals = 0;
  ExpectRows(*store, keys);
  const std::vector<uint64_t> later = Range(5001, 6025);
  Put(*store, later);
  store->Commit();
  store.reset();
  store = Open(true);
  ExpectRows(*store, keys);
  ExpectRows(*store, later);
  EXPECT_EQ(store->size(), keys.size() + later.size()) << "the failed put left rows";
}

// A device that answers every read or write with -EAGAIN (or -EINTR: a
// signal that never stops coming) fails the call naming the file and where
// in it, after a bounded number of tries (asking for good would keep the
// thread spinning); once it answers again, the store works on, with nothing
// of the failed put in it. The two answers share one count: a device that
// gives them in turn fails so too.
TEST_F(SsdIoFaultTest, IoUringCompletionsOfEagainOrEintrForGoodFailNamingTheFileAndTheOffset) {
  // Enough for any bound a test can wait for, few enough that a loop with
  // none takes them all and lets the calls succeed (in a second or so).
  constexpr int kFaults = 200000;
  const auto inject = [&](int error) {  // 0: both, in turn
    again_completions = error == EINTR ? 0 : kFaults;
    interrupted_completions = error == EAGAIN ? 0 : kFaults;
  };
  const auto left = [] { return again_completions + interrupted_completions; };
  const auto names_the_answer = [](const std::string& what, int error) {
    return error != 0 ? what.find(std::strerror(error)) != std::string::npos
                      : what.find(std::strerror(EAGAIN)) != std::string::npos ||
                            what.find(std::strerror(EINTR)) != std::string::npos;
  };
  for (const int error : {EAGAIN, EINTR, 0}) {
    SCOPED_TRACE(error == 0 ? "EAGAIN and EINTR in turn" : std::strerror(error));
    fs::remove_all(dir_);
    auto store = Open(true);
    if (!OnUring(*store)) GTEST_SKIP() << "no io_uring here";
    const std::vector<uint64_t> keys = Range(1, 1025);  // one file
    Put(*store, keys);
    store->Commit();
    inject(error);
    std::vector<uint8_t> out(keys.size() * kRowBytes);
    try {
      store->Get(keys.data(), keys.size(), out.data(), nullptr);
      ADD_FAILURE() << "a get whose every read completed so succeeded";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find((fs::path(dir_) / "000000000001.hpf").string() + ": io_uring read at byte "),
                std::string::npos) << what;
      EXPECT_TRUE(names_the_answer(what, error)) << what;
    }
    EXPECT_GT(left(), 0) << "the get asked again as long as the faults lasted";
    inject(error);
    try {
      Put(*store, Range(3001, 3011));
      ADD_FAILURE() << "a put whose every write completed so succeeded";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(".hpf: io_uring write at byte "), std::string::npos) << what;
      EXPECT_TRUE(names_the_answer(what, error)) << what;
    }
    EXPECT_GT(left(), 0) << "the put asked again as long as the faults lasted";
    again_completions = interrupted_completions = 0;
    ExpectRows(*store, keys);
    store->Commit();
    store.reset();
    store = Open(true);
    ExpectRows(*store, keys);
    EXPECT_EQ(store->size(), keys.size()) << "the failed put left rows";
  }
}

// The pread path (io_uring not asked for): calls interrupted or cut short
// are asked again, for every write of a put (MANIFEST's too) and read of a get.
TEST_F(SsdIoFaultTest, PreadPathCallsInterruptedOrCutShortAreAskedAgain) {
  const std::vector<uint64_t> keys = Range(1, 4097);
  {
    auto store = Open(false);
    ASSERT_EQ(store->stats().io_path.rfind("pread", 0), 0u) << store->stats().io_path;
    interrupted_calls = 3;
    short_calls = 3;
    Put(*store, keys);
    store->Commit();
    EXPECT_EQ(interrupted_calls + short_calls, 0) << "the put's writes took fewer faults than asked";
  }
  auto store = Open(false);
  interrupted_calls = 3;
  short_calls = 3;
  ExpectRows(*store, keys);
  EXPECT_EQ(interrupted_calls + short_calls, 0) << "the get's reads took fewer faults than asked";
}

// A read the device fails (EIO: a bad sector, say) fails the get naming the
// file and where in it, on both paths: the offset is what finds the sector,
// and what tells one bad block from a dead drive.
TEST_F(SsdIoFaultTest, AReadTheDeviceFailsNamesTheFileAndTheOffset) {
  for (const bool uring : {true, false}) {
    SCOPED_TRACE(uring ? "io_uring" : "pread");
    fs::remove_all(dir_);
    auto store = Open(uring);
    if (uring && !OnUring(*store)) continue;  // the pread path still runs below
    Put(*store, Range(1, 1025));  // one file: slot = key - 1
    store->Commit();
    // Key 700's row, slot 699, lies in rows block 2: the region starts at
    // 16384 (header, 8 KiB of keys, one block of block CRCs), so at 24576.
    failed_reads = 1;
    const uint64_t key = 700;
    std::vector<uint8_t> out(kRowBytes);
    try {
      store->Get(&key, 1, out.data(), nullptr);
      ADD_FAILURE() << "a get whose read failed succeeded";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find((fs::path(dir_) / "000000000001.hpf").string() + ": "), std::string::npos) << what;
      EXPECT_NE(what.find("at byte 24576"), std::string::npos) << what;
      EXPECT_NE(what.find(std::strerror(EIO)), std::string::npos) << what;
    }
    EXPECT_EQ(failed_reads, 0);
    ExpectRows(*store, {key});  // the fault passed: the row reads
  }
}
// A compaction victim that the device fails to read at every try (a bad
// sector, in its rows or its keys) used to stop the run as IoError, and
// every later compaction chose the same file first and failed the same
// way: the stale records of every other file piled up behind it, and every
// commit raised. Now the file is read once more, then set aside as a
// damaged file is (left as it is, still in the store: its readable rows
// read, a get of an unreadable one raises IoError naming where), the run
// compacts the other victims without it, and the commit raises IoError
// naming the file and the offset once; later commits' compactions pass it
// over, and Compact() tries it again, which succeeds once the disk reads.
TEST_F(SsdIoFaultTest, ACompactionVictimThatCannotBeReadIsSetAsideAndTheOthersCompact) {
  // 1024 records of 16 bytes: the keys at [4096, 12288), the rows from
  // 16384, key k of file 1 at slot k - 1 (4 KiB blocks of 256 rows).
  const struct {
    const char* name;
    uint64_t begin, end;
  } regions[] = {{"rows block 0", 16384, 20480}, {"keys", 4096, 12288}};
  for (const bool uring : {false, true}) {
    for (const auto& region : regions) {
      SCOPED_TRACE(std::string(uring ? "io_uring, " : "pread, ") + region.name);
      fs::remove_all(dir_);
      const std::vector<uint64_t> a = Range(1, 1025), b = Range(2001, 3025), c = Range(4001, 5025);
      std::vector<uint64_t> most, a_left, bc_left;  // three quarters of each file, and the rest
      for (const auto* keys : {&a, &b, &c}) {
        for (uint64_t key : *keys) (key % 4 != 0 ? most : keys == &a ? a_left : bc_left).push_back(key);
      }
      {
        auto store = Open(uring);
        if (uring && !OnUring(*store)) break;  // the pread path ran already
        Put(*store, a);  // file 1
        Put(*store, b);  // 2
        Put(*store, c);  // 3
        store->Commit();
        Put(*store, most);  // files 4..6: files 1..3 three quarters stale
        store->Commit();
      }
      const std::string victim = (fs::path(dir_) / "000000000001.hpf").string();
      auto store = Open(uring, 1.5);  // 5376 records on disk for 3072 live: the next commit compacts
      SetBadSector(victim, region.begin, region.end);
      try {
        store->Commit();
        ADD_FAILURE() << "a compaction whose victim could not be read raised nothing";
      } catch (const IoError& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(victim + ": "), std::string::npos) << what;
        EXPECT_NE(what.find("at byte " + std::to_string(region.begin)), std::string::npos) << what;
        EXPECT_NE(what.find(std::strerror(EIO)), std::string::npos) << what;
      }
      EXPECT_GE(bad_sector_reads.load(), 2) << "read once more before it is set aside";
      SsdStoreStats s = store->stats();
      EXPECT_EQ(s.unreadable_files, 1u);
      EXPECT_EQ(s.corrupt_files, 0u);
      EXPECT_EQ(s.compactions, 1u) << "the other victims were compacted all the same: " << s.last_error;
      EXPECT_EQ(s.compacted_records, 512u) << "b's and c's live quarters";
      EXPECT_EQ(s.compaction_failures, 1u);
      EXPECT_TRUE(fs::exists(victim));
      EXPECT_EQ(store->size(), 3072u);
      ExpectRows(*store, bc_left);
      ExpectRows(*store, most);
      if (region.begin == 16384) {  // key 4's only copy lies on the bad sector: raises, and does not vanish
        const uint64_t key = 4;
        std::vector<uint8_t> out(kRowBytes);
        EXPECT_THROW(store->Get(&key, 1, out.data(), nullptr), IoError);
        ExpectRows(*store, std::vector<uint64_t>(a_left.begin() + 64, a_left.end()));  // its other blocks
      } else {
        ExpectRows(*store, a_left);  // gets read no keys
      }

      // Commits go on, and so do their compactions, without trying it again.
      bad_sector_reads = 0;
      EXPECT_NO_THROW(store->Commit());
      Put(*store, b);  // the output wholly stale, files 4..6 two thirds
      Put(*store, c);
      EXPECT_NO_THROW(store->Commit());
      s = store->stats();
      EXPECT_EQ(s.compactions, 2u);
      EXPECT_EQ(s.compaction_failures, 1u) << s.last_error;
      EXPECT_EQ(bad_sector_reads.load(), 0);
      EXPECT_TRUE(fs::exists(victim));

      // Once the disk reads it again, Compact() compacts it.
      SetBadSector("", 0, 0);
      EXPECT_NO_THROW(store->Compact());
      EXPECT_FALSE(fs::exists(victim));
      EXPECT_EQ(store->stats().unreadable_files, 0u);
      store->Commit();
      store.reset();
      store = Open(uring);
      ExpectRows(*store, a_left);
      ExpectRows(*store, b);
      ExpectRows(*store, c);
      ExpectRows(*store, most);
      EXPECT_EQ(store->size(), 3072u);
    }
  }
}

// A read of a victim that the device fails once (a fault that passes) is
// asked again: the compaction goes through, and sets nothing aside.
TEST_F(SsdIoFaultTest, ACompactionVictimReadThatFailsOnceIsReadAgain) {
  for (const bool uring : {false, true}) {
    SCOPED_TRACE(uring ? "io_uring" : "pread");
    fs::remove_all(dir_);
    auto store = Open(uring);
    if (uring && !OnUring(*store)) continue;
    const std::vector<uint64_t> keys = Range(1, 1025);
    Put(*store, keys);  // file 1
    store->Commit();
    Put(*store, Range(1, 769));  // file 1 three quarters stale
    store->Commit();
    failed_reads = 1;
    EXPECT_NO_THROW(store->Compact());
    EXPECT_EQ(failed_reads, 0);
    const SsdStoreStats s = store->stats();
    EXPECT_EQ(s.compactions, 1u);
    EXPECT_EQ(s.compaction_failures, 0u) << s.last_error;
    EXPECT_EQ(s.unreadable_files, 0u);
    EXPECT_FALSE(fs::exists(fs::path(dir_) / "000000000001.hpf"));
    ExpectRows(*store, keys);
  }
}

// Bound rewrites the live rows that stay in the stamp its cap cuts through.
// When the device failed to read some of them (a bad sector), Bound raised
// IoError and changed nothing, at every call (every checkpoint of a bounded
// table). Now, read once more and failing again, the cut is left undone and
// the file as it is, the older stamps bounded all the same (as for a
// corrupt block: ssd_store_test.cc); the next commit raises IoError naming
// the file and the offset, once.
TEST_F(SsdIoFaultTest, ABoundCuttingThroughABadSectorLeavesTheCutUndoneAndBoundsTheRest) {
  for (const bool uring : {false, true}) {
    SCOPED_TRACE(uring ? "io_uring" : "pread");
    fs::remove_all(dir_);
    auto store = Open(uring);
    if (uring && !OnUring(*store)) continue;
    store->SetStamp(1);
    Put(*store, Range(5001, 5257));  // file 1
    store->SetStamp(2);
    Put(*store, Range(1025, 2049));  // file 2: key k at slot k - 1025
    Put(*store, Range(1, 1025));     // file 3
    store->SetStamp(3);
    Put(*store, Range(3001, 4025));  // file 4
    store->Commit();
    const std::string file = (fs::path(dir_) / "000000000002.hpf").string();
    SetBadSector(file, 28672, 32768);  // rows block 3: keys 1793..2048
    // A cap of 1792 takes stamp 1 whole, then cuts stamp 2: 1..1280 would
    // go, 1281..2048 (blocks 1..3 of file 2) be rewritten.
    SsdBoundResult r;
    ASSERT_NO_THROW(r = store->Bound(0, 1792));
    EXPECT_EQ(r.capped, Range(5001, 5257));
    EXPECT_EQ(r.records_rewritten, 0u);
    EXPECT_GE(bad_sector_reads.load(), 2) << "read once more before the cut is left";
    EXPECT_EQ(store->size(), 3072u);
    ExpectRows(*store, Range(1, 1793));
    const uint64_t key = 2000;
    std::vector<uint8_t> out(kRowBytes);
    EXPECT_THROW(store->Get(&key, 1, out.data(), nullptr), IoError);
    try {
      store->Commit();
      ADD_FAILURE() << "a bound over a bad sector was never told";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(file + ": "), std::string::npos) << what;
      EXPECT_NE(what.find("at byte 20480"), std::string::npos) << what;  // the read of blocks 1..3
      EXPECT_NE(what.find(std::strerror(EIO)), std::string::npos) << what;
    }
    EXPECT_NO_THROW(store->Commit());
    EXPECT_EQ(store->stats().unreadable_files, 1u);
    EXPECT_EQ(store->stats().corrupt_files, 0u);
    SetBadSector("", 0, 0);
    store.reset();
    store = Open(uring);
    EXPECT_EQ(store->size(), 3072u);
    ExpectRows(*store, Range(1, 2049));
    ExpectRows(*store, Range(3001, 4025));
  }
}

}  // namespace
}  // namespace hps
