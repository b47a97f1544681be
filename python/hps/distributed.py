"""hps.distributed: one parameter-server node per MPI rank (mpi4py).

Run any hps training under ``mpiexec -n N`` and each rank becomes a node with its
own MEM-PS and SSD-PS (``<path>/rank<r>``). Keys are owned by rank
``(mix64(key) >> 32) mod N`` (the high half of the hash, so that the device tier's
``mix64(key) mod G`` still spreads a rank's keys over its devices).

Sparse parameters, bulk-synchronous per batch (no staleness):
  prefetch stage: each rank sends the distinct keys of its batch to their owners
    (alltoallv); each owner pins the union of what it was asked for in its
    MEM-PS, reading SSD-PS for misses;
  load stage: once the owner's previous batch is written back, it loads that union
    onto its device tier and returns the rows to the ranks that asked (alltoallv);
  train stage: gradients of each key go back to its owner (alltoallv), add up there,
    and the owner applies its optimizer once per key.
Dense parameters (torch): gradients all-reduced every step (``dense_sync =
"allreduce"``), or k-step Adam (:class:`KStepAdam`, the terabyte-scale paper's
Algorithm 2): local steps, x and the second moment v averaged every k steps.
All-reduces may go hierarchically (:func:`hierarchical_allreduce`).

Every collective runs under a watchdog: a rank that waits longer than
``timeout`` seconds for its peers (one died or hung) prints which operation it
was in and aborts the whole job, so nothing hangs forever. Each stage has its
own communicator, so the stages' collectives run concurrently (MPI_THREAD_MULTIPLE).
Bytes sent to other ranks are counted per kind in ``Node.bytes_sent``.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from hps.data import mix64
from hps.errors import HpsError
from hps.hash_table import EMPTY_KEY
from hps.mem_cache import CacheFullError
from hps.parameter_server import ParameterServer

__all__ = ["DistributedConfig", "DistributedServer", "KStepAdam", "DenseSync", "Node", "RankFailure",
           "hierarchical_allreduce", "launched_by_mpi", "owner_ranks"]

COMM_KINDS = ("sparse_keys", "sparse_rows", "sparse_grads", "dense", "control")


class RankFailure(HpsError):
    """The ranks disagree about the job (world size, checkpoint step)."""


def launched_by_mpi() -> bool:
    """Whether this process is one of several started by mpiexec (MPICH or Open MPI),
    told by the launcher's environment, so that a plain run never initialises MPI."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        try:
            if int(os.environ.get(name, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


def owner_ranks(keys: np.ndarray, world: int) -> np.ndarray:
    """The rank that owns each key (int64)."""
    return ((mix64(keys) >> np.uint64(32)) % np.uint64(world)).astype(np.int64)


@dataclass
class DistributedConfig:
    dense_sync: str = "allreduce"   # "allreduce": gradients summed every step; "kstep": k-step Adam
    k: int = 1                      # kstep: average x and v every k steps
    beta1: float = 0.0              # kstep: the paper's default
    beta2: float = 0.999
    eps: float = 1e-8               # kstep: v starts at eps (no eps in the denominator)
    hierarchical: bool = False      # all-reduce across nodes (log2 steps), then within each node
    ranks_per_node: int = 0         # 0: the ranks sharing this machine's memory (MPI's shared-memory split)
    timeout: float = 600.0          # seconds a rank waits for its peers before aborting the job

    def check(self, source: str = "[distributed]") -> None:
        if self.dense_sync not in ("allreduce", "kstep"):
            raise ValueError(f"{source}: dense_sync must be 'allreduce' or 'kstep', got {self.dense_sync!r}")
        if not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"{source}: k must be an int >= 1, got {self.k!r}")
        if not 0.0 <= self.beta1 < 1.0 or not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"{source}: beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not self.eps > 0:
            raise ValueError(f"{source}: eps must be > 0, got {self.eps}")
        if self.ranks_per_node < 0:
            raise ValueError(f"{source}: ranks_per_node must be >= 0, got {self.ranks_per_node}")
        if not self.timeout > 0:
            raise ValueError(f"{source}: timeout must be > 0 seconds, got {self.timeout}")


# ---------------------------------------------------------------- the node

class _Watchdog:
    """Aborts the job when a collective waits longer than `timeout` seconds."""

    def __init__(self, node: "Node", timeout: float):
        self.node = node
        self.timeout = timeout
        self._ops: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hps-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str):
        me = threading.get_ident()
        with self._lock:
            self._ops[me] = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._ops.pop(me, None)

    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                late = [(what, now - t0) for what, t0 in self._ops.values() if now - t0 > self.timeout]
            if late:
                what, waited = late[0]
                self.node.abort(f"waited {waited:.0f} s in {what} for the other ranks (timeout "
                                f"{self.timeout:g} s): a rank has died or hung")

    def stop(self) -> None:
        self._stop.set()


