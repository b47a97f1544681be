#include "hps/ssd_store.h"

#include <fcntl.h>
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
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "util/block_io.h"
#include "format/key_index.h"
#include "format/manifest.h"
#include "format/param_file.h"
#include "store/ssd_store_testing.h"
#include "util/errors.h"  // ThrowErrno

namespace hps {
namespace detail {
SsdStoreTestSeams ssd_store_test_seams;
}  // namespace detail
namespace {

namespace fs = std::filesystem;
using detail::KeyIndex;
using detail::ManifestWriter;
using detail::ParamFile;

constexpr const char* kStoreMarker = "STORE";
constexpr const char* kManifest = "MANIFEST";
constexpr const char* kFileSuffix = ".hpf";
constexpr int kStoreVersion = 1;
// Blocks buffered per wave of a get: each concurrent get holds this much (its
// BlockIo's scratch). 4 MiB keeps about a thousand 4 KiB reads in flight,
// which is what the drive needs; 64 MiB had gets no faster and their buffers
// several times a lookup's cache budget (bench/lookup_bench.py --cgroup).
constexpr uint64_t kReadWaveBytes = uint64_t{4} << 20;
// The index's room for a put's new keys is made in pieces of about this many
// slots (10 bytes each) allocated and copied, or shards looked at, each piece
// under the writer's lock: a reader waits for one piece at most (under a
// millisecond), less than for a file's keys entering the index (65536 keys).
constexpr uint64_t kReservePieceSlots = uint64_t{1} << 16;

using detail::SyncDirectory;
using detail::ThrowErrno;

// Creates `dir` and its missing parents, and makes their names durable: an
// fsync of a new directory does not persist its entry in the one above it
// (fsync(2)), so without this a power loss after a commit returned could
// lose the whole store.
void CreateDirectoriesDurably(const fs::path& dir) {
  std::vector<fs::path> parents;  // of each directory created, deepest first
  for (fs::path at = dir; !at.empty() && !fs::exists(at); at = at.parent_path()) {
    parents.push_back(at.has_parent_path() ? at.parent_path() : fs::path("."));
    if (!at.has_parent_path() || at.parent_path() == at) break;
  }
  if (parents.empty()) return;
  fs::create_directories(dir);
  for (const fs::path& parent : parents) SyncDirectory(parent.string());
}

std::string FileName(uint64_t sequence) {
  char name[32];
  std::snprintf(name, sizeof name, "%012llu%s", static_cast<unsigned long long>(sequence), kFileSuffix);
  return name;
}

// The sequence of a parameter file's name, or false for any other name.
bool ParseFileName(const std::string& name, uint64_t* sequence) {
  const size_t suffix = std::strlen(kFileSuffix);
  if (name.size() <= suffix || name.compare(name.size() - suffix, suffix, kFileSuffix) != 0) return false;
  const std::string digits = name.substr(0, name.size() - suffix);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return false;
  *sequence = std::stoull(digits);
  return true;
}

// Reads or creates the STORE marker, which fixes the row size for good.
void CheckOrCreateMarker(const std::string& dir, uint32_t row_bytes) {
  const std::string marker = (fs::path(dir) / kStoreMarker).string();
  if (fs::exists(marker)) {
    std::ifstream in(marker);
    std::string magic, field;
    int version = 0;
    uint64_t stored_row_bytes = 0;
    if (!(in >> magic >> version >> field >> stored_row_bytes) || magic != "hps-ssd-store" ||
        field != "row_bytes") {
      throw CorruptionError(marker + ": not an hps store marker");
    }
    if (version != kStoreVersion) {
      throw CorruptionError(marker + ": store format " + std::to_string(version) +
                            ", this build reads " + std::to_string(kStoreVersion));
    }
    if (stored_row_bytes != row_bytes) {
      throw std::invalid_argument("the store at " + dir + " holds rows of " +
                                  std::to_string(stored_row_bytes) + " bytes, not " +
                                  std::to_string(row_bytes));
    }
    return;
  }
  // A marker still under its temporary name is a first open that failed or
  // was killed before the rename, and wrote nothing else: the directory is
  // still new (and the marker is written over below).
  const std::string tmp = marker + ".tmp";
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename() == fs::path(tmp).filename()) continue;
    throw std::invalid_argument(dir + " is not an hps store (no " + kStoreMarker +
                                " file) and is not empty; give a new or empty directory");
  }
  {
    std::ofstream out(tmp);
    out << "hps-ssd-store " << kStoreVersion << "\nrow_bytes " << row_bytes << "\n";
    out.flush();
    if (!out) ThrowErrno("write", tmp);
  }
  const int fd = open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) ThrowErrno("open", tmp);
  if (fsync(fd) != 0) {
    const int err = errno;
    close(fd);  // not leaked by a store that failed to open
    errno = err;
    ThrowErrno("sync", tmp);
  }
  close(fd);
  if (std::rename(tmp.c_str(), marker.c_str()) != 0) ThrowErrno("rename", tmp);
  SyncDirectory(dir);
}

// "" when the filesystem holding the store at `dir` takes O_DIRECT opens, else
// why not. Probed once at open, on the STORE marker, so that a store with no
// files yet already knows (and require_direct_io fails at open, not at the
// first put).
std::string ProbeDirectIo(const std::string& dir) {
  const std::string marker = (fs::path(dir) / kStoreMarker).string();
  const int fd = open(marker.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd >= 0) {
    close(fd);
    return "";
  }
  return "O_DIRECT refused by the filesystem at " + dir + ": " + std::strerror(errno);
}

// Where a compaction or Bound found a file damaged, which it then sets aside
// (FileStore::SetAside) rather than fail on it at every run.
enum class Damage : uint8_t {
  kNone,
  kRows,  // a rows block failed its CRC or its read, or the rows region ends early
  kKeys,  // the keys failed their CRC or their read: no record of the file can be told live
};

// A file that failed a read: its checks (a CorruptionError), or the device,
// twice (an IoError: a bad sector). The message is the error's, which names
// the file and what failed (the block and the key; the offset).
class DamagedFile : public std::runtime_error {
 public:
  DamagedFile(const std::string& what, uint32_t file, Damage where, bool read_failed)
      : std::runtime_error(what), handle(file), damage(where), unreadable(read_failed) {}
  uint32_t handle;
  Damage damage;
  bool unreadable;  // the device failed the read, rather than the checks the bytes
};

// Runs `read` (a read of a file's keys, or of rows and their checks, which
// can run again), asking once more when the device fails it: a fault that
// passes is no damage, while a bad sector fails again, and every later
// compaction or Bound would meet it. Throws DamagedFile for a failed check
// or a second failed read.
template <typename Read>
void ReadOrDamaged(uint32_t handle, Damage where, Read&& read) {
  try {
    try {
      read();
    } catch (const IoError&) {
      read();
    }
  } catch (const CorruptionError& e) {
    throw DamagedFile(e.what(), handle, where, false);
  } catch (const IoError& e) {
    throw DamagedFile(std::string(e.what()) + " (read twice)", handle, where, true);
  }
}

// What stopped a compaction run, or the first damaged file it (or a Bound)
// went on without: the message, and whether a file failed its checks
// (CorruptionError) rather than a call (IoError).
struct CompactionError {
  std::string message;  // "": none
  bool corruption = false;
  bool empty() const { return message.empty(); }
  [[noreturn]] void Throw(const std::string& what) const {
    if (corruption) throw CorruptionError(what);
    throw IoError(what);
  }
};

// Ends what a commit raises of a compaction's failure.
constexpr const char* kCompactsAgain = "; a later commit over compaction_trigger compacts again";

