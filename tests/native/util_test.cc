// The util layer's leaf helpers: key checks and de-duplication (hps/keys.h),
// the errno message (util/errors.h), whole-range file I/O (util/block_io.h) and
// the huge-page allocator (util/huge_pages.h).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "hps/errors.h"
#include "hps/keys.h"
#include "util/block_io.h"
#include "util/errors.h"
#include "util/huge_pages.h"

namespace hps {
namespace {

TEST(CheckKeys, NamesTheIndexOfTheReservedKey) {
  const std::vector<uint64_t> keys = {1, 2, kEmptyKey, 4};
  try {
    CheckKeys(keys.data(), keys.size());
    FAIL() << "the reserved key was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("keys[2]"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(CheckKeys(keys.data(), 2));
}

TEST(UniqueKeys, KeepsFirstAppearanceOrderAndInvertsThroughGrowth) {
  // 5000 distinct keys, each twice: more than the helper's first 1024 slots hold.
  std::vector<uint64_t> keys;
  for (uint64_t i = 0; i < 5000; ++i) keys.push_back(i * 7919 + 3);
  for (uint64_t i = 5000; i-- > 0;) keys.push_back(i * 7919 + 3);
  std::vector<int64_t> inverse(keys.size(), -1);
  const std::vector<uint64_t> uniq = UniqueKeys(keys.data(), keys.size(), inverse.data());
  ASSERT_EQ(uniq.size(), 5000u);
  for (uint64_t i = 0; i < 5000; ++i) EXPECT_EQ(uniq[i], i * 7919 + 3);
  for (size_t i = 0; i < keys.size(); ++i) ASSERT_EQ(uniq[static_cast<size_t>(inverse[i])], keys[i]) << i;
  const uint64_t bad[] = {5, kEmptyKey};
  int64_t bad_inverse[2];
  EXPECT_THROW(UniqueKeys(bad, 2, bad_inverse), std::invalid_argument);
}

TEST(SumByInverse, SumsRowsInOrderAndRefusesAnIndexOutOfRange) {
  const int64_t inverse[] = {1, 0, 1};
  const float rows[] = {1, 2, 10, 20, 100, 200};  // (3, 2)
  float out[4] = {-1, -1, -1, -1};
  SumByInverse(inverse, 3, rows, 2, 2, out);
  EXPECT_EQ(std::vector<float>(out, out + 4), (std::vector<float>{10, 20, 101, 202}));
  const int64_t outside[] = {0, 2};
  try {
    SumByInverse(outside, 2, rows, 2, 2, out);
    FAIL() << "an index outside [0, 2) was accepted";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("inverse[1] = 2"), std::string::npos) << e.what();
  }
}

TEST(ThrowErrno, NamesTheFileTheCallAndErrnosText) {
  errno = ENOENT;
  try {
    detail::ThrowErrno("open", "/no/such/file");
    FAIL() << "ThrowErrno returned";
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()), "/no/such/file: open: No such file or directory");
  }
}

TEST(ReadFully, AShortFileIsCorruptionNamingTheFileAndOffset) {
  char path[] = "/tmp/hps_util_test_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  const char data[] = "0123456789";
  detail::WriteFully(fd, path, 0, data, 10);
  char back[10];
  detail::ReadFully(fd, path, 0, back, 10);
  EXPECT_EQ(std::string(back, 10), "0123456789");
  char more[20];
  try {
    detail::ReadFully(fd, path, 0, more, 20);
    ADD_FAILURE() << "a read past the end succeeded";
  } catch (const CorruptionError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("at byte 10"), std::string::npos) << what;
  }
  close(fd);
  unlink(path);
  EXPECT_THROW(detail::ReadFully(fd, path, 0, back, 1), IoError);  // a closed descriptor: EBADF
}

TEST(HugePageAllocator, LargeBuffersStartOnAHugePageAndKeepTheirContentsThroughGrowth) {
  using Vec = std::vector<uint32_t, detail::HugePageAllocator<uint32_t>>;
  Vec small(100, 7);  // under a huge page: operator new's
  EXPECT_EQ(small[99], 7u);
  Vec v;
  const uint64_t n = 3 * detail::kHugePageBytes / sizeof(uint32_t) + 5;  // 6 MiB and a tail
  for (uint64_t i = 0; i < n; ++i) v.push_back(static_cast<uint32_t>(i * 2654435761u));  // grows through both kinds
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(v[i], static_cast<uint32_t>(i * 2654435761u)) << "v[" << i << "]";
  if (detail::HugePageAllocator<uint32_t>::Mapped(v.capacity() * sizeof(uint32_t))) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % detail::kHugePageBytes, 0u);
  }
  Vec copy(v.begin(), v.end());
  v = Vec();  // unmapped: the copy is its own
  EXPECT_EQ(copy[n - 1], static_cast<uint32_t>((n - 1) * 2654435761u));
  EXPECT_THROW(detail::HugePageAllocator<uint64_t>().allocate(SIZE_MAX / 4), std::bad_array_new_length);
}

}  // namespace
}  // namespace hps
