"""Resuming a job on a different number of ranks (reshard on restore).

A job checkpointed on N ranks (or one process: a parameter server at the job's
path) and resumed under ``mpiexec -n M hps train --resume`` is resharded first
(hps.train's _prepare_job runs these steps on every rank):

1. ``check_source`` (rank 0): the checkpoint job.json names is whole on every
   old rank: its store's MANIFEST, STORE and every parameter file the MANIFEST
   lists, and its dense state. What is missing is named; nothing is written.
2. ``write_rank`` (every new rank r): pins the old checkpoint (hps.jobdir: hard
   links, read-only; every old rank's shard), keeps the keys that r owns under M
   (``owner_ranks(keys, M) == r``) with their whole rows (embedding and the
   sparse optimizer's state, which the row holds: Adam's step count too) and
   writes them as a new SSD-PS store in checkpoint K+1 of ``<path>/rank<r>``
   (K: the old checkpoint), beside the dense state of step K (``merge_dense``),
   bounded by the job's [ps] ttl_steps and max_rows as a checkpoint is (onto
   fewer ranks, a rank gets up to several old ranks' caps of rows).
   An old rank's directory keeps its checkpoint K untouched; a directory that
   was no rank of the old job is made anew.
3. ``commit`` (rank 0, once every rank finished step 2): job.json names
   checkpoint K+1 and the new world (the rename is the switch), then the old
   job's files that the new one does not use are removed (the rank directories
   from M on; for a one-process job, its parameter server at the root).

The process that reshards (rank 0) holds the writer lock of every old rank's
directory from step 1 to the end of step 3, and of every other directory that
step 2 writes from right after step 1 (``take_new_ranks``; to_one_process: the
root) to the end too (``Hold``): an ``hps train`` of the old job, or another
reshard, started meanwhile is refused with PathInUseError naming this process,
instead of training on while the reshard rewrites its directories and the switch
takes the job from under it. The ranks write under rank 0's locks
(``write_rank(held=True)``): a lock cannot pass from the rank that wrote a
directory to rank 0, so let go after the write and taken at the commit, a server
opened in between dropped the new checkpoint (or made the commit refuse). A
directory the reshard empties or removes that no Hold has (a new rank's, written
by a caller that runs the steps without take_new_ranks; an old rank's removed by
a later resume) is locked for it: a server open there is refused, naming the
directory, and keeps its files.

A crash before the switch leaves job.json naming checkpoint K of N ranks, whole:
the job resumes on N ranks (each old rank rolls back to K and drops the partial
K+1) or reshards again on M. A failure the reshard's process survives (a rank's
write raised, the commit refused) also removes the directories of the new ranks
from N on as the Hold lets go; a process killed leaves them, and a later reshard
onto as many ranks replaces what they hold. A crash after it leaves the new job whole; the next
resume removes the old files left over (a reshard again: first, ``finish_removal``).
The switch rewrites job.json only: an old rank's metadata names K until a server
opens the rank at K+1, and a new rank's none. Any server opened on a rank's
directory at its last checkpoint (the job's, or one opened there directly) opens
at job.json's (hps.parameter_server): opened at the metadata's, it dropped K+1.
No other file has to change with the switch, so no crash between two of them can
leave a rank naming a checkpoint the job does not.

A removal refused partway (a server open on the third of four directories to go)
leaves the first two removed and the rest whole. It is not made all-or-nothing
(every lock taken first) because nothing reads that state wrongly, and a crash
partway leaves the same: the removals run after the switch, so the job is what
the record names (job.json's ranks below its world; to one process, the root's
server) and every reader and run reads only that, never a directory to remove;
each directory goes whole under its lock or, refused before anything of it goes,
stays whole (a server or Lookup opened on it directly reads on); and the record
of what to remove (job.json's ``resharded_from``; ``resharded-from.json``, kept
until the last rank directory is gone) stays until a later run removes the rest.
Taking every lock first would still leave a crash partway, and changes nothing
that is read.

Back to one process: a job of N ranks resumed by ``hps train --resume`` without
mpiexec becomes a one-process parameter server at the job's root
(``to_one_process``): step 2 writes every row as checkpoint K+1 of a parameter
server at the root (its metadata naming K+1), and the switch is the rename of
job.json to ``resharded-from.json`` (a job's root is read as a job while job.json
is there); then the rank directories are removed (``remove_old_ranks``, run again
by the next one-process run if a crash cut it short). k-step Adam's dense state
(m a rank) has no one-process optimizer to go to: such a job resumes on ranks only.
"""
from __future__ import annotations