class Node:
    """This rank's place in the job: communicators per stage, node topology for
    hierarchical all-reduce, byte counters and the watchdog."""

    STAGES = ("read", "prefetch", "load", "train")

    def __init__(self, config: Optional[DistributedConfig] = None, comm=None):
        from mpi4py import MPI
        self.MPI = MPI
        self.config = config or DistributedConfig()
        self.config.check()
        world = comm if comm is not None else MPI.COMM_WORLD
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("hps.distributed needs an MPI with MPI_THREAD_MULTIPLE (the pipeline's stages "
                               "run collectives from their own threads)")
        self.world = world
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.comms = {stage: world.Dup() for stage in self.STAGES}
        self.bytes_sent = {kind: 0 for kind in COMM_KINDS}
        self._bytes_lock = threading.Lock()
        rpn = self.config.ranks_per_node
        if rpn:
            if self.size % rpn:
                raise ValueError(f"[distributed] ranks_per_node = {rpn} does not divide the {self.size} ranks")
            self.node_comm = world.Split(self.rank // rpn, self.rank)
        else:
            self.node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        local = self.node_comm.Get_rank()
        self.cross_comm = world.Split(local, self.rank)  # the same local rank on every node
        sizes = world.allgather(self.node_comm.Get_size())
        self.nodes = self.cross_comm.Get_size()
        self.uniform_nodes = len(set(sizes)) == 1
        self._watchdog = _Watchdog(self, self.config.timeout)

    # -- failure
    def abort(self, why: str, code: int = 70) -> None:
        """Says why on stderr and ends every rank of the job (MPI_Abort)."""
        sys.stderr.write(f"hps.distributed: rank {self.rank} of {self.size}: {why}; aborting the job\n")
        sys.stderr.flush()
        self.world.Abort(code)

    def guard(self, what: str):
        return self._watchdog.guard(what)

    def count(self, kind: str, nbytes: int) -> None:
        with self._bytes_lock:
            self.bytes_sent[kind] += int(nbytes)

    # -- collectives
    def alltoallv(self, stage: str, blocks: Sequence[np.ndarray], kind: str, what: str) -> list[np.ndarray]:
        """Sends blocks[r] to rank r; returns what each rank sent here, in rank
        order. Blocks share one dtype and trailing shape."""
        MPI = self.MPI
        comm = self.comms[stage]
        first = blocks[self.rank]
        tail = first.shape[1:]
        row_bytes = first.dtype.itemsize * int(np.prod(tail, dtype=np.int64))
        send_counts = np.array([len(b) for b in blocks], np.int64)
        recv_counts = np.empty(self.size, np.int64)
        with self.guard(f"{what} (counts)"):
            comm.Alltoall(send_counts, recv_counts)
        if max(int(send_counts.sum()), int(recv_counts.sum())) * row_bytes >= 2**31:
            raise ValueError(f"{what}: a batch of {send_counts.sum()} / {recv_counts.sum()} rows of {row_bytes} "
                             f"bytes passes MPI's 2 GiB message limit; use smaller batches")
        send = np.ascontiguousarray(np.concatenate(blocks)) if len(blocks) else first
        recv = np.empty((int(recv_counts.sum()),) + tail, first.dtype)
        sb, rb = send_counts * row_bytes, recv_counts * row_bytes
        sd = np.concatenate([[0], np.cumsum(sb)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rb)[:-1]])
        with self.guard(what):
            comm.Alltoallv([send, (sb.astype(np.int32), sd.astype(np.int32)), MPI.BYTE],
                           [recv, (rb.astype(np.int32), rd.astype(np.int32)), MPI.BYTE])
        self.count(kind, int(sb.sum() - sb[self.rank]))
        return np.split(recv, np.cumsum(recv_counts)[:-1])

    def allreduce(self, stage: str, buf: np.ndarray, kind: str, what: str, hierarchical: bool = False) -> np.ndarray:
        """Sums buf over the ranks, in place. `hierarchical` goes across nodes, then
        within them, over communicators of their own: only the train stage uses it."""
        with self.guard(what):
            if hierarchical:
                hierarchical_allreduce(buf, self.node_comm, self.cross_comm, lambda n: self.count(kind, n))
                return buf
            self.comms[stage].Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        if self.size > 1:
            self.count(kind, buf.nbytes)
        return buf

    def allgather(self, stage: str, obj: Any, what: str) -> list:
        with self.guard(what):
            return self.comms[stage].allgather(obj)

    def close(self) -> None:
        self._watchdog.stop()


