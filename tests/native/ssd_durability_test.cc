// SSD-PS's durability order, which no test that reopens a store in the same
// (or a killed) process can see: the page cache keeps a file that was never
// synced. A commit must make each new file's data durable (fdatasync), then
// their names (fsync of the directory), and only then the MANIFEST record
// that names them; a compaction must do the same for its outputs. Otherwise a
// power loss after the commit returns leaves a MANIFEST pointing at empty or
// missing files.
//
// This binary defines fdatasync, fsync, ftruncate, close, remove and unlink itself: the
// store's calls (it is linked in statically) come here, are logged with the
// path of their descriptor (or fail, where a test asks), and go on to the
// kernel.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "format/manifest.h"
#include "hps/ssd_store.h"
#include "store/ssd_store_testing.h"
#include "temp_dir.h"

namespace {

struct SyncCall {
  bool data_only;    // fdatasync, not fsync
  std::string path;  // what the descriptor names
};

std::mutex sync_log_mutex;
std::vector<SyncCall> sync_log;  // guarded by sync_log_mutex
// Faults a test injects: the next fdatasync or ftruncate fails with EIO.
std::atomic<bool> fail_next_fdatasync{false}, fail_next_ftruncate{false};
// The next fdatasync of a path ending so fails with sync_error.
std::mutex sync_fault_mutex;
std::string fail_sync_of;  // guarded by sync_fault_mutex
int sync_error = EIO;      // guarded by sync_fault_mutex
int sync_fault_skips = 0;  // guarded by sync_fault_mutex: matching syncs let through first
// The file's contents when its sync failed: what a crash right then may
// leave on disk (the kernel may have written them before reporting).
std::string contents_at_failed_sync;  // guarded by sync_fault_mutex
// The next fsync of a path ending so fails with EIO.
std::string fail_fsync_of;  // guarded by sync_fault_mutex
int fsync_fault_skips = 0;  // guarded by sync_fault_mutex: matching fsyncs let through first
// Holds the first fdatasync of a path ending so, once armed, until the test
// opens it: a thread of the store stops there while the test does something
// else, and the test learns that it got there.
class SyncGate {
 public:
  void Arm(const std::string& path_end) {
    std::lock_guard lock(mutex_);
    path_end_ = path_end;
    entered_ = open_ = false;
  }
  void PassIfArmed(const std::string& path) {
    std::unique_lock lock(mutex_);
    if (path_end_.empty() || entered_ || path.size() < path_end_.size() ||
        path.compare(path.size() - path_end_.size(), path_end_.size(), path_end_) != 0) {
      return;
    }
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return open_; });
  }
  // Whether a sync waits there (or passed), after waiting up to `wait` for one.
  bool Entered(std::chrono::milliseconds wait) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, wait, [this] { return entered_; });
  }
  void Open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    path_end_.clear();
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::string path_end_;  // "": not armed
  bool entered_ = false, open_ = false;
};
SyncGate first_gate, second_gate;

// The next close of a descriptor open for writing fails with EIO, as NFS
// reports a write-back that failed; the descriptor is closed all the same.
std::atomic<bool> fail_next_write_close{false};

std::string PathOf(int fd) {
  char link[64], target[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof target - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : "?";
}

void LogSync(int fd, bool data_only) {
  std::string path = PathOf(fd);
  std::lock_guard lock(sync_log_mutex);
  sync_log.push_back({data_only, std::move(path)});
}

}  // namespace

