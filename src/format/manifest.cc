#include "format/manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "util/block_io.h"
#include "util/crc32c.h"
#include "format/param_file.h"  // CorruptionError, ReadFully
#include "util/errors.h"       // ThrowErrno

namespace hps::detail {
namespace {

constexpr uint32_t kRecordHeaderBytes = 8;
constexpr uint32_t kMaxPayloadBytes = 1 + 2 * sizeof(uint64_t);

uint64_t Field(const uint8_t* payload, size_t index) {
  uint64_t v;
  std::memcpy(&v, payload + 1 + index * sizeof(uint64_t), sizeof v);
  return v;
}

// The payload length each edit has; 0 for a byte that is no edit.
uint32_t EditLength(uint8_t edit) {
  switch (static_cast<ManifestEdit>(edit)) {
    case ManifestEdit::kAddFile:
      return 17;
    case ManifestEdit::kDropFile:
      return 9;
    case ManifestEdit::kCommit:
      return 1;
    case ManifestEdit::kBase:
      return 17;
  }
  return 0;
}

// Why the record at `at` cannot be read ("" when it is sound: it fits in the
// log and its CRC holds). Its edit is checked by the caller.
std::string RecordFault(const std::vector<uint8_t>& log, uint64_t at) {
  if (at + kRecordHeaderBytes > log.size()) {
    return "header cut off by the end of the file at byte " + std::to_string(log.size());
  }
  uint32_t length, crc;
  std::memcpy(&length, log.data() + at, 4);
  std::memcpy(&crc, log.data() + at + 4, 4);
  if (length == 0 || length > kMaxPayloadBytes) return "payload length " + std::to_string(length);
  if (at + kRecordHeaderBytes + length > log.size()) {
    return "payload of " + std::to_string(length) + " bytes cut off by the end of the file at byte " +
           std::to_string(log.size());
  }
  if (Crc32c(log.data() + at + kRecordHeaderBytes, length) != crc) return "CRC mismatch";
  return "";
}

// Whether a whole, well-formed record starts at `at`.
bool SoundRecordAt(const std::vector<uint8_t>& log, uint64_t at) {
  if (!RecordFault(log, at).empty()) return false;
  uint32_t length;
  std::memcpy(&length, log.data() + at, 4);
  return EditLength(log[at + kRecordHeaderBytes]) == length;
}

}  // namespace

ManifestReplay ReplayManifest(const std::string& path) {
  ManifestReplay replay;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return replay;
    ThrowErrno("open", path);
  }
  std::vector<uint8_t> log;
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    ThrowErrno("stat", path);
  }
  log.resize(static_cast<size_t>(st.st_size));
  try {
    ReadFully(fd, path, 0, log.data(), log.size());
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);

  ManifestState pending = replay.state;
  uint64_t at = 0;
  while (at < log.size()) {
    const std::string fault = RecordFault(log, at);
    if (!fault.empty()) {
      // A crash can tear only the last append (Commit writes its edits and
      // commit record in one append, then syncs; a failed append is cut off
      // before the next), so a torn record is followed by nothing sound. A
      // sound record anywhere after this one means damage inside the log:
      // stop, and change nothing, since the store's open would otherwise
      // remove the files of every commit after it.
      for (uint64_t next = at + 1; next + kRecordHeaderBytes < log.size(); ++next) {
        if (SoundRecordAt(log, next)) {
          throw CorruptionError(path + ": record at byte " + std::to_string(at) + ": " + fault +
                                ", yet a sound record follows at byte " + std::to_string(next) +
                                ": the log is damaged before its end, not torn by a crash");
        }
      }
      break;  // a torn tail: the last append, cut short
    }
    uint32_t length;
    std::memcpy(&length, log.data() + at, 4);
    const uint8_t* payload = log.data() + at + kRecordHeaderBytes;
    const auto edit = static_cast<ManifestEdit>(payload[0]);
    const std::string where = path + ": record at byte " + std::to_string(at) + ": ";
    if (EditLength(payload[0]) != length) {
      throw CorruptionError(where + "unknown edit type " + std::to_string(payload[0]) + " of " +
                            std::to_string(length) + " bytes");
    }
    if (edit == ManifestEdit::kAddFile) {
      const uint64_t seq = Field(payload, 0);
      if (!pending.live_files.emplace(seq, Field(payload, 1)).second) {
        throw CorruptionError(where + "adds file " + std::to_string(seq) + ", which is live");
      }
      pending.max_sequence = std::max(pending.max_sequence, seq);
    } else if (edit == ManifestEdit::kBase) {
      if (at != 0) throw CorruptionError(where + "a base record, which only opens a rolled log");
      pending.commits = Field(payload, 0);
      pending.max_sequence = Field(payload, 1);
    } else if (edit == ManifestEdit::kDropFile) {
      const uint64_t seq = Field(payload, 0);
      if (pending.live_files.erase(seq) == 0) {
        throw CorruptionError(where + "drops file " + std::to_string(seq) + ", which is not live");
      }
    } else {  // kCommit
      pending.commits += 1;
      replay.state = pending;
      replay.valid_bytes = at + kRecordHeaderBytes + length;
    }
    at += kRecordHeaderBytes + length;
  }
  replay.ignored_bytes = log.size() - replay.valid_bytes;
  return replay;
}

