"""The Criteo format and its readers: :class:`CriteoTsv`, :class:`CriteoParquet`, :func:`open_criteo`.

What a valid example is (the 40 columns, label 0 or 1, integer counts, hex
categoricals; ``_parse_line`` is the reference definition), how its values
become a batch's arrays (:func:`dense_transform`, :func:`hps.data.keys.feature_keys`'s
hash), and the two readers, which convert pyarrow columns straight to numpy and
fall back to the per-line parser to name a bad line.
"""
from __future__ import annotations

import gzip
import re
import zlib
from typing import Callable, Iterator, Optional, Union

import numpy as np

from hps.data.examples import _Piece, _sources_of
from hps.data.files import (DataError, _compression, _LfLineEnds, _line_bounds, _open_binary, _Reader, _shown,
                            _warn_empty, list_files, parquet_errors, parquet_file)
from hps.data.keys import _field_tags, _keys

from hps.data import _criteo_lines  # the compiled per-line parser (bench/reader_bench.py sets it to None
#                                    to time the Python reference, _slow_python, it replaced)

LABEL_COLUMN = "label"
DENSE_COLUMNS: tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL_COLUMNS: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
#: The 40 Criteo columns in file order.
COLUMNS: tuple[str, ...] = (LABEL_COLUMN,) + DENSE_COLUMNS + CATEGORICAL_COLUMNS


def dense_transform(raw) -> np.ndarray:
    """float32 ``log(1 + max(x, 0))`` of raw integer counts (missing given as 0 or NaN)."""
    x = np.array(raw, dtype=np.float64)  # a copy: the operations below work in place
    np.fmax(x, 0.0, out=x)  # fmax also turns NaN into 0
    np.log1p(x, out=x)
    return x.astype(np.float32)


def _piece(path, lines, labels, dense_raw, cat_values, cat_missing) -> _Piece:
    """Rows from validated raw values (dense_raw: float64 counts with 0 for missing)."""
    return _Piece(np.asarray(labels, np.float32), dense_transform(dense_raw),
                  _keys(_field_tags(cat_values.shape[1]), cat_values, cat_missing), _sources_of(path, lines))


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
    """Raises DataError unless arrow type t is one that column ``name`` may have. A feature
    column of type null (every value missing: what pyarrow, pandas and polars write for a
    column of None alone, as a small shard's I12 or C22 may be) is taken; a label is not."""
    if name != LABEL_COLUMN and pa.types.is_null(t):
        return
    if name in CATEGORICAL_COLUMNS:
        v = t.value_type if pa.types.is_dictionary(t) else t
        if not (pa.types.is_string(v) or pa.types.is_large_string(v) or pa.types.is_binary(v)
                or pa.types.is_large_binary(v) or pa.types.is_integer(v)):
            raise DataError(f"{path}: column {name} has type {t}, expected hex strings or integers",
                            path=path, field=name)
    elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise DataError(f"{path}: column {name} has type {t}, expected integers", path=path, field=name)