import errno
import io
import json
import os
from typing import Optional

import numpy as np

from hps.distributed.sparse import owner_ranks
from hps.jobdir import (MANIFEST, MARKER, RESHARDED_FILE, STORE_DIR, TRAINER_STATE, file_name, latest_records,
                        open_store, pin, read_job, read_job_record, read_json, replay_manifest, write_trainer_state)
from hps.parameter_server import (CHECKPOINTS, JOB_MANIFEST, METADATA, RUN, SERVER_STEP, WRITER_LOCK, PathInUseError,
                                  _lock_path, _make_dirs_durable, _remove_tree, _replace_durable, _sync_dir,
                                  _write_durable, bound_store, check_store_digest, checkpoint_step, new_run_id,
                                  write_store_digest)

RESHARDED = "resharded_from"   # job.json: the world and checkpoint the job was resharded from
_CHUNK = 1 << 16               # rows moved per get / put


class Hold:
    """The writer locks (hps.parameter_server's) of the directories a reshard
    rewrites, held by the process that reshards from check_source until it
    releases them (after commit, or to_one_process's switch): a server opened
    there meanwhile (an ``hps train`` of the old job, or another reshard's
    check) is refused with PathInUseError naming this process. Checking that no
    server is open and then letting go would leave a gap in which a run of the
    old job starts, trains on and checkpoints while its directories are rewritten.
    The process's own server must not open a held directory either (flock: every
    open of the file is another holder): release first.

    A new rank's directory (``take(new_rank=True)``) that holds only its lock file
    when let go (the reshard was refused, or failed, before its rank wrote it; or
    one an earlier reshard's crash left so) goes then, and so does one that is no
    rank of the job then, whatever its rank wrote (the reshard failed before its
    switch: the job is the old one): left, it would be a rank the job does not
    have, which no later removal names."""

    def __init__(self, root: str):
        self.root = os.fspath(root)  # the job's
        self._fds: dict = {}  # realpath -> the lock's file descriptor
        self._new_ranks: dict = {}  # realpath -> the path, of the new ranks' directories

    def take(self, server: str, where: str, new_rank: bool = False) -> None:
        """Locks the directory `server` (once per directory), or raises
        PathInUseError naming `where` and the holder. `new_rank`: the directory of
        a rank the job had not (class docstring)."""
        key = os.path.realpath(server)
        if new_rank:
            self._new_ranks[key] = os.fspath(server)
        if key in self._fds:
            return
        try:
            fd = _lock_path(server, doing=f"resharding the job at {self.root}")
        except PathInUseError as e:
            raise PathInUseError(f"{where}: the job is still running, or another run has it open; it cannot be "
                                 f"resharded under it. {e}") from None
        self._fds[key] = fd

    def hand_over(self, server: str) -> Optional[int]:
        """Gives `server`'s lock to the caller (the file descriptor; None when it is
        not held here), which closes it: a removal that goes on holding it."""
        key = os.path.realpath(server)
        self._new_ranks.pop(key, None)
        return self._fds.pop(key, None)

    def release(self, server: Optional[str] = None) -> None:
        """Lets go of `server`'s lock, or of every lock held; a new rank's directory
        that holds only its lock file goes first (class docstring)."""
        keys = list(self._fds) if server is None else [os.path.realpath(server)]
        for key in keys:
            fd = self._fds.pop(key, None)
            new_rank = self._new_ranks.pop(key, None)
            if fd is None:
                continue
            try:
                if new_rank is not None:
                    _remove_if_no_rank(new_rank)
            finally:
                os.close(fd)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _remove_if_no_rank(path: str) -> None:
    """Removes the directory `path` of a new rank, whose writer lock the caller
    holds, when it is no rank of the job as job.json names it now: the reshard
    failed before its switch (a rank's write raised, the commit refused), so the
    job is the old one, and what the rank wrote there is a copy of its share that
    no later run names (a resume on the old world, or a reshard onto fewer ranks,
    never takes it). Else only a directory holding nothing but its lock file goes
    (_remove_if_lock_alone). The lock file goes last, while held; what cannot be
    removed stays (a later reshard onto as many ranks empties it) rather than hide
    the failure under way."""
    from hps.jobdir import rank_and_job
    try:
        found = rank_and_job(path)
    except (OSError, ValueError):  # (a damaged job.json: named by whatever reads the job next)
        found = None
    if found is not None:
        rank, _, _, job = found
        if job is None or rank >= job["world"]:
            try:
                for name in os.listdir(path):
                    if name != WRITER_LOCK:
                        _remove_tree(os.path.join(path, name))
            except OSError:
                return
    _remove_if_lock_alone(path)


