"""Herald's worker caches on one node (issue 16): rows that stay on the devices
between batches, and batches partitioned to the devices that hold their rows.

With ``schedule = "herald"`` the device tier is not emptied after each batch.
Each device (a worker) keeps a cache of rows, and the Herald scheduler
(``hps.herald``, include/hps/herald.h) decides, per batch,

- which examples each device trains (location-aware: an example goes to the
  device whose cache holds most of its keys, each device its share);
- which rows each device fetches: from the peer device holding the latest
  version (a row copied device to device) or from MEM-PS;
- which rows the caches drop: a device above ``worker_cache_rows`` drops its
  least recently trained keys, and a dirty row no cache holds any more (one
  trained since it was last written below: its trained bit, below) is
  written to MEM-PS (the on-demand push; to SSD-PS if MEM-PS does not hold
  the key: see ``_to_mem``); a clean one is dropped unwritten
  (``evict_clean_dropped``), as Herald pushes dirty rows only.

Under BSP every device that trains a key holds its latest version after the
batch: the key's gradients from all of them are summed on one of them (the
key's *primary*, the trainer its hash picks: ``primaries``), one optimizer
step runs there, and the updated row is copied to the key's other trainers. So
a run computes what the sequential schedule computes, up to the order in which
floats are summed.

What moves is counted: ``stats()`` gives the rows loaded from MEM-PS, fetched
from peers, copied to keep replicas equal, written to MEM-PS (evictions and
flushes: ``evict_pushes`` and ``flushed_rows``, the only push counts), and the
transfer matrix of all of it (with the tier's own counts of gradients sent to
primaries and embeddings read). The plan's pulls, peer pulls and shared keys
(``plan_*``) are what the scheduler planned, which the moves match.

MEM-PS holds stale copies of cached rows: ``flush()`` writes to MEM-PS the
cached rows trained since they were last written there (the caches keep them,
clean as far as MEM-PS is concerned); the others' stored copies equal the
cached ones. The parameter server calls it before a pull (an evaluation) and a
checkpoint. Which rows those are the tier's tables say: each row has a trained
bit (hps._core.DeviceTier's ``take_trained``), set by the step that changes
it and by the replica copy after it, carried by a fetch from a peer (the copy
is as new as its source), cleared by a load from MEM-PS and by a write (a
flush's or an eviction's: an evicted row is written only if its bit is set,
the bit of its last copy, which every live copy of the key shares). Writing
every cached row made each checkpoint write the whole caches again and an
export's delta list rows that had not changed; a list of trained keys kept in
Python, cut to the cached ones every few batches (a read of the whole
snapshot), slowed the MPI job (1c5833b, reverted by 44f8008). The bits cost a
batch the rows it touches; a flush, the rows it writes and a pass over the
caches' keys (which trained copies are live: ``live_trained``).

Physical rows follow the scheduler's snapshot: a row a device no longer holds
stays in its table (stale, never read: a fetch overwrites it) until the table
fills, when the tables are rebuilt from the snapshot (``compactions``).

A batch is scheduled when it is made (``ParameterServer.batch``: the
pipeline's load stage, while the batch before it trains), since a schedule
reads keys only; its rows move when it starts (``partition()``, first in the
train stage), after the batch before it applied. Between the two the snapshot
is ahead of the tables: each schedule keeps the caches' keys as the batch
before left them, which the batch's table rebuild and a flush in the meantime
(an evaluation inside the step before it) use. Batches start in the order
they were made, each after the one before it applied (RuntimeError
otherwise), and a batch dropped after its schedule (abort) stops the caches.

Thread safety: one thread makes the batches (the pipeline's loader) and one
runs them (the train thread); the write-back thread only unpins MEM-PS; pull
and checkpoint take the step lock, and the snapshot has a lock of its own.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from hps.batch_base import BatchBase, RunsInMadeOrder, StopsAfterAFailedStep, prefetched_positions, release_after
from hps.data.keys import mix64
from hps.herald import Herald


def size_gradients(tier, slots: np.ndarray, keys: np.ndarray, table_rows: int) -> None:
    """Sizes a tier's gradient tables between batches: device d's for keys[d]
    distinct keys (the keys whose gradients it sums this batch), twice that, a
    power of two, at most `table_rows`; resized only when that is more than
    slots[d] (its size now, updated here) or a quarter of it or less. Apply reads
    every slot of every gradient table, and a cache's table has many times the
    slots a batch's keys need: in W7s, 8 tables of 262,144 slots where a device
    sums a few thousand keys a batch."""
    for d, n in enumerate(np.asarray(keys, np.int64).tolist()):
        want = min(table_rows, max(64, 1 << (2 * n - 1).bit_length()))
        if want > slots[d] or 4 * want <= slots[d]:
            tier.set_gradient_capacity(d, want)
            slots[d] = want


def primaries(keys: np.ndarray, trains: np.ndarray) -> np.ndarray:
    """Each key's primary among its trainers (trains: (K, W) bools, a row a key
    that at least one worker trains): the first trainer at or after a start
    the key's hash picks, going round. The lowest trainer would put every key
    the whole batch trains (the hottest, trained by every worker) on worker 0:
    all their gradients into its one device, and every replica copy out of it
    (W7s line 17: device 0 received 70% of the rows between the 8 devices),
    where a start by hash spreads them evenly. Low bits of the
    hash: the owner of a key (hps.distributed.sparse.owner_ranks) takes the
    high ones."""
    K, W = trains.shape
    if K == 0 or W == 1:
        return np.zeros(K, np.int64)
    bits = np.uint64(1) << np.arange(W, dtype=np.uint64)
    held = np.ascontiguousarray(trains, bool).view(np.uint8) @ bits  # bit w: worker w trains the key
    start = ((mix64(keys) & np.uint64(0xFFFF_FFFF)) * np.uint64(W)) >> np.uint64(32)
    # held rotated right by start, so that bit 0 is worker `start` (a shift by W is
    # not defined: start 0 takes held as it is)
    wrapped = held << np.where(start == 0, np.uint64(0), np.uint64(W) - start)
    turned = (held >> start) | np.where(start == 0, np.uint64(0), wrapped)
    if W < 64:
        turned &= np.uint64((1 << W) - 1)
    first = np.log2((turned & (~turned + np.uint64(1))).astype(np.float64)).astype(np.int64)  # its lowest set bit
    return (start.astype(np.int64) + first) % W


def first_table_rows(capacity: int) -> int:
    """A worker table's rows at first: twice a cache of `capacity` keys, at least
    64, at most 2^16 (it grows when the caches and a batch's fetches need more)."""
    return min(max(64, 1 << (2 * capacity - 1).bit_length()), 1 << 16)


def needs_rebuild(present: int, incoming: int, table_rows: int) -> bool:
    """Whether a table holding `present` rows (live or stale) lacks room for
    `incoming` more below load 0.7."""
    return present + incoming > 0.7 * table_rows


def rebuilt_table_rows(table_rows: int, live: int, incoming: int) -> int:
    """A rebuilt table's rows: doubled until its `live` rows and `incoming` more
    fill at most half of it, so that the batches after the rebuild fill the other
    0.2 with stale rows before the next one (each costs a copy of every cache)."""
    while live + incoming > 0.5 * table_rows:
        table_rows *= 2
    return table_rows


def live_trained(keys: np.ndarray, owners: np.ndarray, held: list) -> tuple[np.ndarray, np.ndarray]:
    """Of the trained rows (keys[i] on worker owners[i]: a tier's take_trained),
    each key once, from its lowest worker whose cache holds it (held[w]: worker
    w's keys): the rows a flush writes. A row its cache dropped stays in the
    table, stale, bit and all (a newer copy may live on another worker, or the
    eviction that lost the key's last copy wrote it below): it is left out, and
    so is a row a batch not yet applied fetched (its source is read)."""
    live = np.zeros(len(keys), bool)
    for w, h in enumerate(held):
        mine = np.flatnonzero(owners == w)
        if len(mine) and len(h):
            live[mine] = np.isin(keys[mine], h)
    keys, owners = keys[live], owners[live]
    order = np.lexsort((owners, keys))
    keys, owners = keys[order], owners[order]
    first = np.ones(len(keys), bool)
    first[1:] = keys[1:] != keys[:-1]
    return keys[first], owners[first]


def most_fetched(n_examples: int, fields: int, workers: int, distinct: int) -> int:
    """The most rows one worker can fetch for a batch: the keys of its share
    of the examples (Herald gives each ceil(n / W) at most), or the batch's
    distinct keys where those are fewer. Sizing the tables for every distinct
    key on every worker made them twice the size (W7s: 262,144 rows a device
    where the caches hold 52k keys and a share has 13k)."""
    return min(distinct, -(-n_examples // workers) * fields)


class WorkerCaches(RunsInMadeOrder, StopsAfterAFailedStep):
    """The persistent device tier of ``workers`` devices, each a cache of at
    most ``capacity`` rows, scheduled by Herald. Built by ParameterServer."""

    _what = "the worker caches"

    def __init__(self, ps, workers: int, capacity: int, device_capacity: int = 1 << 62):
        if capacity < 1:
            raise ValueError(f"worker_cache_rows must be >= 1 with schedule = 'herald', got {capacity}")
        if capacity > device_capacity:
            raise ValueError(f"worker_cache_rows = {capacity} is more than device_capacity = {device_capacity}")
        self._ps = ps
        self.workers = workers
        self.capacity = capacity
        self.device_capacity = device_capacity  # the most rows a device's table has
        self.herald = Herald(workers, capacity)
        self._row_floats = ps.row_floats
        # Tables grow when a batch's fetches would fill one past 0.7 (schedule), up to device_capacity.
        self._table_rows = min(first_table_rows(capacity), device_capacity)
        self._tier = ps._new_tier(self._table_rows, track_trained=True)
        self._gradient_slots = np.full(workers, self._table_rows, np.int64)  # each device's gradient table's
        # The tables as the scheduled batches will leave them, under _scheduling:
        # each device's rows, live or stale, once they have fetched (an upper
        # bound: a fetch that overwrote a stale row is counted again), and the
        # tables' rows.
        self._init_made_order()
        self._planned_present = np.zeros(workers, np.int64)
        self._planned_rows = self._table_rows
        self._init_fail_stop()
        self._dirty = False  # a batch applied since the last flush (else no row's trained bit is set)
        self.moved_rows = np.zeros((workers, workers), np.uint64)  # whole rows copied device to device
        self.counts = {"batches": 0, "ps_loads": 0, "peer_fetches": 0, "replica_copies": 0,
                       "evict_pushes": 0, "evict_clean_dropped": 0, "flushes": 0, "flushed_rows": 0,
                       "compactions": 0, "table_growths": 0, "plan_pulls": 0, "plan_peer_pulls": 0,
                       "plan_shared": 0, "distinct": 0}
        self._tier_before = None  # transfer counts of the tiers replaced when the tables grew

    # ------------------------------------------------------------ schedule
    def schedule(self, examples: np.ndarray, distinct: int, upcoming=None):
        """Schedules a batch (examples: (n, fields) keys with `distinct` distinct
        ones): any thread, batches in the order they train. Decides whether its
        tables must be rebuilt first: room for the most rows a device can fetch,
        by dropping stale rows, then by larger tables. Returns (number, plan,
        rebuild): rebuild is None, or (the caches' keys before the batch, the
        rebuilt tables' rows) for _rebuild at its start."""
        self.check()
        n, fields = examples.shape
        incoming = most_fetched(n, fields, self.workers, distinct)
        with self._scheduling:
            held = self.herald.cached_by_worker()  # as the batch before leaves them
            rebuild = None
            if needs_rebuild(int(self._planned_present.max()), incoming, self._planned_rows):
                live = max(len(k) for k in held)
                if live + incoming > self.device_capacity:
                    # Refused before the snapshot takes the batch: the caches stay usable.
                    raise ValueError(f"a batch of {distinct} distinct keys may fetch {incoming} rows onto a "
                                     f"device whose cache holds {live}, more than device_capacity = "
                                     f"{self.device_capacity} together; raise device_capacity or lower "
                                     f"worker_cache_rows")
                rebuild = (held, min(rebuilt_table_rows(self._planned_rows, live, incoming), self.device_capacity))
            plan = self.herald.schedule(examples, upcoming=upcoming)  # lookahead: kept last
            if rebuild is not None:
                self._planned_rows = rebuild[1]
                self._planned_present[:] = [len(k) for k in held]
            self._planned_present += np.diff(plan.fetch_offsets).astype(np.int64)
            return self._made_one(held), plan, rebuild

    def _rebuild(self, held: list, table_rows: int) -> None:
        """At a batch's start (the batch before it applied): each device's table
        holds the keys `held` gives it and no stale rows, in tables of
        `table_rows` rows."""
        owners = [np.full(len(k), w, np.int32) for w, k in enumerate(held)]
        # The rows keep their bits (read with them: one lookup a key).
        read = [self._tier.rows_trained(k, o, self._row_floats) for k, o in zip(held, owners)]
        if table_rows != self._table_rows:
            rows_before, bytes_before = self._tier.transfers()
            self._tier_before = (rows_before, bytes_before) if self._tier_before is None else \
                (self._tier_before[0] + rows_before, self._tier_before[1] + bytes_before)
            self._tier = self._ps._new_tier(table_rows, track_trained=True)
            self._table_rows = table_rows
            self._gradient_slots[:] = table_rows
            self.counts["table_growths"] += 1
        else:
            self._tier.clear()
        for k, o, (r, t) in zip(held, owners, read):
            if len(k):
                self._tier.upsert(k, r, o, self._row_floats, t)
        self.counts["compactions"] += 1

    # ------------------------------------------------------------ MEM-PS
    def _to_mem(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Rows as the newest copies below the caches: dirty in MEM-PS where it
        holds the key, else straight to SSD-PS (through the backing store), so
        that the latest version lives in one place only.

        Not pinned and written back: a pin needs a free slot for each key MEM-PS
        lacks, beside the pins of the batches in flight (the pipeline's prefetch
        holds the next batch's), so a pipelined run failed with CacheFullError
        at budgets where the sequential one ran, and a flush of more cached keys
        than MEM-PS holds failed in any run. It also loaded each such row from
        SSD-PS only to overwrite it, counted as a MEM-PS miss and load.
        keep_updated takes no slot and loads nothing; a key a prefetch has
        pinned meanwhile gets its row in place, where its batch reads it."""
        if len(keys) == 0:
            return
        self._ps._cache.keep_updated(keys, np.ascontiguousarray(rows))

    def flush(self) -> int:
        """The cached rows trained since they were last written to MEM-PS, there,
        one copy a key; returns how many: the caches as the last batch applied
        left them (the snapshot before the batches scheduled since, a batch in
        its step among them)."""
        with self._lock:
            self.check()
            if not self._dirty:
                return 0
            trained, on = self._tier.take_trained()
            try:
                with self._scheduling:
                    held = self._as_applied(self.herald.cached_by_worker)
                keys, owners = live_trained(trained, on, held)
                rows = self._tier.rows(keys, owners, self._row_floats)
                self._to_mem(keys, rows)
            except BaseException:
                self._tier.set_trained(trained, on, True)  # not written: the next flush tries again
                raise
            self._dirty = False
            self.counts["flushes"] += 1
            self.counts["flushed_rows"] += len(keys)
            return len(keys)

    # ------------------------------------------------------------ stats
    def transfers(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, bytes) moved from device to device: the tier's embeddings and
        gradients, and the whole rows (with optimizer state) of peer fetches
        and replica copies."""
        rows, moved_bytes = self._tier.transfers()
        if self._tier_before is not None:
            rows, moved_bytes = rows + self._tier_before[0], moved_bytes + self._tier_before[1]
        return rows + self.moved_rows, moved_bytes + self.moved_rows * np.uint64(4 * self._row_floats)

    def stats(self) -> dict:
        """Counts; `cached`: each cache's keys once the batches scheduled so far train."""
        with self._lock, self._scheduling:
            return {**self.counts, "cached": [self.herald.cached_count(w) for w in range(self.workers)],
                    "capacity_per_worker": self.capacity, "table_rows": self._table_rows,
                    "scheduler_bytes": self.herald.memory_bytes,
                    "moved_rows": self.moved_rows.tolist()}


class HeraldBatch(BatchBase):
    """One batch on the worker caches (the WorkingBatch protocol of
    hps.parameter_server). Made, it is scheduled (the pipeline's load stage);
    ``partition()`` fetches the rows the devices lack (the pipeline calls it
    first in the train stage; the other calls run it if it has not); pull,
    push and apply as on the device tier; write_back only unpins MEM-PS (the
    rows stay cached)."""

    def __init__(self, caches: WorkerCaches, prefetched):
        self._caches = caches
        self._pre = prefetched
        self.keys = prefetched.keys  # distinct, in order of first appearance
        self.wait_seconds = 0.0
        self._number = None  # set: scheduled (the snapshot has taken this batch)
        self._started = False
        self._applied = False
        self._done = False
        try:
            self._schedule()
        except BaseException as e:
            if self._number is not None:  # the snapshot moved on without this batch's rows
                caches.fail(f"{type(e).__name__} after a batch was scheduled: {e}")
                caches._finished(self._number)
            release_after(e, self._release)  # the schedule's error stands
            raise

    # ------------------------------------------------------------ schedule, then fetch
    def _schedule(self) -> None:
        """The schedule and what follows from it alone (no row moves): each
        device's examples, each key's trainers and primary, the copies to bind."""
        c, pre, W = self._caches, self._pre, self._caches.workers
        examples = pre.examples
        n, fields = examples.shape
        self._number, plan, self._rebuild = c.schedule(examples, len(self.keys), getattr(pre, "upcoming", None))
        self._plan = plan
        order = np.argsort(plan.assignment, kind="stable")
        bounds = np.searchsorted(plan.assignment[order], np.arange(W + 1))
        self._minibatches = [order[bounds[w]:bounds[w + 1]] for w in range(W)]

        # Each key's trainers; its primary (primaries()) gets its gradients.
        trains = np.zeros((len(self.keys), W), bool)
        trains[pre.inverse, np.repeat(plan.assignment, fields)] = True
        self._primary = primaries(self.keys, trains)
        # Each worker's examples' positions among the batch's keys (hps.torch
        # gathers a mini-batch's keys, a copy of them: the examples are not in order).
        by_example = pre.inverse.reshape(n, fields)
        self._mine = [(examples[mb].reshape(-1), by_example[mb].reshape(-1)) for mb in self._minibatches]
        self._sorted = None  # for the positions of other keys (built when first needed)
        self._copies_of(trains, W)

    def _copies_of(self, trains: np.ndarray, W: int) -> None:
        """The batch's rows by position: a copy of each key on each of its
        trainers (key by key, trainers ascending), so that a pull reads the
        worker's own copy and a push sums on the key's primary, with no key
        looked up after the bind (a host partition's rows are read and stepped
        where its table holds them)."""
        K = len(self.keys)
        copies = np.flatnonzero(trains.reshape(-1))  # key * W + worker
        at = np.full(K * W, -1, np.int64)
        at[copies] = np.arange(len(copies))
        # _at[w][i]: the position of key i's copy on w; -1 where w does not train it.
        self._at = np.ascontiguousarray(at.reshape(K, W).T)
        self._bound_keys = self.keys[copies // W]
        self._bound_owners = (copies % W).astype(np.int32)
        self._at_primary = self._at[self._primary, np.arange(K)]
        # After the step, the primary's row goes onto each other copy.
        replica = np.ones(len(copies), bool)
        replica[self._at_primary] = False
        self._replica_to = np.flatnonzero(replica)
        self._replica_from = self._at_primary[copies[replica] // W]
        self._replica_moves = np.bincount(self._primary[copies[replica] // W] * W + self._bound_owners[replica],
                                          minlength=W * W).reshape(W, W).astype(np.uint64)

    def partition(self) -> list:
        """Fetches the batch's rows (after the batch before it applied); returns
        each device's example indices (the pipeline's mini-batches)."""
        if self._done:  # every call comes here first
            # The tables are bound to the next batch's rows by then (the
            # device tier's batches refuse too: their rows are gone).
            raise RuntimeError("Herald batch: a call after its release (write_back or abort)")
        if not self._started:
            self._caches._begin(self._number)
            with self._caches.step():
                self._start()
        return self._minibatches

    def _start(self) -> None:
        c, plan, W = self._caches, self._plan, self._caches.workers
        if self._rebuild is not None:
            c._rebuild(*self._rebuild)
            self._rebuild = None
        size_gradients(c._tier, c._gradient_slots, np.bincount(self._primary, minlength=W), c._table_rows)

        # Fetches: rows the trainers lack, from MEM-PS or from a peer's table.
        fk = plan.fetch_keys
        dest = np.repeat(np.arange(W, dtype=np.int32), np.diff(plan.fetch_offsets).astype(np.int64))
        src = plan.fetch_from
        if len(fk):
            rows = np.empty((len(fk), c._row_floats), np.float32)
            from_ps = src < 0
            trained = None  # each fetch's source's bit (None: all from MEM-PS, clean)
            if from_ps.any():
                rows[from_ps] = c._ps._cache.read_pinned(fk[from_ps]).view(np.float32)
            peer = ~from_ps
            if peer.any():
                peer_src = src[peer]
                # A peer's row is as new as its source, relative to MEM-PS: its trained bit goes with it.
                rows[peer], peer_trained = c._tier.rows_trained(fk[peer], peer_src, c._row_floats)
                c.moved_rows += np.bincount(peer_src.astype(np.int64) * W + dest[peer],
                                            minlength=W * W).reshape(W, W).astype(np.uint64)
                trained = np.zeros(len(fk), bool)
                trained[peer] = peer_trained
            # A stale copy is overwritten, the others join the table; each row takes its bit.
            c._tier.upsert(fk, rows, dest, c._row_floats, trained)
            c.counts["ps_loads"] += int(from_ps.sum())
            c.counts["peer_fetches"] += int(peer.sum())
        c._tier.bind(self._bound_keys, self._bound_owners)
        self.gathers_into_columns = c._tier.reads_in_place
        c.counts["batches"] += 1
        c.counts["plan_pulls"] += plan.pulls
        c.counts["plan_peer_pulls"] += plan.peer_pulls
        # (Not the plan's pushes: the replay's model (bench/herald_replay.py), a row a
        # peer fetch needs and every key no cache holds any more, each as if dirty and
        # sent to the PS. Here a peer fetch goes device to device and a clean evicted
        # row is dropped unwritten: the rows written are evict_pushes and flushed_rows.)
        c.counts["plan_shared"] += plan.shared
        c.counts["distinct"] += plan.distinct
        # Last: a start that failed halfway left the tables bound to the batch
        # before (or half-fetched) and stopped the caches; the calls after it
        # run partition() again, which then refuses rather than serve those rows.
        self._started = True

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Where each of keys (any shape, flattened) is among the batch's keys:
        from the prefetch for its keys, a run of them or a worker's examples,
        else searched for. KeyError names a key not in the batch."""
        self.partition()
        flat = np.ascontiguousarray(keys).reshape(-1)
        known = prefetched_positions(flat, self._pre.flat, self._pre.inverse)
        if known is not None:
            return known
        if flat.itemsize == 8 and len(flat):
            keys = flat.view(np.uint64)
            for mine, at in self._mine:  # (the shares are the same size: the ends tell them apart first)
                if len(mine) == len(keys) and mine[0] == keys[0] and mine[-1] == keys[-1] \
                        and np.array_equal(mine, keys):
                    return at
        flat = flat.astype(np.uint64, copy=False)
        if len(self.keys) == 0:  # a batch of no examples: no position to clip a search to
            if len(flat):
                raise KeyError(f"key {int(flat[0])} is not in this batch")
            return np.zeros(0, np.int64)
        if self._sorted is None:
            self._sorted = np.argsort(self.keys)
        at = np.searchsorted(self.keys, flat, sorter=self._sorted)
        at = self._sorted[np.minimum(at, len(self.keys) - 1)]
        if not np.array_equal(self.keys[at], flat):
            bad = flat[self.keys[at] != flat][0]
            raise KeyError(f"key {int(bad)} is not in this batch")
        return at

    def _checked(self, positions) -> np.ndarray:
        """positions as an array, each among the batch's keys (numpy would take
        a negative one from the end): IndexError names the first that is not."""
        positions = np.asarray(positions)
        if len(positions) and (positions.min() < 0 or positions.max() >= len(self.keys)):
            i = int(np.flatnonzero((positions < 0) | (positions >= len(self.keys)))[0])
            raise IndexError(f"positions[{i}] = {int(positions[i])} is outside [0, {len(self.keys)})")
        return positions

    def _copies(self, positions: np.ndarray, worker: int) -> np.ndarray:
        """Worker `worker`'s copies of the keys at positions (the schedule put a
        copy of every key it trains on it). KeyError names a key it does not train."""
        self._check_worker(worker)
        positions = self._checked(positions)
        at = self._at[worker][positions]
        if len(at) and at.min() < 0:
            bad = int(self.keys[positions[np.flatnonzero(at < 0)[0]]])
            raise KeyError(f"key {bad} is not in worker {worker}'s cache this batch "
                           f"(the schedule gave its examples to other workers)")
        return at

    # ------------------------------------------------------------ the WorkingBatch protocol
    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        """Embeddings (n, dim) of keys on device `worker`, from its own cache."""
        return self.gather(self.positions(keys), worker=worker)

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Gradients (n, dim) from device `worker` to each key's primary, where they sum."""
        positions = self.positions(keys)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        # (n, dim); a worker with no examples pushes none (-1 cannot stand for dim when n is 0)
        self.accumulate(positions, grads.reshape(len(positions), -1 if len(positions) else self._caches._tier.dim),
                        worker=worker)

    def gather(self, positions: np.ndarray, out: Optional[np.ndarray] = None, worker: int = 0) -> np.ndarray:
        """Embeddings (n, dim) of the keys at positions, from worker `worker`'s
        copies; into `out` if given: (n, dim), or where the tier reads in place
        (gathers_into_columns) also (B, k * dim) with B * k = n, which may be the
        first columns of a wider matrix."""
        self.partition()
        at = self._copies(positions, worker)
        c = self._caches
        with c._lock:
            return c._tier.get_at(worker, at, out)

    def accumulate(self, positions: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Gradients from worker `worker` to the primaries of the keys at
        positions, where they sum until apply(); laid out as gather's `out`."""
        self.partition()
        self._check_worker(worker)
        c = self._caches
        with c._lock:
            c._tier.accumulate_at(worker, self._at_primary[self._checked(positions)], grads)

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self._caches.workers:
            raise ValueError(f"worker {worker} is outside [0, {self._caches.workers})")

    def apply(self) -> None:
        """One step per key on its primary; the updated rows copied to the key's
        other trainers; the rows no cache holds any more written to MEM-PS."""
        if self._applied:
            return
        self.partition()
        c = self._caches
        with c.step(check=False):
            try:
                c._tier.apply()
                if len(self._replica_to):
                    c._tier.copy_rows_at(self._replica_from, self._replica_to)
                    c.moved_rows += self._replica_moves
                    c.counts["replica_copies"] += len(self._replica_to)
                lost, lost_from = self._plan.lost_keys, self._plan.lost_from
                if len(lost):
                    # Only a trained row differs from its copy below the caches (the
                    # bit of the last copy, the key's latest version, which every
                    # live copy shares: a replica takes its primary's).
                    dirty = c._tier.trained(lost, lost_from)
                    lost, lost_from = lost[dirty], lost_from[dirty]
                    c.counts["evict_clean_dropped"] += int((~dirty).sum())
                if len(lost):
                    c._to_mem(lost, c._tier.rows(lost, lost_from, c._row_floats))
                    c._tier.set_trained(lost, lost_from, False)  # written
                    c.counts["evict_pushes"] += len(lost)
            except BaseException as e:
                # The error is the reason recorded (the first stands), not the
                # abort's that releases the batch.
                c.fail(f"{type(e).__name__}: {e}")
                release_after(e, self.abort)
                raise
            c._dirty = True
            c._finished(self._number)
        self._applied = True

    def _stage(self) -> Optional[str]:
        return None if self._done else "applied" if self._applied else "made"

    def write_back(self) -> None:
        """Unpins the batch's keys in MEM-PS (their rows stay in the caches)."""
        if self._done:
            return
        if not self._applied:
            raise RuntimeError("write_back before apply")
        self._release()

    def abort(self) -> None:
        """Releases the batch. Before apply the caches no longer match the
        scheduler, which has moved on: they stop (see WorkerCaches.fail)."""
        if self._done:
            return
        if not self._applied and self._number is not None:
            self._caches.fail("a batch was aborted after it was scheduled")
            self._caches._finished(self._number)
        self._release()

    def _release(self) -> None:
        self._done = True
        try:
            self._caches._ps._cache.unpin(self.keys)
        finally:
            # Even when the unpin throws (a key something else unpinned): a
            # checkpoint waits until no batch is active, and this one is done.
            self._caches._ps._herald_batch_done()
