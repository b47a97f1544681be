// SSD-PS's own contracts, beyond the format (ssd_format_test.cc): what open
// refuses, what the counters count, what a failed compaction or Bound leaves,
// and what a put racing a compaction leaves committed. Each test holds a
// behaviour that a mutation audit of src/store/ssd_store.cc found unchecked.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "failing_allocations.h"  // replaces operator new: in this one file of the binary
#include "format/param_file.h"  // ParamFile::kKeyChunk, ParamFileLayout
#include "hps/ssd_store.h"
#include "store/ssd_store_testing.h"
#include "temp_dir.h"

namespace hps {
namespace {

namespace fs = std::filesystem;

class SsdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test_support::FreshTestDir("hps-ssd-store-test");
  }
  void TearDown() override {
    detail::ssd_store_test_seams = {};
    fs::remove_all(dir_);
  }

  SsdStoreOptions Options(uint64_t file_records) const {
    SsdStoreOptions o;
    o.path = dir_;
    o.row_bytes = kRowBytes;
    o.file_records = file_records;
    o.background_compaction = false;
    o.compaction_trigger = 100;  // compactions only where a test asks for one
    return o;
  }

  // The parameter files in the store's directory, by name.
  std::vector<std::string> Files() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      if (entry.path().extension() == ".hpf") names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // Takes the name the store gives its next file ("%012llu.hpf", one past
  // the highest sequence in the directory), so that the next write fails
  // with EEXIST: a fault injected without touching the process's limits.
  std::string BlockNextFile(uint64_t ahead = 0) const {
    uint64_t highest = 0;
    for (const std::string& name : Files()) highest = std::max<uint64_t>(highest, std::stoull(name));
    char name[32];
    std::snprintf(name, sizeof name, "%012llu.hpf", static_cast<unsigned long long>(highest + 1 + ahead));
    const std::string path = (fs::path(dir_) / name).string();
    std::ofstream(path) << "in the way";
    return path;
  }

  static constexpr uint32_t kRowBytes = 16;
  std::string dir_;
};

// Row of `key` at `version`: (key, version, key, ~version) as uint32.
std::vector<uint8_t> Rows(const std::vector<uint64_t>& keys, uint32_t version) {
  std::vector<uint8_t> rows(keys.size() * 16);
  for (size_t i = 0; i < keys.size(); ++i) {
    const uint32_t words[4] = {static_cast<uint32_t>(keys[i]), version, static_cast<uint32_t>(keys[i]), ~version};
    std::memcpy(rows.data() + i * 16, words, sizeof words);
  }
  return rows;
}

void Put(SsdStore& store, const std::vector<uint64_t>& keys, uint32_t version) {
  const std::vector<uint8_t> rows = Rows(keys, version);
  store.Put(keys.data(), keys.size(), rows.data());
}

// The version each key reads at; -1 for a miss; -2 for a row not of its key.
std::vector<int64_t> Versions(SsdStore& store, const std::vector<uint64_t>& keys) {
  std::vector<uint8_t> out(keys.size() * 16), found(keys.size());
  store.Get(keys.data(), keys.size(), out.data(), found.data());
  std::vector<int64_t> versions(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    uint32_t w[4];
    std::memcpy(w, out.data() + i * 16, sizeof w);
    const bool own = w[0] == static_cast<uint32_t>(keys[i]) && w[2] == w[0] && w[3] == ~w[1];
    versions[i] = !found[i] ? -1 : own ? int64_t{w[1]} : -2;
  }
  return versions;
}

std::vector<uint64_t> Range(uint64_t first, uint64_t end) {
  std::vector<uint64_t> keys(end - first);
  std::iota(keys.begin(), keys.end(), first);
  return keys;
}

// ------------------------------------------------------------------ open

// A later format's store must not be read as this one's.
TEST_F(SsdStoreTest, AStoreMarkerOfAnotherFormatIsRefused) {
  fs::create_directories(dir_);
  std::ofstream(fs::path(dir_) / "STORE") << "hps-ssd-store 2\nrow_bytes 16\n";
  try {
    SsdStore::Open(Options(4));
    ADD_FAILURE() << "opened a store of format 2";
  } catch (const CorruptionError& e) {
    EXPECT_NE(std::string(e.what()).find("store format 2, this build reads 1"), std::string::npos) << e.what();
  }
}

// Two files that swapped names (a botched restore) hold the same keys, the
// older rows under the newer name: open must refuse, not serve the older.
TEST_F(SsdStoreTest, AFileUnderAnotherFilesNameIsCorruptionNotStaleRows) {
  {
    auto store = SsdStore::Open(Options(4));
    Put(*store, Range(1, 5), 1);
    Put(*store, Range(1, 5), 2);
    store->Commit();
  }
  const std::vector<std::string> files = Files();
  ASSERT_EQ(files.size(), 2u);
  const fs::path a = fs::path(dir_) / files[0], b = fs::path(dir_) / files[1], tmp = fs::path(dir_) / "swap";
  fs::rename(a, tmp);
  fs::rename(b, a);
  fs::rename(tmp, b);
  try {
    auto store = SsdStore::Open(Options(4));
    ADD_FAILURE() << "opened swapped files; key 1 reads version " << Versions(*store, {1})[0];
  } catch (const CorruptionError& e) {
    EXPECT_NE(std::string(e.what()).find(files[0] + ": header says sequence 2"), std::string::npos) << e.what();
  }
}

// Compaction writes old rows into new files, which keep the old stamp under
// a higher sequence: the reopened stamp is the highest, not the last file's,
// or the stamps a trainer set would go back.
TEST_F(SsdStoreTest, ReopenedStampIsTheHighestNotTheLastFilesStamp) {
  {
    auto store = SsdStore::Open(Options(4));
    store->SetStamp(1);
    Put(*store, Range(1, 9), 1);
    store->SetStamp(5);
    Put(*store, Range(1, 4), 5);  // the first file three quarters stale
    store->Compact();             // key 4 rewritten, stamp 1, into the newest file
    ASSERT_EQ(store->stats().compactions, 1u);
  }
  auto store = SsdStore::Open(Options(4));
  EXPECT_EQ(store->stamp(), 5u);
  EXPECT_THROW(store->SetStamp(4), std::invalid_argument);
  std::vector<uint64_t> stamps(2);
  const std::vector<uint64_t> keys = {1, 4};
  store->Stamps(keys.data(), 2, stamps.data(), nullptr);
  EXPECT_EQ(stamps, (std::vector<uint64_t>{5, 1}));  // the rewritten row kept its own
}

