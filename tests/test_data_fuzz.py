"""Fuzzing hps.data's Criteo readers with malformed input (hypothesis).

A reference written here, independently of hps/data.py, from the documented
format (CriteoTsv's and CriteoParquet's docstrings, the key formula in
data.py) decides for every line (Parquet row) whether it is valid and, if it
is, what it holds. The readers must agree with it exactly: a valid line gives
the reference's label, dense values and keys at its own line number; a
malformed one raises DataError naming file, line and field, or with
skip_malformed=True is skipped and counted while every other line's row stays
as it was. Never another exception type, a hang, or a key made from a value
that wrapped, was cut at a NUL or moved by a field.
"""
import gzip
import random
import warnings

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from hps.data import (CATEGORICAL_COLUMNS, COLUMNS, DENSE_COLUMNS, CriteoParquet, CriteoTsv, DataError,  # noqa: E402
                      EmptyFileWarning)

# Fixed examples, no database: the same cases on every run and machine.
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None)
FEW = settings(FUZZ, max_examples=60)

# ------------------------------------------------------------------ the reference

M64 = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
DIGITS = frozenset(b"0123456789")
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_key(field: int, value) -> int:
    """key(field, value) = splitmix64(((field + 1) << 32) ^ value); a missing value
    (None) uses bit 63 as its value; the all-ones key becomes all-ones less one."""
    key = splitmix64(((field + 1) << 32) ^ ((1 << 63) if value is None else value))
    return M64 - 1 if key == M64 else key


def ref_dense(x) -> float:
    """float32 log(1 + max(x, 0)) of a count (an int, or a float from Parquet)."""
    return float(np.float32(np.log1p(max(float(x), 0.0))))


def ref_int(v: bytes):
    """The integer spelled by -?[0-9]+, else None."""
    digits = v[1:] if v.startswith(b"-") else v
    if not digits or not set(digits) <= DIGITS:
        return None
    return int(digits.decode("ascii")) * (-1 if v.startswith(b"-") else 1)


def ref_tsv_line(line: bytes):
    """(row, None) of a valid line, row = (label, dense tuple, keys tuple); or (None, field)
    of a malformed one, field the first bad column, None when the field count is wrong."""
    fields = line.split(b"\t")
    if len(fields) != len(COLUMNS):
        return None, None
    label = ref_int(fields[0])
    if label not in (0, 1):
        return None, "label"
    dense = []
    for name, v in zip(DENSE_COLUMNS, fields[1:14], strict=True):
        x = 0 if v == b"" else ref_int(v)
        if x is None or not INT64_MIN <= x <= INT64_MAX:
            return None, name
        dense.append(ref_dense(x))
    keys = []
    for f, (name, v) in enumerate(zip(CATEGORICAL_COLUMNS, fields[14:], strict=True)):
        if v == b"":
            keys.append(ref_key(f, None))
        elif 1 <= len(v) <= 16 and set(v) <= HEX_DIGITS:
            keys.append(ref_key(f, int(v.decode("ascii"), 16)))
        else:
            return None, name
    return (float(label), tuple(dense), tuple(keys)), None


def ref_tsv_file(content: bytes):
    """[(line number, row or None, bad field)] of a file: lines end at "\\n", one "\\r" before
    it is part of the line end, the last line may lack its "\\n"; an empty file has no lines."""
    if not content:
        return []
    lines = content.split(b"\n")
    if content.endswith(b"\n"):
        lines.pop()
    out = []
    for n, text in enumerate(lines, 1):
        row, field = ref_tsv_line(text[:-1] if text.endswith(b"\r") else text)
        out.append((n, row, field))
    return out


# ------------------------------------------------------------------ checking a reader

def read_all(reader, path, empty=None):
    """(rows, line numbers) of one pass, rows as the reference writes them. ``empty``:
    whether the file warns that it holds no data (EmptyFileWarning; None: either)."""
    rows, lines = [], []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for b in reader:
            assert b.labels.dtype == np.float32 and b.dense.dtype == np.float32 and b.keys.dtype == np.uint64
            for i in range(len(b)):
                rows.append((float(b.labels[i]), tuple(b.dense[i].tolist()), tuple(b.keys[i].tolist())))
                where, n = b.locate(i)
                assert where == path
                lines.append(n)
    assert all(issubclass(w.category, EmptyFileWarning) for w in warned), [str(w.message) for w in warned]
    if empty is not None:
        assert len(warned) == int(empty), (empty, [str(w.message) for w in warned])
    return rows, lines


def where(path, line, field, parquet=False):
    """The start of the message of a DataError at (line, field)."""
    at = f"{path}: row {line}: " if parquet else f"{path}:{line}: "
    return at + (f"field {field}: " if field else "")


def assert_names(error, path, line, field, parquet=False):
    assert isinstance(error, DataError) and isinstance(error, ValueError)
    assert (error.path, error.line, error.field) == (path, line, field), str(error)
    assert str(error).startswith(where(path, line, field, parquet)), str(error)


