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
//
// The log would grow with every commit for the life of a store, and every
// open replays all of it; so once it passes a bound the writer rolls it: it
// writes the state of the last commit as one log (a base record, an add per
// live file and a commit) to MANIFEST.tmp, syncs it, renames it over the log
// and syncs the directory. A crash at any step leaves either log whole, and a
// MANIFEST.tmp left behind is never read (the next writer removes it).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace hps::detail {

// DO NOT CHANGE THESE VALUES: they are stored in manifests on disk.
// kBase (commits, max_sequence) opens a rolled log, and only there: the
// commits before the one that ends it, and the highest sequence they
// committed (files dropped since are in no add). Builds before it refuse a
// rolled log as corrupt, naming the unknown edit type.
enum class ManifestEdit : uint8_t { kAddFile = 1, kDropFile = 2, kCommit = 3, kBase = 4 };

// The log is rolled once it passes the larger of this and kManifestRollFactor
// times the rolled log's size: some thirty thousand commits of a file each
// before the first roll, and an open replays little more than a rolled log.
constexpr uint64_t kManifestRollFloorBytes = uint64_t{1} << 20;
constexpr uint64_t kManifestRollFactor = 4;

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

// The bytes of a rolled log of `state`.
uint64_t RolledManifestBytes(const ManifestState& state);

class ManifestWriter {
 public:
  // Appends to `path` after the `replay.valid_bytes` that ReplayManifest
  // accepted, cutting off whatever follows; creates the file if missing.
  // `replay.state` is the state it rolls from. Rolls once the log passes
  // max(roll_floor_bytes, kManifestRollFactor x its rolled size). Removes a
  // MANIFEST.tmp that a roll cut short left behind (see TakeStrayError).
  ManifestWriter(const std::string& path, const ManifestReplay& replay,
                 uint64_t roll_floor_bytes = kManifestRollFloorBytes);
  ~ManifestWriter();
  ManifestWriter(const ManifestWriter&) = delete;
  ManifestWriter& operator=(const ManifestWriter&) = delete;

  void AddFile(uint64_t sequence, uint64_t records);
  void DropFile(uint64_t sequence);
  // Appends the buffered edits and a commit record, then syncs: on return
  // they are durable. On failure the log is cut back to its last commit.
  // Then rolls the log when it has passed its bound; a roll that fails
  // leaves the log as it was, the commit in it (see TakeRollError).
  void Commit();
  // Whether the last Commit() failed only in its sync, its whole append
  // written: the kernel may have put it on disk before reporting, and the
  // cut back is not synced, so after a crash the commit may stand.
  bool failed_commit_may_stand() const { return failed_commit_may_stand_; }

  uint64_t bytes() const { return bytes_; }
  uint64_t rolls() const { return rolls_; }
  // Why the last roll failed, once ("" when none failed since the last call).
  std::string TakeRollError() { return std::exchange(roll_error_, ""); }
  // Why the constructor could not remove a MANIFEST.tmp left behind, once
  // ("" when there was none, or it went). Nothing reads that file, and the
  // next roll writes over it, so it fails nothing; the caller reports it.
  std::string TakeStrayError() { return std::exchange(stray_error_, ""); }

 private:
  struct Edit {
    ManifestEdit edit;
    uint64_t sequence, records;
  };
  void Append(ManifestEdit edit, const std::vector<uint64_t>& fields);
  void Roll();

  std::string path_;
  uint64_t roll_floor_bytes_;
  int fd_ = -1;
  uint64_t bytes_ = 0;           // durable length
  bool cut_pending_ = false;     // a failed append is still past bytes_
  bool failed_commit_may_stand_ = false;
  bool directory_sync_pending_ = false;  // a roll's rename may not be durable yet
  std::vector<uint8_t> pending_;  // encoded edits since the last commit
  std::vector<Edit> pending_edits_;  // the same, for state_
  ManifestState state_;           // as of the last commit
  uint64_t rolls_ = 0;
  std::string roll_error_;
  std::string stray_error_;
};

}  // namespace hps::detail