bool EndsWith(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

// Whether this fdatasync of `path` is to fail, and with what.
int SyncFault(const std::string& path) {
  std::lock_guard lock(sync_fault_mutex);
  if (fail_sync_of.empty() || !EndsWith(path, fail_sync_of)) return 0;
  if (sync_fault_skips > 0) {
    --sync_fault_skips;
    return 0;
  }
  fail_sync_of.clear();
  std::ifstream in(path, std::ios::binary);
  contents_at_failed_sync.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return sync_error;
}

// At the next fdatasync of a path ending in crash_image_at, the directory
// crash_image_of is copied to crash_image_dir: what a crash right then may
// leave (the sync itself not yet done).
std::string crash_image_at, crash_image_of, crash_image_dir;  // guarded by sync_fault_mutex

void TakeCrashImage(const std::string& path) {
  std::lock_guard lock(sync_fault_mutex);
  if (crash_image_at.empty() || !EndsWith(path, crash_image_at)) return;
  crash_image_at.clear();
  std::filesystem::copy(crash_image_of, crash_image_dir, std::filesystem::copy_options::recursive);
}

extern "C" int fdatasync(int fd) {
  LogSync(fd, true);
  TakeCrashImage(PathOf(fd));
  first_gate.PassIfArmed(PathOf(fd));
  second_gate.PassIfArmed(PathOf(fd));
  if (fail_next_fdatasync.exchange(false)) {
    errno = EIO;
    return -1;
  }
  if (const int error = SyncFault(PathOf(fd))) {
    errno = error;
    return -1;
  }
  return static_cast<int>(syscall(SYS_fdatasync, fd));
}

extern "C" int ftruncate(int fd, off_t length) noexcept {
  if (fail_next_ftruncate.exchange(false)) {
    errno = EIO;
    return -1;
  }
  return static_cast<int>(syscall(SYS_ftruncate, fd, length));
}

extern "C" int close(int fd) {
  const bool writing = fd >= 0 && (fcntl(fd, F_GETFL) & O_ACCMODE) == O_WRONLY;
  const int rc = static_cast<int>(syscall(SYS_close, fd));
  if (rc == 0 && writing && fail_next_write_close.exchange(false)) {
    errno = EIO;
    return -1;
  }
  return rc;
}

extern "C" int fsync(int fd) {
  LogSync(fd, false);
  {
    std::lock_guard lock(sync_fault_mutex);
    if (!fail_fsync_of.empty() && EndsWith(PathOf(fd), fail_fsync_of)) {
      if (fsync_fault_skips > 0) {
        --fsync_fault_skips;
      } else {
        fail_fsync_of.clear();
        errno = EIO;
        return -1;
      }
    }
  }
  return static_cast<int>(syscall(SYS_fsync, fd));
}

// The next removal (remove or unlink) of a path ending so fails with EIO.
std::string fail_removal_of;  // guarded by sync_fault_mutex

bool RemovalFails(const char* path) {
  std::lock_guard lock(sync_fault_mutex);
  if (fail_removal_of.empty() || !EndsWith(path, fail_removal_of)) return false;
  fail_removal_of.clear();
  return true;
}

extern "C" int remove(const char* path) noexcept {
  static const auto real = reinterpret_cast<int (*)(const char*)>(dlsym(RTLD_NEXT, "remove"));
  if (RemovalFails(path)) {
    errno = EIO;
    return -1;
  }
  return real(path);
}

extern "C" int unlink(const char* path) noexcept {
  static const auto real = reinterpret_cast<int (*)(const char*)>(dlsym(RTLD_NEXT, "unlink"));
  if (RemovalFails(path)) {
    errno = EIO;
    return -1;
  }
  return real(path);
}

// Descriptors of this process open on paths ending so.
int OpenDescriptorsOf(const std::string& end) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const auto target = std::filesystem::read_symlink(entry.path(), error);
    if (!error && EndsWith(target.string(), end)) ++count;
  }
  return count;
}

namespace hps {
namespace {

namespace fs = std::filesystem;

class SsdDurabilityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::weakly_canonical(test_support::FreshTestDir("hps-ssd-durability-test")).string();
  }
  void TearDown() override {
    detail::ssd_store_test_seams = {};
    first_gate.Open();
    second_gate.Open();
    fail_next_write_close = false;
    FailNextSyncOf("", EIO);
    {
      std::lock_guard lock(sync_fault_mutex);
      fail_fsync_of.clear();
      fsync_fault_skips = 0;
      fail_removal_of.clear();
      crash_image_at.clear();
    }
    fs::remove_all(dir_);
    fs::remove_all(dir_ + "-crash");
  }

  std::unique_ptr<SsdStore> Open() const {
    SsdStoreOptions o;
    o.path = dir_;
    o.row_bytes = kRowBytes;
    o.file_records = 4;
    o.background_compaction = false;
    o.compaction_trigger = 100;  // compactions only where a test asks for one
    return SsdStore::Open(o);
  }

  static void Put(SsdStore& store, uint64_t first, uint64_t end) {
    std::vector<uint64_t> keys(end - first);
    std::iota(keys.begin(), keys.end(), first);
    const std::vector<uint8_t> rows(keys.size() * kRowBytes, 7);
    store.Put(keys.data(), keys.size(), rows.data());
  }

  // Three files of keys 1..4, 5..8, 9..12, committed, then the first two three
  // quarters stale (keys 2..4 and 6..8 written again), committed: what a
  // compaction has to work on.
  static void CommitTwoFilesMostlyStale(SsdStore& store) {
    Put(store, 1, 13);
    store.Commit();
    Put(store, 2, 5);
    Put(store, 6, 9);
    store.Commit();
  }