def check_reader(make, path, expected, parquet=False):
    """Reads `path` with make(skip_malformed) in both modes against expected
    [(line, row or None, bad field)]."""
    good = [(n, row) for n, row, _ in expected if row is not None]
    bad = [(n, field) for n, row, field in expected if row is None]
    want = ([row for _, row in good], [n for n, _ in good])
    empty = not expected  # a text file without a line, a Parquet file of no rows: no data
    if bad:
        with pytest.raises(DataError) as e:
            list(make(False))
        assert_names(e.value, path, *bad[0], parquet=parquet)
    else:
        assert read_all(make(False), path, empty) == want
    reader = make(True)
    assert read_all(reader, path, empty) == want
    assert reader.malformed == len(bad)
    assert reader.stats()["malformed"] == len(bad)
    assert len(reader.malformed_examples) == min(len(bad), 10)
    for message, (n, field) in zip(reader.malformed_examples, bad, strict=False):
        assert message.startswith(where(path, n, field, parquet)), message


# ------------------------------------------------------------------ TSV strategies

# Valid lines are built by a random.Random seeded from one draw: forty
# hypothesis draws a line cost more than reading the lines.
LABELS = [b"0", b"1", b"00", b"01", b"-0", b"001"]
DENSE_SPECIAL = [b"0007", b"-0", b"9223372036854775807", b"-9223372036854775808", b"-09"]


def valid_dense(rnd) -> bytes:
    kind = rnd.randrange(8)
    if kind == 0:
        return b""
    if kind == 1:
        return rnd.choice(DENSE_SPECIAL)
    if kind == 2:
        return str(rnd.randint(INT64_MIN, INT64_MAX)).encode()
    return str(rnd.randint(-5, 1 << 20)).encode()


def valid_hex(rnd) -> bytes:
    kind = rnd.randrange(8)
    if kind == 0:
        return b""
    if kind == 1:
        return "".join(rnd.choices("0123456789abcdefABCDEF", k=rnd.randint(1, 16))).encode()
    return b"%08x" % rnd.getrandbits(32)


def valid_line(rnd) -> bytes:
    return b"\t".join([rnd.choice(LABELS)] + [valid_dense(rnd) for _ in DENSE_COLUMNS] +
                      [valid_hex(rnd) for _ in CATEGORICAL_COLUMNS])


def valid_lines(min_size=0, max_size=6):
    return st.builds(lambda n, seed: [valid_line(random.Random(seed + i)) for i in range(n)],
                     st.integers(min_size, max_size), st.integers(0, 1 << 32))


HEX = st.builds(lambda seed: valid_hex(random.Random(seed)), st.integers(0, 1 << 32))
DENSE = st.builds(lambda seed: valid_dense(random.Random(seed)), st.integers(0, 1 << 32))
# block_bytes 1: every line a block of its own; 1 MiB: the whole file one block.
BLOCK_BYTES = st.sampled_from([1, 700, 1 << 20])

# Values that a lax parser would take, or take wrongly.
NASTY = [
    b"99999999999999999999", b"18446744073709551616", b"9223372036854775808", b"-9223372036854775809",
    b"340282366920938463463374607431768211457", b"1e400", b"1e5", b"1.5", b"1,5", b"1_0", b"nan", b"NaN",
    b"inf", b"-inf", b"Infinity", b"+5", b"+1", b" 5", b"5 ", b"\x0b5", b"\x0c", b"\x005", b"5\x00", b"\x00",
    b"0x5", b"0X1f", b"2", b"-1", b"-", b"--1", b"\xef\xbb\xbf1", b"\xff\xfe", b"\xc3\xa9", "\u0661".encode(),
    b'"1"', b"'0'", b"\r", b"1\r", b"\r1", b"fffffffffffffffff", b"00000000000000000", b"g", b"68fd1e6\x00",
    b"68FD1E64", b"true", b"",
]
NASTY_VALUE = st.one_of(st.sampled_from(NASTY), st.binary(max_size=4))
JUNK = st.one_of(st.sampled_from([b"\t", b"\r", b"\n", b"\r\n", b"\x00", b" ", b"\xef\xbb\xbf", b"\xff", b"x", b"-",
                                  b"+", b".", b"e", b"\t\t"]), st.binary(min_size=1, max_size=3))


