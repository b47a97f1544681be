"""Training data: Criteo-format TSV and Parquet readers, and a synthetic Criteo.

Every source yields :class:`Batch` objects of the same shape, so a trainer does
not care where examples come from:

- ``labels`` float32 (n,), 0.0 or 1.0;
- ``dense``  float32 (n, 13), the integer features I1..I13 as
  ``log(1 + max(x, 0))``; a missing value counts as 0 (so it also maps to 0.0).
  Negative counts are clipped because the log needs x > -1 and Criteo's few
  negative values carry no more signal than 0 (the DLRM convention);
- ``keys``   uint64 (n, 26), one key per categorical field C1..C26 (Criteo is
  single-hot per field, so there are no offsets), from :func:`feature_keys`;
- ``sources``, where the rows came from (file, first line, count), so that an
  error found later can name the input line (:meth:`Batch.locate`).

Sources:

- :class:`CriteoTsv`: the raw Criteo format, one example per line, 40
  tab-separated fields (label, I1..I13, C1..C26), no header; empty fields are
  missing values. Parsed with pyarrow.csv; a per-line Python parser runs only
  on a block that the fast path rejects, to name the bad line, or to skip and
  count bad lines with ``skip_malformed=True``.
- :class:`CriteoParquet`: columns ``label, I1..I13, C1..C26``; categoricals as
  hex strings or integers (the same value gives the same key either way).
- :class:`SyntheticCriteo`: Zipf-skewed ids under a hidden logistic model, so
  that a model can learn something (AUC well above 0.5) without any download.
- :func:`open_criteo` picks the reader from the file names.

Paths may be local, or any fsspec URL (``s3://``, ``gs://``, ``memory://`` ...),
and may be a list, a glob or a directory (:func:`list_files`); node ``rank`` of
``world`` reads ``files[rank::world]`` (:func:`shard_files`). ``.gz`` TSV files
are decompressed on the fly.

Bad input raises :class:`DataError` (a ValueError) naming file, line and
field: ``train.tsv:1234: field I5: 'abc' is not an integer``.

This module needs only numpy to import and to generate synthetic data; the
file readers need pyarrow (and fsspec for URLs) and say so when it is missing.
Readers are not thread-safe: give each thread its own reader.

>>> from hps.data import SyntheticCriteo
>>> gen = SyntheticCriteo(seed=1, batch_size=4, examples=10)
>>> [len(b) for b in gen]
[4, 4, 2]
>>> b = next(iter(gen))
>>> b.keys.shape, b.keys.dtype.name, b.dense.shape, b.labels.dtype.name
((4, 26), 'uint64', (4, 13), 'float32')
"""
from __future__ import annotations

import abc
import glob as _glob
import gzip
import io
import math
import os
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

__all__ = [
    "Batch",
    "CATEGORICAL_COLUMNS",
    "COLUMNS",
    "CriteoParquet",
    "CriteoTsv",
    "DENSE_COLUMNS",
    "DEFAULT_VOCAB_SIZES",
    "DataError",
    "LABEL_COLUMN",
    "SENTINEL_KEY",
    "Source",
    "SyntheticCriteo",
    "dense_transform",
    "feature_keys",
    "list_files",
    "missing_key",
    "mix64",
    "open_criteo",
    "shard_files",
]

# --------------------------------------------------------------------------- format

LABEL_COLUMN = "label"
DENSE_COLUMNS: tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL_COLUMNS: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
#: The 40 Criteo columns in file order.
COLUMNS: tuple[str, ...] = (LABEL_COLUMN,) + DENSE_COLUMNS + CATEGORICAL_COLUMNS

#: The key hps reserves for empty table slots (all 64 bits set); never produced here.
SENTINEL_KEY = 0xFFFF_FFFF_FFFF_FFFF

#: Messages of skipped lines a reader keeps in ``malformed_examples``.
MAX_MALFORMED_EXAMPLES = 10

# A value longer than this is cut in error messages.
_MAX_SHOWN_VALUE = 40


class DataError(ValueError):
    """Malformed input, with the place it was found.

    ``path``, ``line`` (1-based line of a TSV file, or 1-based row of a Parquet
    file) and ``field`` (a column name such as "I5") are None when unknown.
    """

    def __init__(self, message: str, *, path: Optional[str] = None, line: Optional[int] = None,
                 field: Optional[str] = None):
        super().__init__(message)
        self.path = path
        self.line = line
        self.field = field


# --------------------------------------------------------------------------- keys
#
# DO NOT CHANGE the constants or the formula below: keys are stored in
# checkpoints and in SSD-PS files, so a change silently orphans every trained row.
#
# key(field, value) = splitmix64(((field + 1) << 32) ^ value), where splitmix64
# is the output function of Steele et al.'s SplittableRandom (add the golden
# gamma, then the Stafford "mix13" finalizer). Every step is invertible, so the
# hash is a bijection of 64-bit words: two (field, value) pairs with values
# below 2**32 (every Criteo hash) and different fields or values never share a
# key. The +1 keeps field 0 away from the bare value.
# A missing value hashes ((field + 1) << 32) ^ (1 << 63): bit 63 is never set
# for a 32-bit value, so it does not collide with any of them either.
# The one 64-bit word that hashes to SENTINEL_KEY is field 828_541_685's value
# 0x7b2131ab; it gets _SENTINEL_REPLACEMENT instead, the hash of field
# 1_326_503_678's value 0xa9921217. So for the fields anyone uses (below
# 828_541_685) and 32-bit values, keys are distinct and never the sentinel
# (tests/test_data.py inverts the hash to check both pre-images).

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MISSING_BIT = np.uint64(1 << 63)
_SENTINEL = np.uint64(SENTINEL_KEY)
_SENTINEL_REPLACEMENT = np.uint64(0xFFFF_FFFF_FFFF_FFFE)
_MAX_FIELD = (1 << 31) - 2  # (field + 1) << 32 must stay below bit 63