def _remove_if_lock_alone(path: str) -> None:
    """Removes the directory `path`, whose writer lock the caller holds, when its lock
    file is all it holds: the lock file goes first, while held (_lock_path takes no
    removed file's lock). A server that opens there once it is gone makes a new one,
    and the directory stays, its. Run as locks are let go, maybe after a failure:
    what cannot be removed stays (a later reshard empties it) rather than hide that
    failure."""
    try:
        if os.listdir(path) == [WRITER_LOCK]:
            os.unlink(os.path.join(path, WRITER_LOCK))
            os.rmdir(path)
    except OSError:
        pass


def remove_lock_only_ranks(root: str, first: int) -> list:
    """Removes every ``rank<r>`` directory at root, r >= `first` (no rank of the job:
    its world; 0 at a one-process server's root), that holds only its writer lock
    file, and returns their paths. A reshard killed between take_new_ranks and its
    ranks' writes left such directories (its Hold never let go, so never removed
    them), and a resume that is no reshard, or a reshard to fewer ranks than they
    name, never takes them: kept, each would be a rank the job does not have. Each
    is locked for its removal, as Hold's own are (_remove_if_lock_alone); one that a
    server or another reshard holds is theirs and stays, as does one with more in it."""
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        if not (name.startswith("rank") and name[4:].isdigit() and int(name[4:]) >= first):
            continue
        path = os.path.join(root, name)
        try:
            if os.listdir(path) != [WRITER_LOCK]:
                continue
            fd = _lock_path(path, doing=f"removing it: a directory of no rank of the job at {root}")
        except (OSError, PathInUseError):  # (not a directory, gone meanwhile, or held: not this run's)
            continue
        try:
            _remove_if_lock_alone(path)
        finally:
            os.close(fd)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def check_source(root: str, hold: Optional[Hold] = None) -> dict:
    """What resharding the job at root reads, checked whole: {"world", "checkpoint",
    "step", "distributed"}. Raises FileNotFoundError naming the first missing
    part (a rank's checkpoint directory, its store's MANIFEST or STORE, a
    parameter file the MANIFEST lists, the dense state), ValueError when the job
    has no finished checkpoint, hps.CorruptionError when a rank's MANIFEST is not
    the one its checkpoint recorded, PathInUseError when a server of the old job
    is open (the job still runs): its next checkpoint would replace the one
    written here, and the switch would take the job from under it. With `hold`,
    each old rank's directory stays locked in it (Hold): the reshard that follows
    needs that; without, this only checks."""
    job = read_job(root)
    if job.checkpoint is None:
        raise ValueError(f"{root}: the job has no finished checkpoint to reshard")
    for r in range(job.world):
        where = f"rank {r} of the job at {root} (checkpoint {job.checkpoint})" if job.distributed else \
            f"the parameter server at {root} (checkpoint {job.checkpoint})"
        if hold is None:
            _check_not_open(job.rank_dir(r), where)
        elif os.path.isdir(job.rank_dir(r)):  # (a missing one is named below)
            hold.take(job.rank_dir(r), where)
        directory = job.checkpoint_dir(r)
        store = os.path.join(directory, STORE_DIR)
        for path in (directory, os.path.join(store, MANIFEST), os.path.join(store, MARKER),
                     os.path.join(directory, TRAINER_STATE)):
            if not os.path.exists(path):
                raise FileNotFoundError(f"{where}: {path} is missing; the checkpoint cannot be resharded")
        with open(os.path.join(store, MANIFEST), "rb") as f:
            manifest = f.read()
        check_store_digest(directory, manifest)
        files = replay_manifest(manifest, os.path.join(store, MANIFEST))
        for seq in sorted(files):
            path = os.path.join(store, file_name(seq))
            if not os.path.exists(path):
                raise FileNotFoundError(f"{where}: {path} is missing (its MANIFEST lists it); the checkpoint "
                                        f"cannot be resharded")
    step = job.step
    if step is None:
        step = _load_state(os.path.join(job.checkpoint_dir(0), TRAINER_STATE))["batches_done"]
    return {"world": job.world, "checkpoint": job.checkpoint, "step": int(step), "distributed": job.distributed}