def mutate(data, line: bytes) -> bytes:
    """One malformation of a valid line (it may happen to leave the line valid)."""
    kind = data.draw(st.sampled_from(["truncate", "delete", "insert", "replace", "extra", "drop", "trailing",
                                      "blank", "bom"]))
    fields = line.split(b"\t")
    j = data.draw(st.integers(0, len(fields) - 1))
    if kind == "truncate":
        return line[:data.draw(st.integers(0, len(line) - 1))]
    if kind == "delete":
        i = data.draw(st.integers(0, len(line) - 1))
        return line[:i] + line[i + data.draw(st.integers(1, 20)):]
    if kind == "insert":
        i = data.draw(st.integers(0, len(line)))
        return line[:i] + data.draw(JUNK) + line[i:]
    if kind == "replace":
        fields[j] = data.draw(NASTY_VALUE)
    elif kind == "extra":  # the fields after it move by one
        fields.insert(j, data.draw(st.one_of(NASTY_VALUE, HEX, DENSE)))
    elif kind == "drop":
        del fields[j]
    elif kind == "trailing":
        return line + data.draw(st.sampled_from([b"\t", b"\t\t", b"\r", b"\r\r", b" ", b"\x00"]))
    elif kind == "blank":
        return data.draw(st.sampled_from([b"", b" ", b"\t", b"\r", b"\x00", b"\t" * 39]))
    elif kind == "bom":
        return b"\xef\xbb\xbf" + line
    return b"\t".join(fields)


def file_of(lines, end: bytes, terminated: bool) -> bytes:
    return end.join(lines) + (end if terminated and lines else b"")


def write_tsv(directory, content: bytes, gz: bool) -> str:
    path = directory / ("fuzz.tsv.gz" if gz else "fuzz.tsv")
    path.write_bytes(gzip.compress(content, mtime=0) if gz else content)
    return str(path)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def tsv_reader(path, block_bytes):
    return lambda skip: CriteoTsv(path, batch_size=3, block_bytes=block_bytes, skip_malformed=skip)


L0 = b"\t".join([b"1"] + [b"5"] * 13 + [b"68fd1e64"] * 26)


# ------------------------------------------------------------------ TSV properties

@FUZZ
@given(lines=valid_lines(), end=st.sampled_from([b"\n", b"\r\n"]), terminated=st.booleans(),
       block_bytes=BLOCK_BYTES, gz=st.booleans())
def test_tsv_valid_lines_give_the_reference_keys(fuzz_dir, lines, end, terminated, block_bytes, gz):
    content = file_of(lines, end, terminated)
    expected = ref_tsv_file(content)
    assert all(row is not None for _, row, _ in expected)  # the strategy writes valid lines only
    assert len(expected) == len(lines)
    path = write_tsv(fuzz_dir, content, gz)
    check_reader(tsv_reader(path, block_bytes), path, expected)


@FUZZ
@given(lines=valid_lines(1, 5), end=st.sampled_from([b"\n", b"\r\n"]),
       terminated=st.booleans(), block_bytes=BLOCK_BYTES, gz=st.booleans(), data=st.data())
def test_tsv_mutated_lines_raise_or_are_skipped(fuzz_dir, lines, end, terminated, block_bytes, gz, data):
    lines = list(lines)
    for i in data.draw(st.sets(st.integers(0, len(lines) - 1), min_size=1, max_size=2)):
        lines[i] = mutate(data, lines[i])
    content = file_of(lines, end, terminated)
    path = write_tsv(fuzz_dir, content, gz)
    check_reader(tsv_reader(path, block_bytes), path, ref_tsv_file(content))


# A UTF-8 byte order mark at the start of a block: pyarrow.csv drops it, so the
# fast path read the line as valid while the per-line parser (and the same
# line in another block) rejected it; a file's first line always starts a block.
@pytest.mark.parametrize("block_bytes", [1, 1 << 20])
@pytest.mark.parametrize("at", [0, 1])
def test_tsv_byte_order_mark_is_rejected_wherever_it_is(fuzz_dir, block_bytes, at):
    lines = [L0, L0]
    lines[at] = b"\xef\xbb\xbf" + L0
    path = write_tsv(fuzz_dir, file_of(lines, b"\n", True), gz=False)
    with pytest.raises(DataError) as e:
        list(CriteoTsv(path, block_bytes=block_bytes))
    assert_names(e.value, path, at + 1, "label")
    assert str(e.value) == f"{path}:{at + 1}: field label: '\\ufeff1' is not 0 or 1"
    reader = CriteoTsv(path, block_bytes=block_bytes, skip_malformed=True)
    assert sum(len(b) for b in reader) == 1 and reader.malformed == 1


# ------------------------------------------------------------------ compressed TSV

def _gzip_errors_named(path, expected_rows_if_read):
    """Both modes: a DataError naming the file, or (a harmless change) the reference rows."""
    for skip in (False, True):
        try:
            got = read_all(CriteoTsv(path, batch_size=4, block_bytes=64, skip_malformed=skip), path)
        except DataError as e:  # the damage, or a line it garbled before the gzip CRC showed it
            assert e.path == path and str(e).startswith(f"{path}:{e.line}: "), str(e)
            assert e.line >= 1
        else:
            assert got == expected_rows_if_read


