"""Input files: which to read, how to open them, and what every file reader shares.

:func:`list_files` expands paths, globs and directories (local or fsspec URLs);
:func:`shard_files` gives node ``rank`` of ``world`` its share; ``_Reader`` is the
base of the format readers (file list, batching, malformed-line count);
:class:`DataError` is what bad input raises, naming file, line and field;
:class:`EmptyFileWarning` what a file without a row of data warns.
pyarrow and fsspec are imported on first use, so this module needs only numpy.
"""
from __future__ import annotations

import abc
import bz2
import fnmatch
import glob as _glob
import gzip
import os
import re
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from hps.data.examples import Batch, _check_batching, _Piece, _rebatch

#: Messages of skipped lines a reader keeps in ``malformed_examples``.
MAX_MALFORMED_EXAMPLES = 10

# A value longer than this is cut in error messages.
_MAX_SHOWN_VALUE = 40


class DataError(ValueError):
    """Malformed input, with the place it was found.

    ``path``, ``line`` (1-based line of a TSV file, or 1-based row of a Parquet
    file) and ``field`` (a column name such as "I5"; in libsvm text the field of
    data.schema.fields that holds the bad feature's index, or for an index in none
    of them that index) are None when unknown.
    """

    def __init__(self, message: str, *, path: Optional[str] = None, line: Optional[int] = None,
                 field: Optional[str] = None):
        super().__init__(message)
        self.path = path
        self.line = line
        self.field = field


class EmptyFileWarning(UserWarning):
    """A data file holds no data: a Criteo TSV, libsvm or CSV file of 0 bytes (or none
    once decompressed), a Parquet file of 0 rows, a CSV file of a header alone. It gives
    no examples, and the reader goes on to the next file rather than fail: a
    directory of shards may hold empty parts (a Hadoop job writes one for a reducer
    that had no output). ``hps train`` refuses data that gives no
    example at all."""


def _warn_empty(path: str, what: Optional[str] = None) -> None:
    """Warns that the file at path gave no examples: ``what`` it holds (default: no data)."""
    what = what or f"no data{' once decompressed' if _compression(path) else ''}"
    warnings.warn(f"{path}: empty file ({what}): no examples read from it", EmptyFileWarning, stacklevel=2)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401  (submodules are not imported by the package)
        import pyarrow.csv  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ImportError("hps.data's TSV and Parquet readers need pyarrow: pip install pyarrow") from e
    return pyarrow


def _fsspec():
    try:
        import fsspec
    except ImportError as e:
        raise ImportError("reading URLs (s3://, gs://, ...) needs fsspec: pip install fsspec") from e
    return fsspec


_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _is_url(path: str) -> bool:
    return bool(_SCHEME_RE.match(path))


def _visible(name: str) -> bool:
    # Spark and Hadoop leave _SUCCESS, .crc and similar markers beside the data.
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return not base.startswith((".", "_"))


def _wildcard_visible(pattern: str, match: str) -> bool:
    """Whether a glob's match is data: no name that a wildcard part of the pattern
    matched starts with "." or "_" (Spark's _SUCCESS, _temporary/, .crc files),
    unless that part starts with the same character ("out/_part-*" asks for them).
    Names the pattern spells out are the user's own choice and always kept."""
    pp, mp = pattern.split("/"), match.split("/")
    if "**" in pp:  # "**" matches any number of names (none too): pair the parts around it
        i, j = pp.index("**"), len(pp) - pp[::-1].index("**")
        tail = len(pp) - j
        pairs = (list(zip(pp[:i], mp[:i])) + [("**", m) for m in mp[i:len(mp) - tail]]
                 + list(zip(pp[j:], mp[len(mp) - tail:])))
    else:
        pairs = list(zip(pp, mp))
    return all(not (_glob.has_magic(part) and name[:1] in (".", "_") and not part.startswith(name[0]))
               for part, name in pairs)


def _walk(top: str) -> list[str]:
    """The files under directory ``top`` at every depth (a partitioned data set's
    day=.../part-0.parquet), in sorted order, which is its ``top/**`` glob's: names
    starting with "." or "_" left out, directories too (_temporary/, .ipynb_checkpoints/)."""
    return sorted(entry.path for _, entry in _walk_entries(top, _visible))


