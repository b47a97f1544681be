"""Herald across the ranks of an MPI job (issue 16): each rank a worker with a
cache of rows that persists between steps, examples moved to the rank that holds
their rows, and rows moved only when another rank needs them.

The sequential job (hps.distributed.sparse) sends every rank's distinct keys to
their owners each step and the rows back, then the gradients. Here one rank, the
leader (rank 0), holds the scheduler's snapshot of every rank's cache and plans
every step; the others learn only their part of the plan:

- prefetch (the pipeline's prefetch stage): every rank sends its example keys to
  the leader (its distinct keys and where each example's sit among them), and its
  distinct keys to their owners, which pin them in MEM-PS (a rank may fetch them
  from there);
- schedule (when the step's batch is made: the pipeline's load stage, while the
  step before trains): the leader runs Herald (hps.herald) on the global batch,
  each example's origin the rank that read it (it moves only where more of its
  keys' rows than its own bytes are cached elsewhere: example_cost), and cuts
  the plan into parts; it keeps the caches' keys as the step before
  left them, for a flush in the meantime (as hps.worker_caches does on a node);
- partition (first in the train stage, where every rank's cache agrees with the
  snapshot before the step): the leader sends each rank its plan part (``plan``
  bytes), or its refusal of the step (a step that would fetch more rows onto a
  rank than ``device_capacity`` holds beside its cache), which every rank raises
  alike: the rank of each of its examples; for
  each key it will train (ascending), its trainers (a bit a rank) and where its
  row comes from when the rank's cache lacks it; the rows it serves to others;
  the rows its evictions lost; and, when its table must be compacted, the keys
  its cache holds. The examples go to their ranks (labels, dense features, keys:
  ``examples`` bytes); the rows a rank lacks come from the rank whose cache holds
  their latest version, else from their owner's MEM-PS;
- apply: a key trained on several ranks has its gradients summed on one of
  them (its primary, the trainer its hash picks: hps.worker_caches.primaries,
  so that the keys every rank trains do not all sum on rank 0), which sends the
  sum back, and each trainer steps its own copy; a row no cache holds any more
  goes to its owner's MEM-PS if trained since it was last written there (else
  it is dropped: evict_clean_dropped); pulls (an
  evaluation) and checkpoints first write to its owner every cached row
  trained since it was last written there: each rank's table keeps a trained
  bit a row (hps.worker_caches), the ranks send the leader the keys of theirs,
  and the leader names which rank writes which (a copy its cache holds).

So the job computes what the sequential one does, up to the order in which floats
are summed (tests/test_distributed.py runs both on 2 and 4 ranks). The leader's
scheduler sees the whole global batch: its cost does not fall with more ranks,
and it runs beside the step before (the ranks wait for it only where it takes
longer than that step). Steps start in the order they were made, each after the
one before it applied. Were every rank to run
it, every rank's keys would go to every other: W - 1 times the leader's inbound
keys, and W schedulers' CPU. With ``[ps] lookahead``, every rank's window goes to the
leader (the scheduler keeps the job's window last) and to the owners (MEM-PS
keeps it, in the order the job needs its keys: OwnerWindows; a window moved on a
batch sends only the batch that enters). Multi-hot fields
are not taken (hps train refuses them).
"""
from __future__ import annotations

import numpy as np

from hps import _core
from hps.batch_base import BatchBase, RunsInMadeOrder, StopsAfterAFailedStep, release_after
from hps.distributed.comm import Node, raised_on_every_rank
from hps.distributed.sparse import (DistributedServer, FreshRows, _StepData, owner_ranks, rank_positions,
                                   OwnerWindows, refuse_nonfinite)
from hps.herald import Herald
from hps.mem_cache import CacheFullError
from hps.parameter_server import ParameterServer
from hps.worker_caches import (first_table_rows, live_trained, most_fetched, needs_rebuild, primaries,
                               rebuilt_table_rows, size_gradients)


LEADER = 0  # the rank that holds the snapshot and plans every step
# A plan part's source of a key a rank trains: the rank whose cache serves its row
# (< 64), _OWNER + the owner whose MEM-PS does, or _HELD (the rank's cache holds it).
_OWNER, _HELD = 64, 255
# A plan part's fields, in order (hps.distributed.herald._pack): the leader's refusal
# of the step (its message, UTF-8; empty: none), the counts, the ranks of the rank's
# examples, its trained keys' trainer bits and sources, the rows it serves (keys, how
# many to each rank, whether from its cache), the keys its evictions lost, and the
# keys its cache holds when its table is compacted.
_PART = (np.uint8, np.int64, np.uint8, np.uint8, np.uint8, np.uint64, np.int64, np.bool_, np.uint64, np.uint64)
_COUNTS = ("plan_pulls", "plan_peer_pulls", "plan_shared", "distinct", "cached", "table_rows")


def _pack(arrays) -> np.ndarray:
    """One byte buffer: the arrays' sizes in bytes (int64), then their bytes."""
    sizes = np.array([a.nbytes for a in arrays], np.int64)
    return np.concatenate([sizes.view(np.uint8)] + [np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                                                    for a in arrays])


