"""`hps export`: the rows of a job's last finished checkpoint that changed since a
consumer's previous export (or all of them), as Parquet (docs/serving.md).

Which rows changed: SSD-PS never updates in place. A row updated by training
goes into a new parameter file with a higher sequence number, and a key's
current row is its copy in the highest-numbered live file that holds it. A
consumer's position records, per rank, the highest sequence number of the
checkpoint it last exported; the rows whose current copy is in a file above it
are the ones that may have changed since. This reads every live file's keys (8
bytes a record, no rows) and the changed rows only. A compaction rewrites live
rows unchanged into new, higher-numbered files, so rows it moved are exported
again although unchanged: over-reported, never missed.

Removed keys: the position also keeps the keys the consumer has seen (a sorted
.npy per rank in ``<path>/exports``, 8 bytes a key); a key among them that the
checkpoint no longer holds is a tombstone: the keys that bounded tables
([ps] ttl_steps and max_rows) erased since. SSD-PS erases a key by dropping or
rewriting every file that holds a copy of it, so the live files' keys read here
no longer include it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import uuid
from typing import Optional

import numpy as np

from hps import jobdir
from hps.errors import CorruptionError
from hps.parameter_server import PathInUseError, _make_dirs_durable, _replace_durable, _sync_dir, _write_durable

EXPORT_META = "_export.json"    # in the output directory, written last
TO_LOCK = ".hps-export.lock"    # in the output directory: flock'ed while an export writes there (kept)
CHUNK_ROWS = 1 << 18            # rows read and written at a time (bounds the export's memory)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_consumer(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"consumer name {name!r}: use 1-128 letters, digits, '_', '.', '-', starting with a "
                         f"letter or digit")
    return name


def position_path(root: str, consumer: str) -> str:
    return os.path.join(root, jobdir.EXPORTS, f"{consumer}.json")


def read_position(root: str, consumer: str) -> Optional[dict]:
    try:
        return jobdir.read_export_position(position_path(root, consumer))
    except FileNotFoundError:
        return None


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) with x ~ q * scale[:, None]: scale = max|x| / 127 per row (0 for a
    zero row), q rounded to nearest, so each value is off by at most scale / 2."""
    scale = (np.abs(x).max(axis=1) / 127.0).astype(np.float32) if x.size else np.zeros(len(x), np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(x / safe[:, None]), -127, 127).astype(np.int8)
    return q, scale


def schema(dim: int, state_floats: int, int8: bool, with_state: bool):
    import pyarrow as pa
    fields = [pa.field("key", pa.uint64(), nullable=False)]
    if int8:
        fields += [pa.field("embedding", pa.list_(pa.int8(), dim)), pa.field("scale", pa.float32())]
    else:
        fields.append(pa.field("embedding", pa.list_(pa.float32(), dim)))
    if with_state:
        fields.append(pa.field("state", pa.list_(pa.float32(), state_floats)))
    fields += [pa.field("step", pa.int64()), pa.field("rank", pa.int32(), nullable=False),
               pa.field("tombstone", pa.bool_(), nullable=False)]
    return pa.schema(fields)