def _walk_entries(top: str, keep: Callable[[str], bool]) -> Iterator[tuple[str, os.DirEntry]]:
    """(name under ``top``, names joined by "/"; its os.DirEntry) of each file under
    directory ``top`` at every depth, where ``keep`` takes the file's name and each of
    its directories'. Links are followed, as a glob follows them; a link to a directory
    that holds it is a ValueError naming it (its files would repeat without end). A
    directory below ``top`` that is gone by the time it is listed is passed over (a
    growing directory's writer may remove its own); ``top``'s own listing raises OSError."""
    def visit(directory: str, prefix: str, above: frozenset):
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except FileNotFoundError:
            if not prefix:
                raise
            return
        for entry in entries:
            if not keep(entry.name):
                continue
            try:
                if entry.is_dir():
                    real = os.path.realpath(entry.path)
                    if real in above:
                        raise ValueError(f"{entry.path}: a link to {real}, a directory that holds it: the data "
                                         f"files under it would be listed without end")
                    yield from visit(entry.path, prefix + entry.name + "/", above | {real})
                elif entry.is_file():
                    yield prefix + entry.name, entry
            except FileNotFoundError:  # (removed since the listing)
                continue

    yield from visit(top, "", frozenset({os.path.realpath(top)}))


def _expand(path: str) -> list[str]:
    if _is_url(path):
        fs, p = _fsspec().core.url_to_fs(path)
        if _glob.has_magic(p):
            found = sorted(fs.unstrip_protocol(q) for q in fs.glob(p)
                           if _wildcard_visible(p, q) and not fs.isdir(q))
        elif fs.isdir(p):  # every depth, as _walk
            top = p.rstrip("/")
            found = sorted(fs.unstrip_protocol(q) for q in fs.find(p, withdirs=False)
                           if all(_visible(name) for name in q[len(top):].strip("/").split("/")))
        elif fs.exists(p):
            return [path]
        else:
            raise FileNotFoundError(f"no such file: {path}")
    elif _glob.has_magic(path):
        # recursive: "**" is any depth, as in an fsspec URL's glob
        found = sorted(q for q in _glob.glob(path, recursive=True)
                       if _wildcard_visible(path.replace(os.sep, "/"), q.replace(os.sep, "/")) and os.path.isfile(q))
    elif os.path.isdir(path):
        found = _walk(path)
    elif os.path.isfile(path):
        return [path]
    else:
        raise FileNotFoundError(f"no such file: {path}")
    if not found:
        raise FileNotFoundError(f"no data file in {path}")
    return found


def _listed_roots(top: str) -> list[str]:
    """The real paths of the directories whose files a listing of directory ``top``
    takes at every depth: ``top``'s own, and the target of each link to a directory
    that the listing follows (under names it takes, as _walk follows them). A check
    that a path is no data compares it with each: the real path of ``top`` alone
    missed one reached through a link (data/more -> elsewhere/)."""
    return [os.path.realpath(top)] + [real for _, real in _linked_dirs(top)]


def _linked_dirs(top: str, depth: Optional[int] = None) -> Iterator[tuple[list, str]]:
    """(the names from ``top`` down to it, its real path) of each link to a directory
    under directory ``top``, through directories and links under names a listing
    takes (none starting with "." or "_"), as _walk and a glob's wildcards follow
    them; only the first ``depth`` levels below ``top`` (None: every level)."""
    def visit(directory: str, names: list, above: frozenset):
        if depth is not None and len(names) >= depth:
            return
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError:  # (gone, or unreadable: the listing names it)
            return
        for entry in entries:
            if not _visible(entry.name):
                continue
            try:
                if not entry.is_dir():
                    continue
                real = os.path.realpath(entry.path)
                if real in above:  # (a link to a directory that holds it: the listing refuses it)
                    continue
                if entry.is_symlink():
                    yield names + [entry.name], real
                yield from visit(entry.path, names + [entry.name], above | {real})
            except OSError:
                continue

    yield from visit(top, [], frozenset({os.path.realpath(top)}))