uint64_t RolledManifestBytes(const ManifestState& state) {
  return kRecordHeaderBytes + EditLength(static_cast<uint8_t>(ManifestEdit::kBase)) +
         state.live_files.size() * (kRecordHeaderBytes + EditLength(static_cast<uint8_t>(ManifestEdit::kAddFile))) +
         kRecordHeaderBytes + EditLength(static_cast<uint8_t>(ManifestEdit::kCommit));
}

namespace {

std::string RollPath(const std::string& path) { return path + ".tmp"; }

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Makes the directory's entries durable: a roll's rename.
void SyncDirectoryOf(const std::string& path) { detail::SyncDirectory(DirectoryOf(path)); }

}  // namespace

ManifestWriter::ManifestWriter(const std::string& path, const ManifestReplay& replay, uint64_t roll_floor_bytes)
    : path_(path), roll_floor_bytes_(roll_floor_bytes), bytes_(replay.valid_bytes), state_(replay.state) {
  fd_ = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) ThrowErrno("open", path);
  if (ftruncate(fd_, static_cast<off_t>(replay.valid_bytes)) != 0 || fdatasync(fd_) != 0) {
    const int error = errno;
    close(fd_);
    errno = error;
    ThrowErrno("cut back to the last commit", path);
  }
  // A roll cut short by a crash; never read, and the next roll writes over
  // it anyway, so a failure to remove it changes nothing (but is reported).
  const std::string stray = RollPath(path);
  if (unlink(stray.c_str()) != 0 && errno != ENOENT) stray_error_ = stray + ": remove: " + std::strerror(errno);
}

ManifestWriter::~ManifestWriter() {
  if (fd_ >= 0) close(fd_);
}

void ManifestWriter::Append(ManifestEdit edit, const std::vector<uint64_t>& fields) {
  std::vector<uint8_t> payload(1 + fields.size() * sizeof(uint64_t));
  payload[0] = static_cast<uint8_t>(edit);
  if (!fields.empty()) std::memcpy(payload.data() + 1, fields.data(), fields.size() * sizeof(uint64_t));
  const uint32_t length = static_cast<uint32_t>(payload.size());
  const uint32_t crc = Crc32c(payload.data(), payload.size());
  const size_t at = pending_.size();
  pending_.resize(at + kRecordHeaderBytes + length);
  std::memcpy(pending_.data() + at, &length, 4);
  std::memcpy(pending_.data() + at + 4, &crc, 4);
  std::memcpy(pending_.data() + at + kRecordHeaderBytes, payload.data(), length);
}

void ManifestWriter::AddFile(uint64_t sequence, uint64_t records) {
  Append(ManifestEdit::kAddFile, {sequence, records});
  pending_edits_.push_back({ManifestEdit::kAddFile, sequence, records});
}