@FEW
def _damaged(data, packed: bytes, shortest: int, other) -> bytes:
    """packed truncated to at least `shortest` bytes, one byte flipped, or other()."""
    how = data.draw(st.sampled_from(["truncate", "flip", "other"]))
    if how == "truncate":
        return packed[:data.draw(st.integers(shortest, len(packed) - 1))]
    if how == "flip":
        i = data.draw(st.integers(0, len(packed) - 1))
        return packed[:i] + bytes([packed[i] ^ data.draw(st.integers(1, 255))]) + packed[i + 1:]
    return other()


@given(lines=valid_lines(1, 4), data=st.data())
@example(lines=[L0, L0], data=None).via("truncated gzip: EOFError")
def test_tsv_gz_damaged_raises_data_error(fuzz_dir, lines, data):
    content = file_of(lines, b"\n", True)
    packed = gzip.compress(content, mtime=0)
    if data is None:
        damaged = packed[:-12]
    else:
        damaged = _damaged(data, packed, shortest=1, other=lambda: packed + data.draw(st.binary(min_size=1, max_size=12)))
    path = fuzz_dir / "damaged.tsv.gz"
    path.write_bytes(damaged)
    _gzip_errors_named(str(path), ([row for _, row, _ in ref_tsv_file(content)], list(range(1, len(lines) + 1))))


@pytest.mark.parametrize("damage", ["truncated", "not gzip", "bad crc"])
def test_tsv_gz_damage_is_a_data_error_naming_the_line(fuzz_dir, damage):
    content = file_of([L0] * 200, b"\n", True)
    packed = gzip.compress(content, mtime=0)
    if damage == "truncated":  # was EOFError
        damaged = packed[:-12]
    elif damage == "not gzip":  # was gzip.BadGzipFile (an OSError)
        damaged = content
    else:  # was gzip.BadGzipFile too
        damaged = packed[:-8] + bytes([packed[-8] ^ 1]) + packed[-7:]
    path = fuzz_dir / f"{damage.replace(' ', '_')}.tsv.gz"
    path.write_bytes(damaged)
    reader = CriteoTsv(str(path), batch_size=50, block_bytes=len(L0) * 30, skip_malformed=True)
    seen = 0
    with pytest.raises(DataError) as e:
        for b in reader:
            seen += len(b)
    assert e.value.path == str(path) and e.value.field is None
    assert "compressed" in str(e.value)
    # Every line delivered came before the line named; at least the one named is lost.
    assert seen < e.value.line
    assert str(e.value).startswith(f"{path}:{e.value.line}: ")
    assert not isinstance(e.value.__cause__, DataError) and e.value.__cause__ is not None


# ------------------------------------------------------------------ Parquet

# A Parquet case is built by a random.Random seeded from one draw, as the TSV
# lines are: drawing each cell through hypothesis cost 40 ms a case.

def _int_type(bits, signed):
    return {(8, True): pa.int8(), (32, True): pa.int32(), (64, True): pa.int64(), (8, False): pa.uint8(),
            (32, False): pa.uint32(), (64, False): pa.uint64()}[bits, signed]


def _ints(rnd, n, bits, signed):
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return [rnd.choice([None, 0, 1, lo, hi, rnd.randint(lo, hi)]) for _ in range(n)]


def _float(rnd, width):
    """A float of the given width, the odd ones often."""
    x = rnd.choice([None, 0.0, -0.0, 1.0, 0.5, 2.0, float("nan"), float("inf"), float("-inf"), 1e300, -1e300, 5e-324,
                    rnd.uniform(-1e6, 1e6), rnd.lognormvariate(0, 20)])
    if width == 32 and x is not None:
        with np.errstate(over="ignore"):
            x = float(np.float32(x))  # 1e300 becomes inf, as a float32 column would hold it
    return x


def label_column(rnd, n):
    """(arrow array, [label or 'bad' per row]), or (array, 'type') for a type the reader must refuse."""
    kind = rnd.choice(["int8", "int64", "uint8", "float64", "float32", "bool", "string"])
    if kind == "string":
        return pa.array(["1"] * n, pa.string()), "type"
    if kind == "bool":
        values = [rnd.choice([None, True, False]) for _ in range(n)]
        return pa.array(values, pa.bool_()), ["bad" if v is None else float(v) for v in values]
    if kind.startswith("float"):
        width = 32 if kind == "float32" else 64
        values = [_float(rnd, width) for _ in range(n)]
        want = [float(v) if v is not None and v in (0.0, 1.0) else "bad" for v in values]
        return pa.array(values, pa.float32() if width == 32 else pa.float64()), want
    bits, signed = {"int8": (8, True), "int64": (64, True), "uint8": (8, False)}[kind]
    values = _ints(rnd, n, bits, signed)
    return pa.array(values, _int_type(bits, signed)), [float(v) if v in (0, 1) else "bad" for v in values]