  // How many of the keys [first, end) the store finds, each with the row Put gave it.
  static uint64_t Found(SsdStore& store, uint64_t first, uint64_t end) {
    std::vector<uint64_t> keys(end - first);
    std::iota(keys.begin(), keys.end(), first);
    std::vector<uint8_t> rows(keys.size() * kRowBytes), found(keys.size());
    const uint64_t hits = store.Get(keys.data(), keys.size(), rows.data(), found.data());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (found[i]) {
        EXPECT_EQ(rows[i * kRowBytes], 7) << "key " << keys[i];
      }
    }
    return hits;
  }

  static void FailNextSyncOf(const std::string& path_end, int error, int skips = 0) {
    std::lock_guard lock(sync_fault_mutex);
    fail_sync_of = path_end;
    sync_error = error;
    sync_fault_skips = skips;
  }

  // The parameter files in the store's directory, by path.
  std::vector<std::string> Files() const {
    std::vector<std::string> paths;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      if (entry.path().extension() == ".hpf") paths.push_back(entry.path().string());
    }
    std::sort(paths.begin(), paths.end());
    return paths;
  }

  // The next fsync of a path ending in path_end, after `skips` of them, fails with EIO.
  static void FailNextFsyncOf(const std::string& path_end, int skips) {
    std::lock_guard lock(sync_fault_mutex);
    fail_fsync_of = path_end;
    fsync_fault_skips = skips;
  }
  static bool FsyncFaultTaken() {
    std::lock_guard lock(sync_fault_mutex);
    return fail_fsync_of.empty();
  }

  static std::vector<SyncCall> TakeSyncLog() {
    std::lock_guard lock(sync_log_mutex);
    return std::exchange(sync_log, {});
  }

  // Checks that in `log` each of `files` has an fdatasync, then the
  // directory an fsync, then MANIFEST an fdatasync, in that order.
  void ExpectSyncedBeforeTheManifest(const std::vector<SyncCall>& log, const std::vector<std::string>& files) const {
    const std::string manifest = (fs::path(dir_) / "MANIFEST").string();
    auto last = [&](const std::string& path, bool data_only, size_t before) -> ptrdiff_t {
      for (size_t i = std::min(before, log.size()); i-- > 0;) {
        if (log[i].path == path && log[i].data_only == data_only) return static_cast<ptrdiff_t>(i);
      }
      return -1;
    };
    const ptrdiff_t manifest_sync = last(manifest, true, log.size());
    ASSERT_GE(manifest_sync, 0) << "no fdatasync of " << manifest;
    const ptrdiff_t dir_sync = last(dir_, false, static_cast<size_t>(manifest_sync));
    ASSERT_GE(dir_sync, 0) << "no fsync of " << dir_ << " before the fdatasync of " << manifest;
    for (const std::string& file : files) {
      EXPECT_GE(last(file, true, static_cast<size_t>(dir_sync)), 0)
          << "no fdatasync of " << file << " before the fsync of its directory and " << manifest;
    }
  }

  static constexpr uint32_t kRowBytes = 16;
  std::string dir_;
};

TEST_F(SsdDurabilityTest, CommitSyncsTheNewFilesThenTheirNamesThenTheManifest) {
  auto store = Open();
  Put(*store, 1, 11);  // three files
  const std::vector<std::string> written = Files();
  ASSERT_EQ(written.size(), 3u);
  TakeSyncLog();
  store->Commit();
  ExpectSyncedBeforeTheManifest(TakeSyncLog(), written);
}

TEST_F(SsdDurabilityTest, CompactionSyncsItsOutputsThenTheirNamesThenTheManifest) {
  auto store = Open();
  CommitTwoFilesMostlyStale(*store);
  const std::vector<std::string> before = Files();
  TakeSyncLog();
  store->Compact();
  const std::vector<SyncCall> log = TakeSyncLog();
  std::vector<std::string> outputs;
  for (const std::string& file : Files()) {
    if (!std::binary_search(before.begin(), before.end(), file)) outputs.push_back(file);
  }
  ASSERT_EQ(outputs.size(), 1u) << "keys 1 and 5, out of the two stale files, into one";
  ASSERT_EQ(store->stats().compactions, 1u);
  ExpectSyncedBeforeTheManifest(log, outputs);
}