void ManifestWriter::DropFile(uint64_t sequence) {
  Append(ManifestEdit::kDropFile, {sequence});
  pending_edits_.push_back({ManifestEdit::kDropFile, sequence, 0});
}

void ManifestWriter::Commit() {
  failed_commit_may_stand_ = false;
  // A roll whose directory sync failed: its rename may not be durable, and
  // a crash would bring back the log it replaced, without this commit.
  if (directory_sync_pending_) {
    try {
      SyncDirectoryOf(path_);
    } catch (...) {
      pending_.clear();
      pending_edits_.clear();
      throw;
    }
    directory_sync_pending_ = false;
  }
  Append(ManifestEdit::kCommit, {});
  // A failed append must be cut off before the next one goes after it:
  // replay takes a damaged record followed by sound ones for damage inside
  // the log, and refuses to open the store.
  if (cut_pending_) {
    if (ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
      pending_.clear();
      pending_edits_.clear();
      ThrowErrno("cut off the failed append before this commit", path_);
    }
    cut_pending_ = false;
  }
  // On failure, cut the log back so no half-written commit precedes the next
  // append, and drop the edits: the caller learns that nothing since the
  // last commit is durable.
  auto fail = [&](const char* what) {
    const int error = errno;
    cut_pending_ = ftruncate(fd_, static_cast<off_t>(bytes_)) != 0;  // retried by the next commit
    pending_.clear();
    pending_edits_.clear();
    errno = error;
    ThrowErrno(what, path_);
  };
  for (uint64_t done = 0; done < pending_.size();) {
    const ssize_t w = pwrite(fd_, pending_.data() + done, pending_.size() - done,
                             static_cast<off_t>(bytes_ + done));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("append commit");
    }
    done += static_cast<uint64_t>(w);
  }
  if (fdatasync(fd_) != 0) {
    failed_commit_may_stand_ = true;
    fail("sync commit");
  }
  bytes_ += pending_.size();
  pending_.clear();
  for (const Edit& e : pending_edits_) {
    if (e.edit == ManifestEdit::kAddFile) {
      state_.live_files[e.sequence] = e.records;
      state_.max_sequence = std::max(state_.max_sequence, e.sequence);
    } else {
      state_.live_files.erase(e.sequence);
    }
  }
  pending_edits_.clear();
  state_.commits += 1;
  if (bytes_ > std::max(roll_floor_bytes_, kManifestRollFactor * RolledManifestBytes(state_))) Roll();
}

// The steps in this order keep a whole log under the name at every point: the
// rolled log is durable before the rename puts it there, and until the
// directory sync makes the rename durable, a crash brings back the old log,
// whose last commit is this one too.
void ManifestWriter::Roll() {
  const std::string tmp = RollPath(path_);
  std::vector<uint8_t> log;
  std::swap(log, pending_);  // empty: Append encodes into pending_
  Append(ManifestEdit::kBase, {state_.commits - 1, state_.max_sequence});
  for (const auto& [sequence, records] : state_.live_files) Append(ManifestEdit::kAddFile, {sequence, records});
  Append(ManifestEdit::kCommit, {});
  std::swap(log, pending_);
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    roll_error_ = tmp + ": open: " + std::strerror(errno);
    return;
  }
  try {
    detail::WriteFully(fd, tmp, 0, log.data(), log.size());
    if (fdatasync(fd) != 0) ThrowErrno("sync", tmp);
    if (std::rename(tmp.c_str(), path_.c_str()) != 0) ThrowErrno("rename over " + path_, tmp);
  } catch (const std::exception& e) {
    close(fd);
    unlink(tmp.c_str());  // a failure leaves a stray the next writer removes
    roll_error_ = e.what();
    return;
  }
  // The name now holds the rolled log: append there from now on.
  close(fd_);
  fd_ = fd;
  bytes_ = log.size();
  ++rolls_;
  try {
    SyncDirectoryOf(path_);
  } catch (const std::exception& e) {
    directory_sync_pending_ = true;  // before the next commit's append
    roll_error_ = e.what();
  }
}

}  // namespace hps::detail