// ------------------------------------------------------------- counters

TEST_F(SsdStoreTest, DuplicateKeysInOnePutStoreTheLastRowOnce) {
  auto store = SsdStore::Open(Options(4));
  const std::vector<uint64_t> keys = {5, 6, 5};
  std::vector<uint8_t> rows = Rows(keys, 1);
  std::vector<uint8_t> last = Rows({5}, 3);
  std::memcpy(rows.data() + 2 * 16, last.data(), 16);
  store->Put(keys.data(), keys.size(), rows.data());
  EXPECT_EQ(Versions(*store, {5, 6}), (std::vector<int64_t>{3, 1}));
  const SsdStoreStats s = store->stats();
  EXPECT_EQ(s.rows_written, 2u);  // one record a key, not one a row given
  EXPECT_EQ(s.live_records, 2u);
  EXPECT_EQ(s.stale_records, 0u);
}

// commits counts manifest commits, each once, and goes on across a reopen.
TEST_F(SsdStoreTest, CommitsCountEachManifestCommitOnce) {
  {
    auto store = SsdStore::Open(Options(4));
    Put(*store, {1}, 1);
    store->Commit();
    store->Commit();
    EXPECT_EQ(store->stats().commits, 2u);
  }
  auto store = SsdStore::Open(Options(4));
  EXPECT_EQ(store->stats().commits, 2u);
  store->Commit();
  EXPECT_EQ(store->stats().commits, 3u);
}

// Every commit appended to MANIFEST and nothing rewrote it: it grew for the
// life of a store, and each open replayed all of it. Now the store rolls it
// past its bound (here a floor of 1 KiB, which the few live files' rolled
// log stays under), counting each roll, and a reopen finds the last commit's
// rows and count of commits.
TEST_F(SsdStoreTest, AStoreCommittedManyTimesKeepsItsManifestUnderItsBound) {
  detail::ssd_store_test_seams.manifest_roll_floor_bytes = 1024;
  const std::string manifest = (fs::path(dir_) / "MANIFEST").string();
  SsdStoreOptions o = Options(4);
  o.compaction_trigger = 2;  // compactions keep the live files few
  uint64_t commits = 0;
  {
    auto store = SsdStore::Open(o);
    for (uint32_t version = 1; version <= 200; ++version) {
      Put(*store, {version % 8, 100 + version % 3}, version);
      store->Commit();
      ASSERT_LE(fs::file_size(manifest), 1024u) << "after commit " << version;
    }
    EXPECT_GT(store->stats().manifest_rolls, 0u);
    EXPECT_EQ(store->stats().manifest_roll_failures, 0u);
    commits = store->stats().commits;
  }
  auto store = SsdStore::Open(o);
  EXPECT_EQ(store->stats().commits, commits);
  EXPECT_EQ(store->stats().manifest_rolls, 0u) << "counted since open";
  std::vector<int64_t> want;
  for (uint64_t key = 0; key < 8; ++key) want.push_back(key == 0 ? 200 : 192 + key);
  for (uint64_t key = 100; key < 103; ++key) want.push_back(static_cast<int64_t>(98 + key));  // 198, 199, 200
  std::vector<uint64_t> keys = Range(0, 8);
  for (uint64_t key = 100; key < 103; ++key) keys.push_back(key);
  EXPECT_EQ(Versions(*store, keys), want);
}

// rows_read and bytes_requested are what read amplification divides by:
// misses read nothing and must not count.
TEST_F(SsdStoreTest, RowsReadCountsHitsOnly) {
  auto store = SsdStore::Open(Options(4));
  Put(*store, {7}, 1);
  const std::vector<uint64_t> keys = {7, 8, 9};
  std::vector<uint8_t> out(3 * 16);
  EXPECT_EQ(store->Get(keys.data(), 3, out.data(), nullptr), 1u);
  const SsdStoreStats s = store->stats();
  EXPECT_EQ(s.rows_read, 1u);
  EXPECT_EQ(s.bytes_requested, 16u);
}

// "Stamps never go back": staying put is not going back (a trainer stamps
// every batch, several batches a step).
TEST_F(SsdStoreTest, SetStampTakesTheCurrentStampAgain) {
  auto store = SsdStore::Open(Options(4));
  store->SetStamp(3);
  EXPECT_NO_THROW(store->SetStamp(3));
  EXPECT_THROW(store->SetStamp(2), std::invalid_argument);
  EXPECT_EQ(store->stamp(), 3u);
}

// The bound_* stats are the results summed over calls; a cap that ends
// exactly on a stamp drops that stamp's file whole, rewriting nothing.
TEST_F(SsdStoreTest, BoundStatsAddUpItsResults) {
  auto store = SsdStore::Open(Options(4));
  store->SetStamp(1);
  Put(*store, Range(1, 5), 1);
  store->SetStamp(2);
  Put(*store, Range(5, 9), 2);
  store->SetStamp(3);
  Put(*store, Range(9, 13), 3);
  store->Commit();
  const SsdBoundResult expired = store->Bound(2, 0);  // stamp 1 goes
  EXPECT_EQ(expired.expired, Range(1, 5));
  EXPECT_EQ(expired.files_dropped, 1u);
  const SsdBoundResult capped = store->Bound(0, 4);  // exactly stamp 2's four keys too many
  EXPECT_EQ(capped.capped, Range(5, 9));
  EXPECT_EQ(capped.files_dropped, 1u);
  EXPECT_EQ(capped.records_rewritten, 0u);
  const SsdBoundResult cut = store->Bound(0, 3);  // cuts stamp 3: key 9 goes, 10..12 rewritten
  EXPECT_EQ(cut.capped, std::vector<uint64_t>{9});
  EXPECT_EQ(cut.records_rewritten, 3u);
  const SsdStoreStats s = store->stats();
  EXPECT_EQ(s.bound_expired, 4u);
  EXPECT_EQ(s.bound_capped, 5u);
  EXPECT_EQ(s.bound_files_dropped, 2u);
  EXPECT_EQ(s.bound_records_rewritten, 3u);
  store->Commit();
  EXPECT_EQ(Files().size(), 1u);
}

