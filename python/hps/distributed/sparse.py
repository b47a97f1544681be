"""The job's sparse parameters sharded over the ranks: key ownership, and the
bulk-synchronous exchange of keys, rows and gradients of each working set
(:class:`DistributedServer`, :class:`DistBatch`), with hps.ParameterServer's interface.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import numpy as np

from hps import _core
from hps.data.keys import mix64
from hps.distributed.comm import Node, RankFailure, mark_raised_on_every_rank
from hps.errors import DivergedError
from hps.hash_table import EMPTY_KEY
from hps.mem_cache import CacheFullError
from hps.batch_base import prefetched_positions, release_after
from hps.parameter_server import ParameterServer

class RowCodec:
    """A codec for rows crossing between ranks (``[distributed] sparse_rows`` and
    ``sparse_grads``; hps.hierarchical.codecs): each (n, width) float32 block packs
    into (n, bytes a row) uint8, so one alltoallv carries it: bf16 2 bytes a value,
    int8 1 byte a value and a float32 scale a row; "none" sends float32 as is.
    ``counts``: bytes before (float32) and after, of the blocks sent to other ranks."""

    def __init__(self, spec: str, width: int):
        from hps.hierarchical.codecs import make_codec
        self.spec, self.width = spec, width
        self.codec = make_codec(spec)
        self.before = self.after = 0

    def pack(self, blocks: list, me: int) -> list:
        if self.spec == "none":
            sent = sum(b.nbytes for r, b in enumerate(blocks) if r != me)
            self.before += sent
            self.after += sent
            return blocks
        out = []
        # The block a rank keeps (r == me) goes through the codec too: every row
        # and gradient is rounded the same whichever rank owns its key, so the
        # result does not depend on the sharding (the tests compare it with one
        # server fed the rounded traffic). It costs 1/W of the encoding.
        for r, b in enumerate(blocks):
            b = np.ascontiguousarray(b, np.float32).reshape(-1, self.width)
            arrays = self.codec.encode(b).arrays
            packed = np.concatenate([a.reshape(len(b), -1).view(np.uint8) for a in arrays], axis=1) \
                if len(b) else np.empty((0, self.row_bytes), np.uint8)
            if r != me:
                self.before += b.nbytes
                self.after += packed.nbytes
            out.append(packed)
        return out

    @property
    def row_bytes(self) -> int:
        return {"bf16": 2 * self.width, "int8": self.width + 4}.get(self.spec, 4 * self.width)

    def roundtrip(self, rows: np.ndarray) -> np.ndarray:
        """rows (n, width) as they arrive after crossing through the codec."""
        if self.spec == "none":
            return rows
        return self.codec.decode(self.codec.encode(np.ascontiguousarray(rows, np.float32)))

    def unpack(self, blocks: list) -> list:
        if self.spec == "none":
            return blocks
        from hps.hierarchical.codecs import Encoded
        out = []
        for b in blocks:
            n, w = len(b), self.width
            if self.spec == "bf16":
                arrays = (np.ascontiguousarray(b).view(np.uint16).reshape(n, w),)
            else:
                arrays = (np.ascontiguousarray(b[:, :w]).view(np.int8), np.ascontiguousarray(b[:, w:]).view(np.float32)
                          .reshape(n))
            out.append(self.codec.decode(Encoded(self.spec, (n, w), arrays)))
        return out


class FreshRows:
    """Rows still as their keys' first use made them cross between ranks as a bit.

    A new row's values are a function of its key and the table's seed alone (the
    initializer, and the optimizer's starting state: SparseOptimizer.initial_rows),
    so the rank that asked for a row can make it itself. The sender marks each row
    whose bits equal its key's initial row (one never trained: every key's first
    pull, which in click logs is most keys', their tails being long) and sends only
    the others; the receiver, which knows the keys it asked for, makes the marked
    ones. A block is bytes: a bit a row (ceil(n / 8) bytes, little-endian bit
    order), then the other rows, through the codec where there is one. What arrives
    is bit for bit what whole rows would give (through a lossy codec too: a made
    row goes through it as a sent one would). ``fresh``: rows sent to other ranks
    as a bit."""

    def __init__(self, optimizer, width: int, codec: Optional[RowCodec] = None):
        self.optimizer = optimizer  # hps._core.SparseOptimizer (initial_rows, initial_embeddings)
        self.width = width          # floats a row carries: the embedding, or the whole row with its state
        self.codec = codec
        self.fresh = 0

    def initial(self, keys: np.ndarray) -> np.ndarray:
        """The first `width` floats of keys' initial rows."""
        keys = np.ascontiguousarray(keys, np.uint64)
        if self.width == self.optimizer.dim:
            # The sequential job's pulls carry embeddings only: the owner, for each
            # block, and the asker, for the rows it makes, would otherwise make the
            # optimizer state of every row and drop it.
            return self.optimizer.initial_embeddings(keys)
        return self.optimizer.initial_rows(keys)[:, :self.width]

    def pack(self, keys: list, rows: list, me: int) -> list:
        """The byte blocks that send rows[r] (n, width) of keys[r] to rank r."""
        marks = []
        for r, (k, b) in enumerate(zip(keys, rows)):
            b = np.ascontiguousarray(b, np.float32).reshape(len(k), self.width)
            mark = np.all(b.view(np.uint32) == self.initial(k).view(np.uint32), axis=1)
            if r != me:
                self.fresh += int(mark.sum())
            marks.append((mark, b[~mark]))
        kept = [b for _, b in marks]
        if self.codec is not None:
            kept = self.codec.pack(kept, me)
        return [np.concatenate([np.packbits(mark, bitorder="little"), np.ascontiguousarray(b).view(np.uint8).reshape(-1)])
                for (mark, _), b in zip(marks, kept)]

    def unpack(self, keys: list, blocks: list) -> list:
        """The rows (n, width) float32 of keys[r] from what rank r sent (pack's).
        RuntimeError, naming the rank, for a block that does not match the keys."""
        out = []
        for r, (k, buf) in enumerate(zip(keys, blocks)):
            n = len(k)
            head = (n + 7) // 8
            if len(buf) < head:
                raise RuntimeError(f"rank {r}'s rows: a block of {len(buf)} bytes cannot mark {n} rows (does that "
                                   f"rank run another hps?)")
            mark = np.unpackbits(buf[:head], count=n, bitorder="little").astype(bool)
            sent = n - int(mark.sum())
            body = buf[head:].tobytes()  # a copy: the received offset need not be aligned
            row_bytes = 4 * self.width if self.codec is None else self.codec.row_bytes
            if len(body) != sent * row_bytes:
                raise RuntimeError(f"rank {r}'s rows: a block that marks {sent} of {n} rows as sent holds "
                                   f"{len(body)} bytes of rows, not {sent * row_bytes} (does that rank run "
                                   f"another hps?)")
            if self.codec is None or self.codec.spec == "none":
                got = np.frombuffer(body, np.float32).reshape(sent, self.width)
            else:
                got = self.codec.unpack([np.frombuffer(body, np.uint8).reshape(sent, row_bytes)])[0]
            made = self.initial(k[mark])
            if self.codec is not None:
                made = self.codec.roundtrip(made)
            rows = np.empty((n, self.width), np.float32)
            rows[mark] = made
            rows[~mark] = got
            out.append(rows)
        return out


def refuse_nonfinite(grads: np.ndarray, keys: np.ndarray, what: str, codec: str = "none") -> float:
    """Raises DivergedError where the gradients (n, dim) of keys (n,) hold a NaN or
    an infinity, naming `what` (the traffic), how many values and keys, and the
    first key. Checked before the gradients leave the rank, whatever codec carries
    them: int8 cannot encode one, and bf16 or none would carry it into the owners'
    rows, which every later step and checkpoint would then hold as NaN. `codec`
    ([distributed] sparse_grads): under "bf16" a finite value past
    BFloat16.largest_finite_input is refused too, since the codec rounds it to an
    infinity, which the owner would step its row with.

    Returns the largest |gradient| (0.0 for none), for sum_bound: the check is
    the gradients' largest and smallest value (numpy's max and min propagate a
    NaN), which the bound reads anyway: no np.isfinite pass, with its mask as
    large as the gradients, reads them before; the values and keys are counted
    only for the error."""
    if codec == "bf16":
        from hps.hierarchical.codecs import BFloat16
        largest = BFloat16.largest_finite_input
    else:
        largest = float(np.finfo(np.float32).max)  # (|x| <= it: x is finite)
    top, bottom = (float(grads.max()), float(grads.min())) if grads.size else (0.0, 0.0)
    if top <= largest and -bottom <= largest:  # (False for a NaN)
        return max(top, -bottom)
    # (False for a NaN and an infinity too, under either test)
    ok = np.abs(grads) <= np.float32(largest) if codec == "bf16" else np.isfinite(grads)
    bad_rows = ~ok.all(axis=1)
    first = int(np.flatnonzero(bad_rows)[0])
    values, rows = int(ok.size - np.count_nonzero(ok)), int(bad_rows.sum())
    plural = "s" if values != 1 else ""
    keys_said = f"{rows} key{'s' if rows != 1 else ''} (key {int(keys[first])} first: {grads[first][~ok[first]][0]!s})"
    if np.isfinite(grads[~ok]).any():
        raise DivergedError(f"{what}: {values} value{plural} in the gradients of {keys_said} that bfloat16 rounds "
                            f"to an infinity (past {largest:.7g}) or that {'is' if values == 1 else 'are'} not a "
                            f"number: training diverged ([distributed] sparse_grads = 'bf16' would carry "
                            f"{'it' if values == 1 else 'them'} into the owners' rows)")
    raise DivergedError(f"{what}: {values} non-finite value{plural} in the gradients of {keys_said}: training "
                        f"diverged (no codec of [distributed] sparse_grads carries a value that is not a number to "
                        f"the owners' rows)")


# Finite gradients of a key summed at its owner overflow only past float32's largest
# value. Each rank tells the others in a step's first exchange a bound on its part of
# any key's sum (sum_bound): where the ranks' bounds together stay under a quarter of
# it (any sane step's: the owners' sums in float32 stay under it for fewer than 50
# million rows of one key), no sum can overflow, and the owners step with no check
# between them. Past it, each owner sums and checks its keys before any steps, and
# the ranks agree (DistributedServer._summed).
_SUM_BOUND = float(np.finfo(np.float32).max) / 4


def sum_bound(largest: float, repeats: int) -> int:
    """A rank's bound on its part of any key's sum (its largest |gradient|, as
    refuse_nonfinite returns it, times `repeats`, the most rows it sends of one
    key), as Node.alltoallv's `tell` (the float64's bits)."""
    return int(np.array([largest * repeats], np.float64).view(np.int64)[0])


def may_overflow(heard: np.ndarray) -> bool:
    """Whether the ranks' bounds (sum_bound's, as heard) let a key's sum overflow:
    the same on every rank (the same floats, summed in rank order)."""
    return float(np.ascontiguousarray(heard, np.int64).view(np.float64).sum()) >= _SUM_BOUND


def refuse_overflow(sums: np.ndarray, keys: np.ndarray, what: str, rank: int) -> None:
    """Raises DivergedError where the owner's sums (n, dim) of every rank's finite
    gradients of keys (n,) overflowed, naming `what`, the owner (`rank`), how many
    values and keys, and the first key."""
    ok = np.isfinite(sums)
    if ok.all():
        return
    bad_rows = ~ok.all(axis=1)
    first = int(np.flatnonzero(bad_rows)[0])
    values, rows = int(ok.size - np.count_nonzero(ok)), int(bad_rows.sum())
    raise DivergedError(f"{what}: {values} value{'s' if values != 1 else ''} of the sums of {rows} "
                        f"key{'s' if rows != 1 else ''} (key {int(keys[first])} first: "
                        f"{sums[first][~ok[first]][0]!s}) at their owner, rank {rank}, overflow float32: training "
                        f"diverged (finite gradients whose sum overflowed); no rank's owner stepped a key")


def key_array(keys, what: str) -> np.ndarray:
    """keys as an array, refused (TypeError naming `what`) unless uint64 or int64 (uint64
    keys bit-cast), as hps.ParameterServer refuses them: a cast to uint64 would make a
    float key 1.7 key 1, and a key of 2**53 + 1 its neighbour, without a word."""
    keys = np.asarray(keys)
    if keys.dtype not in (np.uint64, np.int64) and keys.size:
        raise TypeError(f"{what} must be an array of uint64 or int64 keys, got {keys.dtype}")
    return keys


def owner_ranks(keys: np.ndarray, world: int) -> np.ndarray:
    """The rank that owns each key (int64)."""
    return ((mix64(keys) >> np.uint64(32)) % np.uint64(world)).astype(np.int64)


def rank_positions(keys, uniq: np.ndarray, flat: np.ndarray, inverse: np.ndarray, absent: str) -> np.ndarray:
    """Where each of keys is among a rank batch's distinct keys `uniq` (sorted),
    which np.unique found for the batch's keys `flat` (`inverse`): taken from
    there for those keys or a run of them (a worker's examples), else searched
    for (2 ms for a rank's 26k keys, twice a batch, where it was the only way).
    KeyError "key K <absent>" for the first key not among them."""
    keys = key_array(keys, "keys").reshape(-1)
    known = prefetched_positions(keys, flat, inverse)
    if known is not None:
        return known
    keys = keys.astype(np.uint64, copy=False)
    pos = np.minimum(np.searchsorted(uniq, keys), max(len(uniq) - 1, 0))
    if len(keys) and (len(uniq) == 0 or (uniq[pos] != keys).any()):
        missing = keys[(uniq[pos] != keys) if len(uniq) else slice(None)]
        raise KeyError(f"key {int(missing[0])} {absent}")
    return pos


WINDOW_SET, WINDOW_SLIDE = 0, 1  # a lookahead message's kind: the rank's window anew, or moved on a batch


def pack_window(kind: int, batches: list) -> np.ndarray:
    """A lookahead message (uint64): its kind, the number of batches n it carries,
    each one's count of keys, then the keys batch by batch (uint64 each: a key
    concatenated with int64 counts would be cast to float64). WINDOW_SET: every
    batch of the rank's window; WINDOW_SLIDE: its first batch left, and the batch
    that enters (n = 1, or n = 0 at the end of the data)."""
    head = np.array([kind, len(batches), *[len(b) for b in batches]], np.uint64)
    return np.concatenate([head, *[b.astype(np.uint64, copy=False) for b in batches]])


def unpack_window(buf: np.ndarray, rank: int) -> tuple:
    """(kind, batches) of a pack_window message from `rank`. RuntimeError, naming
    the rank, for a message whose header does not match its keys (another hps
    version on that rank)."""
    n = int(buf[1]) if len(buf) >= 2 else -1
    counts = buf[2:2 + n].astype(np.int64) if 0 <= n <= len(buf) - 2 else None
    if (counts is None or int(buf[0]) not in (WINDOW_SET, WINDOW_SLIDE) or (counts < 0).any()
            or len(buf) != 2 + n + int(counts.sum()) or (int(buf[0]) == WINDOW_SLIDE and n > 1)):
        raise RuntimeError(f"rank {rank}'s lookahead window: {len(buf)} words do not match its header "
                           f"(does that rank run another hps?)")
    return int(buf[0]), np.split(buf[2 + n:], np.cumsum(counts)[:-1]) if n else []


class WindowSender:
    """A rank's side of the lookahead exchange: what its window's owners are sent
    at each prefetch. A window that is the last one shifted by one batch (its
    arrays from the second on, the same objects, then at most one more: as
    ParameterServer._move_window tells, and the pipeline's windows are) sends only
    the batch that enters (WINDOW_SLIDE); any other sends every batch (WINDOW_SET).
    A batch goes as its distinct keys, ascending."""

    def __init__(self):
        self._last: Optional[list] = None  # the arrays of the window last sent

    def batches(self, upcoming) -> tuple:
        """(kind, batches) for the window `upcoming` (a list of key arrays)."""
        if not isinstance(upcoming, (list, tuple)):
            raise TypeError(f"upcoming must be a list of key arrays (the next batches'), got {type(upcoming).__name__}")
        given, last = list(upcoming), self._last

        def same(a, b) -> bool:
            return len(a) == len(b) and all(x is y for x, y in zip(a, b))

        # The window last sent again (a prefetch given it twice) is set anew: sliding
        # it would take its own batches for new ones.
        if last and not same(given, last) and len(last) - 1 <= len(given) <= len(last) \
                and same(given[:len(last) - 1], last[1:]):
            kind, first = WINDOW_SLIDE, len(last) - 1
        else:
            kind, first = WINDOW_SET, 0
        batches = [np.unique(key_array(u, f"upcoming[{i}]").astype(np.uint64, copy=False).reshape(-1))
                   for i, u in enumerate(given[first:], first)]
        self._last = given
        return kind, batches

    def forget(self) -> None:
        """The last window is not known to have reached the owners (its exchange
        failed): the next one is set anew."""
        self._last = None

    def blocks(self, upcoming, world: int, whole: Optional[int] = None) -> list:
        """The messages (pack_window) to each rank: the keys it owns of the batches
        sent, each with its batch; rank `whole` (Herald's leader) gets all of them."""
        kind, batches = self.batches(upcoming)
        owners = [owner_ranks(b, world) for b in batches]
        return [pack_window(kind, batches if r == whole else [b[o == r] for b, o in zip(batches, owners)])
                for r in range(world)]


class OwnerWindows:
    """An owner's side of the lookahead exchange: each rank's window as its
    messages built it (the keys this owner was sent of each of its batches), and
    MEM-PS's window, whose batch j holds the keys this owner owns of every rank's
    batch j, ascending. A key's first place there is so the first of the job's
    coming batches any rank needs it in (the ranks step through global batches
    together), so the row MEM-PS evicts from the window is the one the job needs
    latest. When every rank slid, MEM-PS's window slides by the entering batch's
    keys (their union over the ranks; O(batch)); when any rank set its window anew,
    it is set anew from every rank's batches, batch by batch (O(K x batch)): the
    same positions either way (MemCache.slide_lookahead), so the same evictions.
    ``mine``: which keys of the batches received this owner owns (None: all)."""

    def __init__(self, world: int, mine=None):
        self._ranks: list = [[] for _ in range(world)]  # per rank: the keys received of each of its batches
        self._mine = mine
        # What MEM-PS's window is owed (apply): None, nothing; ("slide", keys or None: the
        # end of the data); ("set",): set anew, also where a call to it raised (unknown).
        self._owed: Optional[tuple] = None

    def update(self, messages: list) -> None:
        """The ranks' messages (pack_window, rank by rank) to their windows. MEM-PS
        gets the result later (apply, with the prefetch's pins): a MemCache call
        that raises CacheFullError (a window past its room) must leave the exchange
        done, since the pipeline tries that prefetch again and the other ranks have
        gone on to its next exchange."""
        got = [unpack_window(m, r) for r, m in enumerate(messages)]
        for r, (kind, _) in enumerate(got):
            if kind == WINDOW_SLIDE and not self._ranks[r]:
                raise RuntimeError(f"rank {r}'s lookahead window slid from a window it never sent "
                                   f"(does that rank run another hps?)")
        length = max(map(len, self._ranks))  # MEM-PS's window's batches
        # A batch entering a shorter window than the longest (a rank that set a short
        # one, then slid) lands inside MEM-PS's window, not at its end: set anew. So
        # does a window that MEM-PS does not hold yet (owed).
        slide = self._owed is None and all(kind == WINDOW_SLIDE and (not new or len(self._ranks[r]) == length)
                                           for r, (kind, new) in enumerate(got))
        # The ranks' windows are what they sent, whatever MEM-PS makes of them below:
        # the next messages build on them.
        for r, (kind, new) in enumerate(got):
            self._ranks[r] = (self._ranks[r][1:] if kind == WINDOW_SLIDE else []) + new
        if slide:
            entering = [self._owned(new[0]) for _, new in got if new]
            self._owed = ("slide", np.unique(np.concatenate(entering)) if entering else None)
        else:
            self._owed = ("set",)

    def apply(self, cache) -> None:
        """`cache`'s window to the ranks' windows as last updated (a no-op where it
        is already): slid by the entering batches' keys it owns (their union over the
        ranks; O(batch)) when every rank slid, else set anew from every rank's batches,
        batch by batch (O(K x batch)). A call that raises leaves the window to be set
        anew by the next apply (MemCache changes nothing then)."""
        owed = self._owed
        if owed is None:
            return
        self._owed = ("set",)  # a call below that raises leaves MEM-PS's window unknown
        if owed[0] == "slide":
            if owed[1] is not None:
                cache.slide_lookahead(owed[1])
            else:
                cache.pop_lookahead()  # the end of the data: no batch enters
        else:
            batches = [np.unique(np.concatenate([self._owned(b[j]) for b in self._ranks if len(b) > j]))
                       for j in range(max(map(len, self._ranks)))]
            cache.set_lookahead(batches[0] if batches else np.empty(0, np.uint64))
            for b in batches[1:]:
                cache.push_lookahead(b)
        self._owed = None

    def _owned(self, keys: np.ndarray) -> np.ndarray:
        return keys if self._mine is None else keys[self._mine(keys)]

    def keys(self) -> np.ndarray:
        """Every key of the ranks' windows as received, once, sorted."""
        return np.unique(np.concatenate([np.empty(0, np.uint64)] + [k for b in self._ranks for k in b]))


class _StepData:
    """A rank's part of one global step: its examples batch (possibly empty, its
    multi-hot bags included) and the step's example count over all ranks, which the
    loss is normalised by."""

    def __init__(self, examples, total_examples: int):
        self.examples = examples
        self.labels, self.dense, self.keys = examples.labels, examples.dense, examples.keys
        self.bags = getattr(examples, "bags", ())
        self.total_examples = total_examples

    def __len__(self) -> int:
        return len(self.labels)

    def all_keys(self) -> np.ndarray:
        return self.examples.all_keys()

    def rows(self, idx: np.ndarray):
        return self.examples.rows(idx)


class DistPrefetched:
    """The keys of a rank's examples batch, sent to their owners, and the owner's
    pins of what the ranks asked it for."""

    def __init__(self, uniq, order, counts, asked, local, flat, inverse, failed: Optional[Exception] = None):
        self.keys = uniq                # this rank's distinct keys, sorted
        self.order = order              # uniq[order] is the send order (grouped by owner)
        self.counts = counts            # keys sent to each owner
        self.asked = asked              # per rank: the keys it asked this rank for
        self.local = local              # the local server's Prefetched (the union of asked)
        self.flat = flat                # the batch's keys as prefetched, flattened
        self.inverse = inverse          # where each of them is among uniq
        # Why this owner's pins failed (then local is None): raised by its batch, in
        # the exchange its peers' batches wait in.
        self.failed = failed

    def release(self) -> None:
        if self.local is not None:
            self.local.release()


class DistBatch:
    """A working set on every rank at once (the distributed hps.Batch): rows of this
    rank's keys (pulled from their owners), gradients summed here until finish()
    sends them to the owners."""

    def __init__(self, server: "DistributedServer", local, pre: DistPrefetched, rows: np.ndarray):
        self.server = server
        self.local = local              # the owner side: the working set (hps.Batch) of the union asked of this rank
        self.pre = pre
        self.keys = pre.keys
        self.rows = rows
        self.grads = np.zeros_like(rows)
        self.touched = np.zeros(len(rows), bool)
        self.wait_seconds = local.wait_seconds

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        return rank_positions(keys, self.keys, self.pre.flat, self.pre.inverse, "is not in this batch's working set")

    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        return self.rows[self._positions(keys)]

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        # Summed per key natively, in the examples' order (np.add.at took 12.6 ms
        # where this takes 0.6, for 106k rows of 16 floats over 21k keys).
        pos = self._positions(keys)
        rows = np.ascontiguousarray(grads, np.float32).reshape(len(pos), self.grads.shape[1])
        self.grads += _core.sum_by_inverse(pos, rows, len(self.grads))
        self.touched[pos] = True

    def apply(self) -> None:
        """Each owner gets the summed gradients of the keys any rank touched and
        applies one step per key (collective)."""
        node, pre = self.server.node, self.pre
        try:
            try:
                # Before the first exchange, and told there: every rank's batch is
                # aborted, this rank raising its error, the others RankFailure.
                largest = refuse_nonfinite(self.grads, self.keys, "push gradients", self.server.grads_codec.spec)
                bound = sum_bound(largest, 1)  # (a key's gradients are summed here: one row a key)
                in_send_order = pre.order
                touched = self.touched[in_send_order]
                grads = self.grads[in_send_order]
                bounds = np.concatenate([[0], np.cumsum(pre.counts)])
                idx_blocks, grad_blocks = [], []
                for r in range(node.size):
                    t = np.flatnonzero(touched[bounds[r]:bounds[r + 1]])
                    idx_blocks.append(t.astype(np.int32))
                    grad_blocks.append(grads[bounds[r]:bounds[r + 1]][t])
            except Exception as e:  # noqa: BLE001 - told to the peers, then raised
                node.give_up("train", "push positions", e)
            heard = np.empty(node.size, np.int64)
            idx_in = node.alltoallv("train", idx_blocks, "sparse_keys", "push positions", tell=bound, heard=heard)
            codec = self.server.grads_codec
            grads_in = codec.unpack(node.alltoallv("train", codec.pack(grad_blocks, node.rank), "sparse_grads",
                                                   "push gradients"))
            if may_overflow(heard):
                k, g = self.server._summed([pre.asked[src][idx_in[src]] for src in range(node.size)], grads_in)
                if len(k):
                    self.local.push(k, g)
            else:
                for src in range(node.size):
                    if len(idx_in[src]):
                        self.local.push(pre.asked[src][idx_in[src]], grads_in[src])
        except BaseException as e:
            release_after(e, self.local.abort)  # the exchange's error stands
            raise
        # The owner's sums of every rank's gradients: a key whose sum overflowed is
        # refused there (DivergedError, naming it) before any row steps, which,
        # where the ranks' bounds let no sum overflow (may_overflow), is not told:
        # its sum was checked above on every rank together.
        self.local.apply()

    def write_back(self) -> None:
        """The owner's updated rows to its MEM-PS (local; the pipeline's writer thread)."""
        self.local.write_back()

    def finish(self) -> None:
        self.apply()
        self.write_back()

    def abort(self) -> None:
        self.local.abort()


class DistributedServer:
    """The job's sparse parameters, sharded over the ranks; the same interface as
    hps.ParameterServer for hps.torch and the pipeline. ``pull``, ``push``,
    ``prefetch``, ``batch`` and ``checkpoint`` are collective: every rank calls
    them in the same order (from the same pipeline stage). ``sparse_rows`` and
    ``sparse_grads``: the codecs of rows and gradients between ranks (RowCodec)."""

    def __init__(self, local: ParameterServer, node: Node, *, sparse_rows: str = "none", sparse_grads: str = "none"):
        self.local = local
        self.node = node
        self.config = local.config
        self.dim = local.dim
        self._retry: Optional[tuple] = None  # the exchange of a prefetch that hit CacheFullError
        # Refused together with the ranks' initial rows, the servers' first exchange:
        # a rank that refused its own arguments before it left its peers waiting there.
        failed = None
        try:
            self.rows_codec = RowCodec(sparse_rows, self.dim)  # [distributed] sparse_rows: rows to the askers
            self.grads_codec = RowCodec(sparse_grads, self.dim)  # sparse_grads: gradients to the owners
            self._check_arguments()
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            failed = e
        self._check_initial_rows(failed)
        self.fresh_rows = FreshRows(local._native_opt, self.dim, self.rows_codec)  # untrained rows as a bit
        self._window_sender = WindowSender()  # lookahead: this rank's windows to the owners
        self._owner_windows = self._make_owner_windows()  # and the ranks' windows as this owner's MEM-PS keeps them

    # -- exchange helpers
    def _keys_to_owners(self, keys, what: str) -> tuple:
        """keys' distinct ones (sorted), grouped by owner for _send_keys: (uniq,
        order, counts, blocks, flat, inverse), blocks[r] the keys to rank r, flat
        the keys as given, flattened, and inverse where each is among uniq (numpy's
        unique finds it for less than without). Keys refused (key_array, a reserved
        key) raise, naming `what`."""
        flat = key_array(keys, what).astype(np.uint64, copy=False).ravel()
        uniq, inverse = np.unique(flat, return_inverse=True)
        if len(uniq) and uniq[-1] == EMPTY_KEY:
            raise ValueError(f"{what}: key {EMPTY_KEY:#x} is reserved (the empty-slot sentinel)")
        owners = owner_ranks(uniq, self.node.size)
        order = np.argsort(owners, kind="stable")
        counts = np.bincount(owners, minlength=self.node.size)
        blocks = np.split(uniq[order], np.cumsum(counts)[:-1])
        return uniq, order, counts, blocks, flat, inverse.reshape(-1)

    def _send_keys(self, stage: str, keys: np.ndarray, what: str):
        """keys' distinct ones (sorted) to their owners: (uniq, order, counts,
        asked, flat, inverse), as _keys_to_owners. Keys this rank refuses are
        refused on every rank, in the exchange (Node.give_up)."""
        try:
            uniq, order, counts, blocks, flat, inverse = self._keys_to_owners(keys, what)
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            self.node.give_up(stage, what, e)
        asked = self.node.alltoallv(stage, blocks, "sparse_keys", what)
        return uniq, order, counts, asked, flat, inverse

    def _return_rows(self, stage: str, uniq, order, counts, asked, rows_out, what: str,
                     waiting: Optional[tuple] = None) -> np.ndarray:
        """rows_out() (its [r]: the rows of asked[r], the keys rank r asked this owner
        for) to the ranks that asked; returns the rows of uniq, whose uniq[order]
        went to their owners, counts[r] to rank r. An owner whose rows_out() raises
        (its reads: the keys were exchanged) tells the ranks in the exchange, and
        every rank raises (Node.give_up).

        A rank that refuses the rows it was sent (a block another hps wrote)
        raises alone, after the call's last exchange: its peers hear of it from
        its Node (Node.owe), at no cost to a call that succeeds: in its next
        exchange on `stage`'s communicator, or, `waiting` (stage, exchange), in
        the exchange its peers go on into and wait in (their batch's apply) by
        its next collective (Node.owe_waiting). Before, they went on none the
        wiser, or waited there until the watchdog's timeout."""
        try:
            blocks = self.fresh_rows.pack(asked, rows_out(), self.node.rank)
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            self.node.give_up(stage, what, e)
        sent = self.node.alltoallv(stage, blocks, "sparse_rows", what)
        try:
            mine = np.split(uniq[order], np.cumsum(counts)[:-1])
            rows_in = self.fresh_rows.unpack(mine, sent)
            rows = np.empty((len(uniq), self.dim), np.float32)
            rows[order] = np.concatenate(rows_in) if rows_in else rows
        except Exception as e:  # noqa: BLE001 - owed to the peers, then raised
            if waiting is None:
                self.node.owe(stage, what, e)
            else:
                self.node.owe_waiting(*waiting, e)
            raise
        return rows

    def _summed(self, keys_in: list, grads_in: list) -> tuple:
        """Where a step's sums may overflow (may_overflow, the same on every rank):
        this owner's keys (keys_in[r], from rank r) and their sums of every rank's
        gradients (grads_in[r]), in rank order, checked before any owner steps, and
        refused on every rank where one owner's overflowed (Node.confirm): that
        owner raises DivergedError, the others RankFailure naming it, and no owner
        steps a key. Before, the owner refused its keys alone, after the last
        exchange, and the others stepped theirs. Returns (keys, sums), a row a key,
        for the owner's server to step (so no sum of its own can overflow)."""
        failed = sums = uniq = None
        try:
            k = np.concatenate([np.asarray(a, np.uint64) for a in keys_in])
            g = np.concatenate([np.asarray(a, np.float32).reshape(-1, self.dim) for a in grads_in])
            uniq, inverse = np.unique(k, return_inverse=True)
            sums = _core.sum_by_inverse(inverse.reshape(-1).astype(np.int64), np.ascontiguousarray(g), len(uniq))
            refuse_overflow(sums, uniq, "push gradients", self.node.rank)
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            failed = e
        self.node.confirm("train", "push sums", failed)
        return uniq, sums

    # -- the collective API
    def pull(self, keys: np.ndarray) -> np.ndarray:
        """Rows (n, dim) of keys, from their owners, as of the last finished batch."""
        uniq, order, counts, asked, _, inverse = self._send_keys("train", keys, "pull keys")
        rows = self._return_rows("train", uniq, order, counts, asked, lambda: [self.local.pull(a) for a in asked],
                                 "pull rows")
        return rows[inverse].reshape(np.shape(keys) + (self.dim,))

    def push(self, keys: np.ndarray, grads: np.ndarray, *, step: bool = True) -> None:
        """Sums the gradients every rank pushes for each key at its owner, which
        applies one step per key: as one ParameterServer.push of all ranks' pairs
        (``step``: as ParameterServer.push's; every rank passes the same). Keys or
        gradients this rank refuses are refused on every rank, before any is sent
        (Node.give_up): this rank raises its error, the others RankFailure."""
        codec = self.grads_codec
        try:
            keys = key_array(keys, "push keys").astype(np.uint64, copy=False)
            grads = np.asarray(grads)
            if grads.dtype != np.float32:
                raise TypeError(f"grads must be an array of float32, got {grads.dtype}")
            if grads.shape != (len(keys), self.dim):
                raise ValueError(f"grads must have shape ({len(keys)}, {self.dim}), got {grads.shape}")
            if len(keys) and (keys == EMPTY_KEY).any():  # (its owner's push refused it, after the exchange)
                raise ValueError(f"push keys: key {EMPTY_KEY:#x} is reserved (the empty-slot sentinel)")
            largest = refuse_nonfinite(grads, keys, "push gradients", codec.spec)
            bound = sum_bound(largest, len(keys))  # (a key's rows are summed at its owner)
            self._check_push()
            owners = owner_ranks(keys, self.node.size)
            order = np.argsort(owners, kind="stable")
            cuts = np.cumsum(np.bincount(owners, minlength=self.node.size))[:-1]
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            self.node.give_up("train", "push keys", e)
        heard = np.empty(self.node.size, np.int64)
        keys_in = self.node.alltoallv("train", np.split(keys[order], cuts), "sparse_keys", "push keys", tell=bound,
                                      heard=heard)
        grads_in = codec.unpack(self.node.alltoallv("train", codec.pack(np.split(grads[order], cuts), self.node.rank),
                                                    "sparse_grads", "push gradients"))
        if may_overflow(heard):
            k, g = self._summed(keys_in, grads_in)
        else:
            k = np.concatenate(keys_in)
            g = np.ascontiguousarray(np.concatenate(grads_in)) if len(k) else np.empty((0, self.dim), np.float32)
        self._push_exchanged()
        # Also with no pair for this rank: a push is a step of every rank's server (the
        # step [ps] ttl_steps counts), as one ParameterServer.push of the job's pairs.
        self.local.push(k, g, step=step)

    def prefetch(self, keys: np.ndarray, upcoming=None) -> DistPrefetched:
        """The pipeline's pull stage: keys to their owners, each owner pins what it
        was asked for. A CacheFullError leaves the exchange done; the pipeline's
        retry with the same keys only pins again. ``upcoming`` (lookahead): the
        keys of this rank's next batches, which go to their owners too, so that
        each owner's MEM-PS keeps them when it must evict. Its window is given to
        MEM-PS with the pins, after the exchanges: a window past its room raises
        CacheFullError as a pin does, and the retry tries it again without an
        exchange (its peers are in the next one). Keys or a window this rank
        refuses are refused on every rank, before either is sent (Node.give_up).

        After the exchange, the peers' prefetches have returned, and their batches
        will wait for this owner's rows. So its pins' other failures (a working set
        past device_capacity, a read of SSD-PS) are raised by its batch, in that
        wait, on every rank (this prefetch returns); and a CacheFullError not
        tried again (the next prefetch is given other keys) is told there by the
        next prefetch, before its own exchange."""
        if self._retry is not None and self._retry[0] is keys:
            exchange = self._retry[1]
        else:
            self._give_up_retry()
            exchange = self._exchange(keys, upcoming)
        self._retry = None
        uniq, order, counts, asked, flat, inverse = exchange
        union = np.unique(np.concatenate(asked)) if asked else np.empty(0, np.uint64)
        try:
            if upcoming is not None:
                self._owner_windows.apply(self.local._cache)
            local = self.local.prefetch(union)
        except CacheFullError as e:
            self._retry = (keys, exchange, e)
            raise
        except Exception as e:  # noqa: BLE001 - raised by the batch, on every rank
            # After the exchange, the peers' prefetches went on, and each batch waits
            # for this rank's rows: its batch raises this there (Node.give_up). Raised
            # here, it left them waiting until the watchdog's timeout.
            return DistPrefetched(uniq, order, counts, asked, None, flat, inverse, failed=e)
        return DistPrefetched(uniq, order, counts, asked, local, flat, inverse)

    def _give_up_retry(self) -> None:
        """A prefetch that raised CacheFullError and is not tried again (this call
        is not its retry): the peers' prefetches went on, and their batches wait
        for this rank in their first exchange. Told there (as a load that failed:
        they raise RankFailure naming its error), and this rank goes on with the
        call. Raised at the prefetch, it left them waiting until the watchdog's
        timeout, or until this rank's next call met them there."""
        if self._retry is None:
            return
        error = self._retry[2]
        self._retry = None
        try:
            self._tell_abandoned(error)
        except BaseException as e:
            if e is not error:
                raise

    def _tell_abandoned(self, error: Exception) -> None:
        """Tells the peers, where their batches wait, that this rank's last
        prefetch failed (`error`, which Node.give_up raises here again)."""
        self.node.give_up("load", "load rows", error)

    def _exchange(self, keys, upcoming) -> tuple:
        """The prefetch's exchanges (_send_window's, then _send_keys'), their
        checks made first: a rank that refused its keys after its window was
        sent left its peers waiting in the keys' exchange."""
        try:
            window = None if upcoming is None else self._window_blocks(upcoming)
            sent = self._keys_to_owners(keys, "prefetch keys")
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            self._window_sender.forget()
            self.node.give_up("prefetch", "prefetch keys" if upcoming is None else "lookahead keys", e)
        try:
            if window is not None:
                self._send_window(upcoming, window, then="prefetch keys")
            uniq, order, counts, blocks, flat, inverse = sent
            asked = self.node.alltoallv("prefetch", blocks, "sparse_keys", "prefetch keys")
        except BaseException:
            self._window_sender.forget()  # (the owners may not have had the window)
            raise
        return uniq, order, counts, asked, flat, inverse

    def _window_blocks(self, upcoming) -> list:
        """What _send_window sends each rank of the window `upcoming` (WindowSender.blocks)."""
        return self._window_sender.blocks(upcoming, self.node.size)

    def _send_window(self, upcoming, blocks: Optional[list] = None, then: Optional[str] = None):
        """Every rank's window to the owners (collective, prefetch stage): each one
        sent the keys it owns of the batches that changed (`blocks`, else
        _window_blocks'), for its MEM-PS to keep the coming keys it owns in the
        order the job needs them (OwnerWindows.apply). `then`: the prefetch
        exchange that follows, where a rank that refuses what it was sent (a
        window another hps wrote) tells its peers (Node.give_up): they have gone
        on into it, and waited there until the watchdog's timeout."""
        if blocks is None:
            blocks = self._window_blocks(upcoming)
        got = self.node.alltoallv("prefetch", blocks, "sparse_keys", "lookahead keys")
        try:
            self._owner_windows.update(got)
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            if then is None:
                raise
            self.node.give_up("prefetch", then, e)

    def _make_owner_windows(self) -> OwnerWindows:
        return OwnerWindows(self.node.size)

    def batch(self, pre: DistPrefetched, overlap: bool = False) -> DistBatch:
        """The load stage: the union this rank was asked for goes onto its device
        tier, and once its previous batch is applied (or, without `overlap`,
        written back) the rows go to the ranks that asked. A rank whose load fails
        tells the ranks in the exchange, and every rank raises (Node.give_up)."""
        made = []

        def rows_out() -> list:
            if pre.failed is not None:
                raise pre.failed
            made.append(self.local.batch(pre.local, overlap=overlap))
            return [made[0].pull(a) for a in pre.asked]
        try:
            # (a rank that refuses the rows it was sent: its peers' batches go on to
            # their apply, whose first exchange they wait in)
            rows = self._return_rows("load", pre.keys, pre.order, pre.counts, pre.asked, rows_out, "load rows",
                                     waiting=("train", "push positions"))
        except BaseException as e:
            if made:
                release_after(e, made[0].abort)  # the exchange's error stands
            raise
        return DistBatch(self, made[0], pre, rows)

    def aligned(self, source: Iterable, empty) -> Iterator[_StepData]:
        """This rank's examples batches in lockstep with the other ranks': a rank whose
        data ends first takes part with empty batches until every rank's has ended.
        `empty` is an empty hps.data.Batch of the source's shape. A source that
        raises on one rank (a malformed line of its own data) ends every rank's:
        that rank raises its error, the others RankFailure naming it (they waited
        in the next step's exchange for a rank that had left)."""
        it = iter(source)
        done = False
        while True:
            failed = None
            try:
                examples = None if done else next(it, None)
            except Exception as e:  # noqa: BLE001 - told to the peers, then raised
                failed, examples = e, None
            done = examples is None
            n = 0 if done else len(examples)
            flags = np.array([0 if done else 1, n, failed is not None], np.int64)
            self.node.allreduce("read", flags, "control", "read (who still has data)")
            if flags[2]:
                self._read_failed(failed)
            if flags[0] == 0:
                return
            yield _StepData(empty if done else examples, int(flags[1]))

    def _read_failed(self, failed: Optional[Exception]) -> None:
        """aligned(), once a rank's source raised: the ranks' errors, gathered; this
        rank's own raised again, else RankFailure naming the ranks that failed."""
        mine = None if failed is None else f"{type(failed).__name__}: {failed}"
        every = self.node.allgather("read", mine, "read (the ranks' errors)")
        if failed is not None:
            raise mark_raised_on_every_rank(failed)
        said = "; ".join(f"rank {r}'s data failed ({e})" for r, e in enumerate(every) if e is not None)
        raise RankFailure(f"read: {said}: every rank stops")

    def checkpoint(self, save=None, *, keep_previous: bool = False) -> int:
        """This rank's ParameterServer.checkpoint (local: the job's consistency is
        hps.train's, which keeps the previous checkpoint until every rank is done)."""
        return self.local.checkpoint(save, keep_previous=keep_previous)

    def prune_checkpoints(self) -> None:
        self.local.prune_checkpoints()

    def _check_push(self) -> None:
        """Checks before a push (raise to refuse it; a subclass adds its own), made
        with push's own checks, which every rank hears of before any key is sent.

        A push's owners step their keys with the local server's push, which waits
        for every batch of it to be written back (ParameterServer._batch_in_the_way
        says which would never be). A batch made and not yet applied is applied by
        this thread, after the push: a push is collective on the train stage's
        exchanges, as a batch's apply is, so no other thread may apply one
        meanwhile. One applied and not yet written back is written back by the
        thread that made it, unless another does (the pipeline's writer). The push
        waited for it forever, after its exchanges: an hps.torch module with no
        batch attached, its backward inside a batch, hung every rank. Refused
        here, on every rank, whichever ranks see it."""
        why = self.local._batch_in_the_way()
        if why is not None:
            raise RuntimeError(
                f"DistributedServer.push: each owner steps its keys with its server's push, which waits for every "
                f"batch of the server to be written back; a batch of this rank's is open ({why}) and is finished "
                f"only after this push, on the thread that trains it: the push would wait for it forever. Nothing "
                f"was pushed, on any rank. Push the gradients into the batch (batch.push(keys, grads); an "
                f"hps.torch module: module.attach(batch, worker)), or push once the batch is finished")

    def _push_exchanged(self) -> None:
        """A subclass's work once a push's keys and gradients have crossed, before
        this rank's server steps the keys it owns."""

    def _check_arguments(self) -> None:
        """A subclass's checks of its own arguments (raise to refuse them), made on
        every rank before the ranks compare their initial rows."""

    def _check_initial_rows(self, failed: Optional[Exception] = None) -> None:
        """Refuses ranks whose servers make other initial rows (another dim,
        initializer, seed or optimizer): a rank makes the untrained rows it asked an
        owner for (FreshRows), so they must be the owner's. Collective: the first
        exchange of the job's servers. `failed`: this rank's refusal of its own
        arguments, raised here, once the peers have heard it (they raise
        RankFailure naming it)."""
        probe = np.array([0, 1, 0x9E3779B97F4A7C15], np.uint64)
        mine = None if failed is not None else self.local._native_opt.initial_rows(probe).tobytes()
        said = None if failed is None else f"{type(failed).__name__}: {failed}"
        every = self.node.allgather("train", (mine, said), "the ranks' initial rows")
        if failed is not None:
            raise mark_raised_on_every_rank(failed)
        refused = [f"rank {r} refused its arguments ({e})" for r, (_, e) in enumerate(every) if e is not None]
        if refused:
            raise RankFailure(f"{type(self).__name__}: {'; '.join(refused)}: every rank's server is refused")
        every = [rows for rows, _ in every]
        other = [r for r, theirs in enumerate(every) if theirs != every[0]]
        if other:
            raise ValueError(f"rank {other[0]}'s parameter server makes other initial rows than rank 0's (its "
                             f"dim, initializer, seed or optimizer differ): every rank's must be the same, since "
                             f"a rank makes the untrained rows it pulls from their owners")

    def fresh_rows_sent(self) -> int:
        """Rows this rank sent as a bit, never trained (FreshRows)."""
        return self.fresh_rows.fresh

    def stats(self) -> dict:
        s = self.local.stats()
        s["distributed"] = {"rank": self.node.rank, "world": self.node.size, "nodes": self.node.nodes,
                            "bytes_sent": dict(self.node.bytes_sent), "fresh_rows_sent_as_bits": self.fresh_rows.fresh,
                            "codecs": {name: {"codec": c.spec, "before": c.before, "after": c.after}
                                       for name, c in (("sparse_rows", self.rows_codec),
                                                       ("sparse_grads", self.grads_codec))}}
        return s

    def close(self) -> None:
        self.local.close()