def _example_keys(buf: np.ndarray, rank: int) -> np.ndarray:
    """Rank `rank`'s example keys, (n_examples, fields), from what its _exchange
    sent the leader: its distinct keys and, for each key of each example, its
    index among them (2 or 4 bytes). A header this code does not write (another
    hps version on that rank) is refused, naming the rank, not misread."""
    (fields, width), uniq, where = _unpack(buf, (np.int64, np.uint64, np.uint8))
    if width not in (2, 4) or fields < 1 or len(where) % (width * fields):
        raise RuntimeError(f"rank {rank}'s example keys: {len(where)} bytes of key indices of {width} bytes for "
                           f"examples of {fields} keys do not make whole examples (does that rank run another hps?)")
    index = where.view(np.uint16 if width == 2 else np.uint32).reshape(-1, fields)
    if index.size and int(index.max()) >= len(uniq):
        raise RuntimeError(f"rank {rank}'s example keys: an index {int(index.max())} past its {len(uniq)} distinct "
                           f"keys (does that rank run another hps?)")
    return uniq[index]


def _unpack(buf: np.ndarray, dtypes) -> list:
    """What _pack packed, as arrays of `dtypes` (copies: a received buffer's
    offsets need not be aligned)."""
    head = 8 * len(dtypes)
    sizes = np.frombuffer(buf[:head].tobytes(), np.int64)
    if len(buf) != head + int(sizes.sum()):
        raise RuntimeError(f"a Herald plan part of {len(buf)} bytes does not match its header ({sizes.tolist()})")
    ends = head + np.cumsum(sizes)
    return [np.frombuffer(buf[e - n:e].tobytes(), t) for e, n, t in zip(ends, sizes, dtypes)]


class HeraldPrefetched:
    """A step's pins on this rank and, on the leader, the global batch (every
    rank's example keys)."""

    def __init__(self, pinned: np.ndarray, cache, examples=None, starts=None, uniq=None, inverse=None):
        self.pinned = pinned       # the batch's keys this rank owns, pinned in its MEM-PS
        self.examples = examples   # leader: (N, F) every rank's example keys, in rank order
        self.starts = starts       # leader: (W + 1,) rank r's examples are rows starts[r]:starts[r + 1]
        self.uniq = uniq           # leader: the global batch's distinct keys, in order of first appearance
        self.inverse = inverse     # leader: (N * F,) each example key's place in uniq
        self.upcoming = None       # leader: the job's lookahead window
        self.failed = None         # why this rank's pins failed (none held): its step raises it
        self._cache = cache
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache.unpin(self.pinned)


