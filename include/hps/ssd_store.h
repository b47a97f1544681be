// SSD-PS: the tier that keeps the rows that fit neither in device nor in host
// memory, as immutable parameter files on disk (docs/ssd_format.md).
//
// put() never updates in place: a batch of rows becomes new files, written
// sequentially with O_DIRECT through io_uring, and the index then points at
// the new copies; the old ones become stale, counted per file. commit() makes
// everything put so far durable through the manifest, then, once the files
// hold too many stale records, hands a compaction to a background thread.
// open() of an existing store replays the manifest, deletes files that were
// never committed, and rebuilds the index from the live files' keys.
//
// Where the kernel or filesystem refuses io_uring or O_DIRECT (ramfs, tmpfs
// before Linux 6.6, say), pread/pwrite and the page cache take over:
// stats().io_path says which path ran, io_fallback() why (the Python class
// warns once per store), and require_direct_io makes a refused O_DIRECT an
// error instead.
//
// Stamps and bounds: every file carries a stamp, when its rows were last
// updated in the caller's unit (hps: the training step), set by SetStamp
// before the puts and kept by compaction. Stamps never go back, so a key's
// copies are stamped in the order they were written, and every copy of a key
// whose current copy is stamped below s lies in files stamped below s.
// Bound() erases the keys not updated since a stamp, and the oldest beyond a
// number of keys, by dropping such files whole (and rewriting the survivors
// of the one stamp it cuts through): nothing on disk can bring an erased key
// back, so no tombstone is kept, and the space is free at the next commit.
//
// Thread safety: any call from any thread. Gets run concurrently with each
// other and with a put's or a compaction's file I/O; they wait only while
// the index changes (one file's keys at a time).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hps/errors.h"  // CorruptionError, IoError
#include "hps/keys.h"    // kEmptyKey

