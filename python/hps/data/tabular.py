"""Readers of data laid out by a :class:`~hps.data.schema.Schema`: CSV/TSV, Parquet, libsvm/libFM text.

- :class:`SchemaCsv`: delimited text with or without a header, parsed by
  pyarrow.csv with the schema's delimiter (quotes allowed; a value over a line
  end makes its row malformed, in a column the schema skips too). Every column is read as bytes,
  and those the schema uses are converted here, so that a bad value is named with its file, line
  and column.
- :class:`SchemaParquet`: any of those columns in Parquet; labels and dense
  values as integers, floats, booleans, decimals or numeric text; categoricals as
  strings, binary or integers (an integer's key is that of its decimal text),
  multi-hot fields as list columns or as text with a separator.
- :class:`Libsvm`: ``label idx:val idx:val ...`` (libsvm, libFM); each field of
  the schema's ``fields`` (an inclusive range of feature indices; without
  ``fields``, one field of every index) is a bag of its indices, weighted by
  their values. Labels 0/1 (or -1/+1). Parsed by the compiled line parser
  (_libsvm_lines.pyx); a bad line is named by the Python reference parser.
- :func:`open_schema` picks the reader from the file names (.parquet/.pq,
  .svm/.libsvm/.libfm, else text) or ``format``.

Files may be compressed (.gz, .bz2, .zst; by name). Each batch's ``keys`` hold
the single-hot (categorical) fields, ``bags`` the multi-hot ones (for libsvm,
every field), ``dense`` the dense features (:func:`hps.data.dense_transform`
with ``dense_transform = "log"``). Every file of a data set must give the same
fields (names and order) as the first one.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterator, Optional

import numpy as np

from hps.data import _libsvm_lines  # the compiled libsvm line parser (_libsvm_lines.pyx)
from hps.data.criteo import dense_transform
from hps.data.examples import Bags, _Piece, _sources_of
from hps.data.files import (_COMPRESSED, DataError, _compression, _is_url, _LfLineEnds, _line_bounds, _open_binary,
                            _Reader, _shown, _warn_empty, list_files, parquet_errors, parquet_file)
from hps.data.keys import _field_tag, _keys
from hps.data.schema import Schema, _as_binary, _binary_parts, value_hashes

# The least magnitude that is inf as a float32, the type values are stored in.
FLOAT32_OVERFLOW = _libsvm_lines.FLOAT32_OVERFLOW

# A line end as pyarrow.csv reads one.
_LINE_END = re.compile(rb"\r\n|\n|\r")


def _plain_name(path: str) -> str:
    """The file name without a compression suffix ("day0.tsv.gz" -> "day0.tsv")."""
    base = path.lower()
    for ext in _COMPRESSED:
        if base.endswith(ext):
            return base[:-len(ext)]
    return base


def _open_stream(pa, path: str):
    """A pyarrow input stream of the file's decompressed bytes."""
    if _is_url(path):
        return pa.PythonFile(_open_binary(path), mode="r")
    return pa.input_stream(path, compression=_compression(path))


def _read_errors(pa):
    import gzip
    import zlib
    return (pa.ArrowException, OSError, EOFError, gzip.BadGzipFile, zlib.error)


# --------------------------------------------------------------------------- conversions

def _text_type(pa, t) -> bool:
    return pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or \
        pa.types.is_large_binary(t)


def _numeric(pa, arr, name: str, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values float64 with NaN for missing, missing, bad) of a label or dense column:
    numbers (integers, floats, booleans, decimals), or text that pyarrow reads as a
    number (empty is missing). A NaN is a
    missing value wherever it comes from: a float column's NaN, or text such as
    "nan" or "NaN" (which would otherwise reach a batch as NaN under
    ``dense_transform = "none"``)."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.dictionary_decode(), t.value_type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t) \
            or pa.types.is_null(t):  # (null: a Parquet column of missing values alone)
        values = arr.cast(pa.float64()).to_numpy(zero_copy_only=False)
        missing = np.isnan(values)
        return values, missing, np.isinf(values)
    if not _text_type(pa, t):
        raise DataError(f"{path}: column {name!r} has type {t}, expected numbers", path=path, field=name)
    pc = pa.compute
    empty = pc.equal(pc.binary_length(arr), 0)
    arr = pc.if_else(empty, pa.scalar(None, arr.type), arr)
    missing = arr.is_null().to_numpy(zero_copy_only=False)
    try:
        values = arr.cast(pa.string()).cast(pa.float64()).to_numpy(zero_copy_only=False)
        return values, missing | np.isnan(values), np.isinf(values)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    values = np.full(len(arr), np.nan)
    bad = np.zeros(len(arr), bool)
    # As bytes: Parquet does not check that a string column holds UTF-8, and such a
    # value is a bad one (the cast to string below refuses it), not a UnicodeDecodeError.
    for i, v in enumerate(arr.cast(pa.binary()).to_pylist()):  # only a block that holds a bad value comes here
        if v is None:
            continue
        try:
            values[i] = pa.array([v], pa.binary()).cast(pa.string()).cast(pa.float64())[0].as_py()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            bad[i] = True
    bad |= np.isinf(values)
    return values, missing | (np.isnan(values) & ~bad), bad


def _bags(pa, arr, sep: str, field_index: int, name: str, path: str) -> Bags:
    """The bags of a multi-hot column: a list column, or text split at ``sep``; empty
    elements and empty or null cells add nothing (an empty bag)."""
    pc = pa.compute
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.dictionary_decode(), t.value_type
    if pa.types.is_null(t):  # a Parquet column of missing values alone: empty bags
        arr = arr.cast(pa.list_(pa.string()))
        t = arr.type
    if _text_type(pa, t):
        if not sep:
            raise DataError(f"{path}: multi-hot column {name!r} is text: give its separator in "
                            f"data.schema.multi_hot", path=path, field=name)
        arr = pc.split_pattern(pc.fill_null(arr, pa.scalar(b"" if pa.types.is_binary(t) else "", t)), sep)
    elif not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise DataError(f"{path}: multi-hot column {name!r} has type {t}, expected a list or text",
                        path=path, field=name)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = _as_binary(pa, pc.list_flatten(arr))
    if values is None:
        raise DataError(f"{path}: multi-hot column {name!r} has type {t}, expected lists of strings or integers",
                        path=path, field=name)
    h, missing = value_hashes(pa, values)
    keep = ~missing
    counted = np.concatenate([[0], np.cumsum(keep)])
    offsets = counted[np.concatenate([[0], np.cumsum(lengths)])].astype(np.int64)
    return Bags(_keys(_field_tag(field_index), h[keep], None), offsets)