def dense_column(rnd, n):
    kind = rnd.choice(["int32", "int64", "uint64", "float32", "float64", "string", "date"])
    if kind == "string":
        return pa.array(["5"] * n, pa.string()), "type"
    if kind == "date":
        return pa.array([0] * n, pa.date32()), "type"
    if kind.startswith("float"):
        width = 32 if kind == "float32" else 64
        values = [_float(rnd, width) for _ in range(n)]
        want = [0.0 if v is None or v != v else "bad" if v in (float("inf"), float("-inf")) else ref_dense(v)
                for v in values]
        return pa.array(values, pa.float32() if width == 32 else pa.float64()), want
    bits, signed = {"int32": (32, True), "int64": (64, True), "uint64": (64, False)}[kind]
    values = _ints(rnd, n, bits, signed)
    # past int64 (a uint64's top half) is an error, as in the TSV
    return pa.array(values, _int_type(bits, signed)), [0.0 if v is None else "bad" if v > INT64_MAX else ref_dense(v)
                                                       for v in values]


BAD_TEXT = ["0x1f", " 1", "1 ", "1" * 17, "0" * 17, "g", "\x00", "1\x00", "\u0661", "é", "68fd1e6\x00", "+1", "-1",
            "\ufeff1", "1\t2", "1\n", "nan"]


def _text(rnd):
    kind = rnd.randrange(6)
    if kind == 0:
        return rnd.choice([None, ""])
    if kind == 1:
        return rnd.choice(BAD_TEXT)
    if kind == 2:
        return "".join(chr(rnd.randrange(1, 0x3000)) for _ in range(rnd.randint(1, 4)))
    return "".join(rnd.choices("0123456789abcdefABCDEF", k=rnd.randint(1, 16)))


def categorical_column(rnd, n, field):
    kind = rnd.choice(["string", "large_string", "dictionary", "binary", "int8", "int32", "int64", "uint64",
                       "float64", "bool"])
    if kind == "float64":
        return pa.array([1.0] * n, pa.float64()), "type"
    if kind == "bool":
        return pa.array([True] * n, pa.bool_()), "type"
    if kind in ("string", "large_string", "dictionary", "binary"):
        values = [_text(rnd) for _ in range(n)]
        want = []
        for v in values:
            b = None if v is None else v.encode()
            if not b:
                want.append(ref_key(field, None))
            elif len(b) <= 16 and set(b) <= HEX_DIGITS:
                want.append(ref_key(field, int(v, 16)))
            else:
                want.append("bad")
        if kind == "binary":
            return pa.array([None if v is None else v.encode() for v in values], pa.binary()), want
        arr = pa.array(values, pa.large_string() if kind == "large_string" else pa.string())
        return (arr.dictionary_encode() if kind == "dictionary" else arr), want
    bits, signed = {"int8": (8, True), "int32": (32, True), "int64": (64, True), "uint64": (64, False)}[kind]
    values = _ints(rnd, n, bits, signed)
    return (pa.array(values, _int_type(bits, signed)),
            [ref_key(field, None if v is None else v % (1 << bits)) for v in values])


def parquet_case(seed):
    """(table, row group sizes, expected): expected is [(row, reference row or None, bad field)],
    or ('refuse', field) for a file the reader must refuse whole."""
    rnd = random.Random(seed)
    n = rnd.randint(0, 7)
    arrays, wants = {}, {}
    arrays["label"], wants["label"] = label_column(rnd, n)
    for name in DENSE_COLUMNS:
        arrays[name], wants[name] = dense_column(rnd, n) if rnd.randrange(4) == 0 else \
            (pa.array([7] * n, pa.int64()), [ref_dense(7)] * n)
    for f, name in enumerate(CATEGORICAL_COLUMNS):
        arrays[name], wants[name] = categorical_column(rnd, n, f) if rnd.randrange(4) == 0 else \
            (pa.array(["ab"] * n, pa.string()), [ref_key(f, 0xAB)] * n)
    absent = set(rnd.sample(COLUMNS, rnd.randint(1, 2))) if rnd.randrange(10) == 0 else set()
    names = [c for c in COLUMNS if c not in absent]
    if rnd.randrange(2):
        rnd.shuffle(names)
    if rnd.randrange(2):
        names.insert(rnd.randint(0, len(names)), "extra")
        arrays["extra"] = pa.array([None] * n, pa.null())
    table = pa.table({c: arrays[c] for c in names})
    groups = [rnd.randint(0, 3) for _ in range(rnd.randint(0, 4))]
    if absent:
        return table, groups, ("refuse", next(c for c in COLUMNS if c in absent))
    refused = [c for c in COLUMNS if wants[c] == "type"]
    if refused:
        return table, groups, ("refuse", refused[0])
    expected = []
    for r in range(n):
        bad = next((c for c in COLUMNS if wants[c][r] == "bad"), None)
        row = None if bad else (wants["label"][r], tuple(wants[c][r] for c in DENSE_COLUMNS),
                                tuple(wants[c][r] for c in CATEGORICAL_COLUMNS))
        expected.append((r + 1, row, bad))
    return table, groups, expected


