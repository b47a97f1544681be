"""Herald across the ranks of an MPI job (issue 16): each rank a worker with a
cache of rows that persists between steps, examples moved to the rank that holds
their rows, and rows moved only when another rank needs them.

The sequential job (hps.distributed.sparse) sends every rank's distinct keys to
their owners each step and the rows back, then the gradients. Here:

- prefetch (the pipeline's prefetch stage): every rank gets every rank's example
  keys (the global batch), and each owner pins in its MEM-PS the batch's keys it
  owns (a rank may fetch them from there);
- partition (first in the train stage, where every rank's cache agrees with the
  scheduler's snapshot): every rank runs the same Herald scheduler (hps.herald) on
  the global batch, so all agree on which rank trains each example; the examples
  go there (labels, dense features, keys: ``examples`` bytes); the rows a rank
  lacks come from the rank whose cache holds their latest version, else from
  their owner's MEM-PS;
- apply: a key trained on several ranks is stepped on the lowest of them (its
  primary), which gets the others' summed gradients and sends them the stepped
  row; a row no cache holds any more goes to its owner's MEM-PS; pulls (an
  evaluation) and checkpoints first write every cached row to its owner.

So the job computes what the sequential one does, up to the order in which floats
are summed (tests/test_distributed.py runs both on 2 and 4 ranks). Every rank runs
the scheduler on the whole global batch: its cost does not fall with more ranks.
With ``[ps] lookahead``, every rank's window goes to every rank (the scheduler keeps the
job's window last) and to the owners (MEM-PS keeps it). Multi-hot fields are not taken
(hps train refuses them).
"""
from __future__ import annotations

import numpy as np

from hps import _core
from hps.batch_base import BatchBase, StopsAfterAFailedStep
from hps.distributed.comm import Node
from hps.distributed.sparse import DistributedServer, _StepData, owner_ranks
from hps.herald import Herald
from hps.mem_cache import CacheFullError
from hps.parameter_server import ParameterServer


class HeraldPrefetched:
    """A step's global batch (every rank's example keys) and this rank's pins."""

    def __init__(self, examples: np.ndarray, starts: np.ndarray, pinned: np.ndarray, cache,
                 uniq: np.ndarray, inverse: np.ndarray):
        self.examples = examples   # (N, F): every rank's example keys, in rank order
        self.starts = starts       # (W + 1,): rank r's examples are rows starts[r]:starts[r + 1]
        self.uniq = uniq           # the global batch's distinct keys, in order of first appearance
        self.inverse = inverse     # (N * F,): each example key's place in uniq
        self.pinned = pinned       # the batch's keys this rank owns, pinned in its MEM-PS
        self._cache = cache
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache.unpin(self.pinned)