class _Converted:
    """The schema's columns of one block as a batch's arrays, with the bad rows per column."""

    def __init__(self, pa, get, layout, schema: Schema, path: str):
        names = layout.columns
        label_name = names[layout.label]
        values, missing, bad = _numeric(pa, get(layout.label), label_name, path)
        self.n = len(values)
        self.label_missing = missing
        self.labels = np.where(missing, 0.0, values).astype(np.float32)
        # (column position, name, bad rows, why), checked in this order.
        self.bad = [(layout.label, label_name, missing | bad | ((values != 0) & (values != 1)), "is not 0 or 1")]
        dense = np.zeros((self.n, len(layout.dense)))
        log = schema.dense_transform == "log"
        for j, i in enumerate(layout.dense):
            values, missing, bad = _numeric(pa, get(i), names[i], path)
            dense[:, j] = np.where(missing, 0.0, values)
            self.bad.append((i, names[i], bad, "is not a number"))
            if not log:  # stored as float32, where it would be inf (log1p brings any double inside)
                past = np.abs(dense[:, j]) >= FLOAT32_OVERFLOW
                dense[past, j] = 0.0  # a bad row, dropped or raised: not cast
                self.bad.append((i, names[i], past, "is past float32's range (+-3.4028235e38)"))
        self.dense = dense_transform(dense) if log else dense.astype(np.float32)
        self.keys = np.empty((self.n, len(layout.categorical)), np.uint64)
        for j, i in enumerate(layout.categorical):
            arr = _as_binary(pa, get(i))
            if arr is None:
                t = get(i).type
                raise DataError(f"{path}: categorical column {names[i]!r} has type {t}, expected strings, "
                                f"binary or integers", path=path, field=names[i])
            h, missing = value_hashes(pa, arr)
            self.keys[:, j] = _keys(_field_tag(j), h, missing)
        k = len(layout.categorical)
        self.bags = tuple(_bags(pa, get(i), sep, k + j, names[i], path) for j, (i, sep) in enumerate(layout.multi_hot))
        self.get = get
        self._pa = pa
        self.names = names

    def bad_rows(self) -> np.ndarray:
        return np.logical_or.reduce([b for _, _, b, _ in self.bad])

    def reason(self, r: int) -> tuple[Optional[str], str]:
        """(column, message) of bad row r: the first bad column in schema order; the
        column None for what is wrong with the whole line."""
        for i, name, bad, why in self.bad:
            if bad[r]:
                if name is None:
                    return None, why
                scalar = self.get(i)[int(r)]
                if isinstance(scalar, self._pa.DictionaryScalar):
                    scalar = scalar.value
                try:
                    value = scalar.as_py()
                except UnicodeDecodeError:  # Parquet does not check that a string column holds UTF-8
                    value = scalar.cast(self._pa.binary()).as_py()
                return name, f"{_shown(value)} {why}"
        raise AssertionError("row is not bad")

    def piece(self, path: str, lines: np.ndarray, keep: Optional[np.ndarray] = None) -> _Piece:
        if keep is None:
            return _Piece(self.labels, self.dense, self.keys, _sources_of(path, lines), self.bags)
        rows = np.flatnonzero(keep)
        bags = []
        for b in self.bags:
            lens = np.diff(b.offsets)[rows]
            sel = np.concatenate([np.arange(b.offsets[r], b.offsets[r + 1]) for r in rows]) if len(rows) \
                else np.zeros(0, np.int64)
            bags.append(Bags(b.keys[sel.astype(np.int64)], np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)))
        return _Piece(self.labels[keep], self.dense[keep], self.keys[keep], _sources_of(path, lines[keep]), bags)


class _SchemaReader(_Reader):
    """A _Reader with a schema, which checks that every file gives the same fields."""

    def __init__(self, paths, schema, batch_size: int = 4096, **options):
        super().__init__(paths, batch_size, **options)
        if isinstance(schema, Schema):
            schema.check()  # (a Schema made in Python has not been checked yet)
        self.schema = schema if isinstance(schema, Schema) else Schema.from_dict(schema)
        self._first: Optional[tuple] = None

    def widths(self) -> tuple[int, int, int]:
        """(dense features, single-hot fields, multi-hot fields) of the first file with
        data (:meth:`widths_file`): the model's shape."""
        layout = self._layout(self.widths_file())
        return len(layout.dense), len(layout.categorical), len(layout.multi_hot)

    def widths_file(self) -> str:
        """The file :meth:`widths` takes the model's shape from: the first with data."""
        for path in self.files:
            if self._layout(path) is not None:
                return path
        raise DataError(f"{self.files[0]}: the data holds no examples ({len(self.files)} file(s), each empty): no "
                        f"fields to take the model's shape from", path=self.files[0])

    def fields(self) -> Optional[tuple]:
        """The fields of the first file with data (label, dense, categorical and multi-hot
        column names, the last with their separators): what every file of a data set must
        give alike; None when no file has any (a file of 0 bytes has no fields to give)."""
        for path in self.files:
            layout = self._layout(path)
            if layout is not None:
                return layout.names()
        return None

    def _same_fields(self, layout, path: str) -> None:
        names = layout.names()
        if self._first is None:
            self._first = (path, names)
        elif names != self._first[1]:
            raise DataError(f"{path}: the schema gives other fields here than in {self._first[0]} "
                            f"({_describe(names)} against {_describe(self._first[1])})", path=path)

    def _bad_rows(self, conv: _Converted, layout, path: str, lines: np.ndarray, where,
                  other_lines: tuple = ()) -> Optional[np.ndarray]:
        """The rows to keep (None: all), raising or counting the bad ones; ``other_lines``:
        errors of lines among these that gave no row (a wrong field count). All are
        reported in line order, so that the error raised is the lowest line's however
        the file was cut into blocks."""
        bad = conv.bad_rows()
        if not bad.any() and not other_lines:
            return None
        errors = list(other_lines)
        for r in np.flatnonzero(bad):
            name, message = conv.reason(r)
            column = f" column {name!r}:" if name is not None else ""
            errors.append(DataError(f"{where(int(lines[r]))}:{column} {message}", path=path, line=int(lines[r]),
                                    field=name))
        for error in sorted(errors, key=lambda e: e.line):
            self._bad(error)
        return ~bad if bad.any() else None


