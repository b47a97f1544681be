#include "util/block_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <unordered_map>
#include <utility>

#include "hps/config.h"
#include "util/errors.h"  // IoError, CorruptionError, ThrowErrno

#if HPS_HAVE_LIBURING
#include <liburing.h>
#endif

namespace hps::detail {

void ReadFully(int fd, const std::string& path, uint64_t offset, void* data, uint64_t bytes) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t r = pread(fd, p, bytes, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      const std::string what = "read at byte " + std::to_string(offset);  // where a bad sector is
      errno = error;
      ThrowErrno(what, path);
    }
    if (r == 0) throw CorruptionError(path + ": not a valid hps parameter file: file ends early, at byte " +
                                    std::to_string(offset));
    p += r;
    offset += static_cast<uint64_t>(r);
    bytes -= static_cast<uint64_t>(r);
  }
}

void WriteFully(int fd, const std::string& path, uint64_t offset, const void* data, uint64_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t w = pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      ThrowErrno("write", path);
    }
    if (w == 0) throw IoError(path + ": write: no progress (disk full?)");
    p += w;
    offset += static_cast<uint64_t>(w);
    bytes -= static_cast<uint64_t>(w);
  }
}

void SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) ThrowErrno("open directory", dir);
  const int rc = fsync(fd);
  const int error = errno;
  close(fd);
  errno = error;
  if (rc != 0) ThrowErrno("sync directory", dir);
}

namespace {

class PosixIo final : public BlockIo {
 public:
  void ReadAll(std::vector<IoRequest>& requests) override {
    for (const IoRequest& r : requests) ReadFully(r.fd, *r.path, r.offset, r.buffer, r.bytes);
  }
  void WriteAll(std::vector<IoRequest>& requests) override {
    for (const IoRequest& r : requests) WriteFully(r.fd, *r.path, r.offset, r.buffer, r.bytes);
  }
  const char* name() const override { return "pread"; }
};

#if HPS_HAVE_LIBURING
// A W5 batch reads ~1000 scattered blocks. With 64 in flight the thread had to
// be scheduled ~15 times to refill the ring, and the pipeline runs it at a low
// priority beside the trainer, so the device sat idle between refills (W5: 10-13 s
// waiting on reads per 1M examples, 6-8 s with 512); most batches now take one submit.
constexpr unsigned kQueueDepth = 512;
constexpr uint64_t kMaxOpBytes = uint64_t{1} << 30;  // io_uring lengths are 32-bit
// A submit refused with nothing in the kernel is tried again this many times,
// this far apart (about a second in all), before the call fails.
constexpr int kSubmitRetries = 1000;
constexpr auto kSubmitBackoff = std::chrono::milliseconds(1);
// An operation that completes with -EAGAIN (it did nothing: ask again) or
// -EINTR (interrupted before it moved anything) is asked again this many
// times in a row, either answer counting, with this pause before each pass
// that met one, before the call fails: a device (or a signal) that never
// stops answering so would otherwise keep the thread spinning for good.
constexpr int kAskAgainRetries = 1000;
constexpr auto kAskAgainBackoff = std::chrono::milliseconds(1);

class UringIo final : public BlockIo {
 public:
  // nullptr when the kernel refuses io_uring (too old, forbidden by seccomp
  // or io_uring_disabled, short of locked memory), with *why saying so.
  static std::unique_ptr<UringIo> Create(std::string* why) {
    std::unique_ptr<UringIo> io(new UringIo);
    const int rc = io_uring_queue_init(kQueueDepth, &io->ring_, 0);
    if (rc != 0) {
      *why = std::string("io_uring_queue_init: ") + std::strerror(-rc);
      return nullptr;
    }
    io->ready_ = true;
    return io;
  }
  ~UringIo() override {
    if (ready_) io_uring_queue_exit(&ring_);
  }

  void ReadAll(std::vector<IoRequest>& requests) override { Run(requests, false); }
  void WriteAll(std::vector<IoRequest>& requests) override { Run(requests, true); }
  const char* name() const override { return "io_uring"; }
  bool reusable() const override { return reusable_; }

 private:
  UringIo() = default;