def _check_not_open(server: str, where: str) -> None:
    """Raises PathInUseError, naming `where` and the holder, when a parameter server
    has the directory `server` open (its writer lock is held)."""
    if not os.path.exists(os.path.join(server, WRITER_LOCK)):
        return  # never opened since the lock existed: nothing to take it (and nothing created here)
    try:
        fd = _lock_path(server)
    except PathInUseError as e:
        raise PathInUseError(f"{where}: the job is still running, or another run has it open; it cannot be "
                             f"resharded under it. {e}") from None
    os.close(fd)


def _load_state(path: str) -> dict:
    import torch
    return torch.load(path, weights_only=False, map_location="cpu")


def merge_dense(states: list) -> dict:
    """The dense state (hps.train's trainer-state) of every new rank from the old
    ranks'. All-reduce training keeps them equal: rank 0's is taken as it is.
    k-step Adam keeps m per rank (and x and v too between merges; hps train's
    last checkpoint comes after a merge): a floating tensor that differs between
    the old ranks (the MLP's, its optimizer's m and v) is their mean, as a merge
    makes x and v; counters are rank 0's."""
    import torch
    first = states[0]

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    def mean(values):
        a = values[0]
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            if all(same(v, a) for v in values[1:]):
                return a  # (x and v right after a merge): exactly as they are
            return torch.stack(values).mean(dim=0).to(a.dtype)
        if isinstance(a, dict):
            return {k: mean([v[k] for v in values]) for k in a}
        if isinstance(a, list):
            return [mean([v[i] for v in values]) for i in range(len(a))]
        return a

    if "dense_sync" not in first:  # a one-process run's: its steps count as the k-step counter's
        first = {**first, "dense_sync": {"steps": first["batches_done"], "merges": 0}}
    if first.get("admission") and first["admission"].get("sketch") is not None:
        first = {**first, "admission": _merge_admission([s["admission"] for s in states])}
    if all(same(s["mlp"], first["mlp"]) and same(s["opt"], first["opt"]) for s in states[1:]):
        return first
    return {**first, "mlp": mean([s["mlp"] for s in states]), "opt": mean([s["opt"] for s in states])}


def _merge_admission(states: list) -> dict:
    """The [admission] state of every new rank: the job's sketch and counts (every
    rank of a job keeps the same; hps.admission), each rank's part set to 0. Old
    ranks that each counted their own batches (a checkpoint of hps before job-wide
    counting) have their sketches summed (saturating) and their counts added."""
    first = states[0]
    sketches = [s["sketch"] for s in states]
    same = all(np.array_equal(k["counters"], sketches[0]["counters"]) and
               all(k[n] == sketches[0][n] for n in ("occurrences", "admitted", "keys_admitted")) for k in sketches)
    out = {**first, "rank_occurrences": 0, "rank_default_reads": 0}
    if not same:
        counters = np.minimum(np.sum([np.asarray(k["counters"], np.uint32) for k in sketches], axis=0), 255)
        out["sketch"] = {**sketches[0], "counters": counters.astype(np.uint8),
                         **{n: sum(int(k[n]) for k in sketches) for n in ("occurrences", "admitted", "keys_admitted")}}
        out["default_reads"] = sum(int(s["default_reads"]) for s in states)
    return out


def _rank_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"rank{rank}")