def _describe(names) -> str:
    label, dense, cats, multi = names
    return f"label {label!r}, dense {dense}, categorical {cats}, multi-hot {[m for m, _ in multi]}"


# --------------------------------------------------------------------------- CSV / TSV

class SchemaCsv(_SchemaReader):
    """Batches from delimited text laid out by ``schema`` (header or not, by ``schema.header``).

    Errors name file, line and column: ``clicks.csv:12: column 'price': 'abc' is not a
    number``, ``clicks.csv:7: has 4 fields, expected 5``, ``clicks.csv:9: is an empty line,
    expected 5 fields``, ``clicks.csv: no column 'click'``. Without a header the field
    count expected is the one most of the file's first lines (its first MiB) have, ties
    going to the earliest line's, so that a malformed line 1 is one malformed line
    (``clicks.csv:1: has 4 fields, expected 5, as most of its first lines have (the file
    has no header)``). ``skip_malformed`` skips and counts bad lines as the Criteo readers do; a schema that
    does not match a file raises even then. Lines are 1-based and count the header;
    a line ends at "\\n", "\\r\\n" or a lone "\\r" (as pyarrow.csv reads them).
    pyarrow parses ``block_bytes`` at a time; a file with a longer line (a long
    multi-hot list) is read again from that line with larger blocks, up to 1 GiB.
    """

    def __init__(self, paths, schema, batch_size: int = 4096, *, rank: int = 0, world: int = 1,
                 drop_last: bool = False, skip_malformed: bool = False, block_bytes: int = 1 << 20):
        super().__init__(paths, schema, batch_size, rank=rank, world=world, drop_last=drop_last,
                         skip_malformed=skip_malformed)
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        self.block_bytes = block_bytes

    def delimiter(self, path: str) -> str:
        return self.schema.delimiter or ("\t" if _plain_name(path).endswith(".tsv") else ",")

    def _layout(self, path: str):
        """The file's layout; None for a file without data (no header, no fields)."""
        names, _ = self._columns(path, self._pa.csv.ParseOptions(delimiter=self.delimiter(path)))
        return None if names is None else self.schema.resolve(names, path, by_name=self.schema.header)

    def _columns(self, path: str, parse) -> tuple[Optional[list[str]], int]:
        """(the header's names, or "0", "1", ... for the fields most of the first lines have
        (_field_count); the first line's bytes); (None, 0) for a file without a byte (once
        decompressed)."""
        pa = self._pa
        with _open_stream(pa, path) as f:
            # The first line ends where pyarrow ends it: at "\n", "\r\n" or a lone "\r"
            # (a file of "\r" line ends has no "\n" at all, and was taken for a header
            # without a line end: no rows). A "\r" last in what is read waits for the
            # next byte, which may be its "\n".
            buf, end, eof = b"", None, False
            while end is None and not eof:
                chunk = f.read(1 << 16)
                eof = not chunk
                at = max(len(buf) - 1, 0)  # (from the last byte read before: a "\r" held back)
                buf += chunk
                m = _LINE_END.search(buf, at)
                if m is not None and (m.group() != b"\r" or m.end() < len(buf) or eof):
                    end = m.end()
            first = buf if end is None else buf[:end]
            if not self.schema.header and (first.strip(b"\r\n") or self.skip_malformed):
                # The lines after it too, for the field count (_field_count)
                while not eof and len(buf) < len(first) + _COUNT_SAMPLE_BYTES:
                    chunk = f.read(1 << 16)
                    eof = not chunk
                    buf += chunk
                sample = buf if eof else buf[:max(buf.rfind(b"\n"), buf.rfind(b"\r"), len(first) - 1) + 1]
        if not first:
            return None, 0
        counted = first
        if not first.strip(b"\r\n"):
            # Without a header, skip_malformed skips it as any empty line (it has no field
            # count): the lines after it give the count. A header's line cannot be skipped.
            filled = None if self.schema.header or not self.skip_malformed else \
                re.search(rb"[^\r\n]+(?:\r\n|\n|\r|$)", sample)
            if filled is None:
                raise DataError(f"{path}:1: the first line is empty", path=path, line=1)
            counted = filled.group()
        ended = first.endswith((b"\n", b"\r"))
        if self.schema.header:
            # (a header that does not end a line has no rows after it: -1)
            whole = first if ended else first + b"\n"
            return (list(pa.csv.read_csv(pa.BufferReader(whole), parse_options=parse).column_names),
                    len(first) if ended else -1)
        return [str(i) for i in range(_field_count(pa, counted, sample, parse))], len(first)

    def _pieces(self) -> Iterator[_Piece]:
        pa = self._pa
        errors = _read_errors(pa)
        for path in self.files:
            try:
                names, first_bytes = self._columns(path, pa.csv.ParseOptions(delimiter=self.delimiter(path)))
            except errors as e:
                raise DataError(f"{path}: cannot read: {e}", path=path) from e
            # A file without a byte (an empty partition's part, which Spark writes without
            # its header) has no rows, so no fields to check: it warns as an empty Criteo
            # TSV or libsvm file does.
            if names is None:
                _warn_empty(path)
                continue
            layout = self.schema.resolve(names, path, by_name=self.schema.header)
            self._same_fields(layout, path)
            if self.schema.header and first_bytes < 0:  # a header without a line end: no rows
                _warn_empty(path, "a header, no rows")
                continue
            # A line after the header gives a row or a malformed line (raised, or counted).
            rows, malformed_before = 0, self._found  # (lines found, reached or not)
            block = max(self.block_bytes, 2 * first_bytes)
            resume = [2 if self.schema.header else 1]  # the first line not delivered yet
            counted: set = set()  # lines of a wrong field count already counted as malformed
            with _LinePeek(pa, path) as peek:
                while True:
                    try:
                        for piece in self._file_pieces(path, names, layout, block, resume, counted, peek):
                            rows += len(piece)
                            yield piece
                        break
                    except _LineTooLong as e:
                        # pyarrow cannot take a line longer than about two of its blocks: read
                        # the file again with larger blocks, delivering the lines not yet given.
                        if block >= _MAX_BLOCK_BYTES:
                            most = f"{_MAX_BLOCK_BYTES:,} bytes"
                            why = f"a quoted value runs on past the end of its line for more than {most} (a " \
                                f"quote not closed on it?)" if (peek.text(resume[0]) or b"").count(b'"') % 2 \
                                else f"a line is longer than {most}"
                            raise DataError(f"{path}: cannot read at or after line {resume[0]}: {why} ({e})",
                                            path=path, line=resume[0]) from e
                        block = min(4 * block, _MAX_BLOCK_BYTES)
            if self.schema.header and not rows and self._found == malformed_before:
                _warn_empty(path, "a header, no rows")

    def _file_pieces(self, path: str, names: list, layout, block: int, resume: list, counted: set,
                     peek: "_LinePeek"):
        """The pieces of one file's lines from ``resume[0]`` on (set to the next line after
        each piece), read in pyarrow blocks of ``block`` bytes; raises _LineTooLong where a
        line does not fit them. ``peek`` reads the file's lines that may be empty."""
        pa = self._pa
        errors = _read_errors(pa)
        start = resume[0]
        # pyarrow numbers rows as if each were one line; a quoted value may run on over
        # line ends (see below), so its numbers are turned into lines here: a row's
        # line is its number plus the line ends inside the rows before it (`extra`).
        # rows of a wrong field count: (pyarrow's number, message, line ends in it), to report
        invalid: list[tuple] = []
        shifts: list[tuple] = []  # their (number, line ends), which the rows after them skip
        final = [0, False]  # the last row's line so far, and whether a value in it holds a line end
        # Without a header the field count is the one most of the first lines have
        # (_field_count): the message says where it comes from.
        counted_from = "" if self.schema.header else ", as most of its first lines have (the file has no header)"

        def on_invalid(row):
            invalid.append((row.number, _empty_line(row.expected_columns) if not row.text else
                            f"has {row.actual_columns} fields, expected {row.expected_columns}{counted_from}",
                            row.text.count("\n")))
            shifts.append((row.number, invalid[-1][2]))
            return "skip"  # raised or counted once placed on its line, below

        def place(rows: list, line_of) -> list[DataError]:
            """The errors of invalid rows (pyarrow's number, message, line ends), at line
            line_of(number), to raise or count with the errors of the rows around them."""
            errors = []
            for number, message, ends in rows:
                ln = int(line_of(number))
                if ln > final[0]:
                    final[:] = [ln, ends > 0]
                if ln < start or ln in counted:  # delivered (skipped) before a re-read
                    continue
                if self.skip_malformed:
                    counted.add(ln)
                errors.append(DataError(f"{path}:{ln}: {message}", path=path, line=ln))
            return errors

        def cannot_read(e, line):
            if invalid and not self.skip_malformed:
                number, message, _ = invalid[0]
                return DataError(f"{path}:{number + extra}: {message}", path=path, line=number + extra)
            if isinstance(e, pa.ArrowInvalid) and "straddl" in str(e):  # "straddling object straddles two
                return _LineTooLong(str(e))                               # block boundaries"
            at = f" at or after line {line}" if line is not None else ""
            if isinstance(e, pa.ArrowInvalid) and "out of sync with chunker" in str(e):  # across a block's end
                return DataError(f"{path}: cannot read{at}: a quoted value runs on past the end of its line (a "
                                 f"quote not closed on it?)", path=path, line=line)
            return DataError(f"{path}: cannot read{at}: {e}", path=path, line=line)

        # newlines_in_values: without it pyarrow cuts its blocks at any line end, inside a
        # quoted value too, and a value over a line end that a block boundary split ended
        # the read ("out of sync with chunker"), gave its tail as a row of its own, or
        # swallowed the rows after it, as the blocks fell. With it the file reads the same
        # at any block size; such a row is malformed all the same (below).
        parse = pa.csv.ParseOptions(delimiter=self.delimiter(path), newlines_in_values=True,
                                    ignore_empty_lines=False, invalid_row_handler=on_invalid)
        # Columns read by position (generated names) even with a header, which
        # may repeat a name the schema does not use. The columns the schema does not
        # use are read too, as bytes: a value over a line end there moves the lines
        # after it as much, and is as malformed.
        generated = [f"c{i}" for i in range(len(names))]
        wanted = layout.read_columns()
        read = pa.csv.ReadOptions(column_names=generated, skip_rows=1 if self.schema.header else 0,
                                  block_size=block, use_threads=False)
        convert = pa.csv.ConvertOptions(column_types={c: pa.binary() for c in generated},
                                        strings_can_be_null=False, quoted_strings_can_be_null=False)
        number = 2 if self.schema.header else 1  # pyarrow's number of the next row
        extra = 0  # line ends inside the rows read so far
        line = number  # the next row's line
        try:
            reader = pa.csv.open_csv(pa.PythonFile(_NoBlockEndsInCr(_open_stream(pa, path)), mode="r"),
                                     read_options=read, parse_options=parse,
                                     convert_options=convert)
        except errors as e:
            raise cannot_read(e, None) from e
        with reader:
            while True:
                try:
                    rb = reader.read_next_batch()
                except StopIteration:
                    break
                except errors as e:
                    raise cannot_read(e, line) from e
                n = rb.num_rows
                numbers = np.arange(number, number + n)
                waiting = sorted(shifts)
                inside = np.zeros(n, np.int64)  # line ends inside the invalid rows before a row, not in `extra`
                for s, k in waiting:
                    numbers[numbers >= s] += 1
                    inside[numbers > s] += k

                def invalid_ends_before(s: int) -> int:
                    return sum(k for t, k in waiting if t < s)
                # A quoted value may run on over line ends (a quote not closed on its line
                # takes the lines up to the next quote, or to the end of the file): such a
                # row is malformed, and the lines it took count.
                ends = {i: _line_ends(pa, rb.column(generated[i])) for i in range(len(names))}
                ends = {i: e for i, e in ends.items() if e is not None}
                spans = sum((e[1] for e in ends.values()), np.zeros(n, np.int64))
                before = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)  # line ends before row j
                lines = numbers + extra + before[:-1] + inside
                if n:
                    number = int(numbers[-1]) + 1
                shifts[:] = [(s, k) for s, k in shifts if s >= number]
                # This batch's invalid rows: those among its rows and those right after them
                # (pyarrow may have parsed blocks ahead, whose invalid rows wait their turn).
                invalid.sort()
                mine, after = [], number
                for r in invalid:
                    if r[0] < number or r[0] == after:
                        mine.append(r)
                        after += r[0] == after
                invalid[:] = [r for r in invalid if r not in mine]
                placed = place(mine, lambda s: s + extra + before[np.searchsorted(numbers, s)] +
                               invalid_ends_before(s))
                extra += int(before[-1]) + invalid_ends_before(number)
                if n:
                    line = int(lines[-1]) + int(spans[-1]) + 1
                    if int(lines[-1]) > final[0]:
                        final[:] = [int(lines[-1]), bool(spans[-1])]
                first = int(np.searchsorted(lines, start))  # rows before it were delivered before a re-read
                if first:
                    rb, lines = rb.slice(first), lines[first:]
                if len(lines) == 0:
                    for error in placed:
                        self._bad(error)
                    continue
                conv = _Converted(pa, lambda i, rb=rb: rb.column(generated[i]), layout, self.schema, path)
                for i, e in ends.items():  # reported before the column's other faults
                    conv.bad.insert(0, (i, names[i], e[0][first:],
                                        "runs on past the end of its line (a quote not closed on it?)"))
                empty = self._empty_lines(conv, rb, generated, wanted, lines, peek)
                if empty is not None:
                    conv.bad.insert(0, (None, None, empty, _empty_line(len(names))))
                keep = self._bad_rows(conv, layout, path, lines, lambda ln: f"{path}:{ln}", placed)
                piece = conv.piece(path, lines, keep)
                resume[0] = line
                if len(piece):
                    yield piece
            for error in place(invalid, lambda s: s + extra + sum(k for t, k in shifts if t < s)):  # after the rows
                self._bad(error)
        if final[1] and peek.quotes_from(final[0]) % 2:
            # The quote was never closed: the file is cut short or its quoting broken,
            # and skipping that "line" would drop the rest of the file as one line.
            raise DataError(f"{path}:{final[0]}: a quoted value runs on to the end of the file (a quote not "
                            f"closed on line {final[0]}?)", path=path, line=final[0])


    def _empty_lines(self, conv: _Converted, rb, generated: list, wanted: list, lines: np.ndarray,
                     peek: "_LinePeek") -> Optional[np.ndarray]:
        """The rows that are empty lines, or None when there is none. pyarrow reads an
        empty line as a row of empty values, as it reads ",,": a row whose label is
        empty and whose every column read is empty is looked up in the file (rare: the
        file is read a second time only when a batch has such a row)."""
        if not conv.label_missing.any():
            return None
        pc = self._pa.compute
        maybe = conv.label_missing.copy()
        for i in wanted:
            maybe &= pc.equal(pc.binary_length(rb.column(generated[i])), 0).to_numpy(zero_copy_only=False)
        if not maybe.any():
            return None
        empty = np.zeros(len(maybe), bool)
        for r in np.flatnonzero(maybe):
            empty[r] = peek.text(int(lines[r])) == b""
        return empty if empty.any() else None