def _numeric_array(pa, arr, name: str, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values float64 with NaN for missing, missing, bad: non-finite or an integer past int64)
    of an integer/float/bool array."""
    t = arr.type
    _check_type(pa, t, name, path)
    if pa.types.is_integer(t) and t.bit_width == 64:
        # float64 holds integers exactly only up to 2**53; beyond that the
        # log transform cannot tell the difference anyway.
        missing = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(len(arr), bool)
        ints = pa.compute.fill_null(arr, 0).to_numpy()
        values = ints.astype(np.float64)
        values[missing] = np.nan
        if ints.dtype == np.uint64:  # past int64 is refused, as in a TSV file (_parse_line)
            return values, missing, ints > np.uint64(_INT64_MAX)
    else:
        values = arr.cast(pa.float64()).to_numpy(zero_copy_only=False)
        missing = np.isnan(values)
    return values, missing, np.isinf(values)


def _categorical_array(pa, arr, name: str, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values uint64, missing, bad) of a categorical column: hex strings or integers."""
    _check_type(pa, arr.type, name, path)
    if pa.types.is_null(arr.type):
        return np.zeros(len(arr), np.uint64), np.ones(len(arr), bool), np.zeros(len(arr), bool)
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
        if isinstance(value, int) and value > _INT64_MAX:  # a Parquet uint64 column
            return f"{_shown(value)} is out of the 64-bit integer range"
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
    (``.gz``, ``.bz2``, ``.zst``, by name in any case, are decompressed). Node
    ``rank`` of ``world`` reads its share of the files (:func:`shard_files`).
    Batches have ``batch_size`` rows and run on across file boundaries; the
    last one is smaller unless ``drop_last``.

    A malformed line raises :class:`DataError`, e.g.
    ``train.tsv:1234: field I5: 'abc' is not an integer`` or
    ``train.tsv:77: has 38 fields, expected 40``. With ``skip_malformed=True``
    such lines are left out and counted in ``malformed``, the first messages
    kept in ``malformed_examples``. Valid fields: label 0 or 1; I* empty or a
    decimal int64 (``-?[0-9]+``); C* empty or 1 to 16 hex digits. Lines end
    at "\\n" (a "\\r" before it is dropped), so a lone "\\r" or a byte order
    mark belongs to a field and makes the line malformed; but a file whose
    first 64 KiB hold a "\\r" and no "\\n" has lone "\\r" line ends (classic
    Mac OS), and is read with each "\\r" (or "\\r\\n") ending a line. A damaged
    compressed file raises DataError at the first line it cannot give, even
    with ``skip_malformed``.

    Files are read in blocks of ``block_bytes`` (cut at line ends) that
    pyarrow.csv parses with several threads; a block it rejects, or one with a
    bad value, is parsed again line by line (hps.data._criteo_lines, compiled
    from Cython) to find the bad lines, each named by ``_parse_line``. A dirty
    file reads about as fast as a clean one (bench/reader_bench.py).
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
            # pyarrow's codecs (bz2, zstd, and any of a URL's) report damaged data as
            # a plain OSError: for a compressed file it is the data's fault.
            damaged = _DECOMPRESSION_ERRORS + ((OSError,) if _compression(path) else ())
            with _open_binary(path) as raw:
                line = 1
                blocks = _blocks(_LfLineEnds(raw), self.block_bytes)
                read_any = False
                while True:
                    try:
                        block = next(blocks, None)
                    except damaged as e:
                        # Not a line to skip: nothing after this point can be read.
                        raise DataError(f"{path}:{line}: corrupt or truncated compressed data at or after this "
                                        f"line: {e}", path=path, line=line) from e
                    if block is None:
                        break
                    read_any = True
                    piece, n_lines = self._fast(block, path, line) or self._slow(block, path, line)
                    line += n_lines
                    if len(piece):
                        yield piece
                if not read_any:
                    _warn_empty(path)

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
        """(rows, lines) of the block line by line; bad lines raise or are counted (self._bad).
        The compiled parser (hps.data._criteo_lines) gives the verdicts and values, and
        _parse_line, the reference, the reason for each bad line."""
        if _criteo_lines is None:
            return self._slow_python(block, path, first_line)
        data, starts, ends = _line_bounds(block)
        ends -= (ends > starts) & (data[np.maximum(ends - 1, 0)] == 13)  # a "\r" before the "\n" is dropped
        n = len(starts)
        labels, dense = np.empty(n), np.empty((n, len(DENSE_COLUMNS)))
        cats, absent = np.empty((n, len(CATEGORICAL_COLUMNS)), np.uint64), np.empty((n, len(CATEGORICAL_COLUMNS)), np.uint8)
        valid = np.empty(n, np.uint8)
        if _criteo_lines.parse_lines(data, starts, ends, labels, dense, cats, absent, valid) < n:
            for i in np.flatnonzero(valid == 0):
                parsed = _parse_line(block[starts[i]:ends[i]])
                if not (parsed[0] is None or isinstance(parsed[0], str)):
                    raise RuntimeError(f"{path}:{first_line + i}: the compiled line parser rejects a line that "
                                       f"_parse_line accepts (a bug in hps.data._criteo_lines)")
                field, message = parsed
                self._bad(DataError(f"{path}:{first_line + i}: " + (f"field {field}: " if field else "") + message,
                                    path=path, line=first_line + int(i), field=field))
        keep = valid.view(bool)
        return _piece(path, np.flatnonzero(keep) + first_line, labels[keep], dense[keep], cats[keep],
                      absent[keep].view(bool)), n

    def _slow_python(self, block: bytes, path: str, first_line: int) -> tuple[_Piece, int]:
        """_slow by _parse_line alone: the Python reference bench/reader_bench.py times."""
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
    as unsigned of their width; null missing). An I* integer past int64 (in a
    uint64 column) is malformed, as in a TSV file. Arguments and malformed-row
    handling as :class:`CriteoTsv`; a "line" here is the 1-based row number,
    e.g. ``day0.parquet: row 12: field C3: 'xyz' is not a hexadecimal ...``.
    A feature column of type null (every value missing) is read as missing values.
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
        errors = parquet_errors(pa)
        for path in self.files:
            with parquet_file(pa, path) as pf:
                _check_schema(pa, pf.schema_arrow, path)
                row = 1
                # One row group at a time, so that an error names the group.
                for g in range(pf.num_row_groups):
                    row = yield from self._row_group(pf, g, path, row, errors)
                if row == 1:  # (an export's part of no rows, as an empty TSV part)
                    _warn_empty(path, "no rows")

    def _row_group(self, pf, g: int, path: str, row: int, errors):
        """Yields the pieces of row group g, whose first row is ``row`` of the file; returns
        the row after it."""
        pa = self._pa
        n_rows = pf.metadata.row_group(g).num_rows
        record_batches = pf.iter_batches(batch_size=self.read_rows, row_groups=[g], columns=list(COLUMNS))
        first = row
        while True:
            try:
                record_batch = next(record_batches, None)
            except errors as e:
                raise DataError(f"{path}: row group {g} (rows {first}-{first + n_rows - 1}): cannot read: {e}",
                                path=path, line=first) from e
            if record_batch is None:
                return row
            cols = _Columns(pa, lambda name, part=record_batch: [part.column(name)], record_batch.num_rows, path)
            lines = np.arange(row, row + record_batch.num_rows)
            keep = ~cols.bad_rows()
            for r in np.flatnonzero(~keep):
                name = next(c for c in COLUMNS if cols.bad[c][r])
                line = row + int(r)
                self._bad(DataError(f"{path}: row {line}: field {name}: {_reason(name, cols.value(name, r))}",
                                    path=path, line=line, field=name))
            row += record_batch.num_rows
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
