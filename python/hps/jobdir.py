"""Reading a job directory without disturbing the job that writes it.

A job directory is what ``hps train`` (or a ParameterServer) leaves at its path:
one parameter server (``hps-parameter-server.json``, ``ssd/``, ``checkpoints/N/``),
or under mpiexec ``job.json`` and one such server per rank in ``rank<r>/``
(hps.parameter_server and hps.train describe both). The readers here (``hps
inspect``, ``hps export``, ``hps.Lookup``) only ever read finished checkpoints:

- The checkpoint to read is the one the job names: ``job.json``'s ``checkpoint``
  in a job (every rank finished it), else the metadata's; of one rank's directory
  (``<job>/rank<r>``) read on its own, job.json's too, and a directory that is no
  rank of its job any more (a reshard's leftover) is refused (read_job). A checkpoint directory
  never changes once renamed into place; training only deletes it whole, once a
  later one is named.
- ``pin()`` takes a private view of it: hard links to the parameter files its
  MANIFEST lists (immutable, so a link is an exact copy that outlives the
  checkpoint's deletion) and copies of its MANIFEST and STORE marker, in
  ``<path>/.hps-readers/<pid>-<id>/rank<r>/``; for one server also a link to hps
  train's step (``trainer-step.json``, or ``trainer-state.pt`` in a checkpoint
  written before that file) in ``<pid>-<id>/``, so that ``View.step()`` still
  reads it once training has pruned the checkpoint; and whether each rank's
  checkpoint holds hps train's dense state (``RankView.dense_state``). If training deletes the
  checkpoint while the links are made (a missing file or MANIFEST), pin starts
  over from the checkpoint the job names then. So the view is always one whole
  checkpoint of every rank, never a mix and never a half-written one.
- An ``SsdStore`` opened on a private view reads it with every check of its own
  (docs/ssd_format.md); what it may change there (its MANIFEST, stray files) is
  the view's, never the job's. Its errors name the checkpoint's files
  (``RankView.source_names``), since the view's go with it.

Views a crashed reader left behind are removed by the next pin; ``View.close()``
removes its own. Each view's reader holds an flock on the view's lock file
(``<pid>-<id>.lock`` beside it) for as long as it reads it, and the kernel drops
it when the reader dies: so a view is taken for dead when its lock can be had,
whatever PID namespace its reader ran in (a container sharing the job's
directory) and whatever process has its PID now.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from hps.errors import CorruptionError, HpsError
from hps.parameter_server import (CHECKPOINTS, FORMAT_VERSION, JOB_MANIFEST, METADATA, RUN, ParameterServerConfig,
                                  _write_durable, check_store_digest)

READERS = ".hps-readers"        # the private views, in the job's root
LOCK_SUFFIX = ".lock"           # <view>.lock, beside each view: flock'ed by its reader while it lives
EXPORTS = "exports"             # the export consumers' positions, in the job's root
RESHARDED_FILE = "resharded-from.json"  # a one-process server's root: the job.json of the job it was resharded from
STORE_DIR = "ssd"
MANIFEST = "MANIFEST"
MARKER = "STORE"
TRAINER_STATE = "trainer-state.pt"
TRAINER_STEP = "trainer-step.json"  # trainer-state.pt's counters, readable without unpickling it
# hps.hierarchical's, beside trainer-state.pt in a trainer rank's checkpoint: the job's
# [hierarchical] layout and plan (every trainer rank), each group PS's blocks (the
# group's first trainer rank), the EASGD centre's parameters (trainer rank 0).
HT_LAYOUT = "hierarchical.json"
HT_GROUP_PS = "group-ps{}.pt"     # .format(index of the PS in its group)
HT_CENTRE = "easgd-centre.pt"
FILE_SUFFIX = ".hpf"
HEADER = struct.Struct("<8sIIQQIIII")  # magic, version, row_bytes, sequence, records, 4 CRCs
MAGIC = b"HPSPARAM"
BLOCK = 4096


# ---------------------------------------------------------------- CRC-32C and the MANIFEST

def _crc_table() -> list:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of short data (MANIFEST records, headers); the bulk checks run native."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


_COMMIT = 3  # a MANIFEST record's type: the files added and deleted before it are live
_BASE = 4  # ... the commit count and highest sequence that open a rolled MANIFEST (no files)


def _manifest_records(data: bytes):
    """(offset, payload) of each whole record of a MANIFEST, in order, up to the
    first that is cut short or fails its CRC (a torn tail, natively)."""
    at = 0
    while at + 8 <= len(data):
        length, crc = struct.unpack_from("<II", data, at)
        if not 1 <= length <= 17 or at + 8 + length > len(data):
            return
        payload = data[at + 8: at + 8 + length]
        if crc32c(payload) != crc:
            return
        yield at, payload
        at += 8 + length


def replay_manifest(data: bytes, where: str = MANIFEST) -> dict:
    """{sequence: records} of the files live at the MANIFEST's last commit record
    (docs/ssd_format.md, "Manifest"). A bad record ends the replay, as a torn
    tail does natively; a damaged log is the native open's to report."""
    live: dict = {}
    pending: dict = {}
    for at, payload in _manifest_records(data):
        kind, length = payload[0], len(payload)
        if kind == 1 and length == 17:
            seq, records = struct.unpack_from("<QQ", payload, 1)
            pending[seq] = records
        elif kind == 2 and length == 9:
            pending.pop(struct.unpack_from("<Q", payload, 1)[0], None)
        elif kind == _COMMIT and length == 1:
            live = dict(pending)
        elif kind == _BASE and length == 17 and at == 0:
            pass  # the store rolled its log: the adds after it are the files live then
        else:
            raise ValueError(f"{where}: record at byte {at}: unknown type {kind} of length {length}")
    return live