// A file Bound drops before any commit listed it is simply gone: the
// manifest never named it, so the commit must not drop it there either (a
// replay refuses a drop of a file it does not know, and the store with it).
TEST_F(SsdStoreTest, BoundDroppingAnUncommittedFileCommitsAndReopens) {
  {
    auto store = SsdStore::Open(Options(4));
    store->SetStamp(1);
    Put(*store, Range(1, 5), 1);  // never committed
    store->SetStamp(2);
    Put(*store, Range(5, 9), 2);
    EXPECT_EQ(store->Bound(2, 0).expired, Range(1, 5));
    store->Commit();
  }
  auto store = SsdStore::Open(Options(4));
  EXPECT_EQ(Versions(*store, Range(1, 9)), (std::vector<int64_t>{-1, -1, -1, -1, 2, 2, 2, 2}));
  EXPECT_EQ(Files().size(), 1u);
}

// Compact() rewrites the files more than half stale, and only those;
// compacted_records counts the live records it moved.
TEST_F(SsdStoreTest, CompactMovesTheLiveRecordsOfFilesMoreThanHalfStale) {
  auto store = SsdStore::Open(Options(4));
  Put(*store, Range(1, 13), 1);                // files A = 1..4, B = 5..8, C = 9..12
  Put(*store, {1, 2, 5, 6, 7, 9, 10, 11}, 2);  // A half stale, B and C three quarters
  store->Compact();
  SsdStoreStats s = store->stats();
  EXPECT_EQ(s.compactions, 1u);
  EXPECT_EQ(s.compacted_records, 2u);  // keys 8 and 12, out of B and C, into one file
  EXPECT_EQ(s.stale_records, 2u);      // A's 1 and 2: A stays
  EXPECT_EQ(s.files, 4u);              // A, the put's two, B and C's output
  EXPECT_EQ(Versions(*store, Range(1, 13)), (std::vector<int64_t>{2, 2, 1, 1, 2, 2, 2, 1, 2, 2, 2, 1}));
}

// compactions counts runs, as its stats line says, not the chunks a run
// swaps in one manifest commit each: one Compact() over eight victims in two
// chunks is one compaction. A run whose second chunk fails still counts (its
// first chunk stands) and is a failure too; its rows all read, before and
// after a reopen.
TEST_F(SsdStoreTest, CompactionsCountsRunsNotTheirChunks) {
  // Eight files of four keys, each three quarters stale: eight victims with
  // one live record each, in two chunks of about one file of live records.
  auto stale_all_but_every_fourth = [&](SsdStore& store, uint32_t version) {
    std::vector<uint64_t> again;
    for (uint64_t key = 1; key <= 32; ++key) {
      if (key % 4 != 0) again.push_back(key);
    }
    Put(store, again, version);
    store.Commit();
  };
  std::vector<int64_t> want(32, 2);
  for (size_t i = 3; i < 32; i += 4) want[i] = 1;
  {
    auto store = SsdStore::Open(Options(4));
    Put(*store, Range(1, 33), 1);
    store->Commit();
    stale_all_but_every_fourth(*store, 2);
    const uint64_t commits = store->stats().commits;
    store->Compact();
    SsdStoreStats s = store->stats();
    ASSERT_EQ(s.commits, commits + 3) << "Compact's own commit and one per chunk: two chunks";
    EXPECT_EQ(s.compacted_records, 8u);
    EXPECT_EQ(s.compactions, 1u) << "one Compact(), one run";

    // Again over the eight files the same keys take, their second output in the way.
    Put(*store, Range(1, 33), 1);
    store->Commit();
    stale_all_but_every_fourth(*store, 2);
    const std::string blocker = BlockNextFile(/*ahead=*/1);
    EXPECT_THROW(store->Compact(), IoError);
    fs::remove(blocker);
    s = store->stats();
    EXPECT_EQ(s.compactions, 2u) << "its first chunk committed";
    EXPECT_EQ(s.compaction_failures, 1u);
    EXPECT_NE(s.last_error.find(blocker + ": create: File exists"), std::string::npos) << s.last_error;
    EXPECT_EQ(Versions(*store, Range(1, 33)), want);
    store->Commit();
  }
  auto store = SsdStore::Open(Options(4));
  EXPECT_EQ(Versions(*store, Range(1, 33)), want);
  EXPECT_EQ(Files().size(), store->stats().files) << "no file of the failed chunk left behind";
}

// Open indexes a file's keys a chunk at a time (ParamFile::kKeyChunk): each
// chunk's keys must point at their own slots, not the first chunk's.
TEST_F(SsdStoreTest, AReopenedFileOfSeveralKeyChunksServesEveryRow) {
  const uint64_t n = detail::ParamFile::kKeyChunk + 1000;
  {
    auto store = SsdStore::Open(Options(n));
    Put(*store, Range(1, n + 1), 1);
    store->Commit();
  }
  auto store = SsdStore::Open(Options(n));
  ASSERT_EQ(store->stats().files, 1u);
  EXPECT_EQ(store->size(), n);
  EXPECT_EQ(Versions(*store, Range(1, n + 1)), std::vector<int64_t>(n, 1));
}

// --------------------------------------------------------------- failures