class HeraldServer(StopsAfterAFailedStep, DistributedServer):
    """DistributedServer with Herald's schedule: a cache of at most ``capacity``
    rows on each rank. Collective like DistributedServer: every rank calls
    prefetch, batch, the batch's calls, pull, push and checkpoint in the same order."""

    _what = "the rank's Herald cache"
    _resume_hint = "rerun the job with --resume from its last checkpoint"

    def __init__(self, local: ParameterServer, node: Node, capacity: int):
        super().__init__(local, node)
        if capacity < 1:
            raise ValueError(f"worker_cache_rows must be >= 1 with schedule = 'herald', got {capacity}")
        self.capacity = capacity
        self.herald = Herald(node.size, capacity)
        self._row_floats = local.row_floats
        self._table_rows = min(max(64, 1 << (2 * capacity - 1).bit_length()), 1 << 16)
        self._tier = self._new_tier(self._table_rows)
        self._present = 0  # rows in the table, live or stale (an upper bound)
        self._init_fail_stop()
        self._dirty = False
        self.counts = {"batches": 0, "examples_sent": 0, "examples_kept": 0, "ps_loads": 0, "peer_fetches": 0,
                       "rows_served": 0, "primary_steps": 0, "replica_copies": 0, "evict_pushes": 0,
                       "flushes": 0, "flushed_rows": 0, "compactions": 0, "plan_pulls": 0, "plan_peer_pulls": 0,
                       "plan_shared": 0, "distinct": 0}

    def _new_tier(self, rows: int):
        return _core.DeviceTier(1, rows, self.local._native_opt, threads=self.local.config.device_threads)

    # ------------------------------------------------------------ state
    def ensure_room(self, incoming: int) -> None:
        """Before a step is scheduled (table and snapshot agree): room for
        `incoming` rows, by dropping stale rows, then by a larger table."""
        if self._present + incoming <= 0.7 * self._table_rows:
            return
        keys = self.herald.cached(self.node.rank)
        rows = self._tier.rows(keys, None, self._row_floats)
        table_rows = self._table_rows
        while len(keys) + incoming > 0.5 * table_rows:
            table_rows *= 2
        if table_rows != self._table_rows:
            self._tier = self._new_tier(table_rows)
            self._table_rows = table_rows
        else:
            self._tier.clear()
        if len(keys):
            self._tier.insert(keys, rows, None, self._row_floats)
        self._present = len(keys)
        self.counts["compactions"] += 1

    def _to_owners(self, keys: np.ndarray, rows: np.ndarray, what: str) -> int:
        """Sends rows to their owners (collective), which write them into MEM-PS
        as the newest copies; returns how many this rank wrote."""
        W = self.node.size
        owners = owner_ranks(keys, W)
        order = np.argsort(owners, kind="stable")
        cuts = np.cumsum(np.bincount(owners, minlength=W))[:-1]
        keys_in = self.node.alltoallv("train", np.split(keys[order], cuts), "sparse_keys", f"{what} keys")
        rows_in = self.node.alltoallv("train", np.split(rows[order], cuts), "sparse_rows", f"{what} rows")
        k = np.concatenate(keys_in)
        if len(k):
            r = np.ascontiguousarray(np.concatenate(rows_in))
            cache = self.local._cache
            cache.pin(k)
            cache.write_back(k, r.view(np.uint8))
        return len(k)

    def flush(self) -> None:
        """Every cached row to its owner's MEM-PS, one copy a key (collective; the
        caches keep the rows)."""
        with self._lock:
            self.check()
            if not self._dirty:
                return
            me = self.node.rank
            mine = self.herald.cached(me)
            for lower in range(me):  # a key several ranks hold goes from the lowest
                mine = mine[~np.isin(mine, self.herald.cached(lower), assume_unique=True)]
            rows = self._tier.rows(mine, None, self._row_floats)
            self._to_owners(mine, rows, "flush")
            self._dirty = False
            self.counts["flushes"] += 1
            self.counts["flushed_rows"] += len(mine)

    # ------------------------------------------------------------ the collective API
    def pull(self, keys: np.ndarray) -> np.ndarray:
        self.flush()
        return super().pull(keys)

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """As DistributedServer.push; the caches are written to the owners and
        emptied first (the step goes to the owners' rows)."""
        with self._lock:
            self.flush()
            self.herald.clear()
            self._tier.clear()
            self._present = 0
        super().push(keys, grads)

    def prefetch(self, keys: np.ndarray, upcoming=None) -> HeraldPrefetched:
        """Every rank's example keys to every rank; this rank pins the ones it owns."""
        if not isinstance(keys, np.ndarray) or keys.ndim != 2 or keys.dtype not in (np.uint64, np.int64):
            raise ValueError(f"schedule = 'herald' takes (n_examples, fields) uint64 keys, got "
                             f"{getattr(keys, 'dtype', type(keys).__name__)} {getattr(keys, 'shape', '')}")
        window = None
        if self._retry is not None and self._retry[0] is keys:
            parts, window = self._retry[1]  # the exchange of a prefetch that found MEM-PS full: only pin again
        else:
            if upcoming is not None:  # every rank schedules with the job's window
                window = self._lookahead(upcoming)
            # A rank's distinct keys (8 bytes each) and where each example's are among
            # them (4 bytes a key): about half the bytes of the keys themselves.
            flat = np.ascontiguousarray(keys).view(np.uint64)
            uniq, inverse = _core.unique_keys(flat.reshape(-1))
            where = inverse.astype(np.uint32).reshape(flat.shape)
            W = self.node.size
            uniqs = self.node.alltoallv("prefetch", [uniq] * W, "sparse_keys", "herald distinct keys")
            wheres = self.node.alltoallv("prefetch", [where] * W, "sparse_keys", "herald example key positions")
            parts = [u[w] for u, w in zip(uniqs, wheres)]
        self._retry = None
        examples = np.concatenate(parts)
        starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
        uniq, inverse = _core.unique_keys(examples.reshape(-1))
        mine = np.sort(uniq[owner_ranks(uniq, self.node.size) == self.node.rank])
        try:
            self.local._cache.pin(mine)
        except CacheFullError:
            self._retry = (keys, (parts, window))
            raise
        pre = HeraldPrefetched(examples, starts, mine, self.local._cache, uniq, inverse)
        pre.upcoming = window
        return pre

    def batch(self, pre: HeraldPrefetched, overlap: bool = False) -> "HeraldDistBatch":
        return HeraldDistBatch(self, pre)

    def checkpoint(self, save=None, *, keep_previous: bool = False) -> int:
        self.flush()
        return super().checkpoint(save, keep_previous=keep_previous)

    def stats(self) -> dict:
        s = super().stats()
        with self._lock:
            s["herald"] = {**self.counts, "cached": self.herald.cached_count(self.node.rank),
                           "capacity": self.capacity, "table_rows": self._table_rows,
                           "scheduler_bytes": self.herald.memory_bytes}
        return s