namespace hps {

struct SsdStoreOptions {
  std::string path;                       ///< a directory; created if missing
  uint32_t row_bytes = 0;                 ///< bytes per row; > 0; fixed for the store's life
  uint64_t file_records = uint64_t{1} << 16;  ///< records per parameter file; > 0
  bool verify_rows_on_open = false;       ///< also check every rows block of every file at open (reads all)
  double compaction_trigger = 1.5;        ///< compact at commit once records on disk > this x live; >= 1
  bool use_io_uring = true;               ///< read through io_uring where the kernel allows, else pread
  bool direct_io = true;                  ///< read and write rows with O_DIRECT where the filesystem allows
  bool background_compaction = true;      ///< compact on a thread; false: inside commit()
  bool require_direct_io = false;         ///< throw IoError where O_DIRECT is refused; needs direct_io
};

struct SsdStoreStats {
  uint64_t files = 0;           ///< parameter files in use (committed or not)
  uint64_t live_records = 0;    ///< records the index points at: the stored keys
  uint64_t stale_records = 0;   ///< records superseded by a later put
  uint64_t disk_bytes = 0;      ///< bytes of those files
  uint64_t rows_written = 0;
  uint64_t bytes_written = 0;
  uint64_t rows_read = 0;
  uint64_t bytes_read = 0;      ///< bytes of rows blocks read from files: by get, and by compaction
                                ///< and Bound for the rows they rewrite (not the keys they read)
  uint64_t bytes_requested = 0; ///< rows_read * row_bytes; gets' read amplification = bytes_read /
                                ///< this, over a span in which no compaction or Bound ran
  uint64_t commits = 0;
  uint64_t compactions = 0;          ///< compaction runs that committed (a run swaps its victims in
                                     ///< chunks, a manifest commit each: it counts once, from its first)
  uint64_t compacted_records = 0;    ///< live records rewritten by them
  uint64_t compaction_failures = 0;  ///< runs stopped by a failed chunk, which changed nothing (the
                                     ///< chunks before it stand: such a run is a compaction too; see
                                     ///< last_error), or that met a damaged file and went on without it
  std::string last_error;            ///< the message of the last failed compaction
  uint64_t corrupt_files = 0;        ///< files a compaction or Bound() found damaged since open (a
                                     ///< rows block or the keys failing their CRC) and left as they
                                     ///< are, still in the store; see Commit()
  uint64_t unreadable_files = 0;     ///< the same for files the device failed to read, twice (EIO:
                                     ///< a bad sector)
  uint64_t cleanup_failures = 0;     ///< removals of unlisted files, or directory syncs after a
                                     ///< commit that stands, that failed (written to stderr; the
                                     ///< commit stands, and the next one syncs the directory again);
                                     ///< and removals of the files of a failed put, compaction or
                                     ///< bound that failed (stderr; its own error is raised, and
                                     ///< open removes the file); and removals at open of unlisted
                                     ///< files or a MANIFEST.tmp that failed (stderr; nothing reads
                                     ///< them, the open goes on, and the next open tries again)
  uint64_t manifest_rolls = 0;       ///< rewrites of MANIFEST as one record of the live files, since open
  uint64_t manifest_roll_failures = 0;  ///< rolls that failed (written to stderr; the commit stands)
  bool compaction_running = false;   ///< a compaction is planned or under way
  double compaction_lock_max_us = 0; ///< longest a compaction held readers off (one chunk's swap)
  uint64_t index_bytes = 0;     ///< memory of the key index
  std::string io_path;          ///< how gets and puts moved rows: "io_uring" or "pread", "+O_DIRECT"
                                ///< when direct; the fallback's name once any of them fell back
                                ///< (compaction and Bound move their rows the same way, through the
                                ///< same pool; only the keys they read go by pread)
  std::string io_fallback;      ///< io_fallback()
  uint64_t stamp = 0;           ///< stamp(): what puts write now
  uint64_t bound_expired = 0;   ///< keys Bound() erased for a stamp below its min_stamp, all calls
  uint64_t bound_capped = 0;    ///< keys Bound() erased for max_live, all calls
  uint64_t bound_files_dropped = 0;       ///< files Bound() dropped whole
  uint64_t bound_records_rewritten = 0;   ///< survivors of a cut stamp that Bound() rewrote
};

// What one Bound() erased.
struct SsdBoundResult {
  std::vector<uint64_t> expired;     ///< keys whose current copy was stamped below min_stamp, ascending
  std::vector<uint64_t> capped;      ///< then the oldest beyond max_live, ascending
  uint64_t files_dropped = 0;        ///< files gone whole (also those that held only stale records)
  uint64_t records_rewritten = 0;    ///< live records of the cut stamp kept, in new files
};

class SsdStore {
 public:
  // Creates the store at options.path, or opens the one there. Throws
  // std::invalid_argument for bad options, a row size other than the store's,
  // or a path that holds something other than a store; CorruptionError naming
  // the file for a damaged one; IoError for failed system calls.
  static std::unique_ptr<SsdStore> Open(const SsdStoreOptions& options);

  virtual ~SsdStore() = default;