  void Run(std::vector<IoRequest>& requests, bool write) {
    write_ = write;
    pending_.clear();
    size_t next = 0, in_flight = 0;
    int refusals = 0;  // submits refused in a row with nothing in the kernel
    try {
      while (next < requests.size() || in_flight > 0) {
        while (next < requests.size() && in_flight < kQueueDepth) {
          Queue(&requests[next], requests[next].bytes, 0);
          ++next;
          ++in_flight;
        }
        const int submitted = io_uring_submit(&ring_);
        if (submitted == -EAGAIN || submitted == -EBUSY) {
          // Refused for now: the kernel is short of memory for the requests
          // (-EAGAIN) or has completions to reap first (-EBUSY). With some
          // operations in the kernel, reaping their completions below frees
          // what it lacks; with none, only time can, and nothing would ever
          // complete to end the wait.
          if (in_flight - io_uring_sq_ready(&ring_) == 0) {
            if (++refusals > kSubmitRetries) {
              ThrowUring("submit", submitted, *requests.front().path,
                         " (refused " + std::to_string(refusals) + " times in a row)");
            }
            std::this_thread::sleep_for(kSubmitBackoff);
            continue;
          }
        } else if (submitted < 0) {
          ThrowUring("submit", submitted, *requests.front().path);
        } else {
          refusals = 0;
        }
        io_uring_cqe* cqe = nullptr;
        const int waited = io_uring_wait_cqe(&ring_, &cqe);
        if (waited < 0) {
          if (waited == -EINTR) continue;
          ThrowUring("wait", waited, *requests.front().path);
        }
        // Drain every completion that is ready.
        unsigned head;
        unsigned seen = 0;
        bool met_again = false;
        io_uring_for_each_cqe(&ring_, head, cqe) {
          ++seen;
          auto* r = static_cast<IoRequest*>(io_uring_cqe_get_data(cqe));
          const int res = cqe->res;
          Pending& pending = pending_.find(r)->second;  // Queue's: found, so nothing here allocates
          const uint64_t done = pending.done;
          if (res == -EINTR || res == -EAGAIN) {
            const int asked = ++pending.asked_again;
            if (asked > kAskAgainRetries) {
              io_uring_cq_advance(&ring_, seen);
              --in_flight;
              ThrowUring(((write_ ? "write at byte " : "read at byte ") + std::to_string(r->offset + done)).c_str(),
                         res, *r->path, " (nothing moved " + std::to_string(asked) + " times in a row)");
            }
            met_again = true;
            Queue(r, r->bytes - done, done);  // the same operation again
            continue;
          }
          if (res > 0) pending.asked_again = 0;  // it moved: a later -EAGAIN or -EINTR starts a new count
          if (res < 0) {
            io_uring_cq_advance(&ring_, seen);
            --in_flight;
            if (write_ && done > 0) {  // the kernel cut the write short: no room, usually
              throw IoError(*r->path + ": io_uring write: " + std::strerror(-res) + " after a short write at byte " +
                            std::to_string(r->offset + done) + " (disk full or file size limit?)");
            }
            if (write_) ThrowUring("write", res, *r->path);
            // A failed read names where: a bad sector is one block, not the file.
            ThrowUring(("read at byte " + std::to_string(r->offset + done)).c_str(), res, *r->path);
          }
          if (res == 0) {
            io_uring_cq_advance(&ring_, seen);
            --in_flight;
            if (write_) throw IoError(*r->path + ": io_uring write: no progress (disk full?)");
            throw CorruptionError(*r->path + ": not a valid hps parameter file: file ends early, at byte " +
                                  std::to_string(r->offset + done));
          }
          const uint64_t total = done + static_cast<uint64_t>(res);
          if (total < r->bytes) {
            Queue(r, r->bytes - total, total);  // short: ask for the rest
          } else {
            pending_.erase(r);
            --in_flight;
          }
        }
        io_uring_cq_advance(&ring_, seen);
        if (met_again) std::this_thread::sleep_for(kAskAgainBackoff);
      }
    } catch (...) {
      Drain(in_flight);
      throw;
    }
  }

  // After a failure, waits out the operations the kernel holds: their
  // buffers belong to the caller, who is about to free them. Those still
  // queued, when the kernel refuses them even now, are never waited for
  // (they would never complete); the ring, which would hand them to the
  // kernel with the next call's, is then not reused.
  void Drain(size_t in_flight) {
    io_uring_submit(&ring_);
    const unsigned unsubmitted = io_uring_sq_ready(&ring_);
    if (unsubmitted > 0) reusable_ = false;
    in_flight -= std::min<size_t>(in_flight, unsubmitted);
    while (in_flight > 0) {
      io_uring_cqe* cqe = nullptr;
      const int waited = io_uring_wait_cqe(&ring_, &cqe);
      if (waited == -EINTR) continue;
      if (waited < 0) {  // the ring itself is broken; nothing more to wait for
        reusable_ = false;
        return;
      }
      io_uring_cqe_seen(&ring_, cqe);
      --in_flight;
    }
  }