def mix64(x) -> np.ndarray:
    """splitmix64's finaliser of a uint64 array: a bijection of uint64 (distinct in,
    distinct out), so it turns ids into random-looking keys (a fresh array)."""
    z = np.array(x, dtype=np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
    return z


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of a uint64 array (a fresh array; wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        return mix64(x + _GAMMA)


def _keys(field_tags: np.ndarray, values: np.ndarray, missing: Optional[np.ndarray]) -> np.ndarray:
    """Keys from uint64 values; field_tags = (field + 1) << 32, broadcast against values."""
    pre = field_tags ^ values
    if missing is not None:
        pre = np.where(missing, field_tags ^ _MISSING_BIT, pre)  # (faster than copyto(where=))
    keys = _splitmix64(pre)
    keys[keys == _SENTINEL] = _SENTINEL_REPLACEMENT
    return keys


def _field_tag(field) -> np.uint64:
    if isinstance(field, bool) or not isinstance(field, (int, np.integer)):
        raise TypeError(f"field must be an int, got {type(field).__name__}")
    if not 0 <= field <= _MAX_FIELD:
        raise ValueError(f"field must be in [0, {_MAX_FIELD}], got {field}")
    return np.uint64((int(field) + 1) << 32)


_HEX_RE = re.compile(r"[0-9a-fA-F]{1,16}")


def feature_keys(field: int, values, missing=None) -> np.ndarray:
    """The uint64 keys of categorical ``values`` of field ``field`` (0 for C1).

    ``values`` is array-like, either of integers or of hex strings (str or
    bytes, 1 to 16 digits, any case: Criteo's "68fd1e64"); a hex string and the
    integer it spells give the same key. An empty string or None is a missing
    value, which has one key per field (:func:`missing_key`); so does every
    position where the optional boolean ``missing`` mask is true. Signed
    integers are read bitwise as unsigned of the same width (int32 -1 is
    0xFFFFFFFF), which is how 32-bit hashes stored in signed columns mean it.
    Returns an array of the shape of ``values``; never SENTINEL_KEY.

    >>> feature_keys(0, ["68fd1e64", "", None]).tolist() == (
    ...     feature_keys(0, [0x68fd1e64]).tolist() + [missing_key(0)] * 2)
    True
    """
    tag = _field_tag(field)
    arr = np.asarray(values)
    flat = arr.reshape(-1)  # 1-d even for a scalar, so that the arithmetic stays on arrays
    if arr.dtype.kind in "USO":
        ints = np.zeros(flat.shape, np.uint64)
        absent = np.zeros(flat.shape, bool)
        for i, v in enumerate(flat.tolist()):
            if isinstance(v, bytes):
                v = v.decode("ascii", "replace")
            if v is None or v == "":
                absent[i] = True
            elif isinstance(v, str) and _HEX_RE.fullmatch(v):
                ints[i] = int(v, 16)
            elif isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v < 1 << 64:
                ints[i] = v  # an object array may mix in plain integers
            else:
                raise ValueError(f"field {field}: {_shown(v)} is not a hexadecimal value of 1 to 16 digits")
    elif arr.dtype.kind in "iu":
        ints = flat.astype(f"u{arr.dtype.itemsize}", copy=False).astype(np.uint64)
        absent = None
    elif arr.size == 0:
        ints, absent = flat.astype(np.uint64), None
    else:
        raise TypeError(f"values must be integers or hex strings, got dtype {arr.dtype}")
    if missing is not None:
        missing = np.asarray(missing, dtype=bool)
        if missing.shape != arr.shape:
            raise ValueError(f"missing has shape {missing.shape}, values have {arr.shape}")
        absent = missing.reshape(-1) if absent is None else (absent | missing.reshape(-1))
    return _keys(tag, ints, absent).reshape(arr.shape)


def missing_key(field: int) -> int:
    """The key of a missing (empty) value of categorical field ``field``."""
    tag = _field_tag(field)
    return int(_keys(tag, np.zeros(1, np.uint64), np.ones(1, bool))[0])


def dense_transform(raw) -> np.ndarray:
    """float32 ``log(1 + max(x, 0))`` of raw integer counts (missing given as 0 or NaN)."""
    x = np.array(raw, dtype=np.float64)  # a copy: the operations below work in place
    np.fmax(x, 0.0, out=x)  # fmax also turns NaN into 0
    np.log1p(x, out=x)
    return x.astype(np.float32)


# --------------------------------------------------------------------------- batches

@dataclass(frozen=True)
class Source:
    """``count`` consecutive examples from ``path`` starting at line (or Parquet row) ``first_line``."""

    path: str
    first_line: int
    count: int


@dataclass(frozen=True, eq=False)
class Batch:
    """One mini-batch; see the module docstring for the meaning of each array.

    labels (n,) float32, dense (n, n_dense) float32, keys (n, n_categorical)
    uint64, sources: the input spans the rows came from, in row order.
    """

    labels: np.ndarray
    dense: np.ndarray
    keys: np.ndarray
    sources: tuple[Source, ...] = ()

    def __len__(self) -> int:
        return len(self.labels)

    def locate(self, i: int) -> tuple[str, int]:
        """(path, line) of row ``i``: where to look when that example misbehaves."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for a batch of {len(self)}")
        for s in self.sources:
            if i < s.count:
                return s.path, s.first_line + i
            i -= s.count
        raise IndexError("the batch's sources do not cover its rows")


class _Piece:
    """Rows on their way into batches (a parsed block, before re-batching)."""

    __slots__ = ("labels", "dense", "keys", "sources")

    def __init__(self, labels, dense, keys, sources):
        self.labels, self.dense, self.keys, self.sources = labels, dense, keys, list(sources)

    def __len__(self):
        return len(self.labels)

    def split(self, k: int) -> tuple["_Piece", "_Piece"]:
        head, tail, left = [], [], k
        for s in self.sources:
            if left >= s.count:
                head.append(s)
            elif left <= 0:
                tail.append(s)
            else:
                head.append(Source(s.path, s.first_line, left))
                tail.append(Source(s.path, s.first_line + left, s.count - left))
            left -= s.count
        return (_Piece(self.labels[:k], self.dense[:k], self.keys[:k], head),
                _Piece(self.labels[k:], self.dense[k:], self.keys[k:], tail))


def _merged(sources: Iterable[Source]) -> tuple[Source, ...]:
    """Sources with each run of consecutive lines of one file as one span."""
    out: list[Source] = []
    for s in sources:
        if out and out[-1].path == s.path and out[-1].first_line + out[-1].count == s.first_line:
            out[-1] = Source(s.path, out[-1].first_line, out[-1].count + s.count)
        else:
            out.append(s)
    return tuple(out)


def _batch_of(pieces: list[_Piece]) -> Batch:
    if len(pieces) == 1:
        p = pieces[0]
        return Batch(p.labels, p.dense, p.keys, tuple(p.sources))
    return Batch(np.concatenate([p.labels for p in pieces]),
                 np.concatenate([p.dense for p in pieces]),
                 np.concatenate([p.keys for p in pieces]),
                 _merged(s for p in pieces for s in p.sources))


def _rebatch(pieces: Iterable[_Piece], batch_size: int, drop_last: bool) -> Iterator[Batch]:
    """Cuts a stream of pieces of any length into batches of batch_size rows."""
    pending: list[_Piece] = []
    have = 0
    for piece in pieces:
        while len(piece):
            take = min(batch_size - have, len(piece))
            head, piece = piece.split(take)
            pending.append(head)
            have += take
            if have == batch_size:
                yield _batch_of(pending)
                pending, have = [], 0
    if have and not drop_last:
        yield _batch_of(pending)


def _sources_of(path: str, lines: np.ndarray) -> list[Source]:
    """Sources for rows at the given (increasing) line numbers: one per run of consecutive lines."""
    if len(lines) == 0:
        return []
    breaks = np.flatnonzero(np.diff(lines) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(lines)]])
    return [Source(path, int(lines[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def _piece(path, lines, labels, dense_raw, cat_values, cat_missing) -> _Piece:
    """Rows from validated raw values (dense_raw: float64 counts with 0 for missing)."""
    n_cat = cat_values.shape[1]
    tags = (np.arange(1, n_cat + 1, dtype=np.uint64) << np.uint64(32))[None, :]
    return _Piece(np.asarray(labels, np.float32), dense_transform(dense_raw),
                  _keys(tags, cat_values, cat_missing), _sources_of(path, lines))


def _check_batching(batch_size, rank, world):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not (isinstance(world, (int, np.integer)) and world >= 1):
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if not (isinstance(rank, (int, np.integer)) and 0 <= rank < world):
        raise ValueError(f"rank must be in [0, world={world}), got {rank!r}")


# --------------------------------------------------------------------------- files

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


def _expand(path: str) -> list[str]:
    if _is_url(path):
        fs, p = _fsspec().core.url_to_fs(path)
        if _glob.has_magic(p):
            found = sorted(fs.unstrip_protocol(q) for q in fs.glob(p) if not fs.isdir(q))
        elif fs.isdir(p):
            found = sorted(fs.unstrip_protocol(q) for q in fs.ls(p, detail=False)
                           if _visible(q) and not fs.isdir(q))
        elif fs.exists(p):
            return [path]
        else:
            raise FileNotFoundError(f"no such file: {path}")
    elif _glob.has_magic(path):
        found = sorted(q for q in _glob.glob(path) if os.path.isfile(q))
    elif os.path.isdir(path):
        found = sorted(os.path.join(path, q) for q in os.listdir(path)
                       if _visible(q) and os.path.isfile(os.path.join(path, q)))
    elif os.path.isfile(path):
        return [path]
    else:
        raise FileNotFoundError(f"no such file: {path}")
    if not found:
        raise FileNotFoundError(f"no data file in {path}")
    return found


def list_files(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> list[str]:
    """Data files named by ``paths``: a path, glob or directory, or a list of them.

    Globs and directories expand to their files in sorted order (so every node
    sees the same list); a directory's hidden and ``_``-prefixed entries
    (``_SUCCESS``) are left out; a list keeps its order.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = [f for p in paths for f in _expand(os.fspath(p))]
    if not files:
        raise ValueError("no data files given")
    return files


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


def _open_binary(path: str):
    if _is_url(path):
        return _fsspec().open(path, "rb", compression="infer").open()
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


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


class _Reader(abc.ABC):
    """What the file readers share: file list, batching and the malformed-line count."""

    def __init__(self, paths, batch_size: int = 4096, *, rank: int = 0, world: int = 1,
                 drop_last: bool = False, skip_malformed: bool = False):
        self._pa = _pyarrow()
        _check_batching(batch_size, rank, world)
        self.files: list[str] = shard_files(list_files(paths), rank, world)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.skip_malformed = bool(skip_malformed)
        #: Malformed lines (rows) skipped in the current or last pass.
        self.malformed = 0
        #: The messages of the first MAX_MALFORMED_EXAMPLES of them.
        self.malformed_examples: list[str] = []
        #: Examples yielded in the current or last pass.
        self.examples_read = 0

    def __iter__(self) -> Iterator[Batch]:
        """One pass over this node's files; each call starts again from the first file."""
        self.malformed, self.malformed_examples, self.examples_read = 0, [], 0
        for batch in _rebatch(self._pieces(), self.batch_size, self.drop_last):
            self.examples_read += len(batch)
            yield batch

    def stats(self) -> dict:
        """Counters of the current or last pass, for the stats report."""
        return {"files": len(self.files), "examples_read": self.examples_read, "malformed": self.malformed}

    def _bad(self, error: DataError) -> None:
        """A malformed line: raise, or count it when skipping."""
        if not self.skip_malformed:
            raise error
        self.malformed += 1
        if len(self.malformed_examples) < MAX_MALFORMED_EXAMPLES:
            self.malformed_examples.append(str(error))

    @abc.abstractmethod
    def _pieces(self) -> Iterator[_Piece]:
        """The examples of this reader's files, in file order, as pieces."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.files)} files, batch_size={self.batch_size}, "
                f"drop_last={self.drop_last}, skip_malformed={self.skip_malformed})")


# --------------------------------------------------------------------------- arrow columns
#
# Columns arrive as pyarrow arrays (a TSV block parsed by pyarrow.csv, or a
# Parquet record batch). Each converter returns numpy values plus a per-row
# "bad" mask; the caller decides how to report bad rows.

def _hex_digits(chars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(digit values, is-a-hex-digit) of ASCII bytes.

    Arithmetic rather than a 256-entry lookup table, which numpy gathers
    several times slower: '0'-'9' are 0x30-0x39, 'a'-'f' 0x61-0x66, 'A'-'F'
    0x41-0x46, so the low nibble plus 9 for letters (bit 6 set) is the value.
    """
    u8 = np.uint8
    digits = chars & u8(15)
    digits += u8(9) * (chars >> u8(6))
    letter = chars | u8(0x20)
    letter -= u8(ord("a"))
    decimal = chars - u8(ord("0"))  # uint8 arithmetic wraps: one compare checks a range
    return digits, (decimal < u8(10)) | (letter < u8(6))


# Big-endian words of width / 2 bytes, for hex strings of `width` digits.
_BIG_ENDIAN = {2: np.dtype("u1"), 4: np.dtype(">u2"), 8: np.dtype(">u4"), 16: np.dtype(">u8")}


def _hex_array(pa, arr) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values uint64, missing, bad) of a string or binary array of hex numbers.

    Works on the array's offsets and bytes directly, not on Python strings.
    Bad rows (not 1 to 16 hex digits) are flagged, their values meaningless.
    """
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    n = len(arr)
    _, off_buf, data_buf = arr.buffers()[:3]
    off_type = np.dtype(np.int64 if large else np.int32)
    offsets = np.frombuffer(off_buf, off_type, count=n + 1, offset=arr.offset * off_type.itemsize)
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None and data_buf.size else np.zeros(1, np.uint8)
    lengths = np.diff(offsets)
    missing = lengths == 0
    if arr.null_count:
        missing |= arr.is_null().to_numpy(zero_copy_only=False)
        lengths = np.where(missing, 0, lengths)
    bad = lengths > 16
    width = int(min(lengths.max(initial=0), 16))
    if width == 0:
        return np.zeros(n, np.uint64), missing, bad
    present = ~missing
    if (width in _BIG_ENDIAN and (lengths[present] == width).all()
            and offsets[-1] - offsets[0] == width * np.count_nonzero(present)):  # (nulls hold no bytes)
        # The usual case (Criteo: 8 digits or empty): the digits of the present
        # values are back to back in the data buffer, so they decode as one
        # (m, width) byte matrix, two digits a byte, read as big-endian words.
        digits, valid = _hex_digits(data[offsets[0]:offsets[-1]])
        digits, valid = digits.reshape(-1, width), valid.reshape(-1, width)
        if not valid.all():
            bad[present] = ~valid.all(axis=1)
        packed = (digits[:, 0::2] << 4) | digits[:, 1::2]
        values = np.zeros(n, np.uint64)
        values[present] = packed.view(_BIG_ENDIAN[width]).ravel()
        return values, missing, bad
    pos = np.arange(width)
    idx = np.minimum(offsets[:-1, None] + pos, len(data) - 1)
    digits, valid = _hex_digits(data[idx])
    inside = pos < lengths[:, None]
    bad |= (inside & ~valid).any(axis=1)
    # Digit j of a value of length L is worth 16**(L-1-j); digits past L add nothing.
    shifts = (np.maximum(lengths[:, None] - 1 - pos, 0) * 4).astype(np.uint64)
    parts = np.where(inside, digits.astype(np.uint64) << shifts, np.uint64(0))
    return np.bitwise_or.reduce(parts, axis=1), missing, bad


def _check_type(pa, t, name: str, path: str) -> None:
    """Raises DataError unless arrow type t is one that column ``name`` may have."""
    if name in CATEGORICAL_COLUMNS:
        v = t.value_type if pa.types.is_dictionary(t) else t
        if not (pa.types.is_string(v) or pa.types.is_large_string(v) or pa.types.is_binary(v)
                or pa.types.is_large_binary(v) or pa.types.is_integer(v)):
            raise DataError(f"{path}: column {name} has type {t}, expected hex strings or integers",
                            path=path, field=name)
    elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise DataError(f"{path}: column {name} has type {t}, expected integers", path=path, field=name)


def _numeric_array(pa, arr, name: str, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values float64 with NaN for missing, missing, non-finite) of an integer/float/bool array."""
    t = arr.type
    _check_type(pa, t, name, path)
    if pa.types.is_integer(t) and t.bit_width == 64:
        # float64 holds integers exactly only up to 2**53; beyond that the
        # log transform cannot tell the difference anyway.
        missing = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(len(arr), bool)
        values = pa.compute.fill_null(arr, 0).to_numpy().astype(np.float64)
        values[missing] = np.nan
    else:
        values = arr.cast(pa.float64()).to_numpy(zero_copy_only=False)
        missing = np.isnan(values)
    return values, missing, np.isinf(values)


def _categorical_array(pa, arr, name: str, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values uint64, missing, bad) of a categorical column: hex strings or integers."""
    _check_type(pa, arr.type, name, path)
    t = arr.type.value_type if pa.types.is_dictionary(arr.type) else arr.type
    if not pa.types.is_integer(t):
        return _hex_array(pa, arr)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    missing = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(len(arr), bool)
    values = pa.compute.fill_null(arr, 0).to_numpy()
    values = values.astype(f"u{values.dtype.itemsize}", copy=False).astype(np.uint64)
    return values, missing, np.zeros(len(arr), bool)


class _Columns:
    """The 40 Criteo columns of a block converted to numpy, with what is wrong in each."""

    def __init__(self, pa, get_column: Callable[[str], list], n: int, path: str):
        self.n = n
        self._pa = pa
        self.columns = {}  # name -> list of arrow chunks, kept to quote bad values

        def convert(name, fn):
            chunks = get_column(name)
            self.columns[name] = chunks
            parts = [fn(pa, c, name, path) for c in chunks]
            if not parts:
                return np.zeros(0), np.zeros(0, bool), np.zeros(0, bool)
            return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))

        label, label_missing, label_inf = convert(LABEL_COLUMN, _numeric_array)
        self.labels = np.where(label_missing, 0.0, label)
        self.bad = {LABEL_COLUMN: label_missing | label_inf | ((label != 0) & (label != 1))}
        self.dense_raw = np.empty((n, len(DENSE_COLUMNS)))
        for j, name in enumerate(DENSE_COLUMNS):
            values, missing, bad = convert(name, _numeric_array)
            self.dense_raw[:, j] = np.where(missing, 0.0, values)
            self.bad[name] = bad
        self.cat_values = np.empty((n, len(CATEGORICAL_COLUMNS)), np.uint64)
        self.cat_missing = np.empty((n, len(CATEGORICAL_COLUMNS)), bool)
        for j, name in enumerate(CATEGORICAL_COLUMNS):
            self.cat_values[:, j], self.cat_missing[:, j], self.bad[name] = convert(name, _categorical_array)

    def bad_rows(self) -> np.ndarray:
        return np.logical_or.reduce(list(self.bad.values()))

    def value(self, name: str, row: int):
        for chunk in self.columns[name]:
            if row < len(chunk):
                scalar = chunk[int(row)]
                if isinstance(scalar, self._pa.DictionaryScalar):
                    scalar = scalar.value
                try:
                    return scalar.as_py()
                except UnicodeDecodeError:  # Parquet does not check that a string column holds UTF-8
                    return scalar.cast(self._pa.large_binary()).as_py()
            row -= len(chunk)
        raise IndexError(row)


def _reason(name: str, value) -> str:
    """Why a value of column ``name`` is malformed (the rules of _parse_line, in words)."""
    if name == LABEL_COLUMN:
        return f"{_shown(value)} is not 0 or 1"
    if name in DENSE_COLUMNS:
        if isinstance(value, float):  # a Parquet float column: only inf and -inf are refused
            return f"{_shown(value)} is not a finite number"
        return f"{_shown(value)} is not an integer"
    return f"{_shown(value)} is not a hexadecimal value of 1 to 16 digits"


# --------------------------------------------------------------------------- TSV

_INT_RE = re.compile(rb"-?[0-9]+")
_HEX_BYTES_RE = re.compile(rb"[0-9a-fA-F]{1,16}")
_N_FIELDS = len(COLUMNS)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _parse_line(line: bytes):
    """(label, dense, cat_values, cat_missing) of one TSV line, or (field, message) on error.

    The reference definition of a valid line; the fast path must accept
    exactly these lines (see _FAST_PATH_UNSAFE).
    """
    fields = line.split(b"\t")
    if len(fields) != _N_FIELDS:
        if line == b"":
            return None, f"is an empty line, expected {_N_FIELDS} tab-separated fields"
        return None, f"has {len(fields)} fields, expected {_N_FIELDS}"
    label = fields[0]
    if not (_INT_RE.fullmatch(label) and int(label) in (0, 1)):
        return LABEL_COLUMN, _reason(LABEL_COLUMN, label)
    dense = [0] * len(DENSE_COLUMNS)
    for j, v in enumerate(fields[1:14]):
        if v:
            if not _INT_RE.fullmatch(v):
                return DENSE_COLUMNS[j], _reason(DENSE_COLUMNS[j], v)
            x = int(v)
            if not _INT64_MIN <= x <= _INT64_MAX:
                return DENSE_COLUMNS[j], f"{_shown(v)} is out of the 64-bit integer range"
            dense[j] = x
    cats = [0] * len(CATEGORICAL_COLUMNS)
    absent = [False] * len(CATEGORICAL_COLUMNS)
    for j, v in enumerate(fields[14:]):
        if not v:
            absent[j] = True
        elif _HEX_BYTES_RE.fullmatch(v):
            cats[j] = int(v, 16)
        else:
            return CATEGORICAL_COLUMNS[j], _reason(CATEGORICAL_COLUMNS[j], v)
    return int(label), dense, cats, absent


# pyarrow's int64 conversion is laxer than the format: it trims spaces and
# accepts a "0x" prefix. No valid line holds a space or an x, so a block with
# one goes to the per-line parser, which applies the strict rules.
_FAST_PATH_UNSAFE = (b" ", b"x", b"X")
# pyarrow.csv also drops a UTF-8 byte order mark at the start of its input,
# i.e. of every block: the line would pass or fail by where a block began.
_UTF8_BOM = b"\xef\xbb\xbf"
# What a damaged .gz file raises on read (truncated: EOFError; bad header or
# CRC: BadGzipFile; bad deflate data: zlib.error).
_DECOMPRESSION_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


class CriteoTsv(_Reader):
    """Batches from Criteo TSV files (label, I1..I13, C1..C26; tab-separated, no header).

    ``paths``: a file, glob, directory or list of them, local or fsspec URLs
    (``.gz`` is decompressed). Node ``rank`` of ``world`` reads its share of the
    files (:func:`shard_files`). Batches have ``batch_size`` rows and run on
    across file boundaries; the last one is smaller unless ``drop_last``.

    A malformed line raises :class:`DataError`, e.g.
    ``train.tsv:1234: field I5: 'abc' is not an integer`` or
    ``train.tsv:77: has 38 fields, expected 40``. With ``skip_malformed=True``
    such lines are left out and counted in ``malformed``, the first messages
    kept in ``malformed_examples``. Valid fields: label 0 or 1; I* empty or a
    decimal int64 (``-?[0-9]+``); C* empty or 1 to 16 hex digits. Lines end
    at "\\n" (a "\\r" before it is dropped), so a lone "\\r" or a byte order
    mark belongs to a field and makes the line malformed. A damaged ``.gz``
    file raises DataError at the first line it cannot give, even with
    ``skip_malformed``.

    Files are read in blocks of ``block_bytes`` (cut at line ends) that
    pyarrow.csv parses with several threads; a block it rejects, or one with a
    bad value, is parsed again line by line in Python to find the bad lines.
    A skipped line therefore costs its block the slow path (~40k lines/s
    against ~250k on this project's 2-core test machine); a smaller
    ``block_bytes`` confines it.
    """

    def __init__(self, paths, batch_size: int = 4096, *, rank: int = 0, world: int = 1,
                 drop_last: bool = False, skip_malformed: bool = False, block_bytes: int = 4 << 20):
        super().__init__(paths, batch_size, rank=rank, world=world, drop_last=drop_last,
                         skip_malformed=skip_malformed)
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = int(block_bytes)
        pa = self._pa
        self._read_options = pa.csv.ReadOptions(column_names=list(COLUMNS), use_threads=True)
        self._parse_options = pa.csv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False,
                                                  escape_char=False, newlines_in_values=False,
                                                  ignore_empty_lines=False)
        types = {LABEL_COLUMN: pa.int64()}
        types.update({c: pa.int64() for c in DENSE_COLUMNS})
        types.update({c: pa.string() for c in CATEGORICAL_COLUMNS})
        self._convert_options = pa.csv.ConvertOptions(column_types=types, null_values=[""],
                                                      strings_can_be_null=False, quoted_strings_can_be_null=False)

    def _pieces(self) -> Iterator[_Piece]:
        for path in self.files:
            with _open_binary(path) as f:
                line = 1
                blocks = _blocks(f, self.block_bytes)
                while True:
                    try:
                        block = next(blocks, None)
                    except _DECOMPRESSION_ERRORS as e:
                        # Not a line to skip: nothing after this point can be read.
                        raise DataError(f"{path}:{line}: corrupt or truncated compressed data at or after this "
                                        f"line: {e}", path=path, line=line) from e
                    if block is None:
                        break
                    piece, n_lines = self._fast(block, path, line) or self._slow(block, path, line)
                    line += n_lines
                    if len(piece):
                        yield piece

    def _fast(self, block: bytes, path: str, first_line: int) -> Optional[tuple[_Piece, int]]:
        """(rows, lines) of the block through pyarrow.csv, or None if a line needs the per-line parser."""
        pa = self._pa
        if block.startswith(_UTF8_BOM) or any(c in block for c in _FAST_PATH_UNSAFE):
            return None
        try:
            table = pa.csv.read_csv(pa.BufferReader(block), read_options=self._read_options,
                                    parse_options=self._parse_options, convert_options=self._convert_options)
        except pa.ArrowInvalid:
            return None
        # pyarrow also ends lines at a lone "\r", so with a "\r" in the block its
        # rows may not be the lines; the per-line parser (which splits at "\n"
        # only) then reports the line. Without one they are the lines.
        if b"\r" in block and table.num_rows != block.count(b"\n") + (not block.endswith(b"\n")):
            return None
        cols = _Columns(pa, lambda name: table.column(name).chunks, table.num_rows, path)
        if cols.bad_rows().any():
            return None  # e.g. a label of 2, or a bad hex digit: let _slow name it
        lines = np.arange(first_line, first_line + table.num_rows)
        return _piece(path, lines, cols.labels, cols.dense_raw, cols.cat_values, cols.cat_missing), table.num_rows

    def _slow(self, block: bytes, path: str, first_line: int) -> tuple[_Piece, int]:
        """(rows, lines) of the block by _parse_line; bad lines raise or are counted (self._bad)."""
        lines_ok, labels, dense, cats, absent = [], [], [], [], []
        rows = block.split(b"\n")
        if block.endswith(b"\n"):
            rows.pop()
        for i, row in enumerate(rows):
            if row.endswith(b"\r"):
                row = row[:-1]
            parsed = _parse_line(row)
            if parsed[0] is None or isinstance(parsed[0], str):
                field, message = parsed
                where = f"{path}:{first_line + i}: "
                self._bad(DataError(where + (f"field {field}: " if field else "") + message,
                                    path=path, line=first_line + i, field=field))
                continue
            lines_ok.append(first_line + i)
            labels.append(parsed[0])
            dense.append(parsed[1])
            cats.append(parsed[2])
            absent.append(parsed[3])
        n = len(lines_ok)
        return _piece(path, np.asarray(lines_ok, np.int64), np.asarray(labels, np.float64),
                      np.asarray(dense, np.float64).reshape(n, len(DENSE_COLUMNS)),
                      np.asarray(cats, np.uint64).reshape(n, len(CATEGORICAL_COLUMNS)),
                      np.asarray(absent, bool).reshape(n, len(CATEGORICAL_COLUMNS))), len(rows)


def _blocks(f, block_bytes: int) -> Iterator[bytes]:
    """The file's bytes in blocks of about block_bytes that end at a line end."""
    rest = b""
    while True:
        data = f.read(block_bytes)
        if not data:
            break
        buf = rest + data if rest else data
        cut = buf.rfind(b"\n")
        if cut < 0:  # a line longer than a block: keep reading
            rest = buf
            continue
        rest = buf[cut + 1:]
        yield buf[:cut + 1]
    if rest:
        yield rest  # the last line, without a line end


# --------------------------------------------------------------------------- Parquet

class CriteoParquet(_Reader):
    """Batches from Parquet files with columns label, I1..I13, C1..C26.

    Other columns are ignored. label: integers, floats or booleans equal to 0
    or 1; I*: integers or floats, null or NaN missing; C*: hex strings (as in
    the TSV files; empty or null missing) or integers (signed ones read bitwise
    as unsigned of their width; null missing). Arguments and malformed-row
    handling as :class:`CriteoTsv`; a "line" here is the 1-based row number,
    e.g. ``day0.parquet: row 12: field C3: 'xyz' is not a hexadecimal ...``.
    A file that cannot be read (not Parquet, truncated, a damaged row group),
    a missing or repeated column, or a column of another type raises
    DataError even with ``skip_malformed``: there is no row to skip.
    ``read_rows``: rows converted at a time.
    """

    def __init__(self, paths, batch_size: int = 4096, *, rank: int = 0, world: int = 1,
                 drop_last: bool = False, skip_malformed: bool = False, read_rows: int = 65536):
        if isinstance(read_rows, bool) or not isinstance(read_rows, (int, np.integer)) or read_rows < 1:
            raise ValueError(f"read_rows must be a positive int, got {read_rows!r}")
        super().__init__(paths, batch_size, rank=rank, world=world, drop_last=drop_last,
                         skip_malformed=skip_malformed)
        self.read_rows = int(read_rows)

    def _pieces(self) -> Iterator[_Piece]:
        pa = self._pa
        # What pyarrow raises on a damaged file: ArrowInvalid (a ValueError), a plain
        # OSError ("Couldn't deserialize thrift"), UnicodeDecodeError for a column
        # name that is not UTF-8 in the footer.
        errors = (pa.ArrowException, OSError, UnicodeDecodeError)
        for path in self.files:
            with (_fsspec().open(path, "rb").open() if _is_url(path) else open(path, "rb")) as f:
                try:
                    pf = pa.parquet.ParquetFile(f)
                    schema = pf.schema_arrow
                except errors as e:
                    raise DataError(f"{path}: not a readable Parquet file: {e}", path=path) from e
                _check_schema(pa, schema, path)
                row = 1
                # One row group at a time, so that an error names the group.
                for g in range(pf.num_row_groups):
                    row = yield from self._row_group(pf, g, path, row, errors)

    def _row_group(self, pf, g: int, path: str, row: int, errors):
        """Yields the pieces of row group g, whose first row is ``row`` of the file; returns
        the row after it."""
        pa = self._pa
        n_rows = pf.metadata.row_group(g).num_rows
        batches = pf.iter_batches(batch_size=self.read_rows, row_groups=[g], columns=list(COLUMNS))
        first = row
        while True:
            try:
                rb = next(batches, None)
            except errors as e:
                raise DataError(f"{path}: row group {g} (rows {first}-{first + n_rows - 1}): cannot read: {e}",
                                path=path, line=first) from e
            if rb is None:
                return row
            cols = _Columns(pa, lambda name, rb=rb: [rb.column(name)], rb.num_rows, path)
            lines = np.arange(row, row + rb.num_rows)
            keep = ~cols.bad_rows()
            for r in np.flatnonzero(~keep):
                name = next(c for c in COLUMNS if cols.bad[c][r])
                line = row + int(r)
                self._bad(DataError(f"{path}: row {line}: field {name}: {_reason(name, cols.value(name, r))}",
                                    path=path, line=line, field=name))
            row += rb.num_rows
            if not keep.all():
                yield _piece(path, lines[keep], cols.labels[keep], cols.dense_raw[keep],
                             cols.cat_values[keep], cols.cat_missing[keep])
            else:
                yield _piece(path, lines, cols.labels, cols.dense_raw, cols.cat_values, cols.cat_missing)


def _check_schema(pa, schema, path: str) -> None:
    """Raises DataError unless the Criteo columns are each there once, with a type the reader takes."""
    names = schema.names
    absent = [c for c in COLUMNS if c not in names]
    if absent:
        raise DataError(f"{path}: no column {', '.join(absent)} (expected label, I1..I13, C1..C26)",
                        path=path, field=absent[0])
    for c in COLUMNS:
        if names.count(c) > 1:
            raise DataError(f"{path}: column {c} appears {names.count(c)} times", path=path, field=c)
    for c in COLUMNS:
        _check_type(pa, schema.field(c).type, c, path)


_PARQUET_SUFFIXES = (".parquet", ".pq")


def open_criteo(paths, batch_size: int = 4096, *, format: Optional[str] = None,
                **options) -> Union["CriteoTsv", "CriteoParquet"]:
    """A CriteoParquet or CriteoTsv reader of ``paths``.

    ``format`` is "parquet" or "tsv"; by default files ending in .parquet or .pq
    are Parquet and the others TSV (a mix is an error). ``options`` go to the
    reader (rank, world, drop_last, skip_malformed, ...).
    """
    if format is None:
        files = list_files(paths)
        kinds = {f.lower().endswith(_PARQUET_SUFFIXES) for f in files}
        if len(kinds) > 1:
            raise ValueError(f"{paths!r} mixes Parquet and TSV files; give one kind, or format=")
        format = "parquet" if kinds.pop() else "tsv"
        paths = files
    if format == "parquet":
        return CriteoParquet(paths, batch_size, **options)
    if format == "tsv":
        return CriteoTsv(paths, batch_size, **options)
    raise ValueError(f"format must be 'tsv' or 'parquet', got {format!r}")


# --------------------------------------------------------------------------- synthetic

#: Criteo Kaggle's per-field cardinalities, clipped to [10, 1_000_000].
DEFAULT_VOCAB_SIZES: tuple[int, ...] = (
    1460, 583, 1_000_000, 1_000_000, 305, 24, 12517, 633, 10, 93145, 5683, 1_000_000, 3194,
    27, 14992, 1_000_000, 10, 5652, 2173, 10, 1_000_000, 18, 15, 286181, 105, 142572,
)

# DO NOT CHANGE these without meaning to change every synthetic stream: the
# example stream is generated in blocks of _BLOCK examples (so it does not
# depend on batch_size), block b of part p from SeedSequence(seed, (p, b)).
_BLOCK = 4096
_PARTS = {"train": 0, "eval": 1}
_CALIBRATION_PART = 2
_PARAMETER_PART = 3
_CALIBRATION_EXAMPLES = 16384
# Ranks up to _ZIPF_HEAD are drawn exactly from a table; above it from the
# continuous power law rounded to the nearest integer, whose probability of k
# is within a(a+1)/(24 k^2) (< 1e-4 here) of the exact Zipf one.
_ZIPF_HEAD = 64
# Cells of the table that maps a uniform to a head rank without a binary search.
_ZIPF_CELLS = 4096
# Scales the hidden weights; sets the Bayes AUC (0.80 to 0.85 with the defaults).
_SIGNAL = 0.65


class SyntheticCriteo:
    """Criteo-like examples from a hidden logistic model; deterministic by seed.

    Field f (0..len(vocab_sizes)-1) takes ids in [0, vocab_sizes[f]): a rank
    r >= 1 is drawn with P(r) ~ r**-zipf_a (truncated to the vocabulary) and
    mapped to an id by a fixed permutation of the field (an affine map mod the
    vocabulary size, so ids are not ordered by frequency and nothing is
    stored). A value is missing with probability ``cat_missing``. Dense
    features are log-normal counts, missing with probability
    ``dense_missing``.

    The label is Bernoulli(sigmoid(logit)), where logit = bias + sum over
    fields of w(key) + dense . v, see :meth:`hidden_logit`. w(key) comes from
    hashing (seed, key) into a uniform value of unit variance times a
    per-field scale: a vocabulary of a million costs no memory. The bias is
    solved at construction so that the expected CTR is ``ctr`` (with the
    defaults, the CTR of 100k examples is within 0.25 +- 0.01 for seeds 0-7).
    Frequent ids are seen often enough to learn their weights; tail ids are
    noise, as in real logs. The hidden logit ranks the labels with an AUC of
    0.80 to 0.85 (seeds 0-7), the ceiling for any model of these data.

    ``part`` selects an independent example stream of the same model: train a
    model on "train" and measure it on "eval". ``rank``/``world`` split a
    stream among nodes by blocks of 4096 examples (node r gets blocks r,
    r + world, ...); ``examples`` is the total over all nodes (None: endless).
    The stream does not depend on batch_size. ``write_tsv`` writes it as a
    Criteo TSV file, which :class:`CriteoTsv` reads back to the same batches.

    >>> gen = SyntheticCriteo(seed=7, batch_size=1000, examples=2000)
    >>> a, b = list(gen), list(SyntheticCriteo(seed=7, batch_size=500, examples=2000))
    >>> bool((a[1].keys[500:] == b[3].keys).all())
    True
    """

    def __init__(self, seed: int = 0, *, vocab_sizes: Sequence[int] = DEFAULT_VOCAB_SIZES,
                 zipf_a: float = 1.1, n_dense: int = 13, batch_size: int = 4096,
                 examples: Optional[int] = None, part: str = "train", rank: int = 0, world: int = 1,
                 drop_last: bool = False, ctr: float = 0.25, cat_missing: float = 0.05,
                 dense_missing: float = 0.1):
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        _check_batching(batch_size, rank, world)
        if part not in _PARTS:
            raise ValueError(f"part must be one of {sorted(_PARTS)}, got {part!r}")
        vocab = np.asarray(vocab_sizes, dtype=np.int64)
        if vocab.ndim != 1 or len(vocab) == 0 or (vocab < 1).any() or (vocab > 1 << 31).any():
            raise ValueError("vocab_sizes must be a non-empty list of ints in [1, 2**31]")
        if not zipf_a >= 0:
            raise ValueError(f"zipf_a must be >= 0, got {zipf_a}")
        if not 0 < ctr < 1:
            raise ValueError(f"ctr must be in (0, 1), got {ctr}")
        for name, p in (("cat_missing", cat_missing), ("dense_missing", dense_missing)):
            if not 0 <= p < 1:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        if examples is not None and examples < 0:
            raise ValueError(f"examples must be >= 0 or None, got {examples}")
        if n_dense < 0:
            raise ValueError(f"n_dense must be >= 0, got {n_dense}")
        self.seed, self.part, self.rank, self.world = int(seed), part, int(rank), int(world)
        self.vocab_sizes = tuple(int(v) for v in vocab)
        self.zipf_a, self.n_dense, self.ctr = float(zipf_a), int(n_dense), float(ctr)
        self.cat_missing, self.dense_missing = float(cat_missing), float(dense_missing)
        self.batch_size, self.drop_last = int(batch_size), bool(drop_last)
        self.examples = None if examples is None else int(examples)
        n_cat = len(vocab)
        self._tags = (np.arange(1, n_cat + 1, dtype=np.uint64) << np.uint64(32))[None, :]

        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_PARAMETER_PART,)))
        # Permutation id = (rank - 1) * mul + add (mod V), mul coprime to V.
        self._perm_mul = np.empty(n_cat, np.int64)
        self._perm_add = np.empty(n_cat, np.int64)
        for f, v in enumerate(self.vocab_sizes):
            mul = int(rng.integers(1, v)) if v > 1 else 1
            while math.gcd(mul, v) != 1:
                mul += 1
            # (rank - 1) * mul + add == rank * mul + (add - mul): one pass less.
            self._perm_mul[f], self._perm_add[f] = mul, (int(rng.integers(0, v)) - mul) % v
        # Field weight scales: a few fields carry most of the signal, as in real logs.
        self._field_scale = _SIGNAL * (0.15 + 0.55 * rng.random(n_cat) ** 2)
        self._dense_mu = rng.uniform(0.5, 4.0, self.n_dense)
        self._dense_sigma = rng.uniform(0.5, 1.5, self.n_dense)
        self._dense_weight = rng.normal(0.0, 0.25, self.n_dense)
        self._weight_salt = np.uint64(int(rng.integers(0, (1 << 63) - 1)) * 2 + 1)
        self._u_weight = self._field_scale * math.sqrt(12.0) * 2.0 ** -53
        self._u_offset = -0.5 * math.sqrt(12.0) * float(self._field_scale.sum())
        self._setup_zipf()
        self.bias = 0.0
        self.bias = self._calibrate()

    # -- the hidden model

    def hidden_logit(self, batch: Batch) -> np.ndarray:
        """The ground-truth logit (float64, (n,)) of the model that drew the labels.

        Reads only ``batch.keys`` and ``batch.dense``, so it also works on the
        batches a reader gets from this generator's ``write_tsv`` output.
        """
        keys = np.asarray(batch.keys, np.uint64)
        if keys.ndim != 2 or keys.shape[1] != len(self.vocab_sizes):
            raise ValueError(f"keys must have shape (n, {len(self.vocab_sizes)}), got {keys.shape}")
        # w(key) = scale[f] * sqrt(12) * (u - 1/2), u uniform on [0, 1) from the
        # top 53 bits of (key ^ salt) * odd: the key is already a strong hash, so
        # one multiplication decorrelates the seeds. The constant part of the
        # sum and the scales are folded into _u_weight and _u_offset.
        with np.errstate(over="ignore"):
            h = (keys ^ self._weight_salt) * _MIX2
        logit = (h >> np.uint64(11)).astype(np.float64) @ self._u_weight + (self.bias + self._u_offset)
        if self.n_dense:
            # Roughly centred, so that the dense term shifts the bias little.
            centre = np.maximum(self._dense_mu, 0.0) * (1.0 - self.dense_missing)
            logit += (np.asarray(batch.dense, np.float64) - centre) @ self._dense_weight
        return logit

    def _calibrate(self) -> float:
        """The bias that makes the mean predicted CTR equal self.ctr (bisection)."""
        raw = self._raw(np.random.SeedSequence(self.seed, spawn_key=(_CALIBRATION_PART,)), _CALIBRATION_EXAMPLES)
        piece = self._piece_of(raw, np.zeros(0, np.int64), draw_labels=False)
        logit0 = self.hidden_logit(Batch(piece.labels, piece.dense, piece.keys))
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(logit0 + mid)))) < self.ctr:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    # -- Zipf ranks

    def _setup_zipf(self):
        a = self.zipf_a
        cdf = np.cumsum(np.arange(1, _ZIPF_HEAD + 1, dtype=np.float64) ** -a)
        self._zipf_cdf = np.append(cdf, np.inf)  # the inf stops the correction at the last head rank
        # The rank at the start of each of _ZIPF_CELLS equal cells of [0, cdf[-1]),
        # and how many rank boundaries a cell may hold (1 unless zipf_a is large).
        starts = np.arange(_ZIPF_CELLS) * (cdf[-1] / _ZIPF_CELLS)
        self._zipf_cell = np.searchsorted(cdf, starts, side="right").astype(np.int64) + 1
        self._zipf_cell_scale = _ZIPF_CELLS / cdf[-1]
        ends = np.append(self._zipf_cell[1:], _ZIPF_HEAD)
        self._zipf_steps = int((ends - self._zipf_cell).max(initial=0))
        # The first boundary after each cell's start: with one boundary per cell
        # (the usual case) the rank is _zipf_cell[c] + (t >= _zipf_bound[c]).
        self._zipf_bound = cdf[self._zipf_cell - 1]
        vocab = np.asarray(self.vocab_sizes, np.float64)
        self._zipf_h = np.minimum(vocab, _ZIPF_HEAD)
        self._zipf_head_mass = cdf[self._zipf_h.astype(np.int64) - 1]
        self._zipf_f_h = self._zipf_F(self._zipf_h + 0.5)
        tail = np.where(vocab > _ZIPF_HEAD, self._zipf_F(vocab + 0.5) - self._zipf_f_h, 0.0)
        self._zipf_total = self._zipf_head_mass + tail
        self._zipf_lo = self._zipf_h.astype(np.int64) + 1
        self._zipf_hi = np.asarray(self.vocab_sizes, np.int64)
        # The tail inverse, F^-1(F(h + 1/2) + max(t - head_mass, 0)), as
        # exp(k * log(c * max(t - head_mass, 0) + d)): one log and one exp
        # (numpy's float ** is several times slower).
        if a == 1.0:
            self._zipf_c, self._zipf_d, self._zipf_k = 1.0, self._zipf_h + 0.5, 1.0
        else:
            self._zipf_c, self._zipf_d, self._zipf_k = 1.0 - a, (1.0 - a) * self._zipf_f_h, 1.0 / (1.0 - a)

    def _zipf_F(self, x):
        """An antiderivative of x**-a."""
        a = self.zipf_a
        return np.log(x) if a == 1.0 else x ** (1.0 - a) / (1.0 - a)

    def _ranks(self, t: np.ndarray) -> np.ndarray:
        """Zipf ranks (1-based, int64) from t, uniform on [0, _zipf_total[f]) in column f.

        Head ranks: the rank at the start of t's cell, moved up past the CDF
        boundaries inside the cell. Tail ranks: the continuous inverse, rounded.
        In-place operations: this is the generator's hottest loop.
        """
        cdf = self._zipf_cdf
        cell = (t * self._zipf_cell_scale).astype(np.int64)
        np.minimum(cell, _ZIPF_CELLS - 1, out=cell)
        ranks = self._zipf_cell[cell]
        if self._zipf_steps:
            ranks += t >= self._zipf_bound[cell]
        for _ in range(self._zipf_steps - 1):
            ranks += t >= cdf[ranks - 1]
        if (self._zipf_hi > _ZIPF_HEAD).any():
            y = t - self._zipf_head_mass
            np.maximum(y, 0.0, out=y)
            if self.zipf_a == 1.0:  # F = log: F^-1(log(h + 1/2) + s) = (h + 1/2) * exp(s)
                np.exp(y, out=y)
                y *= self._zipf_d
            else:
                y *= self._zipf_c
                y += self._zipf_d
                np.log(y, out=y)
                y *= self._zipf_k
                np.exp(y, out=y)
            y += 0.5
            tail = y.astype(np.int64)  # y > 0: truncation is floor
            np.minimum(tail, self._zipf_hi, out=tail)  # (np.clip is slower than the two)
            np.maximum(tail, self._zipf_lo, out=tail)
            ranks = np.where(t >= self._zipf_head_mass, tail, ranks)  # (faster than copyto(where=))
        return ranks

    # -- examples

    def _raw(self, seq: np.random.SeedSequence, n: int):
        """Raw values of n examples: (ids, cat_missing, dense_counts, dense_missing, label_uniforms)."""
        rng = np.random.default_rng(seq)
        n_cat = len(self.vocab_sizes)
        # One uniform u per value decides both: missing if u < m, else the rank
        # from (u - m) / (1 - m), which is uniform given u >= m.
        u = rng.random((n, n_cat))
        cat_missing = u < self.cat_missing
        u -= self.cat_missing
        u *= self._zipf_total / (1.0 - self.cat_missing)
        np.maximum(u, 0.0, out=u)
        ranks = self._ranks(u)
        ranks *= self._perm_mul
        ranks += self._perm_add
        ids = ranks % self._zipf_hi
        t = rng.standard_normal((n, self.n_dense), dtype=np.float32)
        t *= self._dense_sigma.astype(np.float32)
        t += self._dense_mu.astype(np.float32)
        np.maximum(t, np.float32(0), out=t)
        counts = np.expm1(t, out=t)
        np.floor(counts, out=counts)
        dense_missing = rng.random((n, self.n_dense), dtype=np.float32) < self.dense_missing
        counts[dense_missing] = 0
        return ids.view(np.uint64), cat_missing, counts, dense_missing, rng.random(n)

    def _piece_of(self, raw, lines: np.ndarray, draw_labels: bool = True) -> _Piece:
        ids, cat_missing, counts, _, label_u = raw
        keys = _keys(self._tags, ids, cat_missing)
        dense = dense_transform(counts)
        labels = np.zeros(len(ids), np.float32)
        piece = _Piece(labels, dense, keys, _sources_of(f"synthetic:{self.part}", lines))
        if draw_labels:
            p = 1.0 / (1.0 + np.exp(-self.hidden_logit(Batch(labels, dense, keys))))
            labels[:] = label_u < p
        return piece

    def _blocks(self, total: Optional[int]) -> Iterator[tuple[int, int]]:
        """(block index, examples used from it) of this node's blocks among the first `total` examples
        of the stream (None: all)."""
        b = self.rank
        while total is None or b * _BLOCK < total:
            yield b, _BLOCK if total is None else min(_BLOCK, total - b * _BLOCK)
            b += self.world

    def _raw_blocks(self, total: Optional[int]):
        """(block index, raw values) of this node's blocks. A block is always drawn
        whole and then cut, so that a shorter stream is a prefix of a longer one."""
        part = _PARTS[self.part]
        for b, n in self._blocks(total):
            raw = self._raw(np.random.SeedSequence(self.seed, spawn_key=(part, b)), _BLOCK)
            yield b, tuple(r[:n] for r in raw)

    def _pieces(self) -> Iterator[_Piece]:
        for b, raw in self._raw_blocks(self.examples):
            start = b * _BLOCK + 1
            yield self._piece_of(raw, np.arange(start, start + len(raw[0])))

    def __iter__(self) -> Iterator[Batch]:
        """The stream from its start (every iteration yields the same batches)."""
        return _rebatch(self._pieces(), self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches per pass on this node (a TypeError for an endless stream)."""
        if self.examples is None:
            raise TypeError("an endless SyntheticCriteo (examples=None) has no length")
        mine = sum(n for _, n in self._blocks(self.examples))
        return mine // self.batch_size if self.drop_last else -(-mine // self.batch_size)

    def write_tsv(self, path: str, examples: int) -> int:
        """Writes this node's first ``examples`` examples as a Criteo TSV file; returns the count.

        The file holds the raw values (counts and 8-digit hex ids; missing ones
        empty), so reading it with :class:`CriteoTsv` gives this generator's
        batches (the same as ``SyntheticCriteo(..., examples=examples)``'s on one
        node). ``path`` may be an fsspec URL; a ``.gz`` path is compressed.
        Needs 13 dense and 26 categorical fields.
        """
        if self.n_dense != len(DENSE_COLUMNS) or len(self.vocab_sizes) != len(CATEGORICAL_COLUMNS):
            raise ValueError(f"the Criteo format has {len(DENSE_COLUMNS)} dense and {len(CATEGORICAL_COLUMNS)} "
                             f"categorical fields; this generator has {self.n_dense} and {len(self.vocab_sizes)}")
        if examples < 0:
            raise ValueError(f"examples must be >= 0, got {examples}")
        if _is_url(path):
            out = _fsspec().open(path, "wb", compression="infer").open()
        else:
            out = gzip.open(path, "wb") if path.endswith(".gz") else open(path, "wb")
        written = 0
        with out:
            for _, raw in self._raw_blocks(None):
                if written >= examples:
                    break
                piece = self._piece_of(raw, np.zeros(0, np.int64))
                k = min(len(piece), examples - written)
                out.write(_tsv_lines(piece.labels[:k], tuple(r[:k] for r in raw)))
                written += k
        return written

    def __repr__(self) -> str:
        return (f"SyntheticCriteo(seed={self.seed}, part={self.part!r}, examples={self.examples}, "
                f"batch_size={self.batch_size}, fields={len(self.vocab_sizes)}, zipf_a={self.zipf_a})")


_HEX_CHARS = np.frombuffer(b"0123456789abcdef", np.uint8)


def _tsv_lines(labels: np.ndarray, raw) -> bytes:
    """Criteo TSV text of examples given as labels and SyntheticCriteo._raw values."""
    ids, cat_missing, counts, dense_missing, _ = raw
    n = len(labels)
    # 8 hex digits per id, built as a byte matrix rather than by formatting each one.
    nibbles = (ids[:, :, None] >> (np.arange(28, -1, -4, dtype=np.uint64))) & np.uint64(15)
    hexes = _HEX_CHARS[nibbles.astype(np.intp)].view("S8")[:, :, 0]
    hexes = np.where(cat_missing, b"", hexes)
    ints = np.where(dense_missing, b"", counts.astype(np.int64).astype("S20"))
    cols = [np.where(labels > 0, b"1", b"0")] + [ints[:, j] for j in range(ints.shape[1])] + \
           [hexes[:, j] for j in range(hexes.shape[1])]
    out = io.BytesIO()
    for fields in zip(*(c.tolist() for c in cols), strict=True):
        out.write(b"\t".join(fields))
        out.write(b"\n")
    return out.getvalue() if n else b""
