#include "format/param_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "util/crc32c.h"
#include "util/errors.h"  // ThrowErrno

namespace hps::detail {
namespace {

constexpr char kMagic[8] = {'H', 'P', 'S', 'P', 'A', 'R', 'A', 'M'};
constexpr uint64_t kIoChunk = uint64_t{1} << 20;  // bytes per read or write request

[[noreturn]] void ThrowCorrupt(const std::string& path, const std::string& what) {
  throw CorruptionError(path + ": not a valid hps parameter file: " + what);
}

// Over the 48-byte header with header_crc = 0, and from version 3 on the
// stamp after it too, so that a flipped stamp is caught like any header field.
uint32_t HeaderCrc(ParamFileHeader h, uint64_t stamp) {
  h.header_crc = 0;
  const uint32_t crc = Crc32c(&h, sizeof h);
  return h.version >= 3 ? Crc32c(&stamp, sizeof stamp, crc) : crc;
}

std::string Hex(uint32_t v) {
  char s[11];
  std::snprintf(s, sizeof s, "0x%08x", v);
  return s;
}

// The CRC-32C (as Crc32c) of each of n 4 KiB blocks. The crc32 instruction
// has a latency of 3 cycles and a throughput of 1, so one block's chain of
// 512 steps leaves it two-thirds idle; three blocks' chains side by side keep
// it busy. Checking the ~20k blocks of a W1 get batch one at a time took
// 0.7-1.2 us a block on the 2-core dev VM.
#if defined(__x86_64__)
__attribute__((target("sse4.2"))) void Crc32cThreeBlocks(const uint8_t* a, const uint8_t* b,
                                                         const uint8_t* c, uint32_t* out) {
  uint64_t ca = 0xffffffffu, cb = 0xffffffffu, cc = 0xffffffffu;
  for (uint64_t at = 0; at < kBlockBytes; at += 8) {
    uint64_t wa, wb, wc;
    std::memcpy(&wa, a + at, 8);
    std::memcpy(&wb, b + at, 8);
    std::memcpy(&wc, c + at, 8);
    ca = __builtin_ia32_crc32di(ca, wa);
    cb = __builtin_ia32_crc32di(cb, wb);
    cc = __builtin_ia32_crc32di(cc, wc);
  }
  out[0] = ~static_cast<uint32_t>(ca);
  out[1] = ~static_cast<uint32_t>(cb);
  out[2] = ~static_cast<uint32_t>(cc);
}
#endif

void BlockCrcs(const uint8_t* const* blocks, uint64_t n, uint32_t* out) {
  uint64_t i = 0;
#if defined(__x86_64__)
  if (Crc32cHardware()) {
    for (; i + 3 <= n; i += 3) Crc32cThreeBlocks(blocks[i], blocks[i + 1], blocks[i + 2], out + i);
  }
#endif
  for (; i < n; ++i) out[i] = Crc32c(blocks[i], kBlockBytes);
}

// "rows block 3 (file offset 20480)": the table index and where it is on disk.
std::string BlockName(const ParamFileLayout& layout, uint64_t block) {
  return "rows block " + std::to_string(block) + " (file offset " +
         std::to_string(layout.rows_offset() + block * kBlockBytes) + ")";
}

}  // namespace

ParamFileImage::ParamFileImage(uint32_t row_bytes, uint64_t records)
    : layout_{row_bytes, records}, buffer_(layout_.file_bytes()) {
  if (row_bytes == 0) throw std::invalid_argument("parameter file: row_bytes must be > 0");
}

uint64_t ParamFileImage::Write(const std::string& path, uint64_t sequence, BlockIo& io, bool direct,
                               uint64_t stamp) {
  ParamFileHeader h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kParamFileVersion;
  h.row_bytes = layout_.row_bytes;
  h.sequence = sequence;
  h.records = layout_.records;
  h.keys_crc = Crc32c(keys(), layout_.records * sizeof(uint64_t));
  h.rows_crc = Crc32c(row(0), layout_.records * layout_.row_bytes);
  uint8_t* table = buffer_.data() + layout_.block_crcs_offset();
  std::vector<const uint8_t*> blocks(layout_.row_blocks());
  std::vector<uint32_t> crcs(blocks.size());
  for (uint64_t b = 0; b < blocks.size(); ++b) blocks[b] = row(0) + b * kBlockBytes;
  BlockCrcs(blocks.data(), blocks.size(), crcs.data());
  if (!crcs.empty()) std::memcpy(table, crcs.data(), crcs.size() * sizeof(uint32_t));  // little-endian, as the header
  h.blocks_crc = Crc32c(table, layout_.row_blocks() * sizeof(uint32_t));
  h.header_crc = HeaderCrc(h, stamp);
  std::memcpy(buffer_.data(), &h, sizeof h);
  std::memcpy(buffer_.data() + kStampOffset, &stamp, sizeof stamp);

  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
  int fd = direct ? open(path.c_str(), flags | O_DIRECT, 0644) : open(path.c_str(), flags, 0644);
  if (fd < 0 && direct && errno == EINVAL) {
    // The filesystem refuses O_DIRECT (older tmpfs), possibly after creating
    // the file; the name is this write's own, so start it over buffered.
    direct_error_ = errno;
    unlink(path.c_str());
    fd = open(path.c_str(), flags, 0644);
  }
  if (fd < 0) ThrowErrno("create", path);
  const uint64_t total = layout_.file_bytes();
  try {
    // Claim the space first: a full disk (or RLIMIT_FSIZE) then fails here,
    // cleanly, rather than as a short O_DIRECT write whose remainder is
    // misaligned. Filesystems without fallocate just write.
    const int claimed = total > 0 ? posix_fallocate(fd, 0, static_cast<off_t>(total)) : 0;
    if (claimed != 0 && claimed != EOPNOTSUPP && claimed != EINVAL) {
      errno = claimed;
      ThrowErrno("allocate", path);
    }
    std::vector<IoRequest> writes;
    for (uint64_t offset = 0; offset < total; offset += kIoChunk) {
      writes.push_back(IoRequest{fd, &path, offset, std::min(kIoChunk, total - offset), buffer_.data() + offset});
    }
    io.WriteAll(writes);
  } catch (...) {
    close(fd);
    unlink(path.c_str());  // a partial file must never be mistaken for data
    throw;
  }
  if (close(fd) != 0) {
    const int error = errno;
    unlink(path.c_str());
    errno = error;
    ThrowErrno("close", path);
  }
  return total;
}

uint64_t WriteParamFile(const std::string& path, uint64_t sequence, uint32_t row_bytes,
                        const uint64_t* keys, const uint8_t* rows, uint64_t n, uint64_t stamp) {
  if (row_bytes == 0) throw std::invalid_argument(path + ": row_bytes must be > 0");
  ParamFileImage image(row_bytes, n);
  if (n > 0) {
    std::memcpy(image.keys(), keys, n * sizeof(uint64_t));
    std::memcpy(image.row(0), rows, n * row_bytes);
  }
  std::unique_ptr<BlockIo> io = NewBlockIo(false);
  const uint64_t written = image.Write(path, sequence, *io, false, stamp);
  ParamFile::Open(path, row_bytes, false).Sync();
  return written;
}

ParamFile ParamFile::Open(const std::string& path, uint32_t row_bytes, bool verify_rows,
                          bool direct_reads) {
  ParamFile f;
  f.path_ = path;
  f.fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0) ThrowErrno("open", path);