// A file cut short under an open store (by another process, or a failing
// disk) is named with where it ends, by both I/O paths: a read that comes up
// short asks for the rest and finds the end, rather than taking whatever the
// buffer held for the missing bytes (which a block CRC then reports as a
// mismatch, or, when the buffer held that very block from an earlier read,
// does not report at all).
TEST_F(SsdStoreTest, AFileCutShortUnderAnOpenStoreIsNamedWithWhereItEnds) {
  for (const bool uring : {false, true}) {
    SCOPED_TRACE(uring ? "io_uring" : "pread");
    fs::remove_all(dir_);
    SsdStoreOptions options = Options(1024);  // 16 KiB of rows: four blocks
    options.use_io_uring = uring;
    auto store = SsdStore::Open(options);
    if (uring && store->stats().io_path.rfind("io_uring", 0) != 0) GTEST_SKIP() << "no io_uring here";
    const std::vector<uint64_t> keys = Range(1, 1025);
    Put(*store, keys, 1);
    store->Commit();
    ASSERT_EQ(Versions(*store, keys), std::vector<int64_t>(1024, 1));  // the blocks now in the scratch
    const std::string file = (fs::path(dir_) / Files().at(0)).string();
    const uint64_t end = fs::file_size(file) - 2 * 4096;  // the last two rows blocks gone
    fs::resize_file(file, end);
    try {
      Versions(*store, keys);  // one read of the whole rows region
      ADD_FAILURE() << "read the rows of " << file << " cut to " << end << " bytes";
    } catch (const CorruptionError& e) {
      EXPECT_NE(std::string(e.what()).find(file + ": not a valid hps parameter file: file ends early, at byte " +
                                           std::to_string(end)),
                std::string::npos)
          << e.what();
    }
  }
}

// Flips a byte of the row at `slot` of the parameter file at `path` (of
// `records` rows of 16 bytes), as a failing disk might: its block no longer
// matches its CRC.
void FlipRowByte(const std::string& path, uint64_t records, uint64_t slot) {
  const detail::ParamFileLayout layout{16, records};
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(layout.row_offset(slot) + 5));
  const char byte = static_cast<char>(f.get() ^ 0x5A);
  f.seekp(static_cast<std::streamoff>(layout.row_offset(slot) + 5));
  f.put(byte);
  ASSERT_TRUE(f.flush()) << path;
}

// The exception a get of `key` raised, with its message; "" when it read.
std::string GetError(SsdStore& store, uint64_t key, bool* corruption) {
  try {
    Versions(store, {key});
    return "";
  } catch (const std::exception& e) {
    *corruption = dynamic_cast<const CorruptionError*>(&e) != nullptr;
    return e.what();
  }
}

// A compaction that meets a rows block failing its CRC raises CorruptionError
// naming the file, the block and the key, not IoError. It used to stop the
// whole run there, and every compaction after it chose the same file and
// failed the same way, so the store's disk use grew without bound. Now that
// file is left as it is (its row stays in the store, and its gets keep
// raising CorruptionError: nothing drops it), the run goes on without it,
// commits' compactions pass it over while it holds a live row, and Compact()
// tries it again, which succeeds once puts have superseded its bad rows.
// On both I/O paths.
TEST_F(SsdStoreTest, ACompactionMeetingACorruptBlockSetsItsFileAsideAndGoesOn) {
  for (const bool uring : {false, true}) {
    SCOPED_TRACE(uring ? "io_uring" : "pread");
    fs::remove_all(dir_);
    SsdStoreOptions options = Options(512);  // 8 KiB of rows a file: slots 0..255 in block 0
    options.use_io_uring = uring;
    const std::vector<uint64_t> a = Range(1, 513), b = Range(1001, 1513), c = Range(2001, 2513);
    std::vector<uint64_t> most, a_left, bc_left;  // three quarters of each file, and the rest
    for (const auto* keys : {&a, &b, &c}) {
      for (uint64_t key : *keys) (key % 4 != 0 ? most : keys == &a ? a_left : bc_left).push_back(key);
    }
    std::vector<uint64_t> every = a;
    every.insert(every.end(), b.begin(), b.end());
    every.insert(every.end(), c.begin(), c.end());
    auto expect_versions = [&](SsdStore& store, const std::vector<uint64_t>& keys, int64_t version) {
      EXPECT_EQ(Versions(store, keys), std::vector<int64_t>(keys.size(), version));
    };
    {
      auto store = SsdStore::Open(options);
      if (uring && store->stats().io_path.rfind("io_uring", 0) != 0) GTEST_SKIP() << "no io_uring here";
      Put(*store, a, 1);  // file 1
      Put(*store, b, 1);  // 2
      Put(*store, c, 1);  // 3
      store->Commit();
      Put(*store, most, 2);  // files 4..6: files 1..3 three quarters stale
      store->Commit();
    }
    const std::string victim = (fs::path(dir_) / "000000000001.hpf").string();
    FlipRowByte(victim, 512, 3);  // key 4's row, which is live, in block 0
    const std::string bad_block = victim + ": rows block 0 (file offset ";
    auto expect_named = [&](const std::string& message) {
      EXPECT_NE(message.find(bad_block), std::string::npos) << message;
      EXPECT_NE(message.find("reading key 4 "), std::string::npos) << message;
    };
    options.compaction_trigger = 1.5;  // 2688 records on disk for 1536 live: the next commit compacts
    auto store = SsdStore::Open(options);
    try {
      store->Commit();
      ADD_FAILURE() << "a compaction over a corrupt block raised nothing";
    } catch (const std::exception& e) {
      EXPECT_NE(dynamic_cast<const CorruptionError*>(&e), nullptr) << "not a CorruptionError: " << e.what();
      expect_named(e.what());
    }
    SsdStoreStats s = store->stats();
    EXPECT_EQ(s.compaction_failures, 1u);
    EXPECT_EQ(s.corrupt_files, 1u);
    expect_named(s.last_error);
    EXPECT_EQ(s.compactions, 1u) << "the other victims were compacted all the same";
    EXPECT_EQ(s.compacted_records, 256u) << "b's and c's live quarters";
    EXPECT_TRUE(fs::exists(victim));
    EXPECT_EQ(s.files, 5u) << "a's file, the put's three, and b's and c's output";
    // Key 4's only copy is damaged: it still raises, naming where, and does not vanish.
    bool corruption = false;
    const std::string error = GetError(*store, 4, &corruption);
    EXPECT_TRUE(corruption) << error;
    expect_named(error);
    EXPECT_EQ(store->size(), 1536u);
    expect_versions(*store, std::vector<uint64_t>(a_left.begin() + 64, a_left.end()), 1);  // a's block 1
    expect_versions(*store, bc_left, 1);
    expect_versions(*store, most, 2);

    // Commits go on, and so do their compactions, without meeting it again.
    EXPECT_NO_THROW(store->Commit());
    Put(*store, b, 3);  // the output wholly stale, files 4..6 two thirds
    Put(*store, c, 3);
    EXPECT_NO_THROW(store->Commit());
    s = store->stats();
    EXPECT_EQ(s.compactions, 2u);
    EXPECT_EQ(s.compaction_failures, 1u) << s.last_error;
    EXPECT_EQ(s.corrupt_files, 1u);
    EXPECT_TRUE(fs::exists(victim));
    expect_versions(*store, b, 3);

    // A reopen still finds key 4 there, damaged.
    store.reset();
    store = SsdStore::Open(options);
    corruption = false;
    expect_named(GetError(*store, 4, &corruption));
    EXPECT_TRUE(corruption);
    // Compact() tries the file again, which still fails on it alone...
    try {
      store->Compact();
      ADD_FAILURE() << "Compact() over a corrupt block raised nothing";
    } catch (const std::exception& e) {
      EXPECT_NE(dynamic_cast<const CorruptionError*>(&e), nullptr) << "not a CorruptionError: " << e.what();
      expect_named(e.what());
    }
    EXPECT_TRUE(fs::exists(victim));
    // ...until puts supersede the rows of its bad block: then it goes.
    Put(*store, std::vector<uint64_t>(a_left.begin(), a_left.begin() + 64), 4);
    EXPECT_NO_THROW(store->Compact());
    EXPECT_FALSE(fs::exists(victim));
    EXPECT_EQ(store->stats().corrupt_files, 0u);
    store->Commit();
    store.reset();
    store = SsdStore::Open(options);
    expect_versions(*store, std::vector<uint64_t>(a_left.begin(), a_left.begin() + 64), 4);
    expect_versions(*store, std::vector<uint64_t>(a_left.begin() + 64, a_left.end()), 1);
    expect_versions(*store, bc_left, 3);
    EXPECT_EQ(store->size(), 1536u);
    EXPECT_EQ(Files().size(), store->stats().files);
  }
}