class _LinePeek:
    """A file's lines, read forward only, opened on first use: what a line holds
    where pyarrow's rows do not say (an empty line)."""

    def __init__(self, pa, path: str):
        self._pa, self._path = pa, path
        self._f = None
        self._buf, self._line = b"", 1  # the buffer starts at line self._line
        self._eof = False

    def text(self, line: int) -> Optional[bytes]:
        """The bytes of 1-based ``line`` without its line end, or None past the file's end."""
        if self._f is None or line < self._line:  # (a line before is asked only after a re-read)
            self.close()
            self._f, self._buf, self._line, self._eof = _open_stream(self._pa, self._path), b"", 1, False
        while True:
            ends = np.flatnonzero(np.frombuffer(self._buf, np.uint8) == 10)
            k = line - self._line  # line ends to pass in the buffer
            start = int(ends[k - 1]) + 1 if 0 < k <= len(ends) else 0
            if k < len(ends):
                return self._buf[start:int(ends[k])].rstrip(b"\r")
            if self._eof:  # the last line has no line end, or there is no such line
                return self._buf[start:].rstrip(b"\r") if k == len(ends) and start < len(self._buf) else None
            if len(ends):  # keep the last line, begun
                self._buf, self._line = self._buf[int(ends[-1]) + 1:], self._line + len(ends)
            chunk = self._f.read(1 << 20)
            self._eof = not chunk
            self._buf += chunk

    def quotes_from(self, line: int) -> int:
        """The number of quote characters (") from the start of 1-based ``line`` to the file's end."""
        if self.text(line) is None:
            return 0
        k = line - self._line
        ends = np.flatnonzero(np.frombuffer(self._buf, np.uint8) == 10)
        count = self._buf.count(b'"', int(ends[k - 1]) + 1 if k else 0)
        while not self._eof:
            chunk = self._f.read(1 << 20)
            self._eof = not chunk
            count += chunk.count(b'"')
        self.close()
        return count

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _empty_line(fields: int) -> str:
    """What a CSV reader says of an empty line (as the Criteo reader says it)."""
    return f"is an empty line, expected {fields} field{'s' if fields != 1 else ''}"


