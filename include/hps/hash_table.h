// Device-portable hash table of embedding rows (the device tier's store).
//
// The cuDF concurrent_unordered_map scheme: open addressing with linear probing
// over a fixed number of slots, the all-ones key marking an empty slot, and a
// slot claimed by an atomic compare-and-swap on its key. Each slot owns one row
// of `row_floats` float32 values (embedding + optimizer state), stored by slot.
// The table never grows: keep the load below ~0.8, since probes lengthen as it
// fills, and a claim that finds no empty slot raises TableFullError.
//
// Every operation is a bulk call over arrays. The probe and row-update bodies are
// written once and run either by a CPU launcher (a parallel loop over `threads`
// cores) or by CUDA kernels (when built with CUDA and a device is present).
//
// On a CUDA table the arrays of rows a call takes or fills (rows, rows_out,
// deltas, embeddings_out) may lie in host memory or in the table's GPU memory
// (unified addressing tells which, so a gather can land in a torch CUDA
// tensor); keys and flags lie in host memory. On the CPU all lie in host memory.
//
// Thread safety: any number of threads may call at once. Reads (find, slots, keys_at, export)
// share the table; every other call has it to itself. The lock-free CAS scheme
// works inside a call, where the launcher's threads race for slots.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hps/errors.h"  // TableFullError, DivergedError
#include "hps/keys.h"    // kEmptyKey, CheckKeys, UniqueKeys, SumByInverse
#include "hps/optimizer.h"

namespace hps {

struct HashTableOptions {
  uint64_t capacity = 0;  ///< slots, the most keys it holds; > 0, rounded up to a multiple of 8
  int32_t row_floats = 0; ///< floats per row; > 0
  int32_t threads = 0;    ///< CPU launcher threads; 0 = all cores
  int32_t cuda_device = -1;  ///< -1: host memory and CPU launcher; >= 0: that GPU
};

class HashTable {
 public:
  virtual ~HashTable() = default;

  virtual uint64_t capacity() const = 0;
  virtual int32_t row_floats() const = 0;
  virtual uint64_t size() const = 0;
  // "cpu" or "cuda:N".
  virtual std::string device() const = 0;

  // Inserts absent keys with their rows (n, row_floats); present keys keep their
  // rows. Of duplicates inside one call, one row is stored (the first, on the
  // CPU). inserted[i] (optional) is 1 where keys[i]'s row was written. Returns
  // the number of keys inserted.
  virtual uint64_t insert(const uint64_t* keys, uint64_t n, const float* rows,
                          uint8_t* inserted) = 0;

  // Copies the rows of present keys into rows_out (n, row_floats); rows of
  // absent keys are zero. found[i] (optional) is 1 for present keys. Returns hits.
  virtual uint64_t find(const uint64_t* keys, uint64_t n, float* rows_out,
                        uint8_t* found) const = 0;

  // The same, with only the first `columns` floats of each row (the embedding
  // without its optimizer state) into rows_out (n, columns). Throws
  // std::invalid_argument unless 0 < columns <= row_floats().
  virtual uint64_t find_columns(const uint64_t* keys, uint64_t n, int32_t columns, float* rows_out,
                                uint8_t* found) const = 0;

  // The address of each present key's row in host memory (n; null for an
  // absent key), valid until the key leaves the table (clear): a caller that
  // reads and updates a batch's rows many times looks each key up once.
  // slots_out (optional, n) gets each one's slot, as slots() gives it.
  // Returns hits. A table in GPU memory throws std::logic_error.
  virtual uint64_t row_addresses(const uint64_t* keys, uint64_t n, float** rows_out, int64_t* slots_out) = 0;

  // The slot, in [0, capacity()), of each present key (n; -1 for an absent
  // key). A key keeps its slot until clear (nothing else removes a key), so a
  // caller may keep something of its own per row in an array beside the
  // table, indexed by slot (the device tier's trained bits), and reach it
  // with no second lookup. Returns hits.
  virtual uint64_t slots(const uint64_t* keys, uint64_t n, int64_t* slots_out) const = 0;
  // The key in each of the n slots (each in [0, capacity()), else
  // std::out_of_range; kEmptyKey where a slot is free): the keys of the rows
  // that a caller's per-slot array names.
  virtual void keys_at(const int64_t* slots, uint64_t n, uint64_t* keys_out) const = 0;