// Once its manifest record is synced, a compaction has taken effect for
// good: the names of its outputs were synced before that record, and the
// directory sync after it makes only the victims' removal durable (a crash
// that undoes it leaves strays that open removes). So a failure of that last
// sync is no failure of the compaction: it counts as done, nothing raises,
// and the next commit syncs the directory again.
TEST_F(SsdDurabilityTest, ACompactionThatCommittedStandsThoughTheSyncOfItsVictimsRemovalFails) {
  auto store = Open();
  CommitTwoFilesMostlyStale(*store);
  // Compact's own commit, then the outputs' names, go through; the third
  // fsync of the directory, after the victims' removal, fails.
  FailNextFsyncOf(dir_, 2);
  EXPECT_NO_THROW(store->Compact());
  ASSERT_TRUE(FsyncFaultTaken()) << "the compaction synced the directory fewer than three times";
  SsdStoreStats s = store->stats();
  EXPECT_EQ(s.compactions, 1u);
  EXPECT_EQ(s.compaction_failures, 0u) << s.last_error;
  EXPECT_EQ(s.last_error, "");
  EXPECT_EQ(s.cleanup_failures, 1u) << "the failed sync is counted";
  EXPECT_EQ(s.files, 4u) << "of five files, two victims out and one output in";
  EXPECT_EQ(Files().size(), 4u) << "the victims are removed";
  EXPECT_EQ(Found(*store, 1, 13), 12u);
  TakeSyncLog();
  EXPECT_NO_THROW(store->Commit());
  const std::vector<SyncCall> log = TakeSyncLog();
  EXPECT_TRUE(std::any_of(log.begin(), log.end(), [&](const SyncCall& c) { return !c.data_only && c.path == dir_; }))
      << "the next commit did not sync the directory again";
  store.reset();
  store = Open();
  EXPECT_EQ(store->stats().files, 4u);
  EXPECT_EQ(Found(*store, 1, 13), 12u);
}

// The same for the files a Bound dropped: the commit that drops them from
// the manifest stands though the sync of their removal fails.
TEST_F(SsdDurabilityTest, ACommitOfBoundsDropsStandsThoughTheSyncOfTheirRemovalFails) {
  auto store = Open();
  store->SetStamp(1);
  Put(*store, 1, 5);
  store->SetStamp(2);
  Put(*store, 5, 9);
  store->Commit();
  const SsdBoundResult bounded = store->Bound(/*min_stamp=*/2, /*max_live=*/0);
  ASSERT_EQ(bounded.files_dropped, 1u);
  // The commit's sync of the directory before its record goes through; the
  // one after the removal fails.
  FailNextFsyncOf(dir_, 1);
  EXPECT_NO_THROW(store->Commit());
  ASSERT_TRUE(FsyncFaultTaken()) << "the commit synced the directory fewer than twice";
  EXPECT_EQ(store->stats().cleanup_failures, 1u) << "the failed sync is counted";
  EXPECT_EQ(Files().size(), 1u);
  EXPECT_NO_THROW(store->Commit()) << "the next commit drops nothing again";
  store.reset();
  store = Open();
  EXPECT_EQ(Found(*store, 1, 5), 0u);
  EXPECT_EQ(Found(*store, 5, 9), 4u);
}

// A put takes the record ids of all its files at once. Before, it took each
// file's as it indexed that file, so a compaction taking the last ids for its
// outputs between two of them failed the put halfway: its first file in the
// index, the rest not. Now the put takes them in the lock section where it
// checks there are enough: a compaction that took ids first fails the put
// whole, changing nothing, and one that comes after finds none left and fails
// before its commit, changing nothing either. The test runs a store of
// four files' ids to that point: the compaction, stopped at its output's
// fdatasync before taking an id, goes on while the put is between its two
// files, and the test waits there until the compaction has taken its id
// (it is then at its manifest's fdatasync) or failed.
TEST_F(SsdDurabilityTest, APutTakesTheRecordIdsOfAllItsFilesBeforeACompactionCanTakeThem) {
  detail::ssd_store_test_seams.max_files = 4;
  auto store = Open();
  Put(*store, 1, 5);  // file 1
  store->Commit();
  Put(*store, 2, 5);  // file 2: file 1 three quarters stale
  store->Commit();
  // Compact's output is file 3 (reserved when it plans); the put's are 4 and 5.
  first_gate.Arm("/000000000003.hpf");
  std::atomic<bool> compaction_returned{false};
  std::string compaction_error;
  std::thread compaction([&] {
    try {
      store->Compact();
    } catch (const IoError& e) {
      compaction_error = e.what();
    }
    compaction_returned = true;
  });
  ASSERT_TRUE(first_gate.Entered(std::chrono::seconds(20))) << "the compaction never synced its output";
  second_gate.Arm("/MANIFEST");
  bool compaction_went_on = false;
  detail::ssd_store_test_seams.put_between_files = [&] {
    first_gate.Open();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!compaction_returned && !second_gate.Entered(std::chrono::milliseconds(10))) {
      if (std::chrono::steady_clock::now() > deadline) return;
    }
    compaction_went_on = true;
  };
  EXPECT_NO_THROW(Put(*store, 101, 109));  // two files
  detail::ssd_store_test_seams.put_between_files = nullptr;
  second_gate.Open();
  compaction.join();
  ASSERT_TRUE(compaction_went_on) << "the compaction neither committed nor failed while the put was between files";
  EXPECT_NE(compaction_error.find("files live; raise file_records"), std::string::npos) << compaction_error;
  EXPECT_EQ(store->stats().compaction_failures, 1u);
  EXPECT_EQ(Found(*store, 1, 5), 4u);
  EXPECT_EQ(Found(*store, 101, 109), 8u);
  store->Commit();
  store.reset();
  store = Open();
  EXPECT_EQ(Found(*store, 1, 5), 4u);
  EXPECT_EQ(Found(*store, 101, 109), 8u);
  EXPECT_EQ(store->stats().files, 4u);
}

