"""A declared schema for data of any columns (``[data.schema]``), and the key of any categorical value.

The Criteo readers know one layout (label, I1..I13, C1..C26). :class:`Schema`
says which columns of a user's file are the label, the dense features, the
categorical (single-hot) fields and the multi-hot fields, by name (files with
a header, Parquet) or by 0-based position (text without a header)::

    [data.schema]
    label = "click"
    dense = ["price", "age"]
    categorical = "rest"          # or a list; "rest": every column not named elsewhere
    multi_hot = { tags = "|" }    # a separator inside a text field ("" for a Parquet list column)
    skip = ["id"]
    header = true                 # text files
    delimiter = ","               # text files; default: tab for .tsv, else a comma

A categorical value is any byte string, hashed from its bytes with its field
(:func:`value_keys`), never required to be hexadecimal; an empty value is a
missing one (:func:`hps.data.missing_key` of the field). Fields are numbered in
the model's order: the categorical fields 0..k-1 in their schema order (for
"rest", in file order), then the multi-hot fields k..k+m-1; for libsvm text the
fields of ``fields`` in their order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from hps.data.files import DataError
from hps.data.keys import _field_tag, _keys, _splitmix64

Column = Union[str, int]

_DENSE_TRANSFORMS = ("log", "none")


def _column_list(value, name: str, source: str) -> list:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{source}: {name} must be a list of column names or positions, got {value!r}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (str, int)) or (isinstance(v, int) and v < 0) or v == "":
            raise ValueError(f"{source}: {name}: {v!r} is not a column name or a 0-based position")
    return list(value)


@dataclass
class Schema:
    """Which columns are what; ``[data.schema]`` (the module's docstring gives the form)."""

    label: Column = "label"
    dense: list = field(default_factory=list)
    categorical: Union[list, str] = field(default_factory=list)   # or "rest"
    multi_hot: dict = field(default_factory=dict)                 # column -> separator ("" for list columns)
    skip: list = field(default_factory=list)
    header: bool = True
    delimiter: Optional[str] = None
    dense_transform: str = "log"      # "log": log(1 + max(x, 0)) as for Criteo's counts; "none": as read
    fields: dict = field(default_factory=dict)  # libsvm: field -> [first, last] feature index (inclusive)

    @classmethod
    def from_dict(cls, d: dict, source: str = "[data.schema]") -> "Schema":
        """A checked Schema; errors name ``source`` and the field (``source: data.schema.dense: ...``)."""
        from hps.config import check_fields
        if isinstance(d, Schema):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"{source}: data.schema must be a table, got {d!r}")
        check_fields(cls, d, source, prefix="data.schema.")
        s = cls(**d)
        s.check(source)
        return s

    def check(self, source: str = "[data.schema]") -> None:
        p = "data.schema."
        if isinstance(self.label, bool) or not isinstance(self.label, (str, int)) or self.label == "" or \
                (isinstance(self.label, int) and self.label < 0):
            raise ValueError(f"{source}: {p}label must be a column name or a 0-based position, got {self.label!r}")
        self.dense = _column_list(self.dense, p + "dense", source)
        self.skip = _column_list(self.skip, p + "skip", source)
        if isinstance(self.categorical, str):
            if self.categorical != "rest":
                raise ValueError(f"{source}: {p}categorical must be a list or \"rest\", got {self.categorical!r}")
        else:
            self.categorical = _column_list(self.categorical, p + "categorical", source)
        if not isinstance(self.multi_hot, dict):
            raise ValueError(f"{source}: {p}multi_hot must be a table of column = separator, got {self.multi_hot!r}")
        for k, sep in self.multi_hot.items():
            if not isinstance(sep, str):
                raise ValueError(f"{source}: {p}multi_hot.{k}: the separator must be a string, got {sep!r}")
        if not isinstance(self.header, bool):
            raise ValueError(f"{source}: {p}header must be true or false, got {self.header!r}")
        if self.delimiter is not None and (not isinstance(self.delimiter, str) or len(self.delimiter) != 1):
            raise ValueError(f"{source}: {p}delimiter must be one character, got {self.delimiter!r}")
        if self.dense_transform not in _DENSE_TRANSFORMS:
            raise ValueError(f"{source}: {p}dense_transform must be one of {', '.join(_DENSE_TRANSFORMS)}, "
                             f"got {self.dense_transform!r}")
        seen: dict = {}
        named = [("label", self.label)] + [("dense", c) for c in self.dense] + \
            [("multi_hot", _column_key(c)) for c in self.multi_hot] + [("skip", c) for c in self.skip]
        if isinstance(self.categorical, list):
            named += [("categorical", c) for c in self.categorical]
        for role, c in named:
            if c in seen:
                raise ValueError(f"{source}: column {c!r} is in both {p}{seen[c]} and {p}{role}")
            seen[c] = role
        if not self.header and any(isinstance(c, str) for _, c in named):
            bad = next(c for _, c in named if isinstance(c, str))
            raise ValueError(f"{source}: {p}header = false: columns are 0-based positions, got the name {bad!r}")
        if not isinstance(self.fields, dict):
            raise ValueError(f"{source}: {p}fields must be a table of field = [first, last], got {self.fields!r}")
        ranges = []
        for k, r in self.fields.items():
            if (not isinstance(r, (list, tuple)) or len(r) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                                       for x in r) or not 0 <= r[0] <= r[1]):
                raise ValueError(f"{source}: {p}fields.{k} must be [first, last] feature indices with "
                                 f"0 <= first <= last, got {r!r}")
            ranges.append((r[0], r[1], k))
        ranges.sort()
        for (_, hi, a), (lo, _, b) in zip(ranges, ranges[1:]):
            if lo <= hi:
                raise ValueError(f"{source}: {p}fields.{a} and {p}fields.{b} overlap at index {lo}")

    def resolve(self, columns: list[str], path: str, by_name: bool) -> "Layout":
        """The layout of a file with these columns (header names, Parquet names, or
        generated ones when ``by_name`` is false and the schema gives positions). A name may
        repeat where the schema does not name it (a CSV header ending in ",," gives two empty
        names; "rest" takes such columns by position); a name the schema gives that
        repeats is refused: which column it means is ambiguous."""

        def find(c: Column) -> int:
            if isinstance(c, int):
                if c >= len(columns):
                    raise DataError(f"{path}: column {c} is past the file's {len(columns)} columns "
                                    f"(positions are 0-based)", path=path, field=str(c))
                return c
            if not by_name:
                raise DataError(f"{path}: the schema names column {c!r}, but the file has no header",
                                path=path, field=c)
            if c not in columns:
                shown = ", ".join(columns[:20]) + (", ..." if len(columns) > 20 else "")
                raise DataError(f"{path}: no column {c!r} (the file's columns: {shown})", path=path, field=c)
            at = [i for i, name in enumerate(columns) if name == c]
            if len(at) > 1:
                raise DataError(f"{path}: the schema names column {c!r}, which the file has {len(at)} times (at "
                                f"positions {', '.join(map(str, at))}, 0-based): which one is meant is ambiguous",
                                path=path, field=c)
            return at[0]

        label = find(self.label)
        dense = [find(c) for c in self.dense]
        multi = [(find(_column_key(c)), sep) for c, sep in self.multi_hot.items()]
        skip = [find(c) for c in self.skip]
        if self.categorical == "rest":
            used = {label, *dense, *skip, *(i for i, _ in multi)}
            cats = [i for i in range(len(columns)) if i not in used]
        else:
            cats = [find(c) for c in self.categorical]
        every = [label, *dense, *cats, *(i for i, _ in multi), *skip]
        for i in every:
            if every.count(i) > 1:
                raise DataError(f"{path}: column {columns[i]!r} (position {i}) has two roles in the schema",
                                path=path, field=columns[i])
        return Layout(columns, label, dense, cats, multi)


