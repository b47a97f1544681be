#include "hps/ssd_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "block_reader.h"
#include "manifest.h"
#include "param_file.h"

namespace hps {
namespace {

namespace fs = std::filesystem;
using detail::ManifestWriter;
using detail::ParamFile;

constexpr const char* kStoreMarker = "STORE";
constexpr const char* kManifest = "MANIFEST";
constexpr const char* kFileSuffix = ".hpf";
constexpr int kStoreVersion = 1;
constexpr uint64_t kReadWaveBytes = uint64_t{64} << 20;  // blocks buffered per wave of a get

[[noreturn]] void ThrowErrno(const std::string& what, const std::string& path) {
  throw IoError(path + ": " + what + ": " + std::strerror(errno));
}

// Makes the directory's entries (created and removed files) durable.
void SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) ThrowErrno("open directory", dir);
  const int rc = fsync(fd);
  const int error = errno;
  close(fd);
  errno = error;
  if (rc != 0) ThrowErrno("sync directory", dir);
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
  if (!fs::is_empty(dir)) {
    throw std::invalid_argument(dir + " is not an hps store (no " + kStoreMarker +
                                " file) and is not empty; give a new or empty directory");
  }
  const std::string tmp = marker + ".tmp";
  {
    std::ofstream out(tmp);
    out << "hps-ssd-store " << kStoreVersion << "\nrow_bytes " << row_bytes << "\n";
    out.flush();
    if (!out) ThrowErrno("write", tmp);
  }
  const int fd = open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || fsync(fd) != 0) ThrowErrno("sync", tmp);
  close(fd);
  if (std::rename(tmp.c_str(), marker.c_str()) != 0) ThrowErrno("rename", tmp);
  SyncDirectory(dir);
}

class FileStore final : public SsdStore {
 public:
  explicit FileStore(const SsdStoreOptions& options)
      : options_(options), reader_(detail::NewBlockReader(options.use_io_uring)) {
    const std::string& dir = options_.path;
    if (fs::exists(dir) && !fs::is_directory(dir)) {
      throw std::invalid_argument(dir + " is not a directory, so not an hps store");
    }
    fs::create_directories(dir);
    CheckOrCreateMarker(dir, options_.row_bytes);

    const std::string manifest = Path(kManifest);
    const detail::ManifestReplay replay = detail::ReplayManifest(manifest);
    commits_ = replay.state.commits;
    next_sequence_ = replay.state.max_sequence + 1;
    // Files not in the last commit were written by puts that were never
    // committed (or by a crash mid-write): they are not part of the store.
    for (const auto& entry : fs::directory_iterator(dir)) {
      uint64_t sequence = 0;
      if (!ParseFileName(entry.path().filename().string(), &sequence)) continue;
      next_sequence_ = std::max(next_sequence_, sequence + 1);
      if (replay.state.live_files.count(sequence) == 0) fs::remove(entry.path());
    }
    for (const auto& [sequence, records] : replay.state.live_files) {  // ascending: later wins
      const std::string file = Path(FileName(sequence));
      if (!fs::exists(file)) {
        throw CorruptionError(file + ": listed as live in " + manifest + " but missing");
      }
      ParamFile f = ParamFile::Open(file, options_.row_bytes, options_.verify_rows_on_open,
                                    options_.direct_io);
      if (f.header().records != records || f.header().sequence != sequence) {
        throw CorruptionError(file + ": header says sequence " +
                              std::to_string(f.header().sequence) + " with " +
                              std::to_string(f.header().records) + " records, " + manifest +
                              " says " + std::to_string(sequence) + " with " + std::to_string(records));
      }
      Index(sequence, std::move(f));
    }
    SyncDirectory(dir);  // the removals above
    manifest_ = std::make_unique<ManifestWriter>(manifest, replay.valid_bytes);
  }

  void Put(const uint64_t* keys, uint64_t n, const uint8_t* rows) override {
    CheckKeys(keys, n);
    std::lock_guard lock(mutex_);
    // The last of duplicate keys wins: keep one record per key.
    std::vector<uint64_t> order;
    order.reserve(n);
    {
      std::unordered_set<uint64_t> seen;
      seen.reserve(n);
      for (uint64_t i = n; i-- > 0;) {
        if (seen.insert(keys[i]).second) order.push_back(i);
      }
      std::reverse(order.begin(), order.end());
    }
    // Write every file first; only a fully written batch enters the index, so
    // a failed put (a full disk, say) changes nothing.
    const uint32_t row_bytes = options_.row_bytes;
    std::vector<std::pair<uint64_t, ParamFile>> written;
    try {
      std::vector<uint64_t> file_keys;
      std::vector<uint8_t> file_rows;
      for (uint64_t begin = 0; begin < order.size(); begin += options_.file_records) {
        const uint64_t count = std::min<uint64_t>(options_.file_records, order.size() - begin);
        file_keys.resize(count);
        file_rows.resize(count * row_bytes);
        for (uint64_t j = 0; j < count; ++j) {
          const uint64_t i = order[begin + j];
          file_keys[j] = keys[i];
          std::memcpy(file_rows.data() + j * row_bytes, rows + i * row_bytes, row_bytes);
        }
        const uint64_t sequence = next_sequence_++;
        const std::string file = Path(FileName(sequence));
        stats_.bytes_written +=
            detail::WriteParamFile(file, sequence, row_bytes, file_keys.data(), file_rows.data(), count);
        written.emplace_back(sequence, ParamFile::Open(file, row_bytes, false, options_.direct_io));
      }
    } catch (...) {
      for (const auto& entry : written) fs::remove(entry.second.path());
      throw;
    }
    for (auto& [sequence, file] : written) {
      uncommitted_.push_back(sequence);
      Index(sequence, std::move(file));
    }
    stats_.rows_written += order.size();
  }