def hierarchical_allreduce(buf: np.ndarray, node_comm, cross_comm, count=lambda nbytes: None) -> np.ndarray:
    """Sums buf over all ranks, in place, the MLSys 2020 paper's way (appendix C.3):
    first across nodes, each rank exchanging with the rank of the same local index
    on its partner node (recursive doubling: log2(nodes) pairwise exchanges, with
    the nodes beyond a power of two folded in first), then within each node.
    `count(n)` is told the bytes each send moves."""
    from mpi4py import MPI
    n, me = cross_comm.Get_size(), cross_comm.Get_rank()
    if n > 1:
        pof2 = 1 << (n.bit_length() - 1)
        tmp = np.empty_like(buf)
        # Nodes beyond the power of two hand their sums to a partner and wait.
        if me >= pof2:
            cross_comm.Send(buf, dest=me - pof2, tag=11)
            count(buf.nbytes)
            cross_comm.Recv(buf, source=me - pof2, tag=12)
        else:
            if me + pof2 < n:
                cross_comm.Recv(tmp, source=me + pof2, tag=11)
                buf += tmp
            step = 1
            while step < pof2:
                partner = me ^ step
                cross_comm.Sendrecv(buf, dest=partner, sendtag=13, recvbuf=tmp, source=partner, recvtag=13)
                count(buf.nbytes)
                buf += tmp  # a + b == b + a in IEEE arithmetic: both partners hold the same sum
                step <<= 1
            if me + pof2 < n:
                cross_comm.Send(buf, dest=me + pof2, tag=12)
                count(buf.nbytes)
    if node_comm.Get_size() > 1:
        node_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        count(buf.nbytes)
    return buf


# ---------------------------------------------------------------- sparse parameters

class _StepData:
    """A rank's part of one global step: its batch (possibly empty) and the step's
    example count over all ranks, which the loss is normalised by."""

    def __init__(self, batch, total_examples: int):
        self.labels, self.dense, self.keys = batch.labels, batch.dense, batch.keys
        self.total_examples = total_examples

    def __len__(self) -> int:
        return len(self.labels)


class DistPrefetched:
    """A rank's batch keys, sent to their owners, and the owner's pins of what
    the ranks asked it for."""

    def __init__(self, uniq, order, counts, asked, local):
        self.keys = uniq                # this rank's distinct keys, sorted
        self.order = order              # uniq[order] is the send order (grouped by owner)
        self.counts = counts            # keys sent to each owner
        self.asked = asked              # per rank: the keys it asked this rank for
        self.local = local              # the local server's Prefetched (the union of asked)

    def release(self) -> None:
        self.local.release()