def _column_key(c):
    """A multi_hot table's key (always a string in TOML) as a column: digits are a position."""
    return int(c) if isinstance(c, str) and c.isdigit() else c


@dataclass(frozen=True)
class Layout:
    """A schema applied to one file: positions of its columns by role."""

    columns: list
    label: int
    dense: list
    categorical: list
    multi_hot: list  # (position, separator)

    def names(self) -> tuple:
        """The roles' column names: what every file of a data set must agree on."""
        c = self.columns
        return (c[self.label], [c[i] for i in self.dense], [c[i] for i in self.categorical],
                [(c[i], s) for i, s in self.multi_hot])

    def read_columns(self) -> list[int]:
        return sorted({self.label, *self.dense, *self.categorical, *(i for i, _ in self.multi_hot)})


# --------------------------------------------------------------------------- value keys

# DO NOT CHANGE: keys are stored in checkpoints and SSD-PS files.
# A categorical value's bytes b (UTF-8 for text) become a 64-bit word h:
#   h = len(b); for each 8-byte little-endian word w of b (the last padded with
#   zero bytes): h = splitmix64(h ^ w)
# and its key is hps.data.keys' key of (field, h): splitmix64(((field + 1) << 32) ^ h).
# Unlike Criteo's 32-bit hex values, h spans 64 bits, so two values share a key
# with probability 2**-64 a pair (a hash, not a bijection).

