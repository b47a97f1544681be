// A parameter file of SSD-PS: one immutable batch of (key, row) records,
// written once and sequentially, then only read (docs/ssd_format.md).
//
//   [header block, 4 KiB][keys: records x uint64, padded to 4 KiB]
//   [block CRCs: one uint32 per 4 KiB block of rows, padded to 4 KiB]
//   [rows: records x row_bytes, padded to 4 KiB]
//
// Keys and rows live in separate regions, each with its own CRC-32C, so that
// reopening a store verifies and indexes a file by reading its keys alone.
// A get reads single 4 KiB blocks of rows, never the whole region, so each
// block also has a CRC of its own (version 2), kept in memory while the file
// is open and checked on every read of the block.
// Every region starts on a 4 KiB boundary, as O_DIRECT reads need.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "util/block_io.h"
#include "hps/errors.h"  // CorruptionError, IoError

namespace hps {
namespace detail {

struct IoRequest;
class BlockIo;

inline constexpr uint64_t kBlockBytes = 4096;
// 2 added the block CRCs. Version 1 files (no table) are still read: Open
// checks their whole rows region once and computes the table in memory.
// 3 added the stamp (u64 at offset 48, right after the 48-byte header and
// covered by its CRC): when the file's rows were last updated, in the
// caller's unit (a training step). Version 1 and 2 files read as stamp 0.
inline constexpr uint32_t kParamFileVersion = 3;
// Where version 3 keeps the stamp, and the bytes its header CRC covers.
inline constexpr uint64_t kStampOffset = 48;
inline constexpr uint64_t kHeaderBytesV3 = 56;

inline uint64_t RoundUpToBlock(uint64_t bytes) {
  return (bytes + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
}

// DO NOT CHANGE THE LAYOUT: it is the first bytes of every file on disk
// (little-endian; the rest of the header block is zero).
struct ParamFileHeader {
  char magic[8];        // "HPSPARAM"
  uint32_t version;     // kParamFileVersion
  uint32_t row_bytes;   // bytes per row
  uint64_t sequence;    // the store's sequence number of this file
  uint64_t records;     // number of (key, row) records
  uint32_t keys_crc;    // CRC-32C of the keys region's records * 8 bytes
  uint32_t rows_crc;    // CRC-32C of the rows region's records * row_bytes bytes
  uint32_t header_crc;  // CRC-32C of this struct with header_crc = 0
  uint32_t blocks_crc;  // version 2: CRC-32C of the block-CRC table's row_blocks x 4
                        // bytes; version 1: 0 (it was "reserved")
};
static_assert(sizeof(ParamFileHeader) == 48, "on-disk header size");
// Version 3 follows the header with a u64 stamp (kStampOffset); header_crc
// then covers the 56 bytes, the header's 48 (header_crc = 0) and the stamp's 8.

// Where things are in a file of `records` rows of `row_bytes`.
struct ParamFileLayout {
  uint32_t row_bytes;
  uint64_t records;
  uint32_t version = kParamFileVersion;

  uint64_t keys_offset() const { return kBlockBytes; }
  // The rows region's 4 KiB blocks (its last one zero-padded).
  uint64_t row_blocks() const { return RoundUpToBlock(records * row_bytes) / kBlockBytes; }
  // The block-CRC table (row_blocks() x uint32), absent (0 bytes) in version 1.
  uint64_t block_crcs_offset() const { return kBlockBytes + RoundUpToBlock(records * sizeof(uint64_t)); }
  uint64_t block_crcs_bytes() const {
    return version >= 2 ? RoundUpToBlock(row_blocks() * sizeof(uint32_t)) : 0;
  }
  uint64_t rows_offset() const { return block_crcs_offset() + block_crcs_bytes(); }
  uint64_t file_bytes() const { return rows_offset() + row_blocks() * kBlockBytes; }
  uint64_t row_offset(uint64_t slot) const { return rows_offset() + slot * row_bytes; }
};

// A parameter file being assembled in memory, in its on-disk layout, so that
// it goes out in large aligned writes (O_DIRECT) with no staging copy.
class ParamFileImage {
 public:
  ParamFileImage(uint32_t row_bytes, uint64_t records);
  ParamFileLayout layout() const { return layout_; }
  uint64_t* keys() { return reinterpret_cast<uint64_t*>(buffer_.data() + layout_.keys_offset()); }
  uint8_t* row(uint64_t slot) { return buffer_.data() + layout_.row_offset(slot); }

  // Seals the header (CRCs) and writes the image as the new file `path`
  // (which must not exist) through `io`, with O_DIRECT when `direct` and the
  // filesystem allows it. Not synced: ParamFile::Sync() does that before a
  // commit names the file. On failure the partial file is removed and
  // IoError names it. Returns the bytes written. `stamp`: see
  // kParamFileVersion.
  uint64_t Write(const std::string& path, uint64_t sequence, BlockIo& io, bool direct, uint64_t stamp = 0);
  // errno of the O_DIRECT open that Write was refused and replaced with a
  // buffered one; 0 when it was not.
  int direct_error() const { return direct_error_; }

 private:
  ParamFileLayout layout_;
  AlignedBuffer buffer_;
  int direct_error_ = 0;
};

// Writes and syncs a new file at `path` holding keys[i] with rows (n,
// row_bytes), with pwrite; for tests and tools. Returns the bytes written.
uint64_t WriteParamFile(const std::string& path, uint64_t sequence, uint32_t row_bytes,
                        const uint64_t* keys, const uint8_t* rows, uint64_t n, uint64_t stamp = 0);

// An open, validated parameter file. Not copyable; movable.
class ParamFile {
 public:
  // Checks the header (magic, version, row size, file length, header CRC)
  // and loads the block-CRC table (checked against its CRC); with
  // verify_rows, every rows block and the rows region's CRC too. A version 1
  // file has no table: its rows are always checked and the table computed
  // from them. With direct_reads, rows are read through a second,
  // O_DIRECT descriptor (bypassing the page cache) where the filesystem
  // allows it. Throws CorruptionError or IoError naming the file.
  static ParamFile Open(const std::string& path, uint32_t row_bytes, bool verify_rows,
                        bool direct_reads = false);

  ParamFile(ParamFile&& other) noexcept;
  ParamFile& operator=(ParamFile&& other) noexcept;
  ParamFile(const ParamFile&) = delete;
  ParamFile& operator=(const ParamFile&) = delete;
  ~ParamFile();

  const std::string& path() const { return path_; }
  const ParamFileHeader& header() const { return header_; }
  // When the rows were last updated (version 3; 0 for older files).
  uint64_t stamp() const { return stamp_; }
  ParamFileLayout layout() const { return {header_.row_bytes, header_.records, header_.version}; }
  // The CRC-32C of each 4 KiB block of the rows region.
  const std::vector<uint32_t>& block_crcs() const { return block_crcs_; }
  // The keys of the records, by slot, read from disk and checked against
  // their CRC (the store keeps none in memory: its index has them).
  std::vector<uint64_t> ReadKeys() const;
  // The same keys in chunks of at most `chunk` (a reader that opens a big file
  // holds one chunk, not all its keys): fn(keys, first_slot, n) for each, in slot
  // order, then the CRC check, which throws CorruptionError after the last call.
  void ForEachKeyChunk(const std::function<void(const uint64_t*, uint64_t, uint64_t)>& fn,
                       uint64_t chunk = kKeyChunk) const;
  static constexpr uint64_t kKeyChunk = 1 << 16;  // 512 KiB of keys
  // Makes the file's data durable (fdatasync).
  void Sync() const;

  // The reads that fetch some rows: each run of neighbouring 4 KiB blocks
  // once, or the whole rows region when that moves no more bytes.
  struct Run {
    uint64_t first, last;    // blocks, inclusive
    uint64_t buffer_offset;  // where the run lands in the plan's buffer
  };
  struct RowsPlan {
    std::vector<Run> runs;  // by first block
    uint64_t bytes = 0;     // the buffer the runs fill, a multiple of 4 KiB
  };
  RowsPlan PlanRows(const uint64_t* slots, uint64_t n) const;
  // The reads of a plan into `buffer` (4 KiB aligned, plan.bytes long).
  void AddReads(const RowsPlan& plan, uint8_t* buffer, std::vector<IoRequest>* reads) const;
  // Copies the rows of `slots` from a plan's filled buffer into out (n,
  // row_bytes), after checking every block those rows touch against its CRC
  // (each once). keys[i] is the key stored at slots[i], for the message: a
  // mismatch throws CorruptionError naming the file, the block and the key.
  void CopyRows(const RowsPlan& plan, const uint8_t* buffer, const uint64_t* slots,
                const uint64_t* keys, uint64_t n, uint8_t* out) const;
  // PlanRows + pread + CopyRows. Returns the bytes read from the file.
  uint64_t ReadRows(const uint64_t* slots, const uint64_t* keys, uint64_t n, uint8_t* out) const;
  // Whether rows are read with O_DIRECT.
  bool direct() const { return direct_fd_ >= 0; }
  // errno of the refused O_DIRECT open when direct_reads was asked for and
  // the page cache serves the reads instead; else 0.
  int direct_error() const { return direct_error_; }

 private:
  ParamFile() = default;

  int read_fd() const { return direct_fd_ >= 0 ? direct_fd_ : fd_; }

  std::string path_;
  int fd_ = -1;
  int direct_fd_ = -1;
  int direct_error_ = 0;
  ParamFileHeader header_{};
  uint64_t stamp_ = 0;
  std::vector<uint32_t> block_crcs_;  // 4 bytes per 4 KiB of rows
};

}  // namespace detail
}  // namespace hps