  // Queues `bytes` of r starting `done` bytes in; operations longer than
  // kMaxOpBytes finish as a series of short ones.
  // Its entry in pending_ goes in first: that insertion is the one step that
  // may fail (bad_alloc), and an operation already in the submission queue
  // when it did would reach the kernel with Drain's next submit uncounted,
  // so unwaited for: the kernel would then move bytes into or out of a
  // buffer its caller had freed, and hand its completion to the ring's next
  // call, whose requests it is not.
  void Queue(IoRequest* r, uint64_t bytes, uint64_t done) {
    pending_[r].done = done;
    bytes = std::min(bytes, kMaxOpBytes);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // full: hand the queued ones to the kernel first
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) throw IoError(*r->path + ": io_uring submission queue stays full");
    }
    if (write_) {
      io_uring_prep_write(sqe, r->fd, r->buffer + done, static_cast<unsigned>(bytes), r->offset + done);
    } else {
      io_uring_prep_read(sqe, r->fd, r->buffer + done, static_cast<unsigned>(bytes), r->offset + done);
    }
    io_uring_sqe_set_data(sqe, r);
  }

  [[noreturn]] static void ThrowUring(const char* what, int res, const std::string& path,
                                      const std::string& detail = "") {
    throw IoError(path + ": io_uring " + what + ": " + std::strerror(-res) + detail);
  }

  io_uring ring_{};
  bool ready_ = false;
  bool write_ = false;
  bool reusable_ = true;
  // Each request with an operation queued or in the kernel. One map, not one
  // per field: a completion then finds its request's entry, and allocates
  // nothing that could fail between reaping it and advancing past it.
  struct Pending {
    uint64_t done = 0;    // bytes already moved
    int asked_again = 0;  // -EAGAIN or -EINTR completions in a row
  };
  std::unordered_map<IoRequest*, Pending> pending_;
};
#endif

}  // namespace

AlignedBuffer::AlignedBuffer(uint64_t bytes) {
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  if (rounded > 0) {
    data_ = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded));
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(data_, 0, rounded);
  }
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept : data_(std::exchange(other.data_, nullptr)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

uint8_t* BlockIo::Scratch(uint64_t bytes) {
  if (bytes > scratch_bytes_) {
    scratch_ = AlignedBuffer();  // the old one goes first: never both at once
    scratch_ = AlignedBuffer(bytes);
    scratch_bytes_ = bytes;
  }
  return scratch_.data();
}

std::unique_ptr<BlockIo> NewBlockIo(bool prefer_uring, std::string* fallback) {
  std::string why;
#if HPS_HAVE_LIBURING
  if (prefer_uring) {
    if (auto io = UringIo::Create(&why)) return io;
  }
#else
  (void)prefer_uring;
#endif
  if (fallback != nullptr) *fallback = why;
  return std::make_unique<PosixIo>();
}

BlockIoPool::BlockIoPool(bool prefer_uring) : prefer_uring_(prefer_uring) {
  std::unique_ptr<BlockIo> first = NewBlockIo(prefer_uring, &fallback_);
  name_ = first->name();
  idle_.push_back(std::move(first));
}

std::string BlockIoPool::name() const {
  std::lock_guard lock(mutex_);
  return name_;
}

std::string BlockIoPool::fallback() const {
  std::lock_guard lock(mutex_);
  return fallback_;
}

BlockIoPool::Lease BlockIoPool::Acquire() {
  {
    std::lock_guard lock(mutex_);
    if (!idle_.empty()) {
      std::unique_ptr<BlockIo> io = std::move(idle_.back());
      idle_.pop_back();
      return Lease(this, std::move(io));
    }
  }
  // A ring more than the first may still be refused (locked memory runs
  // out): this caller then moves its bytes with pread, and name() says so.
  std::string why;
  std::unique_ptr<BlockIo> io = NewBlockIo(prefer_uring_, &why);
  if (!why.empty()) {
    std::lock_guard lock(mutex_);
    name_ = io->name();
    if (fallback_.empty()) fallback_ = why;
  }
  return Lease(this, std::move(io));
}

void BlockIoPool::Return(std::unique_ptr<BlockIo> io) {
  if (io == nullptr || !io->reusable()) return;  // the next caller gets a fresh one
  std::lock_guard lock(mutex_);
  idle_.push_back(std::move(io));
}

}  // namespace hps::detail
