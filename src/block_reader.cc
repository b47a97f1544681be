#include "block_reader.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <new>
#include <cstring>
#include <unordered_map>

#include "hps/config.h"
#include "param_file.h"  // ReadFully, IoError

#if HPS_HAVE_LIBURING
#include <liburing.h>
#endif

namespace hps::detail {
namespace {

class PreadReader final : public BlockReader {
 public:
  void ReadAll(std::vector<ReadRequest>& requests) override {
    for (const ReadRequest& r : requests) ReadFully(r.fd, *r.path, r.offset, r.buffer, r.bytes);
  }
  const char* name() const override { return "pread"; }
};

#if HPS_HAVE_LIBURING
constexpr unsigned kQueueDepth = 64;
constexpr uint64_t kMaxReadBytes = uint64_t{1} << 30;  // io_uring lengths are 32-bit

class UringReader final : public BlockReader {
 public:
  // nullptr when the kernel refuses io_uring (too old, or forbidden).
  static std::unique_ptr<UringReader> Create() {
    std::unique_ptr<UringReader> reader(new UringReader);
    if (io_uring_queue_init(kQueueDepth, &reader->ring_, 0) != 0) return nullptr;
    reader->ready_ = true;
    return reader;
  }
  ~UringReader() override {
    if (ready_) io_uring_queue_exit(&ring_);
  }

  void ReadAll(std::vector<ReadRequest>& requests) override {
    size_t next = 0, in_flight = 0;
    while (next < requests.size() || in_flight > 0) {
      while (next < requests.size() && in_flight < kQueueDepth) {
        Queue(&requests[next], requests[next].bytes, 0);
        ++next;
        ++in_flight;
      }
      const int submitted = io_uring_submit(&ring_);
      if (submitted < 0) ThrowUring("submit", submitted, *requests.front().path);
      io_uring_cqe* cqe = nullptr;
      const int waited = io_uring_wait_cqe(&ring_, &cqe);
      if (waited < 0) {
        if (waited == -EINTR) continue;
        ThrowUring("wait", waited, *requests.front().path);
      }
      // Drain every completion that is ready.
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        auto* r = static_cast<ReadRequest*>(io_uring_cqe_get_data(cqe));
        const int res = cqe->res;
        const uint64_t done = pending_done_[r];
        if (res == -EINTR || res == -EAGAIN) {
          Queue(r, r->bytes - done, done);  // the same read again
          continue;
        }
        if (res < 0) {
          io_uring_cq_advance(&ring_, seen);
          ThrowUring("read", res, *r->path);
        }
        if (res == 0) {
          io_uring_cq_advance(&ring_, seen);
          throw CorruptionError(*r->path + ": not a valid hps parameter file: file ends early, at byte " +
                                std::to_string(r->offset + done));
        }
        const uint64_t total = done + static_cast<uint64_t>(res);
        if (total < r->bytes) {
          Queue(r, r->bytes - total, total);  // a short read: ask for the rest
        } else {
          pending_done_.erase(r);
          --in_flight;
        }
      }
      io_uring_cq_advance(&ring_, seen);
    }
  }
  const char* name() const override { return "io_uring"; }

 private:
  UringReader() = default;

  // Queues the read of `bytes` of r starting `done` bytes in; reads longer
  // than kMaxReadBytes finish as a series of short reads.
  void Queue(ReadRequest* r, uint64_t bytes, uint64_t done) {
    bytes = std::min(bytes, kMaxReadBytes);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // full: hand the queued ones to the kernel first
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) throw IoError(*r->path + ": io_uring submission queue stays full");
    }
    io_uring_prep_read(sqe, r->fd, r->buffer + done, static_cast<unsigned>(bytes), r->offset + done);
    io_uring_sqe_set_data(sqe, r);
    pending_done_[r] = done;
  }

  [[noreturn]] static void ThrowUring(const char* what, int res, const std::string& path) {
    throw IoError(path + ": io_uring " + what + ": " + std::strerror(-res));
  }

  io_uring ring_{};
  bool ready_ = false;
  std::unordered_map<ReadRequest*, uint64_t> pending_done_;  // bytes already read
};
#endif

}  // namespace

AlignedBuffer::AlignedBuffer(uint64_t bytes) {
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  if (rounded > 0) {
    data_ = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded));
    if (data_ == nullptr) throw std::bad_alloc();
  }
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

std::unique_ptr<BlockReader> NewBlockReader(bool prefer_uring) {
#if HPS_HAVE_LIBURING
  if (prefer_uring) {
    if (auto reader = UringReader::Create()) return reader;
  }
#else
  (void)prefer_uring;
#endif
  return std::make_unique<PreadReader>();
}

}  // namespace hps::detail