// A put that fails (here: its two files would need more record ids than the
// store has) removes the files it wrote. When a removal fails too, the put's
// own error still surfaces: the filesystem_error of a throwing removal took
// its place, and the caller learnt only that a file could not be removed.
// The other file is still removed; the one left is a stray that open removes.
TEST_F(SsdDurabilityTest, APutWhoseCleanupFailsTooRaisesItsOwnError) {
  detail::ssd_store_test_seams.max_files = 1;
  auto store = Open();
  {
    std::lock_guard lock(sync_fault_mutex);
    fail_removal_of = "/000000000001.hpf";
  }
  try {
    Put(*store, 1, 9);  // two files: 1 and 2
    ADD_FAILURE() << "a put of more files than record ids succeeded";
  } catch (const std::exception& e) {
    EXPECT_EQ(dynamic_cast<const fs::filesystem_error*>(&e), nullptr) << "the cleanup's error surfaced: " << e.what();
    EXPECT_NE(std::string(e.what()).find("files would be live; raise file_records"), std::string::npos) << e.what();
  }
  {
    std::lock_guard lock(sync_fault_mutex);
    EXPECT_TRUE(fail_removal_of.empty()) << "the put removed no file";
  }
  EXPECT_EQ(store->stats().cleanup_failures, 1u);
  EXPECT_EQ(Files(), std::vector<std::string>{dir_ + "/000000000001.hpf"});
  EXPECT_EQ(Found(*store, 1, 9), 0u);
  store.reset();
  detail::ssd_store_test_seams.max_files = 0;
  store = Open();
  EXPECT_TRUE(Files().empty()) << "open left the stray";
  EXPECT_EQ(Found(*store, 1, 9), 0u);
}

// Open removes the files MANIFEST does not list (here an uncommitted put's).
// One whose removal fails (EIO, EACCES) failed the open of a sound store with
// the throwing removal's filesystem_error. Nothing reads it (its sequence is
// not given again), so the open goes on, counts it, and the next open removes it.
TEST_F(SsdDurabilityTest, AStrayWhoseRemovalFailsAtOpenFailsNothingAndTheNextOpenRemovesIt) {
  auto store = Open();
  Put(*store, 1, 9);  // files 1 and 2
  store->Commit();
  Put(*store, 9, 13);  // file 3, never committed
  store.reset();
  {
    std::lock_guard lock(sync_fault_mutex);
    fail_removal_of = "/000000000003.hpf";
  }
  try {
    store = Open();
  } catch (const std::exception& e) {
    FAIL() << "the open failed: " << e.what();
  }
  {
    std::lock_guard lock(sync_fault_mutex);
    EXPECT_TRUE(fail_removal_of.empty()) << "open did not try to remove the stray";
  }
  EXPECT_EQ(store->stats().cleanup_failures, 1u);
  EXPECT_EQ(Files(), (std::vector<std::string>{dir_ + "/000000000001.hpf", dir_ + "/000000000002.hpf",
                                               dir_ + "/000000000003.hpf"}));
  EXPECT_EQ(Found(*store, 1, 9), 8u);
  EXPECT_EQ(Found(*store, 9, 13), 0u);
  Put(*store, 20, 24);  // a new sequence, not the stray's
  store->Commit();
  store.reset();
  store = Open();
  EXPECT_EQ(store->stats().cleanup_failures, 0u);
  EXPECT_EQ(Files(), (std::vector<std::string>{dir_ + "/000000000001.hpf", dir_ + "/000000000002.hpf",
                                               dir_ + "/000000000004.hpf"}));
  EXPECT_EQ(Found(*store, 1, 9), 8u);
  EXPECT_EQ(Found(*store, 9, 13), 0u);
  EXPECT_EQ(Found(*store, 20, 24), 4u);
}