class HeraldDistBatch(BatchBase):
    """One step on every rank (the WorkingBatch protocol): ``partition()`` schedules
    it, moves the examples and the rows; pull and push on this rank's cache;
    apply() sums shared keys' gradients on their primaries."""

    def __init__(self, server: HeraldServer, pre: HeraldPrefetched):
        self.server = server
        self.pre = pre
        self.keys = pre.pinned
        self.wait_seconds = 0.0
        self.exchanged = None  # the examples this rank trains (hps.pipeline takes them as the batch's data)
        self._data = None
        self._plan = None
        self._applied = False
        self._done = False

    def bind(self, data) -> None:
        """The rank's own examples of this step (its reader's batch): partition()
        sends them where the schedule puts them."""
        self._data = data

    # ------------------------------------------------------------ partition
    def partition(self) -> list:
        if self._plan is None:
            with self.server.step():
                self._start()
        return self._minibatches

    def _start(self) -> None:
        s, pre, node = self.server, self.pre, self.server.node
        W, me = node.size, node.rank
        examples = pre.examples
        n, fields = examples.shape
        uniq, inverse = pre.uniq, pre.inverse  # found once, in the prefetch stage
        s.ensure_room(len(uniq))
        plan = s.herald.schedule(examples, upcoming=getattr(pre, "upcoming", None))
        self._plan = plan

        # The examples to the ranks the schedule gives them (each rank's in its order).
        data = self._data
        a, z = int(pre.starts[me]), int(pre.starts[me + 1])
        dest = plan.assignment[a:z]
        order = np.argsort(dest, kind="stable")
        cuts = np.cumsum(np.bincount(dest, minlength=W))[:-1]
        dense = np.ascontiguousarray(data.dense, np.float32)
        got_keys = node.alltoallv("train", np.split(np.ascontiguousarray(data.keys)[order], cuts), "examples",
                                  "herald examples (keys)")
        got_dense = node.alltoallv("train", np.split(dense[order], cuts), "examples", "herald examples (dense)")
        got_labels = node.alltoallv("train", np.split(np.ascontiguousarray(data.labels, np.float32)[order], cuts),
                                    "examples", "herald examples (labels)")
        from hps.data import Batch
        mine = Batch(np.concatenate(got_labels), np.concatenate(got_dense), np.concatenate(got_keys))
        total = getattr(data, "total_examples", len(data.labels))
        self.exchanged = _StepData(mine, total)
        self._minibatches = [np.arange(len(mine.labels))]
        s.counts["examples_sent"] += int((dest != me).sum())
        s.counts["examples_kept"] += int((dest == me).sum())

        # Each key's trainers (ranks); its primary, the lowest, steps it.
        trains = np.zeros((len(uniq), W), bool)
        trains[inverse, np.repeat(plan.assignment, fields)] = True
        primary = trains.argmax(axis=1)
        self._uniq, self._trains, self._primary = uniq, trains, primary
        mine_index = np.flatnonzero(trains[:, me])
        by_key = np.argsort(uniq[mine_index])
        self._mine = uniq[mine_index][by_key]  # the keys this rank trains, sorted
        self._mine_index = mine_index[by_key]  # their places in uniq
        self._grads = np.zeros((len(self._mine), s._tier.dim), np.float32)

        # Rows: each fetch is served by the peer holding the latest version, else by the owner.
        fk, src = plan.fetch_keys, plan.fetch_from
        fdest = np.repeat(np.arange(W, dtype=np.int32), np.diff(plan.fetch_offsets).astype(np.int64))
        server = np.where(src >= 0, src, owner_ranks(fk, W)).astype(np.int64)
        serve = np.flatnonzero(server == me)  # in fetch order, grouped by destination below
        serve = serve[np.argsort(fdest[serve], kind="stable")]
        rows_out = np.empty((len(serve), s._row_floats), np.float32)
        from_peer = src[serve] >= 0
        if from_peer.any():
            rows_out[from_peer] = s._tier.rows(fk[serve][from_peer], None, s._row_floats)
        if (~from_peer).any():
            rows_out[~from_peer] = s.local._cache.read_pinned(fk[serve][~from_peer]).view(np.float32)
        cuts = np.cumsum(np.bincount(fdest[serve], minlength=W))[:-1]
        rows_in = node.alltoallv("train", np.split(rows_out, cuts), "sparse_rows", "herald fetched rows")
        want = np.flatnonzero(fdest == me)  # my fetches, in fetch order
        got = np.empty((len(want), s._row_floats), np.float32)
        for r in range(W):  # rank r served mine in fetch order
            got[server[want] == r] = rows_in[r]
        s.counts["rows_served"] += len(serve)
        if len(want):
            k = fk[want]
            s._tier.assign(k, got, None, s._row_floats)  # a stale copy is overwritten
            s._tier.insert(k, got, None, s._row_floats)
            s._present += len(want)
            s.counts["ps_loads"] += int((src[want] < 0).sum())
            s.counts["peer_fetches"] += int((src[want] >= 0).sum())
        s.counts["batches"] += 1
        s.counts["plan_pulls"] += plan.pulls
        s.counts["plan_peer_pulls"] += plan.peer_pulls
        s.counts["plan_shared"] += plan.shared
        s.counts["distinct"] += plan.distinct

    # ------------------------------------------------------------ the WorkingBatch protocol
    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        self.partition()
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        with self.server._lock:
            return self.server._tier.get(0, keys, None, self.server._tier.dim)

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Gradients of this rank's keys, summed here until apply()."""
        self.partition()
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        at = np.minimum(np.searchsorted(self._mine, keys), max(len(self._mine) - 1, 0))
        if len(keys) and (len(self._mine) == 0 or (self._mine[at] != keys).any()):
            bad = keys[(self._mine[at] != keys) if len(self._mine) else slice(None)][0]
            raise KeyError(f"key {int(bad)} is not trained on this rank this step")
        self._grads += _core.sum_by_inverse(at.astype(np.int64), np.ascontiguousarray(grads, np.float32),
                                            len(self._mine))

    def apply(self) -> None:
        """Shared keys' gradients to their primaries, one step there, the stepped rows
        to the other trainers; rows no cache holds any more to their owners."""
        if self._applied:
            return
        self.partition()
        s, node = self.server, self.server.node
        W, me = node.size, node.rank
        with s.step(check=False):
            self._apply(s, node, W, me)
            s._dirty = True
        self._applied = True

    def _apply(self, s, node, W, me) -> None:
        trains, primary, uniq = self._trains, self._primary, self._uniq
        # Every rank knows who trains what, so the blocks carry no keys: rank r sends
        # primary p the gradients of the keys r trains and p steps, in key order.
        mine_primary = primary[self._mine_index]
        blocks = []
        for p in range(W):
            sel = mine_primary == p
            blocks.append(self._grads[sel] if p != me else self._grads[:0])
        grads_in = node.alltoallv("train", blocks, "sparse_grads", "herald shared gradients")
        stepped = self._mine[mine_primary == me]
        total = self._grads[mine_primary == me].copy()
        stepped_index = self._mine_index[mine_primary == me]
        for r in range(W):
            if r == me or not len(grads_in[r]):
                continue
            # Rank r sent the keys it trains whose primary is me, in key order: a subset of `stepped`.
            theirs = np.sort(uniq[trains[:, r] & (primary == me)])
            total[np.searchsorted(stepped, theirs)] += grads_in[r]
        if len(stepped):
            s._tier.accumulate(0, stepped, total, None, s._tier.dim)
            s._tier.apply()
        s.counts["primary_steps"] += len(stepped)
        # The stepped rows to the other trainers of each key.
        rows = s._tier.rows(stepped, None, s._row_floats) if len(stepped) else \
            np.empty((0, s._row_floats), np.float32)
        others = trains[stepped_index].copy()
        others[:, me] = False
        out = [rows[others[:, r]] if r != me else rows[:0] for r in range(W)]
        rows_in = node.alltoallv("train", out, "sparse_rows", "herald stepped rows")
        for r in range(W):
            if r == me or not len(rows_in[r]):
                continue
            # Rank r sent the keys it stepped that I train, in key order.
            theirs = np.sort(uniq[trains[:, me] & (primary == r)])
            s._tier.assign(theirs, rows_in[r], None, s._row_floats)
            s.counts["replica_copies"] += len(theirs)
        # Rows no cache holds any more: from the rank that dropped the last copy to the owner.
        plan = self._plan
        lost = plan.lost_keys[plan.lost_from == me]
        rows = s._tier.rows(lost, None, s._row_floats) if len(lost) else np.empty((0, s._row_floats), np.float32)
        s._to_owners(lost, rows, "herald evicted")
        s.counts["evict_pushes"] += len(lost)

    def write_back(self) -> None:
        """Unpins the keys this rank owns (their rows stay in the caches)."""
        if self._done:
            return
        if not self._applied:
            raise RuntimeError("write_back before apply")
        self._done = True
        self.pre.release()

    def abort(self) -> None:
        if self._done:
            return
        if not self._applied and self._plan is not None:
            self.server.fail("a step was aborted after it was scheduled")
        self._done = True
        self.pre.release()
