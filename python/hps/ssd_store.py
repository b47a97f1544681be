"""SSD-PS: rows on disk in immutable parameter files (docs/ssd_format.md)."""
from __future__ import annotations

import os
import warnings

import numpy as np

from hps import _core
from hps.errors import IoPathWarning


class SsdStore(_core.SsdStore):
    """Fixed-size rows under uint64 keys in a directory of parameter files.

    put(keys, rows) writes new files (never in place); get(keys) reads the rows
    back, grouped by file; commit() makes every put so far durable, then, once
    records on disk exceed ``compaction_trigger`` x the live ones, starts a
    compaction on a background thread (``background_compaction=False`` runs it
    inside commit()); ``wait_for_compaction()`` waits for it, ``compact()``
    runs one in the caller's thread.
    Opening an existing directory replays its manifest: puts that were never
    committed are gone, committed ones are all there.

    Stamps and bounds (docs/ssd_format.md): ``set_stamp(s)`` stamps the files
    that puts write from now on (stamps never go back; ``stamp`` is the current
    one), ``stamps(keys)`` gives (stamp of each key's current copy, found), and
    ``bound(min_stamp, max_live)`` erases the keys stamped below min_stamp, then
    the oldest beyond max_live (0: no cap), returning ``{"expired", "capped"}``
    (sorted uint64 arrays), ``files_dropped`` and ``records_rewritten``; the
    next commit makes it durable.

    ``rows`` is any C-contiguous 2-D array whose rows are ``row_bytes`` long
    (float32 embeddings of dim row_bytes / 4, say); ``get(keys, dtype)`` views
    the rows it returns as ``dtype``.

    >>> import numpy as np, tempfile, hps
    >>> path = tempfile.mkdtemp()
    >>> store = hps.SsdStore(path, row_bytes=8)
    >>> store.put(np.array([1, 2], np.uint64), np.array([[1, 2], [3, 4]], np.float32))
    >>> store.commit()
    >>> rows, found = hps.SsdStore(path, row_bytes=8).get(np.array([2, 9], np.uint64), np.float32)
    >>> rows.tolist(), found.tolist()
    ([[3.0, 4.0], [0.0, 0.0]], [True, False])

    Reads and writes go through io_uring with O_DIRECT where the kernel and
    filesystem allow, else pread/pwrite and the page cache: ``stats()["io_path"]``
    says which path ran, ``io_fallback`` why, and an ``hps.IoPathWarning`` says
    it once per store (``use_io_uring`` / ``direct_io`` = False choose the
    fallbacks without one; ``require_direct_io`` makes a refused O_DIRECT an
    ``hps.IoError``). A compaction that fails raises ``hps.IoError`` from the
    next ``commit()`` (after that commit is durable), once; one that finds a
    file damaged raises ``hps.CorruptionError`` naming it, leaves it as it is
    (``stats()["corrupt_files"]``) and compacts the other files, and one whose
    read of a file the device fails twice (a bad sector) does the same with
    ``hps.IoError`` (``stats()["unreadable_files"]``). A ``bound()`` that meets
    such a file bounds the others without it and the next ``commit()`` says so.
    Any method may be called from any thread; gets run in parallel.
    """

    def __init__(self, path: str | os.PathLike, row_bytes: int, *, file_records: int = 1 << 16,
                 verify_rows_on_open: bool = False, compaction_trigger: float = 1.5,
                 use_io_uring: bool = True, direct_io: bool = True,
                 background_compaction: bool = True, require_direct_io: bool = False):
        super().__init__(os.fspath(path), row_bytes, file_records, verify_rows_on_open,
                         compaction_trigger, use_io_uring, direct_io, background_compaction,
                         require_direct_io)
        self._built = True
        self._path = os.fspath(path)
        self._io_warned = False
        self._warn_of_io_fallback()

    def _warn_of_io_fallback(self) -> None:
        """Warns once if io_uring or O_DIRECT, asked for, fell back. Open finds
        most of it; a later ring or file may too, so the calls that move rows
        check until the warning is out. (Rows moved by a BackingStore are seen
        at the next such call, and in stats().)"""
        why = self.io_fallback
        if why:
            self._io_warned = True
            warnings.warn(f"hps.SsdStore at {self._path} moves rows by {self.stats()['io_path']}, "
                          f"not as asked: {why}", IoPathWarning, stacklevel=3)

    def put(self, keys: np.ndarray, rows: np.ndarray) -> None:
        super().put(keys, rows)
        if not self._io_warned:
            self._warn_of_io_fallback()

    def get(self, keys: np.ndarray, dtype=np.uint8) -> tuple[np.ndarray, np.ndarray]:
        rows, found = super().get(keys)
        if not self._io_warned:
            self._warn_of_io_fallback()
        return rows.view(dtype), found

    def commit(self) -> None:
        super().commit()
        if not self._io_warned:
            self._warn_of_io_fallback()

    def compact(self) -> None:
        super().compact()
        if not self._io_warned:
            self._warn_of_io_fallback()

    def __repr__(self) -> str:
        if not getattr(self, "_built", False):  # its __init__ raised: the methods raise (see MemCache's)
            return "SsdStore(not built: its constructor raised)"
        return f"SsdStore(row_bytes={self.row_bytes}, size={len(self)})"
