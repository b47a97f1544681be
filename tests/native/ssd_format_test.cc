// SSD-PS on-disk formats: CRC-32C, parameter files, the manifest log.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <atomic>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "util/block_io.h"
#include "util/crc32c.h"
#include "hps/ssd_store.h"
#include "format/key_index.h"
#include "format/manifest.h"
#include "format/param_file.h"
#include "temp_dir.h"

namespace hps::detail {
namespace {

namespace fs = std::filesystem;

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test_support::FreshTestDir("hps-ssd-test");
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  static void FlipByte(const std::string& path, uint64_t offset) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x5a;
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
  }

  std::string dir_;
};

// RFC 3720, appendix B.4, and the usual check value.
TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xff), up(32);
  for (int i = 0; i < 32; ++i) up[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8a9136aau);
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62a8ab43u);
  EXPECT_EQ(Crc32c(up.data(), 32), 0x46dd794eu);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32cPortable(up.data(), 32), 0x46dd794eu);
}

TEST(Crc32c, ContinuesAcrossPieces) {
  std::vector<uint8_t> data(1000);
  std::mt19937 rng(1);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  const uint32_t whole = Crc32c(data.data(), data.size());
  EXPECT_EQ(Crc32cPortable(data.data(), data.size()), whole);  // both paths agree
  for (size_t cut : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    EXPECT_EQ(Crc32c(data.data() + cut, data.size() - cut, Crc32c(data.data(), cut)), whole);
  }
}

struct Records {
  std::vector<uint64_t> keys;
  std::vector<uint8_t> rows;
};

Records MakeRecords(uint64_t n, uint32_t row_bytes, uint32_t seed) {
  std::mt19937_64 rng(seed);
  Records r;
  r.keys.resize(n);
  r.rows.resize(n * row_bytes);
  for (auto& k : r.keys) k = rng();
  for (auto& b : r.rows) b = static_cast<uint8_t>(rng());
  return r;
}

using ParamFileTest = TempDir;

TEST_F(ParamFileTest, RoundTripsKeysAndRowsForAnyRowSize) {
  for (uint32_t row_bytes : {1u, 36u, 128u, 4096u, 5000u}) {
    const uint64_t n = 777;
    const Records r = MakeRecords(n, row_bytes, row_bytes);
    const std::string path = Path("f" + std::to_string(row_bytes));
    const uint64_t written = WriteParamFile(path, 42, row_bytes, r.keys.data(), r.rows.data(), n);
    EXPECT_EQ(written, fs::file_size(path));
    EXPECT_EQ(written % kBlockBytes, 0u);

    ParamFile f = ParamFile::Open(path, row_bytes, /*verify_rows=*/true);
    EXPECT_EQ(f.header().sequence, 42u);
    EXPECT_EQ(f.header().records, n);
    EXPECT_EQ(f.ReadKeys(), r.keys);

    // A few scattered rows: only their blocks are read.
    const std::vector<uint64_t> few = {500, 3, 3, 776, 0};
    std::vector<uint8_t> out(few.size() * row_bytes);
    std::vector<uint64_t> few_keys;
    for (uint64_t slot : few) few_keys.push_back(r.keys[slot]);
    const uint64_t read = f.ReadRows(few.data(), few_keys.data(), few.size(), out.data());
    const uint64_t region = f.layout().file_bytes() - f.layout().rows_offset();
    EXPECT_LE(read, region);
    for (size_t i = 0; i < few.size(); ++i) {
      ASSERT_EQ(std::memcmp(out.data() + i * row_bytes, r.rows.data() + few[i] * row_bytes, row_bytes), 0)
          << "row_bytes " << row_bytes << " slot " << few[i];
    }
    // Every row, reversed: the whole region in one read.
    std::vector<uint64_t> all(n), all_keys(n);
    for (uint64_t i = 0; i < n; ++i) all[i] = n - 1 - i, all_keys[i] = r.keys[n - 1 - i];
    std::vector<uint8_t> every(n * row_bytes);
    EXPECT_EQ(f.ReadRows(all.data(), all_keys.data(), n, every.data()), region);
    for (uint64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(every.data() + i * row_bytes, r.rows.data() + (n - 1 - i) * row_bytes, row_bytes), 0);
    }
  }
}

TEST_F(ParamFileTest, EmptyFile) {
  WriteParamFile(Path("empty"), 1, 16, nullptr, nullptr, 0);
  ParamFile f = ParamFile::Open(Path("empty"), 16, true);
  EXPECT_TRUE(f.ReadKeys().empty());
  EXPECT_EQ(fs::file_size(Path("empty")), kBlockBytes);
}

TEST_F(ParamFileTest, NeverOverwritesAnExistingFile) {
  const Records r = MakeRecords(10, 8, 1);
  WriteParamFile(Path("f"), 1, 8, r.keys.data(), r.rows.data(), 10);
  const auto size = fs::file_size(Path("f"));
  EXPECT_THROW(WriteParamFile(Path("f"), 2, 8, r.keys.data(), r.rows.data(), 5), IoError);
  EXPECT_EQ(fs::file_size(Path("f")), size);
  EXPECT_EQ(ParamFile::Open(Path("f"), 8, true).header().sequence, 1u);
}

void ExpectCorrupt(const std::string& path, uint32_t row_bytes, bool verify_rows,
                   const std::string& what) {
  // Both ways keys are read: whole (compaction) and in chunks (the store's open).
  for (const bool chunked : {false, true}) {
    try {
      const ParamFile f = ParamFile::Open(path, row_bytes, verify_rows);
      if (chunked) {
        f.ForEachKeyChunk([](const uint64_t*, uint64_t, uint64_t) {}, 7);
      } else {
        f.ReadKeys();
      }
      ADD_FAILURE() << "opened " << path << (chunked ? " in chunks" : "") << ", expected: " << what;
    } catch (const CorruptionError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path), std::string::npos) << message;
      EXPECT_NE(message.find(what), std::string::npos) << message;
    }
  }
}

TEST_F(ParamFileTest, KeysInChunksAreTheKeysInSlotOrder) {
  const Records r = MakeRecords(1000, 16, 5);
  WriteParamFile(Path("f"), 1, 16, r.keys.data(), r.rows.data(), 1000);
  const ParamFile f = ParamFile::Open(Path("f"), 16, true);
  for (const uint64_t chunk : {1ull, 7ull, 999ull, 1000ull, 4096ull}) {
    std::vector<uint64_t> got;
    uint64_t calls = 0, largest = 0;
    f.ForEachKeyChunk([&](const uint64_t* keys, uint64_t first, uint64_t n) {
      EXPECT_EQ(first, got.size());
      got.insert(got.end(), keys, keys + n);
      ++calls;
      largest = std::max(largest, n);
    }, chunk);
    EXPECT_EQ(got, r.keys) << "chunk " << chunk;
    EXPECT_EQ(calls, (1000 + chunk - 1) / chunk) << "chunk " << chunk;
    EXPECT_LE(largest, chunk);
  }
  WriteParamFile(Path("empty"), 2, 16, nullptr, nullptr, 0);
  uint64_t empty_calls = 0;
  ParamFile::Open(Path("empty"), 16, true).ForEachKeyChunk([&](const uint64_t*, uint64_t, uint64_t) { ++empty_calls; });
  EXPECT_EQ(empty_calls, 0u);
}