class _NoBlockEndsInCr:
    """A pyarrow stream read by SchemaCsv, whose reads (pyarrow's blocks) never end in a
    "\r" the file goes on after: pyarrow 26 drops the "\n" of a "\r\n" that a block
    boundary splits inside a quoted value, and the line it ends went uncounted (the row
    read as valid, every later row and error named a line too early). The "\r" is held
    back for the next read."""

    def __init__(self, stream):
        self._stream = stream
        self._held = b""

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            data, self._held = self._held + self._stream.read(), b""
            return data
        if n < 2:  # too small to hold a byte back (pyarrow's blocks here are larger)
            data, self._held = self._held or self._stream.read(n), b""
            return data
        data, self._held = self._held + self._stream.read(n - len(self._held)), b""
        if data == b"\r":  # a short read: the "\r" goes out with what follows it
            data += self._stream.read(1)
        if len(data) > 1 and data.endswith(b"\r"):
            self._held, data = b"\r", data[:-1]
        return data

    def close(self) -> None:
        self._stream.close()

    @property
    def closed(self) -> bool:
        return self._stream.closed

    def readable(self) -> bool:
        return True


# Without a header, the field count is the one most lines of about this many bytes
# at the file's start have.
_COUNT_SAMPLE_BYTES = 1 << 20