def _glob_takes(pattern: str, path: str, below: bool) -> bool:
    """Whether the local glob ``pattern``, as list_files expands it, lists the file at
    ``path`` (a real path), or with ``below``, a file under the directory ``path``
    under some names (one a run has yet to write there): its names from the glob's
    fixed directories ("data" of "data/**/*.csv"), by their real path or through a
    link below them that the glob's wildcards follow, must match the glob's parts,
    each name a wildcard matches one a listing takes (_wildcard_visible)."""
    parts = pattern.split(os.sep)
    fixed = next(i for i, part in enumerate(parts) if _glob.has_magic(part))
    top = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else os.curdir)
    wild = [part for part in parts[fixed:] if part]
    # A link deeper than the glob's parts reach is never followed: "**" reaches any depth.
    reach = None if "**" in wild else len(wild) - 1
    for names, real in [([], os.path.realpath(top))] + list(_linked_dirs(top, reach)):
        inside = os.path.relpath(path, real)
        if inside.split(os.sep)[0] == "..":
            continue
        if _parts_match(wild, names + ([] if inside == os.curdir else inside.split(os.sep)), below):
            return True
    return False


def _parts_match(parts: list, names: list, below: bool) -> bool:
    """Whether a glob's parts match ``names`` ("**" any number of them), and with
    ``below``, ``names`` followed by one or more names of a run's choosing."""
    if not names:
        # Any part matches some name (a wildcard's, one that a listing takes); "**" none too.
        return bool(parts) if below else all(part == "**" for part in parts)
    if not parts:
        return False
    part, name = parts[0], names[0]
    if part == "**":
        return _parts_match(parts[1:], names, below) or (_visible(name) and _parts_match(parts, names[1:], below))
    if _glob.has_magic(part) and name[:1] in (".", "_") and not part.startswith(name[0]):
        return False  # (_wildcard_visible)
    return fnmatch.fnmatchcase(name, part) and _parts_match(parts[1:], names[1:], below)


def list_files(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> list[str]:
    """Data files named by ``paths``: a path, glob or directory, or a list of them.

    Globs and directories expand to their files in sorted order (so every node
    sees the same list); ``**`` in a glob matches any number of directories,
    local or URL; a directory gives its files at every depth, as ``DIR/**`` does
    (a partitioned data set's ``day=.../part-0.parquet``); a list keeps its order.
    Names starting with ``.`` or ``_`` (Spark's and Hadoop's ``_SUCCESS``,
    ``_committed_*``, ``.crc`` files, ``_temporary/``, ``.ipynb_checkpoints/``)
    are left out of a directory at every depth and out of what a wildcard
    matches (``out/*``, ``out/**/*.csv``), as pyarrow datasets leave them out; a
    file named as it is (``out/_SUCCESS``), or by a wildcard that starts with the
    same character (``out/_part-*``), is read. A file named twice (a directory and a
    file in it, overlapping globs, a link and its target) is a ValueError naming it.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = [f for p in paths for f in _expand(os.fspath(p))]
    if not files:
        raise ValueError("no data files given")
    _refuse_repeats(files)
    return files


def _refuse_repeats(files: list[str]) -> None:
    """Raises ValueError naming a file that ``files`` holds twice (a directory and a file
    in it, two globs that overlap, "a.tsv" and "./a.tsv", a link and its target): it
    would be read twice, its examples trained on twice in a pass, and under mpiexec
    possibly by two ranks."""
    seen: dict = {}
    for f in files:
        key = f if _is_url(f) else os.path.realpath(f)
        if key in seen:
            also = "" if seen[key] == f else f" (as {seen[key]} and as {f})"
            raise ValueError(f"{f}: named more than once in the data paths{also}: its examples would be read "
                             f"twice a pass; name each file once (epochs repeat the data)")
        seen[key] = f


def shard_files(files: Sequence[str], rank: int = 0, world: int = 1) -> list[str]:
    """The files node ``rank`` of ``world`` reads: ``files[rank::world]``.

    Raises ValueError when that is none, since a node without data would hang
    a synchronous data-parallel job at its first collective.
    """
    _check_batching(1, rank, world)
    mine = list(files)[rank::world]
    if not mine:
        raise ValueError(f"rank {rank} of {world} gets no file: there are {len(files)} files for {world} "
                         f"ranks; use at most {len(files)} ranks or split the data into more files")
    return mine


#: Compression by file name suffix (any case): what the readers decompress.
_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}


def _compression(path: str) -> Optional[str]:
    """The compression a file's name says ("gzip", "bz2", "zstd"), or None."""
    name = path.lower()
    return next((kind for ext, kind in _COMPRESSED.items() if name.endswith(ext)), None)


class _CodecStream:
    """A pyarrow codec stream over a file object (a URL's); closing it closes the
    stream (finishing it, when writing), then that file object."""

    def __init__(self, raw, stream):
        self._raw = raw
        self._stream = stream

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Decompressed(_CodecStream):
    """The decompressed bytes of a file object of compressed ones, by pyarrow's codecs."""

    def __init__(self, raw, kind: str):
        pa = _pyarrow()
        super().__init__(raw, pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), kind))

    def read(self, n: Optional[int] = -1) -> bytes:
        return self._stream.read() if n is None or n < 0 else self._stream.read(n)

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._stream.closed