def committed_length(data: bytes) -> int:
    """Bytes of a MANIFEST up to the end of its last commit record that replay
    reaches; what follows is a torn tail or uncommitted edits."""
    end = 0
    for at, payload in _manifest_records(data):
        if payload[0] == _COMMIT:
            end = at + 8 + len(payload)
    return end


def encode_manifest(files: dict) -> bytes:
    """A MANIFEST that adds `files` ({sequence: records}) and commits."""
    out = bytearray()
    payloads = [struct.pack("<BQQ", 1, seq, n) for seq, n in sorted(files.items())] + [bytes([_COMMIT])]
    for p in payloads:
        out += struct.pack("<II", len(p), crc32c(p)) + p
    return bytes(out)


def file_name(sequence: int) -> str:
    return f"{sequence:012d}{FILE_SUFFIX}"


def read_header(path: str) -> dict:
    """The fields of a parameter file's header (unchecked: the native open checks)."""
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than a header")
    magic, version, row_bytes, seq, records, keys_crc, rows_crc, header_crc, blocks_crc = HEADER.unpack(raw)
    return {"magic": magic, "version": version, "row_bytes": row_bytes, "sequence": seq, "records": records}


def read_keys(path: str, records: int, first: int = 0) -> np.ndarray:
    """The keys of a parameter file's slots [first, first + records) (the native open
    checked their CRC)."""
    return np.fromfile(path, dtype="<u8", count=records, offset=BLOCK + 8 * first).astype(np.uint64, copy=False)


# ---------------------------------------------------------------- the job

@dataclass
class Job:
    """What a job directory is: its ranks' directories, the checkpoint it names."""
    root: str
    distributed: bool
    world: int
    checkpoint: Optional[int]
    step: Optional[int]          # job.json's; for one server, read from trainer-state.pt (see step_of)
    config: ParameterServerConfig
    metadata: dict
    run: Optional[str] = None    # job.json's run id in a job, else the metadata's (None: written before runs had ids)

    def rank_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"rank{rank}") if self.distributed else self.root

    def checkpoint_dir(self, rank: int, number: Optional[int] = None) -> str:
        number = self.checkpoint if number is None else number
        return os.path.join(self.rank_dir(rank), CHECKPOINTS, f"{number:06d}")

    @property
    def row_bytes(self) -> int:
        from hps.optim import native_optimizer
        c = self.config
        return 4 * native_optimizer(c.dim, c.optimizer, c.initializer, c.seed).row_floats