// Record ids: handle * slots_per_file_ + slot, 32 bits, so that the index takes
// 12 bytes a slot. Handles are reused once their file is gone.
class FileStore final : public SsdStore {
 public:
  explicit FileStore(const SsdStoreOptions& options)
      : options_(options), io_pool_(options.use_io_uring) {
    const std::string& dir = options_.path;
    if (fs::exists(dir) && !fs::is_directory(dir)) {
      throw std::invalid_argument(dir + " is not a directory, so not an hps store");
    }
    CreateDirectoriesDurably(dir);
    CheckOrCreateMarker(dir, options_.row_bytes);
    if (options_.direct_io) {
      const std::string refused = ProbeDirectIo(dir);
      if (!refused.empty()) NoteBuffered(refused);
      direct_ = refused.empty();
    }

    const std::string manifest = Path(kManifest);
    const bool manifest_exists = fs::exists(manifest);
    const detail::ManifestReplay replay = detail::ReplayManifest(manifest);
    // Files written under another file_records (or merged by compaction) may
    // hold more records than this open asks for: ids must fit the largest.
    slots_per_file_ = options_.file_records;
    for (const auto& [sequence, records] : replay.state.live_files) {
      slots_per_file_ = std::max<uint64_t>(slots_per_file_, records);
    }
    if (slots_per_file_ >= KeyIndex::kNone) {
      throw std::invalid_argument("ssd store: " + std::to_string(slots_per_file_) +
                                  " records in one file; at most 2^32 - 2");
    }
    max_handles_ = uint64_t{KeyIndex::kNone} / slots_per_file_;
    if (detail::ssd_store_test_seams.max_files > 0) {
      max_handles_ = std::min(max_handles_, detail::ssd_store_test_seams.max_files);
    }
    commits_ = replay.state.commits;
    next_sequence_ = replay.state.max_sequence + 1;
    // Files not in the last commit were written by puts that were never
    // committed (or by a crash mid-write): they are not part of the store.
    // They go only once every live file has opened: an open that fails
    // (replay included) removes nothing.
    std::vector<fs::path> strays;
    for (const auto& entry : fs::directory_iterator(dir)) {
      uint64_t sequence = 0;
      if (!ParseFileName(entry.path().filename().string(), &sequence)) continue;
      next_sequence_ = std::max(next_sequence_, sequence + 1);
      if (replay.state.live_files.count(sequence) == 0) strays.push_back(entry.path());
    }
    // The first open creates MANIFEST and syncs its name before any put, so
    // parameter files beside no MANIFEST mean it was lost, not a new store:
    // treating them as strays would delete every committed row.
    if (!manifest_exists && !strays.empty()) {
      throw CorruptionError(manifest + ": missing, yet " + dir + " holds " + std::to_string(strays.size()) +
                            " parameter files (" + strays.front().filename().string() +
                            ", ...); restore MANIFEST or move the files away. Nothing was deleted");
    }
    uint64_t stamp = 0;
    for (const auto& [sequence, records] : replay.state.live_files) {  // ascending: later wins
      const std::string file = Path(FileName(sequence));
      if (!fs::exists(file)) {
        throw CorruptionError(file + ": listed as live in " + manifest + " but missing");
      }
      auto f = std::make_shared<const ParamFile>(
          ParamFile::Open(file, options_.row_bytes, options_.verify_rows_on_open, direct_));
      CheckDirectReads(*f);
      if (f->header().records != records || f->header().sequence != sequence) {
        throw CorruptionError(file + ": header says sequence " +
                              std::to_string(f->header().sequence) + " with " +
                              std::to_string(f->header().records) + " records, " + manifest +
                              " says " + std::to_string(sequence) + " with " + std::to_string(records));
      }
      stamp = std::max(stamp, f->stamp());
      const ParamFile& opened = *f;  // the entry keeps it
      const uint32_t handle = AddEntry(sequence, std::move(f), true);
      // A chunk of keys at a time: a reader opening a store beside another (a
      // Lookup's refresh) holds 512 KiB of keys, not a big file's all at once.
      // A CRC mismatch throws after the last chunk, and the half-built store goes.
      opened.ForEachKeyChunk([&](const uint64_t* keys, uint64_t first, uint64_t n) { Index(handle, keys, first, n); });
    }
    stamp_ = stamp;  // puts go on from the newest file's: stamps never go back
    // A stray that cannot be removed (EIO, EACCES) must not fail the open of
    // a sound store: nothing reads it (only the files MANIFEST lists are
    // opened, and its sequence is never given again: next_sequence_ is past
    // every file here), and every open tries again. So it is counted as the
    // other cleanups are.
    for (const fs::path& stray : strays) {
      std::error_code error;
      fs::remove(stray, error);
      if (error) NoteOpenCleanupFailure(stray.string() + ": remove: " + error.message());
    }
    const uint64_t roll_floor = detail::ssd_store_test_seams.manifest_roll_floor_bytes;
    manifest_ = std::make_unique<ManifestWriter>(manifest, replay,
                                                 roll_floor > 0 ? roll_floor : detail::kManifestRollFloorBytes);
    if (const std::string error = manifest_->TakeStrayError(); !error.empty()) NoteOpenCleanupFailure(error);
    SyncDirectory(dir);  // the removals above, and MANIFEST's name when it was just created
    if (options_.background_compaction) compactor_ = std::thread([this] { CompactorLoop(); });
  }

  ~FileStore() override {
    {
      std::lock_guard lock(compaction_mutex_);
      stopping_ = true;
    }
    compaction_cv_.notify_all();
    if (compactor_.joinable()) compactor_.join();
  }

  void Put(const uint64_t* keys, uint64_t n, const uint8_t* rows) override {
    CheckKeys(keys, n);
    if (n >= KeyIndex::kNone) throw std::invalid_argument("ssd store: put of more than 2^32 - 2 rows in one call");
    std::lock_guard put_lock(put_mutex_);
    const uint64_t stamp = stamp_.load();
    // The last of duplicate keys wins: keep one record per key.
    std::vector<uint32_t> order;
    {
      KeyIndex last;
      for (uint64_t i = 0; i < n; ++i) last.Upsert(keys[i], static_cast<uint32_t>(i));
      order.reserve(last.size());
      for (uint64_t i = 0; i < n; ++i) {
        if (last.Find(keys[i]) == i) order.push_back(static_cast<uint32_t>(i));
      }
    }
    // Write every file first, and take everything the index needs for them
    // (record ids, room for new keys); only then does the batch enter the
    // index, which can then not fail. So a failed put (a full disk, out of
    // memory) changes nothing and leaves no file, and a put that returns has
    // put every row: never some keys' new rows beside others' old ones, in
    // gets or in the next commit.
    const uint32_t row_bytes = options_.row_bytes;
    const uint64_t files = (order.size() + options_.file_records - 1) / options_.file_records;
    std::vector<PutFile> written;
    std::vector<uint32_t> handles;  // written's, taken together
    written.reserve(files);  // a file written is in `written`, so removed if the put fails
    handles.reserve(files);  // an entry added is in `handles`, so removed too
    uint64_t bytes = 0;
    try {
      auto io = io_pool_.Acquire();
      for (uint64_t begin = 0; begin < order.size(); begin += options_.file_records) {
        const uint64_t count = std::min<uint64_t>(options_.file_records, order.size() - begin);
        detail::ParamFileImage image(row_bytes, count);
        uint64_t* file_keys = image.keys();
        for (uint64_t j = 0; j < count; ++j) {
          const uint64_t i = order[begin + j];
          file_keys[j] = keys[i];
          std::memcpy(image.row(j), rows + i * row_bytes, row_bytes);
        }
        std::vector<uint64_t> written_keys(file_keys, file_keys + count);
        const uint64_t sequence = next_sequence_++;
        written.push_back({sequence, WriteFile(image, sequence, stamp, *io, &bytes), std::move(written_keys)});
      }
      // The batch's keys that the index lacks, counted by shard, and those
      // whose current copy a compaction under way is to carry over, found
      // while gets go on: only this put adds keys, and only Plan, which waits
      // for it, marks victims, so both hold until it has indexed.
      std::vector<uint32_t> new_keys;  // by shard
      uint64_t new_key_count = 0;
      std::vector<uint64_t> victim_keys;
      {
        std::shared_lock lock(mutex_);
        const bool compacting = std::any_of(by_sequence_.begin(), by_sequence_.end(),
                                            [&](const auto& file) { return Entry(file.second).victim; });
        for (const PutFile& w : written) {
          new_key_count += index_.CountNewKeys(w.keys.data(), w.keys.size(), &new_keys);
          for (uint64_t key : w.keys) {
            const uint32_t id = compacting ? index_.Find(key) : KeyIndex::kNone;
            if (id != KeyIndex::kNone && Entry(static_cast<uint32_t>(id / slots_per_file_)).victim) {
              victim_keys.push_back(key);
            }
          }
        }
      }
      // Room in the index for the new keys, a piece at a time, each its own
      // lock section: growing every shard a big put touches at once (a
      // copy of much of the index, when its shards pass their load together)
      // made readers wait for all of it. Nothing else inserts meanwhile, so
      // the room holds; a piece that fails only leaves shards larger.
      for (uint64_t shard = 0; new_key_count > 0 && shard < detail::CompactKeyIndex::kShards;) {
        std::unique_lock lock(mutex_);
        shard = index_.Reserve(new_keys, shard, kReservePieceSlots);
      }
      // Every file's handle (its record ids) in this one lock section: a
      // compaction takes handles for its outputs meanwhile, and one that
      // took the last between two of our files would fail the put halfway,
      // its first files in the index. Unindexed, the files serve no get yet.
      std::unique_lock lock(mutex_);
      if (entries_.size() - free_handles_.size() + written.size() > max_handles_) {
        throw std::runtime_error("ssd store: more than " + std::to_string(max_handles_) +
                                 " files would be live; raise file_records");
      }
      uncommitted_.reserve(uncommitted_.size() + written.size());
      free_handles_.reserve(free_handles_.size() + written.size());  // RemoveEntry's, below, should this fail
      // Index records the first copy of each such key that a put supersedes;
      // its entry is made here, empty (kNone), so that Index allocates none.
      // One left empty by a put that failed, or whose key a chunk swapped out
      // of its victim meanwhile, matches no record id: it carries nothing
      // over, and the run's end clears it with the rest.
      for (uint64_t key : victim_keys) superseded_victim_copies_.try_emplace(key, KeyIndex::kNone);
      for (const PutFile& w : written) handles.push_back(AddEntry(w.sequence, w.file, false));
      uncommitted_.insert(uncommitted_.end(), handles.begin(), handles.end());
    } catch (...) {
      if (!handles.empty()) {
        std::unique_lock lock(mutex_);
        for (uint32_t handle : handles) RemoveEntry(handle);
      }
      std::vector<std::string> paths;
      for (const PutFile& w : written) paths.push_back(w.file->path());
      RemoveAfterFailure(paths, "put");
      throw;
    }
    IndexPut(handles, written);
    counters_.rows_written += order.size();
    counters_.bytes_written += bytes;
  }