class _Compressing(_CodecStream):
    """A writer that compresses into a file object by pyarrow's codecs."""

    def __init__(self, raw, kind: str):
        pa = _pyarrow()
        super().__init__(raw, pa.CompressedOutputStream(pa.PythonFile(raw, mode="w"), kind))

    def write(self, data: bytes) -> int:
        return self._stream.write(data)


def _open_binary_for_writing(path: str):
    """A binary writer to ``path`` (local or a URL) that compresses as the name says,
    so that _open_binary reads back what was written."""
    kind = _compression(path)
    if _is_url(path):
        raw = _fsspec().open(path, "wb", compression=None if kind else "infer").open()
        return _Compressing(raw, kind) if kind else raw
    if kind == "gzip":
        return gzip.open(path, "wb")
    if kind == "bz2":
        return bz2.open(path, "wb")
    if kind == "zstd":
        return _pyarrow().output_stream(path, compression="zstd")
    return open(path, "wb")


def _open_binary(path: str):
    """A binary file object of the file's bytes, decompressed as its name says
    (_compression), local or a URL; a URL of another compression suffix (.xz
    ...) as fsspec infers it."""
    kind = _compression(path)
    if _is_url(path):
        if kind is None:
            return _fsspec().open(path, "rb", compression="infer").open()
        # Not fsspec's inference: without the optional zstandard module it reads a
        # .zst file as it is, compressed bytes given as text.
        return _Decompressed(_fsspec().open(path, "rb").open(), kind)
    if kind == "gzip":
        return gzip.open(path, "rb")
    if kind is not None:  # pyarrow's codecs (as the schema readers'): an empty .bz2 file is empty,
        return _pyarrow().input_stream(path, compression=kind)  # where the bz2 module calls it cut short
    return open(path, "rb")


# How far into a file _LfLineEnds looks for a "\n" before taking its line ends for "\r".
_LINE_END_SNIFF_BYTES = 64 << 10