def read_json(path: str):
    """A JSON file of the job (metadata, job.json, an export position), its damage
    named with the file: json's own message gives only a line and column."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data)
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path}: not JSON ({e})") from None


def _whole_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_job_record(manifest: str) -> dict:
    """job.json at path `manifest`, checked: the one parse of it (hps.jobdir's
    readers, and a ParameterServer opened on a rank's directory, which opens at
    the checkpoint it names), so a damaged one is named alike everywhere. Its
    fields: ``world`` (ranks, >= 1), ``checkpoint`` (the number every rank
    finished; null before the first), and optionally ``step`` (a number or null)
    and ``run`` (a string or null); others are kept as they are. Raises
    ValueError naming the file and the field; FileNotFoundError as open does."""
    job = read_json(manifest)
    if not isinstance(job, dict):
        raise ValueError(f"{manifest}: not a job record (a JSON {type(job).__name__}, not an object)")
    for name in ("world", "checkpoint"):
        if name not in job:
            raise ValueError(f"{manifest}: no field '{name}'")
    checks = {"world": (job["world"], _whole_number(job["world"]) and job["world"] >= 1, "a number of ranks >= 1"),
              "checkpoint": (job["checkpoint"], job["checkpoint"] is None or _whole_number(job["checkpoint"]),
                             "a checkpoint number or null"),
              "step": (job.get("step"), job.get("step") is None or _whole_number(job.get("step")),
                       "a number of batches or null"),
              RUN: (job.get(RUN), job.get(RUN) is None or isinstance(job.get(RUN), str), "a run id or null")}
    for name, (value, sound, what) in checks.items():
        if not sound:
            raise ValueError(f"{manifest}: field '{name}' must be {what}, got {value!r}")
    return job


def rank_and_job(root: str) -> Optional[tuple]:
    """(r, the job's directory, its job.json's path, the record it holds or None
    where there is none) where the directory root is named ``rank<r>``, else None:
    the one reading of a rank directory's job (its readers, a ParameterServer
    opened there). Raises ValueError for a damaged job.json (read_job_record)."""
    path = os.path.realpath(root)
    name, parent = os.path.basename(path), os.path.dirname(path)
    if not (name.startswith("rank") and name[4:].isdigit()):
        return None
    manifest = os.path.join(parent, JOB_MANIFEST)
    try:
        job = read_job_record(manifest)
    except FileNotFoundError:
        job = None
    return int(name[4:]), parent, manifest, job


def _refusal(root: str, rank: int, parent: str, manifest: str, job: Optional[dict]) -> Optional[tuple]:
    """no_rank_of_its_job's answer for rank_and_job(root)'s reading."""
    if job is None:
        if os.path.exists(os.path.join(parent, RESHARDED_FILE)):
            return (f"{root} was rank {rank} of the job at {parent} before its reshard to one process "
                    f"({os.path.join(parent, RESHARDED_FILE)}): what it holds is left for removal, not the job's "
                    f"checkpoint", f"the parameter server at {parent}")
        return None
    if rank >= job["world"]:
        return (f"{root} is no rank of the job at {parent}, which has {job['world']} ranks ({manifest}): what it "
                f"holds is what a reshard left to remove or is writing, not the job's checkpoint",
                f"the job at {parent}, or one of its ranks' directories (rank0 to rank{job['world'] - 1})")
    return None


def no_rank_of_its_job(root: str) -> Optional[tuple]:
    """(why, instead) when the directory root is no rank of its job any more, else
    None (a rank of it, or no job's rank directory at all): ``<job>/rank<r>`` with
    r at or past job.json's world, or beside the record of a reshard to one
    process. What it holds is what a reshard left to remove (or is writing), not
    the job's: the readers refuse it (_rank_checkpoint), and so does a
    ParameterServer opened there. `why` says so, naming root, the job and its
    record (job.json and its world); `instead` names what to use ("the job at
    ..."). Raises ValueError for a damaged job.json (read_job_record)."""
    found = rank_and_job(root)
    return None if found is None else _refusal(root, *found)


def _rank_checkpoint(root: str, own: Optional[int]) -> Optional[int]:
    """The checkpoint to read of the parameter server at root, whose metadata names
    `own`: where root is rank r of a job (``<job>/rank<r>``, r below job.json's
    world), the one job.json names, which the job resumes every rank at (its
    metadata may name another: an old rank after a reshard's switch names the
    checkpoint before it, a rank that got further than job.json one the job
    drops); else `own`. Raises FileNotFoundError for a rank directory that is no
    rank of its job any more (no_rank_of_its_job), which was read silently as if
    it were the job's."""
    found = rank_and_job(root)
    if found is None:
        return own
    refused = _refusal(root, *found)
    if refused is not None:
        why, instead = refused
        raise FileNotFoundError(f"{why}; read {instead}")
    job = found[3]
    return own if job is None else job["checkpoint"]


def read_job(root: str) -> Job:
    """The job at root as it is now. Raises FileNotFoundError when root holds
    neither a job nor a parameter server, ValueError for a format this build
    does not read. root may be one rank's directory (``<job>/rank<r>``), read as
    one parameter server at the checkpoint job.json names (_rank_checkpoint)."""
    root = os.fspath(root)
    if os.path.exists(root) and not os.path.isdir(root):  # a config or a checkpoint's file given by mistake
        raise FileNotFoundError(f"{root} is a file, not a job directory: give the job's path ([ps] path)")
    manifest = os.path.join(root, JOB_MANIFEST)
    if os.path.exists(manifest):
        job = read_job_record(manifest)
        meta_path = os.path.join(root, "rank0", METADATA)
        distributed, world, number, step = True, job["world"], job["checkpoint"], job.get("step")
        run = job.get(RUN)
    else:
        meta_path = os.path.join(root, METADATA)
        distributed, world, number, step, run = False, 1, None, None, None
    try:
        meta = read_json(meta_path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{root} holds no hps job or parameter server (no {JOB_MANIFEST}, "
                                f"no {METADATA})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format {meta.get('format')}, this build reads {FORMAT_VERSION}")
    if not distributed:
        number, run = _rank_checkpoint(root, meta.get("checkpoint")), meta.get(RUN)
    config = ParameterServerConfig.from_dict({**meta["config"], "path": root}, source=meta_path)
    return Job(root, distributed, world, number, step, config, meta, run)


def write_trainer_state(directory: str, data: bytes, batches_done: int, examples_done: int) -> None:
    """hps train's dense state (torch.save's bytes) into a checkpoint directory, and
    beside it its counters as JSON: a reader that wants the step alone (a Lookup's
    refresh, an export) then reads some bytes instead of unpickling the MLP, its
    optimizer and the admission sketch at every checkpoint."""
    _write_durable(os.path.join(directory, TRAINER_STEP),
                   json.dumps({"batches_done": int(batches_done), "examples_done": int(examples_done)}).encode())
    _write_durable(os.path.join(directory, TRAINER_STATE), data)


def write_checkpoint_file(directory: str, name: str, data: bytes) -> None:
    """One more file of the caller's into a checkpoint directory (ParameterServer.
    checkpoint's ``save``), synced: the checkpoint names it only once it is whole."""
    _write_durable(os.path.join(directory, name), data)


def step_of(job: Job, number: Optional[int] = None) -> Optional[int]:
    """The training step (batches done) of a checkpoint: job.json's in a job; for
    one server, trainer-step.json's (hps train's), or trainer-state.pt's in a
    checkpoint written before that file was (needs torch); else None. Of a
    checkpoint that training may prune meanwhile, read a pinned view's
    (View.step)."""
    if job.distributed:
        return job.step if number in (None, job.checkpoint) else None
    if number is None and job.checkpoint is None:
        return None  # a run stopped before its first checkpoint
    return _step_in(job.checkpoint_dir(0, number))


def _step_in(directory: str) -> Optional[int]:
    """step_of of one server's checkpoint, from the files in directory (the
    checkpoint's, or a view's links to them)."""
    try:
        with open(os.path.join(directory, TRAINER_STEP)) as f:
            return int(json.load(f)["batches_done"])
    except FileNotFoundError:
        pass  # an older checkpoint, or pruned meanwhile (then the state is gone too)
    except (ValueError, KeyError, TypeError, OSError):
        return None  # not hps train's
    path = os.path.join(directory, TRAINER_STATE)
    if not os.path.exists(path):
        return None
    try:
        import torch
    except ImportError:
        return None
    import pickle
    try:
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError:
            # [admission]'s sketch counters are numpy arrays, which the weights-only
            # unpickler refuses; hps train reads this file in full as well.
            state = torch.load(path, weights_only=False, map_location="cpu")
        return int(state["batches_done"])
    except (FileNotFoundError, KeyError, RuntimeError, EOFError, OSError, pickle.UnpicklingError):
        return None  # pruned meanwhile, or not hps train's


# ---------------------------------------------------------------- private views

@dataclass
class RankView:
    rank: int
    source: str              # the checkpoint's store directory (may be deleted after pinning)
    path: str                # the private copy
    files: dict              # {sequence: records} live in the checkpoint
    dense_state: bool = False  # the checkpoint holds hps train's dense state (trainer-state.pt)

    def source_name(self, text: str) -> str:
        """text with the private copy's path replaced by the checkpoint's."""
        return text.replace(self.path, self.source)

    @contextlib.contextmanager
    def source_names(self):
        """Errors raised in the block (reads of the private copy) name the
        checkpoint's files instead, the rest of their text kept (a CRC failure's
        block and offset): the copy is gone once the view is closed, so a user
        could not find the file its path names."""
        try:
            yield
        except (HpsError, ValueError, OSError) as e:
            renamed = _renamed(e, self)
            if renamed is None:
                raise
            raise renamed from None


def _renamed(e: BaseException, rank: RankView) -> Optional[BaseException]:
    """e as rank's checkpoint would have raised it (RankView.source_names), or None
    when it names no file of the copy (or its type takes no message alone)."""
    if rank.path not in str(e):
        return None
    try:
        if isinstance(e, OSError) and e.errno is not None:  # errno and filename kept apart, as raised
            args = [e.errno, rank.source_name(e.strerror or "")]
            if e.filename is not None:
                args.append(rank.source_name(os.fsdecode(e.filename)))
            return type(e)(*args)
        return type(e)(rank.source_name(str(e)))
    except TypeError:
        return None


@dataclass
class View:
    """One finished checkpoint of every rank, pinned (module docstring)."""
    job: Job
    checkpoint: int
    directory: str
    ranks: list = field(default_factory=list)
    lock: int = -1           # the descriptor holding the flock on directory's lock file (_private_directory)

    def step(self) -> Optional[int]:
        """The training step of the checkpoint pinned (step_of's), read from the view:
        training may have pruned the checkpoint since."""
        if self.job.distributed:
            return self.job.step  # job.json's, read with the checkpoint it names
        return _step_in(self.directory)

    def close(self) -> None:
        _remove_private(self.directory, self.lock)
        self.lock = -1

    def __enter__(self) -> "View":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _private_directory(root: str, tag: str = "") -> tuple[str, int]:
    """A new private directory in root's .hps-readers, <pid>-<tag><id>, and the
    descriptor of its lock file (<directory>.lock), flock'ed: the directory is this
    process's until _remove_private, or its death (the kernel drops the lock).

    The lock file comes first, locked, and then the directory: a directory whose
    lock file is missing is never one being made. A sweeper that opened the new
    lock file before this process locked it may take it for a dead reader's and
    remove it; then the name is no longer this file, and another is made."""
    readers = os.path.join(root, READERS)
    while True:
        os.makedirs(readers, exist_ok=True)
        directory = os.path.join(readers, f"{os.getpid()}-{tag}{uuid.uuid4().hex[:12]}")
        lock = directory + LOCK_SUFFIX
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # O_RDWR: NFS locks need write access
        except FileNotFoundError:
            continue  # .hps-readers removed meanwhile by a reader that found it empty
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a sweeper holds it
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise
                # A filesystem with no flock: a view with no lock file, judged by its PID.
                _remove_private(directory, fd)
                fd = -1
                os.makedirs(directory)
                return directory, fd
            if _names(lock, fd):
                os.mkdir(directory)
                return directory, fd
        except BaseException:
            _remove_private(directory, fd)
            raise
        os.close(fd)


# flock's errors on a filesystem that takes no locks (some FUSE and network mounts).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


def _names(path: str, fd: int) -> bool:
    """Whether path still names the file open at fd."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


def _remove_private(directory: str, lock: int = -1) -> None:
    """A private directory, its lock file (lock: its descriptor, closed last, so
    that no sweeper takes the directory while it goes), and .hps-readers once
    empty (another reader's may remain)."""
    shutil.rmtree(directory, ignore_errors=True)
    if lock >= 0:
        with contextlib.suppress(OSError):
            if _names(directory + LOCK_SUFFIX, lock):
                os.unlink(directory + LOCK_SUFFIX)
        os.close(lock)
    try:
        os.rmdir(os.path.dirname(directory))
    except OSError:
        pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_views(root: str) -> None:
    """Removes the views in root's .hps-readers whose reader is gone: those whose
    lock file's flock can be had (the kernel dropped it at the reader's death).
    A PID says nothing here: a live reader in another PID namespace (a container
    sharing the directory) has a PID this one may not have, and a dead reader's
    PID may be another process's now. Only a view with no lock file (made by an
    hps from before the locks) is judged by its PID, as then."""
    readers = os.path.join(root, READERS)
    try:
        names = set(os.listdir(readers))
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        pid = name.split("-", 1)[0]
        # Never this process's own: under NFS, flock is emulated with POSIX locks,
        # which one process never conflicts with itself on (and which closing any of
        # its descriptors of the file drops).
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        path = os.path.join(readers, name)
        if name.endswith(LOCK_SUFFIX):
            _remove_if_unlocked(path[:-len(LOCK_SUFFIX)])
        elif name + LOCK_SUFFIX not in names and not os.path.exists(path + LOCK_SUFFIX):
            if not _process_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def _remove_if_unlocked(directory: str) -> None:
    """Removes directory and its lock file if the lock can be had (its reader is
    gone), holding the lock while it does."""
    lock = directory + LOCK_SUFFIX
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return  # removed meanwhile (or not ours to judge)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # its reader lives, in whichever PID namespace (or no lock says otherwise)
        if not _names(lock, fd):
            return  # another sweeper removed it first
        shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(lock)
    finally:
        os.close(fd)


def link_checkpoint(source: str, dst: str, check_digest: bool = True) -> dict:
    """Pins the store of one checkpoint (source) into the new directory dst: links
    to the files its MANIFEST lists, copies of MANIFEST and STORE; returns
    {sequence: records}. FileNotFoundError when the checkpoint is (being) deleted;
    hps.CorruptionError when its MANIFEST is not the one the checkpoint recorded
    (unless not `check_digest`: the caller reports it)."""
    os.makedirs(dst)
    with open(os.path.join(source, MANIFEST), "rb") as f:
        manifest = f.read()
    if check_digest:
        check_store_digest(os.path.dirname(source), manifest)
    with open(os.path.join(source, MARKER), "rb") as f:
        marker = f.read()
    files = replay_manifest(manifest, os.path.join(source, MANIFEST))
    for seq in files:
        os.link(os.path.join(source, file_name(seq)), os.path.join(dst, file_name(seq)))
    with open(os.path.join(dst, MANIFEST), "wb") as f:
        f.write(manifest)
    with open(os.path.join(dst, MARKER), "wb") as f:
        f.write(marker)
    return files


def _link_trainer_step(checkpoint: str, dst: str) -> bool:
    """Links hps train's step of one server's checkpoint (the directory checkpoint)
    into dst: trainer-step.json, or in a checkpoint written before that file the
    dense state it was read from. False when it has neither (a ParameterServer not
    made by hps train, or the checkpoint being deleted)."""
    for name in (TRAINER_STEP, TRAINER_STATE):
        try:
            os.link(os.path.join(checkpoint, name), os.path.join(dst, name))
            return True
        except FileNotFoundError:
            continue
    return False


def pin(root: str, attempts: int = 100, check_digest: bool = True) -> View:
    """A private view of the last finished checkpoint of every rank of the job at
    root. Raises FileNotFoundError when the job has no finished checkpoint yet,
    hps.CorruptionError when it is damaged (a MANIFEST unlike its checkpoint's
    record: unless not `check_digest`, for inspect --verify, which lists it)."""
    root = os.fspath(root)
    _remove_dead_views(root)
    for _ in range(attempts):
        job = read_job(root)
        if job.checkpoint is None:
            raise FileNotFoundError(f"{root}: the job has no finished checkpoint yet")
        directory, lock = _private_directory(root)
        view = View(job, job.checkpoint, directory, lock=lock)
        try:
            for r in range(job.world):
                source = os.path.join(job.checkpoint_dir(r), STORE_DIR)
                path = os.path.join(directory, f"rank{r}")
                view.ranks.append(RankView(r, source, path, link_checkpoint(source, path, check_digest),
                                           os.path.exists(os.path.join(job.checkpoint_dir(r), TRAINER_STATE))))
            stepped = job.distributed or _link_trainer_step(job.checkpoint_dir(0), directory)
            dense = all(rv.dense_state for rv in view.ranks)
            now = read_job(root)
            if now.run == job.run and ((stepped and dense) or now.checkpoint == job.checkpoint):
                return view
            # A new run started meanwhile (its id is written before it deletes the old run's
            # checkpoints): the files linked may be its own checkpoint of the same number. Or
            # the step or a dense state was missing from a checkpoint the job no longer names:
            # deleted meanwhile (a checkpoint the job still names simply has none).
            view.close()
        except FileNotFoundError as e:
            view.close()  # a later checkpoint replaced this one meanwhile: read the job again
            # Training deletes a checkpoint only once the job names a later one: a file
            # missing from the checkpoint the job still names is damage, not a replacement.
            if read_job(root).checkpoint == job.checkpoint:  # damage, as a bad CRC is (exit 1), not a missing job
                raise CorruptionError(f"{e.filename}: missing from checkpoint {job.checkpoint}, which the job at "
                                      f"{root} names: the checkpoint is damaged") from None
        except CorruptionError:
            view.close()  # (no view left behind)
            now = read_job(root)
            if (now.run, now.checkpoint) == (job.run, job.checkpoint):
                raise  # a MANIFEST unlike its checkpoint's record; else it was read as the job moved on
        except BaseException:
            view.close()
            raise
    raise RuntimeError(f"{root}: the job's checkpoint changed during each of {attempts} attempts to pin it")


def open_store(rank: RankView, row_bytes: int, verify: bool = False):
    """The SsdStore of a pinned rank (read it only; a put would go to the view). Its
    reads' errors name the view's files: wrap them in ``rank.source_names()``."""
    from hps.ssd_store import SsdStore
    with rank.source_names():
        return SsdStore(rank.path, row_bytes, verify_rows_on_open=verify, background_compaction=False)


def latest_records(rank: RankView) -> tuple[np.ndarray, np.ndarray]:
    """(keys, sequence of the file holding each key's latest copy), sorted by key:
    a key in several live files (a put after a compaction planned its output)
    counts in the highest-numbered one, as the store's index does."""
    parts_k, parts_s = [], []
    for seq, records in sorted(rank.files.items()):
        with rank.source_names():
            keys = read_keys(os.path.join(rank.path, file_name(seq)), records)
        parts_k.append(keys)
        parts_s.append(np.full(len(keys), seq, np.uint64))
    if not parts_k:
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    keys, seqs = np.concatenate(parts_k), np.concatenate(parts_s)
    order = np.lexsort((seqs, keys))
    keys, seqs = keys[order], seqs[order]
    last = np.ones(len(keys), bool)
    last[:-1] = keys[1:] != keys[:-1]
    return keys[last], seqs[last]


# ---------------------------------------------------------------- hps inspect

def _disk_bytes(path: str) -> int:
    """Bytes of the files under path, each inode once (checkpoints hard-link the store's files)."""
    seen, total = set(), 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def read_export_position(path: str) -> dict:
    """An export consumer's position file (hps.export), checked for the fields that
    export and inspect read: one missing raised a bare KeyError naming neither the
    file nor the field."""
    pos = read_json(path)
    damaged = "a damaged export position: remove it, then export with --full"
    if not isinstance(pos, dict):
        raise ValueError(f"{path}: not a JSON object ({damaged})")
    for name in ("checkpoint", "world", "ranks"):
        if name not in pos:
            raise ValueError(f"{path}: no field '{name}' ({damaged})")
    ranks = pos["ranks"]
    if not isinstance(ranks, list):
        raise ValueError(f"{path}: field 'ranks' is not a list, one entry a rank ({damaged})")
    for i, r in enumerate(ranks):
        if not isinstance(r, dict) or "max_sequence" not in r:
            raise ValueError(f"{path}: ranks[{i}] has no field 'max_sequence' ({damaged})")
    # Each field of the type export reads it as: another (null, a string, a negative
    # number) raised a TypeError or OverflowError naming neither the file nor the field.
    checks = [("checkpoint", pos["checkpoint"], _whole_number(pos["checkpoint"]), "a checkpoint number"),
              ("world", pos["world"], _whole_number(pos["world"]) and pos["world"] >= 1, "a number of ranks >= 1"),
              (RUN, pos.get(RUN), pos.get(RUN) is None or isinstance(pos.get(RUN), str), "a run id or null")]
    for i, r in enumerate(ranks):
        checks += [(f"ranks[{i}].max_sequence", r["max_sequence"], _whole_number(r["max_sequence"]),
                    "a file sequence number"),
                   (f"ranks[{i}].keys", r.get("keys"), r.get("keys") is None or isinstance(r.get("keys"), str),
                    "a key set's file name or null")]
    for name, value, sound, what in checks:
        if not sound:
            raise ValueError(f"{path}: field '{name}' must be {what}, got {value!r} ({damaged})")
    return pos


def export_positions(root: str) -> dict:
    """{consumer: its position file's contents} (hps.export)."""
    out = {}
    d = os.path.join(root, EXPORTS)
    if os.path.isdir(d):
        for name in sorted(os.listdir(d)):
            if name.endswith(".json"):
                out[name[:-5]] = read_export_position(os.path.join(d, name))
    return out


def _checkpoint_numbers(rank_dir: str) -> list:
    d = os.path.join(rank_dir, CHECKPOINTS)
    if not os.path.isdir(d):
        return []
    return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def _sound_marker(directory: str, row_bytes: int) -> bytes:
    """The STORE marker this build writes for rows of row_bytes (a new store's, made in directory)."""
    from hps.ssd_store import SsdStore
    os.makedirs(directory)
    try:
        del_store = SsdStore(directory, row_bytes, background_compaction=False)
        del del_store
        with open(os.path.join(directory, MARKER), "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _check_marker(store_dir: str, directory: str, row_bytes: int) -> Optional[str]:
    """What the native open says of store_dir's STORE marker (a store holding only a
    copy of it, made in directory), or None when it is sound."""
    from hps.errors import HpsError
    from hps.ssd_store import SsdStore
    os.makedirs(directory)
    try:
        shutil.copyfile(os.path.join(store_dir, MARKER), os.path.join(directory, MARKER))
        del_store = SsdStore(directory, row_bytes, background_compaction=False)
        del del_store
        return None
    except (HpsError, ValueError, OSError) as e:
        return str(e).replace(directory, store_dir)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _verify_checkpoint(job: Job, rank: int, number: int, scratch: str, row_bytes: int) -> tuple[list, int]:
    """Checks every parameter file a checkpoint's MANIFEST lists, each on its own
    (so that every bad file is named, not only the first): header, length, the
    block-CRC table, every rows block, the rows and keys CRCs; then the MANIFEST
    itself. Returns (problems, files checked); a checkpoint that training deleted
    meanwhile is no problem."""
    from hps.errors import HpsError
    source = os.path.join(job.checkpoint_dir(rank, number), STORE_DIR)
    pinned = os.path.join(scratch, f"rank{rank}-{number}")
    try:
        files = link_checkpoint(source, pinned, check_digest=False)  # (checked below, as a problem)
    except FileNotFoundError as e:
        # Training deletes only checkpoints other than the one the job names: one of
        # those going meanwhile was pruned, not damaged.
        if not os.path.isdir(job.checkpoint_dir(rank, number)) or read_job(job.root).checkpoint != number:
            return [], 0
        return [f"rank {rank} checkpoint {number}: {e.filename or e}: missing"], 0
    view = RankView(rank, source, pinned, files)
    problems = []
    # The STORE marker once, on its own: each file below is checked in a store of its
    # own, which would otherwise report a damaged marker again for every file.
    problem = _check_marker(pinned, os.path.join(scratch, f"marker-{rank}-{number}"), row_bytes)
    if problem:
        problems.append(f"rank {rank} checkpoint {number}: " + problem.replace(pinned, source))
        with open(os.path.join(pinned, MARKER), "wb") as f:  # the view's copy: the files are checked still
            f.write(_sound_marker(os.path.join(scratch, f"sound-{rank}-{number}"), row_bytes))
    with open(os.path.join(pinned, MARKER), "rb") as f:
        marker = f.read()
    for seq, records in sorted(files.items()):
        one = os.path.join(scratch, f"file-{rank}-{number}-{seq}")
        os.makedirs(one)
        try:
            os.link(os.path.join(pinned, file_name(seq)), os.path.join(one, file_name(seq)))
            with open(os.path.join(one, MANIFEST), "wb") as f:
                f.write(encode_manifest({seq: records}))
            with open(os.path.join(one, MARKER), "wb") as f:
                f.write(marker)
            store = open_store(RankView(rank, source, one, {seq: records}), row_bytes, verify=True)
            if len(store) != len(np.unique(read_keys(os.path.join(one, file_name(seq)), records))):
                problems.append(f"rank {rank} checkpoint {number}: {os.path.join(source, file_name(seq))}: "
                                f"the store indexes {len(store)} keys of {records} records")
            del store
        except (HpsError, ValueError, OSError) as e:
            problems.append(f"rank {rank} checkpoint {number}: " + str(e).replace(one, source))
        finally:
            shutil.rmtree(one, ignore_errors=True)
    if len(problems) > bool(problem):
        return problems, len(files)  # the whole store's open would name the first of them again
    with open(os.path.join(pinned, MANIFEST), "rb") as f:
        manifest = f.read()  # before the open, which cuts a torn tail off the view's copy
    try:
        del_store = open_store(view, row_bytes)  # the MANIFEST's own replay (damage inside the log)
        del del_store
    except (HpsError, ValueError, OSError) as e:
        problems.append(f"rank {rank} checkpoint {number}: " + view.source_name(str(e)))
        return problems, len(files)
    # The replay takes bytes after the last commit for a crash's torn tail, as it must
    # in the live store; but a checkpoint's MANIFEST is copied whole after a commit, so
    # there they are a cut (or damaged) copy that has lost the files of its last commits.
    end = committed_length(manifest)
    if end != len(manifest):
        problems.append(f"rank {rank} checkpoint {number}: {os.path.join(source, MANIFEST)}: "
                        f"{len(manifest) - end} bytes after its last commit record (at byte {end}): a checkpoint's "
                        f"log ends in a commit, so this one is cut short or damaged and may lack committed files")
        return problems, len(files)
    try:  # a cut at a record boundary replays as a shorter log: the checkpoint's own record tells
        check_store_digest(os.path.dirname(source), manifest)
    except CorruptionError as e:
        problems.append(f"rank {rank} checkpoint {number}: {e}")
    return problems, len(files)


def inspect(root: str, verify: bool = False) -> dict:
    """What the job directory at root holds (docs/serving.md, "hps inspect"); with
    ``verify``, every checkpoint's files checked too (``problems`` lists what
    failed, each naming the file and, for a rows block, the block)."""
    from hps import _core
    from hps.errors import HpsError
    job = read_job(root)
    view = pin(job.root, check_digest=not verify) if job.checkpoint is not None else None
    try:
        # The job as pinned: training may have moved to a later checkpoint (and pruned
        # the one read above) meanwhile, and the report counts the view's rows.
        job = view.job if view is not None else job
        row_bytes = job.row_bytes
        report = {
            "path": os.path.abspath(root), "kind": "job" if job.distributed else "parameter server",
            "world": job.world, "checkpoint": view.checkpoint if view is not None else job.checkpoint,
            "step": view.step() if view is not None else step_of(job),
            "format": {"parameter_server": job.metadata.get("format"), "written_by": job.metadata.get("hps_version"),
                       "this_build": _core.__version__},
            "dim": job.config.dim, "optimizer": job.config.optimizer.kind, "row_bytes": row_bytes,
            "disk_bytes": _disk_bytes(job.root), "ranks": [], "exports": export_positions(job.root),
        }
        for r in range(job.world):
            rank_dir = job.rank_dir(r)
            entry = {"rank": r, "checkpoints": _checkpoint_numbers(rank_dir), "disk_bytes": _disk_bytes(rank_dir)}
            if view is not None:
                rv = view.ranks[r]
                versions: dict = {}
                for seq in rv.files:
                    try:
                        v = str(read_header(os.path.join(rv.path, file_name(seq)))["version"])
                    except (ValueError, OSError):  # cut short: the open below names it (--verify: with the rest)
                        v = "unreadable"
                    versions[v] = versions.get(v, 0) + 1
                with open(os.path.join(rv.path, MARKER), "rb") as f:  # damaged, maybe not text: --verify names it
                    marker = f.read().decode("utf-8", "replace").split()
                try:
                    store = open_store(rv, row_bytes)
                    entry["rows"] = len(store)
                    del store
                except (HpsError, ValueError, OSError) as e:  # --verify names the file and what failed
                    entry["error"] = rv.source_name(str(e))
                    if not verify:
                        raise type(e)(entry["error"]) from None
                entry.update(files=len(rv.files), records=int(sum(rv.files.values())),
                             max_sequence=max(rv.files, default=None), param_file_versions=versions,
                             store_format=int(marker[1]) if len(marker) > 1 and marker[1].isascii()
                             and marker[1].isdigit() else None,
                             dense_state=rv.dense_state)  # the pinned checkpoint's: the live one may be pruned
            report["ranks"].append(entry)
        report["rows"] = sum(e.get("rows", 0) for e in report["ranks"])
        if verify:
            problems, checked = [], 0
            scratch, scratch_lock = _private_directory(job.root, "verify-")
            try:
                for r in range(job.world):
                    for number in _checkpoint_numbers(job.rank_dir(r)):
                        p, n = _verify_checkpoint(job, r, number, scratch, row_bytes)
                        problems += p
                        checked += n
            finally:
                _remove_private(scratch, scratch_lock)
            report["verify"] = {"files_checked": checked, "problems": problems, "ok": not problems}
    finally:
        if view is not None:
            view.close()
    return report


def format_report(report: dict) -> str:
    """The human-readable form of inspect()'s report."""
    where = ("no finished checkpoint yet" if report["checkpoint"] is None
             else f"checkpoint {report['checkpoint']} at step {report['step']}")
    lines = [f"{report['path']}: {report['kind']}, {report['world']} rank(s)",
             f"  {where}, dim {report['dim']}, optimizer {report['optimizer']}, rows of {report['row_bytes']} bytes",
             f"  rows {report.get('rows', 0):,}, disk {report['disk_bytes'] / 2**20:,.1f} MiB",
             f"  formats: parameter server {report['format']['parameter_server']} (written by hps "
             f"{report['format']['written_by']}, this build {report['format']['this_build']})"]
    for e in report["ranks"]:
        lines.append(f"  rank {e['rank']}: checkpoints {e['checkpoints']}, {e.get('rows', 0):,} rows in "
                     f"{e.get('files', 0)} files ({e.get('records', 0):,} records), disk "
                     f"{e['disk_bytes'] / 2**20:,.1f} MiB, store format {e.get('store_format')}, "
                     f"parameter file versions {e.get('param_file_versions', {})}")
    if not report["exports"]:
        lines.append("  exports: none")
    for name, pos in report["exports"].items():
        lines.append(f"  export '{name}': checkpoint {pos['checkpoint']} (step {pos.get('step')}), files up to "
                     f"{[r['max_sequence'] for r in pos['ranks']]} per rank")
    v = report.get("verify")
    if v is not None:
        lines.append(f"  verify: {v['files_checked']} files checked, " +
                     ("all sound" if v["ok"] else f"{len(v['problems'])} problem(s):"))
        lines += [f"    {p}" for p in v["problems"]]
    return "\n".join(lines)
