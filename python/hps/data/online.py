"""A source that keeps growing: :class:`GrowingDirectory` (online training, ``hps train --online``).

A writer drops files into a directory while the trainer runs; each new file is
read once, whole, through the reader its kind takes (Criteo TSV/Parquet, or a
schema's CSV/Parquet/libsvm), and training goes on until a stop condition.

Which files. Those at every depth, as a finite directory lists them
(:func:`hps.data.list_files`): a writer's partitions or buckets (``day=1/part-0.csv``)
too. A file's *name* is its path under the directory ("day=1/part-0.csv"): what
files are ordered, shared between ranks and replayed by.

When a file is taken (the half-written rule). A file is *ready* when its name
and its directories' are visible (no leading ``.`` or ``_``: ``_SUCCESS``, the
marker, ``_spark_metadata/`` are not data), none ends in a temporary suffix
(:data:`TEMPORARY_SUFFIXES`: ``.tmp``, ``.part``, ``.partial``, ``.inprogress``,
``.crdownload``, ``.copying``), and its size and modification time are the same
in two polls in a row. Writers should
write under a temporary suffix (or a dot name) and rename when done; the size
rule only catches a writer that pauses no longer than a poll interval.

Files are immutable once ready. Each file is read once, whole, when it is
taken: a file changed afterwards under the same name (rewritten, or appended to
by a writer that paused longer than a poll and was taken for done) is not read
again, since its first content was trained on already and reading it again
would train those examples twice. A change that is seen (at a later poll, or
while the file was read) warns once, naming the file (:class:`FileChangedWarning`),
and the file is in ``changed_after_read``. New examples go in new files.

Order. At each poll the ready files not read yet are read in name order; a
file that becomes ready later is read after them even if its name sorts
earlier. Node ``rank`` of ``world`` reads, in the order taken, the files whose
name is its own: a hash of the name modulo ``world`` (:func:`owner`). Each rank
polls on its own and may see files become ready in another order than the
others, so a rank given by a file's place in the order taken would read some
files twice and others never; by name, every file has one rank. The shares are
even over many files, not necessarily over a few.

Stop. Whichever comes first: the marker file (``marker``, ``_DONE`` by default)
appears, and then every file present is read (a writer puts the marker after
its last file, so those files are complete) and the source ends; ``idle``
seconds pass with no new ready file and no file appearing or changing (a
file seen but not yet ready is waited for); ``examples`` examples were read (the last
batch is cut to that number). A file's batches never span two files.

Every file must give the fields of the first one with fields (the file
:meth:`GrowingDirectory.widths` shaped the model by, waiting past files without a byte;
under mpiexec rank 0's, :meth:`GrowingDirectory.agree`), as in a finite data set: one that
does not is a DataError naming it. :meth:`GrowingDirectory.fields` gives them, to which
``hps train`` holds the held-out data.
"""
from __future__ import annotations

import hashlib
import os
import time
import warnings
from typing import Callable, Iterator, Optional

from hps.data.examples import Batch
from hps.data.files import MAX_MALFORMED_EXAMPLES, DataError, _Reader, _visible, _walk_entries

import numpy as np

#: Names ending in one of these are files still being written.
TEMPORARY_SUFFIXES = (".tmp", ".part", ".partial", ".inprogress", ".crdownload", ".copying")


class FileChangedWarning(UserWarning):
    """A file of a growing directory changed after it was read: the change is not
    read (each file is read once, whole; see :mod:`hps.data.online`)."""


def _candidate(name: str) -> bool:
    return _visible(name) and not name.lower().endswith(TEMPORARY_SUFFIXES)