  uint64_t Get(const uint64_t* keys, uint64_t n, uint8_t* rows_out, uint8_t* found) override {
    CheckKeys(keys, n);
    const uint32_t row_bytes = options_.row_bytes;
    // Group the requests by file, so each file is read once per call. The
    // groups hold their files: a compaction may drop one meanwhile, and its
    // descriptors stay readable until the last holder lets go.
    struct Group {
      std::shared_ptr<const ParamFile> file;
      std::vector<uint64_t> slots;
      std::vector<uint64_t> slot_keys;  // the key at each slot, for a corruption's message
      std::vector<uint64_t> requests;  // i of each slot
      ParamFile::RowsPlan plan;
      uint64_t offset = 0;  // in the wave's buffer
    };
    std::vector<Group> groups;
    uint64_t hits = 0;
    {
      std::shared_lock lock(mutex_);
      std::unordered_map<uint32_t, size_t> group_of;  // handle -> groups index
      for (uint64_t i = 0; i < n; ++i) {
        const uint32_t id = index_.Find(keys[i]);
        if (found) found[i] = id != KeyIndex::kNone;
        if (id == KeyIndex::kNone) {
          std::memset(rows_out + i * row_bytes, 0, row_bytes);
          continue;
        }
        const uint32_t handle = static_cast<uint32_t>(id / slots_per_file_);
        auto [it, inserted] = group_of.try_emplace(handle, groups.size());
        if (inserted) groups.push_back(Group{entries_[handle].file, {}, {}, {}, {}, 0});
        groups[it->second].slots.push_back(id % slots_per_file_);
        groups[it->second].slot_keys.push_back(keys[i]);
        groups[it->second].requests.push_back(i);
        ++hits;
      }
    }
    for (Group& g : groups) g.plan = g.file->PlanRows(g.slots.data(), g.slots.size());
    // Read the planned block runs in waves of at most kReadWaveBytes, with
    // all of a wave's reads in flight at once.
    auto io = io_pool_.Acquire();
    std::vector<uint8_t> rows;
    uint64_t bytes_read = 0;
    for (size_t begin = 0; begin < groups.size();) {
      size_t end = begin;
      uint64_t bytes = 0;
      while (end < groups.size() && (end == begin || bytes + groups[end].plan.bytes <= kReadWaveBytes)) {
        groups[end].offset = bytes;
        bytes += groups[end].plan.bytes;
        ++end;
      }
      // One file's blocks above a wave (a get of many keys from one file) take
      // a buffer of their own, freed after: the scratch stays a wave at most.
      detail::AlignedBuffer oversized;
      if (bytes > kReadWaveBytes) oversized = detail::AlignedBuffer(bytes);
      uint8_t* buffer = bytes > kReadWaveBytes ? oversized.data() : io->Scratch(bytes);
      std::vector<detail::IoRequest> reads;
      for (size_t g = begin; g < end; ++g) {
        groups[g].file->AddReads(groups[g].plan, buffer + groups[g].offset, &reads);
      }
      io->ReadAll(reads);
      bytes_read += bytes;
      for (size_t g = begin; g < end; ++g) {
        const Group& group = groups[g];
        rows.resize(group.slots.size() * row_bytes);
        group.file->CopyRows(group.plan, buffer + group.offset, group.slots.data(),
                             group.slot_keys.data(), group.slots.size(), rows.data());
        for (size_t j = 0; j < group.slots.size(); ++j) {
          std::memcpy(rows_out + group.requests[j] * row_bytes, rows.data() + j * row_bytes, row_bytes);
        }
      }
      begin = end;
    }
    counters_.bytes_read += bytes_read;
    counters_.rows_read += hits;
    return hits;
  }

  void Commit() override {
    std::unique_lock put_lock(put_mutex_);
    CommitLocked();
    CompactionJob job;
    bool run_here = false;
    {
      std::lock_guard lock(compaction_mutex_);
      if (!compaction_active_ && OverTrigger()) {
        job = Plan(/*to_trigger=*/true);
        // None when files set aside as damaged hold the excess (Plan).
        if (!job.chunks.empty()) {
          compaction_active_ = true;
          if (options_.background_compaction) {
            job_ = std::move(job);
            compaction_cv_.notify_all();
          } else {
            run_here = true;
          }
        }
      }
    }
    // The commit stands either way; a compaction's failure is told once.
    CompactionError failure;
    if (run_here) {
      put_lock.unlock();
      const CompactionError error = RunCompaction(std::move(job));
      // This commit's own to raise, so kept here: left in unreported_failure_
      // (the background thread's slot), a commit on another thread could take
      // it first, raising a failure not its own while this one returned.
      FinishCompaction(error);
      if (!error.empty()) {
        failure = {"the compaction this commit ran failed: " + error.message + kCompactsAgain, error.corruption};
      }
      if (detail::ssd_store_test_seams.commit_after_its_compaction) {
        detail::ssd_store_test_seams.commit_after_its_compaction();
      }
    }
    if (failure.empty()) {
      std::lock_guard lock(compaction_mutex_);
      failure = std::exchange(unreported_failure_, {});
    }
    if (!failure.empty()) {
      failure.Throw("ssd store " + options_.path + ": " + failure.message +
                    " (this commit is durable, and no committed row was lost)");
    }
  }

  void Compact() override {
    std::unique_lock compaction_lock(compaction_mutex_);
    compaction_cv_.wait(compaction_lock, [this] { return !compaction_active_; });
    compaction_active_ = true;
    compaction_lock.unlock();
    CompactionJob job;
    try {
      std::lock_guard put_lock(put_mutex_);
      CommitLocked();
      job = Plan(/*to_trigger=*/false);
    } catch (...) {
      FinishCompaction();
      throw;
    }
    const CompactionError error = RunCompaction(std::move(job));
    FinishCompaction(error);
    if (!error.empty()) error.Throw(error.message);
  }

  void WaitForCompaction() override {
    std::unique_lock lock(compaction_mutex_);
    compaction_cv_.wait(lock, [this] { return !compaction_active_; });
  }

  // Lock-free, so that a trainer may stamp every batch without waiting for a
  // put under way (which then writes the older stamp or this one: both are
  // at least its rows' last update).
  void SetStamp(uint64_t stamp) override {
    uint64_t now = stamp_.load();
    do {
      if (stamp < now) {
        throw std::invalid_argument("ssd store " + options_.path + ": stamp " + std::to_string(stamp) +
                                    " is below the store's stamp " + std::to_string(now) +
                                    "; stamps never go back");
      }
    } while (!stamp_.compare_exchange_weak(now, stamp));
  }

  uint64_t stamp() const override { return stamp_.load(); }