  uint8_t head[kHeaderBytesV3];  // within the 4 KiB header block of any version
  ReadFully(f.fd_, path, 0, head, sizeof head);
  std::memcpy(&f.header_, head, sizeof f.header_);
  const ParamFileHeader& h = f.header_;
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) ThrowCorrupt(path, "bad magic");
  uint64_t stamp = 0;
  std::memcpy(&stamp, head + kStampOffset, sizeof stamp);
  if (HeaderCrc(h, stamp) != h.header_crc) ThrowCorrupt(path, "header CRC mismatch");
  if (h.version >= 3) f.stamp_ = stamp;  // before 3 those bytes are padding
  if (h.version < 1 || h.version > kParamFileVersion) {
    ThrowCorrupt(path, "format version " + std::to_string(h.version) + ", this build reads 1 to " +
                           std::to_string(kParamFileVersion));
  }
  if (h.row_bytes != row_bytes) {
    ThrowCorrupt(path, "rows of " + std::to_string(h.row_bytes) + " bytes, the store expects " +
                           std::to_string(row_bytes));
  }
  const off_t size = lseek(f.fd_, 0, SEEK_END);
  if (size < 0) ThrowErrno("seek", path);
  const ParamFileLayout layout = f.layout();
  if (static_cast<uint64_t>(size) != layout.file_bytes()) {
    ThrowCorrupt(path, "length " + std::to_string(size) + " bytes, the header implies " +
                           std::to_string(layout.file_bytes()));
  }

  const uint64_t blocks = layout.row_blocks();
  const bool has_table = h.version >= 2;
  if (has_table) {
    f.block_crcs_.resize(blocks);
    ReadFully(f.fd_, path, layout.block_crcs_offset(), f.block_crcs_.data(), blocks * sizeof(uint32_t));
    if (Crc32c(f.block_crcs_.data(), blocks * sizeof(uint32_t)) != h.blocks_crc) {
      ThrowCorrupt(path, "block CRC table CRC mismatch");
    }
  } else {
    f.block_crcs_.reserve(blocks);
  }
  if (verify_rows || !has_table) {
    // A version 1 file's rows are checked here, whole, once: from then on
    // the table computed from them guards every read as a version 2 table
    // does.
    std::vector<uint8_t> chunk(kIoChunk);  // a multiple of kBlockBytes
    const uint64_t total = h.records * h.row_bytes;
    const uint64_t region = blocks * kBlockBytes;
    uint32_t crc = 0;
    for (uint64_t done = 0; done < region;) {
      const uint64_t take = std::min<uint64_t>(chunk.size(), region - done);
      ReadFully(f.fd_, path, layout.rows_offset() + done, chunk.data(), take);
      crc = Crc32c(chunk.data(), std::min(take, total - std::min(total, done)), crc);
      std::vector<const uint8_t*> chunk_blocks(take / kBlockBytes);
      std::vector<uint32_t> crcs(chunk_blocks.size());
      for (uint64_t i = 0; i < chunk_blocks.size(); ++i) chunk_blocks[i] = chunk.data() + i * kBlockBytes;
      BlockCrcs(chunk_blocks.data(), chunk_blocks.size(), crcs.data());
      for (uint64_t i = 0; i < crcs.size(); ++i) {
        const uint64_t block = done / kBlockBytes + i;
        if (!has_table) {
          f.block_crcs_.push_back(crcs[i]);
        } else if (crcs[i] != f.block_crcs_[block]) {
          ThrowCorrupt(path, BlockName(layout, block) + " CRC mismatch");
        }
      }
      done += take;
    }
    if (crc != h.rows_crc) ThrowCorrupt(path, "rows CRC mismatch");
  }
  if (direct_reads) {
    // Refused by some filesystems (tmpfs: EINVAL); reads then use the page cache.
    f.direct_fd_ = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (f.direct_fd_ < 0) f.direct_error_ = errno;
  }
  return f;
}