// A file set aside as damaged may hold all of the stale records that put the
// store over compaction_trigger; a commit then has nothing to compact, and
// must start nothing: an empty job on the background thread would plan the
// same empty job again and again, for good.
TEST_F(SsdStoreTest, ADamagedFileHoldingTheExcessStartsNoCompaction) {
  SsdStoreOptions options = Options(4);
  options.background_compaction = true;
  options.compaction_trigger = 1.5;
  auto store = SsdStore::Open(options);
  Put(*store, Range(1, 5), 1);  // one file, one block
  store->Commit();
  FlipRowByte((fs::path(dir_) / "000000000001.hpf").string(), 4, 3);  // key 4's row
  Put(*store, {1, 2, 3}, 2);
  store->Commit();  // 7 records on disk for 4 live: compacts the first file, which fails its CRC
  store->WaitForCompaction();
  EXPECT_THROW(store->Commit(), CorruptionError);
  EXPECT_FALSE(store->stats().compaction_running);
  EXPECT_NO_THROW(store->Commit());
  const SsdStoreStats s = store->stats();
  EXPECT_FALSE(s.compaction_running);
  EXPECT_EQ(s.corrupt_files, 1u);
  EXPECT_EQ(s.compaction_failures, 1u);
  EXPECT_EQ(s.compactions, 0u);
  EXPECT_EQ(Versions(*store, {1, 2, 3}), (std::vector<int64_t>{2, 2, 2}));
  bool corruption = false;
  GetError(*store, 4, &corruption);
  EXPECT_TRUE(corruption);
}

// Flips a byte of the key at `slot` of the parameter file at `path` (of
// `records` rows of 16 bytes): the keys no longer match their CRC.
void FlipKeyByte(const std::string& path, uint64_t records, uint64_t slot) {
  const detail::ParamFileLayout layout{16, records};
  const auto at = static_cast<std::streamoff>(layout.keys_offset() + slot * sizeof(uint64_t) + 1);
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  const char byte = static_cast<char>(f.get() ^ 0x5A);
  f.seekp(at);
  f.put(byte);
  ASSERT_TRUE(f.flush()) << path;
}

