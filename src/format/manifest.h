// The SSD-PS manifest: an append-only log, in the LevelDB style, of which
// parameter files are live.
//
// A record is [u32 payload bytes][u32 CRC-32C of the payload][payload], the
// payload one edit (little-endian): add file (sequence, records), drop file
// (sequence), or commit. Edits are buffered and go out together with their
// commit record in one append, then the log is synced, and a failed append is
// cut off before the next; so a crash can only tear the last append. Replay
// keeps the state of the last complete commit. A record that is cut short or
// fails its CRC ends the log when no sound record follows it (a torn tail);
// when one does, the log is damaged before its end and replay throws.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hps::detail {

// DO NOT CHANGE THESE VALUES: they are stored in manifests on disk.
enum class ManifestEdit : uint8_t { kAddFile = 1, kDropFile = 2, kCommit = 3 };

struct ManifestState {
  std::map<uint64_t, uint64_t> live_files;  // sequence -> records
  uint64_t commits = 0;
  uint64_t max_sequence = 0;  // highest sequence ever committed, live or dropped
};

struct ManifestReplay {
  ManifestState state;
  uint64_t valid_bytes = 0;    // up to the end of the last commit record
  uint64_t ignored_bytes = 0;  // after it: uncommitted edits or a torn tail
};

// Replays the manifest at `path`; a missing file is an empty store. Throws
// CorruptionError naming the file and the record's byte offset for a damaged
// record that sound records follow, an edit of unknown type, or a committed
// edit that contradicts the state (adding a live file, dropping an unknown
// one); IoError when the file cannot be read.
ManifestReplay ReplayManifest(const std::string& path);

class ManifestWriter {
 public:
  // Appends to `path` after its first `valid_bytes` (what ReplayManifest
  // accepted), cutting off whatever follows; creates the file if missing.
  ManifestWriter(const std::string& path, uint64_t valid_bytes);
  ~ManifestWriter();
  ManifestWriter(const ManifestWriter&) = delete;
  ManifestWriter& operator=(const ManifestWriter&) = delete;

  void AddFile(uint64_t sequence, uint64_t records);
  void DropFile(uint64_t sequence);
  // Appends the buffered edits and a commit record, then syncs: on return
  // they are durable. On failure the log is cut back to its last commit.
  void Commit();
  // Whether the last Commit() failed only in its sync, its whole append
  // written: the kernel may have put it on disk before reporting, and the
  // cut back is not synced, so after a crash the commit may stand.
  bool failed_commit_may_stand() const { return failed_commit_may_stand_; }

  uint64_t bytes() const { return bytes_; }

 private:
  void Append(ManifestEdit edit, const std::vector<uint64_t>& fields);

  std::string path_;
  int fd_ = -1;
  uint64_t bytes_ = 0;           // durable length
  bool cut_pending_ = false;     // a failed append is still past bytes_
  bool failed_commit_may_stand_ = false;
  std::vector<uint8_t> pending_;  // encoded edits since the last commit
};

}  // namespace hps::detail