  // Adds deltas (n, row_floats) to the rows of keys; an absent key first gets a
  // zero row. Duplicates sum.
  virtual void accumulate(const uint64_t* keys, uint64_t n, const float* deltas) = 0;

  // Overwrites the rows of present keys; absent keys are skipped (found[i] = 0).
  // Of duplicates inside one call, the last one's row is stored. Returns the
  // number of keys assigned (each duplicate counted).
  virtual uint64_t assign(const uint64_t* keys, uint64_t n, const float* rows,
                          uint8_t* found) = 0;

  // Embeddings (n, opt.dim) of keys; absent keys get a row initialised from
  // (opt.init.seed, key). Requires row_floats() == opt.row_floats().
  virtual void lookup_or_init(const uint64_t* keys, uint64_t n, const SparseOptimizer& opt,
                              float* embeddings_out) = 0;

  // Sums grads (n, opt.dim) per distinct key and applies the optimizer once per
  // key; absent keys are initialised first, as in lookup_or_init. A key whose
  // sum holds a NaN or an infinity (refuse_nonfinite), or whose step would
  // leave a value of its row that is not finite (a finite sum too large for
  // lr, or for the optimizer's squares: refuse_failing_steps), makes it
  // throw DivergedError before any row changes (or any absent key is claimed);
  // more absent keys than free slots make it throw TableFullError so, naming
  // both ("no row was stepped"): a retry after making room steps each key once.
  virtual void apply_gradients(const uint64_t* keys, uint64_t n, const float* grads,
                               const SparseOptimizer& opt) = 0;

  // The same, with the gradients already summed per key in `sums` (a table of
  // the same kind and device, rows of opt.dim floats): the device tier's
  // gradient table, applied without copying it out and summing it again.
  // Throws std::invalid_argument when `sums` is not such a table, and,
  // changing no row, DivergedError when a sum is not finite or a step would
  // leave a row that is not, TableFullError when its keys this table lacks
  // outnumber its free slots.
  virtual void apply_summed_gradients(const HashTable& sums, const SparseOptimizer& opt) = 0;

  // Throws DivergedError when a row holds a NaN or an infinity, naming
  // `what`, how many values and keys, and the first key (in slot order): a
  // gradient-sum table's check, which a caller applying several of them
  // makes on each before applying any (the apply makes it again).
  virtual void refuse_nonfinite(const std::string& what) const = 0;

  // Throws where apply_summed_gradients(sums, opt) would, naming `what`:
  // DivergedError for a sum that holds a NaN or an infinity
  // (sums.refuse_nonfinite), or a key whose step would leave a value of its
  // row here (of its initial row, where this table lacks the key) that is not
  // finite, naming how many keys, the first (in the sums' slot order) and the
  // value; then TableFullError where the sums' keys this table lacks
  // outnumber its free slots. Changes nothing: the steps are run dry, and no
  // slot is claimed. For a caller applying several tables' sums, each checked
  // before any is applied (the apply checks again).
  virtual void refuse_failing_steps(const HashTable& sums, const SparseOptimizer& opt,
                                    const std::string& what) const = 0;

  // Writes up to max_rows (key, row) pairs; returns how many. The CPU table
  // writes them in slot order; the CUDA table's threads claim output places
  // as they find rows, so its order, and which rows a max_rows below size()
  // writes, is not fixed. Callers export every row (max_rows >= size()).
  virtual uint64_t export_rows(uint64_t* keys_out, float* rows_out, uint64_t max_rows) const = 0;

  // Removes every key; rows return to zero.
  virtual void clear() = 0;
};

// Throws std::invalid_argument for bad options, std::runtime_error when the
// requested CUDA device is not available.
std::unique_ptr<HashTable> NewHashTable(const HashTableOptions& options);

// Whether this build contains the CUDA launcher.
bool CudaCompiled();
// Usable CUDA devices; 0 when CUDA is not compiled in, or the driver is missing
// or too old ("no GPU, use host devices").
int CudaDeviceCount();

}  // namespace hps