def _table(sch, keys, rows, dim, step, rank, int8, with_state, tombstone=False):
    import pyarrow as pa
    n = len(keys)
    cols = {"key": pa.array(keys, pa.uint64())}
    if tombstone:
        for f in sch:
            if f.name not in ("key", "step", "rank", "tombstone"):
                cols[f.name] = pa.nulls(n, f.type)
    else:
        emb = np.ascontiguousarray(rows[:, :dim])
        if int8:
            q, scale = quantize_int8(emb)
            cols["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(q.ravel(), pa.int8()), dim)
            cols["scale"] = pa.array(scale, pa.float32())
        else:
            cols["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel(), pa.float32()), dim)
        if with_state:
            state = np.ascontiguousarray(rows[:, dim:])
            cols["state"] = pa.FixedSizeListArray.from_arrays(pa.array(state.ravel(), pa.float32()),
                                                              state.shape[1])
    cols["step"] = pa.array(np.full(n, -1 if step is None else step, np.int64), pa.int64(),
                            mask=np.full(n, step is None))
    cols["rank"] = pa.array(np.full(n, rank, np.int32))
    cols["tombstone"] = pa.array(np.full(n, tombstone))
    return pa.table([cols[f.name] for f in sch], schema=sch)


def _check_position(pos: dict, view: jobdir.View, consumer: str) -> None:
    where = position_path(view.job.root, consumer)
    # The run first: a position's sequence numbers count another run's files (a job started
    # over in this path, rolled back to an earlier checkpoint, or resharded, numbers its files
    # anew), so its delta would miss the
    # rows of every file numbered at or below them, even once the checkpoints pass its own.
    # (A position or a job written before runs had ids is checked by the rules below alone.)
    if pos.get("run") and view.job.run and pos["run"] != view.job.run:
        raise ValueError(f"{where}: consumer '{consumer}' last exported run {pos['run']}, but the job at "
                         f"{view.job.root} is now run {view.job.run} (started over in this path, rolled back to an "
                         f"earlier checkpoint, or resharded), "
                         f"whose files are numbered anew; its position does not apply: export with --full "
                         f"(a whole snapshot, to replace the consumer's copy)")
    if pos["world"] != view.job.world:
        raise ValueError(f"{where}: consumer '{consumer}' last exported a job of {pos['world']} ranks, the job now "
                         f"has {view.job.world}; its positions do not apply: export with --full")
    if len(pos["ranks"]) != pos["world"]:  # (each rank's entry is read by its number)
        raise ValueError(f"{where}: field 'ranks' holds {len(pos['ranks'])} entries for a job of {pos['world']} "
                         f"ranks (a damaged export position: remove it, then export with --full)")
    if pos["checkpoint"] > view.checkpoint:
        raise ValueError(f"{where}: consumer '{consumer}' last exported checkpoint {pos['checkpoint']}, after the "
                         f"job's checkpoint {view.checkpoint} (was the job started over?): export with --full")


def export(root, to, consumer: str = "default", *, full: bool = False, int8: bool = False,
           with_state: bool = False, chunk_rows: int = CHUNK_ROWS) -> dict:
    """Writes the changed rows (all with ``full``) of the last finished checkpoint
    of the job at root into the new or empty directory ``to`` (one Parquet file a
    rank, then ``_export.json``), then moves the consumer's position to that
    checkpoint. Returns what ``_export.json`` holds. A crash before the position
    moves leaves the previous one: the next export repeats these rows."""
    root, to = os.fspath(root), os.fspath(to)
    check_consumer(consumer)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ImportError("hps export writes Parquet through pyarrow: pip install 'pyarrow>=12' "
                          "(or hps[data])") from None
    # A bool is an int: True was taken as chunks of 1 row.
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
        raise ValueError(f"chunk_rows = {chunk_rows!r}: must be an int >= 1")
    _check_to(to)
    _check_to_outside(root, to)
    exports = os.path.join(root, jobdir.EXPORTS)
    # Nothing is written before the job has a finished checkpoint: a directory that
    # training has yet to start in must stay empty (it refuses a non-empty one).
    if jobdir.read_job(root).checkpoint is None:
        raise FileNotFoundError(f"{root}: the job has no finished checkpoint yet")
    _make_dirs_durable(exports)  # (synced in the root before a position there counts)
    with open(os.path.join(exports, f"{consumer}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one export of a consumer at a time; other consumers run freely
        return _export_locked(root, to, consumer, exports, full, int8, with_state, chunk_rows)


def _check_to(to: str) -> None:
    if os.path.exists(to) and (not os.path.isdir(to) or set(os.listdir(to)) - {TO_LOCK}):
        raise ValueError(f"--to {to}: exists and is not an empty directory; give a new one for each export")


def _check_to_outside(root: str, to: str) -> None:
    """Refuses ``to`` inside the job's directory, compared by real paths (a link or ".."
    spelled it otherwise): the directory is the server's, and its next checkpoint
    removes what it does not know under checkpoints/ (an export there was lost)."""
    real, job = os.path.realpath(to), os.path.realpath(root)
    if os.path.commonpath([real, job]) == job:
        raise ValueError(f"--to {to} is inside the job's directory {root}: the directory is the parameter "
                         f"server's (a checkpoint removes what it does not know in checkpoints/); give one outside it")


def _lock_to(to: str) -> int:
    """Makes ``to`` and locks it for this export (flock on its TO_LOCK file, released
    when the returned descriptor closes). The consumer's lock keeps only exports of
    one consumer apart: two of different consumers given one DIR both found it empty
    and wrote their Parquet files over each other's. A file, not the directory: NFS
    emulates flock with a write lock, which a directory cannot be opened for. It
    stays (pyarrow skips names that begin with '.'): removed, a later export could
    lock a new file of that name while one that opened the old one still writes."""
    # Synced in its parent (and any directory made above it) before the position moves:
    # a power loss after that could otherwise keep the position and lose the rows' files.
    _make_dirs_durable(to)
    fd = os.open(os.path.join(to, TO_LOCK), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _check_to(to)  # again: an export that held the lock until now leaves its files
    except BlockingIOError:
        os.close(fd)
        raise PathInUseError(f"--to {to}: another export is writing this directory; give each export a new "
                             f"one") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _export_locked(root, to, consumer, exports, full, int8, with_state, chunk_rows) -> dict:
    import pyarrow.parquet as pq
    # Again under the lock: an export of this consumer to the same directory may have
    # filled it while this one waited, and this one's delta would overwrite its rows.
    _check_to(to)
    previous = read_position(root, consumer)
    unsettled = _unsettled_key_sets(exports, consumer, previous)
    view = jobdir.pin(root)
    to_lock = None
    try:
        job = view.job
        dim, row_bytes = job.config.dim, job.row_bytes
        state_floats = row_bytes // 4 - dim
        if with_state and not state_floats:
            # Arrow builds no fixed_size_list of 0 values (refused by its size; given as a
            # type, the process crashed), and a column of nothing tells the consumer nothing.
            raise ValueError(f"--with-state: the job's optimizer, {job.config.optimizer.kind}, keeps no state "
                             f"after the embedding; export without --with-state")
        step = view.step()
        pos = None if full else previous
        if pos is not None:
            _check_position(pos, view, consumer)
        to_lock = _lock_to(to)
        sch = schema(dim, state_floats, int8, with_state)
        meta = {"consumer": consumer, "job": os.path.abspath(root), "run": job.run, "checkpoint": view.checkpoint,
                "step": step,
                "world": job.world, "full": pos is None, "since_checkpoint": None if pos is None else pos["checkpoint"],
                "dim": dim, "int8": int8, "with_state": with_state, "optimizer": job.config.optimizer.kind,
                "ranks": [], "rows": 0, "tombstones": 0, "unix_time": time.time()}
        tag = f"{view.checkpoint:06d}-{uuid.uuid4().hex[:8]}"
        new_keys_files = []
        # DIR's files are written under names Parquet readers skip, and take their own names
        # once every rank's is whole, just before _export.json: a read failing partway (a rows
        # block's CRC) closed its rank's file, footer and all, as a well-formed Parquet file of
        # the rows written so far, which a reader of DIR took for the export. An export that
        # fails before _export.json removes them (DIR's lock file alone stays: DIR is empty).
        staged: list = []  # (the path written, its name once whole)
        try:
            for rv in view.ranks:
                keys, seqs = jobdir.latest_records(rv)
                since = None if pos is None else pos["ranks"][rv.rank]["max_sequence"]
                changed = keys if since is None else keys[seqs > np.uint64(since)]
                gone = np.empty(0, np.uint64)
                if pos is not None:
                    seen = [_load_key_set(os.path.join(exports, pos["ranks"][rv.rank]["keys"]), consumer)] \
                        if pos["ranks"][rv.rank].get("keys") else []
                    seen += _readable_key_sets(exports, unsettled.get(rv.rank, []))
                    if seen:  # (each set sorted and distinct: merged only after a failed export)
                        seen = seen[0] if len(seen) == 1 else np.unique(np.concatenate(seen))
                        gone = np.setdiff1d(seen, keys, assume_unique=True)
                name = f"part-rank{rv.rank:05d}.parquet"
                part = os.path.join(to, f".{name}.tmp")
                staged.append((part, name))
                store = jobdir.open_store(rv, row_bytes)
                with pq.ParquetWriter(part, sch) as writer:
                    for at in range(0, len(changed), chunk_rows):
                        chunk = changed[at:at + chunk_rows]
                        with rv.source_names():  # a CRC failure names the checkpoint's file
                            rows, found = store.get(chunk, np.float32)
                        if not found.all():
                            raise CorruptionError(f"{rv.source}: key {int(chunk[~found][0])} is in a parameter file "
                                                  f"but not in the store's index")
                        writer.write_table(_table(sch, chunk, rows, dim, step, rv.rank, int8, with_state))
                    if len(gone):
                        writer.write_table(_table(sch, gone, None, dim, step, rv.rank, int8, with_state, True))
                del store
                _fsync(part)
                keys_name = f"{consumer}.{tag}.rank{rv.rank:05d}.keys.npy"
                buf = _npy_bytes(keys)  # sorted, distinct
                _write_durable(os.path.join(exports, keys_name), buf)
                new_keys_files.append(keys_name)
                meta["ranks"].append({"rank": rv.rank, "file": name, "rows": int(len(changed)),
                                      "tombstones": int(len(gone)), "live_rows": int(len(keys)),
                                      "max_sequence": max(rv.files, default=0),
                                      "since_sequence": since})
                meta["rows"] += int(len(changed))
                meta["tombstones"] += int(len(gone))
            for part, name in staged:
                os.replace(part, os.path.join(to, name))
            _sync_dir(to)  # the parts' names, and
            _sync_dir(exports)  # the key sets', before _export.json says the export is whole
            meta_tmp = os.path.join(to, EXPORT_META + ".tmp")
            staged.append((meta_tmp, None))
            _write_durable(meta_tmp, json.dumps(meta, indent=1).encode())
            os.replace(meta_tmp, os.path.join(to, EXPORT_META))  # (written whole, then named)
        except BaseException:
            for part, name in staged:
                for path in (part, name and os.path.join(to, name)):
                    if path:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
            raise
        _sync_dir(to)
        position = {"consumer": consumer, "checkpoint": view.checkpoint, "step": step, "world": job.world,
                    "run": job.run, "to": os.path.abspath(to), "unix_time": meta["unix_time"],
                    "ranks": [{"rank": r["rank"], "max_sequence": r["max_sequence"], "keys": k}
                              for r, k in zip(meta["ranks"], new_keys_files)]}
        path = position_path(root, consumer)
        _write_durable(path + ".tmp", json.dumps(position, indent=1).encode())
        _replace_durable(path + ".tmp", path)  # the export's commit point
        for name in [r.get("keys") for r in (previous or {}).get("ranks", [])] + \
                [n for names in unsettled.values() for n in names]:
            if name and name not in new_keys_files:
                try:
                    os.remove(os.path.join(exports, name))
                except FileNotFoundError:
                    pass
        return meta
    finally:
        if to_lock is not None:
            os.close(to_lock)
        view.close()


def _unsettled_key_sets(exports: str, consumer: str, position: Optional[dict]) -> dict:
    """{rank: names} of this consumer's key sets that its position does not name:
    exports that failed before their commit point left them. One that failed after
    writing _export.json looks whole, and its reader may hold its rows: the next
    export (from the position before it) writes tombstones for their keys gone
    since too, or those rows would stay with the reader for good (a tombstone for a
    key the reader never got deletes nothing). They go once an export commits."""
    named = {r.get("keys") for r in (position or {}).get("ranks", [])}
    # The whole name as _export_locked writes it, not a prefix: a consumer name may
    # hold '.', so the key sets of consumer 'feed.2' also begin with 'feed.' and a digit.
    own = re.compile(re.escape(consumer) + r"\.[0-9]{6,}-[0-9a-f]{8}\.rank([0-9]{5,})\.keys\.npy")
    out: dict = {}
    for name in sorted(os.listdir(exports)):
        m = own.fullmatch(name)
        if m and name not in named:
            out.setdefault(int(m.group(1)), []).append(name)
    return out


def _load_key_set(path: str, consumer: str) -> np.ndarray:
    """The key set a consumer's position names; damage is named with the file (numpy's
    own message names none) and what to do."""
    try:
        return np.load(path)
    except (ValueError, EOFError) as e:
        raise ValueError(f"{path}: the key set of consumer '{consumer}''s position is damaged ({e}); export "
                         f"with --full (a whole snapshot, which writes a new one)") from None


def _readable_key_sets(exports: str, names: list) -> list:
    """The key sets of failed exports, less those cut short by a crash as they were
    written (each is synced before _export.json is written, so their export never
    looked whole)."""
    out = []
    for name in names:
        try:
            out.append(np.load(os.path.join(exports, name)))
        except (ValueError, EOFError):  # a truncated .npy
            continue
    return out


def _npy_bytes(a: np.ndarray) -> bytes:
    import io
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
