// Moves many block-aligned ranges between files and memory at once: through
// io_uring (liburing), with up to kQueueDepth operations in flight, or with
// plain pread/pwrite when io_uring is not compiled in or the kernel refuses
// it. With O_DIRECT descriptors, offsets, sizes and buffers must all be 4 KiB
// aligned; the callers' are.
//
// One BlockIo serves one thread at a time (an io_uring is not shared);
// BlockIoPool hands them out to concurrent callers.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hps::detail {

// Reads exactly `bytes` at `offset`, retrying short reads; IoError names the
// file and the byte where the failed read began, CorruptionError a file
// shorter than expected.
void ReadFully(int fd, const std::string& path, uint64_t offset, void* data, uint64_t bytes);
// Writes exactly `bytes` at `offset`, retrying short writes; IoError names the file.
void WriteFully(int fd, const std::string& path, uint64_t offset, const void* data, uint64_t bytes);
// Makes a directory's entries (files created, renamed or removed in it)
// durable: fsync of the directory; IoError names it.
void SyncDirectory(const std::string& dir);

struct IoRequest {
  int fd;
  const std::string* path;  // for error messages
  uint64_t offset;
  uint64_t bytes;
  uint8_t* buffer;
};

// A 4 KiB-aligned, zero-filled byte buffer, as O_DIRECT needs.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
};

class BlockIo {
 public:
  virtual ~BlockIo() = default;
  // Reads every request fully; throws IoError naming the file and the byte
  // where the failed read began (or CorruptionError for a file that ends early).
  // Reads cut short, interrupted (-EINTR) or refused for now (-EAGAIN) are
  // asked again; one interrupted or refused about a second in a row fails as
  // a read error.
  virtual void ReadAll(std::vector<IoRequest>& requests) = 0;
  // Writes every request fully, asking again as ReadAll does; throws IoError
  // naming the file (a full disk is ENOSPC, or EFBIG past RLIMIT_FSIZE).
  virtual void WriteAll(std::vector<IoRequest>& requests) = 0;
  // "io_uring" or "pread".
  virtual const char* name() const = 0;
  // False once a failure left the object unfit for another call (an
  // io_uring holding requests the kernel refused): BlockIoPool drops it.
  virtual bool reusable() const { return true; }

  // At least `bytes` of aligned buffer for this caller's reads, kept between
  // calls (its contents are not kept): a get reuses it instead of allocating
  // and freeing a wave's worth each time, which grew the allocator's arenas
  // far past the caches' budgets under concurrent gets.
  uint8_t* Scratch(uint64_t bytes);

 private:
  AlignedBuffer scratch_;
  uint64_t scratch_bytes_ = 0;
};


// io_uring when `prefer_uring` and available, else pread/pwrite. When
// `fallback` is given, it gets why io_uring was asked for and not used (the
// call and errno's text), or "" (also when this build has no liburing: that
// is no runtime fallback, and HPS_HAVE_LIBURING says it).
std::unique_ptr<BlockIo> NewBlockIo(bool prefer_uring, std::string* fallback = nullptr);

// BlockIo objects for concurrent callers; each caller holds one for a call.
class BlockIoPool {
 public:
  explicit BlockIoPool(bool prefer_uring);
  // "io_uring" while every BlockIo handed out is one, else "pread".
  std::string name() const;
  // Why a BlockIo meant to be io_uring is pread (the first such reason), or "".
  std::string fallback() const;

  class Lease {
   public:
    Lease(BlockIoPool* pool, std::unique_ptr<BlockIo> io) : pool_(pool), io_(std::move(io)) {}
    ~Lease() { pool_->Return(std::move(io_)); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    BlockIo* operator->() const { return io_.get(); }
    BlockIo& operator*() const { return *io_; }

   private:
    BlockIoPool* pool_;
    std::unique_ptr<BlockIo> io_;
  };
  Lease Acquire();

 private:
  void Return(std::unique_ptr<BlockIo> io);

  bool prefer_uring_;
  mutable std::mutex mutex_;
  const char* name_;     // guarded by mutex_
  std::string fallback_;  // guarded by mutex_
  std::vector<std::unique_ptr<BlockIo>> idle_;
};

}  // namespace hps::detail