class DistBatch:
    """A batch on every rank at once: rows of this rank's keys (pulled from their
    owners), gradients summed here until finish() sends them to the owners."""

    def __init__(self, server: "DistributedServer", local, pre: DistPrefetched, rows: np.ndarray):
        self.server = server
        self.local = local              # the owner side: hps.Batch over the union asked of this rank
        self.pre = pre
        self.keys = pre.keys
        self.rows = rows
        self.grads = np.zeros_like(rows)
        self.touched = np.zeros(len(rows), bool)
        self.wait_seconds = local.wait_seconds

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.uint64)
        pos = np.minimum(np.searchsorted(self.keys, keys), max(len(self.keys) - 1, 0))
        if len(keys) and (len(self.keys) == 0 or (self.keys[pos] != keys).any()):
            missing = keys[(self.keys[pos] != keys) if len(self.keys) else slice(None)]
            raise KeyError(f"key {int(missing[0])} is not in this batch's working set")
        return pos

    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        return self.rows[self._positions(keys)]

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        pos = self._positions(keys)
        np.add.at(self.grads, pos, np.asarray(grads, np.float32))
        self.touched[pos] = True

    def apply(self) -> None:
        """Each owner gets the summed gradients of the keys any rank touched and
        applies one step per key (collective)."""
        node, pre = self.server.node, self.pre
        try:
            in_send_order = pre.order
            touched = self.touched[in_send_order]
            grads = self.grads[in_send_order]
            bounds = np.concatenate([[0], np.cumsum(pre.counts)])
            idx_blocks, grad_blocks = [], []
            for r in range(node.size):
                t = np.flatnonzero(touched[bounds[r]:bounds[r + 1]])
                idx_blocks.append(t.astype(np.int32))
                grad_blocks.append(grads[bounds[r]:bounds[r + 1]][t])
            idx_in = node.alltoallv("train", idx_blocks, "sparse_keys", "push positions")
            grads_in = node.alltoallv("train", grad_blocks, "sparse_grads", "push gradients")
            for src in range(node.size):
                if len(idx_in[src]):
                    self.local.push(pre.asked[src][idx_in[src]], grads_in[src])
        except BaseException:
            self.local.abort()
            raise
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
    them in the same order (from the same pipeline stage)."""

    def __init__(self, local: ParameterServer, node: Node):
        self.local = local
        self.node = node
        self.config = local.config
        self.dim = local.dim
        self._retry: Optional[tuple] = None  # the exchange of a prefetch that hit CacheFullError

    # -- exchange helpers
    def _send_keys(self, stage: str, keys: np.ndarray, what: str):
        uniq = np.unique(np.asarray(keys, np.uint64).ravel())
        if len(uniq) and uniq[-1] == EMPTY_KEY:
            raise ValueError(f"{what}: key {EMPTY_KEY:#x} is reserved (the empty-slot sentinel)")
        owners = owner_ranks(uniq, self.node.size)
        order = np.argsort(owners, kind="stable")
        counts = np.bincount(owners, minlength=self.node.size)
        blocks = np.split(uniq[order], np.cumsum(counts)[:-1])
        asked = self.node.alltoallv(stage, blocks, "sparse_keys", what)
        return uniq, order, counts, asked

    def _return_rows(self, stage: str, uniq, order, rows_out, what: str) -> np.ndarray:
        rows_in = self.node.alltoallv(stage, rows_out, "sparse_rows", what)
        rows = np.empty((len(uniq), self.dim), np.float32)
        rows[order] = np.concatenate(rows_in) if rows_in else rows
        return rows

    # -- the collective API
    def pull(self, keys: np.ndarray) -> np.ndarray:
        """Rows (n, dim) of keys, from their owners, as of the last finished batch."""
        keys = np.asarray(keys)
        uniq, order, _, asked = self._send_keys("train", keys, "pull keys")
        rows = self._return_rows("train", uniq, order, [self.local.pull(a) for a in asked], "pull rows")
        return rows[np.searchsorted(uniq, keys.ravel())].reshape(keys.shape + (self.dim,))

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """Sums the gradients every rank pushes for each key at its owner, which
        applies one step per key: as one ParameterServer.push of all ranks' pairs."""
        keys = np.asarray(keys, np.uint64)
        grads = np.asarray(grads)
        if grads.dtype != np.float32:
            raise TypeError(f"grads must be an array of float32, got {grads.dtype}")
        if grads.shape != (len(keys), self.dim):
            raise ValueError(f"grads must have shape ({len(keys)}, {self.dim}), got {grads.shape}")
        owners = owner_ranks(keys, self.node.size)
        order = np.argsort(owners, kind="stable")
        cuts = np.cumsum(np.bincount(owners, minlength=self.node.size))[:-1]
        keys_in = self.node.alltoallv("train", np.split(keys[order], cuts), "sparse_keys", "push keys")
        grads_in = self.node.alltoallv("train", np.split(grads[order], cuts), "sparse_grads", "push gradients")
        k = np.concatenate(keys_in)
        if len(k):
            self.local.push(k, np.ascontiguousarray(np.concatenate(grads_in)))

    def prefetch(self, keys: np.ndarray) -> DistPrefetched:
        """The pipeline's pull stage: keys to their owners, each owner pins what it
        was asked for. A CacheFullError leaves the exchange done; the pipeline's
        retry with the same keys only pins again."""
        if self._retry is not None and self._retry[0] is keys:
            exchange = self._retry[1]
        else:
            exchange = self._send_keys("prefetch", keys, "prefetch keys")
        self._retry = None
        uniq, order, counts, asked = exchange
        union = np.unique(np.concatenate(asked)) if asked else np.empty(0, np.uint64)
        try:
            local = self.local.prefetch(union)
        except CacheFullError:
            self._retry = (keys, exchange)
            raise
        return DistPrefetched(uniq, order, counts, asked, local)

    def batch(self, pre: DistPrefetched, overlap: bool = False) -> DistBatch:
        """The load stage: the union this rank was asked for goes onto its device
        tier, and once its previous batch is applied (or, without `overlap`,
        written back) the rows go to the ranks that asked."""
        local = self.local.batch(pre.local, overlap=overlap)
        try:
            rows_out = [local.pull(a) for a in pre.asked]
            rows = self._return_rows("load", pre.keys, pre.order, rows_out, "load rows")
        except BaseException:
            local.abort()
            raise
        return DistBatch(self, local, pre, rows)

    def aligned(self, source: Iterable, empty) -> Iterator[_StepData]:
        """This rank's batches in lockstep with the other ranks': a rank whose data
        ends first takes part with empty batches until every rank's has ended.
        `empty` is an empty batch of the source's shape."""
        it = iter(source)
        done = False
        while True:
            batch = None if done else next(it, None)
            done = batch is None
            n = 0 if done else len(batch)
            flags = np.array([0 if done else 1, n], np.int64)
            self.node.allreduce("read", flags, "control", "read (who still has data)")
            if flags[0] == 0:
                return
            yield _StepData(empty if done else batch, int(flags[1]))

    def checkpoint(self, save=None, *, keep_previous: bool = False) -> int:
        """This rank's ParameterServer.checkpoint (local: the job's consistency is
        hps.train's, which keeps the previous checkpoint until every rank is done)."""
        return self.local.checkpoint(save, keep_previous=keep_previous)

    def prune_checkpoints(self) -> None:
        self.local.prune_checkpoints()

    def stats(self) -> dict:
        s = self.local.stats()
        s["distributed"] = {"rank": self.node.rank, "world": self.node.size, "nodes": self.node.nodes,
                            "bytes_sent": dict(self.node.bytes_sent)}
        return s

    def close(self) -> None:
        self.local.close()