def take_new_ranks(root: str, world: int, hold: Hold) -> None:
    """Rank 0, once check_source(root, hold) passed: takes into `hold` the directory
    (made here when missing) of every rank of `world` that was no rank of the old
    job, before any rank writes it; each rank's write_rank then runs with
    held=True. The lock cannot pass from the process that writes a rank to the
    one that commits (another process, maybe on another host): let go after the
    write and taken again at the commit, a server opened in between dropped the
    checkpoint just written (its metadata names none yet) or made the commit
    refuse. Raises PathInUseError naming the rank when a server is open there.
    Each goes when `hold` lets go of it if it holds only its lock file (Hold)."""
    job = read_job(root)
    for r in range(world):
        if job.distributed and r < job.world:
            continue  # (an old rank's: check_source holds it)
        _make_dirs_durable(_rank_dir(root, r))  # (synced in the root before the switch names it)
        hold.take(_rank_dir(root, r), f"rank {r} of the job at {root} as resharded", new_rank=True)


def write_rank(root: str, world: int, rank: int, one_process: bool = False, held: bool = False) -> tuple:
    """Step 2 (module docstring) for new rank `rank` of `world`; returns (the old
    checkpoint, the new one's number, the rows it holds: those bound_store kept). `one_process` (world 1, rank
    0): the rows go to a parameter server at the root (to_one_process).
    `held`: the reshard's rank 0 holds the directory written (take_new_ranks;
    to_one_process the root) until the commit's end, as hps train's does; it is
    not locked here then (flock refuses every other holder, this process's too).
    Else a directory no old rank had is locked only while it is written, and a
    server opened after makes the commit refuse."""
    view = pin(root)
    lock = None  # a new rank's directory's writer lock, held until it is written
    try:
        job = view.job
        number = view.checkpoint + 1
        rank_dir = root if one_process else _rank_dir(root, rank)
        # Its files are numbered anew: a new run (a position of an export never applies across it).
        run_id = new_run_id()
        if one_process:
            from hps.train import _discard_run
            _discard_run(root, held)  # what an earlier reshard to one process that did not finish left
            meta = {**job.metadata, "checkpoint": None, RUN: run_id}
            _write_durable(os.path.join(root, METADATA), json.dumps(meta, indent=1).encode())
        elif not job.distributed or rank >= job.world:
            # No rank of the old job, so check_source's Hold has it not: what is there an earlier
            # reshard that did not finish left, unless a server is open there (a run or another
            # reshard), whose files must not go from under it. (take_new_ranks checked that.)
            _make_dirs_durable(rank_dir)
            if not held:
                try:
                    lock = _lock_path(rank_dir, doing=f"resharding the job at {root}")
                except PathInUseError as e:
                    raise PathInUseError(f"rank {rank} of the job at {root} as resharded: another run has its "
                                         f"directory open; nothing of it was removed. {e}") from None
            for name in os.listdir(rank_dir):
                if name != WRITER_LOCK:
                    _remove_tree(os.path.join(rank_dir, name))
            meta = {**job.metadata, "checkpoint": None, RUN: run_id}
            _write_durable(os.path.join(rank_dir, METADATA), json.dumps(meta, indent=1).encode())
        else:
            # An old rank's directory, whose own run (its metadata's) is what a reader of
            # the directory opened directly (an export's position, a Lookup) compares: its
            # checkpoint `number` (the one its metadata names, where the rank got past
            # job.json's) is replaced below by files numbered anew, and the job's server
            # opens that one keeping the metadata's run. Under the old id a position there
            # took the new files for the old run's: a delta missed every row in a file
            # numbered at or below it. The new id goes first, before anything of the old
            # checkpoint goes; a crash before the switch leaves checkpoint K under it,
            # whose readers then export --full, once.
            meta_path = os.path.join(rank_dir, METADATA)
            meta = {**read_json(meta_path), RUN: run_id}
            _write_durable(meta_path + ".tmp", json.dumps(meta, indent=1).encode())
            _replace_durable(meta_path + ".tmp", meta_path)
        final = os.path.join(rank_dir, CHECKPOINTS, f"{number:06d}")
        tmp = final + ".tmp"
        for leftover in (tmp, final):  # an unfinished checkpoint of the old job, or of an earlier reshard
            _remove_tree(leftover)
        os.makedirs(os.path.join(tmp, STORE_DIR))
        from hps.ssd_store import SsdStore
        c = job.config.ssd
        row_bytes = job.row_bytes
        out = SsdStore(os.path.join(tmp, STORE_DIR), row_bytes, file_records=c.file_records,
                       use_io_uring=c.use_io_uring, direct_io=c.direct_io, background_compaction=False)
        # Rows keep their stamps (the step of their last update, which [ps] ttl_steps
        # and max_rows read): stamps never go back in a store, so the rows go in
        # stamp order, gathered from every old rank, each stamp's under it.
        sources, parts = [], []
        for rv in view.ranks:
            keys, _ = latest_records(rv)
            mine = np.ascontiguousarray(keys[owner_ranks(keys, world) == rank])
            if not len(mine):
                continue
            src = open_store(rv, row_bytes)
            stamps, found = src.stamps(mine)
            if not found.all():
                raise ValueError(f"{rv.source}: key {int(mine[~found][0])} is in a parameter file but the "
                                 f"store does not find it")
            parts.append((np.asarray(stamps, np.uint64), np.full(len(mine), len(sources), np.int64), mine))
            sources.append((rv, src))
        if parts:
            stamps, which, keys = (np.concatenate(x) for x in zip(*parts))
            order = np.lexsort((keys, which, stamps))
            stamps, which, keys = stamps[order], which[order], keys[order]
            cuts = np.flatnonzero((np.diff(stamps) != 0) | (np.diff(which) != 0)) + 1
            for run in np.split(np.arange(len(keys)), cuts):
                rv, src = sources[int(which[run[0]])]
                out.set_stamp(int(stamps[run[0]]))
                for at in range(0, len(run), _CHUNK):
                    k = np.ascontiguousarray(keys[run[at:at + _CHUNK]])
                    rows, found = src.get(k)
                    if not found.all():
                        raise ValueError(f"{rv.source}: key {int(k[~found][0])} is in a parameter file but the "
                                         f"store does not find it")
                    out.put(k, rows)
        del sources
        states = [_load_state(os.path.join(job.checkpoint_dir(r), TRAINER_STATE)) for r in range(job.world)]
        merged = merge_dense(states)
        # The server's step goes on from the old job's (the newest stamp among the
        # rows a rank gets may be older: it would restart the rank's step there).
        step = _server_step(job, merged)
        # max_rows is per rank and hard at each checkpoint, this one too: onto fewer
        # ranks, a rank gets several old ranks' rows (up to their caps together).
        bound_store(out, step, job.config.ttl_steps, job.config.max_rows)
        # What the checkpoint holds, not what was put: onto fewer ranks, max_rows may
        # erase rows again (hps train says "N rows now on M ranks").
        kept = len(out)
        out.commit()
        del out
        with open(os.path.join(tmp, STORE_DIR, MANIFEST), "rb") as f:  # (closed: the store's last word)
            write_store_digest(tmp, f.read())
        import torch
        buf = io.BytesIO()
        torch.save(merged, buf)
        write_trainer_state(tmp, buf.getvalue(), merged["batches_done"], merged["examples_done"])
        _write_durable(os.path.join(tmp, SERVER_STEP), json.dumps({"step": step}).encode())
        _sync_dir(os.path.join(tmp, STORE_DIR))
        _sync_dir(tmp)
        os.rename(tmp, final)
        _sync_dir(os.path.dirname(final))
        # The metadata and checkpoints/ made above in a new rank's directory: synced there
        # before the switch (a rename that may reach the disk first) names the checkpoint,
        # and the old job's files go.
        _sync_dir(rank_dir)
        if one_process:  # the root's server names it (read only once job.json is gone)
            meta = {**job.metadata, "checkpoint": number, "step": step, RUN: run_id}
            _write_durable(os.path.join(root, METADATA + ".tmp"), json.dumps(meta, indent=1).encode())
            _replace_durable(os.path.join(root, METADATA + ".tmp"), os.path.join(root, METADATA))
        return view.checkpoint, number, kept
    finally:
        if lock is not None:
            os.close(lock)
        view.close()