TEST_F(ParamFileTest, CorruptionIsReportedWithFileAndField) {
  const uint32_t row_bytes = 64;
  const Records r = MakeRecords(100, row_bytes, 3);
  const std::string path = Path("f");
  WriteParamFile(path, 9, row_bytes, r.keys.data(), r.rows.data(), 100);
  const ParamFileLayout layout{row_bytes, 100};

  const std::string copy = Path("copy");
  auto fresh = [&] {
    fs::copy_file(path, copy, fs::copy_options::overwrite_existing);
    return copy;
  };
  FlipByte(fresh(), 20);
  ExpectCorrupt(copy, row_bytes, false, "header CRC mismatch");
  FlipByte(fresh(), 0);
  ExpectCorrupt(copy, row_bytes, false, "bad magic");
  FlipByte(fresh(), layout.keys_offset() + 13);
  ExpectCorrupt(copy, row_bytes, false, "keys CRC mismatch");
  FlipByte(fresh(), layout.block_crcs_offset() + 5);
  ExpectCorrupt(copy, row_bytes, false, "block CRC table CRC mismatch");
  // 100 rows of 64 bytes: blocks 0 and 1 of the rows region, the second
  // zero-padded after its 36th row.
  FlipByte(fresh(), layout.rows_offset() + 77);
  ExpectCorrupt(copy, row_bytes, true,
                "rows block 0 (file offset " + std::to_string(layout.rows_offset()) + ") CRC mismatch");
  EXPECT_NO_THROW(ParamFile::Open(copy, row_bytes, false));  // rows unchecked by request
  FlipByte(fresh(), layout.file_bytes() - 1);  // padding: outside rows_crc, inside block 1's CRC
  ExpectCorrupt(copy, row_bytes, true, "rows block 1 (file offset " +
                                           std::to_string(layout.rows_offset() + kBlockBytes) +
                                           ") CRC mismatch");
  fs::resize_file(fresh(), layout.file_bytes() - kBlockBytes);
  ExpectCorrupt(copy, row_bytes, false, "the header implies");
  fs::resize_file(fresh(), layout.file_bytes() + kBlockBytes);  // longer is no better than shorter
  ExpectCorrupt(copy, row_bytes, false, "the header implies");
  fs::resize_file(fresh(), 20);  // magic intact, the rest of the header gone
  ExpectCorrupt(copy, row_bytes, false, "file ends early, at byte 20");
  ExpectCorrupt(path, 32, false, "rows of 64 bytes, the store expects 32");
  EXPECT_THROW(ParamFile::Open(Path("missing"), row_bytes, false), IoError);
}

TEST_F(ParamFileTest, BlockCrcTableCoversEveryRowsBlock) {
  const uint32_t row_bytes = 100;
  const uint64_t n = 200;  // 20000 bytes of rows: 5 blocks, the last one padded
  const Records r = MakeRecords(n, row_bytes, 11);
  const std::string path = Path("f");
  WriteParamFile(path, 3, row_bytes, r.keys.data(), r.rows.data(), n);
  const ParamFileLayout layout{row_bytes, n};
  EXPECT_EQ(layout.row_blocks(), 5u);
  EXPECT_EQ(layout.block_crcs_offset(), 2 * kBlockBytes);  // after one block of keys
  EXPECT_EQ(layout.rows_offset(), 3 * kBlockBytes);
  EXPECT_EQ(fs::file_size(path), 8 * kBlockBytes);

  std::vector<uint8_t> bytes(fs::file_size(path));
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(bytes.data()),
                                             static_cast<std::streamsize>(bytes.size()));
  std::vector<uint32_t> expected;
  for (uint64_t b = 0; b < 5; ++b) {
    expected.push_back(Crc32c(bytes.data() + layout.rows_offset() + b * kBlockBytes, kBlockBytes));
  }
  std::vector<uint32_t> on_disk(5);
  std::memcpy(on_disk.data(), bytes.data() + layout.block_crcs_offset(), 5 * sizeof(uint32_t));
  EXPECT_EQ(on_disk, expected);
  for (uint64_t at = layout.block_crcs_offset() + 5 * 4; at < layout.rows_offset(); ++at) {
    ASSERT_EQ(bytes[at], 0) << "table padding at " << at;
  }
  ParamFileHeader h;
  std::memcpy(&h, bytes.data(), sizeof h);
  EXPECT_EQ(h.version, 3u);
  EXPECT_EQ(h.blocks_crc, Crc32c(expected.data(), 5 * sizeof(uint32_t)));

  const ParamFile f = ParamFile::Open(path, row_bytes, /*verify_rows=*/true);
  EXPECT_EQ(f.block_crcs(), expected);

  // A store's full file (65536 records of 128 bytes, 8 MiB of rows): 2048
  // blocks, 8 KiB of table.
  const ParamFileLayout full{128, 65536};
  EXPECT_EQ(full.row_blocks(), 2048u);
  EXPECT_EQ(full.block_crcs_bytes(), 8192u);
  EXPECT_EQ(full.rows_offset(), kBlockBytes + 512 * 1024 + 8192);
  // Version 1 had no table.
  const ParamFileLayout old{128, 65536, 1};
  EXPECT_EQ(old.block_crcs_bytes(), 0u);
  EXPECT_EQ(old.rows_offset(), kBlockBytes + 512 * 1024);
}

// Version 3's stamp comes back, and its header CRC guards it like any field.
TEST_F(ParamFileTest, StampRoundTripsUnderTheHeaderCrc) {
  const Records r = MakeRecords(10, 8, 4);
  const std::string path = Path("stamped");
  WriteParamFile(path, 1, 8, r.keys.data(), r.rows.data(), 10, /*stamp=*/0x1122334455667788ull);
  EXPECT_EQ(ParamFile::Open(path, 8, true).stamp(), 0x1122334455667788ull);
  EXPECT_EQ(ParamFile::Open(path, 8, true).header().version, 3u);
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekp(static_cast<std::streamoff>(kStampOffset + 3));
  file.put('\x5a');
  file.close();
  ExpectCorrupt(path, 8, false, "header CRC mismatch");
}