def _field_count(pa, first: bytes, sample: bytes, parse) -> int:
    """The field count of most of the rows of ``sample`` (whole lines from the file's
    first, ``first``), ties going to the count seen first. A headerless file has no line
    that says what its count is: line 1's was taken, and a malformed line 1 made every
    other line malformed (with skip_malformed, every good line skipped)."""
    n = pa.csv.read_csv(pa.BufferReader(first), parse_options=parse,
                        read_options=pa.csv.ReadOptions(autogenerate_column_names=True)).num_columns
    seen = {n: 0}  # count -> rows, in the order first seen

    def on_invalid(row):
        seen[row.actual_columns] = seen.get(row.actual_columns, 0) + 1
        return "skip"

    # Rows as _file_pieces reads them (a quoted value may run over a line end), but an
    # empty line counts for no field count: it is malformed whatever the count. Values
    # as bytes, one column converted: only the rows' field counts are wanted.
    names = [f"c{i}" for i in range(n)]
    table = pa.csv.read_csv(pa.BufferReader(sample),
                            parse_options=pa.csv.ParseOptions(delimiter=parse.delimiter, newlines_in_values=True,
                                                              ignore_empty_lines=True, invalid_row_handler=on_invalid),
                            read_options=pa.csv.ReadOptions(column_names=names, use_threads=False,
                                                            block_size=len(sample) + 1),
                            convert_options=pa.csv.ConvertOptions(include_columns=names[:1],
                                                                  column_types={names[0]: pa.binary()}))
    seen[n] += table.num_rows
    return max(seen, key=lambda k: seen[k])  # (max keeps the first of equal ones)


class _LineTooLong(Exception):
    """A line longer than the pyarrow blocks SchemaCsv reads a file in."""


# Blocks grow (4x a time) to this, for the longest line SchemaCsv reads.
_MAX_BLOCK_BYTES = 1 << 30