// Bound drops the files of the stamps it erases whole, reading only their
// keys to find which of them are live. When those keys failed their CRC,
// Bound raised CorruptionError and changed nothing, at every call: every
// checkpoint of a bounded table failed from then on, and a reopen failed on
// the same keys. The index holds every live key of the file (checked at
// open, or taken from a put in memory), so Bound takes them from there: it
// erases exactly the file's live keys (those that later files superseded
// stay), drops the file, and the next commit names it, once.
TEST_F(SsdStoreTest, ABoundDroppingAFileWhoseKeysFailTheirCrcErasesItsLiveKeysAllTheSame) {
  const SsdStoreOptions options = Options(512);
  {
    auto store = SsdStore::Open(options);
    store->SetStamp(1);
    Put(*store, Range(1, 513), 1);  // file 1
    store->SetStamp(2);
    Put(*store, Range(1, 101), 2);  // superseding file 1's first 100
    Put(*store, Range(1001, 1513), 2);
    store->Commit();
  }
  auto store = SsdStore::Open(options);
  const std::string file = (fs::path(dir_) / "000000000001.hpf").string();
  FlipKeyByte(file, 512, 200);
  SsdBoundResult r;
  ASSERT_NO_THROW(r = store->Bound(2, 0));
  EXPECT_EQ(r.expired, Range(101, 513));
  EXPECT_EQ(r.files_dropped, 1u);
  EXPECT_EQ(store->size(), 612u);
  try {
    store->Commit();
    ADD_FAILURE() << "a bound over a file whose keys failed their CRC was never told";
  } catch (const CorruptionError& e) {
    EXPECT_NE(std::string(e.what()).find(file + ": "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("keys CRC mismatch"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(store->Commit());
  EXPECT_FALSE(fs::exists(file));
  store.reset();
  store = SsdStore::Open(options);
  EXPECT_EQ(Versions(*store, Range(1, 101)), std::vector<int64_t>(100, 2));
  EXPECT_EQ(Versions(*store, Range(101, 513)), std::vector<int64_t>(412, -1));
  EXPECT_EQ(Versions(*store, Range(1001, 1513)), std::vector<int64_t>(512, 2));
  EXPECT_EQ(store->size(), 612u);
}

// Bound rewrites the live rows that stay in the stamp its cap cuts through.
// When a block of them failed its CRC, Bound raised CorruptionError and
// changed nothing, at every call: every checkpoint of a bounded table failed
// from then on. Now the cut is left undone (an erasure lasts only once every
// file holding a copy of the key is dropped, and that file can be neither
// dropped nor rewritten), the older stamps are bounded all the same, and
// the file is left as it is, as a compaction leaves it: its sound rows
// read, a get of a bad one raises CorruptionError naming the key. The next
// commit names it, once; Bounds that meet it again go on without it,
// silently; once puts have superseded its bad rows, the cut goes through it.
TEST_F(SsdStoreTest, ABoundCuttingThroughACorruptBlockLeavesTheCutUndoneAndBoundsTheRest) {
  const SsdStoreOptions options = Options(512);  // two blocks of rows a file, 256 rows each
  auto store = SsdStore::Open(options);
  store->SetStamp(1);
  Put(*store, Range(3001, 3257), 1);  // file 1
  store->SetStamp(2);
  Put(*store, Range(513, 1025), 2);  // file 2: key k at slot k - 513
  Put(*store, Range(1, 513), 2);     // file 3
  store->SetStamp(3);
  Put(*store, Range(2001, 2513), 3);  // file 4
  store->Commit();
  const std::string file = (fs::path(dir_) / "000000000002.hpf").string();
  FlipRowByte(file, 512, 300);  // key 813's row, in block 1
  auto expect_named = [&](const std::string& message, const std::string& key) {
    EXPECT_NE(message.find(file + ": rows block 1 (file offset "), std::string::npos) << message;
    EXPECT_NE(message.find("reading key " + key), std::string::npos) << message;
  };
  // A cap of 896 takes stamp 1 whole, then cuts stamp 2: 1..640 would go,
  // 641..1024 (file 2's slots 128..511, blocks 0 and 1) be rewritten.
  SsdBoundResult r;
  ASSERT_NO_THROW(r = store->Bound(0, 896));
  EXPECT_EQ(r.capped, Range(3001, 3257));
  EXPECT_EQ(r.files_dropped, 1u);
  EXPECT_EQ(r.records_rewritten, 0u);
  EXPECT_EQ(store->size(), 1536u);
  bool corruption = false;
  expect_named(GetError(*store, 813, &corruption), "813");
  EXPECT_TRUE(corruption);
  EXPECT_EQ(Versions(*store, Range(513, 769)), std::vector<int64_t>(256, 2));  // its block 0
  EXPECT_EQ(Versions(*store, Range(1, 513)), std::vector<int64_t>(512, 2));
  try {
    store->Commit();
    ADD_FAILURE() << "a bound over a corrupt block was never told";
  } catch (const CorruptionError& e) {
    expect_named(e.what(), "");
    EXPECT_NE(std::string(e.what()).find("1536 keys, over max_live = 896"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(store->Commit());
  EXPECT_EQ(store->stats().corrupt_files, 1u);
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "000000000001.hpf"));

  // Met again, the cut is left undone again, silently.
  ASSERT_NO_THROW(r = store->Bound(0, 896));
  EXPECT_TRUE(r.capped.empty());
  EXPECT_NO_THROW(store->Commit());

  // A reopen reads the file as it was left.
  store.reset();
  store = SsdStore::Open(options);
  EXPECT_EQ(store->size(), 1536u);
  EXPECT_EQ(Versions(*store, Range(1, 769)), std::vector<int64_t>(768, 2));
  EXPECT_EQ(Versions(*store, Range(3001, 3257)), std::vector<int64_t>(256, -1));
  corruption = false;
  expect_named(GetError(*store, 813, &corruption), "813");

  // Its bad block superseded, the cut goes through it: 1..640 go, 641..768 are rewritten.
  store->SetStamp(4);
  Put(*store, Range(769, 1025), 4);
  ASSERT_NO_THROW(r = store->Bound(0, 896));
  EXPECT_EQ(r.capped, Range(1, 641));
  EXPECT_EQ(r.records_rewritten, 128u);
  EXPECT_NO_THROW(store->Commit());
  EXPECT_FALSE(fs::exists(file));
  store.reset();
  store = SsdStore::Open(options);
  EXPECT_EQ(Versions(*store, Range(1, 641)), std::vector<int64_t>(640, -1));
  EXPECT_EQ(Versions(*store, Range(641, 769)), std::vector<int64_t>(128, 2));
  EXPECT_EQ(Versions(*store, Range(769, 1025)), std::vector<int64_t>(256, 4));
  EXPECT_EQ(store->size(), 896u);
}

// A put writes its files, then points the index at them, file by file. When
// an allocation failed in that second part (a shard of the index growing),
// the put threw with its first files indexed: later gets read the new rows of
// some keys and the old of others, and the next commit made that durable. At
// every allocation the put makes, failing it must leave the rows, the files
// and the counts as they were, in the open store and after a commit and a
// reopen; a put that returns must have put every row.
TEST_F(SsdStoreTest, APutThatRunsOutOfMemoryAnywhereChangesNothing) {
  const SsdStoreOptions options = Options(8);
  auto store = SsdStore::Open(options);
  Put(*store, Range(1, 21), 1);  // three files
  store->Commit();
  const std::vector<uint64_t> keys = Range(11, 41);  // four files: ten keys over, twenty new
  const std::vector<uint8_t> rows = Rows(keys, 2);
  const std::vector<uint64_t> every = Range(1, 41);
  std::vector<int64_t> before(40, -1), after(40, 2);
  std::fill(before.begin(), before.begin() + 20, 1);
  std::fill(after.begin(), after.begin() + 10, 1);
  const std::vector<std::string> files = Files();
  const SsdStoreStats was = store->stats();
  auto expect_unchanged = [&](const char* when) {
    SCOPED_TRACE(when);
    EXPECT_EQ(Versions(*store, every), before);
    EXPECT_EQ(Files(), files);
    const SsdStoreStats s = store->stats();
    EXPECT_EQ(s.files, was.files);
    EXPECT_EQ(s.live_records, was.live_records);
    EXPECT_EQ(s.stale_records, was.stale_records);
  };
  test_support::ForEveryAllocation([&](uint64_t k) {
    const test_support::FailingAllocationCall call =
        test_support::CallFailingAllocation(k, [&] { store->Put(keys.data(), keys.size(), rows.data()); });
    if (call.ran_out || call.refused) {
      EXPECT_FALSE(call.refused) << call.error;
      expect_unchanged("after the failed put");
      store->Commit();
      store.reset();
      store = SsdStore::Open(options);
      expect_unchanged("after a commit and a reopen");
    } else {
      EXPECT_EQ(Versions(*store, every), after);
      if (!call.past_its_allocations) {  // an allocation that may fail failed: back to before
        store.reset();
        store = SsdStore::Open(options);
      }
    }
    return call;
  });
  store->Commit();
  store.reset();
  store = SsdStore::Open(options);
  EXPECT_EQ(Versions(*store, every), after);
  EXPECT_EQ(store->stats().stale_records, 10u);
}

// A get through io_uring that runs out of memory, at any allocation, leaves
// its ring fit for the next call. An operation queued just before a failed
// allocation went to the kernel uncounted: the failed call did not wait for
// it, so the kernel read into a buffer its caller had freed, and the next
// call through that ring took its completion for one of its own (here: the
// next get waited for good).
TEST_F(SsdStoreTest, AGetThatRunsOutOfMemoryAnywhereLeavesItsRingWorking) {
  SsdStoreOptions options = Options(8);
  options.direct_io = false;  // the page cache: reads finish at once, so several complete per wait
  auto store = SsdStore::Open(options);
  if (store->stats().io_path.rfind("io_uring", 0) != 0) GTEST_SKIP() << "no io_uring here";
  const std::vector<uint64_t> keys = Range(1, 401);  // fifty files, a read each
  Put(*store, keys, 1);
  test_support::ForEveryAllocation([&](uint64_t k) {
    const test_support::FailingAllocationCall call = test_support::CallFailingAllocation(k, [&] { Versions(*store, keys); });
    EXPECT_FALSE(call.refused) << call.error;
    EXPECT_EQ(Versions(*store, keys), std::vector<int64_t>(keys.size(), 1));
    return call;
  });
}

// A put that would take more files than record ids can address fails before
// it touches the index or leaves a file behind.
TEST_F(SsdStoreTest, APutPastTheFileLimitLeavesNothing) {
  auto store = SsdStore::Open(Options(uint64_t{1} << 31));  // ids for one file only
  Put(*store, {1}, 1);
  EXPECT_THROW(Put(*store, {2}, 1), std::runtime_error);
  EXPECT_EQ(Files().size(), 1u);
  EXPECT_EQ(store->size(), 1u);
  EXPECT_EQ(Versions(*store, {1, 2}), (std::vector<int64_t>{1, -1}));
}

// A put of several files whose second cannot be written removes the first:
// nothing of a failed put stays on disk or in the index.
TEST_F(SsdStoreTest, APutThatFailsMidwayLeavesNoFile) {
  auto store = SsdStore::Open(Options(4));
  Put(*store, Range(1, 5), 1);
  const std::vector<std::string> before = Files();
  const std::string blocker = BlockNextFile(/*ahead=*/1);
  EXPECT_THROW(Put(*store, Range(11, 19), 2), IoError);  // two files; the second is in the way
  fs::remove(blocker);
  EXPECT_EQ(Files(), before);
  EXPECT_EQ(store->size(), 4u);
  EXPECT_EQ(Versions(*store, {1, 11}), (std::vector<int64_t>{1, -1}));
}

// A compaction that cannot write its output throws from Compact(), is
// counted, changes nothing, and leaves no file marked as its victim: a put
// over such a file later must not have its superseded copy carried into a
// newer file by the next compaction, where a reopen would read it.
TEST_F(SsdStoreTest, AFailedCompactionThrowsCountsAndLeavesNoTrace) {
  {
    auto store = SsdStore::Open(Options(4));
    Put(*store, Range(1, 9), 1);
    store->Commit();
    Put(*store, {1, 2, 3, 5, 6, 7}, 2);  // both files three quarters stale
    store->Commit();
    BlockNextFile();
    EXPECT_THROW(store->Compact(), IoError);
    SsdStoreStats s = store->stats();
    EXPECT_EQ(s.compaction_failures, 1u);
    EXPECT_EQ(s.compactions, 0u);
    EXPECT_NE(s.last_error.find("File exists"), std::string::npos) << s.last_error;
    EXPECT_EQ(Versions(*store, Range(1, 9)), (std::vector<int64_t>{2, 2, 2, 1, 2, 2, 2, 1}));
    Put(*store, {4, 8}, 3);  // the failed victims now wholly stale
    store->Compact();
    s = store->stats();
    EXPECT_EQ(s.compactions, 1u);
    EXPECT_EQ(s.compacted_records, 0u);  // nothing live was left in them
    EXPECT_EQ(Versions(*store, Range(1, 9)), (std::vector<int64_t>{2, 2, 2, 3, 2, 2, 2, 3}));
  }
  auto store = SsdStore::Open(Options(4));
  EXPECT_EQ(Versions(*store, Range(1, 9)), (std::vector<int64_t>{2, 2, 2, 3, 2, 2, 2, 3}));
}

// A compaction whose outputs would take more files than record ids can
// address fails before its manifest commit, changing nothing. It used to
// find out only when swapping the index over, after the commit had dropped
// its victims: the open store kept serving them, the next compaction dropped
// them again, and the replay of that MANIFEST refused the store.
TEST_F(SsdStoreTest, ACompactionPastTheFileLimitFailsBeforeItsCommit) {
  const uint64_t two_files = (uint64_t{1} << 31) - 1;  // ids for two files only
  {
    auto store = SsdStore::Open(Options(two_files));
    Put(*store, Range(1, 11), 1);
    store->Commit();
    Put(*store, Range(1, 7), 2);  // the first file 60% stale: a victim, with 4 live records
    store->Commit();
    const std::vector<std::string> before = Files();
    for (int attempt = 0; attempt < 2; ++attempt) {
      EXPECT_THROW(store->Compact(), IoError);
      EXPECT_EQ(Files(), before) << "attempt " << attempt;
      const SsdStoreStats s = store->stats();
      EXPECT_EQ(s.compactions, 0u);
      EXPECT_EQ(s.compaction_failures, static_cast<uint64_t>(attempt + 1));
      EXPECT_NE(s.last_error.find("raise file_records"), std::string::npos) << s.last_error;
    }
    store->Commit();
  }
  auto store = SsdStore::Open(Options(two_files));
  EXPECT_EQ(Versions(*store, Range(1, 11)), (std::vector<int64_t>{2, 2, 2, 2, 2, 2, 1, 1, 1, 1}));
}

// Bound writes the cut stamp's survivors before it changes anything; when
// one of those files cannot be written, the ones already written go too.
TEST_F(SsdStoreTest, ABoundWhoseRewriteFailsLeavesNoFile) {
  auto store = SsdStore::Open(Options(2));
  Put(*store, Range(1, 7), 1);  // three files of one stamp
  store->Commit();
  const std::vector<std::string> before = Files();
  const std::string blocker = BlockNextFile(/*ahead=*/1);  // the second of two survivor files
  EXPECT_THROW(store->Bound(0, 3), IoError);  // would erase 1..3, rewrite 4..6
  fs::remove(blocker);
  EXPECT_EQ(Files(), before);
  EXPECT_EQ(store->size(), 6u);
  EXPECT_EQ(Versions(*store, Range(1, 7)), std::vector<int64_t>(6, 1));
}

// ------------------------------------------------------------------ races

// A compaction that a commit ran itself (background_compaction = false) and
// that failed is that commit's to raise. It went through the slot where the
// background thread leaves its failures for the next commit, so a commit on
// another thread that landed between the two took it: that commit raised a
// failure not its own (its own compaction had gone through), and the commit
// whose compaction failed returned as if it had not.
TEST_F(SsdStoreTest, ACommitsOwnCompactionFailureIsRaisedByThatCommitNotAnother) {
  SsdStoreOptions options = Options(4);
  options.compaction_trigger = 1.5;
  auto store = SsdStore::Open(options);
  Put(*store, Range(1, 9), 1);
  store->Commit();
  Put(*store, {1, 2, 3, 5, 6, 7}, 2);  // 14 records on disk for 8 live: over the trigger
  const std::string blocker = BlockNextFile();  // the compaction's output
  bool landed = false;
  std::string other_commit = "returned";
  detail::ssd_store_test_seams.commit_after_its_compaction = [&] {
    if (std::exchange(landed, true)) return;  // the other commit's own compaction
    fs::remove(blocker);
    try {
      store->Commit();  // the other thread's: its compaction goes through
    } catch (const IoError& e) {
      other_commit = std::string("raised: ") + e.what();
    }
  };
  try {
    store->Commit();
    ADD_FAILURE() << "the commit whose compaction failed returned";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("the compaction this commit ran failed: " + blocker), std::string::npos)
        << e.what();
  }
  ASSERT_TRUE(landed);
  EXPECT_EQ(other_commit, "returned");
  const SsdStoreStats s = store->stats();
  EXPECT_EQ(s.compaction_failures, 1u);
  EXPECT_EQ(s.compactions, 1u);
  EXPECT_EQ(Versions(*store, Range(1, 9)), (std::vector<int64_t>{2, 2, 2, 1, 2, 2, 2, 1}));
}

// A put lands while a background compaction runs: the copies it supersedes
// in victims not yet rewritten are the committed ones, so the compaction
// must carry them over (and plan no next job over them while the put is
// uncommitted). A crash before the next commit (here: no commit) reopens to
// the committed rows, every one; after a commit, to the put's, with the
// same stale count the store kept in memory.
TEST_F(SsdStoreTest, APutRacingACompactionKeepsTheCommittedRows) {
  constexpr uint64_t n = 20000;
  SsdStoreOptions options = Options(64);
  options.background_compaction = true;
  options.compaction_trigger = 1.5;
  const std::vector<uint64_t> keys = Range(1, n + 1);
  std::vector<uint64_t> most = keys;  // 70%, all over the files: every file more than half stale
  std::shuffle(most.begin(), most.end(), std::mt19937_64(4));
  most.resize(n * 7 / 10);
  std::vector<int64_t> committed(n, 1);
  for (uint64_t k : most) committed[k - 1] = 2;

  // Commits version 2 over `most`, which starts a compaction of nearly every
  // file, and puts `racing` over all keys, a few hundred at a time, while it
  // runs. False when no put ran wholly inside it (then nothing raced).
  auto race = [&](SsdStore& store, uint32_t racing) {
    Put(store, most, 2);
    store.Commit();
    bool raced = false;
    for (uint64_t begin = 0; begin < n; begin += 500) {
      const bool running = store.stats().compaction_running;
      Put(store, std::vector<uint64_t>(keys.begin() + begin, keys.begin() + std::min(n, begin + 500)), racing);
      raced |= running && store.stats().compaction_running;
    }
    store.WaitForCompaction();
    EXPECT_EQ(store.stats().compaction_failures, 0u) << store.stats().last_error;
    return raced;
  };
  int raced = 0;
  {
    auto store = SsdStore::Open(options);
    Put(*store, keys, 1);
    store->Commit();
    raced += race(*store, 3);
    EXPECT_EQ(Versions(*store, keys), std::vector<int64_t>(n, 3));
  }  // no commit: version 3 was never durable
  auto store = SsdStore::Open(options);
  ASSERT_EQ(Versions(*store, keys), committed);
  raced += race(*store, 4);
  store->Commit();
  store->WaitForCompaction();
  const SsdStoreStats in_memory = store->stats();
  store.reset();
  store = SsdStore::Open(options);
  EXPECT_EQ(Versions(*store, keys), std::vector<int64_t>(n, 4));
  const SsdStoreStats reopened = store->stats();
  EXPECT_EQ(in_memory.files, reopened.files);
  EXPECT_EQ(in_memory.live_records, reopened.live_records);
  EXPECT_EQ(in_memory.stale_records, reopened.stale_records);
  // The race is timing: say so when it did not happen rather than pass as held.
  if (raced < 2) GTEST_SKIP() << "the put raced the compaction " << raced << " of 2 times";
}

}  // namespace
}  // namespace hps