ParamFile::ParamFile(ParamFile&& other) noexcept { *this = std::move(other); }

ParamFile& ParamFile::operator=(ParamFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    if (direct_fd_ >= 0) close(direct_fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    direct_fd_ = std::exchange(other.direct_fd_, -1);
    direct_error_ = other.direct_error_;
    header_ = other.header_;
    stamp_ = other.stamp_;
    block_crcs_ = std::move(other.block_crcs_);
  }
  return *this;
}

std::vector<uint64_t> ParamFile::ReadKeys() const {
  std::vector<uint64_t> keys(header_.records);
  ReadFully(fd_, path_, layout().keys_offset(), keys.data(), header_.records * sizeof(uint64_t));
  if (Crc32c(keys.data(), header_.records * sizeof(uint64_t)) != header_.keys_crc) {
    ThrowCorrupt(path_, "keys CRC mismatch");
  }
  return keys;
}

void ParamFile::ForEachKeyChunk(const std::function<void(const uint64_t*, uint64_t, uint64_t)>& fn,
                                uint64_t chunk) const {
  const uint64_t records = header_.records;
  std::vector<uint64_t> keys(std::min(records, std::max<uint64_t>(chunk, 1)));
  uint32_t crc = 0;
  for (uint64_t first = 0; first < records; first += keys.size()) {
    const uint64_t n = std::min<uint64_t>(keys.size(), records - first);
    ReadFully(fd_, path_, layout().keys_offset() + first * sizeof(uint64_t), keys.data(), n * sizeof(uint64_t));
    crc = Crc32c(keys.data(), n * sizeof(uint64_t), crc);
    fn(keys.data(), first, n);
  }
  if (crc != header_.keys_crc) ThrowCorrupt(path_, "keys CRC mismatch");
}

void ParamFile::Sync() const {
  if (fdatasync(fd_) != 0) ThrowErrno("sync", path_);
}

ParamFile::~ParamFile() {
  if (fd_ >= 0) close(fd_);
  if (direct_fd_ >= 0) close(direct_fd_);
}