def _server_step(job, merged: dict) -> int:
    """The old job's server step at the checkpoint resharded: its rank 0's record,
    else (a checkpoint made before servers recorded it) job.json's step, or the
    one-process server's metadata's, else the trainer's batches done."""
    step = checkpoint_step(job.checkpoint_dir(0))
    if step is None:
        step = job.step if job.distributed else job.metadata.get("step")
    return int(merged["batches_done"] if step is None else step)


def commit(root: str, world: int, old: dict, number: int, hold: Optional[Hold] = None) -> None:
    """Step 3 (module docstring), rank 0's, once every new rank wrote checkpoint
    `number` from the checkpoint `old` (check_source's) names. `hold` (check_source's)
    takes every new rank's directory too before the switch: from it on, a run of the
    new job could open them while the old files are still being removed. Raises
    FileNotFoundError, switching nothing, when a new rank's checkpoint `number` is
    gone: a server opened on a directory no one held after its rank wrote it (its
    metadata names no checkpoint yet, so the open drops them all)."""
    job = read_job(root)
    if (job.world, job.checkpoint) != (old["world"], old["checkpoint"]):
        raise RuntimeError(f"{root}: the job changed during the reshard (now {job.world} ranks at checkpoint "
                           f"{job.checkpoint}, was {old['world']} at {old['checkpoint']}); resume it again")
    for r in range(world):
        where = f"rank {r} of the job at {root} as resharded"
        if hold is not None:
            hold.take(_rank_dir(root, r), f"{where} (checkpoint {number})")
        written = os.path.join(_rank_dir(root, r), CHECKPOINTS, f"{number:06d}")
        if not os.path.isdir(written):
            raise FileNotFoundError(f"{where}: {written} is gone (a server opened the directory after its rank "
                                    f"wrote it); nothing was switched: resume it again")
    manifest = os.path.join(root, JOB_MANIFEST)
    record = {"world": world, "step": old["step"], "checkpoint": number, RUN: new_run_id(),  # files numbered anew
              RESHARDED: {"world": old["world"], "checkpoint": old["checkpoint"]}}
    _write_durable(manifest + ".tmp", json.dumps(record, indent=1).encode())
    _replace_durable(manifest + ".tmp", manifest)
    remove_old(root, hold)


