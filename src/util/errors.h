// The errno message every file-handling layer writes: "<path>: <what>: <errno text>".
#pragma once

#include <string>

#include "hps/errors.h"

namespace hps::detail {

// Throws IoError naming the file, the call and the text of the current errno.
[[noreturn]] void ThrowErrno(const std::string& what, const std::string& path);

}  // namespace hps::detail