  // Stores rows (n, row_bytes) under keys; of duplicate keys the last wins.
  // Readable at once, durable after commit().
  virtual void Put(const uint64_t* keys, uint64_t n, const uint8_t* rows) = 0;
  // Copies the rows of present keys into rows_out (n, row_bytes); absent keys
  // get zero rows and found[i] = 0 (found may be null). Returns the hits.
  virtual uint64_t Get(const uint64_t* keys, uint64_t n, uint8_t* rows_out, uint8_t* found) = 0;
  // Makes every put so far durable: a crash after this returns reopens to it.
  // Then, when records on disk exceed compaction_trigger x live records and
  // no compaction is under way, starts one: the files more than half stale,
  // and the most stale of the others until disk use is back halfway between
  // live and the trigger. Its victims are rewritten in chunks of about one
  // file of live records, each swapped in by its own manifest commit, so a
  // crash at any instant reopens to a committed state. A compaction that
  // fails is counted in the stats; the chunk that failed changes nothing, and
  // the chunks before it stand;
  // the commit() it ran in (background_compaction = false) or the next one
  // (on the background thread, which also writes a line to stderr) throws
  // IoError for it, once, after its own commit is durable. A victim that
  // fails its checks (a rows block, naming the key, or its keys) is no such
  // failure of the run: the file is left as it is, still in the store (its
  // sound rows read, a get of a bad block's row raises CorruptionError, and
  // no row whose only copy it holds is dropped), and the run goes on
  // without it; that commit raises CorruptionError naming the file, once,
  // and the compactions later commits start pass the file over while they
  // would have to read it (stats().corrupt_files; open forgets this). So too
  // for a victim whose read the device fails twice (EIO: a bad sector; one
  // that passes is asked again), raised as IoError naming the offset
  // (stats().unreadable_files). A damaged file that Bound() met is raised
  // the same way, once (see Bound()). A chunk whose
  // manifest commit is synced has taken effect: a failure to delete its
  // victims, or to sync their deletion, is no failure (a line on stderr; the
  // next commit syncs the directory again; open removes what is left).
  // A file that fails to sync (fdatasync) lost its rows with the error, which
  // the kernel reports once: this commit and every later one throw IoError
  // naming it; reopening returns to the last commit.
  virtual void Commit() = 0;
  // Commits, then rewrites the live records of every file more than half
  // stale, in the calling thread (after any compaction under way); afterwards
  // no file is more than half stale. Throws IoError if it fails, and
  // CorruptionError naming the file (and the block and key) if a file fails
  // its checks (IoError naming the offset if the device fails its read
  // twice): that file is left as it is, the others are compacted all
  // the same. It tries files earlier compactions set aside again (those
  // whose bad rows puts have superseded since go then).
  virtual void Compact() = 0;
  // Returns once no compaction is under way.
  virtual void WaitForCompaction() = 0;

  // The stamp of the files that puts write from now on. Throws
  // std::invalid_argument for a stamp below stamp(): stamps never go back.
  virtual void SetStamp(uint64_t stamp) = 0;
  // The last SetStamp's; after open, the highest stamp of any file (0 for a
  // new store, and for files written before stamps: format version 3).
  virtual uint64_t stamp() const = 0;
  // The stamp of each key's current copy into stamps_out (n); absent keys
  // get 0 and found[i] = 0 (found may be null). Returns the hits.
  virtual uint64_t Stamps(const uint64_t* keys, uint64_t n, uint64_t* stamps_out, uint8_t* found) const = 0;
  // Bounds the table: erases every key whose current copy is stamped below
  // min_stamp (0: none), then, while more than max_live keys remain (0: no
  // cap), the keys with the oldest stamps, of one stamp the smaller keys
  // first. The keys leave at once (gets miss them); the next Commit makes
  // it durable, so a crash or a reopen before it finds them all again.
  // Files whose live keys all go are dropped whole; the live keys that stay
  // in the one stamp the cap cuts through are rewritten into new files of
  // that stamp. Waits for a compaction under way and holds off puts
  // meanwhile; a failure (a full disk while rewriting) changes nothing.
  // A damaged file fails no Bound: one whose keys fail their CRC (or their
  // read, twice) has its live keys taken from the index; one of the cut
  // stamp whose survivors cannot be read (a rows block failing its CRC, or
  // its read twice) is left as it is, none of its keys erased and none of
  // its rows moved (its sound rows read, a get of a bad one raises naming
  // the key), and the other files are bounded as if it were not there, so
  // that the store may keep more than max_live keys until puts supersede
  // its bad rows. The next Commit() raises CorruptionError (IoError, for a
  // failed read) naming such a file, once, as it does a compaction's.
  virtual SsdBoundResult Bound(uint64_t min_stamp, uint64_t max_live) = 0;

  virtual uint64_t size() const = 0;
  virtual uint32_t row_bytes() const = 0;
  virtual SsdStoreStats stats() const = 0;
  // Why io_uring or O_DIRECT, asked for by the options, is not what moves
  // rows ("io_uring_queue_init: Operation not permitted", "O_DIRECT refused
  // by the filesystem at PATH: Invalid argument"): the first such reason, ""
  // while nothing fell back. Open decides most of it (a ring and an O_DIRECT
  // probe); a later ring or file may still fall back.
  virtual std::string io_fallback() const = 0;
};

}  // namespace hps