def write_parquet(path, table, groups):
    """The table in row groups of the given sizes (0: an empty row group), the rest in one more."""
    with pq.ParquetWriter(path, table.schema) as w:
        at = 0
        for g in groups:
            w.write_table(table.slice(at, g), row_group_size=max(g, 1))
            at += min(g, max(len(table) - at, 0))
        if at < len(table) or not groups:
            w.write_table(table.slice(at))


@FUZZ
@given(seed=st.integers(0, 1 << 32), read_rows=st.sampled_from([1, 2, 3, 65536]))
def test_parquet_columns_and_rows_match_the_reference(fuzz_dir, seed, read_rows):
    table, groups, expected = parquet_case(seed)
    path = str(fuzz_dir / "fuzz.parquet")
    write_parquet(path, table, groups)

    def make(skip):
        return CriteoParquet(path, batch_size=3, read_rows=read_rows, skip_malformed=skip)

    if isinstance(expected, tuple):  # the file is refused whole, in both modes
        for skip in (False, True):
            with pytest.raises(DataError) as e:
                list(make(skip))
            assert e.value.path == path and e.value.field == expected[1] and e.value.line is None, str(e.value)
            assert str(e.value).startswith(f"{path}: ") and expected[1] in str(e.value)
    else:
        check_reader(make, path, expected, parquet=True)


def _valid_table(n=10):
    cols = {"label": pa.array([i % 2 for i in range(n)], pa.int8())}
    cols.update({c: pa.array(list(range(n)), pa.int64()) for c in DENSE_COLUMNS})
    cols.update({c: pa.array([format(i, "08x") for i in range(n)], pa.string()) for c in CATEGORICAL_COLUMNS})
    return pa.table(cols)


@FEW
@given(data=st.data())
@example(data=None).via("an empty file: ArrowInvalid")
def test_parquet_damaged_file_raises_data_error(fuzz_dir, data):
    good = fuzz_dir / "good.parquet"
    pq.write_table(_valid_table(), good, row_group_size=4)
    packed = good.read_bytes()
    if data is None:
        damaged = b""
    else:
        damaged = _damaged(data, packed, shortest=0, other=lambda: data.draw(st.binary(max_size=64)))
    path = fuzz_dir / "damaged.parquet"
    path.write_bytes(damaged)
    for skip in (False, True):
        try:
            rows = sum(len(b) for b in CriteoParquet(str(path), skip_malformed=skip))
        except DataError as e:
            assert e.path == str(path) and str(e).startswith(f"{path}: "), str(e)
        else:
            # A flip that Parquet cannot see (it has no checksum by default) may change
            # a value but neither the row count nor the reader's invariants.
            assert rows <= 10


@pytest.mark.parametrize("damage", ["empty", "truncated", "not parquet"])
def test_parquet_unreadable_file_is_a_data_error(fuzz_dir, damage):
    good = fuzz_dir / "whole.parquet"
    pq.write_table(_valid_table(), good)
    packed = good.read_bytes()
    path = fuzz_dir / f"{damage.replace(' ', '_')}.parquet"
    path.write_bytes({"empty": b"", "truncated": packed[:-20], "not parquet": b"label\tI1\n1\t2\n"}[damage])
    with pytest.raises(DataError) as e:  # was pyarrow.ArrowInvalid
        list(CriteoParquet(str(path), skip_malformed=True))
    assert e.value.path == str(path) and e.value.line is None and e.value.field is None
    assert str(e.value).startswith(f"{path}: not a readable Parquet file")


def test_parquet_column_name_that_is_not_utf8_is_a_data_error(fuzz_dir):
    # A damaged footer whose column name is not UTF-8: ParquetFile raised UnicodeDecodeError.
    path = fuzz_dir / "name.parquet"
    pq.write_table(_valid_table().append_column("zz\u00e9zz", pa.array([0] * 10, pa.int8())), path)
    packed = path.read_bytes()
    assert "zz\u00e9zz".encode() in packed  # the footer's schema and column chunks; the Arrow schema is base64
    path.write_bytes(packed.replace("zz\u00e9zz".encode(), b"zz\xff\xfezz"))
    with pytest.raises(DataError) as e:
        list(CriteoParquet(str(path)))
    assert e.value.path == str(path) and e.value.line is None and e.value.field is None
    assert str(e.value).startswith(f"{path}: not a readable Parquet file: ")


