"""`hps size`: what a training config will take in memory and on disk, and the MEM-PS
hit rate its budget will give, before the run.

Sizes come from the native code's own accounting, not from guesses:

- a row is ``4 * row_floats`` bytes, ``row_floats`` from the native optimizer
  (embedding + optimizer state: SGD dim, AdaGrad 2 dim, row-wise AdaGrad dim + 1,
  Adam 3 dim + 1);
- MEM-PS charges each row ``row_bytes`` plus its bookkeeping against the budget;
  the bookkeeping is read back from ``MemCache.capacity_for_budget`` (the native
  ``kOverheadPerRow``), and the capacity is that function's;
- SSD-PS files follow the on-disk layout of docs/ssd_format.md (a header block,
  8 bytes of key and ``row_bytes`` of row a record, 4 bytes of block CRC per 4 KiB of
  rows, each region padded to 4 KiB); the store compacts at a commit once records
  on disk exceed ``[ps.ssd] compaction_trigger`` x live;
- the SSD-PS index (``CompactKeyIndex``, src/format/key_index.h) is costed slot by
  slot: its fixed shard table and slot size are measured on a scratch store
  (``SsdStore.stats()["index_bytes"]``), and its growth rule (65536 shards,
  16 slots first, doubled past a load of 0.8) gives the expected slots for n keys.

Bounded tables and admission: ``[ps] max_rows = N`` caps the rows kept at each
checkpoint, so the rows on disk at a commit (and cached at the end) are at most N,
and between checkpoints at most N plus the keys of one checkpoint interval, which
the CRC tables are sized for (the index keeps the slots of every key it held:
sized for all of them). ``[ps] ttl_steps`` and ``[admission]
threshold`` lower the rows by amounts that depend on the data: they are not
modelled, and the rows and sizes are then upper bounds (``bounds()``'s notes say
so). Nor are the erasures in the hit rate and the disk's writes: an erased key
that comes back misses.

The hit rate is the real policy's, not a model: the keys of a sample of the
training data (its first ``sample`` examples, in batch order) are pinned batch by
batch in an ``hps.MemCache`` of the configured policy and capacity, as the
pipeline's prefetch pins them (``in_flight`` batches pinned at once). The sample is
shorter than the run, so the estimate assumes the stream is stationary: once the
cache is full, every later batch hits at the rate of the sample's last quarter
(``hit_rate_steady``). See :func:`estimate_hit_rate` for what it does when the
sample is too short to fill the cache.

>>> from hps.sizing import ssd_file_bytes
>>> ssd_file_bytes(65536, 128)  # a full file of AdaGrad dim-16 rows: 4 KiB + keys + CRCs + rows
8925184
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import tempfile
from typing import Optional

import numpy as np

DEFAULT_SAMPLE = 200_000  # examples: a few seconds of synthetic data or TSV
IN_FLIGHT = 2             # batches pinned at once in the replay: the pipeline pins the next while one trains

# docs/ssd_format.md, "Parameter file" (src/format/param_file.h, ParamFileLayout):
# every region starts on a 4 KiB boundary, and a block of rows has a 4-byte CRC.
_BLOCK = 4096
_KEY_BYTES = 8
_CRC_BYTES = 4

# src/format/key_index.h, CompactKeyIndex: 2^16 shards, each 16 slots when first
# used and doubled when an insert would pass a load of 4/5 (Upsert's
# `(size + 1) * 5 > capacity * 4`). The slot size and the fixed shard table are
# measured (_index_layout), these only say how the slots grow.
_INDEX_SHARDS = 1 << 16
_INDEX_MIN_SLOTS = 16

# python/hps/parameter_server.py: device tables start at 2^16 rows (or
# device_capacity) and double while a batch fills them past 0.7.
_DEVICE_FIRST_ROWS = 1 << 16
_DEVICE_MAX_LOAD = 0.7


def _round_block(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def ssd_file_bytes(records: int, row_bytes: int) -> int:
    """Bytes of one parameter file of ``records`` rows (docs/ssd_format.md's layout):
    header block, keys region, block-CRC table, rows region, each 4 KiB aligned."""
    if records <= 0:
        return 0
    row_blocks = _round_block(records * row_bytes) // _BLOCK
    return _BLOCK + _round_block(records * _KEY_BYTES) + _round_block(row_blocks * _CRC_BYTES) + row_blocks * _BLOCK


def ssd_disk_bytes(rows: int, row_bytes: int, file_records: int) -> int:
    """Bytes on disk of ``rows`` live rows and no stale ones, in files of
    ``file_records`` (the last one partial): a freshly compacted store."""
    full, rest = divmod(max(int(rows), 0), file_records)
    return full * ssd_file_bytes(file_records, row_bytes) + ssd_file_bytes(rest, row_bytes)


def ssd_crc_table_bytes(rows: int, row_bytes: int, file_records: int) -> int:
    """Memory of the block-CRC tables an open store keeps (4 bytes per 4 KiB of rows)."""
    full, rest = divmod(max(int(rows), 0), file_records)
    blocks = lambda r: _round_block(r * row_bytes) // _BLOCK  # noqa: E731
    return _CRC_BYTES * (full * blocks(file_records) + blocks(rest))


@functools.lru_cache(maxsize=1)
def _index_layout() -> tuple[int, int]:
    """(fixed bytes, bytes a slot) of the SSD-PS index, measured on a scratch store:
    an empty index is its shard table; one key makes one shard of _INDEX_MIN_SLOTS."""
    from hps.ssd_store import SsdStore
    with tempfile.TemporaryDirectory(prefix="hps-size-") as d:
        store = SsdStore(d, row_bytes=8, use_io_uring=False, direct_io=False, background_compaction=False)
        fixed = store.stats()["index_bytes"]
        store.put(np.array([1], np.uint64), np.zeros((1, 8), np.uint8))
        slot = (store.stats()["index_bytes"] - fixed) // _INDEX_MIN_SLOTS
        del store
    return fixed, slot


def _index_slots(keys: int, rewritten: bool) -> int:
    """The slots a CompactKeyIndex shard holding ``keys`` keys has (0 when empty).
    Upsert checks for room before it looks for the key, so rewriting a key of a
    shard grows it as inserting one more would."""
    if keys <= 0:
        return 0
    need = keys + 1 if rewritten else keys
    slots = _INDEX_MIN_SLOTS
    while need * 5 > slots * 4:
        slots *= 2
    return slots


def ssd_index_bytes(keys: int, rewritten: bool = True) -> int:
    """Expected memory of the SSD-PS index for ``keys`` distinct keys: the shard table
    plus each shard's slots, with the keys spread over the shards by hash
    (Poisson with mean keys / 2^16 a shard). ``rewritten``: keys were put again
    after the last new one (a training run rewrites its rows, and reopening a store
    with stale copies does too), which grows a shard one key earlier."""
    fixed, slot = _index_layout()
    keys = int(keys)
    if keys <= 0:
        return fixed
    lam = keys / _INDEX_SHARDS
    spread = 12 * math.sqrt(lam) + 12
    lo, hi = max(0, int(lam - spread)), int(lam + spread) + 1
    s = np.arange(lo, hi)
    log_pmf = s * math.log(lam) - lam - np.array([math.lgamma(k + 1) for k in s])
    pmf = np.exp(log_pmf)
    slots = np.array([_index_slots(int(k), rewritten) for k in s], np.float64)
    return int(fixed + _INDEX_SHARDS * slot * float((pmf * slots).sum()))


def mem_overhead_per_row(row_bytes: int) -> int:
    """Bytes of bookkeeping MEM-PS charges a row besides the row, as the native
    capacity_for_budget counts them."""
    from hps import _core
    budget = 1 << 50
    return round(budget / _core.MemCache.capacity_for_budget(budget, row_bytes)) - row_bytes


def mem_capacity(budget_bytes: int, row_bytes: int) -> int:
    """Rows a MEM-PS budget holds (the native capacity_for_budget)."""
    from hps import _core
    return int(_core.MemCache.capacity_for_budget(int(budget_bytes), int(row_bytes)))


def herald_tables(devices: int, cache_rows: int, most_fetched: int, row_floats: int, dim: int,
                  device_capacity: int = 1 << 62) -> dict:
    """Herald's worker caches (hps.worker_caches): one tier whose tables persist, each
    sized as WorkerCaches sizes it: twice a cache at first (64 to 2^16 rows), doubled
    until a cache and the most rows a device can fetch for a batch (most_fetched: the
    keys of its share of the examples, at most the batch's distinct keys) fill it at
    most half (a rebuild drops the stale rows), at most device_capacity; and the scheduler's snapshot, about 19
    bytes a cached key (W7), at most devices x cache_rows keys."""
    from hps.worker_caches import first_table_rows, rebuilt_table_rows
    table = min(rebuilt_table_rows(first_table_rows(cache_rows), cache_rows, most_fetched), device_capacity)
    snapshot = 19 * devices * cache_rows
    return {"devices": devices, "tiers": 1, "table_rows": table, "cache_rows": cache_rows,
            "most_keys_per_device": most_fetched, "scheduler_bytes": snapshot,
            "bytes": device_tier_bytes(devices, table, row_floats, dim, 1) + snapshot}


def device_tier_bytes(devices: int, table_rows: int, row_floats: int, dim: int, tiers: int) -> int:
    """Memory of the device tier: per tier and device, a table of rows (key + row_floats
    float32 a slot) and one of gradients (key + dim float32), ``table_rows`` slots each
    (src/ps/device_tier.cc, src/table/hash_table.cc: keys and rows arrays by slot)."""
    slots = -(-table_rows // 8) * 8  # HashTable rounds its capacity up to a multiple of 8
    return tiers * devices * slots * ((_KEY_BYTES + 4 * row_floats) + (_KEY_BYTES + 4 * dim))


# ---------------------------------------------------------------- the data sample

@dataclasses.dataclass
class Sample:
    """The first examples of a run's training stream, as the pipeline would batch them."""

    examples: int                 # examples read
    batches: list                 # each batch's distinct keys (uint64), in batch order
    field_first: list             # per field: sorted positions of each distinct key's first occurrence
    field_length: list            # per field: keys of that field in the sample
    exhausted: bool               # the stream ended within the sample
    most_per_device: int = 0      # the largest share of one batch's distinct keys on one device
    most_fetched: int = 0         # schedule = "herald": the most rows one device can fetch for a batch
    widths: tuple = (13, 26, 0)   # the data's (dense features, single-hot fields, multi-hot fields)


def read_sample(cfg, sample: int = DEFAULT_SAMPLE) -> Sample:
    """The first ``sample`` examples of cfg's training data (a hps.train.TrainConfig):
    synthetic or files, epochs and shuffle included; an online directory's files present."""
    from hps import _core
    from hps.train import _train_source, _widths
    if sample < 1:
        raise ValueError(f"--sample: must be >= 1 examples, got {sample}")
    source = _train_source(dataclasses.replace(cfg, online=False), 0, 1)
    from hps.worker_caches import most_fetched
    batches, columns, examples, exhausted, most, fetched = [], None, 0, True, 0, 0
    devices = cfg.ps.devices
    it = iter(source)
    for batch in it:
        take = min(len(batch), sample - examples)
        keys = batch.keys[:take]
        bags = [b.rows(0, take) if take < len(batch) else b for b in getattr(batch, "bags", ())]
        if columns is None:
            columns = [[] for _ in range(keys.shape[1] + len(bags))]
        for f in range(keys.shape[1]):
            columns[f].append(keys[:, f])
        for j, b in enumerate(bags):
            columns[keys.shape[1] + j].append(b.keys)
        flat = np.concatenate([keys.reshape(-1)] + [b.keys for b in bags]) if bags else keys.reshape(-1)
        uniq = _core.unique_keys(np.ascontiguousarray(flat))[0]
        batches.append(uniq)
        fetched = max(fetched, most_fetched(take, keys.shape[1] if keys.ndim == 2 else 1, devices, len(uniq)))
        if devices > 1 and len(uniq):
            owners = _core.DeviceTier.modulo_owners(uniq, devices)
            most = max(most, int(np.bincount(owners, minlength=devices).max()))
        examples += take
        if examples >= sample:
            # Ended exactly here, or more to come (a batch cut short, or another after it).
            exhausted = take == len(batch) and next(it, None) is None
            break
    first, length = [], []
    for col in columns or []:
        keys = np.concatenate(col) if col else np.empty(0, np.uint64)
        _, idx = np.unique(keys, return_index=True)
        first.append(np.sort(idx))
        length.append(len(keys))
    return Sample(examples, batches, first, length, exhausted, most, fetched, tuple(_widths(cfg, source)))


def run_examples(cfg, smp: Sample) -> Optional[int]:
    """Examples one pass of the run trains on: counted when the sample read the whole
    stream; else ``[data] train_examples`` (synthetic data's count, or the first N of
    the files, assumed to hold that many), synthetic data's default; None when unknown
    (files of unknown length)."""
    from hps.train import SYNTHETIC_EXAMPLES
    d = cfg.data
    if smp.exhausted:
        return smp.examples // max(d.epochs, 1)
    if d.train_examples is not None:
        return d.train_examples
    if d.source == "synthetic":
        return SYNTHETIC_EXAMPLES
    return None


def estimate_rows(cfg, smp: Sample, pass_examples: Optional[int]) -> tuple[Optional[int], str]:
    """Distinct keys of one pass (the rows the run stores), and how they were found.

    Each field's distinct keys are extrapolated from the sample by the local slope
    of its growth curve (distinct keys at half the sample and at the whole, Heaps'
    law K ~ n^beta); a synthetic field is capped at its vocabulary plus the missing
    value's key. The curve flattens as n grows, so the estimate errs high."""
    if smp.exhausted:
        return sum(len(f) for f in smp.field_first), "counted (the sample read the whole data)"
    if pass_examples is None:
        return None, "unknown"
    pass_examples = max(pass_examples, smp.examples)
    caps = None
    if cfg.data.source == "synthetic":
        from hps.data import DEFAULT_VOCAB_SIZES
        caps = [v + 1 for v in (cfg.data.vocab_sizes or DEFAULT_VOCAB_SIZES)]
        caps += [v for v, _ in (cfg.data.multi_hot or ())]
    ratio = pass_examples / max(smp.examples, 1)
    total = 0.0
    for f, (first, n) in enumerate(zip(smp.field_first, smp.field_length, strict=True)):
        k = len(first)
        half = int(np.searchsorted(first, n // 2))
        beta = math.log2(k / half) if half and k > half else 0.0
        est = k * ratio ** min(beta, 1.0)
        if caps is not None and f < len(caps):
            est = min(est, caps[f])
        total += max(est, k)
    return int(round(total)), f"extrapolated per field from the sample to {pass_examples:,} examples, Heaps' law"


# ---------------------------------------------------------------- the hit rate

def replay(batches: list, capacity: int, policy: str, in_flight: int = IN_FLIGHT) -> dict:
    """Pins each batch's distinct keys in an hps.MemCache of ``capacity`` rows and the
    policy, as the pipeline's prefetch does, with at most ``in_flight`` batches pinned
    at once (the new one included; the oldest is unpinned first, as its write-back
    would): 1 is a sequential run, 2 a pipelined one that pins the next batch while
    one trains. A batch that does not fit beside the others waits for their
    unpinning, as the prefetch's backpressure does. Returns per-batch hits and
    accesses, the batch after which the cache was first full, and an error string
    when the budget cannot hold one batch."""
    from hps.mem_cache import CacheFullError, MemCache

    def loader(keys):
        return np.zeros((len(keys), 8), np.uint8), np.zeros(len(keys), np.uint8)

    cache = MemCache(8, capacity, policy=policy, loader=loader)
    pinned: list = []
    hits = np.zeros(len(batches), np.int64)
    access = np.array([len(b) for b in batches], np.int64)
    full_at, error = None, None
    for i, keys in enumerate(batches):
        while len(pinned) >= in_flight:
            cache.unpin(pinned.pop(0))
        while True:
            try:
                hit = cache.pin(keys)
                break
            except CacheFullError:
                if not pinned:
                    error = (f"the budget holds {capacity:,} rows, fewer than batch {i}'s {len(keys):,} "
                             f"distinct keys: training would stop with CacheFullError")
                    return {"hits": hits[:i], "access": access[:i], "full_at": full_at, "error": error}
                cache.unpin(pinned.pop(0))
        hits[i] = int(hit.sum())
        pinned.append(keys)
        if full_at is None and cache.stats()["size"] >= capacity:
            full_at = i
    return {"hits": hits, "access": access, "full_at": full_at, "error": error}


def estimate_hit_rate(smp: Sample, capacity: int, policy: str, rows: Optional[int], run_batches: Optional[int],
                      in_flight: int = IN_FLIGHT) -> dict:
    """The MEM-PS hit rate of the run, from the sample.

    - The run's rows fit the cache (rows <= capacity): nothing is evicted; every
      access but a key's first hits (method "fits").
    - The sample fills the cache: it is replayed at the real capacity; the batches
      after the sample are assumed to hit at the rate of the sample's last quarter
      once full (``hit_rate_steady``; method "replay"). New keys grow ever rarer,
      so later batches hit a little more often: the estimate errs low.
    - The sample does not fill the cache but the run would: the sample is replayed
      with the capacity scaled by its distinct keys over the run's rows, the same
      share of the keys cached (method "scaled"): a rougher estimate; a larger
      ``--sample`` replaces it with the one above.

    ``run_batches`` None (the run's length unknown): the whole-run figure is the
    steady rate."""
    access = np.array([len(b) for b in smp.batches], np.int64)
    sample_access = int(access.sum())
    sample_distinct = sum(len(f) for f in smp.field_first)
    mean_access = sample_access / max(len(access), 1)
    total_access = mean_access * run_batches if run_batches else None
    out = {"policy": policy, "capacity": capacity, "in_flight": in_flight, "sample_batches": len(access),
           "sample_accesses": sample_access, "accesses_per_batch": mean_access, "run_batches": run_batches,
           "error": None}
    if rows is not None and rows <= capacity:
        total = total_access or sample_access
        rate = max(0.0, 1.0 - rows / total) if total else 0.0
        return {**out, "method": "fits", "hit_rate": rate, "hit_rate_steady": 1.0, "hit_rate_sample":
                1.0 - sample_distinct / max(sample_access, 1), "cache_full_at_batch": None}
    if sample_distinct <= capacity:
        if rows is None:
            return {**out, "method": "fits", "hit_rate": 1.0 - sample_distinct / max(sample_access, 1),
                    "hit_rate_steady": None, "hit_rate_sample": 1.0 - sample_distinct / max(sample_access, 1),
                    "cache_full_at_batch": None,
                    "note": "the sample never fills the cache; give --rows for the run's rows"}
        scaled = max(1, int(capacity * sample_distinct / rows))
        r = replay(smp.batches, scaled, policy, in_flight)
        short = (f"the sample's {sample_distinct:,} distinct keys do not fill the cache's {capacity:,} rows, "
                 f"and the run's {rows:,} would")
        if r["error"]:  # the scaled cache, not the budget, is too small for a batch
            return {**out, "method": "scaled", "scaled_capacity": scaled, "hit_rate": None, "hit_rate_steady": None,
                    "hit_rate_sample": None, "cache_full_at_batch": None,
                    "note": f"{short}; scaled to the same share of the keys ({scaled:,} rows) it holds less than a "
                            f"batch: no estimate, raise --sample"}
        rate = float(r["hits"].sum()) / max(int(r["access"].sum()), 1)
        return {**out, "method": "scaled", "scaled_capacity": scaled, "hit_rate": rate, "hit_rate_steady": None,
                "hit_rate_sample": rate, "cache_full_at_batch": r["full_at"],
                "note": f"{short}: replayed at {scaled:,} rows (the same share of the keys cached), a rough "
                        f"estimate; raise --sample"}
    r = replay(smp.batches, capacity, policy, in_flight)
    if r["error"]:
        return {**out, "method": "replay", "hit_rate": None, "hit_rate_steady": None, "hit_rate_sample": None,
                "cache_full_at_batch": None, "error": r["error"]}
    hits, acc = r["hits"], r["access"]
    n = len(acc)
    start = max((r["full_at"] or 0) + 1, (3 * n) // 4)
    start = min(start, n - 1)
    steady = float(hits[start:].sum()) / max(int(acc[start:].sum()), 1)
    sample_rate = float(hits.sum()) / max(int(acc.sum()), 1)
    if total_access is None:
        rate = steady
    else:
        rest = max(total_access - sample_access, 0.0)
        rate = (float(hits.sum()) + steady * rest) / (sample_access + rest)
    return {**out, "method": "replay", "hit_rate": rate, "hit_rate_steady": steady, "hit_rate_sample": sample_rate,
            "cache_full_at_batch": r["full_at"], "steady_batches": n - start}


# ---------------------------------------------------------------- bounded tables

def bounds(cfg, rows: int, accesses_per_batch: float, interval: Optional[int]) -> dict:
    """What [ps] max_rows and ttl_steps and [admission] make of the ``rows`` the data
    gives: ``rows_kept``, the most rows at a commit (the cap holds there), and
    ``rows_peak``, the most between two (new keys of one checkpoint interval, at
    most ``accesses_per_batch`` a batch over ``interval`` batches, come on top
    until the checkpoint's erase; ``interval`` None: unknown, the whole run), with
    ``notes`` naming what is not modelled."""
    ps = cfg.ps
    threshold = cfg.admission.threshold
    kept, peak, notes = rows, rows, []
    if ps.max_rows and ps.max_rows < rows:
        kept = ps.max_rows
        if interval is not None:
            peak = min(rows, ps.max_rows + int(math.ceil(accesses_per_batch * interval)))
        notes.append(f"[ps] max_rows = {ps.max_rows:,} keeps at most that many of the {rows:,} rows at each "
                     f"checkpoint (per rank under mpiexec), up to {peak:,} between checkpoints; the hit rate and the "
                     f"disk's writes are a table's without erasures (an erased key that comes back misses)")
    lowered = []
    if ps.ttl_steps:
        lowered.append(f"[ps] ttl_steps = {ps.ttl_steps:,} (rows not updated for that many steps are erased)")
    if threshold > 1:
        lowered.append(f"[admission] threshold = {threshold} (only keys seen {threshold} times get a row)")
    if lowered:
        notes.append(f"not modelled: {' and '.join(lowered)} lower the rows by what the data does, so these rows "
                     f"and sizes are upper bounds")
    return {"max_rows": ps.max_rows, "ttl_steps": ps.ttl_steps, "admission_threshold": threshold,
            "rows_kept": kept, "rows_peak": peak, "upper_bound": bool(lowered), "notes": notes}


# ---------------------------------------------------------------- the whole estimate

def estimate(cfg, rows: Optional[int] = None, sample: int = DEFAULT_SAMPLE, in_flight: Optional[int] = None) -> dict:
    """The sizes and hit rate of a training config (hps.train.TrainConfig), as one
    JSON-able dict; ``rows`` (the distinct keys the run stores) is estimated from
    the data sample when None, and required when the sample cannot tell.
    ``in_flight``: batches pinned at once in the replay (None: IN_FLIGHT, or 1 when
    the config runs the stages one after another)."""
    from hps import _core
    from hps.config import parse_bytes
    from hps.optim import native_optimizer
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1):
        raise ValueError(f"--rows: must be an int >= 1, got {rows!r}")
    ps = cfg.ps
    opt = native_optimizer(ps.dim, ps.optimizer, ps.initializer, ps.seed)
    row_floats = int(opt.row_floats)
    row_bytes = 4 * row_floats
    smp = read_sample(cfg, sample)
    if smp.examples == 0:  # (every figure below is per example or per row: a ZeroDivisionError)
        from hps.train import _source_name
        raise ValueError(f"{_source_name(cfg.data.source)}: the training data holds no examples: nothing to size")
    pass_examples = run_examples(cfg, smp)
    rows_how = "given (--rows)"
    if rows is None:
        rows, rows_how = estimate_rows(cfg, smp, pass_examples)
        if rows is None:
            raise ValueError(f"--rows: the sample of {smp.examples:,} examples did not reach the end of the data and "
                             f"the run's length is unknown; give --rows N (the distinct keys the run will store)")
    rows = int(rows)
    if in_flight is None:
        in_flight = IN_FLIGHT if cfg.pipelined else 1
    epochs = max(cfg.data.epochs, 1)
    run_batches = None
    if smp.exhausted:
        run_batches = len(smp.batches)
    elif pass_examples is not None:
        run_batches = -(-pass_examples // cfg.data.batch_size) * epochs

    # MEM-PS
    budget = parse_bytes(ps.mem_budget, "mem_budget")
    from hps.train import check_lookahead_room, window_batch_keys
    # The lookahead window's part of the budget, as hps train sizes (or refuses) it.
    room = check_lookahead_room(cfg, window_batch_keys(cfg, smp.widths))
    capacity = mem_capacity(budget - room, row_bytes)
    overhead = mem_overhead_per_row(row_bytes)
    hit = estimate_hit_rate(smp, capacity, ps.cache_policy, rows, run_batches, in_flight)
    every = cfg.checkpoint_every or run_batches
    bound = bounds(cfg, rows, hit["accesses_per_batch"], every)
    kept, peak = bound["rows_kept"], bound["rows_peak"]
    cached_rows = min(capacity, kept)
    mem = {"budget_bytes": budget, "row_bytes": row_bytes, "overhead_bytes_per_row": overhead,
           "bytes_per_row": row_bytes + overhead, "lookahead_room_bytes": room, "capacity_rows": capacity,
           "arena_bytes": capacity * row_bytes, "cached_rows_at_end": cached_rows,
           "bytes_at_end": cached_rows * (row_bytes + overhead), "policy": ps.cache_policy}

    # SSD-PS (its live rows at a commit: the cap holds there)
    fr, trigger = ps.ssd.file_records, ps.ssd.compaction_trigger
    live = ssd_disk_bytes(kept, row_bytes, fr)
    disk_per_row = ssd_file_bytes(fr, row_bytes) / fr
    # Between commits (hps train commits at each checkpoint, or only at the end) the
    # store grows by the rows MEM-PS evicts (every evicted row was updated, so dirty):
    # about one a miss once the cache is full; the checkpoint's flush adds the
    # cached dirty rows. A commit then compacts it back under trigger x live.
    steady_miss = 1.0 - (hit["hit_rate_steady"] if hit["hit_rate_steady"] is not None else (hit["hit_rate"] or 0.0))
    written_per_commit = None
    worst, worst_from = None, None
    if every is not None and hit["hit_rate"] is not None:
        written_per_commit = int(steady_miss * hit["accesses_per_batch"] * every) if peak > capacity else 0
        total_written = None
        if run_batches is not None:
            # Every miss is a row that is written once: when evicted, or by the last flush.
            # Each checkpoint before the last also writes the dirty rows cached then (at
            # most the cache), which are written again when evicted or at the end.
            flushes = (run_batches - 1) // cfg.checkpoint_every if cfg.checkpoint_every > 0 else 0
            total_written = int((1.0 - hit["hit_rate"]) * hit["accesses_per_batch"] * run_batches) + \
                flushes * cached_rows
        worst_records = int(trigger * kept) + written_per_commit + min(capacity, peak)
        worst_from = "trigger x live + a commit interval's evictions + the final flush"
        if total_written is not None and max(total_written, kept) < worst_records:
            worst_records = max(total_written, kept)
            worst_from = "every row the run writes"
        worst = int(worst_records * disk_per_row)
    ssd = {"row_bytes": row_bytes, "disk_bytes_per_row": disk_per_row, "file_records": fr,
           "file_bytes": ssd_file_bytes(fr, row_bytes), "live_rows": kept, "disk_live_bytes": live,
           "compaction_trigger": trigger, "disk_at_trigger_bytes": int(trigger * live),
           "rows_written_per_commit": written_per_commit, "disk_worst_bytes": worst, "disk_worst_from": worst_from,
           # The index's shards never shrink, and each grows to the most keys it held at
           # once: with max_rows erasing, keys that come and go reach about the figure
           # of every key at once (measured: 8,282,464 B at a cap of 5,000 of 66,929).
           "index_bytes": ssd_index_bytes(rows), "index_bytes_per_key": ssd_index_bytes(rows) / rows,
           "crc_table_bytes": ssd_crc_table_bytes(peak, row_bytes, fr)}

    # Device tier
    in_place = ps.host_in_place and ps.devices == 1 and _core.cuda_device_count() < 1 \
        and ps.schedule == "sequential"
    if ps.schedule == "herald":
        dev = herald_tables(ps.devices, ps.worker_cache_rows, smp.most_fetched, row_floats, ps.dim,
                            ps.device_capacity)
        dev["kind"] = ("cuda" if _core.cuda_device_count() >= ps.devices else "host partitions") + \
            ", herald worker caches"
    elif in_place:
        dev = {"kind": "host, in place (MEM-PS rows)", "bytes": 0, "table_rows": 0}
    else:
        most = smp.most_per_device if ps.devices > 1 else max((len(b) for b in smp.batches), default=0)
        table = min(ps.device_capacity, _DEVICE_FIRST_ROWS)
        while most > _DEVICE_MAX_LOAD * table and table < ps.device_capacity:
            table = min(2 * table, ps.device_capacity)
        tiers = 2 if cfg.pipelined else 1
        kind = "cuda" if _core.cuda_device_count() >= ps.devices else "host partitions"
        dev = {"kind": kind, "devices": ps.devices, "tiers": tiers, "table_rows": table,
               "most_keys_per_device": most, "bytes": device_tier_bytes(ps.devices, table, row_floats, ps.dim, tiers)}

    return {"config": {"dim": ps.dim, "optimizer": ps.optimizer.kind, "row_floats": row_floats,
                       "mem_budget": ps.mem_budget, "cache_policy": ps.cache_policy, "batch_size": cfg.data.batch_size,
                       "checkpoint_every": cfg.checkpoint_every},
            "sample": {"examples": smp.examples, "batches": len(smp.batches), "exhausted": smp.exhausted,
                       "distinct_keys": sum(len(f) for f in smp.field_first)},
            "run": {"examples_per_pass": pass_examples, "epochs": epochs, "batches": run_batches,
                    "rows": rows, "rows_from": rows_how, "bounds": bound},
            "mem": mem, "ssd": ssd, "device": dev, "hit": _plain(hit),
            "memory_bytes": mem["bytes_at_end"] + ssd["index_bytes"] + ssd["crc_table_bytes"] +
            (dev["bytes"] if not dev["kind"].startswith("cuda") else 0)}


def _plain(d: dict) -> dict:
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in d.items()}


def _size(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def format_table(e: dict) -> str:
    """The estimate as `hps size` prints it."""
    m, s, d, h, r = e["mem"], e["ssd"], e["device"], e["hit"], e["run"]
    rate = "-" if h["hit_rate"] is None else f"{h['hit_rate']:.3f}"
    if h.get("hit_rate_steady") is not None:
        rate += f" (once full: {h['hit_rate_steady']:.3f})"
    rate += f"; {h['method']}, policy {h['policy']}"
    rows = [
        ("row", f"{e['config']['dim']} + state = {e['config']['row_floats']} floats = {m['row_bytes']} B "
                f"({e['config']['optimizer']})"),
        ("rows stored (distinct keys)", f"{r['rows']:,}: {r['rows_from']}"),
        *([("rows kept (max_rows)", f"{r['bounds']['rows_kept']:,} at each checkpoint, up to "
                                    f"{r['bounds']['rows_peak']:,} between checkpoints")]
          if r["bounds"]["rows_kept"] < r["rows"] else []),
        ("MEM-PS budget", f"{_size(m['budget_bytes'])} = {m['capacity_rows']:,} rows of {m['bytes_per_row']} B "
                          f"(row {m['row_bytes']} + bookkeeping {m['overhead_bytes_per_row']})"
                          + (f", less {_size(m['lookahead_room_bytes'])} for the lookahead window"
                             if m["lookahead_room_bytes"] else "")),
        ("MEM-PS rows cached at the end", f"{m['cached_rows_at_end']:,} ({_size(m['bytes_at_end'])})"),
        ("MEM-PS hit rate (estimate)", rate),
        ("SSD-PS bytes per row", f"{s['disk_bytes_per_row']:.1f} (row {s['row_bytes']} + key 8 + block CRC, "
                                 f"files of {s['file_records']:,} rows)"),
        ("SSD-PS disk, live", _size(s["disk_live_bytes"])),
        ("SSD-PS disk, at the trigger", f"{_size(s['disk_at_trigger_bytes'])} "
                                        f"({s['compaction_trigger']:g} x live: a commit compacts past it)"),
        ("SSD-PS disk, worst before a commit", f"{_size(s['disk_worst_bytes'])}" +
         (f" ({s['disk_worst_from']})" if s["disk_worst_from"] else "")),
        ("SSD-PS index memory", f"{_size(s['index_bytes'])} ({s['index_bytes_per_key']:.1f} B a key), "
                                f"block CRCs {_size(s['crc_table_bytes'])}"),
        ("device tier", d["kind"] + (f": {d['devices']} x {d['tiers']} tiers x {d['table_rows']:,} rows, "
                                     f"{_size(d['bytes'])}" if d["bytes"] else "")),
        ("host memory, parameter server", _size(e["memory_bytes"])),
        ("sample", f"{e['sample']['examples']:,} examples, {e['sample']['batches']:,} batches, "
                   f"{e['sample']['distinct_keys']:,} distinct keys" +
         (f"; the run: {r['batches']:,} batches" if r["batches"] else "; the run's length unknown")),
    ]
    out = "\n".join(f"  {k:<36}  {v}" for k, v in rows)
    for note in (h.get("note"), h.get("error"), *r["bounds"]["notes"]):
        if note:
            out += f"\n  note: {note}"
    return out
