"""This rank's place in an MPI job: configuration, communicators per pipeline stage,
node topology, byte counters, and the watchdog that aborts a job whose ranks stop
answering. Only :class:`Node` imports mpi4py, so a plain run never initialises MPI.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, Optional, Sequence

import numpy as np

from hps.config import is_int, is_number
from hps.errors import HpsError

# MPI's counts and offsets are ints: an exchange's bytes to or from one rank must be
# fewer (Node.alltoallv).
MESSAGE_LIMIT = 2**31

COMM_KINDS = ("sparse_keys", "sparse_rows", "sparse_grads", "examples", "plan", "dense", "control", "admission")


# The abort under way in this process: its reason, once abort_job has said it.
_abort_lock = threading.Lock()
_aborting: Optional[str] = None


def abort_job(world, why: str, code: int = 70, detail: str = "") -> None:
    """Writes `why` on stderr and ends every rank of `world`'s job (MPI_Abort).
    Only the first call of the process says "aborting the job": in the moment
    before the abort ends it, another stage of the rank fails too (its step's
    exchanges or batches went with the first failure), and a second such line
    read as a second cause. A later call's reason is written marked as coming
    after it (once the same reason: nothing); it ends the job as the first.
    `detail` (a failure's traceback) is written just before the line, and only
    where the line is: a stage that raised the first failure's error again
    printed its whole traceback a second time.

    MPICH's MPI_Abort returns: mpiexec's proxy kills the ranks a moment later.
    So the abort stays under way once said, for the rest of the process: a
    stage that fails after the first Abort returned (the train loop's own
    handler, reporting the error the train stage raised) would otherwise say
    "aborting the job" a second time."""
    global _aborting
    with _abort_lock:
        first = _aborting
        if first is None:
            _aborting = why
    if first is None:
        sys.stderr.write(f"{detail}{why}; aborting the job\n")
    elif why != first:
        sys.stderr.write(f"{detail}{why} (after the failure above, whose abort of the job is under way)\n")
    sys.stderr.flush()
    # MPI_Abort has mpiexec's proxy kill the ranks and stop forwarding their
    # output, and CI runs lost this line to that race twice; a moment lets the
    # proxy carry the reason out before the abort reaches it.
    time.sleep(1.0)
    world.Abort(code)


class RankFailure(HpsError):
    """The ranks disagree about the job (world size, checkpoint step) or are out of
    step (Node.allgather), raised on every rank alike; or a peer failed before an
    exchange, raised on every rank but that one, which raises its own error
    (Node.give_up). No exchange is owed after it."""


class _FailedAfter(Exception):
    """A rank's failure after a call's last exchange, told in its next exchange
    (Node.owe): its text names the error and the exchange it followed."""


def raised_on_every_rank(e: BaseException) -> bool:
    """Whether every rank of the job raised with `e`, so that no exchange is owed
    after it: a RankFailure, or the error of a rank whose peers heard of it in an
    exchange and raised RankFailure there (Node.give_up)."""
    return isinstance(e, RankFailure) or getattr(e, "_hps_raised_on_every_rank", False)


def mark_raised_on_every_rank(e: BaseException) -> BaseException:
    """e, marked as raised_on_every_rank's."""
    try:
        e._hps_raised_on_every_rank = True
    except AttributeError:  # (an exception type without a __dict__)
        pass
    return e


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


# Launcher variables that give the ranks of this job on this machine, the most exact
# first: Open MPI's, MPICH Hydra's and a PMIx launcher's count the ranks started here
# (an mpiexec inside a Slurm job sets them, and its layout is not Slurm's); then
# Slurm's layouts of tasks over the nodes (srun's step, then the job), of which this
# machine's entry is the one at SLURM_NODEID; then --ntasks-per-node, the same on
# every node.
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE")
SLURM_LAYOUT_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def slurm_tasks_on_node(layout: str, node: int, name: str) -> int:
    """The tasks on node `node` (0-based) of a Slurm task layout as Slurm writes it:
    comma-separated groups "COUNT" or "COUNT(xNODES)", e.g. "4(x2),3" (4 tasks on
    nodes 0 and 1, 3 on node 2). `name` is the variable, for the error."""
    groups = []  # (tasks a node, nodes), the whole layout read before this node's is taken
    for group in layout.split(","):
        count, _, repeat = group.strip().partition("(x")
        try:
            tasks, nodes = int(count), int(repeat[:-1]) if repeat else 1
            if (repeat and not repeat.endswith(")")) or tasks < 1 or nodes < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"{name} = {layout!r}: {group!r} is not a task count (as '4' or '4(x2)')") from None
        groups.append((tasks, nodes))
    first = 0
    for tasks, nodes in groups:
        if node < first + nodes:
            return tasks
        first += nodes
    raise ValueError(f"{name} = {layout!r} lists {first} node(s), and this is node {node} (SLURM_NODEID)")


