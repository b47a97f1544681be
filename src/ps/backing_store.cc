#include "hps/backing_store.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "format/key_index.h"

namespace hps {

BackingStore::BackingStore(SsdStore* ssd, const SparseOptimizer& optimizer, uint64_t write_buffer_rows)
    : ssd_(ssd), optimizer_(optimizer), write_buffer_rows_(write_buffer_rows),
      index_(std::make_unique<detail::KeyIndex>()) {
  if (ssd_ == nullptr) throw std::invalid_argument("backing store: ssd is null");
  optimizer_.validate();
  row_bytes_ = static_cast<uint32_t>(optimizer_.row_floats()) * 4;
  if (ssd_->row_bytes() != row_bytes_) {
    throw std::invalid_argument("backing store: the SSD-PS rows are " + std::to_string(ssd_->row_bytes()) +
                                " bytes, the optimizer's " + std::to_string(row_bytes_));
  }
  if (write_buffer_rows_ == 0 || write_buffer_rows_ > (uint64_t{1} << 31)) {
    throw std::invalid_argument("backing store: write_buffer_rows must be in [1, 2^31], got " +
                                std::to_string(write_buffer_rows_));
  }
}

BackingStore::~BackingStore() = default;

void BackingStore::Load(const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t* dirty) {
  if (dirty != nullptr) std::memset(dirty, 0, n);
  std::vector<uint64_t> rest;  // positions not in the buffer
  {
    std::lock_guard lock(mutex_);
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t at = index_->Find(keys[i]);
      if (at == detail::KeyIndex::kNone) {
        rest.push_back(i);
      } else {
        std::memcpy(rows + i * row_bytes_, rows_.data() + uint64_t{at} * row_bytes_, row_bytes_);
      }
    }
  }
  uint64_t on_ssd = 0;
  if (!rest.empty()) {
    std::vector<uint64_t> rest_keys(rest.size());
    for (size_t j = 0; j < rest.size(); ++j) rest_keys[j] = keys[rest[j]];
    std::vector<uint8_t> read(rest.size() * row_bytes_);
    std::vector<uint8_t> found(rest.size());
    on_ssd = ssd_->Get(rest_keys.data(), rest.size(), read.data(), found.data());
    std::vector<uint64_t> fresh, fresh_keys;  // positions and keys of those found nowhere
    for (size_t j = 0; j < rest.size(); ++j) {
      if (found[j]) {
        std::memcpy(rows + rest[j] * row_bytes_, read.data() + j * row_bytes_, row_bytes_);
      } else {
        fresh.push_back(rest[j]);
        fresh_keys.push_back(rest_keys[j]);
      }
    }
    if (!fresh.empty()) {
      std::vector<float> initial(fresh.size() * row_bytes_ / sizeof(float));
      optimizer_.initial_rows(fresh_keys.data(), fresh.size(), initial.data());
      for (size_t j = 0; j < fresh.size(); ++j) {
        std::memcpy(rows + fresh[j] * row_bytes_, initial.data() + j * row_bytes_ / sizeof(float), row_bytes_);
      }
    }
  }
  rows_loaded_ += n;
  pending_hits_ += n - rest.size();
  ssd_hits_ += on_ssd;
  initialized_ += rest.size() - on_ssd;
}

void BackingStore::Sink(const uint64_t* keys, uint64_t n, const uint8_t* rows) {
  std::lock_guard lock(mutex_);
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t at = index_->Find(keys[i]);
    if (at != detail::KeyIndex::kNone) {
      std::memcpy(rows_.data() + uint64_t{at} * row_bytes_, rows + i * row_bytes_, row_bytes_);
      continue;
    }
    index_->Upsert(keys[i], static_cast<uint32_t>(keys_.size()));
    keys_.push_back(keys[i]);
    rows_.insert(rows_.end(), rows + i * row_bytes_, rows + (i + 1) * row_bytes_);
  }
  if (keys_.size() >= write_buffer_rows_) FlushLocked();
}

void BackingStore::Flush() {
  std::lock_guard lock(mutex_);
  FlushLocked();
}

void BackingStore::FlushLocked() {
  if (keys_.empty()) return;
  ssd_->Put(keys_.data(), keys_.size(), rows_.data());  // distinct keys: the buffer keeps one row a key
  ++puts_;
  rows_put_ += keys_.size();
  keys_.clear();
  rows_.clear();
  index_ = std::make_unique<detail::KeyIndex>();
}

RowLoader BackingStore::loader() {
  return [this](const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t* dirty) { Load(keys, n, rows, dirty); };
}

RowSink BackingStore::sink() {
  return [this](const uint64_t* keys, uint64_t n, const uint8_t* rows) { Sink(keys, n, rows); };
}

BackingStoreCounts BackingStore::counts() const {
  BackingStoreCounts c;
  c.rows_loaded = rows_loaded_;
  c.pending_hits = pending_hits_;
  c.ssd_hits = ssd_hits_;
  c.initialized = initialized_;
  c.puts = puts_;
  c.rows_put = rows_put_;
  std::lock_guard lock(mutex_);
  c.pending_rows = keys_.size();
  return c;
}

}  // namespace hps