def remove_old(root: str, hold: Optional[Hold] = None) -> None:
    """Removes what the job resharded from (job.json's RESHARDED) left that the
    job does not use: rank directories from its world on; a one-process job's
    parameter server at the root. Run again on each resume (a crash may cut it short).
    `hold`: the reshard's (commit), whose locks of the old ranks' directories their
    removals keep (without it each is locked for its removal: _remove_server_dir),
    the root's too: let go and taken again by the removal, a server opened in
    between made it refuse (the next run removed it)."""
    from hps.train import _discard_run
    job = read_job_record(os.path.join(root, JOB_MANIFEST))
    old = job.get(RESHARDED)
    if not old:
        return
    for r in range(job["world"], max(job["world"], old["world"])):
        _remove_server_dir(_rank_dir(root, r), f"rank {r} of the job at {root} before its reshard to "
                                               f"{job['world']} ranks", hold)
    if os.path.exists(os.path.join(root, METADATA)):
        fd = hold.hand_over(root) if hold is not None else None
        if fd is None:
            _discard_run(root)
        else:
            try:
                _discard_run(root, held=True)
                os.unlink(os.path.join(root, WRITER_LOCK))  # last, while held, as _discard_run's own
            finally:
                os.close(fd)
    _sync_dir(root)



def to_one_process(root: str, hold: Optional[Hold] = None) -> tuple:
    """Reshards the job of N ranks at root into one parameter server at root (module
    docstring); returns (the old job as check_source gives it, the new checkpoint,
    the rows it holds). Raises ValueError for a k-step Adam job, before writing anything.
    The job's directories are held (Hold) until it returns; given `hold`, until the
    caller releases it (before it opens the server at root)."""
    if hold is None:
        with Hold(root) as own:
            return to_one_process(root, own)
    old = check_source(root, hold)
    if not old["distributed"]:
        raise ValueError(f"{root} holds one parameter server already, not a job of ranks")
    job = read_job(root)
    dense = _load_state(os.path.join(job.checkpoint_dir(0), TRAINER_STATE))
    if any("m" in st for st in dense["opt"].get("state", {}).values()):
        raise ValueError(f"{root}: the job trained its MLP with k-step Adam ([distributed] dense_sync = 'kstep'), "
                         f"whose state (m a rank) one process has no optimizer for; resume it under mpiexec")
    # Held from before it is written to the end: a server opened at root once its
    # metadata is there would drop the checkpoint being written, or (opened after)
    # race the switch and the removal of the rank directories.
    hold.take(root, f"the parameter server at {root} as resharded")
    _, number, rows = write_rank(root, 1, 0, one_process=True, held=True)
    manifest = os.path.join(root, JOB_MANIFEST)
    current = read_job(root)
    if (current.world, current.checkpoint) != (old["world"], old["checkpoint"]):
        raise RuntimeError(f"{root}: the job changed during the reshard (now {current.world} ranks at checkpoint "
                           f"{current.checkpoint}, was {old['world']} at {old['checkpoint']}); resume it again")
    _replace_durable(manifest, os.path.join(root, RESHARDED_FILE))  # the switch
    remove_old_ranks(root, hold)
    return old, number, rows