class HeraldServer(RunsInMadeOrder, StopsAfterAFailedStep, DistributedServer):
    """DistributedServer with Herald's schedule: a cache of at most ``capacity``
    rows on each rank. Collective like DistributedServer: every rank calls
    prefetch, batch, the batch's calls, pull, push and checkpoint in the same order."""

    _what = "the rank's Herald cache"
    _unit, _units = "step", "steps"
    _resume_hint = "rerun the job with --resume from its last checkpoint"

    def __init__(self, local: ParameterServer, node: Node, capacity: int, example_bytes: int = 0):
        self.capacity = capacity
        self._example_bytes = example_bytes  # (both checked by _check_arguments, on every rank together)
        super().__init__(local, node)
        ps = local.config
        self.leader = node.rank == LEADER
        self._row_floats = local.row_floats
        # Fetched rows move whole (with the optimizer's state); those never trained, as a bit.
        self.fetched_rows = FreshRows(local._native_opt, self._row_floats)
        # An example moved costs its bytes (keys, dense features, label); a row
        # pulled, its floats with the optimizer's state: the partition keeps an
        # example on the rank that read it unless that many more of its keys
        # are cached elsewhere (hps.herald.Herald's example_cost).
        self.example_cost = min(65536.0, self._example_bytes / (4 * self._row_floats))
        self.herald = Herald(node.size, capacity, example_cost=self.example_cost) if self.leader else None
        self.device_capacity = ps.device_capacity  # the most rows a rank's table has
        self._table_rows = min(first_table_rows(capacity), self.device_capacity)
        self._tier = self._new_tier(self._table_rows)
        self._gradient_slots = np.array([self._table_rows], np.int64)  # the tier's gradient table's
        self._present = 0  # rows in the table, live or stale (an upper bound)
        self._cached = 0   # keys this rank's cache holds (the leader's count, at the last plan)
        if self.leader:  # every rank's table as the leader plans it: rows present and table size
            self._tables = [[0, self._table_rows] for _ in range(node.size)]
        self._init_made_order()  # the leader keeps the caches' keys before each pending step
        self._init_fail_stop()
        # Leader: why it refused a step (every step after it is refused alike), else None.
        self._refusal = None
        self._schedule_failure = None  # leader: the error its scheduler raised (every later step fails with it)
        self._dirty = False
        self.counts = {"batches": 0, "examples_sent": 0, "examples_kept": 0, "ps_loads": 0, "peer_fetches": 0,
                       "rows_served": 0, "primary_steps": 0, "replica_copies": 0, "evict_pushes": 0,
                       "evict_clean_dropped": 0, "flushes": 0, "flushed_rows": 0, "compactions": 0, "plan_pulls": 0,
                       "plan_peer_pulls": 0, "plan_shared": 0, "distinct": 0}

    def _check_arguments(self) -> None:
        """The checks of this rank's arguments, which DistributedServer makes with
        the ranks' first exchange: refused on one rank before it, they left the
        others waiting there (or, after it, in the first step's)."""
        ps, capacity = self.local.config, self.capacity
        if ps.ttl_steps or ps.max_rows:
            # The rank's server runs 'sequential' behind this cache, so its own check
            # let them through: its checkpoint would erase keys the cache still holds,
            # and the next flush would bring them back.
            raise ValueError(f"[ps] ttl_steps = {ps.ttl_steps} and max_rows = {ps.max_rows}: bounded "
                             f"tables need schedule = 'sequential' (Herald's caches hold rows between steps)")
        if capacity > ps.device_capacity:  # (the rank's server runs 'sequential': its check did not see it)
            raise ValueError(f"worker_cache_rows = {capacity} is more than device_capacity = {ps.device_capacity} "
                             f"(rows a device) with schedule = 'herald': a rank's cache must fit in its table; "
                             f"lower worker_cache_rows or raise device_capacity")
        if capacity < 1:
            raise ValueError(f"worker_cache_rows must be >= 1 with schedule = 'herald', got {capacity}")
        if self._example_bytes < 0:
            raise ValueError(f"example_bytes must be >= 0, got {self._example_bytes}")

    def _new_tier(self, rows: int):
        return _core.DeviceTier(1, rows, self.local._native_opt, threads=self.local.config.device_threads,
                                track_trained=True)

    # ------------------------------------------------------------ state
    def _compactions(self, incoming: int, held: list) -> dict:
        """Leader, before a step is scheduled: the ranks whose tables (as the steps
        scheduled before leave them) lack room for `incoming` rows, each with the
        keys its cache holds (held[r]) and its table's new size (doubled until they
        fit at half load)."""
        out = {}
        for r, table in enumerate(self._tables):
            present, rows = table
            if not needs_rebuild(present, incoming, rows):
                continue
            keys = held[r]
            if len(keys) + incoming > self.device_capacity:
                raise ValueError(f"a step may fetch {incoming} rows onto rank {r}, whose cache holds {len(keys)} "
                                 f"(worker_cache_rows = {self.capacity}), more than [ps] device_capacity = "
                                 f"{self.device_capacity} together; raise device_capacity or lower "
                                 f"worker_cache_rows")
            rows = min(rebuilt_table_rows(rows, len(keys), incoming), self.device_capacity)
            table[:] = [len(keys), rows]
            out[r] = (keys, rows)
        return out

    def _compact(self, keys: np.ndarray, table_rows: int) -> None:
        """Drops the table's stale rows (keeps `keys`, the ones this rank's cache
        holds), in a table of `table_rows` rows."""
        rows = self._tier.rows(keys, None, self._row_floats)
        trained = self._tier.trained(keys, None)  # the rows keep their bits
        if table_rows != self._table_rows:
            self._tier = self._new_tier(table_rows)
            self._table_rows = table_rows
            self._gradient_slots[:] = table_rows
        else:
            self._tier.clear()
        if len(keys):
            self._tier.insert(keys, rows, None, self._row_floats)
            self._tier.set_trained(keys[trained], None, True)
        self._present = len(keys)
        self.counts["compactions"] += 1

    def _to_owners(self, keys: np.ndarray, rows: np.ndarray, what: str) -> int:
        """Sends rows to their owners (collective), which keep them as the newest
        copies (MEM-PS's keep_updated: dirty where it holds the key, else to
        SSD-PS; no pin, so no room needed beside the batches in flight: see
        hps.worker_caches.WorkerCaches._to_mem); returns how many this rank wrote."""
        W = self.node.size
        owners = owner_ranks(keys, W)
        order = np.argsort(owners, kind="stable")
        cuts = np.cumsum(np.bincount(owners, minlength=W))[:-1]
        keys_in = self.node.alltoallv("train", np.split(keys[order], cuts), "sparse_keys", f"{what} keys")
        rows_in = self.node.alltoallv("train", np.split(rows[order], cuts), "sparse_rows", f"{what} rows")
        k = np.concatenate(keys_in)
        try:
            if len(k):
                self.local._cache.keep_updated(k, np.ascontiguousarray(np.concatenate(rows_in)))
        except Exception as e:
            # (its sink's write: SSD-PS's; it cannot raise CacheFullError) On this rank
            # alone, after the exchange: the ranks that sent the rows count them
            # written, and no later flush writes them again, so this server stops. Its
            # stop is told in its next exchange on the train communicator (a step's
            # plan, a flush: HeraldDistBatch._start, _flush_then), where the peers'
            # servers stop too.
            self.fail(f"{type(e).__name__} while the rows sent to their owner were kept: {e}")
            raise
        return len(k)

    def _from_leader(self, stage: str, blocks, kind: str, what: str, empty: np.ndarray) -> np.ndarray:
        """The leader's blocks[r] to each rank r (collective); returns this rank's."""
        got = self.node.alltoallv(stage, blocks if self.leader else [empty] * self.node.size, kind, what)
        return got[LEADER]

    def flush(self) -> None:
        """The cached rows trained since they were last written to their owners'
        MEM-PS, there, one copy a key, from the lowest rank whose cache holds it
        (collective; the caches keep the rows). Each rank sends the leader the
        keys of its rows whose trained bit is set; the leader keeps those its
        snapshot (as the last step applied left it) has on the rank."""
        with self._lock:
            self.check()
            if not self._dirty:
                return
            trained, _ = self._tier.take_trained()
            try:
                empty = np.empty(0, np.uint64)
                # (keys, as a flush's own to the owners: only the leader sends plan bytes)
                got = self.node.alltoallv("train", [trained if r == LEADER else empty for r in range(self.node.size)],
                                          "sparse_keys", "flush trained keys")
                blocks = []
                if self.leader:
                    with self._scheduling:  # the caches as the last step applied left them
                        held = self._as_applied(self.herald.cached_by_worker)
                    ranks = np.repeat(np.arange(self.node.size, dtype=np.int32), [len(k) for k in got])
                    keys, ranks = live_trained(np.concatenate(got), ranks, held)
                    blocks = [keys[ranks == r] for r in range(self.node.size)]
                mine = self._from_leader("train", blocks, "plan", "flush keys", empty)
                rows = self._tier.rows(mine, None, self._row_floats)
                self._to_owners(mine, rows, "flush")
            except BaseException as e:
                # Not written (the job fails: see fail()); the flush's error stands.
                release_after(e, lambda: self._tier.set_trained(trained, None, True))
                raise
            self._dirty = False
            self.counts["flushes"] += 1
            self.counts["flushed_rows"] += len(mine)

    # ------------------------------------------------------------ the collective API
    def pull(self, keys: np.ndarray) -> np.ndarray:
        self._flush_then("pull keys")
        return super().pull(keys)

    def push(self, keys: np.ndarray, grads: np.ndarray, *, step: bool = True) -> None:
        """As DistributedServer.push; the caches are written to the owners first,
        and emptied once the keys and gradients have crossed (the step goes to the
        owners' rows; a push refused before that leaves them as they were)."""
        with self._lock:
            self._flush_then("push keys")
        super().push(keys, grads, step=step)  # (its checks and _check_push, on every rank together)

    def _flush_then(self, then: str) -> None:
        """flush(), in a call that goes on into exchange `then` on the train
        communicator. A flush that fails on this rank alone (its server stopped,
        perhaps on this rank alone; its keep of the rows sent to it as an owner,
        after the flush's last exchange) is told to the peers in their next
        exchange there: the flush's own, where it was not dirty, or `then`
        (Node.give_up). Raised alone, it left them waiting in it until the
        watchdog's timeout."""
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            if raised_on_every_rank(e):
                raise
            self.node.give_up("train", then, e)

    def _check_push(self) -> None:
        if self._made != self._applied:
            raise RuntimeError(f"push with {self._made - self._applied} Herald steps made and not applied")

    def _push_exchanged(self) -> None:
        # Emptied once the push's keys and gradients have crossed (a push refused
        # before changes no row: the caches stay), before any owner steps a row.
        with self._lock:
            if self.leader:
                self.herald.clear()
                for table in self._tables:
                    table[0] = 0
            self._tier.clear()
            self._present = 0
            self._cached = 0

    def prefetch(self, keys: np.ndarray, upcoming=None) -> HeraldPrefetched:
        """This rank's example keys to the leader, its distinct keys to their
        owners; this rank pins the keys it was sent. Keys or a window this rank
        refuses are refused on every rank, before either is sent (Node.give_up).
        A pin that fails after the exchanges is the step's failure, told in its
        first exchange (as DistributedServer.prefetch's: the peers' steps wait
        there); a CacheFullError not tried again, by the next prefetch."""
        if self._retry is not None and self._retry[0] is keys:
            exchange = self._retry[1]  # the exchange of a prefetch that found MEM-PS full: only pin again
        else:
            self._give_up_retry()
            exchange = self._exchange(keys, upcoming)
        self._retry = None
        parts, mine, window = exchange
        failed = None
        try:
            # MEM-PS's window with the pins, after the exchanges: a window past its room
            # raises CacheFullError as a pin does, tried again by the retry alone.
            if upcoming is not None:
                self._owner_windows.apply(self.local._cache)
            self.local._cache.pin(mine)
        except CacheFullError as e:
            self._retry = (keys, exchange, e)
            raise
        except Exception as e:  # noqa: BLE001 - raised by the step, on every rank (HeraldDistBatch._start)
            mine, failed = np.empty(0, np.uint64), e  # (a pin that raises holds none)
        pre = HeraldPrefetched(mine, self.local._cache)
        pre.failed = failed
        if self.leader:
            pre.examples = np.concatenate(parts)
            pre.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
            pre.uniq, pre.inverse = _core.unique_keys(pre.examples.reshape(-1))
            pre.upcoming = window
        return pre

    def _exchange(self, keys: np.ndarray, upcoming) -> tuple:
        """The prefetch's collectives: (every rank's example keys on the leader,
        else None; the keys this rank owns, sorted; the job's window on the leader).
        This rank's keys and window are checked before the first, and a refusal
        told there: one refused after the window was sent (a reserved key) left
        the peers waiting in the next exchange."""
        W = self.node.size
        try:
            if not isinstance(keys, np.ndarray) or keys.ndim != 2 or keys.dtype not in (np.uint64, np.int64):
                raise ValueError(f"schedule = 'herald' takes (n_examples, fields) uint64 keys, got "
                                 f"{getattr(keys, 'dtype', type(keys).__name__)} {getattr(keys, 'shape', '')}")
            windows = None if upcoming is None else self._window_blocks(upcoming)
            # A rank's distinct keys (8 bytes each) and where each example's are among
            # them (2 bytes a key while a rank has at most 65,536 distinct keys, else 4):
            # about a third of the bytes of the keys themselves.
            flat = np.ascontiguousarray(keys).view(np.uint64)
            uniq, inverse = _core.unique_keys(flat.reshape(-1))  # (names a reserved key)
            where = inverse.astype(np.uint16 if len(uniq) <= 1 << 16 else np.uint32)
            sent = _pack([np.array([flat.shape[1], where.itemsize], np.int64), uniq, where])
            to_owners = self._keys_to_owners(uniq, "herald keys to their owners")
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            self._window_sender.forget()
            self.node.give_up("prefetch", "herald example keys" if upcoming is None else "lookahead keys", e)
        try:
            window = self._send_window(upcoming, windows, then="herald example keys") if upcoming is not None \
                else None
            got = self.node.alltoallv("prefetch", [sent if r == LEADER else sent[:0] for r in range(W)],
                                      "sparse_keys", "herald example keys")
            parts, failed = None, None
            if self.leader:
                try:
                    parts = [_example_keys(buf, r) for r, buf in enumerate(got)]
                    if len({p.shape[1] for p in parts}) > 1:  # (the global batch is one array of examples)
                        raise ValueError("herald example keys: the ranks' examples have other numbers of fields: "
                                         + ", ".join(f"rank {r}'s {p.shape[1]}" for r, p in enumerate(parts)))
                except Exception as e:  # noqa: BLE001 - told to the peers (the leader alone found it), then raised
                    failed = e
            what = "herald keys to their owners"
            if failed is not None:
                self.node.give_up("prefetch", what, failed)
            asked = self.node.alltoallv("prefetch", to_owners[3], "sparse_keys", what)
        except BaseException:
            self._window_sender.forget()  # (the owners may not have had the window)
            raise
        return parts, np.unique(np.concatenate(asked)), window

    def _tell_abandoned(self, error: Exception) -> None:
        # The peers' steps wait for the leader's plan, and fail there: each stops its
        # server (StopsAfterAFailedStep), and so does this rank.
        self.fail(f"{type(error).__name__} in a prefetch not tried again: {error}")
        self.node.give_up("train", "herald plan parts", error)

    def _window_blocks(self, upcoming) -> list:
        # (the leader gets every rank's whole batches: the scheduler's window)
        return self._window_sender.blocks(upcoming, self.node.size, whole=LEADER)

    def _send_window(self, upcoming, blocks=None, then=None):
        """Every rank's window to the leader, whose scheduler keeps the job's window
        last, and to the owners, whose MEM-PS keeps the keys they own in the order
        the job needs them (collective, prefetch stage; OwnerWindows: only the
        batches that changed travel; prefetch gives them to MEM-PS); returns the
        job's window (sorted: the scheduler takes it as a set) on the leader, else
        None. `then`: as DistributedServer._send_window's."""
        super()._send_window(upcoming, blocks, then)
        return self._owner_windows.keys() if self.leader else None

    def _make_owner_windows(self) -> OwnerWindows:
        # The leader is sent every rank's whole batches (the scheduler's window): its
        # MEM-PS keeps those it owns. (Called by DistributedServer.__init__, before
        # self.leader is set.)
        W, me = self.node.size, self.node.rank
        return OwnerWindows(W, (lambda keys: owner_ranks(keys, W) == me) if me == LEADER else None)

    def _schedule(self, pre: HeraldPrefetched) -> tuple:
        """Numbers a step as it is made; the leader schedules it and keeps the
        caches' keys before it. Returns (number, the plan parts or None, the
        leader's scheduling error or None). That error is the step's, raised in
        its first exchange (HeraldDistBatch._start), where the other ranks' steps
        wait for the leader's plan: raised here, on the leader alone, it left them
        waiting until the watchdog's timeout. Every later step the leader makes
        carries it too: its snapshot may hold part of the failed one.

        A stopped server schedules nothing, and its step's start raises its stop
        there too (_begin), where the peers' steps wait: a server stops on one
        rank alone where it failed after a step's or flush's last exchange (an
        owner's keep of the rows sent to it), and its step, refused here, left
        them waiting for its plan until the watchdog's timeout."""
        with self._scheduling:
            parts = held = failure = None
            if self.leader and self._failed is None:
                failure = self._schedule_failure
                try:
                    if failure is None:
                        held = self.herald.cached_by_worker()
                        parts = self._plan_parts(pre, held) if self._refusal is None else None
                except Exception as e:  # noqa: BLE001 - the step's failure, on every rank
                    held, failure = None, e
                    self._schedule_failure = e
                if parts is None and failure is None:
                    parts = [_pack([np.frombuffer(self._refusal.encode(), np.uint8)] +
                                   [np.empty(0, t) for t in _PART[1:]])] * self.node.size
            return self._made_one(held), parts, failure

    def _plan_parts(self, pre: HeraldPrefetched, held: list) -> list:
        """Leader: schedules the step and cuts the plan into each rank's part (_PART);
        held: the caches' keys before it."""
        W = self.node.size
        uniq, inverse, examples = pre.uniq, pre.inverse, pre.examples
        fields = examples.shape[1]
        try:
            compact = self._compactions(most_fetched(len(examples), fields, W, len(uniq)), held)
        except ValueError as e:
            # Raised here, on the leader alone, it ended the job (MPI_Abort) with the
            # other ranks saying nothing of it: the step's plan parts carry it to every
            # rank, which raises it in the step's partition (_start).
            self._refusal = str(e)
            return None
        origin = np.repeat(np.arange(W, dtype=np.int32), np.diff(pre.starts))  # the rank that read each example
        plan = self.herald.schedule(examples, upcoming=pre.upcoming, origin=origin)
        fetches = np.diff(plan.fetch_offsets).astype(np.int64)
        for table, n in zip(self._tables, fetches):
            table[0] += int(n)
        trains = np.zeros((len(uniq), W), bool)
        trains[inverse, np.repeat(plan.assignment, fields)] = True
        bits = np.packbits(trains, axis=1, bitorder="little")
        # Each fetch: its key's place in uniq, its destination and the rank that serves it.
        fk, src = plan.fetch_keys, plan.fetch_from
        by_key = np.argsort(uniq)
        at = by_key[np.searchsorted(uniq, fk, sorter=by_key)]
        fdest = np.repeat(np.arange(W), fetches)
        server = np.where(src >= 0, src, owner_ranks(fk, W))
        source = np.full((len(uniq), W), _HELD, np.uint8)
        source[at, fdest] = np.where(src >= 0, server, _OWNER + server)
        serve_order = np.lexsort((fk, fdest, server))  # by server, then destination, then key
        serve_cuts = np.searchsorted(server[serve_order], np.arange(W + 1))
        trains_by_key = trains[by_key]
        parts = []
        for r in range(W):
            trained = by_key[trains_by_key[:, r]]  # the keys rank r trains, ascending
            served = serve_order[serve_cuts[r]:serve_cuts[r + 1]]
            compact_keys, table_rows = compact.get(r, (np.empty(0, np.uint64), 0))
            counts = np.array([plan.pulls, plan.peer_pulls, plan.shared, plan.distinct,
                               self.herald.cached_count(r), table_rows], np.int64)
            parts.append(_pack([np.empty(0, np.uint8), counts,
                                plan.assignment[pre.starts[r]:pre.starts[r + 1]].astype(np.uint8),
                                bits[trained], source[trained, r], fk[served],
                                np.bincount(fdest[served], minlength=W).astype(np.int64), src[served] >= 0,
                                plan.lost_keys[plan.lost_from == r], compact_keys]))
        return parts

    def batch(self, pre: HeraldPrefetched, overlap: bool = False) -> "HeraldDistBatch":
        return HeraldDistBatch(self, pre)

    def checkpoint(self, save=None, *, keep_previous: bool = False) -> int:
        self.flush()
        return super().checkpoint(save, keep_previous=keep_previous)

    def fresh_rows_sent(self) -> int:
        return super().fresh_rows_sent() + self.fetched_rows.fresh

    def stats(self) -> dict:
        s = super().stats()
        with self._lock, self._scheduling:
            s["herald"] = {**self.counts, "cached": self._cached, "capacity": self.capacity,
                           "table_rows": self._table_rows, "leader": LEADER, "example_cost": self.example_cost,
                           "fresh_rows_served_as_bits": self.fetched_rows.fresh,
                           "scheduler_bytes": self.herald.memory_bytes if self.leader else 0}
        return s