def _hash_strings(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """h (above) of each string of an arrow-style (offsets, data) pair, vectorised over strings.

    Round k mixes in the k-th word of the strings that have one, and only those, so
    the work is the data's words, not (strings x the longest string's words)
    (one 20 kB value among 20,000 short ones had taken 160 times as long)."""
    offsets = offsets.astype(np.int64)
    lengths = np.diff(offsets)
    n = len(lengths)
    h = lengths.astype(np.uint64)
    if n == 0:
        return h
    words = (lengths + 7) // 8
    data = data if len(data) else np.zeros(1, np.uint8)
    rounds = int(words.max(initial=0))
    # Few rounds (ids, short names: the usual column): each takes the strings that have
    # its word by a mask, all of them when every string does. Many (a long value among
    # short ones): the strings ordered longest first once, so that each round's are a
    # prefix of that order (the sort costs more than a few masks).
    ordered = rounds > 4
    if ordered:
        order = np.argsort(-words, kind="stable")
        # have[k]: how many strings have a k-th word (the first have[k] of `order`)
        have = n - np.searchsorted(np.sort(words), np.arange(rounds), side="right")
        sorted_starts, sorted_lens = offsets[:-1][order], lengths[order]
    shortest = int(words.min(initial=0))
    lane = np.arange(8)
    for k in range(rounds):
        if ordered:
            rows = order[:int(have[k])]
            starts, lens = sorted_starts[:len(rows)], sorted_lens[:len(rows)]
        elif k < shortest:  # every string has a k-th word
            rows, starts, lens = None, offsets[:-1], lengths
        else:
            rows = np.flatnonzero(words > k)
            starts, lens = offsets[:-1][rows], lengths[rows]
        pos = 8 * k + lane
        inside = pos < lens[:, None]
        idx = np.minimum(starts[:, None] + pos, len(data) - 1)
        b = np.where(inside, data[idx], 0).astype(np.uint8)
        w = np.ascontiguousarray(b).view("<u8").reshape(len(lens)).astype(np.uint64)
        if rows is None:
            h = _splitmix64(h ^ w)
        else:
            h[rows] = _splitmix64(h[rows] ^ w)
    return h


def _binary_parts(pa, arr):
    """(offsets, data bytes, null mask or None) of a binary/string array (large or not)."""
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    _, off_buf, data_buf = arr.buffers()[:3]
    off_type = np.dtype(np.int64 if large else np.int32)
    offsets = np.frombuffer(off_buf, off_type, count=len(arr) + 1, offset=arr.offset * off_type.itemsize)
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None and data_buf.size else np.zeros(0, np.uint8)
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
    return offsets, data, nulls


def _as_binary(pa, arr):
    """A categorical arrow array as binary values: strings as their bytes, integers and
    booleans as their text (so 123 in Parquet and "123" in a CSV give one key)."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.dictionary_decode(), t.value_type
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return arr
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_null(t):  # (null: missing values alone)
        return arr.cast(pa.string())
    return None


def value_hashes(pa, arr) -> tuple[np.ndarray, np.ndarray]:
    """(h uint64, missing bool) of a categorical arrow array; empty and null values are missing.
    Each distinct value is hashed once (the column is dictionary-encoded first)."""
    enc = pa.compute.dictionary_encode(arr)
    dictionary = enc.dictionary
    offsets, data, _ = _binary_parts(pa, dictionary)
    h_dict = _hash_strings(offsets, data)
    empty_dict = np.diff(offsets.astype(np.int64)) == 0
    idx_arr = enc.indices
    missing = idx_arr.is_null().to_numpy(zero_copy_only=False) if idx_arr.null_count else np.zeros(len(arr), bool)
    idx = pa.compute.fill_null(idx_arr, 0).to_numpy().astype(np.int64) if len(arr) else np.zeros(0, np.int64)
    if len(dictionary) == 0:
        return np.zeros(len(arr), np.uint64), np.ones(len(arr), bool)
    return h_dict[idx], missing | empty_dict[idx]


def value_keys(field_index: int, values) -> np.ndarray:
    """Keys of categorical ``values`` (str or bytes, any content) of field ``field_index``,
    as the schema readers make them; "" and None are missing (:func:`hps.data.missing_key`).

    >>> from hps.data import missing_key
    >>> k = value_keys(3, ["ios", "-1", ""])
    >>> int(k[2]) == missing_key(3), len(set(k.tolist()))
    (True, 3)
    """
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401
    vals = [v.encode() if isinstance(v, str) else v for v in values]
    h, missing = value_hashes(pa, pa.array(vals, pa.binary()))
    return _keys(_field_tag(field_index), h, missing)


def field_keys(pa, field_index: int, arr) -> np.ndarray:
    """Keys of a categorical arrow array of field ``field_index``."""
    h, missing = value_hashes(pa, arr)
    return _keys(_field_tag(field_index), h, missing)