def finish_removal(root: str) -> None:
    """What the job's last reshard left to remove (remove_old's, or remove_old_ranks'
    where the root is one process now), removed before the job is resharded again:
    that reshard's switch replaces the record that names it, and a resume that is
    no reshard, which removes it otherwise, need not come first. Raises
    PathInUseError as they do, before anything of the new reshard is written."""
    if os.path.exists(os.path.join(root, JOB_MANIFEST)):
        remove_old(root)
    else:
        remove_old_ranks(root)


def remove_old_ranks(root: str, hold: Optional[Hold] = None) -> None:
    """What a job resharded to one process (to_one_process) left: its rank
    directories, then the record of it. Run again by each one-process run (a crash
    may cut it short). `hold`: to_one_process's, which holds the rank directories;
    without it each is locked for its removal (_remove_server_dir). The record is
    the old job's job.json, so read_job_record checks it: a damaged one raises
    ValueError naming the file and the field, before anything is removed."""
    record = os.path.join(root, RESHARDED_FILE)
    if not os.path.exists(record):
        return
    world = read_job_record(record)["world"]
    for r in range(world):
        _remove_server_dir(_rank_dir(root, r), f"rank {r} of the job at {root} before its reshard to one process",
                           hold)
    os.remove(record)  # (kept while a rank directory is refused: the next run removes it then)
    _sync_dir(root)


def _remove_server_dir(path: str, where: str, hold: Optional[Hold] = None) -> None:
    """Removes the directory `path` (an old rank's parameter server) whole, holding
    its writer lock throughout: `hold`'s, where it holds it, else taken here. A
    server open there (an hps train or hps.ParameterServer of that rank, another
    reshard) is refused with PathInUseError naming `where` and the holder, and
    nothing of the directory goes: removed without the lock, its files went from
    under that server. As hps.train's _discard_run, the lock file goes last,
    while held (_lock_path takes no removed file's lock)."""
    if not os.path.isdir(path):
        return
    fd = hold.hand_over(path) if hold is not None else None
    if fd is None:
        try:
            fd = _lock_path(path, doing=f"removing it: {where}")
        except FileNotFoundError:
            return  # (another run removed it meanwhile)
        except PathInUseError as e:
            if not os.path.isdir(path):
                return  # (removed meanwhile, while this one was taking its lock)
            raise PathInUseError(f"{where}: another run has its directory open; it was not removed (stop that "
                                 f"run, then run again). {e}") from None
    try:
        for name in os.listdir(path):
            if name != WRITER_LOCK:
                _remove_tree(os.path.join(path, name))
        os.unlink(os.path.join(path, WRITER_LOCK))
        try:
            os.rmdir(path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # A server opened there once the lock file was gone (it made a new one): it starts empty.
            raise PathInUseError(f"{where}: {path}: another run opened it while it was being removed; what the "
                                 f"old job left there is gone, but the directory stays") from None
    finally:
        os.close(fd)