# ---------------------------------------------------------------- dense parameters

def _flat(tensors) -> np.ndarray:
    return np.concatenate([t.detach().reshape(-1).numpy() for t in tensors]).astype(np.float32)


def _unflat(flat: np.ndarray, tensors) -> None:
    import torch
    at = 0
    for t in tensors:
        n = t.numel()
        t.copy_(torch.from_numpy(flat[at:at + n]).reshape(t.shape))
        at += n


@functools.lru_cache(maxsize=None)
def kstep_adam_class():
    """KStepAdam (a torch.optim.Optimizer; made on first use so that the core
    does not import torch)."""
    import torch

    class KStepAdam(torch.optim.Optimizer):
        """The local step of k-step Adam (the terabyte-scale paper's Algorithm 2):

            m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2;
            x <- x - lr m / sqrt(v)

        with m = 0 and v = eps to start, no bias correction and no eps in the
        denominator (v > 0 from the start keeps it finite). Every k steps
        DenseSync averages x and v over the ranks; m stays local."""

        def __init__(self, params, lr: float = 1e-3, beta1: float = 0.0, beta2: float = 0.999,
                     eps: float = 1e-8):
            super().__init__(params, {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                lr, b1, b2, eps = group["lr"], group["beta1"], group["beta2"], group["eps"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["m"] = torch.zeros_like(p)
                        st["v"] = torch.full_like(p, eps)
                    g = p.grad
                    st["m"].mul_(b1).add_(g, alpha=1 - b1)
                    st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    p.addcdiv_(st["m"], st["v"].sqrt(), value=-lr)

        def second_moments(self) -> list:
            out = []
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state[p]
                    if not st:
                        st["m"] = torch.zeros_like(p)
                        st["v"] = torch.full_like(p, group["eps"])
                    out.append(st["v"])
            return out

    return KStepAdam


def __getattr__(name: str):
    if name == "KStepAdam":
        return kstep_adam_class()
    raise AttributeError(f"module 'hps.distributed' has no attribute {name!r}")


class DenseSync:
    """Keeps the dense (torch) parameters of the ranks in step.

    ``allreduce``: call reduce_gradients() after backward, before the optimizer
    step: every rank sums the gradients and takes the same step.
    ``kstep``: use make_optimizer()'s KStepAdam and call after_step() after each
    step: every k steps x and v are averaged over the ranks."""

    def __init__(self, node: Node, params: Sequence, lr: float, config: Optional[DistributedConfig] = None):
        self.node = node
        self.config = config or node.config
        self.params = list(params)
        self.lr = lr
        self.steps = 0
        self.merges = 0
        self.optimizer = None

    def make_optimizer(self, default_factory):
        if self.config.dense_sync == "kstep":
            c = self.config
            self.optimizer = kstep_adam_class()(self.params, lr=self.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps)
        else:
            self.optimizer = default_factory(self.params)
        return self.optimizer

    def broadcast_parameters(self) -> None:
        """Rank 0's parameters to every rank (so all start from one model)."""
        import torch
        flat = _flat(self.params)
        with self.node.guard("broadcast of the dense parameters"):
            self.node.comms["train"].Bcast(flat, root=0)
        with torch.no_grad():
            _unflat(flat, self.params)

    def reduce_gradients(self) -> None:
        import torch
        if self.config.dense_sync != "allreduce" or self.node.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flat(grads)
        self.node.allreduce("train", flat, "dense", "dense gradient all-reduce", self.config.hierarchical)
        for p, g in zip(self.params, grads):
            p.grad = g
        with torch.no_grad():
            _unflat(flat, [p.grad for p in self.params])

    def after_step(self, final: bool = False) -> None:
        """Counts a step; every k steps (and at the end, `final`) averages x and v."""
        if self.config.dense_sync != "kstep":
            return
        if not final:
            self.steps += 1
            if self.steps % self.config.k:
                return
        elif self.steps % self.config.k == 0:
            return  # the last step merged already
        self.merge()

    def merge(self) -> None:
        import torch
        vs = self.optimizer.second_moments()
        flat = np.concatenate([_flat(self.params), _flat(vs)])
        self.node.allreduce("train", flat, "dense", "k-step Adam merge", self.config.hierarchical)
        flat /= self.node.size
        n = sum(p.numel() for p in self.params)
        with torch.no_grad():
            _unflat(flat[:n], self.params)
            _unflat(flat[n:], vs)
        self.merges += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps, "merges": self.merges}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.merges = state["steps"], state["merges"]
