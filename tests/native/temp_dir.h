// Test support: a scratch directory for the running test, named after it and
// the process, and empty (whatever an earlier, killed run left is removed).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>

namespace hps::test_support {

// <temp>/<prefix>-<pid>-<suite>-<test>. A parameterised test's names hold '/'
// ("IoPaths/BlockCrcReadTest"): kept, they would nest directories that a
// TearDown removing only the last level leaves behind.
inline std::string FreshTestDir(const std::string& prefix) {
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(test->test_suite_name()) + "-" + test->name();
  std::replace(name.begin(), name.end(), '/', '.');
  const auto dir = std::filesystem::temp_directory_path() / (prefix + "-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

}  // namespace hps::test_support
