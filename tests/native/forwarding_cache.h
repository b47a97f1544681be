// Test support shared by the ps-layer tests: MEM-PS doubles over the real
// cache, for faults that the real one meets only by chance.
#pragma once

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "hps/keys.h"  // kEmptyKey
#include "hps/mem_cache.h"

namespace hps::test_support {

// Every call passed on to the real cache; a double overrides the ones it changes.
class ForwardingCache : public MemCache {
 public:
  explicit ForwardingCache(std::unique_ptr<MemCache> cache) : cache_(std::move(cache)) {}

  uint64_t Pull(const uint64_t* k, uint64_t n, uint8_t* out, bool pin, uint8_t* hit) override {
    return cache_->Pull(k, n, out, pin, hit);
  }
  uint64_t Pin(const uint64_t* k, uint64_t n, uint8_t* hit, uint8_t** at) override { return cache_->Pin(k, n, hit, at); }
  void WriteBack(const uint64_t* k, uint64_t n, const uint8_t* rows, uint8_t* const* at) override {
    cache_->WriteBack(k, n, rows, at);
  }
  void Unpin(const uint64_t* k, uint64_t n, uint8_t* const* at) override { cache_->Unpin(k, n, at); }
  uint64_t Access(const uint64_t* k, uint64_t n, uint8_t* hit) override { return cache_->Access(k, n, hit); }
  void FlushDirty() override { cache_->FlushDirty(); }
  void ReadPinned(const uint64_t* k, uint64_t n, uint8_t* out, uint8_t* const* at) const override {
    cache_->ReadPinned(k, n, out, at);
  }
  void PinnedRows(const uint64_t* k, uint64_t n, uint8_t** rows) const override { cache_->PinnedRows(k, n, rows); }
  void UnpinUpdated(const uint64_t* k, uint64_t n, const uint8_t* updated, uint8_t* const* at) override {
    cache_->UnpinUpdated(k, n, updated, at);
  }
  void KeepUpdated(const uint64_t* k, uint64_t n, const uint8_t* rows) override { cache_->KeepUpdated(k, n, rows); }
  std::vector<uint64_t> MarkUpdated(const uint64_t* k, uint64_t n, uint8_t* const* at) override {
    return cache_->MarkUpdated(k, n, at);
  }
  void SetLookahead(const uint64_t* k, uint64_t n) override { cache_->SetLookahead(k, n); }
  void PushLookahead(const uint64_t* k, uint64_t n) override { cache_->PushLookahead(k, n); }
  void PopLookahead() override { cache_->PopLookahead(); }
  void SlideLookahead(const uint64_t* k, uint64_t n) override { cache_->SlideLookahead(k, n); }
  void ClearLookahead() override { cache_->ClearLookahead(); }
  uint64_t Erase(const uint64_t* k, uint64_t n) override { return cache_->Erase(k, n); }
  bool Contains(uint64_t key) const override { return cache_->Contains(key); }
  void CountFailedRelease() override { cache_->CountFailedRelease(); }
  uint32_t row_bytes() const override { return cache_->row_bytes(); }
  MemCacheStats stats() const override { return cache_->stats(); }

 protected:
  std::unique_ptr<MemCache> cache_;
};

// MEM-PS where something else unpins `victim` during the next release
// (WriteBack, Unpin, UnpinUpdated) that names it: after the call's check
// that its keys are pinned, before its change, as a concurrent caller that
// breaks the pin contract can. Made deterministic by passing the real cache
// one more occurrence of the victim, just before the caller's own: the
// foreign unpin, which the real cache's change meets first (a plain unpin:
// no row, no step of its own).
class PinBreakingCache final : public ForwardingCache {
 public:
  using ForwardingCache::ForwardingCache;
  uint64_t victim = kEmptyKey;  // reset once met

  void WriteBack(const uint64_t* k, uint64_t n, const uint8_t* rows, uint8_t* const* at) override {
    const uint64_t p = Find(k, n);
    if (p == n) return ForwardingCache::WriteBack(k, n, rows, at);
    const uint32_t row = row_bytes();
    std::vector<uint8_t> with(rows, rows + n * row);
    with.insert(with.begin() + static_cast<std::ptrdiff_t>(p * row), rows + p * row, rows + (p + 1) * row);
    Broken(p, [&](const uint64_t* keys, uint8_t* const* where) { cache_->WriteBack(keys, n + 1, with.data(), where); },
           k, n, at);
  }
  void Unpin(const uint64_t* k, uint64_t n, uint8_t* const* at) override {
    const uint64_t p = Find(k, n);
    if (p == n) return ForwardingCache::Unpin(k, n, at);
    Broken(p, [&](const uint64_t* keys, uint8_t* const* where) { cache_->Unpin(keys, n + 1, where); }, k, n, at);
  }
  void UnpinUpdated(const uint64_t* k, uint64_t n, const uint8_t* updated, uint8_t* const* at) override {
    const uint64_t p = Find(k, n);
    if (p == n) return ForwardingCache::UnpinUpdated(k, n, updated, at);
    std::vector<uint8_t> with(updated, updated + n);
    with.insert(with.begin() + static_cast<std::ptrdiff_t>(p), 0);
    Broken(p, [&](const uint64_t* keys, uint8_t* const* where) { cache_->UnpinUpdated(keys, n + 1, with.data(), where); },
           k, n, at);
  }

 private:
  uint64_t Find(const uint64_t* k, uint64_t n) const { return static_cast<uint64_t>(std::find(k, k + n, victim) - k); }

  // Calls `call` with the keys (and addresses) with the foreign unpin's
  // occurrence at p, and passes on its BrokenPinError with indices into the
  // caller's keys.
  template <typename Call>
  void Broken(uint64_t p, Call call, const uint64_t* k, uint64_t n, uint8_t* const* at) {
    victim = kEmptyKey;
    std::vector<uint64_t> keys(k, k + n);
    keys.insert(keys.begin() + static_cast<std::ptrdiff_t>(p), k[p]);
    std::vector<uint8_t*> where;
    if (at != nullptr) {
      where.assign(at, at + n);
      where.insert(where.begin() + static_cast<std::ptrdiff_t>(p), at[p]);
    }
    const auto back = [&](const std::vector<uint64_t>& indices) {
      std::vector<uint64_t> out;
      for (uint64_t i : indices) out.push_back(i > p ? i - 1 : i);  // the foreign unpin itself is never named
      return out;
    };
    try {
      call(keys.data(), at != nullptr ? where.data() : nullptr);
    } catch (const BrokenPinError& e) {
      throw BrokenPinError(e.what(), back(e.unpinned()), back(e.lost()));
    }
  }
};

}  // namespace hps::test_support