  uint64_t Get(const uint64_t* keys, uint64_t n, uint8_t* rows_out, uint8_t* found) override {
    CheckKeys(keys, n);
    std::lock_guard lock(mutex_);
    const uint32_t row_bytes = options_.row_bytes;
    // Group the requests by file, so each file is read once per call.
    std::map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>> by_file;  // seq -> (slot, i)
    uint64_t hits = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const auto it = index_.find(keys[i]);
      if (found) found[i] = it != index_.end();
      if (it == index_.end()) {
        std::memset(rows_out + i * row_bytes, 0, row_bytes);
        continue;
      }
      by_file[it->second.sequence].emplace_back(it->second.slot, i);
      ++hits;
    }
    // Plan every file's block runs, then read them in waves of at most
    // kReadWaveBytes, with all of a wave's reads in flight at once.
    struct Group {
      const ParamFile* file;
      std::vector<uint64_t> slots;
      const std::vector<std::pair<uint64_t, uint64_t>>* requests;
      ParamFile::RowsPlan plan;
      uint64_t offset = 0;  // in the wave's buffer
    };
    std::vector<Group> groups;
    groups.reserve(by_file.size());
    for (const auto& [sequence, requests] : by_file) {
      Group g{&files_.at(sequence).file, {}, &requests, {}, 0};
      for (const auto& r : requests) g.slots.push_back(r.first);
      g.plan = g.file->PlanRows(g.slots.data(), g.slots.size());
      groups.push_back(std::move(g));
    }
    std::vector<uint8_t> rows;
    for (size_t begin = 0; begin < groups.size();) {
      size_t end = begin;
      uint64_t bytes = 0;
      while (end < groups.size() && (end == begin || bytes + groups[end].plan.bytes <= kReadWaveBytes)) {
        groups[end].offset = bytes;
        bytes += groups[end].plan.bytes;
        ++end;
      }
      detail::AlignedBuffer buffer(bytes);
      std::vector<detail::ReadRequest> reads;
      for (size_t g = begin; g < end; ++g) {
        groups[g].file->AddReads(groups[g].plan, buffer.data() + groups[g].offset, &reads);
      }
      reader_->ReadAll(reads);
      stats_.bytes_read += bytes;
      for (size_t g = begin; g < end; ++g) {
        const Group& group = groups[g];
        rows.resize(group.slots.size() * row_bytes);
        group.file->CopyRows(group.plan, buffer.data() + group.offset, group.slots.data(),
                             group.slots.size(), rows.data());
        for (size_t j = 0; j < group.slots.size(); ++j) {
          std::memcpy(rows_out + (*group.requests)[j].second * row_bytes, rows.data() + j * row_bytes,
                      row_bytes);
        }
      }
      begin = end;
    }
    stats_.rows_read += hits;
    stats_.bytes_requested += hits * row_bytes;
    return hits;
  }

  void Commit() override {
    std::lock_guard lock(mutex_);
    CommitLocked();
    uint64_t on_disk = 0;
    for (const auto& entry : files_) on_disk += entry.second.file.header().records;
    if (static_cast<double>(on_disk) > options_.compaction_trigger * static_cast<double>(index_.size())) {
      try {
        CompactLocked();
      } catch (const std::exception& e) {
        // The user's commit above stands; the compaction changed nothing.
        ++stats_.compaction_failures;
        stats_.last_error = e.what();
      }
    }
  }

  void Compact() override {
    std::lock_guard lock(mutex_);
    CommitLocked();
    CompactLocked();
  }

  uint64_t size() const override {
    std::lock_guard lock(mutex_);
    return index_.size();
  }

  uint32_t row_bytes() const override { return options_.row_bytes; }

  SsdStoreStats stats() const override {
    std::lock_guard lock(mutex_);
    SsdStoreStats s = stats_;
    s.files = files_.size();
    s.live_records = index_.size();
    s.commits = commits_;
    s.io_path = reader_->name();
    if (!files_.empty() && files_.begin()->second.file.direct()) s.io_path += "+O_DIRECT";
    for (const auto& [sequence, f] : files_) {
      s.stale_records += f.stale;
      s.disk_bytes += f.file.layout().file_bytes();
    }
    return s;
  }

 private:
  struct Location {
    uint64_t sequence;
    uint64_t slot;
  };
  struct LiveFile {
    ParamFile file;
    uint64_t stale = 0;  // records whose key now lives in a later file
  };

  std::string Path(const std::string& name) const { return (fs::path(options_.path) / name).string(); }

  // REQUIRES: mutex_ held.
  void CommitLocked() {
    SyncDirectory(options_.path);  // the new files' names, before the manifest points at them
    for (uint64_t sequence : uncommitted_) {
      manifest_->AddFile(sequence, files_.at(sequence).file.header().records);
    }
    manifest_->Commit();
    uncommitted_.clear();
    ++commits_;
  }

  // REQUIRES: mutex_ held, nothing uncommitted (the index is the committed state).
  void CompactLocked() {
    std::vector<uint64_t> victims;
    for (const auto& [sequence, f] : files_) {
      if (2 * f.stale > f.file.header().records) victims.push_back(sequence);
    }
    if (victims.empty()) return;
    // The live records of the victims, read file by file.
    const uint32_t row_bytes = options_.row_bytes;
    std::vector<uint64_t> keys;
    std::vector<uint8_t> rows;
    std::vector<uint64_t> slots;
    for (uint64_t sequence : victims) {
      const ParamFile& file = files_.at(sequence).file;
      slots.clear();
      for (uint64_t slot = 0; slot < file.keys().size(); ++slot) {
        const Location& at = index_.at(file.keys()[slot]);
        if (at.sequence == sequence && at.slot == slot) slots.push_back(slot);
      }
      const size_t before = keys.size();
      for (uint64_t slot : slots) keys.push_back(file.keys()[slot]);
      rows.resize(keys.size() * row_bytes);
      stats_.bytes_read += file.ReadRows(slots.data(), slots.size(), rows.data() + before * row_bytes);
    }
    // New files first; if any write fails, they go and nothing else changed.
    std::vector<std::pair<uint64_t, ParamFile>> written;
    try {
      for (uint64_t begin = 0; begin < keys.size(); begin += options_.file_records) {
        const uint64_t count = std::min<uint64_t>(options_.file_records, keys.size() - begin);
        const uint64_t sequence = next_sequence_++;
        const std::string file = Path(FileName(sequence));
        stats_.bytes_written += detail::WriteParamFile(file, sequence, row_bytes, keys.data() + begin,
                                                       rows.data() + begin * row_bytes, count);
        written.emplace_back(sequence, ParamFile::Open(file, row_bytes, false, options_.direct_io));
      }
      SyncDirectory(options_.path);
      for (const auto& [sequence, file] : written) manifest_->AddFile(sequence, file.header().records);
      for (uint64_t sequence : victims) manifest_->DropFile(sequence);
      manifest_->Commit();
    } catch (...) {
      for (const auto& entry : written) fs::remove(entry.second.path());
      throw;
    }
    // Committed: swap the index over, then delete the victims (a crash before
    // the deletion leaves files the manifest no longer lists; open removes them).
    for (auto& [sequence, file] : written) Index(sequence, std::move(file));
    for (uint64_t sequence : victims) {
      const std::string path = files_.at(sequence).file.path();
      files_.erase(sequence);
      fs::remove(path);
    }
    SyncDirectory(options_.path);
    ++commits_;
    ++stats_.compactions;
    stats_.compacted_records += keys.size();
  }

  // Points the index at every record of `file`; the copies it supersedes go stale.
  void Index(uint64_t sequence, ParamFile file) {
    const std::vector<uint64_t>& keys = file.keys();
    for (uint64_t slot = 0; slot < keys.size(); ++slot) {
      auto [it, inserted] = index_.try_emplace(keys[slot], Location{sequence, slot});
      if (!inserted) {
        files_.at(it->second.sequence).stale += 1;
        it->second = Location{sequence, slot};
      }
    }
    files_.emplace(sequence, LiveFile{std::move(file), 0});
  }

  SsdStoreOptions options_;
  std::unique_ptr<detail::BlockReader> reader_;
  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, Location> index_;
  std::map<uint64_t, LiveFile> files_;  // by sequence
  std::vector<uint64_t> uncommitted_;   // sequences written since the last commit
  std::unique_ptr<ManifestWriter> manifest_;
  uint64_t next_sequence_ = 1;
  uint64_t commits_ = 0;
  SsdStoreStats stats_;
};

}  // namespace

std::unique_ptr<SsdStore> SsdStore::Open(const SsdStoreOptions& options) {
  if (options.path.empty()) throw std::invalid_argument("ssd store: path must not be empty");
  if (options.row_bytes == 0) throw std::invalid_argument("ssd store: row_bytes must be > 0");
  if (options.file_records == 0) throw std::invalid_argument("ssd store: file_records must be > 0");
  if (!(options.compaction_trigger >= 1.0)) {
    throw std::invalid_argument("ssd store: compaction_trigger must be >= 1 (records on disk / live records)");
  }
  return std::make_unique<FileStore>(options);
}

}  // namespace hps
