"""The node parameter server: device tier, MEM-PS cache and SSD-PS composed.

Rows (embedding + optimizer state, float32) live in SSD-PS under
``<path>/ssd``; the MEM-PS cache holds the hot ones within a byte budget; a
batch's working set is pinned in MEM-PS and loaded onto the device tier,
where workers pull embeddings and push gradients (summed at each key's owner
device, then one optimizer step per key); the updated rows go back to MEM-PS,
and from there, when evicted, to SSD-PS. A row never seen is initialised as a
pure function of (seed, key), so it needs no storage until it is updated.

Bounded tables (``ttl_steps``, ``max_rows``; docs/parameter_server.md): a step
is a batch of this server. With a bound set, each batch stamps SSD-PS with the
step, so a row's file tells when it was last updated (a dirty row reaches a
file when MEM-PS evicts it, or at the checkpoint's flush: its stamp is at
least its last update and at most the next checkpoint's step); with none, the
stamp moves at checkpoints only (see _advance_step). At each checkpoint, after the
flush and before the commit, SsdStore.bound() erases the rows stamped more
than ttl_steps before the step, then the oldest beyond max_rows, and MEM-PS
drops their copies; an erased key reads as new (its initial row) next time.

checkpoint() makes everything durable as a numbered snapshot under
``<path>/checkpoints``; ParameterServer.open(path) resumes from the last
checkpoint exactly. A crash at any moment, in the middle of a checkpoint too,
loses the updates since the last finished checkpoint and nothing else.

Layout of ``<path>``::

    hps-parameter-server.json   the config, and the number of the last finished checkpoint
    ssd/                        the live SSD-PS store
    checkpoints/000007/         checkpoint 7: ssd/ (hard links to its parameter files, a
                                copy of the store's MANIFEST and STORE) and what the
                                caller saved beside it (hps train: trainer-state.pt)

How a checkpoint is made (ParameterServer.checkpoint): the dirty MEM-PS rows go
to SSD-PS and the store commits; then the snapshot is made in
``checkpoints/000007.tmp`` and renamed into place; then the metadata names it.
That last atomic rename is the commit point: until it, opening rolls back to the
checkpoint before. Parameter files are immutable, so a hard link is a cheap
and exact copy of one, and a snapshot holds its own links, so the files of a
checkpoint outlive a compaction that deletes them from the live store. Only
the MANIFEST (appended to) and the STORE marker are copied.

Opening rebuilds the live store from the checkpoint the metadata names (or the
one asked for: an MPI job rolls every rank back to the checkpoint that all of
them finished), so nothing written after that checkpoint survives, and drops
every other snapshot. A server with no checkpoint yet opens empty, as it started.
A rank of an MPI job (``<job>/rank<r>``, r below job.json's world) opened at its
last checkpoint opens at the one job.json names, as the job's own resume does:
its metadata may name another (a reshard's switch leaves an old rank's at K where
job.json names K+1; a crash between the rank's checkpoint and job.json's rewrite
leaves it at K+1 where job.json names K), and opened there the job's checkpoint
went. A directory that is no rank of its job any more (r at or past job.json's
world, or beside a reshard to one process's resharded-from.json: what a reshard
left to remove, or is writing) is refused, as hps.jobdir's readers refuse it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import json
import os
import socket
import shutil
import threading
import time
import uuid
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import numpy as np

from hps import _core
from hps import topology as htopo
from hps.config import check_fields, load_toml, parse_bytes
from hps.data.keys import ADMISSION_DEFAULT_KEY
from hps.errors import CorruptionError
from hps.mem_cache import POLICIES, MemCache
from hps.optim import SGD, AdaGrad, Adam, Normal, RowWiseAdaGrad, Uniform, Zeros, native_optimizer
from hps.ssd_store import SsdStore
from hps.batch_base import BatchBase as _BatchBase
from hps.batch_base import held_here, prefetched_positions, release_after
from hps.worker_caches import HeraldBatch, WorkerCaches

METADATA = "hps-parameter-server.json"
FORMAT_VERSION = 2  # 2: checkpoints are snapshots under checkpoints/ (1: the live store was the checkpoint)
CHECKPOINTS = "checkpoints"
LAST = "last"  # ParameterServer(checkpoint=LAST): the checkpoint the metadata names
_STORE_DIR = "ssd"
_MANIFEST = "MANIFEST"  # the store's (docs/ssd_format.md), appended to: a snapshot copies it
WRITER_LOCK = ".hps-writer.lock"  # flock'ed by the one ParameterServer open at a path
# The metadata's (and a job's job.json's) "run": a random id that a new run at the path
# gets (one started over, or a job resharded: its stores' files are numbered anew). An
# export's position records it, so that a position never applies to another run's files.
RUN = "run"
_MAX_BOUND = (1 << 63) - 1  # the largest ttl_steps and max_rows
SERVER_STEP = "server-step.json"  # in a checkpoint: the server's step (batches) when it was made
JOB_MANIFEST = "job.json"  # an MPI job's, at its root (hps.train's): its world and the checkpoint every rank finished


def bound_store(ssd, step: int, ttl_steps: int, max_rows: int) -> dict:
    """Bounded tables' erase of an SsdStore at a checkpoint of `step`: the rows
    stamped more than ttl_steps before it, then the oldest beyond max_rows (0:
    off); SsdStore.bound's {"expired", "capped"} keys. A checkpoint's store is
    bounded so wherever it is written: the server's checkpoint, and a reshard's.

    Admission's default row (ADMISSION_DEFAULT_KEY) is exempt: the checkpoint must
    hold it for the keys never admitted (a Lookup answers them with it, an export
    writes it), also when no batch read it for ttl_steps or it is among the oldest.
    It is written again at `step` first (its bytes: it is never trained), the
    newest row, one of the max_rows kept."""
    if not (ttl_steps or max_rows):
        return ssd.bound(0, 0)
    default = np.array([ADMISSION_DEFAULT_KEY], np.uint64)
    row, found = ssd.get(default)
    if found.all():
        ssd.set_stamp(max(int(ssd.stamp), int(step)))  # (stamps never go back)
        ssd.put(default, np.ascontiguousarray(row))
    min_stamp = step - ttl_steps if ttl_steps and step > ttl_steps else 0
    return ssd.bound(min_stamp, max_rows)


def new_run_id() -> str:
    return uuid.uuid4().hex


class PathInUseError(OSError):
    """Another ParameterServer (this process's or another's) has the path open."""


@contextlib.contextmanager
def _ordered_with_torch(t):
    """Orders the tier's reads and writes of a CUDA tensor's memory with torch's.
    The tier's copies and kernels run on the device's legacy default stream, which
    waits for torch's default stream but not for a stream of the caller's
    (torch.cuda.Stream: non-blocking). So on such a stream, the work that writes
    t (a backward pass's gradients) is waited for first, and torch's later work
    there (which may reuse t's memory once the caller drops it) waits for the
    tier's. On the default stream, or for host memory, nothing is needed."""
    if t.device.type != "cuda":
        yield
        return
    import torch
    current = torch.cuda.current_stream(t.device)
    legacy = torch.cuda.default_stream(t.device)
    if current == legacy:
        yield
        return
    current.synchronize()
    try:
        yield
    finally:
        current.wait_stream(legacy)


def _lock_path(path: str, doing: str = "") -> int:
    """Takes the path's writer lock and returns its file descriptor (closing it
    releases the lock; so does the process's end, however it ends). Two servers at
    one path would each write parameter files of the same sequence numbers and
    overwrite each other's MANIFEST, and the first sign was a later `create: File
    exists`. `doing`: what the holder does there, for the message of whoever is
    refused (a reshard holds its job's directories: hps.reshard.Hold).

    The lock file is removed only by a process that holds it (the removal of a run
    that never checkpointed, a reshard's of rank directories). A process that opened
    it just before and locks it just after holds the lock of a file no path names,
    while the next to come creates another and locks that: the lock counts only if
    the path still names the file locked, else it is taken again."""
    lock = os.path.join(path, WRITER_LOCK)
    removed = False  # the file this process locked was removed, and it tries again
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            if removed:  # (a reshard removed the directory, and what was there went with it)
                raise PathInUseError(f"{path}: another run removed this directory while this one was taking its "
                                     f"writer lock; run again") from None
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                gc.collect()  # a server of this process, dropped but not yet collected, lets go
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process that wrote no name"
            os.close(fd)
            raise PathInUseError(f"{path}: another parameter server has this path open ({holder}); two at one "
                                 f"path would overwrite each other's files. Close it (or stop its hps train) "
                                 f"first, or give another path") from None
        if _names_file(lock, fd):
            break
        os.close(fd)  # removed between the open and the lock: open the path's file anew
        removed = True
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{', ' + doing if doing else ''}\n".encode(), 0)
    return fd


def _names_file(path: str, fd: int) -> bool:
    """Whether path names the file open as fd (not another, nor none)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


_OPTIMIZERS = {"sgd": SGD, "adagrad": AdaGrad, "rowwise_adagrad": RowWiseAdaGrad, "adam": Adam}
_INITIALIZERS = {"uniform": Uniform, "normal": Normal, "zeros": Zeros}


@dataclass
class SsdOptions:
    file_records: int = 1 << 16
    compaction_trigger: float = 1.5
    use_io_uring: bool = True
    direct_io: bool = True
    require_direct_io: bool = False  # a refused O_DIRECT raises hps.IoError instead of warning


def mem_lookahead_room(config: "ParameterServerConfig", row_bytes: int, batch_keys: Optional[int] = None) -> int:
    """Bytes of ``config.mem_budget`` that MEM-PS keeps for its lookahead window
    (``lookahead_room``; "auto": none with ``lookahead = 0``, else room for what its
    forced evictions may list, ``MemCache.lookahead_base_room`` of the rows the budget
    holds at most, plus, for the window's keys, tables and entries: with `batch_keys`
    (the most keys a batch gives MEM-PS, repeats counted: `hps train` knows them) the
    most ``lookahead`` such batches hold, ``MemCache.lookahead_window_room``, else a
    16th of the budget). The rows get the rest."""
    if config.lookahead_room != "auto":
        return parse_bytes(config.lookahead_room, "lookahead_room")
    if not config.lookahead:
        return 0
    budget = parse_bytes(config.mem_budget, "mem_budget")
    if batch_keys is not None:
        rows = _core.MemCache.capacity_for_budget(budget, row_bytes)  # at least the rows the rest holds
        # (may pass the budget: the caller refuses it, naming the window, hps.train's check)
        return (_core.MemCache.lookahead_window_room(batch_keys, config.lookahead, rows)
                + _core.MemCache.lookahead_base_room(rows))
    keys = budget // 16
    rows = _core.MemCache.capacity_for_budget(budget - keys, row_bytes)  # at least the rows the rest holds
    return min(budget, keys + _core.MemCache.lookahead_base_room(rows))


@dataclass
class ParameterServerConfig:
    """What a parameter server is. ``dim``, ``optimizer`` (its kind), ``initializer``
    and ``seed`` fix what the stored rows mean and cannot change for a path; the
    rest may differ from one run to the next."""

    dim: int
    path: str
    optimizer: Any = field(default_factory=AdaGrad)
    initializer: Any = field(default_factory=Uniform)
    seed: int = 0
    mem_budget: Union[int, str] = "1GiB"
    cache_policy: str = "tinylfu-lfu"     # the best of W3 (docs/benchmarks.md)
    prefault: bool = False              # write MEM-PS's whole row arena when the server opens: the
                                        # budget is resident at once, and training never waits on
                                        # the kernel's first touch of a page
    devices: int = 1                    # GPUs when the node has that many, else host partitions
    device_capacity: int = 1 << 22      # most rows per device: a batch's working set / devices must fit
    write_buffer_rows: int = 1 << 16    # evicted dirty rows gathered per SSD-PS put
    device_threads: int = 1             # CPU threads per host partition (0: all cores); a batch's
                                        # rows are few, and the trainer needs the cores
    host_in_place: bool = True          # one host partition (no GPU): batches train on MEM-PS's
                                        # pinned rows (HostBatch) instead of a device-table copy
    schedule: str = "sequential"        # "herald": rows stay in per-device caches between batches and
                                        # examples go to the devices that hold their rows (hps.worker_caches)
    worker_cache_rows: int = 1 << 16    # schedule = "herald": rows a device's cache keeps between batches
    lookahead: int = 0                  # batches ahead whose keys the caches keep when they must evict
                                        # (the pipeline's prefetch passes them; 0: the policy alone decides)
    lookahead_room: Union[int, str] = "auto"  # bytes of mem_budget for MEM-PS's lookahead window (the rows
                                        # get the rest; stats()["mem"]["lookahead_bytes"] never passes it):
                                        # "auto": none with lookahead = 0, else room for the window's keys
                                        # (hps train: the most its batches hold; alone: a 16th of
                                        # mem_budget) and what its forced evictions list (24 B a row)
    ttl_steps: int = 0                  # bounded tables: a row not updated for more than this many steps
                                        # (batches) is erased at the next checkpoint; 0: never
    max_rows: int = 0                   # and at most this many rows are kept (per rank under mpiexec), the
                                        # least recently updated erased beyond it; 0: no cap
    topology: Optional[str] = None      # a topology file (hps.topology) whose routes the device tier's
                                        # transfers take, tier device g its endpoint g, the host executor
                                        # copying (relays staged on the middleman); None: flat host partitions
    ssd: SsdOptions = field(default_factory=SsdOptions)

    LAYOUT_FIELDS = ("dim", "optimizer.kind", "initializer", "seed")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["optimizer"] = {"kind": self.optimizer.kind, **dataclasses.asdict(self.optimizer)}
        d["initializer"] = {"kind": self.initializer.kind, **dataclasses.asdict(self.initializer)}
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "ParameterServerConfig":
        check_fields(cls, d, source)
        d = dict(d)
        for name in ("dim", "path"):
            if name not in d:
                raise ValueError(f"{source}: missing field '{name}'")
        d["optimizer"] = _build(d.get("optimizer", {"kind": "adagrad"}), _OPTIMIZERS, f"{source}: optimizer")
        d["initializer"] = _build(d.get("initializer", {"kind": "uniform"}), _INITIALIZERS,
                                  f"{source}: initializer")
        ssd = d.get("ssd", {})
        if not isinstance(ssd, SsdOptions):
            check_fields(SsdOptions, ssd, source, prefix="ssd.")
            ssd = SsdOptions(**ssd)
        d["ssd"] = ssd
        return cls(**d)

    def check(self, source: Optional[str] = None) -> None:
        """Raises ValueError naming the first field whose value no server takes
        (after ``source``, the file, where given). ParameterServer checks its
        config before it creates anything at the path, so a refused config
        leaves no job directory behind (the next run would find a run that
        "ended before its first checkpoint")."""
        where = f"{source}: " if source else ""

        def whole(name: str, value, least: int, why: str = "") -> None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise ValueError(f"{where}{name} must be an int >= {least}{why}, got {value!r}")

        whole("dim", self.dim, 1)
        try:  # the optimizer's and initializer's values (lr > 0, ...), as the native optimizer takes them
            native_optimizer(self.dim, self.optimizer, self.initializer, self.seed)
        except (TypeError, ValueError) as e:  # (TypeError: a value of the wrong type, lr = "0.05")
            raise ValueError(f"{where}{e}") from None
        try:
            parse_bytes(self.mem_budget, "mem_budget")
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}{e}") from None
        if self.lookahead_room != "auto":
            try:
                room = parse_bytes(self.lookahead_room, "lookahead_room")
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}{e} (or \"auto\")") from None
            if room > parse_bytes(self.mem_budget, "mem_budget"):
                raise ValueError(f"{where}lookahead_room = {self.lookahead_room!r} is more than mem_budget = "
                                 f"{self.mem_budget!r}: it is a share of it")
        if self.cache_policy not in POLICIES:
            raise ValueError(f"{where}cache_policy must be one of {', '.join(POLICIES)}, got {self.cache_policy!r}")
        whole("devices", self.devices, 1)
        whole("device_capacity", self.device_capacity, 1, " (rows a device)")
        whole("write_buffer_rows", self.write_buffer_rows, 1)
        whole("device_threads", self.device_threads, 0, " (0: all cores)")
        if self.schedule not in ("sequential", "herald"):
            raise ValueError(f"{where}schedule must be 'sequential' or 'herald', got {self.schedule!r}")
        whole("lookahead", self.lookahead, 0, " (batches)")
        for name in ("ttl_steps", "max_rows"):
            whole(name, getattr(self, name), 0, " (0: off)")
            if getattr(self, name) > _MAX_BOUND:  # SSD-PS takes steps and rows as uint64
                raise ValueError(f"{where}{name} must be at most 2^63 - 1 (TOML's largest int), "
                                 f"got {getattr(self, name)!r}")
        if self.schedule == "herald":
            whole("worker_cache_rows", self.worker_cache_rows, 1)
            if self.worker_cache_rows > self.device_capacity:
                # A device's table holds its cache and a batch's fetches: at most device_capacity rows.
                raise ValueError(f"{where}worker_cache_rows = {self.worker_cache_rows} is more than "
                                 f"device_capacity = {self.device_capacity} (rows a device) with schedule = "
                                 f"'herald': a device's cache must fit in its table; lower worker_cache_rows or "
                                 f"raise device_capacity")
            if self.devices > 64:
                raise ValueError(f"{where}schedule = 'herald' takes 1 to 64 devices, got devices = {self.devices}")
            if self.ttl_steps or self.max_rows:
                # Herald's worker caches keep rows between batches, out of reach of
                # the checkpoint's erase: an expired key would come back from them.
                raise ValueError(f"{where}ttl_steps = {self.ttl_steps} and max_rows = {self.max_rows}: bounded "
                                 f"tables need schedule = 'sequential' (Herald's worker caches hold rows between "
                                 f"batches)")
        whole("ssd.file_records", self.ssd.file_records, 1)
        trigger = self.ssd.compaction_trigger
        if isinstance(trigger, bool) or not isinstance(trigger, (int, float)) or not trigger >= 1:
            raise ValueError(f"{where}ssd.compaction_trigger must be a number >= 1 (records on disk / live "
                             f"records), got {trigger!r}")
        if self.topology is not None:
            try:
                topo = htopo.load(self.topology)
            except htopo.TopologyError as e:  # it names the topology file and line; this, the field
                raise htopo.TopologyError(f"{where}topology: {e}") from None
            if len(topo.endpoints) < self.devices:  # tier device g is endpoint g
                raise ValueError(f"{where}topology: {self.topology}: topology {topo.name!r} has "
                                 f"{len(topo.endpoints)} endpoints (GPUs and host partitions), fewer than "
                                 f"devices = {self.devices}")

    @classmethod
    def from_toml(cls, path: Union[str, os.PathLike]) -> "ParameterServerConfig":
        """A config from a TOML file: top-level fields, and [optimizer] (kind, lr, ...),
        [initializer] (kind, and uniform's scale or normal's std) and [ssd] tables."""
        return cls.from_dict(load_toml(path), source=os.fspath(path))

    def layout(self) -> dict:
        return {"dim": self.dim, "optimizer.kind": self.optimizer.kind,
                "initializer": dataclasses.asdict(self.initializer) | {"kind": self.initializer.kind},
                "seed": self.seed}


# ---------------------------------------------------------------- durable files
# Errors name the file: an OSError of a write (a full disk, say) does not.

def _write_durable(path: str, data: bytes) -> None:
    """data into a new file at path, synced."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise OSError(e.errno, f"write: {e.strerror}", path) from None


def _replace_durable(src: str, dst: str) -> None:
    os.replace(src, dst)
    _sync_dir(os.path.dirname(dst) or ".")


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, f"sync directory: {e.strerror}", path) from None
    finally:
        os.close(fd)


def _make_dirs_durable(path: str) -> None:
    """os.makedirs(path, exist_ok=True), and the entry of each directory it made
    synced in the one above it. An fsync of a directory does not persist its own
    entry (fsync(2)): a job's path made here and never synced in its parent could
    go, with every checkpoint in it, at a power loss after a checkpoint returned.
    (SSD-PS makes its own directory so: CreateDirectoriesDurably.)"""
    made = []
    at = os.path.abspath(path)
    while not os.path.isdir(at) and os.path.dirname(at) != at:
        made.append(at)
        at = os.path.dirname(at)
    os.makedirs(path, exist_ok=True)
    for directory in made:  # deepest first
        _sync_dir(os.path.dirname(directory))


# The device tier's routes are planned once a run for an even all-to-all of this
# many bytes a device pair: a batch's gets and pushes move about this much (4096
# examples x 26 fields x 64 floats over 8 x 8 pairs: 0.4 MB), where bandwidth,
# not a hop's microseconds, decides the route.
_PLAN_PAIR_BYTES = 1 << 20


def _add_links(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """The sum of two tiers' link counters (DeviceTier.link_counters)."""
    if a is None or b is None:
        return a if b is None else b
    return {"rows": a["rows"] + b["rows"], "bytes": a["bytes"] + b["bytes"],
            "route_rows": {k: a["route_rows"][k] + b["route_rows"][k] for k in a["route_rows"]},
            "relayed_rows": a["relayed_rows"] + b["relayed_rows"],
            "relayed_bytes": a["relayed_bytes"] + b["relayed_bytes"]}


def _routes_stats(topo, routes, links: dict, source: Optional[str]) -> dict:
    """stats()["device"]["routes"]: the plan each device pair's transfers follow and
    what crossed each link (rows and bytes a->b and b->a; a relay's rows count on
    both its hops; second_hop_bytes: a relay's second leg, the plan's phase 2)."""
    names = [d.name for d in topo.devices]
    g = routes.devices
    plan = [["-"] * g for _ in range(g)]
    for r in routes.plan["routes"]:
        if r["src"] < g and r["dst"] < g:
            plan[r["src"]][r["dst"]] = r["kind"] + (f" via {names[topo.endpoints[r['via']]]}" if r["via"] >= 0 else "")
    per_link = []
    for i, l in enumerate(topo.links):
        rows, moved = links["rows"][:, i, :].sum(axis=0), links["bytes"][:, i, :].sum(axis=0)
        per_link.append({"between": [names[l.a], names[l.b]], "kind": l.kind, "rows": rows.tolist(),
                         "bytes": moved.tolist(), "second_hop_bytes": links["bytes"][1, i, :].tolist()})
    return {"topology": topo.name, "source": source or "flat host partitions (default)",
            "executed": routes.execute, "endpoints": [names[e] for e in topo.endpoints[:g]], "plan": plan,
            "links": per_link, "hop_rows": int(links["rows"].sum()), "hop_bytes": int(links["bytes"].sum()),
            "rows_by_route": dict(links["route_rows"]), "relayed_rows": links["relayed_rows"],
            "relayed_bytes": links["relayed_bytes"]}


def checkpoint_step(directory: str) -> Optional[int]:
    """The server's step recorded in a checkpoint directory (SERVER_STEP), or None
    for a checkpoint made before servers recorded it."""
    path = os.path.join(directory, SERVER_STEP)
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a server step record ({type(e).__name__}: {e})") from None


def _job_checkpoint(path: str) -> Optional[tuple]:
    """(job.json's path, the checkpoint it names) when the directory `path` is rank r
    of an MPI job (``<job>/rank<r>``, r below job.json's world) and job.json names
    one; else None (no job there, a directory of no rank of it, none finished yet).
    Raises ValueError (hps.jobdir.read_job_record's, naming the file and field) for
    a job.json that is no job record: which checkpoint the rank must keep is
    unknown then."""
    from hps.jobdir import rank_and_job  # (hps.jobdir reads on top of this module)
    found = rank_and_job(path)
    if found is None:
        return None
    rank, _, manifest, job = found
    if job is None or rank >= job["world"] or job["checkpoint"] is None:
        return None
    return manifest, job["checkpoint"]


def _refuse_no_rank_of_its_job(path: str) -> None:
    """Raises FileNotFoundError (naming the directory, job.json and its world) where
    path is a rank directory of a job that is no rank of it any more (past
    job.json's world, or beside a reshard to one process's record:
    hps.jobdir.no_rank_of_its_job), as the readers refuse it. Opened, it resumed
    at its own checkpoint and took writes that nothing of the job reads, and that
    the next resume removes (or a reshard to more ranks empties)."""
    from hps.jobdir import no_rank_of_its_job  # (hps.jobdir reads on top of this module)
    refused = no_rank_of_its_job(path)
    if refused is not None:
        why, instead = refused
        raise FileNotFoundError(f"{why}; nothing was opened there: open {instead} (to keep what it holds, copy the "
                                f"directory elsewhere and open the copy)")


def _remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _read_or_empty(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _copy_store(src: str, dst: str) -> None:
    """A snapshot's store (src) into the empty directory dst: its parameter files
    (immutable) as hard links, its MANIFEST and STORE copied."""
    for name in sorted(os.listdir(src)):
        source, target = os.path.join(src, name), os.path.join(dst, name)
        if name.endswith(".hpf"):
            os.link(source, target)
        else:
            _write_durable(target, _read_or_empty(source))
    _sync_dir(dst)


# Beside a checkpoint's ssd/: the length and CRC-32 of the MANIFEST copied there.
# A MANIFEST cut at a record boundary replays as a shorter, valid log that has
# lost the files of its last commits; only a record made when it was copied
# tells the two apart.
STORE_DIGEST = "ssd.json"


def write_store_digest(snapshot: str, manifest: bytes) -> None:
    """Records, in checkpoint directory `snapshot`, the MANIFEST its ssd/ holds."""
    digest = {"manifest_bytes": len(manifest), "manifest_crc32": zlib.crc32(manifest)}
    _write_durable(os.path.join(snapshot, STORE_DIGEST), json.dumps(digest).encode())


def check_store_digest(snapshot: str, manifest: bytes) -> None:
    """Raises hps.CorruptionError, naming the MANIFEST, when `manifest` (read from
    checkpoint directory `snapshot`'s ssd/) is not the one its checkpoint recorded.
    Checkpoints written before the record existed have none: nothing to check."""
    path = os.path.join(snapshot, STORE_DIGEST)
    try:
        with open(path, "rb") as f:
            digest = json.loads(f.read())
        want = (int(digest["manifest_bytes"]), int(digest["manifest_crc32"]))
    except FileNotFoundError:
        return
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptionError(f"{path}: not a store digest ({e})") from None
    if (len(manifest), zlib.crc32(manifest)) != want:
        raise CorruptionError(
            f"{os.path.join(snapshot, _STORE_DIR, _MANIFEST)}: {len(manifest)} bytes (CRC-32 "
            f"{zlib.crc32(manifest):#010x}) where the checkpoint recorded {want[0]} (CRC-32 {want[1]:#010x}) in "
            f"{STORE_DIGEST}: the copy is cut short or damaged and may lack committed files")


def _build(spec, table: dict, where: str):
    if not isinstance(spec, dict):
        return spec  # already an optimizer / initializer object
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind not in table:
        raise ValueError(f"{where}: kind must be one of {', '.join(table)}, got {kind!r}")
    try:
        return table[kind](**spec)
    except TypeError as e:
        raise ValueError(f"{where} ({kind}): {e}") from None


class Prefetched:
    """A batch's distinct keys, pinned in MEM-PS by ParameterServer.prefetch;
    ``flat`` are the keys as given (flattened) and ``inverse`` where each of them
    is among ``keys``, so that a batch need not look them up again."""

    def __init__(self, ps: "ParameterServer", keys: np.ndarray, flat: np.ndarray, inverse: np.ndarray,
                 addresses=None, working_set=None, most_per_device: int = 0):
        self._ps = ps
        self.keys = keys
        self.flat = flat
        self.inverse = inverse
        self.addresses = addresses  # where MEM-PS pinned the rows (a host batch's, _core.RowAddresses)
        self.working_set = working_set  # a device-tier batch's: _core.WorkingSet, which holds the pins
        self.most_per_device = most_per_device  # its distinct keys on the fullest device
        self._used = False

    def release(self) -> None:
        """Unpins the rows of a prefetch that will not become a batch."""
        if not self._used:
            self._used = True
            if self.working_set is not None:
                self.working_set.abort()
            else:
                self._ps._cache.unpin(self.keys)


class _TierSlot:
    """A device tier and whether a batch holds it. The pipeline alternates two,
    so that the next batch loads while this one trains."""

    def __init__(self, tier, capacity: int):
        self.tier = tier
        self.capacity = capacity
        self.free = threading.Event()
        self.free.set()


@runtime_checkable
class WorkingBatch(Protocol):
    """What every batch does (the single-node device-tier Batch, the in-place
    HostBatch, the distributed batch, a GPU batch): the interface hps.torch and
    the pipeline call, with no test of which kind it is.

    ``positions(keys)`` turns the keys of a lookup into what ``gather`` and
    ``accumulate`` take (opaque: indices into the working set for a host batch,
    the keys themselves for a device tier); a lookup and its gradient use the
    same positions. ``gather(positions, out=None, worker=0)`` gives the
    embeddings (n, dim), one row per entry, into ``out`` if given: float32
    (n, dim), or (B, k * dim) with B * k = n, possibly the first columns of a
    wider matrix such as a model's input. ``accumulate(positions, grads,
    worker=0)`` adds gradients laid out as gather's ``out``.
    ``gather_tensor(positions, out, worker=0)`` and ``accumulate_tensor(positions,
    grads, worker=0)`` do the same with a torch tensor (n, dim) on any device
    (a model on a GPU): straight between the tier and the GPU's memory where
    the tier can, through host memory otherwise. ``pull`` and
    ``push`` are the same by keys. ``apply()`` steps every key that got
    gradients once, ``write_back()`` returns the rows to MEM-PS and releases
    the batch, ``finish()`` is both, ``abort()`` releases a batch that will not
    finish (steps not applied are dropped)."""

    keys: np.ndarray
    wait_seconds: float
    gathers_into_columns: bool  # gather writes into a wider matrix's columns natively (hps.torch uses it)

    def positions(self, keys: np.ndarray) -> Any: ...
    def gather(self, positions: Any, out: Optional[np.ndarray] = None, worker: int = 0) -> np.ndarray: ...
    def accumulate(self, positions: Any, grads: np.ndarray, worker: int = 0) -> None: ...
    def gather_tensor(self, positions: Any, out: Any, worker: int = 0) -> Any: ...
    def accumulate_tensor(self, positions: Any, grads: Any, worker: int = 0) -> None: ...
    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray: ...
    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None: ...
    def apply(self) -> None: ...
    def write_back(self) -> None: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...


class _ByKeys(_BatchBase):
    """WorkingBatch over a batch that offers only pull and push by keys and the
    rest (the distributed batch): positions are the keys."""

    def __init__(self, batch):
        self._inner = batch
        self.keys = batch.keys
        self.wait_seconds = getattr(batch, "wait_seconds", 0.0)

    def pull(self, keys, worker=0):
        return self._inner.pull(keys, worker=worker)

    def push(self, keys, grads, worker=0):
        self._inner.push(keys, grads, worker=worker)

    def apply(self):
        self._inner.apply()

    def write_back(self):
        self._inner.write_back()

    def abort(self):
        self._inner.abort()


def working_batch(batch) -> Optional[WorkingBatch]:
    """batch as a WorkingBatch: itself when it implements the whole protocol,
    else wrapped so that positions / gather / accumulate go through its pull
    and push (None stays None)."""
    if batch is None or isinstance(batch, WorkingBatch):
        return batch
    return _ByKeys(batch)


class Batch(_BatchBase):
    """A batch's working set on the device tier (ParameterServer.batch), run by
    a native _core.WorkingSet: a handful of calls into C++ a batch (pin, load,
    a pull and a push per worker, apply, write back), the rows moving between
    MEM-PS and the tier without passing through Python (on host partitions they
    do not move: the tier steps MEM-PS's pinned rows where they lie).

    finish() is apply() (one optimizer step per key on the device tier), then
    write_back() (the rows to MEM-PS, the tier freed); the pipeline runs the
    write-back on a thread of its own. A batch loaded before the previous one was
    written back (``overlap``) takes that batch's updated rows from it before
    its first pull, push or apply, so it sees them all the same."""

    def __init__(self, ps: "ParameterServer", prefetched: Prefetched, slot: _TierSlot):
        self._ps = ps
        self.keys = prefetched.keys  # distinct
        self._flat, self._inverse = prefetched.flat, prefetched.inverse
        self._ws = prefetched.working_set
        self._slot = slot
        # Host partitions read and step the rows where the tier holds them, so
        # gather writes into a model input's columns as a host batch does.
        self.gathers_into_columns = self._ws.reads_in_place
        self._applied = False
        self._written_back = threading.Event()
        self._done = False
        self.wait_seconds = 0.0  # how long batch() waited for a device tier to be free

    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        """Embeddings (n, dim) of keys, for the mini-batch of device `worker`."""
        return self._ws.get(worker, keys)

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Sends gradients (n, dim) from device `worker` to the keys' owners,
        where they add up until the batch ends."""
        self._ws.accumulate(worker, keys, grads)

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Where each of keys (any shape, flattened) is among the batch's keys:
        known from the prefetch for its keys or a run of them, else looked up."""
        flat = np.ascontiguousarray(keys).reshape(-1)
        known = prefetched_positions(flat, self._flat, self._inverse)
        return self._ws.positions(flat) if known is None else known

    def gather(self, positions: np.ndarray, out: Optional[np.ndarray] = None, worker: int = 0) -> np.ndarray:
        """Embeddings (n, dim) of the keys at positions, for device `worker`'s
        mini-batch; into `out` if given: (n, dim), or where the tier reads in place
        (gathers_into_columns) also (B, k * dim) with B * k = n, which may be the
        first columns of a wider matrix."""
        return self._ws.get_at(worker, positions, out)

    def accumulate(self, positions: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Sends gradients from device `worker` to the owners of the keys at
        positions, where they add up until apply(); laid out as gather's `out`."""
        self._ws.accumulate_at(worker, positions, grads)

    def gather_tensor(self, positions: np.ndarray, out, worker: int = 0):
        """gather() into a torch tensor (n, dim); on a CUDA tier, with `out` on the
        worker's GPU, the tier writes it there, with no host copy."""
        if not self._takes(out, worker, len(positions)):
            return super().gather_tensor(positions, out, worker)
        with _ordered_with_torch(out):
            self._ws.get_into(worker, positions, out.data_ptr(), out.device.type == "cuda")
        return out

    def accumulate_tensor(self, positions: np.ndarray, grads, worker: int = 0) -> None:
        """accumulate() of a torch tensor (n, dim); on the tier's GPU, read there."""
        if not self._takes(grads, worker, len(positions)):
            return super().accumulate_tensor(positions, grads, worker)
        with _ordered_with_torch(grads):
            self._ws.accumulate_from(worker, positions, grads.data_ptr(), grads.device.type == "cuda")

    def _takes(self, t, worker: int, n: int) -> bool:
        """Whether the tier reads or writes tensor t's memory itself: host memory,
        or the worker's GPU on a CUDA tier; float32 (n, dim), contiguous.
        (Anything else goes the protocol's way, which checks the shape.)"""
        import torch
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (n, self._ps.dim):
            return False
        if t.device.type == "cpu":
            return True
        tier = self._slot.tier
        return t.device.type == "cuda" and tier.accepts_gpu_memory and t.device.index == worker

    def apply(self) -> None:
        """One optimizer step per key that got gradients, on the device tier;
        a failure releases the batch."""
        if self._applied:
            return
        try:
            self._ws.apply()
        except BaseException as e:
            release_after(e, self.abort)  # the step's error stands
            raise
        self._applied = True

    def _stage(self) -> Optional[str]:
        return None if self._done else "applied" if self._applied else "made"

    def write_back(self) -> None:
        """The updated rows back to MEM-PS (dirty), the others' pins released
        (their rows unchanged), the device tier freed for the next batch."""
        if self._done:
            return
        if not self._applied:
            raise RuntimeError("write_back before apply")
        self._release(self._ws.write_back)

    def abort(self) -> None:
        """Drops the gradients not yet applied and releases the batch (steps
        already applied are written back: the batch after it has them)."""
        if self._done:
            return
        self._release(self._ws.abort)

    def _release(self, release) -> None:
        try:
            release()
        except BaseException:
            # A release that failed may have left rows on the tier (the working
            # set retries it when dropped); the next batch needs the tier empty.
            self._slot.tier.clear()
            raise
        finally:
            self._close()

    def _close(self):
        self._done = True
        self._written_back.set()  # before the tier is free: the next load reads MEM-PS then
        self._slot.free.set()


class HostBatch(_BatchBase):
    """A batch trained on its rows where MEM-PS pins them (no GPU, one host
    partition: ``ParameterServerConfig.host_in_place``). A device table would only
    hold a copy of those rows, filled at load and read back at write-back; here
    pull, push and apply work on the pinned rows themselves, and write_back only
    unpins them (the updated ones dirty). Same interface as Batch, plus
    positions / gather / accumulate, which hps.torch uses to skip the key lookups:
    a batch whose keys are the prefetch's already knows where each one is.

    A batch made while the one before it is in flight (``overlap``) shares rows
    with it; it reads them only once that one has applied its step."""

    gathers_into_columns = True  # (RowLayout: the model's input takes the rows as they are read)

    def __init__(self, ps: "ParameterServer", prefetched: Prefetched, previous: Optional["HostBatch"]):
        self._ps = ps
        self.keys = prefetched.keys
        self._flat, self._inverse = prefetched.flat, prefetched.inverse
        self._native = _core.HostBatch(ps._cache, self.keys, ps._native_opt, prefetched.addresses)
        self._previous = previous
        self._applied = threading.Event()
        self._done = False
        self.wait_seconds = 0.0

    def _catch_up(self) -> None:
        previous, self._previous = self._previous, None
        if previous is not None:
            previous._applied.wait()

    @property
    def dim(self) -> int:
        return self._native.dim

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Where each of keys (any shape, flattened) is among the batch's keys."""
        flat = np.ascontiguousarray(keys).reshape(-1)
        known = prefetched_positions(flat, self._flat, self._inverse)
        return self._native.positions(flat) if known is None else known

    def gather(self, positions: np.ndarray, out: Optional[np.ndarray] = None, worker: int = 0) -> np.ndarray:
        """Embeddings (n, dim) of the keys at positions, one row per entry; into
        `out` if given: float32 (n, dim), or (B, k * dim) with B * k = n, which may
        be the first columns of a wider matrix such as a model's input."""
        if worker:
            self._check_worker(worker)
        self._catch_up()
        return self._native.get(positions, out)

    def accumulate(self, positions: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Adds gradients to the keys at positions, until apply(); grads are laid
        out as gather's `out`."""
        if worker:
            self._check_worker(worker)
        self._native.accumulate(positions, grads)

    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        """Embeddings (n, dim) of keys (`worker` is 0: there is one partition)."""
        self._check_worker(worker)
        return self.gather(self._native.positions(np.ascontiguousarray(keys)))

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        """Gradients (n, dim) of keys, summed per key until apply()."""
        self._check_worker(worker)
        self.accumulate(self._native.positions(np.ascontiguousarray(keys)), np.ascontiguousarray(grads))

    @staticmethod
    def _check_worker(worker: int) -> None:
        if worker != 0:
            raise ValueError(f"worker {worker}: a host batch has one device, worker 0")

    def apply(self) -> None:
        """One optimizer step per key that got gradients, on its MEM-PS row."""
        if self._applied.is_set():
            return
        try:
            self._catch_up()
            with self._ps._rows_lock:
                self._native.apply()
        except BaseException as e:
            release_after(e, self.abort)  # the step's error stands
            raise
        self._applied.set()

    def _stage(self) -> Optional[str]:
        return None if self._done else "applied" if self._applied.is_set() else "made"

    def write_back(self) -> None:
        """Unpins the rows, the updated ones dirty: MEM-PS holds them already."""
        if self._done:
            return
        if not self._applied.is_set():
            raise RuntimeError("write_back before apply")
        self._close()

    def abort(self) -> None:
        """Drops the gradients not yet applied."""
        self._applied.set()
        self._close()

    def _close(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._native.release()
        finally:
            self._ps._host_batch_done()


class ParameterServer:
    """One node's parameter server over ``config.path`` (created or resumed).

    >>> import numpy as np, tempfile, hps
    >>> ps = hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=tempfile.mkdtemp(),
    ...                          optimizer=hps.SGD(lr=0.5), mem_budget="1MiB"))
    >>> keys = np.array([7, 7], np.uint64)
    >>> before = ps.pull(keys[:1])
    >>> ps.push(keys, np.ones((2, 4), np.float32))     # one step with g = 2
    >>> bool(np.allclose(ps.pull(keys[:1]), before - 1.0))
    True
    """

    def __init__(self, config: ParameterServerConfig,
                 partitioner: Optional[Callable[[np.ndarray, int], np.ndarray]] = None, *,
                 checkpoint: Union[int, None, str] = LAST,
                 before_restore: Optional[Callable[[Optional[dict]], None]] = None):
        """``checkpoint``: which checkpoint an existing server resumes from: LAST
        (the last finished one, which the metadata names; a rank of an MPI job's:
        the one its job.json names, module docstring), a number (an MPI job
        rolls every rank back to the one all of them finished), or None (none:
        the server starts empty, as new). Opening drops every other checkpoint
        (on a rank of an MPI job, but the one job.json names: checkpoint()).
        None, or a number before the last finished checkpoint, starts a new run
        (its id in the metadata; docs/serving.md): the numbers come again.
        ``before_restore``: called with the stored metadata (None for a new path)
        once the path's writer lock is held and before anything is dropped; what
        it raises ends the open, changing nothing. A caller that chose
        ``checkpoint`` from what it read before taking the lock checks there that
        no other run changed the path meanwhile."""
        config.check()  # before anything is created at the path
        if config.schedule == "herald" and partitioner is not None:
            raise ValueError("schedule = 'herald' places keys by the caches; it takes no partitioner")
        self.config = config
        self.dim = config.dim
        self._native_opt = native_optimizer(config.dim, config.optimizer, config.initializer, config.seed)
        self.row_floats = self._native_opt.row_floats
        row_bytes = 4 * self.row_floats
        if not os.path.isdir(config.path):
            _refuse_no_rank_of_its_job(config.path)  # (before anything is made there; again under its lock)
        _make_dirs_durable(config.path)
        # Released by close(), or when the server is collected without it.
        self._release_path = weakref.finalize(self, os.close, _lock_path(config.path))
        try:
            self._open(config, partitioner, checkpoint, row_bytes, before_restore)
        except BaseException:
            self._release_path()
            raise

    def _open(self, config: ParameterServerConfig, partitioner, checkpoint, row_bytes: int,
              before_restore) -> None:
        # Under the path's lock: a reshard holds its directories while it switches
        # the job's world (a held one is refused above, naming the reshard).
        _refuse_no_rank_of_its_job(config.path)
        meta = self._check_path()
        if before_restore is not None:
            before_restore(meta)
        if checkpoint == LAST and meta is not None:
            checkpoint = self._job_checkpoint_or_last(meta)
        # A run resumed keeps its id; a new one (checkpoint None: started over) gets one.
        # So does a run rolled back to a checkpoint before the last finished one: the
        # checkpoints after it go, and their numbers (and parameter files' numbers) come
        # again for other rows. Under the old id a reader that had read a dropped one (an
        # export's position, a Lookup) took the new checkpoint of its number for it, and a
        # delta missed every row written since the rollback. (An MPI job's run is job.json's,
        # which a rank's rollback to the checkpoint job.json names leaves as it is.)
        # Metadata written before runs had ids gets one now.
        rolled_back = (meta is not None and checkpoint not in (LAST, None) and meta.get("checkpoint") is not None
                       and checkpoint < meta["checkpoint"])
        self._run = (meta or {}).get(RUN) if checkpoint is not None and not rolled_back else None
        self._run = self._run or new_run_id()
        if meta is None:
            if checkpoint not in (LAST, None):
                raise FileNotFoundError(f"{config.path} holds no parameter server, so no checkpoint {checkpoint}")
            self._write_metadata(checkpoint=None)  # first: a crash from here on leaves a server to open
            checkpoint = None
        elif checkpoint == LAST:
            checkpoint = meta.get("checkpoint")
        herald = config.schedule == "herald"
        # The step of the checkpoint resumed from: its own record, which holds also
        # where the metadata names another checkpoint (an MPI job rolled back to an
        # earlier one) or another checkpoint of that number (a rank that got
        # further than job.json, then resharded: the reshard's checkpoint replaced
        # its own); else the metadata's, when it names it. Known before _restore,
        # which may rewrite the metadata to name this checkpoint.
        saved_step = None if checkpoint is None else checkpoint_step(self.checkpoint_dir(checkpoint))
        if saved_step is None and meta is not None and meta.get("checkpoint") == checkpoint:
            saved_step = meta.get("step")
        self._step = int(saved_step or 0)
        self._checkpoint = self._restore(checkpoint, meta)
        self._ssd = SsdStore(os.path.join(config.path, _STORE_DIR), row_bytes, file_records=config.ssd.file_records,
                             compaction_trigger=config.ssd.compaction_trigger,
                             use_io_uring=config.ssd.use_io_uring, direct_io=config.ssd.direct_io,
                             require_direct_io=config.ssd.require_direct_io)
        # Evicted rows gather in the write buffer, then go to SSD-PS in large puts;
        # misses read the buffer, then SSD-PS, then initialise (native, no GIL).
        # Stamps never go back: the store's newest file bounds the step from below
        # (and is the step of a checkpoint that recorded none).
        self._step = max(self._step, self._ssd.stamp)
        self._ssd.set_stamp(self._step)
        self._backing = _core.BackingStore(self._ssd, self._native_opt, config.write_buffer_rows)
        self._counts_lock = threading.Lock()
        self._counts = {"mem_hits": 0, "pulls": 0, "pushes": 0, "batches": 0, "checkpoints": 0,
                        "expired": 0, "capped": 0}
        self._cache = MemCache(row_bytes, budget=config.mem_budget, policy=config.cache_policy,
                               loader=self._backing, sink=self._backing, prefault=config.prefault,
                               lookahead_room=mem_lookahead_room(config, row_bytes))
        self._window = None  # the arrays of prefetch's last lookahead window (None: not known)
        # With one host partition, batches train on MEM-PS's pinned rows (HostBatch).
        self._in_place = (config.host_in_place and config.devices == 1 and partitioner is None
                          and not herald and _core.cuda_device_count() < 1)
        # Device tables start small and double when a batch needs it (up to
        # device_capacity): clearing and reading back scan every slot, so tables
        # sized to the batch cost least.
        capacity = min(config.device_capacity, 1 << 16)
        self._routes, self._topology = (None, None) if self._in_place else self._plan_routes()
        self._links_before = None  # link counters of the tiers outgrown
        self._slots = [] if self._in_place or herald else [_TierSlot(self._new_tier(capacity), capacity)]
        self._next_slot = 0
        self._last_batch: Optional[Union[Batch, HostBatch]] = None
        # batch()'s batches, with the thread that made each, until collected: those
        # not yet written back are what a push waits for (_batch_in_the_way, _held_here).
        self._made = weakref.WeakSet()
        self._made_lock = threading.Lock()
        self._host_batches = threading.Condition()  # guards _host_active
        self._host_active = 0  # host batches not yet written back
        self._rows_lock = threading.Lock()  # a host batch's apply against pull()'s copy of the rows
        self._transfers_before = None
        self._partitioner = partitioner
        self._load_lock = threading.Lock()  # one batch() at a time; checkpoint() holds it too
        self._herald = WorkerCaches(self, config.devices, config.worker_cache_rows,
                                    config.device_capacity) if herald else None
        self._herald_active = 0  # herald batches not yet written back (guarded by _host_batches)

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: Union[str, os.PathLike], **overrides) -> "ParameterServer":
        """Resumes the parameter server at path from its last checkpoint;
        ``overrides`` change the fields that may change (mem_budget, devices, ...)."""
        meta_path = os.path.join(os.fspath(path), METADATA)
        if not os.path.exists(meta_path):
            raise FileNotFoundError(f"{os.fspath(path)} holds no parameter server (no {METADATA})")
        with open(meta_path) as f:
            meta = json.load(f)
        config = ParameterServerConfig.from_dict({**meta["config"], "path": os.fspath(path)}, source=meta_path)
        for name, value in overrides.items():
            if not hasattr(config, name):
                raise ValueError(f"open: unknown config field '{name}'")
            setattr(config, name, value)
        return cls(config)

    def _job_checkpoint_or_last(self, meta: dict):
        """The checkpoint an open at LAST resumes: where the path is a rank of an MPI
        job, the one job.json names (module docstring), which the job resumes every
        rank at (the metadata's, opened at, would drop it); else LAST. Raises
        FileNotFoundError, dropping nothing, when the rank lacks job.json's (damage):
        opened at the metadata's, the rank could never rejoin the job."""
        named = _job_checkpoint(self.config.path)
        if named is None or named[1] == meta.get("checkpoint"):
            return LAST
        manifest, number = named
        if not os.path.isdir(self.checkpoint_dir(number)):
            raise FileNotFoundError(f"{self.config.path}: {manifest} names checkpoint {number} of this rank, which "
                                    f"is missing ({self.checkpoint_dir(number)}); its metadata names "
                                    f"{meta.get('checkpoint')}: nothing was dropped (open it at a checkpoint it "
                                    f"holds: ParameterServer(config, checkpoint=N))")
        return number

    def _metadata_path(self) -> str:
        return os.path.join(self.config.path, METADATA)

    def _check_path(self) -> Optional[dict]:
        """The stored metadata, or None when the path is new; raises if it holds something else."""
        meta_path = self._metadata_path()
        # The metadata written aside by a run killed before its rename (_write_metadata):
        # nothing reads it, and the run's lock is this server's now. Left, the path held
        # "something else" for good where it was the new server's first metadata.
        _remove_tree(meta_path + ".tmp")
        if not os.path.exists(meta_path):
            if set(os.listdir(self.config.path)) - {WRITER_LOCK}:
                raise ValueError(f"{self.config.path} is not empty and holds no parameter server "
                                 f"(no {METADATA}); give a new or empty directory")
            return None
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: format {meta.get('format')}, this build reads {FORMAT_VERSION} "
                             f"(format 1 kept no checkpoint snapshots; train it again with this build)")
        stored = ParameterServerConfig.from_dict({**meta["config"], "path": self.config.path}, source=meta_path)
        mine, theirs = self.config.layout(), stored.layout()
        for name in ParameterServerConfig.LAYOUT_FIELDS:
            if mine[name] != theirs[name]:
                raise ValueError(f"{self.config.path} holds a parameter server with {name} = {theirs[name]!r}, "
                                 f"not {mine[name]!r}; open it with ParameterServer.open(path) or use a new path")
        return meta

    def _write_metadata(self, checkpoint: Optional[int]) -> None:
        """The metadata, naming the last finished checkpoint; replaced atomically
        (this rename is a checkpoint's commit point)."""
        meta = {"format": FORMAT_VERSION, "hps_version": _core.__version__, "checkpoint": checkpoint,
                RUN: self._run,
                "step": getattr(self, "_step", 0),  # this server's batches at that checkpoint
                "config": {k: v for k, v in self.config.to_dict().items() if k != "path"}}
        path = self._metadata_path()
        _write_durable(path + ".tmp", json.dumps(meta, indent=1).encode())
        _replace_durable(path + ".tmp", path)

    def _stored_checkpoint(self) -> Optional[int]:
        """The checkpoint the metadata file names now (None: none, or unreadable)."""
        try:
            with open(self._metadata_path(), "rb") as f:
                return json.loads(f.read()).get("checkpoint")
        except (OSError, ValueError, AttributeError):
            return None

    # ------------------------------------------------------------ checkpoints
    @property
    def checkpoint_number(self) -> Optional[int]:
        """The number of the last finished checkpoint (None: none yet)."""
        return self._checkpoint

    def checkpoint_dir(self, number: Optional[int] = None) -> Optional[str]:
        """The directory of checkpoint `number` (default: the last finished one;
        None when there is none), where checkpoint(save=...) saved its files."""
        number = self._checkpoint if number is None else number
        if number is None:
            return None
        return os.path.join(self.config.path, CHECKPOINTS, f"{number:06d}")

    def _restore(self, number: Optional[int], meta: Optional[dict]) -> Optional[int]:
        """Rebuilds the live store from checkpoint `number` (None: an empty store)
        and drops every other checkpoint. Runs before the store opens; a crash in
        the middle leaves the snapshot as it was, and the next open does it again."""
        root = self.config.path
        live, staging = os.path.join(root, _STORE_DIR), os.path.join(root, _STORE_DIR + ".restore")
        _remove_tree(staging)
        if number is not None:
            snapshot = self.checkpoint_dir(number)
            if not os.path.isdir(snapshot):
                raise FileNotFoundError(f"{snapshot}: checkpoint {number} of {root} is missing")
            check_store_digest(snapshot, _read_or_empty(os.path.join(snapshot, _STORE_DIR, _MANIFEST)))
            os.makedirs(staging)
            _copy_store(os.path.join(snapshot, _STORE_DIR), staging)
        _remove_tree(live)
        if number is not None:
            os.rename(staging, live)
        _sync_dir(root)
        if meta is not None and meta.get("checkpoint") != number:
            self._write_metadata(number)  # before the snapshots after `number` go
        self._prune(keep=number)
        return number

    def _prune(self, keep: Optional[int]) -> None:
        """Removes every snapshot but checkpoint `keep` (and unfinished ones), and but
        the one job.json names where the path is a rank of an MPI job: the job
        resumes every rank at that one, whatever this rank's server did since (a
        checkpoint of its own that job.json does not name yet, a rollback, a start
        over), so a rank without it could never rejoin the job."""
        root = os.path.join(self.config.path, CHECKPOINTS)
        if not os.path.isdir(root):
            return
        named = _job_checkpoint(self.config.path)
        kept = {f"{number:06d}" for number in (keep, None if named is None else named[1]) if number is not None}
        gone = [name for name in sorted(os.listdir(root)) if name not in kept]
        for name in gone:
            _remove_tree(os.path.join(root, name))
        if gone:
            _sync_dir(root)

    def prune_checkpoints(self) -> None:
        """Drops the checkpoints before the last finished one (checkpoint(keep_previous=True)
        kept them: an MPI job drops them once job.json names the new one), but
        the one job.json names, on a rank of an MPI job."""
        with self._load_lock:
            self._prune(keep=self._checkpoint)

    def _snapshot_store(self, dst: str) -> bytes:
        """Hard links of the live store's parameter files and a copy of its
        MANIFEST and STORE into dst; returns the MANIFEST copied. The MANIFEST is read before and after the
        links: if a compaction committed in between, it may have deleted a file
        that the first read lists, so the files are linked again (those not yet
        linked) until a pass sees no commit. A link to a file that the copied
        MANIFEST does not list is harmless: the store removes it when opened."""
        src = os.path.join(self.config.path, _STORE_DIR)
        linked: set = set()
        for _ in range(1000):
            before = _read_or_empty(os.path.join(src, _MANIFEST))
            for name in sorted(os.listdir(src)):
                if name.endswith(".hpf") and name not in linked:
                    try:
                        os.link(os.path.join(src, name), os.path.join(dst, name))
                    except FileNotFoundError:  # deleted by a compaction meanwhile
                        continue
                    linked.add(name)
            if _read_or_empty(os.path.join(src, _MANIFEST)) == before:
                break
        else:
            raise RuntimeError(f"{src}: the store's MANIFEST changed during each of 1000 snapshot passes")
        _write_durable(os.path.join(dst, _MANIFEST), before)
        for name in os.listdir(src):
            if not name.endswith((".hpf", ".tmp")) and name != _MANIFEST:
                _write_durable(os.path.join(dst, name), _read_or_empty(os.path.join(src, name)))
        _sync_dir(dst)
        return before

    # ------------------------------------------------------------ plumbing
    def _count(self, **amounts) -> None:
        with self._counts_lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    def _owners(self, keys):
        if self._partitioner is None:
            return None  # the native modulo hash
        owners = np.ascontiguousarray(self._partitioner(np.asarray(keys, np.uint64), self.config.devices),
                                      dtype=np.int32)
        return owners

    # ------------------------------------------------------------ the API
    def pull(self, keys: np.ndarray) -> np.ndarray:
        """Embeddings (n, dim) float32 of keys (uint64), as of the last finished batch."""
        with self._herald._lock if self._herald is not None else contextlib.nullcontext():
            # Herald: MEM-PS gets the caches' newer rows first, and no batch applies
            # between the flush and the read (its evictions write MEM-PS: the pull
            # would read rows of two batches).
            if self._herald is not None:
                self._herald.flush()
            with self._rows_lock:
                rows, hit = self._cache.pull(keys, pin=False, dtype=np.float32)
        self._count(pulls=1, mem_hits=int(hit.sum()))
        return np.ascontiguousarray(rows[:, :self.dim])

    def push(self, keys: np.ndarray, grads: np.ndarray, *, step: bool = True) -> None:
        """Sums the gradients (n, dim) of each distinct key and applies one optimizer step.
        A push is one step of the server (``step``, which [ps] ttl_steps counts), as a
        batch is; ``step=False``: a part of the step counted last (a push that belongs
        to the batch or push before it). It waits for every batch made to be written
        back: refused (RuntimeError) where this thread holds one (its with block, a
        pipeline's train step: ParameterServer.batch), which would be forever."""
        keys = np.asarray(keys)
        grads = np.asarray(grads)
        if grads.dtype != np.float32:
            raise TypeError(f"grads must be an array of float32, got {grads.dtype}")
        if grads.ndim != 2 or grads.shape != (len(keys), self.dim):
            raise ValueError(f"grads must have shape ({len(keys)}, {self.dim}), got {grads.shape}")
        held = self._held_here()
        fix = ("Nothing was pushed.", "Push the gradients into that batch (batch.push(keys, grads) or "
               "batch.accumulate; an hps.torch module: module.attach(batch, worker)), or push once it is finished "
               "(after {where}).")
        if self._herald is not None:
            # Herald's batches wait for none: the push's batch started out of order,
            # was refused, and its abort stopped the caches.
            held = [b for b in held if b._stage() == "made"]
            if held:
                self._refuse_waiting_for(held, "ParameterServer.push", "is a batch of its own, which starts only "
                                         "once every batch made before it has applied its step", "applies its step",
                                         *fix, never="this call's batch could not start (refused out of order, "
                                         "it stopped the worker caches)")
        elif held:
            self._refuse_waiting_for(held, "ParameterServer.push",
                                     "waits for every batch of the server to be written back", "is written back",
                                     *fix)
        with self._batch(keys, overlap=False, new_step=step) as b:
            b.push(keys, grads)
        self._count(pushes=1)

    def prefetch(self, keys: np.ndarray, upcoming: Optional[list] = None) -> "Prefetched":
        """Pins the distinct keys' rows in MEM-PS (reading SSD-PS for misses), so
        that a later batch(prefetched) finds them in memory. Runs alongside a batch
        in flight: the pipeline's pull stage. ``upcoming``: the keys of the batches
        after this one (the pipeline's lookahead window), which the caches keep
        when they must evict. A list that is the last one's shifted by one batch
        (its arrays from the second on, the same objects, then at most one more)
        slides MEM-PS's window (``stats()["mem"]["lookahead_slides"]``) rather than
        hashing every batch of it again: an array passed again must hold the same
        keys it held when it was first passed."""
        window = self._check_upcoming(upcoming)
        if window is not None:  # MEM-PS keeps the coming batches' rows when it must evict
            self._move_window(*window)
        if self._herald is not None:
            pre = self._pin_examples(keys)
            if window is not None:
                window = np.concatenate(window[1]) if window[1] else np.empty(0, np.uint64)
            pre.upcoming = window
            return pre
        if not self._in_place:
            return self._pin_working_set(keys)
        flat, uniq, inverse = self._distinct(keys)
        hit, addresses = self._cache.pin_rows(uniq)
        self._count(mem_hits=int(hit.sum()))
        return Prefetched(self, uniq, flat, inverse, addresses)

    def _move_window(self, given: list, keys: list) -> None:
        """MEM-PS's lookahead window to the batches `given` (`keys`: each one's
        keys as a uint64 array; both from _check_upcoming): slid by one batch when
        they follow the window's batches (the arrays prefetch was given, by
        identity), else set anew, batch by batch, so that the next call can slide it."""
        window = self._window

        def same(a, b) -> bool:
            return len(a) == len(b) and all(x is y for x, y in zip(a, b))

        if window is not None and same(given, window):
            pass  # the window it holds (a prefetch tried again)
        elif window and len(window) - 1 <= len(given) <= len(window) and same(given[:len(window) - 1], window[1:]):
            if len(given) == len(window):
                self._cache.slide_lookahead(keys[-1])
            else:
                self._cache.pop_lookahead()  # the end of the data: no batch enters
        else:
            self._window = None  # not known until the calls below are made
            self._cache.set_lookahead(keys[0] if keys else np.empty(0, np.uint64))
            for k in keys[1:]:
                self._cache.push_lookahead(k)
        self._window = list(given)

    @staticmethod
    def _check_upcoming(upcoming) -> Optional[tuple]:
        """The lookahead window's batches: (the arrays given, each flattened to a
        uint64 array), or None for none."""
        if upcoming is None:
            return None
        if not isinstance(upcoming, (list, tuple)):
            raise TypeError(f"upcoming must be a list of key arrays (the next batches'), got {type(upcoming).__name__}")
        parts = []
        for i, k in enumerate(upcoming):
            if not isinstance(k, np.ndarray) or k.dtype not in (np.uint64, np.int64):
                raise TypeError(f"upcoming[{i}] must be an array of uint64 or int64, got "
                                f"{getattr(k, 'dtype', type(k).__name__)}")
            parts.append(np.ascontiguousarray(k).reshape(-1).view(np.uint64))
        return list(upcoming), parts

    def _pin_examples(self, keys: np.ndarray) -> "Prefetched":
        """prefetch() for Herald's worker caches: the distinct keys pinned in
        MEM-PS (a device fetches from there what no cache holds), and the keys
        kept by example for the scheduler: (n_examples, fields), or one key an
        example for a 1-D array."""
        flat, uniq, inverse = self._distinct(keys)
        if keys.ndim not in (1, 2):
            raise ValueError(f"keys must be (n_examples, fields) or 1-D with schedule = 'herald', got {keys.shape}")
        hit = self._cache.pin(uniq)
        self._count(mem_hits=int(hit.sum()))
        pre = Prefetched(self, uniq, flat, inverse)
        pre.examples = flat.view(np.uint64).reshape(len(keys), keys.shape[1] if keys.ndim == 2 else 1)
        return pre

    def _pin_working_set(self, keys: np.ndarray) -> "Prefetched":
        """prefetch() for the device tier: one native call finds the distinct
        keys and pins them (the working set holds the pins from then on)."""
        self._check_keys(keys)
        flat = np.ascontiguousarray(keys.reshape(-1))
        ws, uniq, inverse, hits, most = _core.WorkingSet.pin(self._cache, flat, self._native_opt,
                                                            self.config.devices)
        try:
            if self._partitioner is not None:
                most = ws.set_owners(self._owners(uniq))
            self._check_device_room(len(uniq), most)
        except BaseException:
            ws.abort()
            raise
        self._count(mem_hits=hits)
        return Prefetched(self, uniq, flat, inverse, working_set=ws, most_per_device=most)

    def batch(self, keys: Union[np.ndarray, "Prefetched"], *, overlap: bool = False) -> Union[Batch, HostBatch]:
        """Loads the working set of keys (or of a prefetch) onto the device tier;
        the returned Batch serves pulls and pushes until finish() (or the end of a
        with block) writes the updated rows back. This waits for the batch in
        flight to be written back, or, with ``overlap`` (the pipeline's way), only
        for the one before it: two device tiers take turns, and the new batch
        takes the updates of the one in flight from it when that one applies them.

        A batch this waits for that this thread writes back (one whose with block
        is open here, the batch of a pipeline's train step running here) would be
        waited for forever: that is refused (RuntimeError), making nothing."""
        held = self._held_here() if self._herald is None else []  # (Herald's batches wait for none)
        if held and not overlap:
            self._refuse_waiting_for(held, "ParameterServer.batch",
                                     "(without overlap) waits for the batch in flight to be written back",
                                     "is written back", "Nothing was made.", "Finish that batch first (leave {where}).")
        if len(held) > 1 and self._in_place:
            # (A device tier's: the tier it takes next, known under the load lock: _tier_batch.)
            self._refuse_waiting_for(held, "ParameterServer.batch(overlap=True)",
                                     "waits for one of the two batches in flight to be written back (at most two "
                                     "are)", "is written back", "Nothing was made.",
                                     "Finish one of them first (leave {where}).")
        b = self._batch(keys, overlap=overlap, new_step=True)
        b._made_on = threading.get_ident()
        with self._made_lock:
            self._made.add(b)
        return b

    def _batch_in_the_way(self) -> Optional[str]:
        """Why a push from this thread would wait forever (None: it would not, or
        would wait for another thread only). A push waits until every batch made
        is written back. One not yet applied is applied by the thread that trains
        it, the one a trainer pushes from (inside its with block, in a pipeline's
        train step); one applied, not yet written back, by the thread that made it
        (a with block's finish), unless another writes it back (the pipeline's
        writer). hps.torch refuses a push then, rather than wait for a batch that
        waits for it."""
        here = threading.get_ident()
        with self._made_lock:
            made = list(self._made)
        for b in made:
            stage = b._stage()
            if stage == "made":
                return "made and not yet applied"
            if stage == "applied" and b._made_on == here:
                return "applied on this thread and not yet written back"
        return None

    def _held_here(self) -> list:
        """batch()'s batches not yet written back that this thread holds
        (batch_base.holding: a with block of theirs open here, the pipeline's train
        step running here): this thread writes them back only once it goes on, so
        a call of its that waits for one would wait forever. Only those: a batch
        another thread finishes (a pipeline's, the loader's and the writer's) is
        waited for as ever."""
        with self._made_lock:
            made = list(self._made)
        return [b for b in made if b._stage() is not None and held_here(b) is not None]

    @staticmethod
    def _refuse_waiting_for(held: list, call: str, waits: str, until: str, done: str, fix: str,
                            never: str = "this call would wait for it forever") -> None:
        """Raises RuntimeError: `call` `waits` for a batch of `held` (_held_here),
        which `until` only after this thread goes on, so `never`. Names the batch
        and what to do (`fix`, where "{where}" is how this thread holds it)."""
        b = held[0]
        where = held_here(b)
        stage = "not yet applied" if b._stage() == "made" else "applied, not yet written back"
        more = f"; and {len(held) - 1} more that this thread holds" if len(held) > 1 else ""
        raise RuntimeError(
            f"{call} {waits}, and the {type(b).__name__} of {len(b.keys)} keys made by batch() is open on this "
            f"thread, in {where} ({stage}{more}): it {until} only after this thread leaves {where}, so "
            f"{never}. {done} {fix.format(where=where)}")

    def _batch(self, keys: Union[np.ndarray, "Prefetched"], *, overlap: bool,
               new_step: bool) -> Union[Batch, HostBatch]:
        """batch(); new_step=False: the batch is part of the step counted last (push(step=False))."""
        prefetched = keys if isinstance(keys, Prefetched) else self.prefetch(keys)
        if prefetched._ps is not self or prefetched._used:
            raise ValueError("batch: a Prefetched can be used once, with the server that made it")
        prefetched._used = True
        if self._herald is not None:
            with self._host_batches:
                self._herald_active += 1
            b = HeraldBatch(self._herald, prefetched)
        elif self._in_place:
            b = self._host_batch(prefetched, overlap)
        else:
            b = self._tier_batch(prefetched, overlap)
        # Counted once made: a batch the caches refuse (device_capacity) or whose
        # load fails (a device out of memory) is not, as the device tier's
        # prefetch refuses one before its step. (The step went before the load,
        # and stayed one ahead of the batches made for good.)
        if new_step:
            self._advance_step()
        self._count(batches=1)
        return b

    def _tier_batch(self, prefetched: Prefetched, overlap: bool) -> Batch:
        """batch() on a device tier: the working set loaded onto a free one."""
        ws = prefetched.working_set
        waited = time.perf_counter()
        try:
            with self._load_lock:
                if overlap and len(self._slots) == 1:
                    first = self._slots[0]
                    self._slots.append(_TierSlot(self._new_tier(first.capacity), first.capacity))
                    # The new tier is free: the batch in flight (one made without
                    # overlap) may hold the first, and waiting for its write-back
                    # is what overlap is not to do (in one thread, forever).
                    self._next_slot = 1
                for other in ([] if overlap else self._slots):
                    other.free.wait()
                slot = self._slots[self._next_slot]
                if overlap and not slot.free.is_set():
                    held = [b for b in self._held_here() if b._slot is slot]
                    if held:
                        self._refuse_waiting_for(
                            held, "ParameterServer.batch(overlap=True)",
                            "waits for the device tier it takes next (the two tiers take turns) to be free",
                            "is written back", "Nothing was made.", "Finish that batch first (leave {where}).")
                slot.free.wait()
                waited = time.perf_counter() - waited
                slot.free.clear()
                previous = self._last_batch
                if previous is not None and previous._written_back.is_set():
                    previous = None  # MEM-PS has its updates (checked before reading MEM-PS)
                try:
                    self._fit_tier(slot, prefetched.most_per_device)
                    # The rows as MEM-PS holds them now (an earlier batch may have
                    # updated some since the prefetch); a failure releases the pins.
                    ws.load(slot.tier, None if previous is None else previous._ws)
                except BaseException:
                    slot.free.set()
                    raise
                self._next_slot = (self._next_slot + 1) % len(self._slots)
                b = Batch(self, prefetched, slot)
                self._last_batch = b
        except BaseException as e:
            release_after(e, ws.abort)  # nothing, if the load released it; the load's error stands
            raise
        b.wait_seconds = waited
        return b

    def _host_batch(self, prefetched: Prefetched, overlap: bool) -> HostBatch:
        """batch() without a device tier: at most two batches in flight (as with
        two tiers), the new one ordered after the last."""
        waited = time.perf_counter()
        try:
            with self._load_lock:
                with self._host_batches:
                    while self._host_active > (1 if overlap else 0):
                        self._host_batches.wait()
                    self._host_active += 1
                waited = time.perf_counter() - waited
                previous = self._last_batch
                try:
                    b = HostBatch(self, prefetched, previous if previous is not None and not previous._done else None)
                except BaseException:
                    self._host_batch_done()
                    raise
                self._last_batch = b
        except BaseException as e:
            release_after(e, lambda: self._cache.unpin(prefetched.keys))  # the error stands
            raise
        b.wait_seconds = waited
        return b

    def _advance_step(self) -> None:
        """One more step (batch). With bounds on, SSD-PS stamps the rows it stores
        from now on with it, so a stamp is never below its row's last update. With
        bounds off nothing reads the stamps, and the batch path keeps its crossings
        into C++ (issue 15's at most 8): stamps move at checkpoints only (each
        checkpoint's flush is stamped with its step; rows evicted between
        checkpoints carry the previous one's), so bounds turned on later may
        expire a row up to one checkpoint interval early."""
        with self._counts_lock:
            self._step += 1
            step = self._step
        if self._bounded:
            self._ssd.set_stamp(step)

    @property
    def _bounded(self) -> bool:
        return bool(self.config.ttl_steps or self.config.max_rows)

    @property
    def step(self) -> int:
        """Batches made by this server since it was created (resumed with its checkpoints)."""
        return self._step

    def _bound(self) -> None:
        """Bounded tables, at a checkpoint after the flush: erases from SSD-PS the
        rows not updated for more than ttl_steps and then the oldest beyond
        max_rows, and drops MEM-PS's copies (clean after the flush; a row pinned
        by a prefetch made beside the checkpoint stays pinned, with the key's
        initial row: its batch reads the key as new, never the row erased)."""
        if not self._bounded:
            return
        gone = bound_store(self._ssd, self._step, self.config.ttl_steps, self.config.max_rows)
        erased = np.concatenate([gone["expired"], gone["capped"]])
        if len(erased):
            self._cache.erase(erased)
        self._count(expired=len(gone["expired"]), capped=len(gone["capped"]))

    def _herald_batch_done(self) -> None:
        with self._host_batches:
            self._herald_active -= 1
            self._host_batches.notify_all()

    def _host_batch_done(self) -> None:
        with self._host_batches:
            self._host_active -= 1
            self._host_batches.notify_all()

    def _plan_routes(self):
        """The run's routes for the device tier's transfers (one plan a run, shared by
        every tier): the topology file's, executed by the host executor on host
        partitions; without one, a flat topology of the host partitions, whose one
        route (through host memory) the tier's own copy takes, counted per link. A CUDA
        tier of several GPUs moves its rows along the file's routes with the CUDA executor,
        or, without a file, gets none and copies directly between its GPUs."""
        g = self.config.devices
        host = _core.cuda_device_count() < g
        if self.config.topology is None:
            if g < 2 or not host:
                return None, None
            topo = htopo.host_partitions(g)
        else:
            topo = htopo.load(self.config.topology)  # (at least g endpoints: config.check)
            gpus = _core.cuda_device_count()
            if not host and len(topo.endpoints) > gpus:
                # A CUDA tier's endpoint e is GPU e: its exchange makes a stream on
                # every one, and a relay stages on its middleman's GPU.
                raise ValueError(f"{self.config.topology}: topology {topo.name!r} has {len(topo.endpoints)} "
                                 f"endpoints, but this machine has {gpus} GPUs for the CUDA tier's devices = "
                                 f"{g}: give a topology of at most {gpus} endpoints (or none)")
        devices, links = topo._native()
        return _core.TierRoutes(devices, links, g, _PLAN_PAIR_BYTES, host and self.config.topology is not None), topo

    def _new_tier(self, capacity: int, track_trained: bool = False):
        return _core.DeviceTier(self.config.devices, capacity, self._native_opt, threads=self.config.device_threads,
                                routes=self._routes, track_trained=track_trained)

    def _fit_tier(self, slot: _TierSlot, most: int) -> None:
        """Grows the slot's (empty) device tables until the batch, `most` keys on
        its fullest device, fills them at most 0.7."""
        capacity = slot.capacity
        while most > 0.7 * capacity and capacity < self.config.device_capacity:
            capacity = min(2 * capacity, self.config.device_capacity)
        if capacity != slot.capacity:
            rows, moved = slot.tier.transfers()
            self._transfers_before = (rows, moved) if self._transfers_before is None else \
                (self._transfers_before[0] + rows, self._transfers_before[1] + moved)
            self._links_before = _add_links(self._links_before, slot.tier.link_counters())
            slot.tier = self._new_tier(capacity)
            slot.capacity = capacity

    def _distinct(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys flattened, distinct keys, where each key is among them)."""
        self._check_keys(keys)
        flat = np.ascontiguousarray(keys.reshape(-1))
        uniq, inverse = _core.unique_keys(flat)  # names a reserved key
        return flat, uniq, inverse

    @staticmethod
    def _check_keys(keys) -> None:
        if not isinstance(keys, np.ndarray) or keys.dtype not in (np.uint64, np.int64):
            raise TypeError(f"keys must be an array of uint64 or int64, got "
                            f"{getattr(keys, 'dtype', type(keys).__name__)}")

    def _check_device_room(self, distinct: int, most: int) -> None:
        if most > self.config.device_capacity:
            raise ValueError(f"a batch of {distinct} distinct keys puts {most} on one device, "
                             f"more than device_capacity = {self.config.device_capacity}; raise device_capacity")

    def checkpoint(self, save: Optional[Callable[[str], None]] = None, *, keep_previous: bool = False) -> int:
        """Makes the whole state durable as the next numbered checkpoint and returns
        its number: dirty MEM-PS rows to SSD-PS, an SSD-PS commit, a snapshot of
        the store in checkpoint_dir(number) (``save(dir)`` adds the caller's files
        there: hps train's dense state), then the metadata names it. A crash
        before that last step leaves the previous checkpoint as the one to open.
        The previous snapshot is dropped after, unless ``keep_previous`` (an MPI
        job keeps it until every rank has finished this one: prune_checkpoints()).
        Waits for a batch in flight to finish (refused, RuntimeError, where this
        thread holds it: ParameterServer.batch).

        On a rank of an MPI job (``<job>/rank<r>``, r below job.json's world, opened
        directly: ``ParameterServer.open("<job>/rank0")``) whose job.json names a
        checkpoint, a checkpoint without ``keep_previous`` is refused with
        ValueError, writing nothing (the pushes stay in the open server): the job's
        checkpoint is the one job.json names, which every rank resumes at, so one
        rank's own would not be the job's, and dropping job.json's would leave the
        job unable to resume or be served. ``keep_previous=True`` is the job's own
        protocol (hps train's ranks): the rank keeps job.json's checkpoint beside
        the new one, and opens at job.json's again (dropping the new one) until
        job.json names it. To change one rank on its own, copy its directory
        elsewhere and open the copy."""
        named = _job_checkpoint(self.config.path)
        if named is not None and not keep_previous:
            manifest, number = named
            raise ValueError(
                f"checkpoint: {self.config.path} is a rank of the job at {os.path.dirname(manifest)}, whose "
                f"{manifest} names checkpoint {number}, the one every rank resumes at: a checkpoint of this rank "
                f"alone would not be the job's, and would drop checkpoint {number}, so that the job could not "
                f"resume. Nothing was written. Train the job (hps train --resume) to change it, or copy this "
                f"directory elsewhere and open the copy")
        held = self._held_here()
        if held:
            self._refuse_waiting_for(held, "ParameterServer.checkpoint",
                                     "waits for every batch of the server to be written back", "is written back",
                                     "Nothing was written.", "Checkpoint once that batch is finished (after {where}).")
        with self._load_lock:
            for slot in self._slots:
                slot.free.wait()
            with self._host_batches:
                while self._host_active or self._herald_active:
                    self._host_batches.wait()
            # The flushes' rows were updated up to now (bounds off: see _advance_step),
            # the caches' too: those MEM-PS does not hold go straight to the write buffer.
            self._ssd.set_stamp(self._step)
            if self._herald is not None:
                self._herald.flush()  # the caches' rows are part of the checkpoint
            self._cache.flush_dirty()
            self._backing.flush()
            self._bound()
            self._ssd.commit()
            number = (self._checkpoint or 0) + 1
            final = self.checkpoint_dir(number)
            tmp = final + ".tmp"
            for leftover in (tmp, final):  # of a checkpoint that a crash left unfinished
                _remove_tree(leftover)
            # checkpoints/ (made by the first checkpoint) is named in the path before the
            # metadata's rename, which may reach the disk before any sync, names a checkpoint in it.
            _make_dirs_durable(os.path.dirname(final))
            os.makedirs(os.path.join(tmp, _STORE_DIR))
            write_store_digest(tmp, self._snapshot_store(os.path.join(tmp, _STORE_DIR)))
            _write_durable(os.path.join(tmp, SERVER_STEP), json.dumps({"step": self._step}).encode())
            if save is not None:
                save(tmp)
            _sync_dir(tmp)
            os.rename(tmp, final)
            _sync_dir(os.path.dirname(final))
            try:
                self._write_metadata(number)  # the commit point
            except BaseException:
                # The rename may have been made before what failed (the sync of its
                # directory): the metadata names `number` then, and the next checkpoint,
                # numbered `number` again, would remove it as a leftover first.
                if self._stored_checkpoint() == number:
                    self._checkpoint = number
                raise
            self._checkpoint = number
            self._count(checkpoints=1)
            if not keep_previous:
                self._prune(keep=number)
            return number

    def stats(self) -> dict:
        backing = self._backing.counts()
        with self._counts_lock:
            counts = dict(self._counts)
        counts.update(mem_misses=backing["rows_loaded"], pending_hits=backing["pending_hits"],
                      ssd_hits=backing["ssd_hits"], initialized=backing["initialized"],
                      ssd_puts=backing["puts"], ssd_rows_put=backing["rows_put"])
        return {"counts": counts, "mem": self._cache.stats(), "ssd": self._ssd.stats(),
                "pending_rows": backing["pending_rows"], "device": self._device_stats()}

    def _device_stats(self) -> dict:
        if self._herald is not None:
            rows, moved = self._herald.transfers()
            return {"kind": f"{self._herald._tier.kind}, herald worker caches", "devices": self.config.devices,
                    "capacity_per_device": self._herald._table_rows,
                    "transfer_rows": rows.tolist(), "transfer_bytes": moved.tolist(),
                    "herald": self._herald.stats()}
        if self._in_place:
            return {"kind": "host, in place (MEM-PS rows)", "devices": 1, "capacity_per_device": 0,
                    "transfer_rows": [[0]], "transfer_bytes": [[0]]}
        rows, transfer_bytes = self._transfers_before or (0, 0)  # counted by the tables the tier outgrew
        for slot in self._slots:
            r, b = slot.tier.transfers()
            rows, transfer_bytes = rows + r, transfer_bytes + b
        out = {"kind": self._slots[0].tier.kind, "devices": self._slots[0].tier.devices,
               "capacity_per_device": max(slot.capacity for slot in self._slots),
               "transfer_rows": rows.tolist(), "transfer_bytes": transfer_bytes.tolist()}
        if self._routes is not None:
            links = self._links_before
            for slot in self._slots:
                links = _add_links(links, slot.tier.link_counters())
            out["routes"] = _routes_stats(self._topology, self._routes, links, self.config.topology)
        return out

    def close(self) -> None:
        """Releases the stores and the path; what was not checkpointed is dropped.
        Closing again does nothing; any other call on a closed server raises
        RuntimeError."""
        if self.__dict__.get("_closed"):
            return
        self._ssd.wait_for_compaction()
        del self._cache, self._backing, self._ssd, self._slots, self._last_batch
        self._closed = True
        self._release_path()

    def __getattr__(self, name: str):
        # Reached only for attributes not found: after close(), the stores it dropped.
        if self.__dict__.get("_closed"):
            raise RuntimeError(f"{self!r} is closed (close() released its stores and path)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"ParameterServer(dim={self.dim}, path={self.config.path!r})"