def owner(name: str, world: int) -> int:
    """The rank of ``world`` that reads the file ``name`` (a file name, no directory).
    BLAKE2b, not CRC-32: CRC is linear, and names that differ in a digit or two
    (part-00000 ... part-00007) all fell to rank 0 of 2."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % world


def ready_files(before: dict, now: dict) -> list:
    """Names in ``now`` (name -> (size, mtime_ns)) whose size and mtime are the
    same in ``before``, the previous poll's: the ones no writer touched between
    the two polls, in name order."""
    return sorted(n for n, st in now.items() if before.get(n) == st)


class GrowingDirectory:
    """The files of ``directory`` as they appear, each through ``open_file(path)``
    (a reader of that one file), until a stop condition (see the module's doc).

    ``poll``: seconds between looks at the directory; ``idle``: seconds without a
    new file after which the source ends (None: never); ``marker``: the name
    whose presence ends it once the files present are read (None: no marker);
    ``examples``: at most this many examples (None: no cap).

    One pass: iterating again starts over from an empty set of read files.
    ``files_read`` lists the files read in the current or last pass; ``malformed``
    and ``malformed_examples`` add up what its readers skipped (``skip_malformed``);
    ``changed_after_read`` lists the files read that were seen to change afterwards
    (each warned of once, :class:`FileChangedWarning`; the change is not read).
    """

    def __init__(self, directory, open_file: Callable[[str], object], *, poll: float = 1.0,
                 idle: Optional[float] = 60.0, marker: Optional[str] = "_DONE", examples: Optional[int] = None,
                 rank: int = 0, world: int = 1, batch_size: Optional[int] = None):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            what = "is not a directory" if os.path.exists(directory) else "does not exist"
            raise FileNotFoundError(f"online data: {directory} {what} (an online source is a directory that "
                                    f"new files are written into)")
        if not poll > 0:
            raise ValueError(f"online data: poll must be > 0 seconds, got {poll!r}")
        if idle is not None and not idle >= 0:
            raise ValueError(f"online data: the idle timeout must be >= 0 seconds, got {idle!r}")
        if examples is not None and (isinstance(examples, bool) or int(examples) < 1):
            raise ValueError(f"online data: examples must be >= 1, got {examples!r}")
        self.directory = directory
        self.open_file = open_file
        self.poll, self.idle, self.marker = float(poll), idle, marker
        self.examples = None if examples is None else int(examples)
        if not 0 <= int(rank) < int(world):
            raise ValueError(f"online data: rank must be in [0, world), got rank {rank!r} of world {world!r}")
        self.rank, self.world = int(rank), int(world)
        self.batch_size = batch_size
        self.files_read: list = []
        self.examples_read = 0
        self.malformed = 0
        self.malformed_examples: list = []
        self.changed_after_read: list = []
        self._read_stats: dict = {}  # name -> (size, mtime_ns) when this rank's reader opened it
        self._fields: Optional[tuple] = None
        self._first: Optional[str] = None
        self._early: list = []  # the files first_file() took, the last of them _first
        self._reference: Optional[str] = None  # agree(): the file every rank's files are held to
        self._replay: list = []  # replay(): names a run before this one read, in its order

    def _scan(self) -> dict:
        """name -> (size, mtime_ns) of the candidate files at every depth, by their names
        under the directory ("day=1/part-0.csv"), as a finite directory lists them."""
        out = {}
        try:
            for name, entry in _walk_entries(self.directory, _candidate):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # renamed or removed since the listing
                    continue
                out[name] = (st.st_size, st.st_mtime_ns)
        except OSError as e:
            raise DataError(f"online data: cannot list {self.directory}: {e}", path=self.directory) from e
        return out

    def name(self, path: str) -> str:
        """A file's name in the directory, the one ranks share files by and replay()
        takes: its path under the directory, names joined by "/" ("day=1/part-0.csv")."""
        return os.path.relpath(path, self.directory).replace(os.sep, "/")

    def _marked(self) -> bool:
        return self.marker is not None and os.path.exists(os.path.join(self.directory, self.marker))

    def _files(self) -> Iterator[str]:
        """The paths of the files to read, as they become ready, until a stop condition."""
        taken: set = set()
        before: dict = {}
        last_new = time.monotonic()
        while True:
            marked = self._marked()  # looked at before the listing: the files it saw are complete
            now = self._scan()
            self._check_unchanged(now)
            ready = sorted(now) if marked else ready_files(before, now)
            fresh = [n for n in ready if n not in taken]
            for name in fresh:
                taken.add(name)
                yield os.path.join(self.directory, name)
            # A file not taken yet that is new or changed since the last poll is a
            # file arriving: the idle time counts from it too, else a file seen for
            # the first time just as the idle time runs out is never read.
            arriving = any(n not in taken and before.get(n) != st for n, st in now.items())
            if fresh or arriving:
                last_new = time.monotonic()
            if marked:
                return
            # A file seen and not taken yet is waited for whatever the idle time: it is
            # ready at the next poll unless it changes (else with an idle time shorter
            # than a listing, idle = 0 above all, the files present were never read).
            waiting = any(n not in taken for n in now)
            if self.idle is not None and not waiting and time.monotonic() - last_new >= self.idle:
                return
            before = now
            time.sleep(self.poll)

    def _check_unchanged(self, now: dict) -> None:
        """Warns of the files read in this pass whose (size, mtime) in ``now`` is not
        what it was when they were opened (once each)."""
        for name, st in now.items():
            was = self._read_stats.get(name)
            path = os.path.join(self.directory, name)
            if was is None or was == st or path in self.changed_after_read:
                continue
            self.changed_after_read.append(path)
            warnings.warn(f"{path}: changed after it was read ({was[0]} -> {st[0]} bytes): a growing directory "
                          f"reads each file once, whole, when it is ready, so the change is not read; write new "
                          f"examples as new files (under a temporary name, renamed when complete)",
                          FileChangedWarning, stacklevel=3)

    def _stat(self, path: str) -> Optional[tuple]:
        try:
            st = os.stat(path)
        except OSError:  # gone: the reader names it
            return None
        return st.st_size, st.st_mtime_ns

    def first_file(self) -> Optional[str]:
        """The first file that becomes ready and gives fields (waiting for it, up to the
        stop condition): the one the model's shape is taken from. A file without a byte
        (an empty partition's part) has none, and the next is waited for; with readers
        of fixed fields (Criteo's, which have no ``fields()``), the first file. The files
        taken are kept for the pass that follows; None when the source ends first."""
        if self._first is None:
            self._early = []
            files = self._files()
            try:
                for path in files:
                    self._early.append(path)
                    fields = getattr(self._reader(path), "fields", None)
                    if fields is None or fields() is not None:
                        self._first = path
                        break
            finally:
                files.close()
        return self._first

    def replay(self, names) -> None:
        """The files a run before this one read (``files_read``'s names, kept in its
        checkpoint), in its order: the next pass reads them first, in that order,
        then the files new to it. A resumed run skips the examples done, which is
        right only if they come in the order they came before; in a fresh pass the
        files present are taken in name order, and a file that was read later than
        one whose name sorts after it would be skipped in part and the other read
        again. A file named here that is gone is a DataError naming it."""
        self._replay = [os.fspath(n) for n in names]

    def agree(self, node) -> None:
        """Makes rank 0's first file (its widths()'s) the one whose fields every file of
        every rank must give. Each rank's first file is the first that became ready at
        its own polls, which may be another file on each rank (a file written while the
        ranks started): each then held its files to its own first file, and files of
        other fields (the same counts, so the model's shape agreed) were read on two
        ranks without an error. Collective: every rank of ``node`` (a
        hps.distributed Node) calls it, after widths()."""
        first = self.first_file()
        names = node.allgather("train", None if first is None else self.name(first),
                               "the online data's first file")
        if names[0] is not None:
            self._reference = os.path.join(self.directory, names[0])

    def widths(self) -> tuple:
        """(dense, single-hot, multi-hot) fields of the first file's reader (waiting for it)."""
        first = self.first_file()
        if first is None and self._early:
            raise DataError(f"{self.directory}: the online data gave no file with data before the stop condition "
                            f"({len(self._early)} file(s) read, each empty): no fields to take the model's shape "
                            f"from", path=self.directory)
        if first is None:
            raise FileNotFoundError(f"online data: no file appeared in {self.directory} before the stop condition")
        reader = self._reader(first)
        widths = getattr(reader, "widths", None)
        return widths() if widths is not None else (13, 26, 0)

    def fields(self) -> Optional[tuple]:
        """The fields every file must give (a schema reader's ``fields()``): those of the
        file the model's shape is taken from (under mpiexec rank 0's, :meth:`agree`), to
        which held-out data is held as a finite data set's are; None for readers of fixed
        fields (Criteo's) or when no file came."""
        reference = self._reference or self.first_file()
        fields = None if reference is None else getattr(self._reader(reference), "fields", None)
        return fields() if fields is not None else None

    def widths_file(self) -> Optional[str]:
        """The file :meth:`widths` takes the model's shape from: :meth:`first_file`."""
        return self.first_file()

    def _reader(self, path: str):
        try:
            return self.open_file(path)
        except DataError:
            raise
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e}", path=path) from e

    def __iter__(self) -> Iterator[Batch]:
        self.files_read, self.examples_read = [], 0
        self.malformed, self.malformed_examples = 0, []
        self.changed_after_read, self._read_stats = [], {}
        self._fields = None  # (path, fields) of the pass's first file (_check_fields)
        # The files a run before read (replay()), then those first_file() took (any without
        # fields, then the one widths() shaped the model by), then whatever follows.
        earlier = [os.path.join(self.directory, n) for n in self._replay]
        earlier += [p for p in self._early if p not in earlier]
        files = _chain_first(earlier, (p for p in self._files() if p not in earlier))
        replayed = set(earlier[:len(self._replay)])
        for path in files:
            name = self.name(path)
            if owner(name, self.world) != self.rank:
                continue
            if path in replayed and not os.path.exists(path):
                raise DataError(f"{path}: read before the checkpoint this run resumes from, and gone since: the "
                                f"resumed run cannot skip the examples done (it needs the files read so far, "
                                f"unchanged)", path=path)
            self.files_read.append(path)
            opened = self._stat(path)
            if opened is not None:
                self._read_stats[name] = opened
            reader = None
            try:
                reader = self._reader(path)
                self._check_fields(reader, path)
                # A reader ends its pass at the examples left: a malformed line past them, in a
                # block parsed whole, is neither raised nor counted (_Reader._pass).
                left = None if self.examples is None else self.examples - self.examples_read
                for batch in reader._pass(left) if isinstance(reader, _Reader) and left is not None else reader:
                    if self.examples is not None and self.examples_read + len(batch) >= self.examples:
                        keep = self.examples - self.examples_read
                        if keep < len(batch):
                            batch = batch.rows(np.arange(keep))  # (with its rows' sources)
                        self.examples_read += len(batch)
                        yield batch
                        return
                    self.examples_read += len(batch)
                    yield batch
            except DataError:
                raise
            except _read_errors() as e:  # a damaged or vanished file
                raise DataError(f"{path}: cannot read: {type(e).__name__}: {e}", path=path) from e
            finally:
                self._count_malformed(reader)
            done = self._stat(path)  # (a change while it was read; later ones, the next polls find)
            if opened is not None and done is not None:
                self._check_unchanged({name: done})

    def _check_fields(self, reader, path: str) -> None:
        """Raises DataError unless the file's reader gives the fields the pass's first file
        gave. Each file has a reader of its own, which checks its one file: a file of other
        columns (a schema's categorical = "rest") reached the model as keys of another
        width ("keys must have shape (B, 2), got (16, 3)"), naming no file."""
        fields = getattr(reader, "fields", None)
        if fields is None:  # (the Criteo readers: fixed fields)
            return
        got = fields()
        if got is None:  # a file without data (0 bytes): no rows, so no fields to hold to the first file's
            return
        reference = self._reference or self._first
        if self._fields is None and reference is not None and reference != path:
            # The file widths() gave the model's shape by (rank 0's, agree()), which may
            # be another rank's.
            self._fields = (reference, self._reader(reference).fields())
        if self._fields is None:
            self._fields = (path, got)
        elif got != self._fields[1]:
            from hps.data.tabular import _describe
            raise DataError(f"{path}: the schema gives other fields here than in {self._fields[0]} "
                            f"({_describe(got)} against {_describe(self._fields[1])}): every file of a growing "
                            f"directory must give the same fields", path=path)

    def _count_malformed(self, reader) -> None:
        n = getattr(reader, "malformed", 0)
        if n:
            self.malformed += n
            room = MAX_MALFORMED_EXAMPLES - len(self.malformed_examples)
            self.malformed_examples.extend(reader.malformed_examples[:max(room, 0)])

    def stats(self) -> dict:
        return {"files": len(self.files_read), "examples_read": self.examples_read, "malformed": self.malformed}

    def __repr__(self) -> str:
        return (f"GrowingDirectory({self.directory!r}, poll={self.poll}, idle={self.idle}, marker={self.marker!r}, "
                f"examples={self.examples})")


def _read_errors() -> tuple:
    import zlib
    errors = (OSError, EOFError, zlib.error)
    try:
        import pyarrow
        return errors + (pyarrow.ArrowException,)
    except ImportError:
        return errors


def _chain_first(first: list, rest):
    yield from first
    yield from rest