// Reads some rows as the store's get does: plan, a BlockIo's reads, CopyRows.
void ReadThrough(const ParamFile& f, BlockIo& io, const std::vector<uint64_t>& slots,
                 const std::vector<uint64_t>& keys, std::vector<uint8_t>* out) {
  const ParamFile::RowsPlan plan = f.PlanRows(slots.data(), slots.size());
  AlignedBuffer buffer(plan.bytes);
  std::vector<IoRequest> reads;
  f.AddReads(plan, buffer.data(), &reads);
  io.ReadAll(reads);
  out->resize(slots.size() * f.header().row_bytes);
  f.CopyRows(plan, buffer.data(), slots.data(), keys.data(), slots.size(), out->data());
}

// (io_uring?, O_DIRECT?)
class BlockCrcReadTest : public TempDir, public ::testing::WithParamInterface<std::tuple<bool, bool>> {};

// A row of 1000 bytes: rows 4 (4000..4999) and 8 (8000..8999) straddle two blocks.
TEST_P(BlockCrcReadTest, EveryReadChecksTheBlocksItTouches) {
  const auto [uring, direct] = GetParam();
  std::unique_ptr<BlockIo> io = NewBlockIo(uring);
  if (uring && std::string(io->name()) != "io_uring") GTEST_SKIP() << "io_uring unavailable";
  const uint32_t row_bytes = 1000;
  const uint64_t n = 40;  // 10 blocks
  const Records r = MakeRecords(n, row_bytes, 21);
  const std::string path = Path("f");
  WriteParamFile(path, 1, row_bytes, r.keys.data(), r.rows.data(), n);
  const ParamFileLayout layout{row_bytes, n};
  // Row 8's second half, in rows block 2, goes bad after the file was opened
  // (bit rot under a running store).
  const ParamFile f = ParamFile::Open(path, row_bytes, /*verify_rows=*/true, direct);
  FlipByte(path, layout.row_offset(8) + 900);  // an O_DIRECT read flushes it first
  if (!direct) {
    EXPECT_FALSE(f.direct());
  } else if (!f.direct()) {
    std::cerr << "note: " << path << " refuses O_DIRECT; reads are buffered\n";
  }

  auto keys_of = [&](const std::vector<uint64_t>& slots) {
    std::vector<uint64_t> keys;
    for (uint64_t s : slots) keys.push_back(r.keys[s]);
    return keys;
  };
  std::vector<uint8_t> out;
  // Rows in healthy blocks read, and match, whatever else is in the file.
  for (const std::vector<uint64_t>& slots :
       std::vector<std::vector<uint64_t>>{{0, 3}, {13, 4, 39}, {20}}) {
    ReadThrough(f, *io, slots, keys_of(slots), &out);
    for (size_t i = 0; i < slots.size(); ++i) {
      ASSERT_EQ(std::memcmp(out.data() + i * row_bytes, r.rows.data() + slots[i] * row_bytes, row_bytes), 0);
    }
  }
  // Rows 8 (8000..8999) and 9 (9000..9999) touch block 2 (8192..12287):
  // both fail, row 8 though its first block is sound, row 9 though its own
  // bytes are intact; so does the whole region read in one go.
  const std::string block = "rows block 2 (file offset " + std::to_string(layout.rows_offset() + 2 * kBlockBytes) + ")";
  for (const std::vector<uint64_t>& slots :
       std::vector<std::vector<uint64_t>>{{8}, {0, 9}, {39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26,
                                                        25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12,
                                                        11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0}}) {
    const std::vector<uint64_t> keys = keys_of(slots);
    // The message names the first requested row in block 2 (rows 8 to 12).
    const auto first_bad = std::find_if(slots.begin(), slots.end(), [](uint64_t s) { return s >= 8 && s <= 12; });
    const uint64_t bad_key = keys[static_cast<size_t>(first_bad - slots.begin())];
    try {
      ReadThrough(f, *io, slots, keys, &out);
      ADD_FAILURE() << "read a corrupt block, slots from " << slots[0];
    } catch (const CorruptionError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path), std::string::npos) << message;
      EXPECT_NE(message.find(block), std::string::npos) << message;
      EXPECT_NE(message.find("key " + std::to_string(bad_key)), std::string::npos) << message;
    }
    // Compaction's path (pread) checks the same blocks.
    EXPECT_THROW(f.ReadRows(slots.data(), keys.data(), slots.size(), out.data()), CorruptionError);
  }
}

INSTANTIATE_TEST_SUITE_P(IoPaths, BlockCrcReadTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "io_uring" : "pread") +
                                  (std::get<1>(info.param) ? "_direct" : "_buffered");
                         });