def test_parquet_damaged_row_group_is_named(fuzz_dir):
    table = _valid_table(40)
    path = fuzz_dir / "pages.parquet"
    pq.write_table(table, path, row_group_size=10, compression="snappy")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(2).column(COLUMNS.index("C26"))
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    packed = bytearray(path.read_bytes())
    # Overwrite the column chunk's bytes (page headers included) of row group 2.
    packed[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(packed))
    seen = 0
    with pytest.raises(DataError) as e:  # was OSError / ArrowInvalid from pyarrow
        for b in CriteoParquet(str(path), batch_size=5):
            seen += len(b)
    assert e.value.path == str(path) and e.value.line == 21
    assert str(e.value).startswith(f"{path}: row group 2 (rows 21-30): cannot read: ")
    assert seen == 20


@pytest.mark.parametrize("dictionary", [False, True])
def test_parquet_string_column_that_is_not_utf8_is_quoted_as_bytes(fuzz_dir, dictionary):
    # Parquet readers do not check string columns for UTF-8: quoting the bad
    # value in the message raised UnicodeDecodeError instead of the DataError.
    table = _valid_table(3)
    c7 = pa.array([b"1f", b"\xff\xfe", None], pa.binary()).view(pa.string())
    path = fuzz_dir / "latin.parquet"
    pq.write_table(table.set_column(COLUMNS.index("C7"), "C7", c7), path, use_dictionary=dictionary)
    reader = CriteoParquet(str(path), skip_malformed=True, **({"read_rows": 2} if dictionary else {}))
    assert [len(b) for b in reader] == [2]
    assert reader.malformed_examples == [f"{path}: row 2: field C7: b'\\xff\\xfe' is not a hexadecimal value "
                                         f"of 1 to 16 digits"]


def test_parquet_duplicate_column_is_a_data_error(fuzz_dir):
    path = fuzz_dir / "dup.parquet"
    pq.write_table(_valid_table().append_column("C3", pa.array(["1"] * 10)), path)
    with pytest.raises(DataError) as e:  # was KeyError from pyarrow
        list(CriteoParquet(str(path)))
    assert (e.value.path, e.value.line, e.value.field) == (str(path), None, "C3")
    assert str(e.value) == f"{path}: column C3 appears 2 times"


def test_parquet_wrong_column_type_without_rows_is_refused(fuzz_dir):
    # The column types are checked from the schema, so a file (or a first row
    # group) without rows is refused as a file with rows would be.
    path = fuzz_dir / "typed.parquet"
    pq.write_table(_valid_table(0).set_column(COLUMNS.index("C5"), "C5", pa.array([], pa.float64())), path)
    with pytest.raises(DataError) as e:
        list(CriteoParquet(str(path)))
    assert (e.value.path, e.value.line, e.value.field) == (str(path), None, "C5")
    assert str(e.value) == f"{path}: column C5 has type double, expected hex strings or integers"


def test_parquet_non_finite_dense_message(fuzz_dir):
    path = fuzz_dir / "inf.parquet"
    table = _valid_table(3)
    pq.write_table(table.set_column(COLUMNS.index("I2"), "I2", pa.array([1.5, float("-inf"), 2.0])), path)
    with pytest.raises(DataError) as e:
        list(CriteoParquet(str(path)))
    assert str(e.value) == f"{path}: row 2: field I2: -inf is not a finite number"


@pytest.mark.parametrize("read_rows", [0, -1, 1.5, True])
def test_parquet_read_rows_must_be_a_positive_int(fuzz_dir, read_rows):
    path = fuzz_dir / "ok.parquet"
    pq.write_table(_valid_table(), path)
    with pytest.raises(ValueError, match="read_rows must be a positive int"):  # 0 was an error mid-pass
        CriteoParquet(str(path), read_rows=read_rows)


# ------------------------------------------------------------------ the compiled line parser

_FIELD = st.one_of(
    st.just(b""), st.sampled_from([b"0", b"1", b"-0", b"00", b"01", b"-1", b"2", b"-", b"+1", b" 1", b"1\r"]),
    st.integers(INT64_MIN - 2, INT64_MAX + 2).map(lambda v: str(v).encode()),
    st.integers(0, 3).flatmap(lambda z: st.integers(-10**25, 10**25).map(
        lambda v: (b"-" if v < 0 else b"") + b"0" * z + str(abs(v)).encode())),
    st.text("0123456789abcdefABCDEFxg", min_size=1, max_size=18).map(str.encode),
    st.binary(max_size=6).filter(lambda b: b"\t" not in b and b"\n" not in b))
_LABEL = st.sampled_from([b"0", b"1", b"-0", b"00", b"01", b"001"])
_DENSE = st.one_of(st.just(b""), st.integers(0, 2).flatmap(lambda z: st.integers(INT64_MIN, INT64_MAX).map(
    lambda v: (b"-" if v < 0 else b"") + b"0" * z + str(abs(v)).encode())),
    st.sampled_from([str(INT64_MIN).encode(), str(INT64_MAX).encode(), str(INT64_MAX + 1).encode(),
                     str(INT64_MIN - 1).encode()]))