def local_ranks_from_environment(environ=None) -> tuple[int, str]:
    """The ranks of this job on this machine (this one included) as the launcher's
    environment tells before MPI starts, and the variable that told it:
    (1, "") where none does (a plain run; a launcher that sets none of them).
    A variable set to what no launcher writes raises ValueError naming it: the
    count would be a guess."""
    env = os.environ if environ is None else environ
    for name in LOCAL_SIZE_VARIABLES:
        if name in env:
            return _ranks_in(env, name), name
    for name in SLURM_LAYOUT_VARIABLES:
        layout = env.get(name)
        if layout is None:
            continue
        node = env.get("SLURM_NODEID", "0")
        if not node.isdigit():
            raise ValueError(f"SLURM_NODEID = {node!r} is not a node number (an int >= 0)")
        return slurm_tasks_on_node(layout, int(node), name), name
    if "SLURM_NTASKS_PER_NODE" in env:
        return _ranks_in(env, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"
    return 1, ""


def _ranks_in(env, name: str) -> int:
    """The number of ranks variable `name` of `env` holds (an int >= 1)."""
    value = env[name]
    try:
        ranks = int(value)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(f"{name} = {value!r} is not a number of ranks (an int >= 1)")
    return ranks


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
    sparse_rows: str = "none"       # codec of embedding rows between ranks: "none", "bf16", "int8"
    sparse_grads: str = "none"      # codec of sparse gradients between ranks: the same choices

    def check(self, source: str = "[distributed]") -> None:
        if self.dense_sync not in ("allreduce", "kstep"):
            raise ValueError(f"{source}: dense_sync must be 'allreduce' or 'kstep', got {self.dense_sync!r}")
        if not (is_int(self.k) and self.k >= 1):
            raise ValueError(f"{source}: k must be an int >= 1, got {self.k!r}")
        if not all(is_number(b) and 0.0 <= b < 1.0 for b in (self.beta1, self.beta2)):
            raise ValueError(f"{source}: beta1 and beta2 must be in [0, 1), got {self.beta1!r}, {self.beta2!r}")
        if not (is_number(self.eps) and 0 < self.eps < math.inf):
            raise ValueError(f"{source}: eps must be a finite number > 0, got {self.eps!r}")
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"{source}: hierarchical must be true or false, got {self.hierarchical!r}")
        if not (is_int(self.ranks_per_node) and self.ranks_per_node >= 0):
            raise ValueError(f"{source}: ranks_per_node must be an int >= 0 (0: the ranks sharing a machine), got "
                             f"{self.ranks_per_node!r}")
        if not (is_number(self.timeout) and self.timeout > 0):
            raise ValueError(f"{source}: timeout must be > 0 seconds, got {self.timeout!r}")
        for name in ("sparse_rows", "sparse_grads"):
            spec = getattr(self, name)
            if spec not in ("none", "bf16", "int8"):
                raise ValueError(f"{source}: {name} must be 'none', 'bf16' or 'int8' (a codec a row; top-k's error "
                                 f"feedback needs the same tensor every step, which sparse rows are not), got {spec!r}")


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
        world = comm if comm is not None else MPI.COMM_WORLD
        self.world = world
        self.rank, self.size = world.Get_rank(), world.Get_size()
        rpn = self.config.ranks_per_node
        # Checked on every rank, then told in the ranks' first exchange (before any
        # watchdog runs): a rank that refused its own config (its own file) left
        # the others waiting in the communicators' Dup for ever.
        failed = None
        try:
            self.config.check()
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("hps.distributed needs an MPI with MPI_THREAD_MULTIPLE (the pipeline's stages "
                                   "run collectives from their own threads)")
            if rpn and self.size % rpn:
                raise ValueError(f"[distributed] ranks_per_node = {rpn} does not divide the {self.size} ranks")
        except Exception as e:  # noqa: BLE001 - told to the peers, then raised
            failed = e
        every = world.allgather(None if failed is None else f"{type(failed).__name__}: {failed}")
        if failed is not None:
            raise mark_raised_on_every_rank(failed)
        refused = [f"rank {r} refused its config ({e})" for r, e in enumerate(every) if e is not None]
        if refused:
            raise RankFailure(f"hps.distributed.Node: {'; '.join(refused)}: every rank's node is refused")
        self.comms = {stage: world.Dup() for stage in self.STAGES}
        self.bytes_sent = {kind: 0 for kind in COMM_KINDS}
        self._bytes_lock = threading.Lock()
        if rpn:
            self.node_comm = world.Split(self.rank // rpn, self.rank)
        else:
            self.node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        # The ranks of `world` sharing this machine's memory (this one included),
        # whatever ranks_per_node groups: each holds an admission sketch (hps.train).
        shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank) if rpn else self.node_comm
        self.machine_ranks = shared.Get_size()
        if shared is not self.node_comm:
            shared.Free()
        local = self.node_comm.Get_rank()
        self.cross_comm = world.Split(local, self.rank)  # the same local rank on every node
        sizes = world.allgather(self.node_comm.Get_size())
        self.nodes = self.cross_comm.Get_size()
        self.uniform_nodes = len(set(sizes)) == 1
        self._closed = False
        # This rank's failures after a call's last exchange, which its peers have not
        # heard of (owe): by stage, the one its next exchange there tells; and the
        # one its peers wait for in an exchange it will not make, with the thread
        # whose next collective tells it there.
        self._owed: dict = {}
        self._owed_waiting: Optional[tuple] = None  # (thread, stage, what, failed)
        self._watchdog = _Watchdog(self, self.config.timeout)

    # -- failure
    def abort(self, why: str, code: int = 70, detail: str = "") -> None:
        """Says why on stderr (after `detail`: abort_job) and ends every rank of the job (MPI_Abort)."""
        abort_job(self.world, f"hps.distributed: rank {self.rank} of {self.size}: {why}", code, detail)

    def guard(self, what: str):
        return self._watchdog.guard(what)

    def count(self, kind: str, nbytes: int) -> None:
        with self._bytes_lock:
            self.bytes_sent[kind] += int(nbytes)

    # -- collectives
    def alltoallv(self, stage: str, blocks: Optional[Sequence[np.ndarray]], kind: str, what: str,
                  failed: Optional[Exception] = None, tell: int = 0,
                  heard: Optional[np.ndarray] = None) -> list[np.ndarray]:
        """Sends blocks[r] to rank r; returns what each rank sent here, in rank
        order. Blocks share one dtype and trailing shape, on every rank.

        ``failed``: the error this rank raised while it made its blocks (None is
        passed for them), for its peers to hear in the exchange's first step
        rather than wait in it for a rank that has left: every rank then gives
        the exchange up and raises, this one `failed`, the others RankFailure
        naming it (give_up). A rank's checks of its own input (its keys, its
        gradients) are made before its first exchange and told there, at no cost
        of a collective of their own. So is what every rank refuses of the
        exchange itself (rows of other sizes, MPI's 2 GiB limit): every rank
        raises, none waits in the exchange for one that refused it.

        ``tell``: an int64 this rank tells every rank in that first step (at no
        cost); ``heard`` (W,), if given, gets each rank's, in rank order."""
        MPI = self.MPI
        comm = self.comms[stage]
        self._tell_waiting()
        if failed is None:
            # A failure of this rank after a call's last exchange on this communicator
            # (owe): this exchange, every rank's next one there, is given up.
            failed = self._owed.pop(stage, None)
        largest = 0  # the bytes of this rank's largest block
        if failed is None:
            first = blocks[self.rank]
            tail = first.shape[1:]
            row_bytes = first.dtype.itemsize * int(np.prod(tail, dtype=np.int64))
            send_counts = np.array([len(b) for b in blocks], np.int64)
            largest = int(send_counts.max()) * row_bytes
            if int(send_counts.sum()) * row_bytes >= MESSAGE_LIMIT:
                failed = ValueError(f"{what}: this rank sends {int(send_counts.sum())} rows of {row_bytes} bytes, "
                                    f"past MPI's 2 GiB message limit; use smaller batches")
        if failed is not None:
            row_bytes, send_counts, largest = 0, np.zeros(self.size, np.int64), 0
        # To each rank: the rows of its block and the bytes a row (the receiver sizes
        # its buffer from the rows, so a peer whose rows are of another size, another
        # hps version's layout, is refused rather than its bytes read as rows of this
        # size: MPI fills a larger buffer in part, without a word); whether this rank
        # failed before the exchange (`failed`); the bytes of its largest block (MPI's
        # limit, below); and `tell`. The same to every rank but the rows.
        header = np.stack([send_counts] + [np.full(self.size, v, np.int64)
                                           for v in (row_bytes, failed is not None, largest, tell)], axis=1)
        got = np.empty_like(header)
        with self.guard(f"{what} (counts)"):
            comm.Alltoall(header, got)
        if failed is not None or got[:, 2].any():
            self._given_up(comm, what, failed)
        if heard is not None:
            heard[:] = got[:, 4]
        recv_counts = np.ascontiguousarray(got[:, 0])
        # Every rank's row size is in the header, so every rank refuses rows of
        # other sizes alike, whichever ranks they would go between: the two ends of
        # a pair refused them alone, and a third rank waited in the exchange for
        # them until the watchdog's timeout.
        if (got[:, 1] != got[0, 1]).any():
            sizes = ", ".join(f"rank {r}'s {int(b)} bytes" for r, b in enumerate(got[:, 1]))
            raise RankFailure(f"{what}: the ranks' rows differ in size ({sizes}): the ranks run other versions of hps "
                              f"or configs")
        # MPI's counts and offsets are ints of bytes: no rank sends (checked above,
        # before the header) or receives 2 GiB. A rank's receipts are at most the
        # ranks' largest blocks together, which every rank has heard: under the
        # limit (any exchange of less than 2 GiB), no rank need check. Past it (the
        # exchange moves that much), each rank checks its own, and the ranks agree
        # in a collective of their own before any rank sends a row: a rank that
        # refused its receipts alone left the others in the exchange.
        if int(got[:, 3].sum()) >= MESSAGE_LIMIT:
            over = None
            if int(recv_counts.sum()) * row_bytes >= MESSAGE_LIMIT:
                over = ValueError(f"{what}: this rank receives {int(recv_counts.sum())} rows of {row_bytes} bytes, "
                                  f"past MPI's 2 GiB message limit; use smaller batches")
            self.confirm(stage, what, over)
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

    def give_up(self, stage: str, what: str, failed: Exception) -> NoReturn:
        """This rank failed (`failed`) before exchange `what` on stage `stage`'s
        communicator, the next one its peers meet it in: it takes part in the
        exchange's first step only, to tell them, and every rank raises there
        (alltoallv's `failed`). Call it where the error is caught."""
        self.alltoallv(stage, None, "", what, failed=failed)
        raise AssertionError("unreachable: alltoallv raises for a rank that failed")  # pragma: no cover

    def owe(self, stage: str, after: str, failed: Exception) -> None:
        """This rank failed (`failed`, which it raises) after exchange `after`, the
        last of its call on stage `stage`'s communicator, where its peers' calls
        returned, none the wiser. Its next exchange there (alltoallv), which is
        every rank's next one there, is given up on every rank: every rank raises
        RankFailure naming this rank and `failed`, this one too (it raised `failed`
        already). No collective is added to a call that succeeds; rather than
        going on unaware, or pairing that exchange with another call of this
        rank's (one it skipped after its failure), the peers hear of it there."""
        self._owed.setdefault(stage, _FailedAfter(f"{type(failed).__name__} after {after}: {failed}"))

    def owe_waiting(self, stage: str, what: str, failed: Exception) -> None:
        """This rank failed (`failed`, which it raises) after its call's last
        exchange, where its peers went on into exchange `what` on stage `stage`'s
        communicator, which this rank will not make (a later exchange of the same
        batch, which failed here), and wait there. This rank's next collective,
        made from this thread, first tells them there (give_up: they raise
        RankFailure naming this rank and `failed`), then goes on. From this thread
        alone: a pipeline's other stages use their communicators from threads of
        their own, and its stage that raised makes no collective again (hps train
        ends the job for it)."""
        if self._owed_waiting is None:
            # (the thread itself: an ident may be a dead thread's, given to a new one)
            self._owed_waiting = (threading.current_thread(), stage, what, failed)

    def _tell_waiting(self) -> None:
        """What owe_waiting recorded, told to the peers where they wait, if this
        thread recorded it; this rank goes on."""
        owed = self._owed_waiting
        if owed is None or owed[0] is not threading.current_thread():
            return
        self._owed_waiting = None
        _, stage, what, failed = owed
        try:
            self.give_up(stage, what, failed)
        except BaseException as e:
            if e is not failed:
                raise

    def confirm(self, stage: str, what: str, failed: Optional[Exception] = None) -> None:
        """A collective of its own, on stage `stage`'s communicator, where a rank
        may have failed after a call's last exchange (`failed`: its error, else
        None): returns on every rank when none did; else every rank raises, this
        one `failed`, the others RankFailure naming each rank that failed. For
        what only some calls need (a step whose sums may overflow): a call's
        checks of its own input are told in its first exchange (alltoallv)."""
        comm = self.comms[stage]
        self._tell_waiting()
        flag = np.array([failed is not None], np.int64)
        with self.guard(f"{what} (check)"):
            comm.Allreduce(self.MPI.IN_PLACE, flag, op=self.MPI.MAX)
        if flag[0]:
            self._given_up(comm, what, failed)

    def _given_up(self, comm, what: str, failed: Optional[Exception]) -> NoReturn:
        """Every rank, once some rank failed before exchange `what` (alltoallv's
        header said so, or confirm's collective): the ranks' errors, gathered on
        the exchange's own communicator; this rank's own error is raised again,
        else RankFailure naming each rank that failed and its error."""
        owed = isinstance(failed, _FailedAfter)  # (raised by this rank already, in the call it failed)
        mine = None if failed is None else str(failed) if owed else f"{type(failed).__name__}: {failed}"
        with self.guard(f"{what} (errors)"):
            every = comm.allgather(mine)
        if failed is not None and not owed:
            raise mark_raised_on_every_rank(failed)
        said = "; ".join(f"rank {r} failed before the exchange ({e})" for r, e in enumerate(every) if e is not None)
        raise RankFailure(f"{what}: {said}: every rank gives it up")

    def allreduce(self, stage: str, buf: np.ndarray, kind: str, what: str, hierarchical: bool = False) -> np.ndarray:
        """Sums buf over the ranks, in place. `hierarchical` goes across nodes, then
        within them, over communicators of their own: only the train stage uses it."""
        self._tell_waiting()
        with self.guard(what):
            if hierarchical:
                hierarchical_allreduce(buf, self.node_comm, self.cross_comm, lambda n: self.count(kind, n),
                                       uniform=self.uniform_nodes)
                return buf
            self.comms[stage].Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        if self.size > 1:
            self.count(kind, buf.nbytes)
        return buf

    def allgather(self, stage: str, obj: Any, what: str, note: Optional[str] = None) -> list:
        """Every rank's obj, in rank order. Each rank's `what` travels with it: ranks
        that meet in allgathers of different operations are out of step (one of
        them failed, and went on to tell the others while they were in the next
        exchange), and every rank raises RankFailure naming each rank's operation
        and `note` (what failed), rather than take one operation's objects for
        another's and wait in the next exchange for a rank that has left."""
        self._tell_waiting()
        with self.guard(what):
            every = self.comms[stage].allgather((what, note, obj))
        if len({w for w, _, _ in every}) > 1:
            raise RankFailure("the ranks are out of step: " + "; ".join(
                f"rank {r} in {w}" + (f" ({n})" if n else "") for r, (w, n, _) in enumerate(every)))
        return [o for _, _, o in every]

    def close(self) -> None:
        """Stops the watchdog and frees the communicators this node made, once this
        rank's exchanges are over (again: a no-op). MPI caps the communicators a
        process holds (MPICH: 2048), and a process may run one job after another.
        Collective: every rank of the job closes its node."""
        if not self._closed:
            self._tell_waiting()  # (the peers wait in an exchange, not here)
        self._watchdog.stop()
        if self._closed:
            return
        self._closed = True
        for comm in (self.cross_comm, self.node_comm, *reversed(list(self.comms.values()))):
            comm.Free()