  uint64_t Stamps(const uint64_t* keys, uint64_t n, uint64_t* stamps_out, uint8_t* found) const override {
    CheckKeys(keys, n);
    uint64_t hits = 0;
    std::shared_lock lock(mutex_);
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t id = index_.Find(keys[i]);
      const bool hit = id != KeyIndex::kNone;
      if (found) found[i] = hit;
      stamps_out[i] = hit ? Entry(static_cast<uint32_t>(id / slots_per_file_)).stamp : 0;
      hits += hit;
    }
    return hits;
  }

  SsdBoundResult Bound(uint64_t min_stamp, uint64_t max_live) override {
    // A compaction would carry the records of files dropped here over into
    // its outputs: wait for the one under way and start none meanwhile (the
    // next commit writes the drops before it plans one).
    {
      std::unique_lock lock(compaction_mutex_);
      compaction_cv_.wait(lock, [this] { return !compaction_active_; });
      compaction_active_ = true;
    }
    SsdBoundResult result;
    CompactionError damage;  // the next commit raises it, as it does a background compaction's
    try {
      std::lock_guard put_lock(put_mutex_);
      result = BoundLocked(min_stamp, max_live, &damage);
    } catch (...) {
      FinishCompaction();
      throw;
    }
    FinishCompaction({}, damage);
    counters_.bound_expired += result.expired.size();
    counters_.bound_capped += result.capped.size();
    counters_.bound_files_dropped += result.files_dropped;
    counters_.bound_records_rewritten += result.records_rewritten;
    return result;
  }

  uint64_t size() const override {
    std::shared_lock lock(mutex_);
    return index_.size();
  }

  uint32_t row_bytes() const override { return options_.row_bytes; }

  SsdStoreStats stats() const override {
    SsdStoreStats s;
    s.rows_written = counters_.rows_written;
    s.bytes_written = counters_.bytes_written;
    s.rows_read = counters_.rows_read;
    s.bytes_read = counters_.bytes_read;
    s.bytes_requested = counters_.rows_read * options_.row_bytes;
    s.compactions = counters_.compactions;
    s.compacted_records = counters_.compacted_records;
    s.compaction_failures = counters_.compaction_failures;
    s.cleanup_failures = counters_.cleanup_failures;
    s.manifest_rolls = counters_.manifest_rolls;
    s.manifest_roll_failures = counters_.manifest_roll_failures;
    s.compaction_lock_max_us = counters_.compaction_lock_max_ns / 1000.0;
    {
      std::lock_guard lock(compaction_mutex_);
      s.last_error = last_error_;
      s.compaction_running = compaction_active_;
    }
    std::shared_lock lock(mutex_);
    s.files = by_sequence_.size();
    s.live_records = index_.size();
    s.index_bytes = index_.memory_bytes();
    s.commits = commits_;
    s.io_path = io_pool_.name();
    s.io_fallback = io_fallback();
    {
      std::lock_guard io_lock(io_mutex_);
      if (direct_ && !buffered_) s.io_path += "+O_DIRECT";
    }
    s.stamp = stamp_.load();
    s.bound_expired = counters_.bound_expired;
    s.bound_capped = counters_.bound_capped;
    s.bound_files_dropped = counters_.bound_files_dropped;
    s.bound_records_rewritten = counters_.bound_records_rewritten;
    for (const auto& [sequence, handle] : by_sequence_) {
      s.stale_records += Entry(handle).stale;
      s.disk_bytes += Entry(handle).file->layout().file_bytes();
      s.corrupt_files += Entry(handle).corrupt;
      s.unreadable_files += Entry(handle).unreadable;
    }
    return s;
  }

  std::string io_fallback() const override {
    std::string why = io_pool_.fallback();
    std::lock_guard lock(io_mutex_);
    if (!buffered_why_.empty()) why += (why.empty() ? "" : "; ") + buffered_why_;
    return why;
  }

 private:
  struct FileEntry {
    std::shared_ptr<const ParamFile> file;  // null: a free handle
    uint64_t sequence = 0;
    uint64_t stale = 0;      // records whose key now lives in a later file
    uint64_t stamp = 0;      // the file's (ParamFile::stamp), kept here for Bound's grouping
    bool committed = false;
    bool victim = false;     // being compacted away
    Damage damage = Damage::kNone;  // where a compaction or Bound found it damaged (SetAside)
    bool corrupt = false;     // ... failing its checks
    bool unreadable = false;  // ... the device failing its reads
  };
  // A compaction: victims in chunks; each chunk's live records become new
  // files (sequences reserved at planning, so they order before any later
  // put) and replace the chunk's victims in one manifest commit.
  struct CompactionJob {
    std::vector<std::vector<uint32_t>> chunks;  // victim handles
    uint64_t next_sequence = 0;  // the reserved range
    uint64_t end_sequence = 0;
  };
  struct Counters {
    std::atomic<uint64_t> rows_written{0}, bytes_written{0}, rows_read{0}, bytes_read{0};
    std::atomic<uint64_t> compactions{0}, compacted_records{0}, compaction_failures{0}, cleanup_failures{0};
    std::atomic<uint64_t> compaction_lock_max_ns{0};
    std::atomic<uint64_t> manifest_rolls{0}, manifest_roll_failures{0};
    std::atomic<uint64_t> bound_expired{0}, bound_capped{0}, bound_files_dropped{0}, bound_records_rewritten{0};
  };
  // A file a put wrote, with its keys by slot.
  struct PutFile {
    uint64_t sequence;
    std::shared_ptr<const ParamFile> file;
    std::vector<uint64_t> keys;
  };
  // A file Bound() took out of the store; the next commit drops it from the
  // manifest (when it was listed) and deletes it.
  struct Dropped {
    std::shared_ptr<const ParamFile> file;
    bool committed;
  };

  std::string Path(const std::string& name) const { return (fs::path(options_.path) / name).string(); }
  FileEntry& Entry(uint32_t handle) { return entries_[handle]; }
  const FileEntry& Entry(uint32_t handle) const { return entries_[handle]; }
  uint32_t RecordId(uint32_t handle, uint64_t slot) const {
    return static_cast<uint32_t>(handle * slots_per_file_ + slot);
  }

  // Changes nothing when it throws (a new handle's slot or by_sequence_'s
  // node failing to allocate): a caller that removes the entries it added
  // knows of every one. REQUIRES: mutex_ held exclusively (or the constructor).
  uint32_t AddEntry(uint64_t sequence, std::shared_ptr<const ParamFile> file, bool committed) {
    const bool reused = !free_handles_.empty();
    if (!reused && entries_.size() >= max_handles_) {
      throw std::runtime_error("ssd store: more than " + std::to_string(max_handles_) +
                               " files live; raise file_records");
    }
    const uint32_t handle = reused ? free_handles_.back() : static_cast<uint32_t>(entries_.size());
    if (!reused) entries_.emplace_back();
    try {
      by_sequence_.emplace(sequence, handle);
    } catch (...) {
      if (!reused) entries_.pop_back();
      throw;
    }
    if (reused) free_handles_.pop_back();
    records_on_disk_ += file->header().records;
    const uint64_t stamp = file->stamp();
    entries_[handle] = FileEntry{std::move(file), sequence, 0, stamp, committed, false};
    return handle;
  }

  // REQUIRES: mutex_ held exclusively.
  void RemoveEntry(uint32_t handle) {
    FileEntry& e = Entry(handle);
    records_on_disk_ -= e.file->header().records;
    by_sequence_.erase(e.sequence);
    e = FileEntry{};
    free_handles_.push_back(handle);
  }

  // Points the index at the records of slots [first, first + n) of a file,
  // whose keys are keys[0, n); the copies they supersede go stale. The first
  // superseded copy of a key in a compaction's victim is remembered: it may
  // be the committed copy, which the compaction must carry over. Put, which
  // indexes while a compaction runs, has made room for every key and made
  // each such key's entry in superseded_victim_copies_, so that nothing here
  // allocates (at open, no file is a victim). REQUIRES: mutex_ held exclusively.
  void Index(uint32_t handle, const uint64_t* keys, uint64_t first, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t old = index_.Upsert(keys[i], RecordId(handle, first + i));
      if (old == KeyIndex::kNone) continue;
      FileEntry& was = Entry(static_cast<uint32_t>(old / slots_per_file_));
      was.stale += 1;
      if (!was.victim) continue;
      const auto it = superseded_victim_copies_.find(keys[i]);
      if (it != superseded_victim_copies_.end() && it->second == KeyIndex::kNone) it->second = old;
    }
  }

  // Points the index at a put's files, one at a time, so that readers wait
  // one file's keys at most. noexcept: a throw here would leave the batch
  // half indexed, its first files serving gets and going into the next
  // commit; Put took all this needs first.
  void IndexPut(const std::vector<uint32_t>& handles, const std::vector<PutFile>& written) noexcept {
    for (size_t f = 0; f < written.size(); ++f) {
      if (f > 0 && detail::ssd_store_test_seams.put_between_files) detail::ssd_store_test_seams.put_between_files();
      std::unique_lock lock(mutex_);
      Index(handles[f], written[f].keys.data(), 0, written[f].keys.size());
    }
  }

  // Makes the puts so far durable. REQUIRES: put_mutex_ held.
  void CommitLocked() {
    std::vector<std::pair<uint32_t, std::shared_ptr<const ParamFile>>> pending;
    {
      std::shared_lock lock(mutex_);
      for (uint32_t handle : uncommitted_) pending.emplace_back(handle, Entry(handle).file);
    }
    if (!unsyncable_.empty()) throw IoError(unsyncable_);
    for (const auto& entry : pending) {
      try {
        entry.second->Sync();
      } catch (const IoError& e) {
        // The kernel reports a failed write-back once and marks the pages
        // clean: a second fdatasync succeeds though the rows never reached
        // the disk. So no later commit may name this file.
        unsyncable_ = "ssd store " + options_.path + ": " + e.what() +
                      "; rows put since the last commit cannot be made durable: reopen the store, which "
                      "returns to the last commit";
        throw IoError(unsyncable_);
      }
    }
    SyncDirectory(options_.path);  // the new files' names, before the manifest points at them
    {
      std::lock_guard manifest_lock(manifest_mutex_);
      for (const auto& [handle, file] : pending) manifest_->AddFile(file->header().sequence, file->header().records);
      for (const Dropped& d : dropped_) {
        if (d.committed) manifest_->DropFile(d.file->header().sequence);
      }
      CommitManifest();
      ++commits_;
    }
    {
      std::unique_lock lock(mutex_);
      for (const auto& entry : pending) Entry(entry.first).committed = true;
      uncommitted_.clear();
    }
    // Bound's files, no longer listed: a crash before these removals leaves
    // strays that open removes. Gets still holding one keep reading it.
    // Cleared first: a second DropFile of one of them would make the
    // manifest unreadable.
    if (!dropped_.empty()) {
      std::vector<std::string> paths;
      for (const Dropped& d : std::exchange(dropped_, {})) paths.push_back(d.file->path());
      RemoveUnlisted(paths);
    }
  }

  // Commits the manifest's buffered edits (ManifestWriter::Commit), which
  // may roll it. A failed roll fails nothing: the commit stands in the log as
  // it was, and the next commit tries again. REQUIRES: manifest_mutex_ held.
  void CommitManifest() {
    manifest_->Commit();
    counters_.manifest_rolls = manifest_->rolls();
    const std::string roll_error = manifest_->TakeRollError();
    if (!roll_error.empty()) {
      ++counters_.manifest_roll_failures;
      std::fprintf(stderr, "hps: ssd store %s: rolling MANIFEST failed: %s; the commit stands, and the next one "
                   "tries again\n", options_.path.c_str(), roll_error.c_str());
    }
  }

  // Removes files that a commit, already synced, no longer lists, and syncs
  // the directory. That commit stands whatever happens here: its manifest
  // record is durable, and so are the names of the files it added (synced
  // before it). A removal that fails or that a crash undoes only leaves a
  // stray, which open removes. So a failure here is no failure of the
  // commit's caller: it is written to stderr (hps has no logger), and the
  // next commit syncs the directory again before its own record.
  void RemoveUnlisted(const std::vector<std::string>& paths) {
    std::string failure;
    for (const std::string& path : paths) {
      std::error_code error;
      fs::remove(path, error);
      if (error && failure.empty()) failure = "remove " + path + ": " + error.message();
    }
    try {
      SyncDirectory(options_.path);
    } catch (const IoError& e) {
      if (failure.empty()) failure = e.what();
    }
    if (!failure.empty()) {
      ++counters_.cleanup_failures;
      std::fprintf(stderr,
                   "hps: ssd store %s: %s, after a commit that stands; the next commit syncs the directory "
                   "again, and open removes any file left behind\n",
                   options_.path.c_str(), failure.c_str());
    }
  }

  // A leftover that open could not remove (a stray file, a roll's
  // MANIFEST.tmp): to stderr (hps has no logger) and the stats.
  void NoteOpenCleanupFailure(const std::string& failure) {
    ++counters_.cleanup_failures;
    std::fprintf(stderr, "hps: ssd store %s: %s, at open; nothing reads it, and the next open removes it\n",
                 options_.path.c_str(), failure.c_str());
  }

  // Removes the files a failed `operation` wrote, which nothing lists, while
  // its error is in flight: the caller rethrows that error, which names the
  // file and the cause. A removal that fails as well must not take its place
  // (the throwing fs::remove's filesystem_error did): its file is only a
  // stray, which open removes. So it goes to stderr (hps has no logger) and
  // the stats, and the other files are still removed.
  void RemoveAfterFailure(const std::vector<std::string>& paths, const char* operation) {
    for (const std::string& path : paths) {
      std::error_code error;
      fs::remove(path, error);
      if (!error) continue;
      ++counters_.cleanup_failures;
      std::fprintf(stderr, "hps: ssd store %s: remove %s after a failed %s: %s; open removes it\n",
                   options_.path.c_str(), path.c_str(), operation, error.message().c_str());
    }
  }

  // Bound() with put_mutex_ held and no compaction under way, so that only
  // gets run beside it. Everything is read, and the cut stamp's survivors
  // written, before the index changes: a failure until then changes nothing.
  // A damaged file fails no Bound (as it would every Bound after it: every
  // checkpoint of a bounded table). A file whose keys cannot be read has its
  // live keys taken from the index, which holds them all the same (checked
  // at open, or taken from a put or compaction in memory). When some of the
  // cut's survivors cannot be read (a rows block failing its CRC, the device
  // failing its read twice), the cut is left undone: an erased key stays
  // erased only once every file holding a copy of it is dropped, and the
  // file holding those rows can be neither dropped (its rows would be lost)
  // nor rewritten, while keys of its stamp or a later one may have stale
  // copies in it. The drops of older stamps go on (they hold no key of a
  // later stamp: ssd_format.md's invariant); that file is set aside as a
  // compaction sets one aside (its sound rows read, a get of a bad one
  // raises naming the key), and the store keeps fewer than the cut stamp's
  // keys above max_live, until puts supersede the rows it could not read
  // or the cap grows to take that stamp whole, which reads no row.
  // `report`: what the next commit is to raise of the damaged files met
  // that nothing had set aside for that cause before (so once).
  SsdBoundResult BoundLocked(uint64_t min_stamp, uint64_t max_live, CompactionError* report) {
    struct Group {
      std::vector<uint32_t> files;
      uint64_t live = 0;
    };
    std::map<uint64_t, Group> groups;  // by stamp, ascending
    uint64_t live = 0;  // keys not yet chosen to go
    {
      std::shared_lock lock(mutex_);
      for (const auto& [sequence, handle] : by_sequence_) {
        const FileEntry& e = Entry(handle);
        Group& g = groups[e.stamp];
        g.files.push_back(handle);
        g.live += e.file->header().records - e.stale;  // the index's records in it
      }
      live = index_.size();
    }
    // What goes: the stamps below min_stamp whole (expired); then, oldest
    // first, the stamps that fit in the excess over max_live whole (capped);
    // then the smallest keys of the next one, which is cut.
    struct Drop {
      uint32_t handle;
      bool expired;
    };
    std::vector<Drop> drops;
    const Group* cut = nullptr;
    uint64_t cut_stamp = 0, cut_erase = 0;
    auto it = groups.begin();
    for (; it != groups.end() && it->first < min_stamp; ++it) {
      for (uint32_t h : it->second.files) drops.push_back({h, true});
      live -= it->second.live;
    }
    for (; max_live > 0 && it != groups.end() && live > max_live; ++it) {
      const uint64_t excess = live - max_live;
      if (it->second.live <= excess) {
        for (uint32_t h : it->second.files) drops.push_back({h, false});
        live -= it->second.live;
      } else {
        cut = &it->second;
        cut_stamp = it->first;
        cut_erase = excess;
        break;
      }
    }
    SsdBoundResult result;
    if (drops.empty() && cut == nullptr) return result;

    // A file's live records: its keys read (and checked), each kept where
    // the index points at its slot; or, when they cannot be read, the keys
    // that the index points into the file.
    std::vector<MetDamage> met;
    struct Source {
      uint32_t handle;
      std::shared_ptr<const ParamFile> file;
      std::vector<std::pair<uint64_t, uint64_t>> live;  // (key, slot)
    };
    auto source = [&](uint32_t h) {
      Source s{h, nullptr, {}};
      {
        std::shared_lock lock(mutex_);
        s.file = Entry(h).file;
      }
      std::vector<uint64_t> keys;
      bool read = true;
      try {
        ReadOrDamaged(h, Damage::kKeys, [&] { keys = s.file->ReadKeys(); });
      } catch (const DamagedFile& e) {
        read = false;
        met.push_back({e, IsNews(e)});
      }
      std::shared_lock lock(mutex_);
      if (read) {
        for (uint64_t slot = 0; slot < keys.size(); ++slot) {
          if (index_.Find(keys[slot]) == RecordId(h, slot)) s.live.emplace_back(keys[slot], slot);
        }
      } else {
        const uint32_t first = RecordId(h, 0);
        index_.ForEachValueIn(first, uint64_t{first} + slots_per_file_,
                              [&](uint64_t key, uint32_t id) { s.live.emplace_back(key, id - first); });
      }
      return s;
    };
    std::vector<Source> dropped;
    for (const Drop& d : drops) dropped.push_back(source(d.handle));

    // The cut stamp: its live records by key, the first cut_erase erased,
    // the rest read and written into new files of the same stamp.
    struct Kept {
      uint64_t key;
      uint32_t from;  // record id in a cut file
    };
    std::vector<Source> cut_files;
    std::vector<Kept> kept;
    std::vector<uint64_t> cut_away;
    struct Output {
      uint64_t sequence;
      std::shared_ptr<const ParamFile> file;
    };
    std::vector<Output> outputs;
    uint64_t bytes = 0;
    bool cut_left = false;  // left undone: survivors that cannot be read
    if (cut != nullptr) {
      std::vector<Kept> cut_live;
      for (uint32_t h : cut->files) {
        cut_files.push_back(source(h));
        for (const auto& [key, slot] : cut_files.back().live) cut_live.push_back({key, RecordId(h, slot)});
      }
      std::sort(cut_live.begin(), cut_live.end(), [](const Kept& a, const Kept& b) { return a.key < b.key; });
      for (uint64_t i = 0; i < cut_live.size(); ++i) {
        if (i < cut_erase) {
          cut_away.push_back(cut_live[i].key);
        } else {
          kept.push_back(cut_live[i]);
        }
      }
      // Survivors in record-id order: each cut file's rows are read in one plan.
      std::sort(kept.begin(), kept.end(), [](const Kept& a, const Kept& b) { return a.from < b.from; });
      const uint64_t files_out = (kept.size() + options_.file_records - 1) / options_.file_records;
      {
        std::shared_lock lock(mutex_);
        if (entries_.size() - free_handles_.size() + files_out > max_handles_) {
          throw std::runtime_error("ssd store: more than " + std::to_string(max_handles_) +
                                   " files would be live; raise file_records");
        }
      }
      const uint32_t row_bytes = options_.row_bytes;
      std::vector<uint8_t> rows(kept.size() * row_bytes);
      auto io = io_pool_.Acquire();
      for (uint64_t begin = 0; begin < kept.size();) {
        const uint32_t handle = static_cast<uint32_t>(kept[begin].from / slots_per_file_);
        uint64_t end = begin;
        std::vector<uint64_t> slots, slot_keys;
        for (; end < kept.size() && kept[end].from / slots_per_file_ == handle; ++end) {
          slots.push_back(kept[end].from % slots_per_file_);
          slot_keys.push_back(kept[end].key);
        }
        const ParamFile& file =
            *std::find_if(cut_files.begin(), cut_files.end(), [&](const Source& f) { return f.handle == handle; })->file;
        const ParamFile::RowsPlan plan = file.PlanRows(slots.data(), slots.size());
        detail::AlignedBuffer buffer(plan.bytes);
        std::vector<detail::IoRequest> reads;
        file.AddReads(plan, buffer.data(), &reads);
        try {
          ReadOrDamaged(handle, Damage::kRows, [&] {
            io->ReadAll(reads);
            file.CopyRows(plan, buffer.data(), slots.data(), slot_keys.data(), slots.size(),
                          rows.data() + begin * row_bytes);
          });
        } catch (const DamagedFile& e) {
          met.push_back({e, IsNews(e)});
          cut_left = true;
          break;
        }
        counters_.bytes_read += plan.bytes;
        begin = end;
      }
      if (cut_left) {
        cut = nullptr;
      } else {
        try {
          for (uint64_t begin = 0; begin < kept.size(); begin += options_.file_records) {
            const uint64_t count = std::min<uint64_t>(options_.file_records, kept.size() - begin);
            detail::ParamFileImage image(row_bytes, count);
            for (uint64_t j = 0; j < count; ++j) {
              image.keys()[j] = kept[begin + j].key;
              std::memcpy(image.row(j), rows.data() + (begin + j) * row_bytes, row_bytes);
            }
            const uint64_t sequence = next_sequence_++;
            outputs.push_back({sequence, WriteFile(image, sequence, cut_stamp, *io, &bytes)});
          }
        } catch (...) {
          std::vector<std::string> paths;
          for (const Output& out : outputs) paths.push_back(out.file->path());
          RemoveAfterFailure(paths, "bound");
          throw;
        }
      }
    }

    // Nothing below throws but bad_alloc, which the reserves take first.
    uint64_t dropped_records = 0;
    for (const Source& f : dropped) dropped_records += f.live.size();
    result.expired.reserve(dropped_records);
    result.capped.reserve(dropped_records + cut_away.size());
    dropped_.reserve(dropped_.size() + dropped.size() + cut_files.size());
    uncommitted_.reserve(uncommitted_.size() + outputs.size());
    auto forget = [&](uint32_t h) {  // REQUIRES: mutex_ held exclusively
      FileEntry& e = Entry(h);
      dropped_.push_back({e.file, e.committed});
      if (!e.committed) {  // a put's since the last commit, or an earlier Bound's output
        const auto at = std::find(uncommitted_.begin(), uncommitted_.end(), h);
        if (at != uncommitted_.end()) uncommitted_.erase(at);
      }
      RemoveEntry(h);
    };
    // One file at a time, so that readers wait one file's keys at most.
    for (size_t d = 0; d < dropped.size(); ++d) {
      const Source& f = dropped[d];
      std::vector<uint64_t>& out = drops[d].expired ? result.expired : result.capped;
      std::unique_lock lock(mutex_);
      for (const auto& [key, slot] : f.live) {
        if (index_.Find(key) != RecordId(f.handle, slot)) continue;  // a stale copy
        index_.Erase(key);
        out.push_back(key);
      }
      forget(f.handle);
      ++result.files_dropped;
    }
    if (cut != nullptr) {
      std::unique_lock lock(mutex_);
      uint64_t at = 0;
      for (Output& out : outputs) {
        const uint32_t handle = AddEntry(out.sequence, std::move(out.file), false);
        uncommitted_.push_back(handle);
        const uint64_t count = Entry(handle).file->header().records;
        for (uint64_t j = 0; j < count; ++j, ++at) {
          index_.Replace(kept[at].key, kept[at].from, RecordId(handle, j));  // nothing else moves it now
        }
      }
      for (uint64_t key : cut_away) index_.Erase(key);
      for (const Source& f : cut_files) forget(f.handle);
      result.capped.insert(result.capped.end(), cut_away.begin(), cut_away.end());
      result.records_rewritten = kept.size();
    }
    counters_.bytes_written += bytes;
    std::sort(result.expired.begin(), result.expired.end());
    std::sort(result.capped.begin(), result.capped.end());

    // The damaged files that stay (those of a cut left undone) are set aside;
    // those never set aside for their cause before are told, once.
    std::string message;
    {
      std::unique_lock lock(mutex_);
      for (const MetDamage& m : met) {
        const bool stays = cut_left && std::any_of(cut_files.begin(), cut_files.end(),
                                                   [&](const Source& f) { return f.handle == m.error.handle; });
        if (stays) MarkDamaged(&Entry(m.error.handle), m.error.damage, m.error.unreadable);
        if (!m.news) continue;
        if (message.empty()) report->corruption = !m.error.unreadable;
        message += std::string(message.empty() ? "" : "; ") + m.error.what();
        if (m.error.damage == Damage::kKeys) {
          message += "; bound() found the file's live keys in the index instead";
        } else {
          message += "; bound() left the cut of stamp " + std::to_string(cut_stamp) +
                     " undone (the file as it is: its sound rows still read), so the store keeps " +
                     std::to_string(index_.size()) + " keys, over max_live = " + std::to_string(max_live) +
                     ", until puts supersede the rows it could not read";
        }
      }
    }
    if (!message.empty()) report->message = "bound() met a damaged file: " + message;
    return result;
  }

  // A damaged file Bound met, and whether nothing had set it aside for that
  // cause and that part (its keys, or only its rows) before: it is told once.
  struct MetDamage {
    DamagedFile error;
    bool news;
  };
  bool IsNews(const DamagedFile& e) const {
    std::shared_lock lock(mutex_);
    const FileEntry& f = Entry(e.handle);
    return !(e.unreadable ? f.unreadable : f.corrupt) || f.damage < e.damage;
  }

  bool OverTrigger() const {
    std::shared_lock lock(mutex_);
    return static_cast<double>(records_on_disk_) > options_.compaction_trigger * static_cast<double>(index_.size());
  }

  // Chooses the victims: every committed file more than half stale, and,
  // when `to_trigger` and that would still leave disk use above the
  // trigger, the most stale of the rest (under uniform updates every file
  // goes stale at the same pace and few ever pass half). May choose none
  // when `to_trigger`: files set aside as damaged may hold the excess. REQUIRES:
  // put_mutex_ held (no put between the commit and the reserved sequences).
  CompactionJob Plan(bool to_trigger) {
    std::unique_lock lock(mutex_);
    std::vector<uint32_t> candidates;
    for (const auto& [sequence, handle] : by_sequence_) {
      const FileEntry& e = Entry(handle);
      if (!e.committed || e.stale == 0) continue;
      // A file set aside as damaged fails every run that reads it again:
      // those a commit starts pass it over while they would have to (while
      // it holds a live record, in a bad block or not; always, when its keys
      // failed), so that one damaged file does not fail them all. Compact()
      // tries it again.
      if (to_trigger && (e.damage == Damage::kKeys ||
                         (e.damage == Damage::kRows && e.stale < e.file->header().records))) {
        continue;
      }
      candidates.push_back(handle);
    }
    auto stale_fraction = [&](uint32_t h) {
      return static_cast<double>(Entry(h).stale) / static_cast<double>(Entry(h).file->header().records);
    };
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](uint32_t a, uint32_t b) { return stale_fraction(a) > stale_fraction(b); });
    // Aim halfway between live and the trigger, so compactions do not follow
    // every commit.
    const double live = static_cast<double>(index_.size());
    const double target = live * (1.0 + (options_.compaction_trigger - 1.0) / 2.0);
    double on_disk = static_cast<double>(records_on_disk_);
    std::vector<uint32_t> victims;
    for (uint32_t h : candidates) {
      const bool half_stale = 2 * Entry(h).stale > Entry(h).file->header().records;
      if (!half_stale && !(to_trigger && on_disk > target)) break;
      victims.push_back(h);
      on_disk -= static_cast<double>(Entry(h).stale);
    }
    // A chunk's output files take its victims' stamp, so a chunk holds one
    // stamp: a row rewritten by compaction stays as old as it was, and Bound
    // can still drop or keep files whole by stamp.
    std::stable_sort(victims.begin(), victims.end(),
                     [&](uint32_t a, uint32_t b) { return Entry(a).stamp < Entry(b).stamp; });
    CompactionJob job;
    uint64_t outputs = 0, chunk_live = 0;
    for (uint32_t h : victims) {
      FileEntry& e = Entry(h);
      e.victim = true;
      if (job.chunks.empty() || chunk_live >= options_.file_records ||
          Entry(job.chunks.back().front()).stamp != e.stamp) {
        outputs += (chunk_live + options_.file_records - 1) / options_.file_records;
        job.chunks.emplace_back();
        chunk_live = 0;
      }
      job.chunks.back().push_back(h);
      chunk_live += e.file->header().records - e.stale;
    }
    outputs += (chunk_live + options_.file_records - 1) / options_.file_records;
    job.next_sequence = next_sequence_;
    next_sequence_ += outputs;
    job.end_sequence = next_sequence_;
    return job;
  }

  void CompactorLoop() {
    std::unique_lock lock(compaction_mutex_);
    for (;;) {
      compaction_cv_.wait(lock, [this] { return stopping_ || job_.has_value(); });
      if (stopping_) return;
      CompactionJob job = std::move(*job_);
      job_.reset();
      lock.unlock();
      const CompactionError error = RunCompaction(std::move(job));
      // Puts committed during the run may have pushed disk use over the
      // trigger again; with nothing uncommitted, a new job can be planned.
      std::unique_lock put_lock(put_mutex_);
      lock.lock();
      bool again = false;
      if (error.empty() && !stopping_) {
        std::shared_lock index_lock(mutex_);
        again = uncommitted_.empty();
      }
      if (again && OverTrigger()) {
        CompactionJob next = Plan(/*to_trigger=*/true);
        if (!next.chunks.empty()) {  // else looping here would plan the same nothing for good
          job_ = std::move(next);
          continue;
        }
      }
      lock.unlock();
      put_lock.unlock();
      CompactionError failure;
      if (!error.empty()) {
        failure = {"a background compaction failed: " + error.message + kCompactsAgain, error.corruption};
        // hps has no logger; the next commit() raises this as well.
        std::fprintf(stderr, "hps: ssd store %s: %s\n", options_.path.c_str(), failure.message.c_str());
      }
      FinishCompaction(error, failure);
      lock.lock();
    }
  }

  // Runs a planned job chunk by chunk. Returns the error that stopped it, or
  // else the first damaged file it met, or nothing (either is counted in the
  // stats); a failed chunk changes nothing, the chunks before it stay done.
  // A victim that fails its checks, or a read twice, is set aside (SetAside)
  // and its chunk run again without it: reading it would fail every
  // compaction from then on, and the other files' stale records would pile
  // up behind it.
  CompactionError RunCompaction(CompactionJob job) {
    CompactionError error;
    size_t done = 0;
    bool swapped = false;  // a chunk committed
    try {
      for (; done < job.chunks.size(); ++done) {
        {
          std::lock_guard lock(compaction_mutex_);
          if (stopping_) break;
        }
        std::vector<uint32_t>& chunk = job.chunks[done];
        while (!chunk.empty()) {
          try {
            CompactChunk(chunk, &job);
            swapped = true;
            break;
          } catch (const DamagedFile& e) {  // thrown before the chunk wrote anything
            SetAside(e.handle, e.damage, e.unreadable);
            chunk.erase(std::find(chunk.begin(), chunk.end(), e.handle));
            if (error.empty()) {
              error = {std::string(e.what()) +
                           "; compaction left that file as it is (its sound rows still read) and went on "
                           "without it; compactions at commit pass it over, compact() tries it again",
                       !e.unreadable};
            }
          }
        }
      }
    } catch (const std::exception& e) {
      error = {error.empty() ? e.what() : e.what() + std::string(" (before it, this run met: ") + error.message + ")",
               false};
    }
    if (!error.empty()) ++counters_.compaction_failures;
    // A run counts once, however many chunks it swapped in (each its own
    // manifest commit), once one has: a run stopped at a later chunk is a
    // compaction and a failure both.
    if (swapped) ++counters_.compactions;
    std::unique_lock lock(mutex_);
    for (size_t c = done; c < job.chunks.size(); ++c) {
      for (uint32_t h : job.chunks[c]) Entry(h).victim = false;
    }
    superseded_victim_copies_.clear();
    return error;
  }

  // `failure`: what the next commit() is to raise for the error (none when
  // the caller raises it itself, as Compact() and an inline commit do).
  void FinishCompaction(const CompactionError& error = {}, const CompactionError& failure = {}) {
    {
      std::lock_guard lock(compaction_mutex_);
      compaction_active_ = false;
      if (!error.empty()) last_error_ = error.message;
      // After any the next commit has yet to raise, which it must not hide
      // (a background run's, before a Bound's; that one's type stands).
      if (!failure.empty()) {
        if (unreported_failure_.empty()) {
          unreported_failure_ = failure;
        } else {
          unreported_failure_.message += "; and then: " + failure.message;
        }
      }
    }
    compaction_cv_.notify_all();
  }

  // Leaves a victim found damaged as it is: its records stay in the index and
  // on disk (a get of a sound row reads it, one of a bad block raises
  // CorruptionError naming the file, the block and the key, or IoError naming
  // the offset, and nothing drops a row whose only copy it holds), no longer
  // a victim of this run, and marked so that the runs commits start pass it
  // over (Plan). Its copies that puts superseded meanwhile, remembered for
  // the run, are still in it. Open forgets the mark, and its first run meets
  // the damage again.
  void SetAside(uint32_t handle, Damage damage, bool unreadable) {
    std::unique_lock lock(mutex_);
    FileEntry& e = Entry(handle);
    e.victim = false;
    MarkDamaged(&e, damage, unreadable);
  }

  // REQUIRES: mutex_ held exclusively.
  static void MarkDamaged(FileEntry* e, Damage damage, bool unreadable) {
    if (e->damage != Damage::kKeys) e->damage = damage;
    (unreadable ? e->unreadable : e->corrupt) = true;
  }

  // Notes that rows move through the page cache although the options asked
  // for O_DIRECT; with require_direct_io that is an error instead.
  void NoteBuffered(const std::string& why) {
    if (options_.require_direct_io) throw IoError(why + " (require_direct_io is set)");
    std::lock_guard lock(io_mutex_);
    buffered_ = true;
    if (buffered_why_.empty()) buffered_why_ = why;
  }
  void CheckDirectReads(const ParamFile& file) {
    if (direct_ && !file.direct()) {
      NoteBuffered("O_DIRECT refused by the filesystem for reads of " + file.path() + ": " +
                   std::strerror(file.direct_error()));
    }
  }
  // Writes `image` as the file of `sequence` and opens it for reads, noting
  // (or, with require_direct_io, refusing) a write or a read descriptor that
  // the filesystem kept off O_DIRECT; a refused file is removed.
  std::shared_ptr<const ParamFile> WriteFile(detail::ParamFileImage& image, uint64_t sequence, uint64_t stamp,
                                             detail::BlockIo& io, uint64_t* bytes) {
    const std::string path = Path(FileName(sequence));
    *bytes += image.Write(path, sequence, io, direct_, stamp);
    try {
      if (image.direct_error() != 0) {
        NoteBuffered("O_DIRECT refused by the filesystem for writes of " + path + ": " +
                     std::strerror(image.direct_error()));
      }
      auto file = std::make_shared<const ParamFile>(ParamFile::Open(path, options_.row_bytes, false, direct_));
      CheckDirectReads(*file);
      return file;
    } catch (...) {
      RemoveAfterFailure({path}, "write");
      throw;
    }
  }

  void CompactChunk(const std::vector<uint32_t>& victims, CompactionJob* job) {
    const uint32_t row_bytes = options_.row_bytes;
    // Keep the copies that were live when the job was planned: those the
    // index still points at, and those a put has superseded since (which
    // stay live-at-planning however the index moves on). Only their rows are
    // read, with no lock held while reading.
    struct Kept {
      uint64_t key;
      uint32_t from;  // record id in a victim
    };
    std::vector<Kept> kept;
    std::vector<uint8_t> rows;
    std::vector<std::shared_ptr<const ParamFile>> sources;
    uint64_t stamp = 0;  // of every victim (Plan)
    {
      std::shared_lock lock(mutex_);
      for (uint32_t h : victims) sources.push_back(Entry(h).file);
      if (!victims.empty()) stamp = Entry(victims.front()).stamp;
    }
    // The rows come through the gets' path (io_uring, O_DIRECT where the file
    // takes it), each block checked against its CRC; the keys, 8 bytes a
    // record, are read whole and checked against theirs. The same BlockIo
    // writes the new files.
    // A victim that fails its checks, or a read twice, throws DamagedFile,
    // before anything is written: RunCompaction sets it aside and runs the
    // chunk again.
    auto io = io_pool_.Acquire();
    for (size_t v = 0; v < victims.size(); ++v) {
      std::vector<uint64_t> keys;
      ReadOrDamaged(victims[v], Damage::kKeys, [&] { keys = sources[v]->ReadKeys(); });
      std::vector<uint64_t> slots, slot_keys;
      {
        std::shared_lock lock(mutex_);
        for (uint64_t slot = 0; slot < keys.size(); ++slot) {
          const uint32_t id = RecordId(victims[v], slot);
          bool live = index_.Find(keys[slot]) == id;
          if (!live) {
            const auto it = superseded_victim_copies_.find(keys[slot]);
            live = it != superseded_victim_copies_.end() && it->second == id;
          }
          if (!live) continue;
          slots.push_back(slot);
          slot_keys.push_back(keys[slot]);
          kept.push_back({keys[slot], id});
        }
      }
      const size_t before = rows.size();
      rows.resize(before + slots.size() * row_bytes);
      const detail::ParamFile::RowsPlan plan = sources[v]->PlanRows(slots.data(), slots.size());
      detail::AlignedBuffer buffer(plan.bytes);
      std::vector<detail::IoRequest> reads;
      sources[v]->AddReads(plan, buffer.data(), &reads);
      ReadOrDamaged(victims[v], Damage::kRows, [&] {
        io->ReadAll(reads);  // a file cut short is CorruptionError too
        sources[v]->CopyRows(plan, buffer.data(), slots.data(), slot_keys.data(), slots.size(), rows.data() + before);
      });
      counters_.bytes_read += plan.bytes;
    }
    // New files, synced; on failure they go and nothing else changed.
    struct Output {
      uint64_t sequence;
      std::shared_ptr<const ParamFile> file;
      uint64_t begin, count;  // in kept
    };
    std::vector<Output> outputs;
    std::vector<uint32_t> handles;  // the outputs', taken before the commit
    bool commit_may_stand = false;  // the manifest commit failed in its sync
    uint64_t bytes = 0;
    try {
      for (uint64_t begin = 0; begin < kept.size(); begin += options_.file_records) {
        const uint64_t count = std::min<uint64_t>(options_.file_records, kept.size() - begin);
        if (job->next_sequence >= job->end_sequence) {
          throw std::logic_error("ssd store compaction: more live records than planned");
        }
        const uint64_t sequence = job->next_sequence++;
        detail::ParamFileImage image(row_bytes, count);
        for (uint64_t j = 0; j < count; ++j) {
          image.keys()[j] = kept[begin + j].key;
          std::memcpy(image.row(j), rows.data() + (begin + j) * row_bytes, row_bytes);
        }
        auto file = WriteFile(image, sequence, stamp, *io, &bytes);
        outputs.push_back({sequence, file, begin, count});
        file->Sync();
      }
      SyncDirectory(options_.path);
      // Once the manifest has dropped the victims, the swap below must not
      // fail: a store still serving them would drop them again at its next
      // compaction, and no replay accepts a drop of a file that is gone. So
      // the outputs take their handles (record ids) now, where running out
      // of them (file_records too large for this many files) still changes
      // nothing. Unindexed, they serve no get until the swap.
      {
        std::unique_lock lock(mutex_);
        free_handles_.reserve(free_handles_.size() + victims.size());  // RemoveEntry's, in the swap
        for (const Output& out : outputs) handles.push_back(AddEntry(out.sequence, out.file, false));
      }
      std::lock_guard manifest_lock(manifest_mutex_);
      for (const Output& out : outputs) manifest_->AddFile(out.sequence, out.count);
      for (const auto& victim : sources) manifest_->DropFile(victim->header().sequence);
      try {
        CommitManifest();
      } catch (...) {
        commit_may_stand = manifest_->failed_commit_may_stand();
        throw;
      }
      ++commits_;
    } catch (...) {
      {
        std::unique_lock lock(mutex_);
        for (uint32_t handle : handles) RemoveEntry(handle);
      }
      // A commit whose sync failed may be on disk after all (and reopen to
      // it after a crash): its files stay, and an open that finds them
      // unlisted removes them. The victims stay either way.
      if (!commit_may_stand) {
        std::vector<std::string> paths;
        for (const Output& out : outputs) paths.push_back(out.file->path());
        RemoveAfterFailure(paths, "compaction");
      }
      throw;
    }
    // Committed: swap the index over. Readers wait for this block only.
    const auto swap_start = std::chrono::steady_clock::now();
    {
      std::unique_lock lock(mutex_);
      for (size_t o = 0; o < outputs.size(); ++o) {
        const Output& out = outputs[o];
        const uint32_t handle = handles[o];
        Entry(handle).committed = true;
        for (uint64_t j = 0; j < out.count; ++j) {
          const Kept& k = kept[out.begin + j];
          const uint32_t to = RecordId(handle, j);
          if (index_.Replace(k.key, k.from, to)) continue;
          Entry(handle).stale += 1;  // a put superseded it since planning
          const auto it = superseded_victim_copies_.find(k.key);
          if (it != superseded_victim_copies_.end() && it->second == k.from) it->second = to;
        }
      }
      for (uint32_t h : victims) RemoveEntry(h);
    }
    const uint64_t swap_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                       std::chrono::steady_clock::now() - swap_start)
                                                       .count());
    uint64_t max_ns = counters_.compaction_lock_max_ns;
    while (swap_ns > max_ns && !counters_.compaction_lock_max_ns.compare_exchange_weak(max_ns, swap_ns)) {
    }
    // A crash before these removals leaves files the manifest no longer
    // lists; open removes them. Readers still holding one keep reading it.
    std::vector<std::string> victim_paths;
    for (const auto& victim : sources) victim_paths.push_back(victim->path());
    RemoveUnlisted(victim_paths);
    counters_.bytes_written += bytes;
    counters_.compacted_records += kept.size();
  }

  const SsdStoreOptions options_;
  detail::BlockIoPool io_pool_;
  uint64_t slots_per_file_ = 0;  // record ids: handle * this + slot; >= every file's records
  uint64_t max_handles_ = 0;

  // Lock order: put_mutex_, compaction_mutex_, manifest_mutex_, mutex_.
  std::mutex put_mutex_;  // one put or commit at a time: files enter the index in sequence order
  uint64_t next_sequence_ = 1;                   // guarded by put_mutex_
  mutable std::shared_mutex mutex_;              // the index and the files; readers share it
  detail::CompactKeyIndex index_;                // 10 bytes a slot: it holds every key on disk
  std::vector<FileEntry> entries_;               // by handle
  std::vector<uint32_t> free_handles_;
  std::map<uint64_t, uint32_t> by_sequence_;     // sequence -> handle
  std::vector<uint32_t> uncommitted_;            // handles written since the last commit
  uint64_t records_on_disk_ = 0;
  std::unordered_map<uint64_t, uint32_t> superseded_victim_copies_;  // key -> victim record id
  std::mutex manifest_mutex_;
  std::unique_ptr<ManifestWriter> manifest_;
  std::atomic<uint64_t> commits_{0};
  std::atomic<uint64_t> stamp_{0};               // what puts write; never goes back
  std::vector<Dropped> dropped_;                 // guarded by put_mutex_: Bound's, until the next commit
  std::string unsyncable_;                       // guarded by put_mutex_: why every commit fails, once a
                                                 // file failed to sync

  mutable std::mutex compaction_mutex_;
  std::condition_variable compaction_cv_;
  bool compaction_active_ = false;  // a job is planned or running
  bool stopping_ = false;
  std::optional<CompactionJob> job_;  // handed to the background thread
  std::string last_error_;
  CompactionError unreported_failure_;  // a compaction's failure the next commit() raises
  std::thread compactor_;

  bool direct_ = false;  // O_DIRECT asked for, and the filesystem took it at open
  mutable std::mutex io_mutex_;
  bool buffered_ = false;     // guarded by io_mutex_: some rows moved without O_DIRECT after all
  std::string buffered_why_;  // guarded by io_mutex_: the first reason
  Counters counters_;
};

}  // namespace

std::unique_ptr<SsdStore> SsdStore::Open(const SsdStoreOptions& options) {
  if (options.path.empty()) throw std::invalid_argument("ssd store: path must not be empty");
  if (options.row_bytes == 0) throw std::invalid_argument("ssd store: row_bytes must be > 0");
  if (options.file_records == 0) throw std::invalid_argument("ssd store: file_records must be > 0");
  if (options.require_direct_io && !options.direct_io) {
    throw std::invalid_argument("ssd store: require_direct_io needs direct_io");
  }
  if (!(options.compaction_trigger >= 1.0)) {
    throw std::invalid_argument("ssd store: compaction_trigger must be >= 1 (records on disk / live records)");
  }
  return std::make_unique<FileStore>(options);
}

}  // namespace hps