def _line_ends(pa, arr) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(the values that hold a line end, the line ends each holds: the lines it runs on
    over) of a binary column, or None when no value holds one (the usual case)."""
    offsets, data, _ = _binary_parts(pa, arr)
    lo, hi = int(offsets[0]), int(offsets[-1])
    if data[lo:hi].tobytes().find(b"\n") < 0:  # the usual case, one memchr (a comparison's array cost 5x)
        return None
    offsets = offsets.astype(np.int64)
    at = np.flatnonzero(data[lo:hi] == 10) + lo
    rows = np.searchsorted(offsets, at, side="right") - 1
    counts = np.bincount(rows, minlength=len(arr)).astype(np.int64)
    return counts > 0, counts


# --------------------------------------------------------------------------- Parquet

class SchemaParquet(_SchemaReader):
    """Batches from Parquet files laid out by ``schema`` (columns by name; other columns
    are not read). Errors name file, row group, row and column:
    ``day0.parquet: row group 2, row 70001: column 'price': 'abc' is not a number``.
    A file that is not Parquet, a missing column or one of a type the role cannot
    take raises DataError even with ``skip_malformed``."""

    def __init__(self, paths, schema, batch_size: int = 4096, *, rank: int = 0, world: int = 1,
                 drop_last: bool = False, skip_malformed: bool = False, read_rows: int = 65536):
        if isinstance(read_rows, bool) or not isinstance(read_rows, (int, np.integer)) or read_rows < 1:
            raise ValueError(f"read_rows must be a positive int, got {read_rows!r}")
        super().__init__(paths, schema, batch_size, rank=rank, world=world, drop_last=drop_last,
                         skip_malformed=skip_malformed)
        self.read_rows = int(read_rows)

    def _layout(self, path: str):
        with parquet_file(self._pa, path) as pf:
            names = pf.schema_arrow.names
        return self._resolve(names, path)

    def _resolve(self, names: list, path: str):
        """The schema's layout of a file of these columns. A repeated name the schema does
        not read is let be (as in a CSV header); one it reads (by "rest") is refused here,
        since pyarrow reads Parquet columns by name, and that name would give both."""
        layout = self.schema.resolve(list(names), path, by_name=True)
        for i in layout.read_columns():
            at = [j for j, name in enumerate(names) if name == names[i]]
            if len(at) > 1:
                raise DataError(f"{path}: column {names[i]!r} is at {len(at)} positions ({', '.join(map(str, at))}, "
                                f"0-based) and the schema reads it: Parquet columns are read by name; give "
                                f"data.schema.categorical as a list without it", path=path, field=names[i])
        return layout

    def _pieces(self) -> Iterator[_Piece]:
        pa = self._pa
        errors = parquet_errors(pa)
        for path in self.files:
            with parquet_file(pa, path) as pf:
                names = pf.schema_arrow.names
                layout = self._resolve(names, path)
                self._same_fields(layout, path)
                wanted = [names[i] for i in layout.read_columns()]
                row = 1
                for g in range(pf.num_row_groups):
                    batches = pf.iter_batches(batch_size=self.read_rows, row_groups=[g], columns=wanted)
                    while True:
                        try:
                            rb = next(batches, None)
                        except errors as e:
                            raise DataError(f"{path}: row group {g} (from row {row}): cannot read: {e}", path=path,
                                            line=row) from e
                        if rb is None:
                            break
                        n = rb.num_rows
                        lines = np.arange(row, row + n)
                        row += n
                        conv = _Converted(pa, lambda i, rb=rb: rb.column(names[i]), layout, self.schema, path)
                        keep = self._bad_rows(conv, layout, path, lines,
                                              lambda ln, g=g, path=path: f"{path}: row group {g}, row {ln}")
                        piece = conv.piece(path, lines, keep)
                        if len(piece):
                            yield piece
                if row == 1:  # (an export's part of no rows, as an empty TSV part)
                    _warn_empty(path, "no rows")


# --------------------------------------------------------------------------- libsvm / libFM

_LABELS = {b"0": 0.0, b"1": 1.0, b"-1": 0.0, b"+1": 1.0, b"0.0": 0.0, b"1.0": 1.0}


class Libsvm(_SchemaReader):
    """Batches from libsvm / libFM text: ``label idx:val idx:val ...`` (whitespace-separated).

    The schema's ``fields`` (field = [first, last] index, inclusive) group indices
    into fields; an index in none of them is an error (naming line and index).
    Without ``fields`` every index is one field, "features". Each field is a bag
    (``Batch.bags``) of its indices' keys (:func:`hps.data.value_keys` of the index's
    decimal text) weighted by their values; ``keys`` and ``dense`` have no columns.
    Labels: 0, 1, -1 (as 0) or +1. A feature is ``idx:val``, or libFFM's
    ``field:idx:val`` (its field left to ``fields``); a token of more colons is
    malformed. Errors: ``train.svm:5: '3:x': the value is not a number``. A ``#`` starts a comment; blank lines are skipped. Lines end at "\\n"
    ("\\r\\n" too), or at a lone "\\r" in a file whose first 64 KiB hold a "\\r" and
    no "\\n" (classic Mac OS line ends)."""

    def __init__(self, paths, schema=None, batch_size: int = 4096, *, rank: int = 0, world: int = 1,
                 drop_last: bool = False, skip_malformed: bool = False):
        super().__init__(paths, schema if schema is not None else Schema(), batch_size, rank=rank, world=world,
                         drop_last=drop_last, skip_malformed=skip_malformed)
        fields = self.schema.fields or {"features": [0, (1 << 63) - 1]}
        order = sorted((lo, hi, j) for j, (lo, hi) in enumerate(fields.values()))
        self.field_names = list(fields)
        self._lo = np.array([lo for lo, _, _ in order], np.int64)
        self._hi = np.array([hi for _, hi, _ in order], np.int64)
        self._field = np.array([j for _, _, j in order], np.int64)

    def widths(self) -> tuple[int, int, int]:
        return 0, 0, len(self.field_names)

    def widths_file(self) -> None:
        return None  # (the schema's fields, whatever the files hold)

    def fields(self) -> tuple:
        return None, [], [], [(name, "") for name in self.field_names]

    def _pieces(self) -> Iterator[_Piece]:
        pa = self._pa
        errors = _read_errors(pa)
        for path in self.files:
            try:
                stream = _open_stream(pa, path)
            except errors as e:
                raise DataError(f"{path}: cannot read: {e}", path=path) from e
            with stream:
                stream = _LfLineEnds(stream)
                pending = b""
                line = 1
                read_any = False
                while True:
                    try:
                        data = stream.read(1 << 20)
                    except errors as e:
                        raise DataError(f"{path}: cannot read at or after line {line}: {e}", path=path,
                                        line=line) from e
                    if not data:
                        break
                    read_any = True
                    buf = pending + data
                    cut = buf.rfind(b"\n")
                    if cut < 0:
                        pending = buf
                        continue
                    pending = buf[cut + 1:]
                    piece, n_lines = self._block(buf[:cut + 1], path, line)
                    line += n_lines
                    if len(piece):
                        yield piece
                if pending:
                    piece, _ = self._block(pending, path, line)
                    if len(piece):
                        yield piece
                if not read_any:
                    _warn_empty(path)

    def _block(self, block: bytes, path: str, first_line: int) -> tuple[_Piece, int]:
        """(rows, lines) of a block of whole lines, by the compiled line parser
        (hps.data._libsvm_lines); each bad line named by _parse_line, the reference."""
        data, starts, ends = _line_bounds(block)
        kind, labels, f_line, f_idx, f_val = _libsvm_lines.parse_lines(data, starts, ends)
        errors = []
        for i in np.flatnonzero(kind == _libsvm_lines.BAD):
            text = block[starts[i]:ends[i]].split(b"#", 1)[0].strip()
            parsed = self._parse_line_at(text)
            if not isinstance(parsed[0], str):
                raise RuntimeError(f"{path}:{first_line + i}: the compiled libsvm parser rejects a line that "
                                   f"_parse_line accepts (a bug in hps.data._libsvm_lines)")
            message, index = parsed
            ln = first_line + int(i)
            errors.append(DataError(f"{path}:{ln}: {message}", path=path, line=ln, field=self._field_of(index)))
        example = kind == _libsvm_lines.EXAMPLE
        row_of = np.cumsum(example) - 1  # a line's row among the block's examples
        piece = self._assemble(path, first_line + np.flatnonzero(example), labels[example], row_of[f_line],
                               f_idx, f_val, errors)
        return piece, len(starts)

    def _assemble(self, path: str, lines: np.ndarray, labels: np.ndarray, row: np.ndarray, idx: np.ndarray,
                  val: np.ndarray, errors: list) -> _Piece:
        """Rows from parsed lines: labels (n,), and each feature's row, index and value.
        ``errors``: those of the lines among these the line parser refused, raised or
        counted here in line order with those of indices in no field, so that the
        error raised is the lowest line's."""
        n = len(labels)
        where = np.searchsorted(self._lo, idx, side="right") - 1
        field = self._field[np.maximum(where, 0)]
        outside = (where < 0) | (idx > self._hi[np.maximum(where, 0)])
        bad_rows = np.unique(row[outside])  # indices in no field: the whole line is malformed
        for r in bad_rows:
            k = int(idx[outside & (row == r)][0])
            ln = int(lines[r])
            errors.append(DataError(f"{path}:{ln}: feature index {k} is in no field of data.schema.fields",
                                    path=path, line=ln, field=str(k)))
        for error in sorted(errors, key=lambda e: e.line):
            self._bad(error)
        if len(bad_rows):
            keep_rows = np.ones(n, bool)
            keep_rows[bad_rows] = False
            new_row = np.cumsum(keep_rows) - 1
            sel = keep_rows[row]
            row, idx, val, field = new_row[row[sel]], idx[sel], val[sel], field[sel]
            lines, labels = lines[keep_rows], labels[keep_rows]
            n = len(labels)
        # One sort by (field, row), features of a row in file order, and one hash of
        # every index; each field's bag is then a slice (39 Criteo fields: a
        # numpy round per field was most of a block's time).
        n_fields = len(self.field_names)
        order = np.lexsort((row, field))
        row, idx, val, field = row[order], idx[order], val[order], field[order]
        hashes, _ = value_hashes(self._pa, self._pa.array(idx).cast(self._pa.string()))
        bounds = np.searchsorted(field, np.arange(n_fields + 1))
        offsets = np.zeros((n_fields, n + 1), np.int64)
        np.cumsum(np.bincount(field * n + row, minlength=n_fields * n).reshape(n_fields, n), axis=1,
                  out=offsets[:, 1:])
        bags = [Bags(_keys(_field_tag(f), hashes[bounds[f]:bounds[f + 1]], None), offsets[f],
                     val[bounds[f]:bounds[f + 1]]) for f in range(n_fields)]
        return _Piece(np.asarray(labels, np.float32), np.zeros((n, 0), np.float32), np.zeros((n, 0), np.uint64),
                      _sources_of(path, lines), bags)

    def _field_of(self, index: Optional[int]) -> Optional[str]:
        """The name of the field of data.schema.fields that holds feature index
        `index` ("features" without fields), or None (no index, or in no field)."""
        if index is None:
            return None
        at = int(np.searchsorted(self._lo, index, side="right")) - 1
        return self.field_names[self._field[at]] if at >= 0 and index <= self._hi[at] else None

    @staticmethod
    def _parse_line(text: bytes):
        """(label, indices, values) of a line, or the message of what is wrong."""
        parsed = Libsvm._parse_line_at(text)
        return parsed[0] if isinstance(parsed[0], str) else parsed

    @staticmethod
    def _parse_line_at(text: bytes):
        """_parse_line's, but what is wrong as (message, the bad token's index or None
        where it has none to read), for the error to name the index's field."""
        parts = text.split()
        if parts[0] not in _LABELS:
            return f"label {_shown(parts[0])} is not 0, 1, -1 or +1", None
        idx, val = [], []
        for p in parts[1:]:
            k, colon, v = p.rpartition(b":")
            if not colon:
                return f"{_shown(p)} is not index:value", None
            if b":" in k:  # libFFM's field:index:value: the field is the schema's to say
                field, _, k = k.rpartition(b":")
                if b":" in field:  # (not the index between the last two colons, the rest dropped)
                    return f"{_shown(p)} is not index:value or field:index:value", None
            if not _UINT_RE.fullmatch(k):
                return f"{_shown(p)}: the index is not a non-negative integer", None
            index = int(k) if int(k) < 1 << 63 else None  # (past int64: in no field)
            try:
                x = float(v)
            except ValueError:
                return f"{_shown(p)}: the value is not a number", index
            if not np.isfinite(x):
                return f"{_shown(p)}: the value is not finite", index
            if abs(x) >= FLOAT32_OVERFLOW:  # stored as float32, where it would be inf
                return f"{_shown(p)}: the value is past float32's range (+-3.4028235e38)", index
            if index is None:
                return f"{_shown(p)}: the index is past 2**63 - 1", None
            idx.append(int(k))
            val.append(x)
        return _LABELS[parts[0]], idx, val