_HEX = st.one_of(st.just(b""), st.text("0123456789abcdefABCDEF", min_size=1, max_size=16).map(str.encode))


def _mutated(parts):
    label, dense, cats, edits = parts
    fields = [label] + dense + cats
    for at, value in edits:  # a field replaced, or (past the end) one more field
        if at < len(fields):
            fields[at] = value
        else:
            fields.append(value)
    return fields


@FUZZ
@given(st.lists(st.tuples(_LABEL, st.lists(_DENSE, min_size=13, max_size=13),
                          st.lists(_HEX, min_size=26, max_size=26),
                          st.lists(st.tuples(st.integers(0, 41), _FIELD), max_size=2)).map(_mutated),
                min_size=1, max_size=8))
def test_compiled_line_parser_agrees_with_parse_line(rows):
    from hps.data import criteo
    lines = [b"\t".join(fields) for fields in rows]
    block = b"\n".join(lines) + b"\n"
    data = np.frombuffer(block, np.uint8)
    ends = np.flatnonzero(data == 10).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    n = len(lines)
    labels, dense = np.empty(n), np.empty((n, 13))
    cats, absent, valid = np.empty((n, 26), np.uint64), np.empty((n, 26), np.uint8), np.empty(n, np.uint8)
    good = criteo._criteo_lines.parse_lines(data, starts, ends, labels, dense, cats, absent, valid)
    assert good == int(valid.sum())
    for i, line in enumerate(lines):
        ref = criteo._parse_line(line)
        ok = not (ref[0] is None or isinstance(ref[0], str))
        assert bool(valid[i]) == ok, (line, ref)
        if ok:
            assert labels[i] == ref[0]
            assert dense[i].tolist() == [float(x) for x in ref[1]]
            assert cats[i].tolist() == ref[2] and absent[i].astype(bool).tolist() == ref[3]


_SVM_LABEL = st.sampled_from([b"0", b"1", b"-1", b"+1", b"0.0", b"1.0", b"2", b"1.", b"-0", b"x", b"+0"])
_SVM_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(lambda x: repr(x).encode()),
    st.integers(-10**20, 10**20).map(lambda v: str(v).encode()),
    st.sampled_from([b"", b"1_0", b"1__0", b"_1", b"inf", b"-Infinity", b"nan", b"1e400", b"0x10", b".5", b"5.",
                     b"1e", b"+-1", b"1\x00", b"\xff", b"1:2"]))
_SVM_INDEX = st.one_of(st.integers(0, 2**64).map(lambda v: str(v).encode()),
                       st.sampled_from([b"", b"-1", b"1a", b"00012", b"9223372036854775807",
                                        b"9223372036854775808"]))
_SVM_TOKEN = st.one_of(
    st.tuples(_SVM_INDEX, _SVM_VALUE).map(lambda t: t[0] + b":" + t[1]),
    st.tuples(st.sampled_from([b"3", b"", b"a"]), _SVM_INDEX, _SVM_VALUE).map(lambda t: b":".join(t)),  # libFFM
    st.binary(min_size=1, max_size=5).filter(lambda b: not any(c in b for c in b" \t\n\r\x0b\x0c")))
_SVM_SPACE = st.sampled_from([b" ", b"\t", b"  ", b" \x0b", b"\x0c", b" \r"])


@FUZZ
@given(st.lists(st.tuples(_SVM_LABEL, st.lists(st.tuples(_SVM_SPACE, _SVM_TOKEN), max_size=5),
                          st.sampled_from([b"", b" ", b" # a comment", b"#x", b"\r"]),
                          st.booleans()), min_size=1, max_size=8))
@example([(b"0", [(b" ", b"0:0.0"), (b" ", b"0:3.4028235677973366e+38")], b"", False)])  # past float32's range
def test_compiled_libsvm_parser_agrees_with_parse_line(rows):
    from hps.data import Libsvm
    from hps.data import _libsvm_lines as m
    lines = []
    for label, tokens, tail, blank in rows:
        lines.append(tail if blank else label + b"".join(s + t for s, t in tokens) + tail)
    block = b"\n".join(lines) + b"\n"
    data = np.frombuffer(block, np.uint8)
    ends = np.flatnonzero(data == 10).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    kind, labels, f_line, f_idx, f_val = m.parse_lines(data, starts, ends)
    for i, line in enumerate(lines):
        text = line.split(b"#", 1)[0].strip()
        if not text:
            assert kind[i] == m.BLANK, line
            continue
        ref = Libsvm._parse_line(text)
        if isinstance(ref, str):
            assert kind[i] == m.BAD, (line, ref)
            continue
        assert kind[i] == m.EXAMPLE, (line, ref)
        label, idx, val = ref
        assert labels[i] == label
        mine = f_line == i
        assert f_idx[mine].tolist() == idx
        assert f_val[mine].tolist() == np.asarray(val, np.float32).tolist()