// A MANIFEST.tmp that a roll cut short left behind is never read; a failure
// to remove it at open went unreported. It fails nothing, is counted, and
// the next open removes it.
TEST_F(SsdDurabilityTest, ALeftoverManifestTmpWhoseRemovalFailsIsCountedAndRemovedByTheNextOpen) {
  auto store = Open();
  Put(*store, 1, 9);
  store->Commit();
  store.reset();
  std::ofstream(dir_ + "/MANIFEST.tmp") << "a roll cut short";
  {
    std::lock_guard lock(sync_fault_mutex);
    fail_removal_of = "/MANIFEST.tmp";
  }
  store = Open();
  {
    std::lock_guard lock(sync_fault_mutex);
    EXPECT_TRUE(fail_removal_of.empty()) << "open did not try to remove MANIFEST.tmp";
  }
  EXPECT_EQ(store->stats().cleanup_failures, 1u);
  EXPECT_TRUE(fs::exists(dir_ + "/MANIFEST.tmp"));
  EXPECT_EQ(Found(*store, 1, 9), 8u);
  store.reset();
  store = Open();
  EXPECT_EQ(store->stats().cleanup_failures, 0u);
  EXPECT_FALSE(fs::exists(dir_ + "/MANIFEST.tmp"));
  EXPECT_EQ(Found(*store, 1, 9), 8u);
}

// A MANIFEST roll writes the last commit's state to MANIFEST.tmp, syncs it
// and renames it over the log. A crash before the rename leaves the old log
// and the unsynced MANIFEST.tmp: the store reopens to the last commit, and
// the leftover goes.
TEST_F(SsdDurabilityTest, ACrashBeforeAManifestRollsRenameReopensToTheLastCommit) {
  detail::ssd_store_test_seams.manifest_roll_floor_bytes = 256;
  std::string image = dir_ + "-crash";
  {
    std::lock_guard lock(sync_fault_mutex);
    crash_image_at = "/MANIFEST.tmp";
    crash_image_of = dir_;
    crash_image_dir = image;
  }
  auto store = Open();
  Put(*store, 1, 9);  // two files
  store->Commit();
  while (store->stats().commits < 200 && store->stats().manifest_rolls == 0) store->Commit();
  ASSERT_EQ(store->stats().manifest_rolls, 1u) << "no roll after 200 commits";
  const uint64_t commits = store->stats().commits;
  {
    std::lock_guard lock(sync_fault_mutex);
    ASSERT_TRUE(crash_image_at.empty()) << "the roll synced no MANIFEST.tmp";
  }
  store.reset();
  ASSERT_TRUE(fs::exists(image + "/MANIFEST.tmp"));
  detail::ssd_store_test_seams = {};
  dir_.swap(image);
  auto crashed = Open();
  dir_.swap(image);
  EXPECT_EQ(crashed->stats().commits, commits);
  EXPECT_EQ(Found(*crashed, 1, 9), 8u);
  EXPECT_FALSE(fs::exists(image + "/MANIFEST.tmp"));
}

// A roll that fails (here its MANIFEST.tmp's sync) fails nothing: the commit
// stands in the log as it was, the failure is counted, MANIFEST.tmp goes, and
// a later commit rolls.
TEST_F(SsdDurabilityTest, AFailedManifestRollLeavesTheCommitStandingAndIsRetried) {
  detail::ssd_store_test_seams.manifest_roll_floor_bytes = 256;
  FailNextSyncOf("/MANIFEST.tmp", EIO);
  auto store = Open();
  Put(*store, 1, 9);  // two files
  store->Commit();
  while (store->stats().commits < 200 && store->stats().manifest_roll_failures == 0) {
    ASSERT_NO_THROW(store->Commit());
  }
  ASSERT_EQ(store->stats().manifest_roll_failures, 1u) << "no roll after 200 commits";
  EXPECT_EQ(store->stats().manifest_rolls, 0u);
  EXPECT_FALSE(fs::exists(dir_ + "/MANIFEST.tmp"));
  Put(*store, 9, 13);
  store->Commit();
  while (store->stats().commits < 400 && store->stats().manifest_rolls == 0) store->Commit();
  EXPECT_EQ(store->stats().manifest_rolls, 1u);
  EXPECT_EQ(store->stats().manifest_roll_failures, 1u);
  const uint64_t commits = store->stats().commits;
  store.reset();
  store = Open();
  EXPECT_EQ(store->stats().commits, commits);
  EXPECT_EQ(Found(*store, 1, 13), 12u);
}

