#include "util/errors.h"

#include <cerrno>
#include <cstring>

namespace hps::detail {

void ThrowErrno(const std::string& what, const std::string& path) {
  const int err = errno;  // read before anything below can change it
  throw IoError(path + ": " + what + ": " + std::strerror(err));
}

}  // namespace hps::detail