class _LfLineEnds:
    """A binary reader of a file's bytes for the readers that end lines at "\n" alone
    (Criteo TSV, libsvm), with a file of lone "\r" line ends (classic Mac OS, Excel's
    "CSV (Macintosh)") given as one of "\n" line ends, as SchemaCsv (pyarrow.csv) reads
    it: otherwise the file was one line, one malformed example (skipped without a
    word with skip_malformed), and read whole into memory to find its end. A file is
    taken for one of "\r" line ends when its first _LINE_END_SNIFF_BYTES (or all, if
    fewer) hold a "\r" and no "\n": in a file of "\n" line ends a stray "\r" stays
    in its line, which it makes malformed. Each "\r\n" of such a file stays one line
    end. The first bytes are read on the first read, so that a damaged compressed
    file fails where the reader's reads are guarded.
    """

    def __init__(self, raw):
        self._raw = raw
        self._cr = None  # whether the line ends are "\r": known at the first read
        self._head = b""  # what the look for a "\n" read, not yet given
        self._held = b""  # a "\r" last in what was read, which may be a "\r\n"'s

    def _sniff(self) -> None:
        head = b""
        while len(head) < _LINE_END_SNIFF_BYTES and b"\n" not in head:
            data = self._raw.read(_LINE_END_SNIFF_BYTES - len(head))
            if not data:
                break
            head += data
        if head.endswith(b"\r"):
            head += self._raw.read(1)  # a "\n" after it makes this a "\r\n"
        self._cr = b"\r" in head and b"\n" not in head
        self._head = head

    def read(self, n: Optional[int] = -1) -> bytes:
        """At most about n bytes (one more where a held "\r" goes out); all with n < 0."""
        if self._cr is None:
            self._sniff()
        whole = n is None or n < 0
        while True:
            if self._head:
                data = self._head if whole else self._head[:n]
                self._head = self._head[len(data):]
                if whole:
                    data += self._raw.read()
            else:
                data = self._raw.read() if whole else self._raw.read(n)
            if not self._cr:
                return data
            if not data:  # the end: a held "\r" is the last line end
                data, self._held = self._held, b""
                return data.replace(b"\r", b"\n")
            data, self._held = self._held + data, b""
            if data.endswith(b"\r"):
                data, self._held = data[:-1], b"\r"
                if not data:
                    continue
            return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def close(self) -> None:
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parquet_errors(pa) -> tuple:
    """What pyarrow raises on a damaged Parquet file: ArrowInvalid (a ValueError), a
    plain OSError ("Couldn't deserialize thrift"), UnicodeDecodeError for a column
    name that is not UTF-8 in the footer."""
    return (pa.ArrowException, OSError, UnicodeDecodeError)


@contextmanager
def parquet_file(pa, path: str):
    """The pyarrow ParquetFile of `path` (a local path or a URL), its footer read;
    a damaged file raises DataError naming it."""
    with (_fsspec().open(path, "rb").open() if _is_url(path) else open(path, "rb")) as f:
        try:
            pf = pa.parquet.ParquetFile(f)
            pf.schema_arrow
        except parquet_errors(pa) as e:
            raise DataError(f"{path}: not a readable Parquet file: {e}", path=path) from e
        yield pf


def _line_bounds(block: bytes) -> tuple:
    """(the block as uint8, starts, ends) of its lines, without their "\n" (int64 each):
    what the compiled line parsers take."""
    data = np.frombuffer(block, np.uint8)
    ends = np.flatnonzero(data == 10)
    if not block.endswith(b"\n"):
        ends = np.append(ends, len(block))
    starts = np.empty(len(ends), np.int64)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    return data, starts, ends.astype(np.int64)