// A commit whose sync fails leaves its append in the log; the writer cuts it
// off, and when that cut fails too, the next commit cuts it before its own
// append. Otherwise that append, written at the end of the last commit and
// shorter than the failed one, leaves the failed one's later records (sound,
// commit record included) after it: replay then refuses the whole log.
TEST_F(SsdDurabilityTest, AFailedCommitThatCouldNotBeCutIsCutByTheNext) {
  fs::create_directories(dir_);
  const std::string path = (fs::path(dir_) / "MANIFEST").string();
  detail::ManifestWriter w(path, {});
  w.AddFile(1, 10);
  w.Commit();
  w.AddFile(2, 20);
  w.AddFile(3, 30);
  fail_next_fdatasync = true;
  fail_next_ftruncate = true;
  EXPECT_THROW(w.Commit(), IoError);
  EXPECT_FALSE(fail_next_fdatasync || fail_next_ftruncate) << "the commit did not sync and cut as expected";
  w.Commit();  // nothing of the failed one stands: no edits
  const detail::ManifestReplay r = detail::ReplayManifest(path);
  EXPECT_EQ(r.state.live_files, (std::map<uint64_t, uint64_t>{{1, 10}}));
  EXPECT_EQ(r.state.commits, 2u);
  EXPECT_EQ(r.ignored_bytes, 0u);
}