// A version 1 file as the previous build wrote it: no block-CRC table.
void WriteVersion1File(const std::string& path, uint32_t row_bytes, const Records& r) {
  const uint64_t n = r.keys.size();
  const ParamFileLayout layout{row_bytes, n, 1};
  std::vector<uint8_t> bytes(layout.file_bytes(), 0);
  ParamFileHeader h{};
  std::memcpy(h.magic, "HPSPARAM", 8);
  h.version = 1;
  h.row_bytes = row_bytes;
  h.sequence = 5;
  h.records = n;
  h.keys_crc = Crc32c(r.keys.data(), n * 8);
  h.rows_crc = Crc32c(r.rows.data(), n * row_bytes);
  h.header_crc = Crc32c(&h, sizeof h);  // with header_crc (and blocks_crc, "reserved") 0
  std::memcpy(bytes.data(), &h, sizeof h);
  std::memcpy(bytes.data() + layout.keys_offset(), r.keys.data(), n * 8);
  std::memcpy(bytes.data() + layout.rows_offset(), r.rows.data(), n * row_bytes);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

TEST_F(ParamFileTest, Version1FilesAreCheckedWholeAtOpenThenByBlock) {
  const uint32_t row_bytes = 64;
  const Records r = MakeRecords(100, row_bytes, 31);
  const std::string path = Path("v1");
  WriteVersion1File(path, row_bytes, r);
  const ParamFileLayout layout{row_bytes, 100, 1};
  {
    const ParamFile f = ParamFile::Open(path, row_bytes, /*verify_rows=*/false);
    EXPECT_EQ(f.header().version, 1u);
    EXPECT_EQ(f.layout().rows_offset(), layout.rows_offset());
    EXPECT_EQ(f.ReadKeys(), r.keys);
    ASSERT_EQ(f.block_crcs().size(), 2u);
    std::vector<uint8_t> block(kBlockBytes, 0);
    std::memcpy(block.data(), r.rows.data(), kBlockBytes);
    EXPECT_EQ(f.block_crcs()[0], Crc32c(block.data(), kBlockBytes));
    const std::vector<uint64_t> slots = {70, 1}, keys = {r.keys[70], r.keys[1]};
    std::vector<uint8_t> out(2 * row_bytes);
    f.ReadRows(slots.data(), keys.data(), 2, out.data());
    EXPECT_EQ(std::memcmp(out.data(), r.rows.data() + 70 * row_bytes, row_bytes), 0);
    // Damage after open is caught by the table computed at open.
    FlipByte(path, layout.row_offset(1));
    try {
      f.ReadRows(slots.data(), keys.data(), 2, out.data());
      ADD_FAILURE() << "read a corrupt version 1 block";
    } catch (const CorruptionError& e) {
      EXPECT_NE(std::string(e.what()).find("rows block 0"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("key " + std::to_string(r.keys[1])), std::string::npos) << e.what();
    }
  }
  // Damage before open: its rows are always checked at open, asked or not.
  ExpectCorrupt(path, row_bytes, false, "rows CRC mismatch");

  // A version from a later build is named, with what this one reads.
  WriteVersion1File(path + "3", row_bytes, r);
  ParamFileHeader h;
  std::fstream file(path + "3", std::ios::in | std::ios::out | std::ios::binary);
  file.read(reinterpret_cast<char*>(&h), sizeof h);
  h.version = 4;
  h.header_crc = 0;
  const uint64_t stamp = 0;  // from version 3 on the header CRC covers the stamp after it
  h.header_crc = Crc32c(&stamp, sizeof stamp, Crc32c(&h, sizeof h));
  file.seekp(0);
  file.write(reinterpret_cast<const char*>(&h), sizeof h);
  file.close();
  ExpectCorrupt(path + "3", row_bytes, false, "format version 4, this build reads 1 to 3");
}

using ManifestTest = TempDir;

TEST_F(ManifestTest, MissingManifestIsAnEmptyStore) {
  const ManifestReplay r = ReplayManifest(Path("MANIFEST"));
  EXPECT_TRUE(r.state.live_files.empty());
  EXPECT_EQ(r.valid_bytes, 0u);
}

TEST_F(ManifestTest, ReplaysCommittedEditsOnly) {
  const std::string path = Path("MANIFEST");
  {
    ManifestWriter w(path, {});
    w.AddFile(1, 100);
    w.AddFile(2, 50);
    w.Commit();
    w.DropFile(1);
    w.AddFile(3, 70);
    w.Commit();
    w.AddFile(4, 10);  // never committed: never written
  }
  const ManifestReplay r = ReplayManifest(path);
  EXPECT_EQ(r.state.live_files, (std::map<uint64_t, uint64_t>{{2, 50}, {3, 70}}));
  EXPECT_EQ(r.state.commits, 2u);
  EXPECT_EQ(r.state.max_sequence, 3u);
  EXPECT_EQ(r.valid_bytes, fs::file_size(path));
  EXPECT_EQ(r.ignored_bytes, 0u);
}

// Writes a MANIFEST of two commits, file 1 (100 bytes) and then `second`'s
// edits; returns the bytes of the first commit.
uint64_t WriteTwoCommits(const std::string& path, const std::function<void(ManifestWriter&)>& second) {
  ManifestWriter w(path, {});
  w.AddFile(1, 100);
  w.Commit();
  const uint64_t first_commit_bytes = w.bytes();
  second(w);
  w.Commit();
  return first_commit_bytes;
}

TEST_F(ManifestTest, TornLastCommitFallsBackToThePreviousOne) {
  const std::string path = Path("MANIFEST");
  const uint64_t first_commit_bytes = WriteTwoCommits(path, [](ManifestWriter& w) {
    w.AddFile(2, 5);
    w.DropFile(1);
  });
  const uint64_t full = fs::file_size(path);
  // A crash can stop the second append at any byte.
  for (uint64_t cut = first_commit_bytes; cut < full; ++cut) {
    const std::string torn = Path("torn");
    fs::copy_file(path, torn, fs::copy_options::overwrite_existing);
    fs::resize_file(torn, cut);
    const ManifestReplay r = ReplayManifest(torn);
    ASSERT_EQ(r.state.live_files, (std::map<uint64_t, uint64_t>{{1, 100}})) << "cut at " << cut;
    ASSERT_EQ(r.valid_bytes, first_commit_bytes);
    ASSERT_EQ(r.ignored_bytes, cut - first_commit_bytes);
    // Appending after a replay cuts the torn tail off first.
    {
      ManifestWriter w(torn, r);
      w.AddFile(7, 1);
      w.Commit();
    }
    ASSERT_EQ(ReplayManifest(torn).state.live_files,
              (std::map<uint64_t, uint64_t>{{1, 100}, {7, 1}}));
  }
}

// A crash can leave whole edit records of the last append, short only of its
// commit record. The next writer must cut them off: its own append is
// written at the end of the last commit, and when it is shorter than the
// torn tail, the tail's whole records would follow it, and replay would take
// that for damage inside the log and refuse the store.
TEST_F(ManifestTest, AppendingAfterATornTailOfWholeEditsCutsThemOff) {
  const std::string path = Path("MANIFEST");
  const uint64_t first_commit_bytes = WriteTwoCommits(path, [](ManifestWriter& w) {
    for (uint64_t file = 2; file <= 4; ++file) w.AddFile(file, 5);
  });
  fs::resize_file(path, fs::file_size(path) - 1);  // the commit record torn
  const ManifestReplay torn = ReplayManifest(path);
  ASSERT_EQ(torn.valid_bytes, first_commit_bytes);
  {
    ManifestWriter w(path, torn);
    EXPECT_EQ(fs::file_size(path), first_commit_bytes);
    w.Commit();  // a commit with no edits, as a store's commit with no puts
  }
  const ManifestReplay r = ReplayManifest(path);
  EXPECT_EQ(r.state.live_files, (std::map<uint64_t, uint64_t>{{1, 100}}));
  EXPECT_EQ(r.state.commits, 2u);
  EXPECT_EQ(r.ignored_bytes, 0u);
}

// The log of three commits that the damage tests below take apart, and
// where each of its records starts.
std::vector<uint64_t> WriteThreeCommits(const std::string& path) {
  {
    ManifestWriter w(path, {});
    w.AddFile(1, 10);
    w.Commit();
    w.AddFile(2, 20);
    w.DropFile(1);
    w.Commit();
    w.AddFile(3, 30);
    w.Commit();
  }
  std::vector<uint64_t> starts;
  std::ifstream in(path, std::ios::binary);
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (uint64_t at = 0; at < log.size();) {
    starts.push_back(at);
    uint32_t length;
    std::memcpy(&length, log.data() + at, 4);
    at += 8 + length;
  }
  return starts;
}

TEST_F(ManifestTest, DamageInTheLastRecordIsATornTail) {
  const std::string path = Path("MANIFEST");
  const std::vector<uint64_t> starts = WriteThreeCommits(path);
  const uint64_t size = fs::file_size(path);
  ASSERT_EQ(starts.size(), 7u);
  // Nothing follows the last record: a crash's garbage there is a torn
  // append, and replay falls back to the commit before it.
  for (uint64_t at = starts.back(); at < size; ++at) {
    FlipByte(path, at);
    const ManifestReplay r = ReplayManifest(path);
    ASSERT_EQ(r.state.live_files, (std::map<uint64_t, uint64_t>{{2, 20}})) << "flip at " << at;
    ASSERT_EQ(r.valid_bytes, starts[5]) << "flip at " << at;
    FlipByte(path, at);
  }
}

TEST_F(ManifestTest, DamageBeforeTheLastRecordIsCorruption) {
  // Replay once ended here, silently, and the store's open then removed the
  // files of every later commit.
  const std::string path = Path("MANIFEST");
  const std::vector<uint64_t> starts = WriteThreeCommits(path);
  for (size_t record = 0; record + 1 < starts.size(); ++record) {
    for (uint64_t at = starts[record]; at < starts[record + 1]; ++at) {
      FlipByte(path, at);
      try {
        ReplayManifest(path);
        ADD_FAILURE() << "replayed a log with byte " << at << " flipped";
      } catch (const CorruptionError& e) {
        const std::string want = path + ": record at byte " + std::to_string(starts[record]) + ": ";
        ASSERT_EQ(std::string(e.what()).rfind(want, 0), 0u) << e.what();
        ASSERT_NE(std::string(e.what()).find("damaged before its end"), std::string::npos) << e.what();
      }
      FlipByte(path, at);
    }
  }
  EXPECT_EQ(ReplayManifest(path).state.live_files, (std::map<uint64_t, uint64_t>{{2, 20}, {3, 30}}));
}

TEST_F(ManifestTest, ContradictoryCommittedEditsAreCorruption) {
  const std::string path = Path("MANIFEST");
  {
    ManifestWriter w(path, {});
    w.DropFile(5);
    w.Commit();
  }
  try {
    ReplayManifest(path);
    ADD_FAILURE() << "replayed a drop of an unknown file";
  } catch (const CorruptionError& e) {
    EXPECT_NE(std::string(e.what()).find("drops file 5, which is not live"), std::string::npos);
  }
}

// A log that every commit only appended to grew for the life of a store,
// and every open replayed all of it. The writer now rolls it past its bound:
// after each commit it is within max(floor, 4 x its rolled size), and it
// replays to the state of its last commit, the count of commits and the
// highest sequence committed (here a file dropped since) included.
TEST_F(ManifestTest, ARolledLogStaysUnderItsBoundAndReplaysToTheLastCommit) {
  const std::string path = Path("MANIFEST");
  constexpr uint64_t kFloor = 512;
  std::map<uint64_t, uint64_t> live;
  uint64_t commits = 0;
  ManifestWriter w(path, {}, kFloor);
  auto commit = [&] {
    w.Commit();
    ++commits;
    ManifestState state;
    state.live_files = live;
    ASSERT_LE(fs::file_size(path), std::max(kFloor, kManifestRollFactor * RolledManifestBytes(state)))
        << "after commit " << commits;
  };
  for (uint64_t seq = 1; seq <= 300; ++seq) {  // three files live at most
    w.AddFile(seq, seq * 10);
    live[seq] = seq * 10;
    if (seq > 3) {
      w.DropFile(seq - 3);
      live.erase(seq - 3);
    }
    commit();
  }
  EXPECT_GT(w.rolls(), 0u);
  EXPECT_EQ(w.TakeRollError(), "");
  // The highest sequence, then dropped: only the base record of a rolled log
  // still knows it.
  w.AddFile(1000, 1);
  commit();
  w.DropFile(1000);
  commit();
  for (const uint64_t rolls = w.rolls(); w.rolls() == rolls && commits < 1000;) commit();
  const ManifestReplay r = ReplayManifest(path);
  EXPECT_EQ(r.state.live_files, live);
  EXPECT_EQ(r.state.commits, commits);
  EXPECT_EQ(r.state.max_sequence, 1000u);
  EXPECT_EQ(r.ignored_bytes, 0u);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  // A writer of the replayed log goes on appending to the rolled one.
  {
    ManifestWriter again(path, r, kFloor);
    again.AddFile(1001, 5);
    again.Commit();
  }
  live[1001] = 5;
  EXPECT_EQ(ReplayManifest(path).state.live_files, live);
  EXPECT_EQ(ReplayManifest(path).state.commits, commits + 1);
}

// A crash before a roll's rename leaves MANIFEST.tmp beside the log, whole
// or not: replay never reads it, and the next writer removes it.
TEST_F(ManifestTest, ARollCutShortByACrashIsNeverReadAndIsRemoved) {
  const std::string path = Path("MANIFEST");
  {
    ManifestWriter w(path, {});
    w.AddFile(1, 10);
    w.Commit();
  }
  std::ofstream(path + ".tmp", std::ios::binary) << "half a rolled log";
  const ManifestReplay r = ReplayManifest(path);
  EXPECT_EQ(r.state.live_files, (std::map<uint64_t, uint64_t>{{1, 10}}));
  ManifestWriter w(path, r);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// A base record opens a rolled log and nowhere else: one further on is
// damage, which replay must not take for a state to jump to.
TEST_F(ManifestTest, ABaseRecordAfterTheStartIsCorruption) {
  const std::string path = Path("MANIFEST");
  {
    ManifestWriter w(path, {});
    w.AddFile(1, 10);
    w.Commit();
  }
  uint8_t record[8 + 17] = {};
  const uint32_t length = 17;
  record[8] = static_cast<uint8_t>(ManifestEdit::kBase);
  const uint32_t crc = Crc32c(record + 8, length);
  std::memcpy(record, &length, 4);
  std::memcpy(record + 4, &crc, 4);
  const uint64_t at = fs::file_size(path);
  std::ofstream(path, std::ios::binary | std::ios::app).write(reinterpret_cast<const char*>(record), sizeof record);
  try {
    ReplayManifest(path);
    ADD_FAILURE() << "replayed a base record in the middle of a log";
  } catch (const CorruptionError& e) {
    EXPECT_NE(std::string(e.what()).find("record at byte " + std::to_string(at) + ": a base record"), std::string::npos)
        << e.what();
  }
}

using SsdStoreTest = TempDir;

TEST_F(SsdStoreTest, PutGetCommitReopen) {
  const uint32_t row_bytes = 24;
  const Records first = MakeRecords(1000, row_bytes, 5);
  const Records second = MakeRecords(300, row_bytes, 6);
  {
    auto store = SsdStore::Open({dir_, row_bytes, 128, false});
    store->Put(first.keys.data(), 1000, first.rows.data());
    store->Commit();
    store->Put(second.keys.data(), 300, second.rows.data());  // never committed
    EXPECT_EQ(store->size(), 1300u);
  }
  auto store = SsdStore::Open({dir_, row_bytes, 128, true});
  ASSERT_EQ(store->size(), 1000u);
  std::vector<uint8_t> out(1000 * row_bytes);
  std::vector<uint8_t> found(1000);
  EXPECT_EQ(store->Get(first.keys.data(), 1000, out.data(), found.data()), 1000u);
  EXPECT_EQ(out, first.rows);
  EXPECT_EQ(store->Get(second.keys.data(), 1, out.data(), found.data()), 0u);

  // Overwrite 600 of the 1000 keys and compact: files more than half stale
  // move their live records to new files, and every row reads back.
  const Records update = MakeRecords(600, row_bytes, 7);
  store->Put(first.keys.data(), 600, update.rows.data());
  store->Compact();
  const SsdStoreStats st = store->stats();
  EXPECT_GE(st.compactions, 1u);
  EXPECT_LE(st.live_records + st.stale_records, 2 * st.live_records);
  store = SsdStore::Open({dir_, row_bytes, 128, true});
  EXPECT_EQ(store->Get(first.keys.data(), 1000, out.data(), found.data()), 1000u);
  EXPECT_EQ(std::memcmp(out.data(), update.rows.data(), 600 * row_bytes), 0);
  EXPECT_EQ(std::memcmp(out.data() + 600 * row_bytes, first.rows.data() + 600 * row_bytes,
                        400 * row_bytes), 0);
}

TEST(KeyIndex, MatchesAMapThroughGrowth) {
  KeyIndex index;
  std::unordered_map<uint64_t, uint32_t> model;
  std::mt19937_64 rng(5);
  for (uint32_t i = 0; i < 200000; ++i) {
    const uint64_t key = rng() % 150000;  // repeats: updates as well as inserts
    const auto it = model.find(key);
    const uint32_t expected_old = it == model.end() ? KeyIndex::kNone : it->second;
    ASSERT_EQ(index.Upsert(key, i), expected_old);
    model[key] = i;
  }
  ASSERT_EQ(index.size(), model.size());
  for (const auto& [key, value] : model) ASSERT_EQ(index.Find(key), value);
  EXPECT_EQ(index.Find(1u << 30), KeyIndex::kNone);
  // Replace only from the expected value.
  const uint64_t key = model.begin()->first;
  const uint32_t value = model.begin()->second;
  EXPECT_FALSE(index.Replace(key, value + 1, 7));
  EXPECT_TRUE(index.Replace(key, value, 7));
  EXPECT_EQ(index.Find(key), 7u);
  EXPECT_FALSE(index.Replace(1u << 30, KeyIndex::kNone, 7));
  // 12 bytes a slot at load 0.4-0.8.
  EXPECT_LE(index.memory_bytes(), model.size() * 12 / 0.35);
}

TEST(KeyIndex, SizedUpFrontHoldsItsKeysWithoutGrowing) {
  KeyIndex index(100000);
  const uint64_t before = index.memory_bytes();
  EXPECT_GT(before, 0u);
  for (uint32_t i = 0; i < 100000; ++i) ASSERT_EQ(index.Upsert(uint64_t{i} * 7919, i), KeyIndex::kNone);
  EXPECT_EQ(index.memory_bytes(), before);  // no shard had to grow
  for (uint32_t i = 0; i < 100000; ++i) ASSERT_EQ(index.Find(uint64_t{i} * 7919), i);
  EXPECT_EQ(index.Find(3), KeyIndex::kNone);
}

// MEM-PS erases on every eviction: inserts and erases mixed, with dense key
// ranges so that probe runs are long and the backward shift wraps around.
TEST(KeyIndex, EraseKeepsEveryOtherKeyFindable) {
  KeyIndex index;
  std::unordered_map<uint64_t, uint32_t> model;
  std::mt19937_64 rng(9);
  for (uint32_t i = 0; i < 300000; ++i) {
    const uint64_t key = rng() % 5000;
    if (rng() % 3 == 0) {
      const auto it = model.find(key);
      ASSERT_EQ(index.Erase(key), it == model.end() ? KeyIndex::kNone : it->second);
      if (it != model.end()) model.erase(it);
    } else {
      index.Upsert(key, i);
      model[key] = i;
    }
    if (i % 10007 == 0) {
      ASSERT_EQ(index.size(), model.size());
      for (uint64_t k = 0; k < 5000; ++k) {
        const auto it = model.find(k);
        ASSERT_EQ(index.Find(k), it == model.end() ? KeyIndex::kNone : it->second) << "key " << k;
      }
    }
  }
  for (const auto& [key, value] : model) ASSERT_EQ(index.Erase(key), value);
  EXPECT_EQ(index.size(), 0u);
  EXPECT_EQ(index.Find(1), KeyIndex::kNone);
}

// Readers, a writer and the background compaction at once; run under TSan.
TEST_F(SsdStoreTest, ConcurrentGetsPutsAndCompaction) {
  constexpr uint32_t row_bytes = 16;
  constexpr uint64_t n = 3000;
  SsdStoreOptions options;
  options.path = dir_;
  options.row_bytes = row_bytes;
  options.file_records = 100;
  options.compaction_trigger = 1.2;
  auto store = SsdStore::Open(options);
  // Row of key k at version v: (k, v, k, v) as uint32.
  auto row_of = [](uint64_t k, uint32_t v, uint8_t* out) {
    const uint32_t words[4] = {static_cast<uint32_t>(k), v, static_cast<uint32_t>(k), v};
    std::memcpy(out, words, sizeof words);
  };
  std::vector<uint64_t> keys(n);
  std::vector<uint8_t> rows(n * row_bytes);
  for (uint64_t k = 0; k < n; ++k) {
    keys[k] = k;
    row_of(k, 0, rows.data() + k * row_bytes);
  }
  store->Put(keys.data(), n, rows.data());
  store->Commit();
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> bad{0};
  auto reader = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint64_t> ask(200);
    std::vector<uint8_t> out(ask.size() * row_bytes), found(ask.size());
    while (!stop) {
      for (auto& k : ask) k = rng() % n;
      store->Get(ask.data(), ask.size(), out.data(), found.data());
      for (size_t i = 0; i < ask.size(); ++i) {
        uint32_t w[4];
        std::memcpy(w, out.data() + i * row_bytes, sizeof w);
        if (!found[i] || w[0] != ask[i] || w[2] != ask[i] || w[1] != w[3]) ++bad;
      }
      (void)store->stats();
    }
  };
  std::thread r1(reader, 1), r2(reader, 2);
  std::vector<uint32_t> version(n, 0);
  std::mt19937_64 rng(3);
  for (uint32_t v = 1; v <= 20; ++v) {
    std::vector<uint64_t> subset;
    for (uint64_t k = 0; k < n; ++k) {
      if (rng() % 2) subset.push_back(k);
    }
    std::vector<uint8_t> update(subset.size() * row_bytes);
    for (size_t i = 0; i < subset.size(); ++i) {
      row_of(subset[i], v, update.data() + i * row_bytes);
      version[subset[i]] = v;
    }
    store->Put(subset.data(), subset.size(), update.data());
    store->Commit();
  }
  stop = true;
  r1.join();
  r2.join();
  EXPECT_EQ(bad.load(), 0u);
  store->WaitForCompaction();
  SsdStoreStats st = store->stats();
  EXPECT_GE(st.compactions, 2u);
  EXPECT_EQ(st.compaction_failures, 0u) << st.last_error;
  EXPECT_LE(st.live_records + st.stale_records, static_cast<uint64_t>(1.2 * n));
  store.reset();
  store = SsdStore::Open(options);
  std::vector<uint8_t> out(n * row_bytes), found(n);
  ASSERT_EQ(store->Get(keys.data(), n, out.data(), found.data()), n);
  for (uint64_t k = 0; k < n; ++k) {
    uint32_t w[4];
    std::memcpy(w, out.data() + k * row_bytes, sizeof w);
    ASSERT_EQ(w[1], version[k]) << "key " << k;
  }
}


// Bound() against a model: key -> (stamp of its last put, version). TTL
// erases the keys stamped below min_stamp; the cap then the oldest beyond
// max_live, by (stamp, key). Reopens with and without a commit before, and
// compactions between, so that rows rewritten by compaction keep their stamp
// and nothing erased and committed comes back.
struct BoundModel {
  std::map<uint64_t, std::pair<uint64_t, uint32_t>> rows;  // key -> (stamp, version)
  // The keys Bound(min_stamp, max_live) erases: (expired, capped), ascending.
  std::pair<std::vector<uint64_t>, std::vector<uint64_t>> Bound(uint64_t min_stamp, uint64_t max_live) {
    std::vector<uint64_t> expired, capped;
    for (auto it = rows.begin(); it != rows.end();) {
      if (it->second.first < min_stamp) {
        expired.push_back(it->first);
        it = rows.erase(it);
      } else {
        ++it;
      }
    }
    if (max_live > 0 && rows.size() > max_live) {
      std::vector<std::pair<uint64_t, uint64_t>> order;  // (stamp, key)
      for (const auto& [key, value] : rows) order.emplace_back(value.first, key);
      std::sort(order.begin(), order.end());
      for (uint64_t i = 0; i < rows.size() - max_live; ++i) capped.push_back(order[i].second);
      for (uint64_t key : capped) rows.erase(key);
      std::sort(capped.begin(), capped.end());
    }
    return {expired, capped};
  }
};

void BoundRow(uint64_t key, uint32_t version, uint8_t* out) {
  const uint32_t words[4] = {static_cast<uint32_t>(key), version, static_cast<uint32_t>(key >> 32), ~version};
  std::memcpy(out, words, sizeof words);
}

// Every key of `universe` reads as the model has it (absent keys absent),
// with the model's stamp.
void ExpectModel(SsdStore& store, const BoundModel& model, uint64_t universe, const std::string& where) {
  constexpr uint32_t row_bytes = 16;
  std::vector<uint64_t> keys(universe);
  for (uint64_t k = 0; k < universe; ++k) keys[k] = k + 1;
  std::vector<uint8_t> out(universe * row_bytes), found(universe), found2(universe);
  std::vector<uint64_t> stamps(universe);
  ASSERT_EQ(store.Get(keys.data(), universe, out.data(), found.data()), model.rows.size()) << where;
  store.Stamps(keys.data(), universe, stamps.data(), found2.data());
  ASSERT_EQ(store.size(), model.rows.size()) << where;
  for (uint64_t k = 0; k < universe; ++k) {
    const auto it = model.rows.find(keys[k]);
    ASSERT_EQ(found[k] != 0, it != model.rows.end()) << where << ": key " << keys[k];
    ASSERT_EQ(found2[k], found[k]) << where << ": key " << keys[k];
    if (it == model.rows.end()) continue;
    uint8_t expected[row_bytes];
    BoundRow(keys[k], it->second.second, expected);
    ASSERT_EQ(std::memcmp(out.data() + k * row_bytes, expected, row_bytes), 0) << where << ": key " << keys[k];
    ASSERT_EQ(stamps[k], it->second.first) << where << ": stamp of key " << keys[k];
  }
}

TEST_F(SsdStoreTest, BoundMatchesAModelAcrossReopensAndCompactions) {
  constexpr uint32_t row_bytes = 16;
  constexpr uint64_t universe = 2000;
  SsdStoreOptions options;
  options.path = dir_;
  options.row_bytes = row_bytes;
  options.file_records = 64;  // many files a stamp, so that a cut rewrites several
  options.compaction_trigger = 1.3;
  options.background_compaction = false;
  auto store = SsdStore::Open(options);
  BoundModel model, committed;
  std::mt19937_64 rng(20);
  uint64_t stamp = 0;
  uint32_t version = 0;
  uint64_t expired_total = 0, capped_total = 0, rewritten = 0, dropped = 0;
  for (int round = 0; round < 60; ++round) {
    const std::string where = "round " + std::to_string(round);
    stamp += 1 + rng() % 3;
    store->SetStamp(stamp);
    // A few puts: hot keys often, the rest now and then.
    for (int p = 0; p < 3; ++p) {
      std::vector<uint64_t> keys;
      const uint64_t n = 50 + rng() % 300;
      for (uint64_t i = 0; i < n; ++i) keys.push_back(1 + (rng() % 4 == 0 ? rng() % universe : rng() % 200));
      std::vector<uint8_t> rows(keys.size() * row_bytes);
      ++version;
      for (size_t i = 0; i < keys.size(); ++i) {
        BoundRow(keys[i], version, rows.data() + i * row_bytes);
        model.rows[keys[i]] = {stamp, version};
      }
      store->Put(keys.data(), keys.size(), rows.data());
    }
    const uint64_t min_stamp = rng() % 3 == 0 ? 0 : (stamp > 6 ? stamp - 6 : 0);
    const uint64_t max_live = rng() % 3 == 0 ? 0 : 400 + rng() % 500;
    const auto [expired, capped] = model.Bound(min_stamp, max_live);
    const SsdBoundResult result = store->Bound(min_stamp, max_live);
    ASSERT_EQ(result.expired, expired) << where;
    ASSERT_EQ(result.capped, capped) << where;
    expired_total += expired.size();
    capped_total += capped.size();
    rewritten += result.records_rewritten;
    dropped += result.files_dropped;
    ASSERT_NO_FATAL_FAILURE(ExpectModel(*store, model, universe, where + ", after Bound"));
    switch (rng() % 4) {
      case 0:  // a crash before the commit: back to the last one
        store.reset();
        store = SsdStore::Open(options);
        model = committed;
        stamp = std::max(stamp, store->stamp());
        ASSERT_NO_FATAL_FAILURE(ExpectModel(*store, model, universe, where + ", reopened uncommitted"));
        break;
      case 1:
        store->Compact();
        committed = model;
        ASSERT_NO_FATAL_FAILURE(ExpectModel(*store, model, universe, where + ", compacted"));
        break;
      default:
        store->Commit();
        committed = model;
        if (rng() % 2) {
          store.reset();
          store = SsdStore::Open(options);
          ASSERT_NO_FATAL_FAILURE(ExpectModel(*store, model, universe, where + ", reopened"));
        }
    }
  }
  // Both bounds bit, often, and the cap cut through a stamp.
  EXPECT_GT(expired_total, 100u);
  EXPECT_GT(capped_total, 100u);
  EXPECT_GT(rewritten, 0u);
  EXPECT_GT(dropped, 10u);
  store->Commit();
  store->Compact();
  const SsdStoreStats st = store->stats();
  EXPECT_EQ(st.live_records, model.rows.size());
  EXPECT_LE(st.live_records + st.stale_records, 2 * st.live_records);
  EXPECT_EQ(st.compaction_failures, 0u) << st.last_error;
  // Nothing but the live files is left on disk: the dropped ones are gone.
  uint64_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    files += entry.path().extension() == ".hpf";
  }
  EXPECT_EQ(files, st.files);
}

TEST_F(SsdStoreTest, ErasedKeysComeBackOnlyWhenPutAgain) {
  constexpr uint32_t row_bytes = 16;
  SsdStoreOptions options;
  options.path = dir_;
  options.row_bytes = row_bytes;
  options.file_records = 4;
  options.background_compaction = false;
  auto store = SsdStore::Open(options);
  auto put = [&](std::vector<uint64_t> keys, uint32_t version) {
    std::vector<uint8_t> rows(keys.size() * row_bytes);
    for (size_t i = 0; i < keys.size(); ++i) BoundRow(keys[i], version, rows.data() + i * row_bytes);
    store->Put(keys.data(), keys.size(), rows.data());
  };
  store->SetStamp(1);
  put({1, 2, 3, 4, 5, 6}, 1);
  store->Commit();
  store->SetStamp(2);
  put({1, 2}, 2);  // 1 and 2 newer: their stamp-1 copies are stale
  store->SetStamp(3);
  put({7}, 3);
  store->Commit();
  EXPECT_THROW(store->SetStamp(2), std::invalid_argument);
  // TTL at 2: 3..6 expire with the stamp-1 files, stale copies of 1, 2 too.
  SsdBoundResult r = store->Bound(2, 0);
  EXPECT_EQ(r.expired, (std::vector<uint64_t>{3, 4, 5, 6}));
  EXPECT_EQ(r.capped, std::vector<uint64_t>{});
  EXPECT_EQ(r.files_dropped, 2u);
  store->Commit();
  store.reset();
  store = SsdStore::Open(options);
  BoundModel model;
  model.rows = {{1, {2, 2}}, {2, {2, 2}}, {7, {3, 3}}};
  ASSERT_NO_FATAL_FAILURE(ExpectModel(*store, model, 8, "after expiry"));
  EXPECT_EQ(store->stamp(), 3u);
  // Cap at 2: the oldest (stamp 2) smaller key goes; 2 is rewritten alone.
  r = store->Bound(0, 2);
  EXPECT_EQ(r.capped, std::vector<uint64_t>{1});
  EXPECT_EQ(r.records_rewritten, 1u);
  model.rows.erase(1);
  // Put after erase: 4 comes back, with the stamp of its new put.
  store->SetStamp(5);
  put({4}, 5);
  model.rows[4] = {5, 5};
  store->Commit();
  store.reset();
  store = SsdStore::Open(options);
  ASSERT_NO_FATAL_FAILURE(ExpectModel(*store, model, 8, "after cap and put"));
}

// Gets racing Bound, puts and commits; run under TSan. A get finds a key's
// latest row or (once erased) nothing, never a torn or older row.
TEST_F(SsdStoreTest, ConcurrentGetsDuringBound) {
  constexpr uint32_t row_bytes = 16;
  constexpr uint64_t n = 2000;
  SsdStoreOptions options;
  options.path = dir_;
  options.row_bytes = row_bytes;
  options.file_records = 50;
  options.compaction_trigger = 1.2;
  auto store = SsdStore::Open(options);
  // Rows are (key, v, key >> 32, ~v): a torn or misplaced row fails the check.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> bad{0}, hits{0};
  auto reader = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint64_t> ask(100);
    std::vector<uint8_t> out(ask.size() * row_bytes), found(ask.size());
    std::vector<uint64_t> stamps(ask.size());
    while (!stop) {
      for (auto& k : ask) k = 1 + rng() % n;
      hits += store->Get(ask.data(), ask.size(), out.data(), found.data());
      for (size_t i = 0; i < ask.size(); ++i) {
        uint32_t w[4];
        std::memcpy(w, out.data() + i * row_bytes, sizeof w);
        const bool ok = found[i] ? (w[0] == static_cast<uint32_t>(ask[i]) && w[3] == ~w[1])
                                 : (w[0] == 0 && w[1] == 0 && w[3] == 0);
        if (!ok) ++bad;
      }
      store->Stamps(ask.data(), ask.size(), stamps.data(), found.data());
    }
  };
  std::thread r1(reader, 1), r2(reader, 2);
  std::mt19937_64 rng(9);
  for (uint32_t v = 1; v <= 30; ++v) {
    store->SetStamp(v);
    std::vector<uint64_t> keys;
    for (uint64_t i = 0; i < 400; ++i) keys.push_back(1 + rng() % n);
    std::vector<uint8_t> rows(keys.size() * row_bytes);
    for (size_t i = 0; i < keys.size(); ++i) BoundRow(keys[i], v, rows.data() + i * row_bytes);
    store->Put(keys.data(), keys.size(), rows.data());
    store->Bound(v > 5 ? v - 5 : 0, 800);
    store->Commit();
  }
  stop = true;
  r1.join();
  r2.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(hits.load(), 0u);
  store->WaitForCompaction();
  EXPECT_LE(store->size(), 800u);
  EXPECT_EQ(store->stats().compaction_failures, 0u) << store->stats().last_error;
}

}  // namespace
}  // namespace hps::detail
