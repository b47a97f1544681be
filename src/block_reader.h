// Reads many block-aligned ranges at once: through io_uring (liburing), with
// up to kQueueDepth reads in flight, or with plain pread when io_uring is not
// compiled in or the kernel refuses it. With O_DIRECT descriptors, offsets,
// sizes and buffers must all be 4 KiB aligned; the callers' are.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hps::detail {

struct ReadRequest {
  int fd;
  const std::string* path;  // for error messages
  uint64_t offset;
  uint64_t bytes;
  uint8_t* buffer;
};

class BlockReader {
 public:
  virtual ~BlockReader() = default;
  // Reads every request fully; throws IoError (or CorruptionError for a file
  // that ends early) naming the file.
  virtual void ReadAll(std::vector<ReadRequest>& requests) = 0;
  // "io_uring" or "pread".
  virtual const char* name() const = 0;
};

// A 4 KiB-aligned byte buffer, as O_DIRECT reads need.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
};

// io_uring when `prefer_uring` and available, else pread.
std::unique_ptr<BlockReader> NewBlockReader(bool prefer_uring);

}  // namespace hps::detail