// A parameter file whose close fails (NFS reports a failed write-back
// there) was not written: the put fails naming it, removes it and leaves the
// store as it was, committed rows and all.
TEST_F(SsdDurabilityTest, APutWhoseFileFailsToCloseFailsNamingItAndChangesNothing) {
  auto store = Open();
  Put(*store, 1, 5);
  store->Commit();
  const std::vector<std::string> before = Files();
  fail_next_write_close = true;
  try {
    Put(*store, 5, 9);
    ADD_FAILURE() << "a put whose file failed to close succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(dir_ + "/"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(".hpf: close: " + std::string(std::strerror(EIO))), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fail_next_write_close) << "no file was closed after writing";
  EXPECT_EQ(Files(), before);
  EXPECT_EQ(Found(*store, 1, 9), 4u);
  store->Commit();
  store.reset();
  store = Open();
  EXPECT_EQ(Found(*store, 1, 9), 4u);
  EXPECT_EQ(Found(*store, 1, 5), 4u);
}

// A commit whose MANIFEST sync fails (a full disk) fails naming MANIFEST and
// commits nothing: a reopen finds the last commit's rows only; the puts stay
// in the open store, and the next commit makes them durable.
TEST_F(SsdDurabilityTest, ACommitWhoseManifestSyncFailsNamesItAndCommitsNothing) {
  for (const bool retry : {false, true}) {
    SCOPED_TRACE(retry ? "committed again" : "reopened");
    fs::remove_all(dir_);
    auto store = Open();
    Put(*store, 1, 5);
    store->Commit();
    Put(*store, 5, 9);
    FailNextSyncOf("/MANIFEST", ENOSPC);
    try {
      store->Commit();
      ADD_FAILURE() << "a commit whose MANIFEST sync failed succeeded";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(dir_ + "/MANIFEST: sync commit: " + std::strerror(ENOSPC)),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(Found(*store, 1, 9), 8u);
    if (retry) store->Commit();
    store.reset();
    store = Open();
    EXPECT_EQ(Found(*store, 1, 5), 4u);
    EXPECT_EQ(Found(*store, 5, 9), retry ? 4u : 0u);
  }
}

// A compaction whose MANIFEST sync fails cannot tell whether its commit is
// on disk: the kernel may have written the append before reporting the
// error, and a crash then keeps it (the writer's cut is not synced). So it
// keeps its new files, which an open that finds them unlisted removes.
// Deleting them left such a store refusing to open, an output "listed as
// live in MANIFEST but missing", with its victims deleted by that open.
TEST_F(SsdDurabilityTest, ACompactionWhoseManifestSyncFailsKeepsItsOutputs) {
  {
    auto store = Open();
    CommitTwoFilesMostlyStale(*store);
    FailNextSyncOf("/MANIFEST", EIO, /*skips=*/1);  // Compact's own commit first, then the chunk's
    try {
      store->Compact();
      ADD_FAILURE() << "a compaction whose manifest failed to sync succeeded";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("MANIFEST: sync commit"), std::string::npos) << e.what();
    }
    EXPECT_EQ(store->stats().compactions, 0u);
    EXPECT_EQ(Found(*store, 1, 13), 12u);
  }
  std::string at_crash;
  {
    std::lock_guard lock(sync_fault_mutex);
    at_crash = contents_at_failed_sync;
  }
  // A crash as the sync failed, with the append on disk after all.
  const fs::path manifest = fs::path(dir_) / "MANIFEST";
  ASSERT_GT(at_crash.size(), fs::file_size(manifest)) << "the failed append was not cut off";
  std::ofstream(manifest, std::ios::binary | std::ios::trunc) << at_crash;
  auto store = Open();
  EXPECT_EQ(Found(*store, 1, 13), 12u);
  EXPECT_EQ(store->stats().files, 4u) << "the output, the third file and the two puts'";
}

// After a failed fdatasync the kernel has dropped the error with the dirty
// pages (marked clean, never written): a second fdatasync of the file
// succeeds though its data never reached the disk. So a commit whose file
// failed to sync must not be retried into one that names the file: every
// later commit fails, naming it, and a reopen (back to the last commit)
// finds no row of it.
TEST_F(SsdDurabilityTest, AFileThatFailedToSyncIsNeverCommitted) {
  auto store = Open();
  Put(*store, 1, 5);
  store->Commit();
  Put(*store, 5, 9);
  const std::vector<std::string> files = Files();
  ASSERT_EQ(files.size(), 2u);
  const std::string unsynced = files.back();
  FailNextSyncOf(unsynced, EIO);
  for (int attempt = 0; attempt < 2; ++attempt) {
    SCOPED_TRACE(attempt == 0 ? "the commit whose sync failed" : "the next commit");
    try {
      store->Commit();
      ADD_FAILURE() << "committed " << unsynced << ", whose sync failed";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(unsynced + ": sync: " + std::strerror(EIO)), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(Found(*store, 1, 9), 8u) << "the open store still serves its puts";
  store.reset();
  store = Open();
  EXPECT_EQ(Found(*store, 1, 5), 4u);
  EXPECT_EQ(Found(*store, 5, 9), 0u);
}

// A new store's directory, and each missing parent that open creates, is an
// entry in the directory above it, which an fsync of the new directory itself
// does not make durable (fsync(2)): a power loss after a commit returned could
// take the whole store with it. Open syncs each directory it added an entry to.
TEST_F(SsdDurabilityTest, ANewStoresDirectoriesAreSyncedIntoTheirParents) {
  const fs::path root(dir_);
  SsdStoreOptions o;
  o.path = (root / "a" / "store").string();
  o.row_bytes = kRowBytes;
  o.background_compaction = false;
  TakeSyncLog();
  auto store = SsdStore::Open(o);
  Put(*store, 1, 3);
  store->Commit();
  const std::vector<SyncCall> log = TakeSyncLog();
  for (const fs::path& parent : {root.parent_path(), root, root / "a"}) {
    EXPECT_TRUE(std::any_of(log.begin(), log.end(),
                            [&](const SyncCall& c) { return !c.data_only && c.path == parent.string(); }))
        << "no fsync of " << parent << ", where open created " << o.path << " or a parent of it";
  }
}

// A new store whose marker fails to sync is refused naming the marker, and
// leaves no descriptor open on it (each failed open leaked one).
TEST_F(SsdDurabilityTest, ANewStoreWhoseMarkerFailsToSyncIsRefusedAndLeaksNoDescriptor) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    {
      std::lock_guard lock(sync_fault_mutex);
      fail_fsync_of = "STORE.tmp";
    }
    try {
      Open();
      ADD_FAILURE() << "a store whose marker failed to sync opened";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("STORE.tmp"), std::string::npos) << e.what();
    }
    EXPECT_EQ(OpenDescriptorsOf("STORE.tmp"), 0) << "attempt " << attempt;
    fs::remove(fs::path(dir_) / "STORE.tmp");
  }
  EXPECT_NE(Open(), nullptr);  // the fault passed: the store opens
}

// A first open that failed, or was killed, before its marker was renamed into
// place leaves STORE.tmp alone in the directory, torn or whole: the next open
// makes the store, rather than refusing a directory that is "not empty" until
// someone removes the file by hand.
TEST_F(SsdDurabilityTest, AMarkerLeftUnrenamedByAFailedFirstOpenDoesNotBlockTheNext) {
  {
    std::lock_guard lock(sync_fault_mutex);
    fail_fsync_of = "STORE.tmp";
  }
  EXPECT_THROW(Open(), IoError);
  ASSERT_TRUE(fs::exists(fs::path(dir_) / "STORE.tmp"));
  {
    auto store = Open();
    Put(*store, 1, 3);
    store->Commit();
  }
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "STORE.tmp"));
  EXPECT_EQ(Found(*Open(), 1, 3), 2u);

  fs::remove_all(dir_);  // a kill mid-write: a torn marker
  fs::create_directories(dir_);
  std::ofstream(fs::path(dir_) / "STORE.tmp") << "hps-ssd-st";
  EXPECT_NE(Open(), nullptr);
}

}  // namespace
}  // namespace hps