_UINT_RE = re.compile(rb"[0-9]+")

_PARQUET = (".parquet", ".pq")
_LIBSVM = (".svm", ".libsvm", ".libfm", ".ffm")


def _kind(path: str) -> str:
    """The format a file's name says: "parquet", "libsvm" or "csv" (a compression suffix looked through)."""
    name = _plain_name(os.path.basename(path))
    return "parquet" if name.endswith(_PARQUET) else "libsvm" if name.endswith(_LIBSVM) else "csv"


def open_schema(paths, schema, batch_size: int = 4096, *, format: Optional[str] = None, **options):
    """A reader of ``paths`` laid out by ``schema`` (a Schema or a ``[data.schema]`` dict).

    ``format``: "csv" (any delimited text, TSV too: the delimiter is the schema's, or
    by the file's name), "tsv" (text whose delimiter is a tab unless the schema gives
    one), "parquet" or "libsvm"; by default from the names (.parquet/.pq;
    .svm/.libsvm/.libfm/.ffm; else text; a compression suffix is looked through); a
    mix is an error.
    """
    if not isinstance(schema, Schema):
        schema = Schema.from_dict(schema)
    if format is None:
        files = list_files(paths)
        kinds = sorted({_kind(f) for f in files})
        if len(kinds) > 1:
            raise ValueError(f"{paths!r} mixes {' and '.join(kinds)} files; give one kind, or format=")
        format, paths = kinds[0], files
    if format == "tsv" and schema.delimiter is None:  # (not a comma for a name that is not .tsv)
        schema = dataclasses.replace(schema, delimiter="\t")
    if format in ("csv", "tsv", "text"):
        return SchemaCsv(paths, schema, batch_size, **options)
    if format == "parquet":
        return SchemaParquet(paths, schema, batch_size, **options)
    if format in ("libsvm", "libfm"):
        return Libsvm(paths, schema, batch_size, **options)
    raise ValueError(f"format must be 'csv', 'parquet' or 'libsvm' with a schema, got {format!r}")