ParamFile::RowsPlan ParamFile::PlanRows(const uint64_t* slots, uint64_t n) const {
  const ParamFileLayout layout = this->layout();
  const uint64_t row_bytes = header_.row_bytes;
  std::vector<Run> runs;
  runs.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    if (slots[i] >= header_.records) {
      throw std::out_of_range(path_ + ": slot " + std::to_string(slots[i]) + " of " +
                              std::to_string(header_.records) + " records");
    }
    const uint64_t begin = layout.row_offset(slots[i]);
    runs.push_back({begin / kBlockBytes, (begin + row_bytes - 1) / kBlockBytes, 0});
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.first < b.first; });
  RowsPlan plan;
  for (const Run& r : runs) {
    if (!plan.runs.empty() && r.first <= plan.runs.back().last + 1) {
      plan.runs.back().last = std::max(plan.runs.back().last, r.last);
    } else {
      plan.runs.push_back(r);
    }
  }
  uint64_t blocks = 0;
  for (const Run& r : plan.runs) blocks += r.last - r.first + 1;
  const uint64_t region_first = layout.rows_offset() / kBlockBytes;
  const uint64_t region_blocks = (layout.file_bytes() - layout.rows_offset()) / kBlockBytes;
  if (blocks >= region_blocks && region_blocks > 0) {  // one sequential read moves no more
    plan.runs.assign(1, Run{region_first, region_first + region_blocks - 1, 0});
    blocks = region_blocks;
  }
  for (Run& r : plan.runs) {
    r.buffer_offset = plan.bytes;
    plan.bytes += (r.last - r.first + 1) * kBlockBytes;
  }
  return plan;
}

void ParamFile::AddReads(const RowsPlan& plan, uint8_t* buffer, std::vector<IoRequest>* reads) const {
  for (const Run& r : plan.runs) {
    reads->push_back(IoRequest{read_fd(), &path_, r.first * kBlockBytes,
                                 (r.last - r.first + 1) * kBlockBytes, buffer + r.buffer_offset});
  }
}

void ParamFile::CopyRows(const RowsPlan& plan, const uint8_t* buffer, const uint64_t* slots,
                         const uint64_t* keys, uint64_t n, uint8_t* out) const {
  const ParamFileLayout layout = this->layout();
  const uint64_t row_bytes = header_.row_bytes;
  const uint64_t first_row_block = layout.rows_offset() / kBlockBytes;  // in file blocks
  // First where each row is in the buffer and which blocks need a check: a
  // block holds many rows, and each is checked once; then the checks, three
  // blocks at a time (BlockCrcs); then the copies.
  std::vector<bool> queued(plan.bytes / kBlockBytes, false);  // by buffer block
  struct Check {
    uint64_t table_block;
    uint64_t row;  // the first requested row in the block, for the message
  };
  std::vector<Check> checks;
  std::vector<const uint8_t*> blocks, sources(n);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t begin = layout.row_offset(slots[i]);
    const uint64_t block = begin / kBlockBytes;
    const uint64_t last = (begin + row_bytes - 1) / kBlockBytes;
    const auto run = std::upper_bound(plan.runs.begin(), plan.runs.end(), block,
                                      [](uint64_t b, const Run& r) { return b < r.first; }) -
                     1;
    const uint8_t* run_data = buffer + run->buffer_offset;
    sources[i] = run_data + (begin - run->first * kBlockBytes);
    for (uint64_t b = block; b <= last; ++b) {  // a run holds every block of its rows
      const uint64_t at = run->buffer_offset / kBlockBytes + (b - run->first);
      if (queued[at]) continue;
      queued[at] = true;
      checks.push_back({b - first_row_block, i});
      blocks.push_back(run_data + (b - run->first) * kBlockBytes);
    }
  }
  std::vector<uint32_t> crcs(blocks.size());
  BlockCrcs(blocks.data(), blocks.size(), crcs.data());
  for (size_t c = 0; c < checks.size(); ++c) {
    const uint64_t table_block = checks[c].table_block;
    if (crcs[c] != block_crcs_[table_block]) {
      const uint64_t i = checks[c].row;
      throw CorruptionError(path_ + ": " + BlockName(layout, table_block) +
                            " fails its CRC-32C check (stored " + Hex(block_crcs_[table_block]) +
                            ", read " + Hex(crcs[c]) + ") reading key " + std::to_string(keys[i]) +
                            " (slot " + std::to_string(slots[i]) + ")");
    }
  }
  for (uint64_t i = 0; i < n; ++i) std::memcpy(out + i * row_bytes, sources[i], row_bytes);
}

uint64_t ParamFile::ReadRows(const uint64_t* slots, const uint64_t* keys, uint64_t n,
                             uint8_t* out) const {
  const RowsPlan plan = PlanRows(slots, n);
  AlignedBuffer buffer(plan.bytes);
  std::vector<IoRequest> reads;
  AddReads(plan, buffer.data(), &reads);
  for (const IoRequest& r : reads) ReadFully(r.fd, path_, r.offset, r.buffer, r.bytes);
  CopyRows(plan, buffer.data(), slots, keys, n, out);
  return plan.bytes;
}

}  // namespace hps::detail
