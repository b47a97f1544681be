// The exceptions every layer of hps may throw, in one leaf header so that a
// lower layer (block I/O, file formats) raises them without including the
// component above that first needed them. Layer: util (docs/architecture.md).
#pragma once

#include <stdexcept>

namespace hps {

// Raised when a hash-table claim finds no empty slot. Keys placed before it
// stay placed.
class TableFullError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file that is not what it must be: bad magic, version, sizes or CRC. The
// message names the file and the field.
class CorruptionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failed system call (a full disk, a missing file); the message names the
// file, the call and errno's text.
class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A MEM-PS call that would need more slots than the unpinned ones of a shard
// (the message says how many rows the batch needs and how many are pinned),
// or a lookahead window more bytes than its room in the budget (the message
// says both).
class CacheFullError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An optimizer step refused because a gradient it would apply holds a NaN or
// an infinity: one pushed so, or finite ones whose sum overflowed (duplicate
// keys of a push, the ranks' gradients of a key at its owner). Raised before
// the step changes any row; the message names the key.
class DivergedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace hps