class HeraldDistBatch(BatchBase):
    """One step on every rank (the WorkingBatch protocol): ``partition()`` gets
    this rank's part of the leader's plan, moves the examples and the rows; pull
    and push on this rank's cache; apply() sums shared keys' gradients on their
    primaries."""

    def __init__(self, server: HeraldServer, pre: HeraldPrefetched):
        self.server = server
        self.pre = pre
        self.keys = pre.pinned
        self.wait_seconds = 0.0
        self.exchanged = None  # the examples this rank trains (hps.pipeline takes them as the batch's data)
        self._data = None
        self._lost = None  # the keys this rank's evictions lost, from its plan part
        self._started = False  # partition() began the step's exchanges
        self._minibatches = None  # set: partitioned
        self._number = None  # set: scheduled (the leader's snapshot has taken this step)
        self._applied = False
        self._done = False
        # Its pins' failure or the leader's schedule's: raised by the step's start,
        # in its first exchange, on every rank (the others' steps wait there).
        self._failure = pre.failed
        try:
            self._number, self._parts, failure = server._schedule(pre)
            if failure is not None:
                self._failure = failure
        except BaseException as e:
            self._done = True
            release_after(e, pre.release)  # the schedule's error stands, and stops the server below
            if server._failed is None:  # the leader's tables may have taken the step
                server.fail(f"{type(e).__name__} while a step was scheduled: {e}")
            raise

    def bind(self, data) -> None:
        """The rank's own examples of this step (its reader's batch): partition()
        sends them where the schedule puts them."""
        self._data = data

    # ------------------------------------------------------------ partition
    def partition(self) -> list:
        if not self._started:
            self._started = True
            # Whatever fails in the step fails the server (StopsAfterAFailedStep), on
            # every rank: each rank's failure before an exchange is told there
            # (Node.give_up), and every rank raises.
            with self.server.step(check=False):
                self._start()
        elif self._minibatches is None:
            # Its start failed, on every rank: raised again as the stopped server's,
            # with no exchange (the peers, past the step, are in none of it).
            self.server.check()
            raise RuntimeError("a Herald step whose start failed was started again")
        return self._minibatches

    def _start(self) -> None:
        s, node = self.server, self.server.node
        W, me = node.size, node.rank
        blocks, self._parts = self._parts, None
        try:
            s._begin(self._number)  # (this rank's server stopped, or its steps out of order)
            if self._failure is not None:  # (its pins, or the leader's schedule)
                raise self._failure
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            node.give_up("train", "herald plan parts", e)
        part = _unpack(s._from_leader("train", blocks, "plan", "herald plan parts", np.empty(0, np.uint8)), _PART)
        refusal, counts, dest, bits, source, served, serve_counts, from_peer, self._lost, held = part
        if len(refusal):
            raise ValueError(refusal.tobytes().decode())
        try:
            got = dict(zip(_COUNTS, counts.tolist()))
            if got["table_rows"]:
                s._compact(held, got["table_rows"])
            s._cached = got["cached"]

            # The examples to the ranks the schedule gives them (each rank's in its order).
            data = self._data
            if data is None:
                raise RuntimeError(f"rank {me}'s Herald step was given no examples (bind them before partition)")
            if len(dest) != len(data.labels):
                raise RuntimeError(f"the Herald plan places {len(dest)} examples of rank {me}, which has "
                                   f"{len(data.labels)} this step")
            order = np.argsort(dest, kind="stable")
            cuts = np.cumsum(np.bincount(dest, minlength=W))[:-1]
            dense = np.ascontiguousarray(data.dense, np.float32)
            example_keys = np.split(np.ascontiguousarray(data.keys)[order], cuts)
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            node.give_up("train", "herald examples (keys)", e)
        got_keys = node.alltoallv("train", example_keys, "examples", "herald examples (keys)")
        got_dense = node.alltoallv("train", np.split(dense[order], cuts), "examples", "herald examples (dense)")
        got_labels = node.alltoallv("train", np.split(np.ascontiguousarray(data.labels, np.float32)[order], cuts),
                                    "examples", "herald examples (labels)")
        try:
            from hps.data import Batch
            mine = Batch(np.concatenate(got_labels), np.concatenate(got_dense), np.concatenate(got_keys))
            total = getattr(data, "total_examples", len(data.labels))
            self.exchanged = _StepData(mine, total)
            self._minibatches = [np.arange(len(mine.labels))]
            s.counts["examples_sent"] += int((dest != me).sum())
            s.counts["examples_kept"] += int((dest == me).sum())

            # The keys this rank trains (ascending, as the plan part lists them), their
            # trainers, and their primaries (the trainer the key's hash picks, which sums
            # its gradients: hps.worker_caches.primaries).
            self._flat = np.ascontiguousarray(mine.keys).view(np.uint64).reshape(-1)
            self._mine, self._inverse = np.unique(self._flat, return_inverse=True)
            self._inverse = self._inverse.reshape(-1)
            if len(self._mine) != len(source):
                raise RuntimeError(f"the Herald plan gives rank {me} {len(source)} keys to train; its examples "
                                   f"have {len(self._mine)}")
            self._trains = np.unpackbits(bits.reshape(len(source), (W + 7) // 8), axis=1, count=W,
                                         bitorder="little").astype(bool)  # (keys, W); a rank may train none
            self._primary = primaries(self._mine, self._trains)
            self._grads = np.zeros((len(self._mine), s._tier.dim), np.float32)
            size_gradients(s._tier, s._gradient_slots, [len(self._mine)], s._table_rows)

            # Rows: each rank serves, in the order each destination lists them, the
            # fetches the plan gives it, from its cache or from its MEM-PS (owner).
            rows_out = np.empty((len(served), s._row_floats), np.float32)
            if from_peer.any():
                rows_out[from_peer] = s._tier.rows(served[from_peer], None, s._row_floats)
            if (~from_peer).any():
                rows_out[~from_peer] = s.local._cache.read_pinned(served[~from_peer]).view(np.float32)
            cuts = np.cumsum(serve_counts)[:-1]
            rows_blocks = s.fetched_rows.pack(np.split(served, cuts), np.split(rows_out, cuts), me)
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            node.give_up("train", "herald fetched rows", e)
        sent = node.alltoallv("train", rows_blocks, "sparse_rows", "herald fetched rows")
        try:
            want = np.flatnonzero(source != _HELD)  # my fetches, ascending by key
            peer, server = source[want] < _OWNER, source[want] % _OWNER
            asked = [self._mine[want][server == r] for r in range(W)]  # rank r served mine ascending by key
            rows_in = s.fetched_rows.unpack(asked, sent)
            fetched = np.empty((len(want), s._row_floats), np.float32)
            for r in range(W):
                fetched[server == r] = rows_in[r]
            s.counts["rows_served"] += len(served)
            if len(want):
                k = self._mine[want]
                s._tier.assign(k, fetched, None, s._row_floats)  # a stale copy is overwritten (its bit cleared)
                s._tier.insert(k, fetched, None, s._row_floats)
                # A peer's row may be newer than its owner's MEM-PS copy; its bit did not
                # travel with it. Marked trained: this rank steps every key it fetched
                # this step anyway, and a flush before that reads the source's copy.
                s._tier.set_trained(k[peer], None, True)
                s._present += len(want)
                s.counts["ps_loads"] += int((~peer).sum())
                s.counts["peer_fetches"] += int(peer.sum())
            # By position from here: the rows are read (into a model input's columns
            # where the tier reads in place) and stepped with no key looked up again.
            s._tier.bind(self._mine, None)
        except Exception as e:  # noqa: BLE001 - owed to the peers, then raised
            # On this rank alone (rows another hps sent it; its table's), after the
            # partition's last exchange: the peers' steps go on to their apply and
            # wait in its first exchange, which this rank's will not make. Its next
            # collective tells them there (Node.owe_waiting): every server stops.
            node.owe_waiting("train", "herald shared gradients", e)
            raise
        self.gathers_into_columns = s._tier.reads_in_place
        s.counts["batches"] += 1
        for name in ("plan_pulls", "plan_peer_pulls", "plan_shared", "distinct"):
            s.counts[name] += got[name]

    # ------------------------------------------------------------ the WorkingBatch protocol
    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Where each of keys is among the keys this rank trains this step
        (KeyError names one it does not train)."""
        self.partition()
        return rank_positions(keys, self._mine, self._flat, self._inverse, "is not trained on this rank this step")

    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        return self.gather(self.positions(keys), worker=worker)

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Gradients of this rank's keys, summed here until apply()."""
        self.accumulate(self.positions(keys), grads, worker=worker)

    def gather(self, positions: np.ndarray, out=None, worker: int = 0) -> np.ndarray:
        """Embeddings (n, dim) of the keys at positions, from this rank's cache;
        into `out` if given: (n, dim), or where the tier reads in place
        (gathers_into_columns) also (B, k * dim) with B * k = n, which may be the
        first columns of a wider matrix."""
        self.partition()
        with self.server._lock:
            return self.server._tier.get_at(0, np.asarray(positions, np.int64), out)

    def accumulate(self, positions: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Gradients (laid out as gather's `out`) of the keys at positions,
        summed here until apply() (where shared keys' sums cross ranks)."""
        self.partition()
        positions = np.asarray(positions, np.int64)
        if len(positions) == 0:
            # (a rank the partition gave no example of a key): nothing to add, and no
            # width to infer, which numpy refuses for (0, -1)
            return
        grads = np.ascontiguousarray(grads, np.float32).reshape(len(positions), -1)
        self._grads += _core.sum_by_inverse(positions, grads, len(self._mine))

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
            s._finished(self._number)
        self._applied = True

    def _apply(self, s, node, W, me) -> None:
        # Every rank knows who trains each of its keys, so the blocks carry no keys:
        # rank r sends primary p the gradients of the keys both train that p
        # steps, ascending, and gets their sums back in the same order. Each
        # trainer then takes the same step on its copy (row and optimizer state
        # alike, from the same sum): the primary need not ship the stepped rows,
        # twice the floats of a gradient with AdaGrad's or Adam's state.
        # Refused before the first exchange, as the sequential job's push: a NaN
        # would reach the primary's sum and so every trainer's copy of the key. Told
        # in the exchange: every rank raises, this one its error, the others
        # RankFailure naming it (they waited in it for a rank that had left).
        primary = self._primary
        try:
            refuse_nonfinite(self._grads, self._mine, "herald shared gradients")
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            node.give_up("train", "herald shared gradients", e)
        blocks = [self._grads[primary == p] if p != me else self._grads[:0] for p in range(W)]
        grads_in = node.alltoallv("train", blocks, "sparse_grads", "herald shared gradients")
        mine = primary == me
        trainers = self._trains[mine]
        # Summed in rank order, the lowest trainer's first, whichever rank sums
        # (so the floats are the same wherever the primary is).
        lowest = trainers.argmax(axis=1)
        total = np.empty((len(trainers), self._grads.shape[1]), np.float32)
        for r in range(W):
            part = self._grads[mine] if r == me else grads_in[r]
            if not len(part):
                continue
            at = np.flatnonzero(trainers[:, r])
            first = lowest[at] == r
            total[at[first]] = part[first]
            # Finite gradients can overflow in their sum: every trainer's step
            # refuses that key's infinity (DivergedError, naming it) before any row
            # changes, so numpy's warning would only say it first.
            with np.errstate(over="ignore"):
                total[at[~first]] += part[~first]
        out = [total[trainers[:, r]] if r != me else total[:0] for r in range(W)]
        sums_in = node.alltoallv("train", out, "sparse_grads", "herald summed gradients")
        self._grads[mine] = total
        for r in range(W):
            if r != me and len(sums_in[r]):
                self._grads[primary == r] = sums_in[r]
                s.counts["replica_copies"] += len(sums_in[r])
        try:
            # A sum that overflowed is refused by its trainers alone (DivergedError):
            # told in the evicted rows' exchange, which the others wait in.
            if len(self._mine):
                s._tier.accumulate_at(0, np.arange(len(self._mine)), self._grads)
                s._tier.apply()
            s.counts["primary_steps"] += int(mine.sum())
            # Rows no cache holds any more: from the rank that dropped the last copy to the owner.
            # The trained ones only: an untrained row equals its owner's copy.
            lost = self._lost
            dirty = s._tier.trained(lost, None) if len(lost) else np.empty(0, bool)
            s.counts["evict_clean_dropped"] += int((~dirty).sum())
            lost = lost[dirty]
            rows = s._tier.rows(lost, None, s._row_floats) if len(lost) else np.empty((0, s._row_floats), np.float32)
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            node.give_up("train", "herald evicted keys", e)
        s._to_owners(lost, rows, "herald evicted")
        s._tier.set_trained(lost, None, False)  # written
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
        if not self._applied and self._number is not None:
            self.server.fail("a step was aborted after it was scheduled")
            self.server._finished(self._number)
        self._done = True
        self.pre.release()