def _shown(value) -> str:
    """A value for a message: its repr, cut after _MAX_SHOWN_VALUE characters;
    bytes that are not UTF-8 as a bytes literal, so that each escape shows once."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return repr(value[:_MAX_SHOWN_VALUE]) + ("..." if len(value) > _MAX_SHOWN_VALUE else "")
    if isinstance(value, str) and len(value) > _MAX_SHOWN_VALUE:
        value = value[:_MAX_SHOWN_VALUE] + "..."
    return repr(value)


def _rows_before(piece: _Piece, places: list, order: dict) -> list[int]:
    """For each of ``places`` ((file's index in ``order``, line) of a malformed line, in
    increasing order), how many of the piece's rows come before it in the pass: the rows
    of a piece lie in (file, line) order. One walk over both (a dirty block has a span of
    rows between each two bad lines)."""
    out, n, i, sources = [], 0, 0, piece.sources
    for place in places:
        while i < len(sources) and (order.get(sources[i].path, -1),
                                    sources[i].first_line + sources[i].count - 1) < place:
            n += sources[i].count
            i += 1
        inside = 0
        if i < len(sources) and (order.get(sources[i].path, -1), sources[i].first_line) < place:
            inside = place[1] - sources[i].first_line  # (within this span: the same file)
        out.append(n + inside)
    return out


class _Reader(abc.ABC):
    """What the file readers share: file list, batching and the malformed-line count."""

    def __init__(self, paths, batch_size: int = 4096, *, rank: int = 0, world: int = 1,
                 drop_last: bool = False, skip_malformed: bool = False):
        self._pa = _pyarrow()
        _check_batching(batch_size, rank, world)
        #: Every node's files, in order: node ``rank`` of ``world`` reads ``all_files[rank::world]``
        #: (``files``), so every node must list the same ones.
        self.all_files: list[str] = list_files(paths)
        self.files: list[str] = shard_files(self.all_files, rank, world)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.skip_malformed = bool(skip_malformed)
        #: Malformed lines (rows) skipped in the current or last pass.
        self.malformed = 0
        #: The messages of the first MAX_MALFORMED_EXAMPLES of them.
        self.malformed_examples: list[str] = []
        #: Examples yielded in the current or last pass.
        self.examples_read = 0
        self._held: list[DataError] = []  # malformed lines found, not reached yet (_reached)
        self._found = 0  # malformed lines found in this pass, reached or not

    def __iter__(self) -> Iterator[Batch]:
        """One pass over this node's files; each call starts again from the first file."""
        return self._pass(None)

    def _pass(self, examples: Optional[int]) -> Iterator[Batch]:
        """One pass that ends after its first ``examples`` examples (None: all of them), the
        batch that reaches the count cut to it: what :class:`hps.data.FirstExamples` reads
        (``--examples``, ``eval_examples``). A malformed line after the last example taken
        is neither raised nor counted, though its block was parsed."""
        self.malformed, self.malformed_examples, self.examples_read = 0, [], 0
        pieces = self._reached(self._pieces(), examples)
        for batch in _rebatch(pieces, self.batch_size, self.drop_last, examples):
            self.examples_read += len(batch)
            yield batch

    def stats(self) -> dict:
        """Counters of the current or last pass, for the stats report."""
        return {"files": len(self.files), "examples_read": self.examples_read, "malformed": self.malformed}

    def _bad(self, error: DataError) -> None:
        """A malformed line, found where its block is parsed: held until the pass reaches
        it (_reached), then raised, or counted when skipping. Blocks are parsed whole, so a
        pass that stops at its first N examples parsed lines it never reaches."""
        self._held.append(error)
        self._found += 1

    def _report(self, error: DataError) -> None:
        if not self.skip_malformed:
            raise error
        self.malformed += 1
        if len(self.malformed_examples) < MAX_MALFORMED_EXAMPLES:
            self.malformed_examples.append(str(error))

    def _reached(self, pieces: Iterator[_Piece], examples: Optional[int]) -> Iterator[_Piece]:
        """``pieces`` (this node's files' rows, in order), each malformed line held by _bad
        raised or counted before the piece holding the first row after it: one the pass
        takes no row after (past its first ``examples`` examples) goes unsaid. Those of a
        pass's end, or of a failure while reading, are reported there (before the error
        raised). Each time in (file, line) order, so that the lowest line's is raised."""
        order = {path: i for i, path in enumerate(self.files)}

        def place(error: DataError) -> tuple:
            # (a line of unknown place is reported at once, as before anything else)
            return (order.get(error.path, -1), -1 if error.line is None else error.line)

        self._held, self._found = [], 0
        taken = 0  # rows given so far
        try:
            while True:
                try:
                    piece = next(pieces, None)
                except Exception as e:  # noqa: BLE001 - the lines found before it come first
                    failed = e
                else:
                    failed = None
                if failed is not None or piece is None:
                    break
                if self._held:
                    self._held.sort(key=place)
                    room = len(piece) if examples is None else min(len(piece), examples - taken)
                    later = []
                    for error, at in zip(self._held, _rows_before(piece, [place(e) for e in self._held], order),
                                         strict=True):
                        if at < room:  # a row after it is taken
                            self._report(error)
                        elif at == len(piece):  # after this piece's rows
                            later.append(error)
                        # (else past the examples asked, where the pass ends)
                    self._held = later
                taken += len(piece)
                yield piece
            for error in sorted(self._held, key=place):
                self._report(error)
            self._held = []
            if failed is not None:
                raise failed
        finally:
            pieces.close()

    @abc.abstractmethod
    def _pieces(self) -> Iterator[_Piece]:
        """The examples of this reader's files, in file order, as pieces."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.files)} files, batch_size={self.batch_size}, "
                f"drop_last={self.drop_last}, skip_malformed={self.skip_malformed})")