def hierarchical_allreduce(buf: np.ndarray, node_comm, cross_comm, count=lambda nbytes: None,
                           uniform: Optional[bool] = None) -> np.ndarray:
    """Sums buf over all ranks, in place, the MLSys 2020 paper's way (appendix C.3):
    first across nodes, each rank exchanging with the rank of the same local index
    on its partner node (recursive doubling: log2(nodes) pairwise exchanges, with
    the nodes beyond a power of two folded in first), then within each node.
    `count(n)` is told the bytes each send moves.

    That needs every node to hold as many ranks: on nodes of 2 and 1 ranks, the
    lone rank summed only the ranks of local index 0 and missed the others. Nodes
    of other sizes (`uniform` False; None: found out here, by two small
    collectives) sum within each node onto its first rank, those ranks across the
    nodes, and the first rank sends the sum to the others of its node."""
    from mpi4py import MPI
    if uniform is None:
        sizes = cross_comm.allgather(node_comm.Get_size())  # every node's, on the ranks of local index 0
        uniform = not node_comm.allreduce(len(set(sizes)) > 1)
    if uniform:
        _recursive_doubling(buf, cross_comm, count)
        if node_comm.Get_size() > 1:
            node_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            count(buf.nbytes)
        return buf
    first = node_comm.Get_rank() == 0
    if node_comm.Get_size() > 1:
        node_comm.Reduce(MPI.IN_PLACE if first else buf, buf if first else None, op=MPI.SUM, root=0)
        if not first:
            count(buf.nbytes)
    if first:  # (the ranks of local index 0: one a node)
        _recursive_doubling(buf, cross_comm, count)
    if node_comm.Get_size() > 1:
        node_comm.Bcast(buf, root=0)
        if first:
            count(buf.nbytes)
    return buf


def _recursive_doubling(buf: np.ndarray, cross_comm, count) -> None:
    """Sums buf over cross_comm's ranks, in place (hierarchical_allreduce's step across nodes)."""
    n, me = cross_comm.Get_size(), cross_comm.Get_rank()
    if n == 1:
        return
    pof2 = 1 << (n.bit_length() - 1)
    tmp = np.empty_like(buf)
    # Nodes beyond the power of two hand their sums to a partner and wait.
    if me >= pof2:
        cross_comm.Send(buf, dest=me - pof2, tag=11)
        count(buf.nbytes)
        cross_comm.Recv(buf, source=me - pof2, tag=12)
        return
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
