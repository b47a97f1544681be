"""hps.data: key hashing, the TSV and Parquet readers, sharding, the synthetic generator."""
import contextlib
import doctest
import gzip
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import hps.data
from hps.data import (CATEGORICAL_COLUMNS, COLUMNS, DENSE_COLUMNS, SENTINEL_KEY, Batch, CriteoParquet,
                      CriteoTsv, DataError, Source, SyntheticCriteo, feature_keys, list_files, missing_key,
                      open_criteo, shard_files)

# The real Criteo rows, beside the repository (see SOURCE.md there).
SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo-sample" / "train_examples_10k.tsv"
SAMPLE_ROWS = 10_000
SAMPLE_POSITIVES = 2_182  # CTR 0.2182, SOURCE.md

needs_sample = pytest.mark.skipif(not SAMPLE.is_file(), reason=f"the Criteo sample is not at {SAMPLE}")

M64 = (1 << 64) - 1


def _mix_reference(x: int) -> int:
    """splitmix64 in plain Python integers: the documented key formula, written independently."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _unmix(z: int) -> int:
    """The inverse of _mix_reference: the 64-bit word that hashes to z."""
    def unxorshift(v, s):
        x = v
        for _ in range(64 // s + 1):
            x = v ^ (x >> s)
        return x & M64
    z = unxorshift(z, 31)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & M64
    z = unxorshift(z, 27)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & M64
    z = unxorshift(z, 30)
    return (z - 0x9E3779B97F4A7C15) & M64


def u64(values):
    return np.asarray(values, dtype=np.uint64)


def auc(labels, scores):
    """Area under the ROC curve, ties counted half (average ranks)."""
    labels = np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="stable")
    sorted_scores = np.asarray(scores)[order]
    _, start, count = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg_rank = np.repeat(start + (count + 1) / 2.0, count)
    ranks = np.empty(len(order))
    ranks[order] = avg_rank
    pos = labels.sum()
    neg = len(labels) - pos
    return (ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg)


def concat(batches):
    return (np.concatenate([b.labels for b in batches]), np.concatenate([b.dense for b in batches]),
            np.concatenate([b.keys for b in batches]))


def assert_same_rows(a, b):
    for x, y, name in zip(concat(a), concat(b), ("labels", "dense", "keys"), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=name)


# ------------------------------------------------------------------ keys

# Computed once from the formula in hps/data.py; they must never change (keys live in checkpoints).
FIXED_KEYS = [
    (0, 0x68FD1E64, 15268892257825698560),
    (0, 0, 14135772400868000056),
    (25, 0x9727DD16, 11731870180036248102),
    (12, 0xFFFFFFFF, 2853924094272115107),
    (1, M64, 8744455057184156162),
]


@pytest.mark.parametrize("field,value,key", FIXED_KEYS)
def test_feature_keys_fixed_values(field, value, key):
    assert feature_keys(field, u64([value])).tolist() == [key]
    assert _mix_reference(((field + 1) << 32) ^ value) == key
    if value < 1 << 64:
        assert feature_keys(field, [format(value, "x")]).tolist() == [key]


def test_missing_keys_fixed_and_per_field():
    assert missing_key(0) == 3325205089165959452
    assert missing_key(25) == 15145487430460569304
    assert missing_key(0) == _mix_reference((1 << 32) ^ (1 << 63))
    keys = feature_keys(4, ["", None, "a"], missing=[False, False, True])
    assert keys.tolist() == [missing_key(4)] * 3
    assert len({missing_key(f) for f in range(26)}) == 26


def test_feature_keys_inputs_agree():
    hexes = ["68fd1e64", "68FD1E64", b"68fd1e64"]
    ints = u64([0x68FD1E64] * 3)
    np.testing.assert_array_equal(feature_keys(3, hexes), feature_keys(3, ints))
    # Signed columns hold 32-bit hashes bitwise: int32 -1 is 0xffffffff.
    assert feature_keys(3, np.array([-1], np.int32)).tolist() == feature_keys(3, u64([0xFFFFFFFF])).tolist()
    grid = np.arange(12, dtype=np.uint64).reshape(3, 4)
    assert feature_keys(7, grid).shape == (3, 4)
    assert feature_keys(7, np.uint64(5)).shape == ()
    assert feature_keys(7, []).shape == (0,)


def test_keys_distinct_across_fields_and_values():
    values = np.arange(5000, dtype=np.uint64) * np.uint64(977)
    keys = np.concatenate([feature_keys(f, values) for f in range(26)] + [u64([missing_key(f) for f in range(26)])])
    assert len(np.unique(keys)) == len(keys)


@pytest.mark.parametrize("bad", [["xyz"], ["12345678901234567"], ["0x12"], [" 12"], [1.5]])
def test_feature_keys_rejects(bad):
    with pytest.raises((ValueError, TypeError)):
        feature_keys(0, bad)


def test_feature_keys_bad_field():
    with pytest.raises(ValueError, match="field"):
        feature_keys(-1, [1])
    with pytest.raises(TypeError):
        feature_keys(1.0, [1])


def test_no_sentinel_key_ever():
    # The single 64-bit word that hashes to the sentinel, fed in through field 0.
    pre = _unmix(SENTINEL_KEY)
    assert _mix_reference(pre) == SENTINEL_KEY
    value = pre ^ (1 << 32)
    key = feature_keys(0, u64([value, 1]))
    assert key[0] != SENTINEL_KEY
    assert key[0] == 0xFFFF_FFFF_FFFF_FFFE
    # Both pre-images (of the sentinel and of its replacement) lie outside
    # fields < 828_541_685 with 32-bit values, as the module documents.
    assert ((pre >> 32) - 1, pre & 0xFFFFFFFF) == (828_541_685, 0x7B2131AB)
    repl = _unmix(0xFFFF_FFFF_FFFF_FFFE)
    assert ((repl >> 32) - 1, repl & 0xFFFFFFFF) == (1_326_503_678, 0xA9921217)
    rng = np.random.default_rng(0)
    many = feature_keys(0, rng.integers(0, 1 << 64, 200_000, dtype=np.uint64, endpoint=False))
    assert not (many == np.uint64(SENTINEL_KEY)).any()


# ------------------------------------------------------------------ TSV: the real sample

@needs_sample
def test_tsv_sample():
    pytest.importorskip("pyarrow")
    reader = CriteoTsv(str(SAMPLE), batch_size=4096)
    batches = list(reader)
    assert [len(b) for b in batches] == [4096, 4096, 1808]
    labels, dense, keys = concat(batches)
    assert labels.dtype == np.float32 and dense.dtype == np.float32 and keys.dtype == np.uint64
    assert dense.shape == (SAMPLE_ROWS, 13) and keys.shape == (SAMPLE_ROWS, 26)
    assert labels.sum() == SAMPLE_POSITIVES
    assert labels.mean() == pytest.approx(0.2182)
    assert reader.examples_read == SAMPLE_ROWS and reader.malformed == 0
    assert reader.stats() == {"files": 1, "examples_read": SAMPLE_ROWS, "malformed": 0}
    assert not (keys == np.uint64(SENTINEL_KEY)).any()
    assert batches[1].sources == (Source(str(SAMPLE), 4097, 4096),)
    assert batches[2].locate(5) == (str(SAMPLE), 8198)

    # Rows checked field by field against a plain-Python reading of the line
    # (the first has an empty integer field, the third empty categoricals).
    lines = SAMPLE.read_text().splitlines()
    assert "" in lines[0].split("\t")[1:14] and "" in lines[2].split("\t")[14:]
    for row in (0, 2, 9999):
        fields = lines[row].split("\t")
        assert labels[row] == int(fields[0])
        raw = np.array([int(v) if v else 0 for v in fields[1:14]], dtype=np.float64)
        np.testing.assert_array_equal(dense[row], np.log1p(np.maximum(raw, 0)).astype(np.float32))
        expect = [missing_key(j) if not v else _mix_reference(((j + 1) << 32) ^ int(v, 16))
                  for j, v in enumerate(fields[14:])]
        assert keys[row].tolist() == expect


@needs_sample
def test_tsv_sample_small_blocks_and_drop_last():
    pytest.importorskip("pyarrow")
    whole = list(CriteoTsv(str(SAMPLE), batch_size=3000))
    small = list(CriteoTsv(str(SAMPLE), batch_size=3000, block_bytes=50_000, drop_last=True))
    assert [len(b) for b in small] == [3000, 3000, 3000]
    assert_same_rows(small, whole[:3])
    assert small[2].sources[0].first_line == 6001


@needs_sample
def test_tsv_slow_path_reads_what_the_fast_path_reads(tmp_path):
    pytest.importorskip("pyarrow")
    # One bad last line sends the file's only block through the per-line parser.
    bad = tmp_path / "sample_plus_bad.tsv"
    bad.write_bytes(SAMPLE.read_bytes() + b"1\tgarbage\n")
    reader = CriteoTsv(str(bad), batch_size=4096, skip_malformed=True, block_bytes=64 << 20)
    slow = list(reader)
    assert reader.malformed == 1
    assert reader.malformed_examples == [f"{bad}:10001: has 2 fields, expected 40"]
    assert_same_rows(slow, list(CriteoTsv(str(SAMPLE), batch_size=4096)))


# ------------------------------------------------------------------ TSV: malformed lines

HEXES = ["68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "7e0ccccf", "de7995b8", "1f89b562",
         "a73ee510", "a8cd5504", "b2cb9c98", "37c9c164", "2824a5f6", "1adce6ef", "8ba8b39a", "891b62e7",
         "e5ba7672", "f54016b9", "21ddcdc9", "b1252a9d", "07b5194c", "", "3a171ecb", "c5c50484", "e8b83407",
         "9727dd16"]
INTS = ["1", "1", "5", "0", "1382", "4", "15", "2", "181", "1", "2", "", "-2"]


def line(label="0", ints=INTS, hexes=HEXES, **change):
    fields = dict(zip(COLUMNS, [label] + list(ints) + list(hexes), strict=True))
    fields.update(change)
    return "\t".join(fields[c] for c in COLUMNS)


def write(path, lines, end="\n"):
    path.write_text("".join(x + end for x in lines))
    return str(path)


def test_valid_lines_parse(tmp_path):
    pytest.importorskip("pyarrow")
    path = write(tmp_path / "ok.tsv", [line(), line(label="1", I1="", C1="ABCDEF01", C2="1")])
    (batch,) = list(CriteoTsv(path, batch_size=10))
    assert batch.labels.tolist() == [0.0, 1.0]
    assert batch.dense[0, 12] == 0.0  # -2 clipped to 0 before log1p
    assert batch.dense[0, 4] == pytest.approx(np.log1p(1382))
    assert batch.dense[1, 0] == 0.0  # missing
    assert batch.keys[1, 0] == feature_keys(0, [0xABCDEF01])[0]
    assert batch.keys[1, 1] == feature_keys(1, [1])[0]
    assert batch.keys[0, 21] == missing_key(21)


def test_crlf_and_missing_final_newline(tmp_path):
    pytest.importorskip("pyarrow")
    lf = list(CriteoTsv(write(tmp_path / "lf.tsv", [line()] * 3), batch_size=10))
    crlf = list(CriteoTsv(write(tmp_path / "crlf.tsv", [line()] * 3, end="\r\n"), batch_size=10))
    (tmp_path / "open.tsv").write_text("\n".join([line()] * 3))
    unterminated = list(CriteoTsv(str(tmp_path / "open.tsv"), batch_size=10))
    assert_same_rows(lf, crlf)
    assert_same_rows(lf, unterminated)



@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_lone_cr_line_ends_read_as_lines(tmp_path, monkeypatch, compiled):
    # A file of classic Mac OS "\r" line ends has no "\n": it was one line of 118
    # fields, refused, or skipped as one malformed line with skip_malformed, so that
    # the file gave no example without a word (and was read whole to find its end).
    pytest.importorskip("pyarrow")
    from hps.data import criteo
    if not compiled:
        monkeypatch.setattr(criteo, "_criteo_lines", None)
    lines = [line(label=str(i % 2), I3=str(i)) for i in range(1, 41)]
    lf = list(CriteoTsv(write(tmp_path / "lf.tsv", lines), batch_size=100))
    mac = write(tmp_path / "mac.tsv", lines, end="\r")
    (tmp_path / "mac.tsv.gz").write_bytes(gzip.compress((tmp_path / "mac.tsv").read_bytes()))
    for path in (mac, str(tmp_path / "mac.tsv.gz")):
        for block_bytes in (4 << 20, 1000, 16):
            reader = CriteoTsv(path, batch_size=100, block_bytes=block_bytes, skip_malformed=True)
            batches = list(reader)
            assert reader.malformed == 0, (path, block_bytes)
            assert_same_rows(lf, batches)
            assert [b.locate(i)[1] for b in batches for i in range(len(b))] == list(range(1, 41))
    # Each "\r" ends one line: a bad value is named by its line.
    lines[6] = line(I5="abc")
    bad = write(tmp_path / "bad.tsv", lines, end="\r")
    for block_bytes in (4 << 20, 16):
        with pytest.raises(DataError, match=r"bad\.tsv:7: field I5: 'abc' is not an integer"):
            list(CriteoTsv(bad, batch_size=100, block_bytes=block_bytes))
    # A "\r" inside a line of a "\n" file still makes that line (line 1 too) malformed.
    (tmp_path / "stray.tsv").write_bytes(line(C3="ab\rcd").encode() + b"\n" + line().encode() + b"\n")
    with pytest.raises(DataError, match=r"stray\.tsv:1: field C3: 'ab\\rcd' is not a hexadecimal"):
        list(CriteoTsv(str(tmp_path / "stray.tsv"), batch_size=100))

MALFORMED = [
    (line()[:-9], "has 39 fields, expected 40", None),
    (line() + "\t", "has 41 fields, expected 40", None),
    ("", "is an empty line, expected 40 tab-separated fields", None),
    (line(I5="abc"), "field I5: 'abc' is not an integer", "I5"),
    (line(I1=" 5"), "field I1: ' 5' is not an integer", "I1"),  # pyarrow alone would accept these two
    (line(I13="0x5"), "field I13: '0x5' is not an integer", "I13"),
    (line(I2="1.5"), "field I2: '1.5' is not an integer", "I2"),
    (line(I3="99999999999999999999"), "field I3: '99999999999999999999' is out of the 64-bit integer range", "I3"),
    (line(label="2"), "field label: '2' is not 0 or 1", "label"),
    (line(label=""), "field label: '' is not 0 or 1", "label"),
    (line(C3="xyz12345"), "field C3: 'xyz12345' is not a hexadecimal value of 1 to 16 digits", "C3"),
    (line(C26="1" * 17), "field C26: '11111111111111111' is not a hexadecimal value of 1 to 16 digits", "C26"),
]


@pytest.mark.parametrize("bad,message,field", MALFORMED, ids=[m[1][:40] for m in MALFORMED])
def test_malformed_line_names_file_line_field(tmp_path, bad, message, field):
    pytest.importorskip("pyarrow")
    path = write(tmp_path / "train.tsv", [line(), line(label="1"), bad, line()])
    with pytest.raises(DataError) as e:
        list(CriteoTsv(path, batch_size=2))
    assert str(e.value) == f"{path}:3: {message}"
    assert (e.value.path, e.value.line, e.value.field) == (path, 3, field)
    assert isinstance(e.value, ValueError)


def test_malformed_line_number_in_a_later_block(tmp_path):
    pytest.importorskip("pyarrow")
    lines = [line()] * 500
    lines[400] = line(C7="nothex!")
    path = write(tmp_path / "big.tsv", lines)
    reader = CriteoTsv(path, batch_size=64, block_bytes=1000)
    seen = 0
    with pytest.raises(DataError, match=r"big\.tsv:401: field C7: 'nothex!' is not a hexadecimal"):
        for batch in reader:
            seen += len(batch)
    assert seen == 384  # the batches before the bad block's were delivered


def test_skip_malformed_counts_and_keeps_first_messages(tmp_path):
    pytest.importorskip("pyarrow")
    lines = [line(label=str(i % 2)) for i in range(300)]
    bad_at = [3, 50, 51, 120, 121, 122, 123, 124, 125, 126, 127, 128, 299]  # 0-based
    for i in bad_at:
        lines[i] = line(I4="x")
    path = write(tmp_path / "skip.tsv", lines)
    reader = CriteoTsv(path, batch_size=100, skip_malformed=True, block_bytes=2000)
    batches = list(reader)
    assert sum(len(b) for b in batches) == 300 - len(bad_at)
    assert reader.malformed == len(bad_at)
    assert len(reader.malformed_examples) == hps.data.MAX_MALFORMED_EXAMPLES
    assert reader.malformed_examples[:2] == [f"{path}:4: field I4: 'x' is not an integer",
                                             f"{path}:51: field I4: 'x' is not an integer"]
    # Rows keep their true line numbers around the holes.
    good = [i + 1 for i in range(300) if i not in bad_at]
    located = [b.locate(i)[1] for b in batches for i in range(len(b))]
    assert located == good
    labels = concat(batches)[0]
    np.testing.assert_array_equal(labels, [(n - 1) % 2 for n in good])
    # A second pass starts the count again.
    list(reader)
    assert reader.malformed == len(bad_at)


# A malformed line 30 after a bad value on line 9 (see the test below).
LATER_MALFORMED = {"short": ("1\t30", "has 2 fields, expected 40"),
                   "empty": ("", "is an empty line, expected 40 tab-separated fields"),
                   "long": (line(I1="0" * 3000 + "7") + "\tx", "has 41 fields, expected 40")}
# A bad value on line 9, with the line end of the file's lines.
EARLIER_BAD = {"label": (line(label="2"), "field label: '2' is not 0 or 1", "\n"),
               "int": (line(I5="abc"), "field I5: 'abc' is not an integer", "\r\n"),
               "lone-cr": (line(C3="ab\rcd"), "field C3: 'ab\\rcd' is not a hexadecimal value", "\n"),
               "space": (line(I2=" 5"), "field I2: ' 5' is not an integer", "\r\n")}


@pytest.mark.parametrize("later", LATER_MALFORMED)
@pytest.mark.parametrize("earlier", EARLIER_BAD)
def test_tsv_first_error_is_the_lowest_lines_at_any_block_and_batch_size(tmp_path, later, earlier):
    # As for SchemaCsv: with a bad value on line 9 and a malformed line 30, in one block
    # or not, line 9 is named first at every block and batch size (the kept
    # malformed_examples in line order too), and every line keeps its number past a
    # line longer than a block (line 5: 3,000 leading zeros), CRLF line ends and block
    # boundaries.
    pytest.importorskip("pyarrow")
    bad, message, end = EARLIER_BAD[earlier]
    lines = [line(label=str(i % 2), I3=str(i)) for i in range(1, 61)]
    lines[5 - 1] = line(label="1", I1="0" * 3000 + "5", I3="5")
    lines[9 - 1] = bad
    lines[30 - 1], later_message = LATER_MALFORMED[later]
    path = write(tmp_path / "order.tsv", lines, end=end)
    good = [n for n in range(1, 61) if n not in (9, 30)]
    for block_bytes in (4 << 20, 1000, 300, 16):
        for batch_size in (4096, 7):
            with pytest.raises(DataError) as e:
                list(CriteoTsv(path, batch_size, block_bytes=block_bytes))
            assert str(e.value).startswith(f"{path}:9: {message}"), (block_bytes, batch_size)
            assert e.value.line == 9
            reader = CriteoTsv(path, batch_size, block_bytes=block_bytes, skip_malformed=True)
            batches = list(reader)
            assert reader.malformed_examples[0].startswith(f"{path}:9: {message}"), (block_bytes, batch_size)
            assert reader.malformed_examples[1:] == [f"{path}:30: {later_message}"], (block_bytes, batch_size)
            assert [b.locate(i)[1] for b in batches for i in range(len(b))] == good, (block_bytes, batch_size)
            dense = np.concatenate([b.dense for b in batches])  # (a row's I3: its line)
            np.testing.assert_allclose(dense[:, 2], np.log1p(good).astype(np.float32), rtol=1e-6)


def _first_examples_and_what_was_said(reader, n):
    """(batch sizes of FirstExamples(reader, n), the malformed lines counted; or the error raised)."""
    try:
        sizes = [len(b) for b in hps.data.FirstExamples(reader, n)]
    except DataError as e:
        return str(e)
    return sizes, reader.malformed


@pytest.mark.parametrize("kind", ["tsv", "parquet"])
def test_a_malformed_line_past_the_first_examples_asked_is_neither_raised_nor_counted(tmp_path, kind):
    # The readers parse a whole block (4 MiB of TSV, a Parquet batch of 65,536 rows) at
    # once and raised or counted every bad line in it: --examples 100 over a file whose
    # line 151 is bad failed naming line 151, which it never trains, and with
    # skip_malformed counted it as skipped.
    pytest.importorskip("pyarrow")
    lines = [line(label=str(i % 2)) for i in range(300)]
    lines[151 - 1] = line(I4="x")
    if kind == "tsv":
        path = write(tmp_path / "m.tsv", lines)
        sizes = [dict(block_bytes=4 << 20), dict(block_bytes=1000)]
        open_reader = CriteoTsv
        named = f"{path}:151: field I4: 'x' is not an integer"
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        path = str(tmp_path / "m.parquet")
        table = _sample_table(pa, [line(label=str(i % 2)) for i in range(300)])
        table = table.set_column(COLUMNS.index("I4"), "I4", pa.array([1.5 if i != 150 else float("inf")
                                                                       for i in range(300)]))
        pq.write_table(table, path, row_group_size=200)
        sizes = [dict(read_rows=65536), dict(read_rows=7)]
        open_reader = CriteoParquet
        named = f"{path}: row 151: field I4: inf is not a finite number"
    for options in sizes:
        for batch_size in (50, 4096):
            for skip in (False, True):
                def first(n):
                    return _first_examples_and_what_was_said(open_reader(path, batch_size, skip_malformed=skip,
                                                                         **options), n)
                assert first(100) == ([50, 50] if batch_size == 50 else [100], 0), (options, batch_size, skip)
                assert first(150) == ([50, 50, 50] if batch_size == 50 else [150], 0), (options, batch_size, skip)
                assert first(120) == ([50, 50, 20] if batch_size == 50 else [120], 0), (options, batch_size, skip)
                # The line before the 151st example is reached: raised, or counted.
                assert first(151) == (([50, 50, 50, 1] if batch_size == 50 else [151], 1) if skip else named), \
                    (options, batch_size, skip)


def test_gzip_tsv(tmp_path):
    pytest.importorskip("pyarrow")
    text = "".join(line(label=str(i % 2)) + "\n" for i in range(20))
    plain = tmp_path / "a.tsv"
    plain.write_text(text)
    with gzip.open(tmp_path / "a.tsv.gz", "wt") as f:
        f.write(text)
    assert_same_rows(list(CriteoTsv(str(plain), 7)), list(CriteoTsv(str(tmp_path / "a.tsv.gz"), 7)))


# ------------------------------------------------------------------ Parquet

def _sample_table(pa, lines, categorical="hex"):
    """A pyarrow table of TSV lines, built without hps."""
    rows = [x.split("\t") for x in lines]
    cols = {"label": pa.array([int(r[0]) for r in rows], pa.int8())}
    for j, name in enumerate(DENSE_COLUMNS):
        cols[name] = pa.array([int(r[1 + j]) if r[1 + j] else None for r in rows], pa.int64())
    for j, name in enumerate(CATEGORICAL_COLUMNS):
        values = [r[14 + j] for r in rows]
        if categorical == "hex":
            cols[name] = pa.array(values, pa.string())
        else:  # integers with nulls; stored as int32 bitwise, as some writers do
            ints = [int(v, 16) if v else None for v in values]
            cols[name] = pa.array([None if v is None else v - (1 << 32) * (v >= 1 << 31) for v in ints],
                                  pa.int32())
    return pa.table(cols)


@needs_sample
@pytest.mark.parametrize("categorical", ["hex", "int32"])
def test_parquet_round_trip_equals_tsv(tmp_path, categorical):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    lines = SAMPLE.read_text().splitlines()[:3000]
    tsv = write(tmp_path / "head.tsv", lines)
    table = _sample_table(pa, lines, categorical)
    pq.write_table(table, tmp_path / "head.parquet", row_group_size=700)
    reader = CriteoParquet(str(tmp_path / "head.parquet"), batch_size=1000, read_rows=512)
    from_parquet = list(reader)
    assert_same_rows(from_parquet, list(CriteoTsv(tsv, batch_size=1000)))
    assert from_parquet[1].sources == (Source(str(tmp_path / "head.parquet"), 1001, 1000),)
    assert reader.malformed == 0


def test_parquet_feature_column_of_type_null_is_missing_values(tmp_path):
    # pyarrow, pandas and polars write a column of None alone as type null, as a small
    # shard's I12 or C22 (mostly missing in Criteo) may be: it was refused ("column I12 has
    # type null, expected integers") though each of its values, missing, is valid.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = _sample_table(pa, [line(), line(label="1"), line()])
    typed = table.set_column(COLUMNS.index("I12"), "I12", pa.array([None] * 3, pa.int64()))
    typed = typed.set_column(COLUMNS.index("C22"), "C22", pa.array([None] * 3, pa.string()))
    untyped = table.set_column(COLUMNS.index("I12"), "I12", pa.nulls(3))
    untyped = untyped.set_column(COLUMNS.index("C22"), "C22", pa.nulls(3))
    assert untyped.schema.field("C22").type == pa.null()
    pq.write_table(typed, tmp_path / "typed.parquet")
    pq.write_table(untyped, tmp_path / "untyped.parquet")
    (want,) = list(CriteoParquet(str(tmp_path / "typed.parquet")))
    (got,) = list(CriteoParquet(str(tmp_path / "untyped.parquet")))
    np.testing.assert_array_equal(got.keys, want.keys)
    np.testing.assert_array_equal(got.dense, want.dense)
    np.testing.assert_array_equal(got.labels, want.labels)
    # A label of type null is no data at all: still refused, naming the column.
    pq.write_table(table.set_column(0, "label", pa.nulls(3)), tmp_path / "nolabel.parquet")
    with pytest.raises(DataError, match=r"nolabel.parquet: column label has type null, expected integers"):
        list(CriteoParquet(str(tmp_path / "nolabel.parquet")))


def test_integers_past_int64_are_refused_in_parquet_as_in_tsv(tmp_path):
    # "An integer past int64 is an error" (docs/training.md): the TSV reader refused
    # one, but a Parquet uint64 column's values from 2**63 up were taken as counts.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    big = [(1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    lines = [line(I5=str(v)) for v in big]
    tsv = write(tmp_path / "big.tsv", lines)
    table = _sample_table(pa, [line()] * 3)
    table = table.set_column(COLUMNS.index("I5"), "I5", pa.array(big, pa.uint64()))
    path = str(tmp_path / "big.parquet")
    pq.write_table(table, path)
    with pytest.raises(DataError) as e:
        list(CriteoTsv(tsv))
    assert str(e.value) == f"{tsv}:2: field I5: '9223372036854775808' is out of the 64-bit integer range"
    with pytest.raises(DataError) as e:
        list(CriteoParquet(path))
    assert str(e.value) == f"{path}: row 2: field I5: 9223372036854775808 is out of the 64-bit integer range"
    assert (e.value.line, e.value.field) == (2, "I5")
    readers = CriteoTsv(tsv, skip_malformed=True), CriteoParquet(path, skip_malformed=True)
    (from_tsv,), (from_parquet,) = (list(r) for r in readers)
    assert [r.malformed for r in readers] == [2, 2]
    assert [from_tsv.locate(0)[1], from_parquet.locate(0)[1]] == [1, 1]
    np.testing.assert_array_equal(from_parquet.dense, from_tsv.dense)


def test_parquet_malformed_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = _sample_table(pa, [line(), line(label="1"), line(), line()])
    table = table.set_column(0, "label", pa.array([0, 1, 2, 0], pa.int64()))
    table = table.set_column(COLUMNS.index("C4"), "C4", pa.array(["1", "2", "3", "zz"]))
    path = str(tmp_path / "bad.parquet")
    pq.write_table(table, path)
    with pytest.raises(DataError) as e:
        list(CriteoParquet(path))
    assert str(e.value) == f"{path}: row 3: field label: 2 is not 0 or 1"
    reader = CriteoParquet(path, skip_malformed=True)
    (batch,) = list(reader)
    assert reader.malformed == 2 and len(batch) == 2
    assert reader.malformed_examples[1] == f"{path}: row 4: field C4: 'zz' is not a hexadecimal value of 1 to 16 digits"
    assert [batch.locate(i)[1] for i in range(2)] == [1, 2]

    pq.write_table(table.drop_columns(["I7"]), tmp_path / "narrow.parquet")
    with pytest.raises(DataError, match="no column I7"):
        list(CriteoParquet(str(tmp_path / "narrow.parquet")))


def test_fsspec_urls(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://hps-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        lines = [line(label=str(i % 2), C1=format(i, "08x")) for i in range(30)]
        for part in range(3):
            with fsspec.open(f"{root}/tsv/part-{part}.tsv", "wb") as f:
                f.write("".join(x + "\n" for x in lines[part * 10:(part + 1) * 10]).encode())
        local = list(CriteoTsv(write(tmp_path / "all.tsv", lines), batch_size=8))
        remote = list(CriteoTsv(f"{root}/tsv/part-*.tsv", batch_size=8))
        assert_same_rows(remote, local)
        path = remote[0].sources[0].path  # as fsspec spells it: memory:///hps-test-...
        assert path.startswith("memory://") and path.endswith("/tsv/part-0.tsv")
        with fsspec.open(f"{root}/pq/x.parquet", "wb") as f:
            pq.write_table(_sample_table(pa, lines), f)
        assert_same_rows(list(CriteoParquet(f"{root}/pq", batch_size=8)), local)
    finally:
        fs.rm(root, recursive=True)


def test_an_empty_tsv_file_warns_naming_it_and_the_others_are_read(tmp_path):
    # A 0-byte file (an export that wrote nothing) gave 0 examples without a word.
    # It warns and the reader goes on: shards of a directory may be empty parts.
    pytest.importorskip("pyarrow")
    d = tmp_path / "day"
    d.mkdir()
    write(d / "part-0.tsv", [line(label="1")])
    (d / "part-1.tsv").write_bytes(b"")
    (d / "part-2.tsv.gz").write_bytes(gzip.compress(b""))  # no data once decompressed
    with pytest.warns(hps.data.EmptyFileWarning) as got:
        batches = list(CriteoTsv(str(d), batch_size=8))
    assert sum(len(b) for b in batches) == 1
    assert [str(w.message) for w in got] == [
        f"{d / 'part-1.tsv'}: empty file (no data): no examples read from it",
        f"{d / 'part-2.tsv.gz'}: empty file (no data once decompressed): no examples read from it"]
    write(d / "part-1.tsv", [""])  # an empty line is a line: malformed, not an empty file
    with pytest.raises(DataError, match=r"part-1.tsv:1: is an empty line"):
        list(CriteoTsv(str(d / "part-1.tsv")))


def test_a_parquet_file_of_no_rows_warns_naming_it_and_the_others_are_read(tmp_path):
    # A Parquet part of 0 rows (an export's reducer without output: a schema, no row
    # group or empty ones) gave 0 examples without a word, where an empty TSV part warns.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    d = tmp_path / "day"
    d.mkdir()
    table = _sample_table(pa, [line(label="1"), line(label="0")])
    pq.write_table(table, d / "part-0.parquet")
    pq.write_table(table.slice(0, 0), d / "part-1.parquet")
    with pytest.warns(hps.data.EmptyFileWarning) as got:
        batches = list(CriteoParquet(str(d), batch_size=8))
    assert sum(len(b) for b in batches) == 2
    assert [str(w.message) for w in got] == [f"{d / 'part-1.parquet'}: empty file (no rows): no examples read from it"]


def test_local_tsv_is_decompressed_by_the_names_the_schema_readers_take(tmp_path):
    # A local Criteo file was decompressed only when its name ended in a lower-case
    # ".gz": day_0.tsv.bz2, .zst or .TSV.GZ failed with "has 1 fields, expected 40",
    # though the same file behind a URL (fsspec) and the schema readers read them.
    import bz2
    pa = pytest.importorskip("pyarrow")
    lines = [line(label=str(i % 2), C1=format(i, "08x")) for i in range(40)]
    plain = write(tmp_path / "day.tsv", lines)
    content = (tmp_path / "day.tsv").read_bytes()
    (tmp_path / "day.tsv.bz2").write_bytes(bz2.compress(content))
    (tmp_path / "day.TSV.GZ").write_bytes(gzip.compress(content))
    with pa.output_stream(str(tmp_path / "day.tsv.zst"), compression="zstd") as f:
        f.write(content)
    want = list(CriteoTsv(plain, batch_size=16))
    for name in ("day.tsv.bz2", "day.TSV.GZ", "day.tsv.zst"):
        got = list(open_criteo(str(tmp_path / name), batch_size=16, block_bytes=300))
        assert_same_rows(got, want)
        assert got[-1].locate(len(got[-1]) - 1) == (str(tmp_path / name), 40)
    # An empty file is one without lines, compressed or not (and warns, as every empty file).
    for name in ("empty.tsv.bz2", "empty.tsv.zst", "empty.tsv.gz"):
        (tmp_path / name).write_bytes(b"")
        with pytest.warns(hps.data.EmptyFileWarning, match=re.escape(name)):
            assert list(CriteoTsv(str(tmp_path / name))) == []
    # Damaged, each names the file and the line where its data ends.
    (tmp_path / "cut.tsv.bz2").write_bytes(bz2.compress(content)[:-30])
    (tmp_path / "cut.tsv.zst").write_bytes((tmp_path / "day.tsv.zst").read_bytes()[:-30])
    for name in ("cut.tsv.bz2", "cut.tsv.zst"):
        path = str(tmp_path / name)
        with pytest.raises(DataError, match=r"corrupt or truncated compressed data") as e:
            list(CriteoTsv(path, batch_size=16, block_bytes=300))
        assert e.value.path == path and 1 <= e.value.line <= 40


def test_compressed_urls_are_decompressed_by_their_names_without_fsspecs_codecs(tmp_path):
    # fsspec infers a URL's compression only for the codecs it has: without the
    # optional zstandard module it read a .zst file as it is, so CriteoTsv failed
    # with "has 5 fields, expected 40", a CSV with a bare UnicodeDecodeError naming
    # no file, and write_tsv wrote plain text under a .zst name. The readers and
    # write_tsv now decompress and compress such URLs themselves (pyarrow's codecs).
    pa = pytest.importorskip("pyarrow")
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://hps-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        gen = SyntheticCriteo(seed=4, batch_size=64, examples=300)
        for ext in (".zst", ".gz", ".bz2"):
            assert gen.write_tsv(f"{root}/syn.tsv{ext}", 300) == 300
            assert fs.cat(f"{root}/syn.tsv{ext}")[:2] not in (b"0\t", b"1\t")  # compressed
            assert_same_rows(list(CriteoTsv(f"{root}/syn.tsv{ext}", batch_size=64)), list(gen))
        with fsspec.open(f"{root}/a.csv.zst", "wb") as f:
            f.write(pa.compress(b"click,price,site\n1,2,a\n0,3,b\n", "zstd", asbytes=True))
        # (pyarrow's one-shot zstd frame, as another writer's would be)
        (batch,) = list(hps.data.open_schema(f"{root}/a.csv.zst", {"label": "click", "dense": ["price"],
                                                                    "categorical": "rest"}))
        assert batch.labels.tolist() == [1.0, 0.0] and batch.keys.shape == (2, 1)
    finally:
        fs.rm(root, recursive=True)


def test_a_damaged_bz2_url_is_a_data_error_naming_file_and_line(tmp_path):
    # bz2 reports bad data as a plain OSError ("Invalid data stream"), which had
    # left the reader as it was: hps train printed "OSError: Invalid data stream",
    # naming no file. It is now the DataError a damaged .gz gives.
    import bz2
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://hps-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        good = bz2.compress("".join(line() + "\n" for _ in range(3)).encode())
        for name, data in (("bad.tsv.bz2", good[:10] + b"\0" * 40 + good[50:]), ("cut.tsv.bz2", good[:-20])):
            with fsspec.open(f"{root}/{name}", "wb") as f:
                f.write(data)
            reader = CriteoTsv(f"{root}/{name}", skip_malformed=True)
            with pytest.raises(DataError, match=r":1: corrupt or truncated compressed data") as e:
                list(reader)
            assert e.value.path == reader.files[0] and e.value.path.endswith(name) and e.value.line == 1
    finally:
        fs.rm(root, recursive=True)


# ------------------------------------------------------------------ sharding and file lists

def test_list_and_shard_files(tmp_path):
    gen = SyntheticCriteo(seed=2, batch_size=5)
    for i in (3, 0, 4, 1, 2):
        gen.write_tsv(str(tmp_path / f"day_{i}.tsv"), 5 + i)
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".day_9.tsv.crc").write_text("")
    expect = [str(tmp_path / f"day_{i}.tsv") for i in range(5)]
    assert list_files(tmp_path) == expect
    assert list_files(str(tmp_path / "day_*.tsv")) == expect
    assert list_files([expect[3], expect[1]]) == [expect[3], expect[1]]
    assert shard_files(expect, 1, 2) == [expect[1], expect[3]]
    assert shard_files(expect, 4, 5) == [expect[4]]
    with pytest.raises(ValueError, match="rank 2 of 3 gets no file: there are 2 files for 3 ranks"):
        shard_files(expect[:2], 2, 3)
    with pytest.raises(ValueError, match="rank"):
        shard_files(expect, 2, 2)
    with pytest.raises(FileNotFoundError):
        list_files(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError):
        list_files(str(tmp_path / "nope*.tsv"))
    # A file named twice was read twice: its examples trained on twice a pass, without a word.
    for twice in ([tmp_path, expect[2]], [str(tmp_path / "day_*.tsv"), str(tmp_path / "day_[24].tsv")],
                  [expect[2], os.path.join(str(tmp_path), ".", "day_2.tsv")]):
        with pytest.raises(ValueError, match=r"day_2.tsv: named more than once in the data paths"):
            list_files(twice)
    os.symlink(expect[2], tmp_path / "link.tsv.lnk")
    with pytest.raises(ValueError, match=r"link.tsv.lnk: named more than once in the data paths \(as .*day_2.tsv "
                                         r"and as .*link.tsv.lnk\)"):
        list_files([expect[2], str(tmp_path / "link.tsv.lnk")])
    os.remove(tmp_path / "link.tsv.lnk")

    pytest.importorskip("pyarrow")
    reader = CriteoTsv(tmp_path, batch_size=4, rank=1, world=2)
    assert reader.files == [expect[1], expect[3]]
    batches = list(reader)
    assert sum(len(b) for b in batches) == 6 + 8
    assert {s.path for b in batches for s in b.sources} == {expect[1], expect[3]}
    # A batch runs on across the file boundary and says so.
    assert batches[1].sources == (Source(expect[1], 5, 2), Source(expect[3], 1, 2))
    with pytest.raises(ValueError, match="gets no file"):
        CriteoTsv(tmp_path, rank=5, world=6)


@contextlib.contextmanager
def _empty_files_local_and_in_memory(tmp_path, root: str, names: list):
    """Empty files of these relative names under tmp_path and under fsspec's
    memory://root (removed after), to list the same tree locally and by URL."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    try:
        for name in names:
            os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
            (tmp_path / name).write_text("")
            fs.pipe(f"{root}/{name}", b"")
        yield
    finally:
        fs.rm(root, recursive=True)


def test_a_glob_leaves_out_the_markers_spark_and_hadoop_write_beside_the_data(tmp_path):
    # "out/*" had matched _SUCCESS (an empty file: "empty file" from the CSV reader),
    # _committed_* and, through "**", the part files under _temporary/; a directory
    # already left them out. A name the user spells out is still read.
    names = ["part-0.csv", "sub/part-1.csv", "_SUCCESS", "_committed_7", ".part-0.csv.crc",
             "_temporary/part-9.csv", "sub/.part-1.csv.crc"]
    root = "/hps-test-markers"
    with _empty_files_local_and_in_memory(tmp_path, root, names):
        for base in (str(tmp_path), f"memory://{root}"):
            def found(pattern):
                return [f.rsplit(base + "/", 1)[1] for f in list_files(f"{base}/{pattern}")]
            assert found("*") == ["part-0.csv"]
            assert found("**") == found("**/*.csv") == ["part-0.csv", "sub/part-1.csv"]
            assert found("*/*.csv") == ["sub/part-1.csv"]
            assert found("_*") == ["_SUCCESS", "_committed_7"]  # a wildcard that asks for them
            assert found("_temporary/*") == ["_temporary/part-9.csv"]
            assert found("**/.*") == [".part-0.csv.crc", "sub/.part-1.csv.crc"]
            assert list_files(f"{base}/_SUCCESS") == [f"{base}/_SUCCESS"]
            assert [f.rsplit(base + "/", 1)[1] for f in list_files(base)] == ["part-0.csv", "sub/part-1.csv"]
            with pytest.raises(FileNotFoundError, match="no data file in"):
                list_files(f"{base}/*S")  # only _SUCCESS matches: no data file


def test_a_local_double_star_glob_reaches_every_depth_as_a_url_glob_does(tmp_path):
    # "**" in a local glob had matched one directory level only (glob.glob without
    # recursive=True), so data/**/*.tsv silently left out the files directly in
    # data/ and those two levels down, which the same glob over fsspec reads.
    names = ["top.tsv", "day=1/a.tsv", "day=2/hour=3/b.tsv", "day=2/hour=3/c.parquet"]
    root = "/hps-test-double-star"
    with _empty_files_local_and_in_memory(tmp_path, root, names):
        local = list_files(str(tmp_path / "**" / "*.tsv"))
        assert local == sorted(str(tmp_path / n) for n in names[:3])
        url = list_files(f"memory://{root}/**/*.tsv")
        assert [u.rsplit(root + "/", 1)[1] for u in url] == [os.path.relpath(p, tmp_path) for p in local]


def test_a_directory_gives_its_files_at_every_depth_in_the_order_of_its_double_star_glob(tmp_path):
    # A directory listed its top level alone: --data DIR over a partitioned data set
    # (day=.../part-0.tsv) read the files beside the partitions and left the partitions
    # out without a word, and a directory of partitions alone was "no data file in" it.
    # Names starting with "." or "_" are left out at every depth, directories too.
    names = ["top.tsv", "day=1/a.tsv", "day=2/hour=3/b.tsv", "day=10/c.tsv", "_SUCCESS", "day=1/_SUCCESS",
             "day=2/.b.tsv.crc", ".ipynb_checkpoints/top-checkpoint.tsv", "_temporary/0/part-9.tsv",
             "day=3/_temporary/part-8.tsv"]
    data = ["day=1/a.tsv", "day=10/c.tsv", "day=2/hour=3/b.tsv", "top.tsv"]
    root = "/hps-test-directory-depth"
    with _empty_files_local_and_in_memory(tmp_path, root, names):
        for base in (str(tmp_path), f"memory://{root}"):
            assert [f.rsplit(base + "/", 1)[1] for f in list_files(base)] == data, base
            assert list_files(base) == list_files(f"{base}/**"), base
            # Partitions alone (no file at the top): their files.
            assert [f.rsplit(base + "/", 1)[1] for f in list_files(f"{base}/day=2")] == ["day=2/hour=3/b.tsv"], base
            with pytest.raises(FileNotFoundError, match=r"no data file in .*day=3"):
                list_files(f"{base}/day=3")  # (its one file under _temporary/)
    # A link to a directory is followed, as a glob follows it; one to a directory above
    # it is refused, naming it, where its files would repeat without end.
    os.makedirs(tmp_path / "d" / "day=1")
    (tmp_path / "d" / "day=1" / "a.tsv").write_text("")
    os.makedirs(tmp_path / "elsewhere" / "day=2")
    (tmp_path / "elsewhere" / "day=2" / "b.tsv").write_text("")
    os.symlink(tmp_path / "elsewhere" / "day=2", tmp_path / "d" / "day=2")
    assert list_files(tmp_path / "d") == [str(tmp_path / "d" / "day=1" / "a.tsv"),
                                          str(tmp_path / "d" / "day=2" / "b.tsv")]
    os.symlink(tmp_path / "d", tmp_path / "d" / "day=1" / "loop")
    with pytest.raises(ValueError, match=r"d/day=1/loop: a link to .*d, a directory that holds it"):
        list_files(tmp_path / "d")


def test_open_criteo_picks_the_reader(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tsv = write(tmp_path / "a.tsv", [line()] * 3)
    pq.write_table(_sample_table(pa, [line()] * 3), tmp_path / "a.parquet")
    assert isinstance(open_criteo(tsv), CriteoTsv)
    assert isinstance(open_criteo(str(tmp_path / "a.parquet")), CriteoParquet)
    with pytest.raises(ValueError, match="mixes"):
        open_criteo(tmp_path)
    assert_same_rows(list(open_criteo(tsv, 2)), list(open_criteo(str(tmp_path / "a.parquet"), 2)))


# ------------------------------------------------------------------ synthetic data

@pytest.fixture(scope="module")
def train_stream():
    gen = SyntheticCriteo(seed=11, batch_size=8192, examples=160_000)
    return gen, list(gen)


def test_synthetic_batches_have_the_reader_shapes():
    gen = SyntheticCriteo(seed=0, batch_size=1000, examples=2500)
    batches = list(gen)
    assert [len(b) for b in batches] == [1000, 1000, 500] and len(gen) == 3
    assert len(SyntheticCriteo(seed=0, batch_size=1000, examples=2500, drop_last=True)) == 2
    b = batches[2]
    assert isinstance(b, Batch)
    assert b.labels.dtype == np.float32 and b.labels.shape == (500,)
    assert b.dense.dtype == np.float32 and b.dense.shape == (500, 13)
    assert b.keys.dtype == np.uint64 and b.keys.shape == (500, 26)
    assert b.keys.flags.c_contiguous and b.dense.flags.c_contiguous
    assert set(np.unique(b.labels)) <= {0.0, 1.0}
    assert b.locate(499) == ("synthetic:train", 2500)
    with pytest.raises(TypeError):
        len(SyntheticCriteo(seed=0))


def test_synthetic_is_deterministic(train_stream):
    gen, batches = train_stream
    again = list(SyntheticCriteo(seed=11, batch_size=8192, examples=160_000))
    assert_same_rows(again, batches)
    # The stream does not depend on batch_size, and a shorter stream is a prefix.
    other = list(SyntheticCriteo(seed=11, batch_size=777, examples=10_000))
    for got, want in zip(concat(other), concat(batches), strict=True):
        np.testing.assert_array_equal(got, want[:10_000])
    different = next(iter(SyntheticCriteo(seed=12, batch_size=1000)))
    assert (different.keys != batches[0].keys[:1000]).mean() > 0.5


def test_synthetic_parts_and_ranks_are_disjoint_streams_of_one_model(train_stream):
    gen, batches = train_stream
    ev = SyntheticCriteo(seed=11, batch_size=8192, examples=20_000, part="eval")
    eval_batch = next(iter(ev))
    assert ev.bias == gen.bias
    assert (eval_batch.keys != batches[0].keys).mean() > 0.3
    np.testing.assert_array_equal(ev.hidden_logit(eval_batch), gen.hidden_logit(eval_batch))
    # Three nodes split the stream by blocks; together they hold it exactly.
    whole = concat(list(SyntheticCriteo(seed=5, batch_size=3000, examples=30_000)))
    rows = {}
    for rank in range(3):
        part = list(SyntheticCriteo(seed=5, batch_size=3000, examples=30_000, rank=rank, world=3))
        for b in part:
            for i in range(len(b)):
                rows[b.locate(i)[1]] = (rank, b, i)
    assert sorted(rows) == list(range(1, 30_001))
    for line_no in (1, 4096, 4097, 12289, 30_000):
        rank, b, i = rows[line_no]
        np.testing.assert_array_equal(b.keys[i], whole[2][line_no - 1])
        assert b.labels[i] == whole[0][line_no - 1]


def test_synthetic_ctr_and_hidden_model_auc(train_stream):
    gen, batches = train_stream
    labels = concat(batches)[0]
    assert 0.24 <= labels.mean() <= 0.26  # documented: ctr=0.25 +- 0.01
    logit = np.concatenate([gen.hidden_logit(b) for b in batches])
    assert auc(labels, logit) > 0.75
    assert auc(labels, -logit) < 0.25


def test_synthetic_is_learnable_across_parts(train_stream):
    """Per-key click rates counted on "train" rank "eval" examples well (naive Bayes)."""
    gen, batches = train_stream
    labels, _, keys = concat(batches)
    ev = next(iter(SyntheticCriteo(seed=11, batch_size=40_000, examples=40_000, part="eval")))
    prior = labels.mean()
    score = np.zeros(len(ev))
    for f in range(keys.shape[1]):
        uniq, inverse, count = np.unique(keys[:, f], return_inverse=True, return_counts=True)
        clicks = np.bincount(inverse, weights=labels)
        rate = (clicks + 20 * prior) / (count + 20)  # smoothed toward the prior
        log_odds = np.log(rate / (1 - rate)) - np.log(prior / (1 - prior))
        at = np.minimum(np.searchsorted(uniq, ev.keys[:, f]), len(uniq) - 1)
        score += np.where(uniq[at] == ev.keys[:, f], log_odds[at], 0.0)
    assert auc(ev.labels, score) > 0.7


def test_synthetic_ids_are_zipf(train_stream):
    gen, batches = train_stream
    keys = concat(batches)[2]
    n = len(keys)
    field = 2  # vocabulary 1_000_000
    is_missing = keys[:, field] == np.uint64(missing_key(field))
    assert is_missing.mean() == pytest.approx(0.05, abs=0.005)
    _, counts = np.unique(keys[~is_missing, field], return_counts=True)
    counts = np.sort(counts)[::-1]
    ranks = np.arange(1, 1_000_001, dtype=np.float64)
    p = ranks ** -1.1 / (ranks ** -1.1).sum() * 0.95
    # The top ids follow r**-1.1 within sampling error.
    top = counts[:5] / n
    np.testing.assert_allclose(top, p[:5], rtol=0.06)
    small = 8  # vocabulary 10: every id shows up
    assert len(np.unique(keys[:, small])) == 10 + 1


def test_synthetic_write_tsv_reads_back(tmp_path):
    pytest.importorskip("pyarrow")
    gen = SyntheticCriteo(seed=3, batch_size=1000, examples=5000)
    assert gen.write_tsv(str(tmp_path / "syn.tsv"), 5000) == 5000
    assert gen.write_tsv(str(tmp_path / "syn.tsv.gz"), 5000) == 5000
    assert_same_rows(list(CriteoTsv(str(tmp_path / "syn.tsv"), batch_size=1000)), list(gen))
    assert_same_rows(list(CriteoTsv(str(tmp_path / "syn.tsv.gz"), batch_size=1000)), list(gen))
    # Every name CriteoTsv decompresses is written compressed (a .bz2 or .zst path had
    # held plain text, which the reader, decompressing it, refuses).
    for name in ("syn.tsv.bz2", "syn.tsv.zst", "SYN.TSV.GZ"):
        assert gen.write_tsv(str(tmp_path / name), 5000) == 5000
        assert (tmp_path / name).read_bytes()[:2] not in (b"0\t", b"1\t")  # not plain text
        assert_same_rows(list(CriteoTsv(str(tmp_path / name), batch_size=1000)), list(gen))
    first = (tmp_path / "syn.tsv").read_text().split("\n", 1)[0].split("\t")
    assert len(first) == 40 and all(len(v) in (0, 8) for v in first[14:])


@pytest.mark.parametrize("kwargs", [dict(seed=-1), dict(part="test"), dict(vocab_sizes=[0, 5]),
                                    dict(ctr=1.0), dict(batch_size=0), dict(rank=2, world=2),
                                    dict(cat_missing=1.0), dict(zipf_a=-0.5)])
def test_synthetic_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        SyntheticCriteo(**kwargs)


@pytest.mark.parametrize("zipf_a", [0.0, 0.8, 1.0, 2.0])
def test_synthetic_other_skews(zipf_a):
    gen = SyntheticCriteo(seed=1, zipf_a=zipf_a, vocab_sizes=[5, 64, 65, 100_000], n_dense=2,
                          batch_size=20_000, examples=20_000, cat_missing=0.0)
    b = next(iter(gen))
    assert b.keys.shape == (20_000, 4) and b.dense.shape == (20_000, 2)
    ranks = np.arange(1, 6, dtype=np.float64)
    p = ranks ** -zipf_a / (ranks ** -zipf_a).sum()
    _, counts = np.unique(b.keys[:, 0], return_counts=True)
    np.testing.assert_allclose(np.sort(counts)[::-1] / 20_000, p, atol=0.015)
    assert 0.2 < b.labels.mean() < 0.3


def test_synthetic_head_ranks_are_exact():
    """White-box: the table lookup gives the inverse-CDF rank for every draw in the head."""
    for zipf_a in (1.1, 3.0):
        gen = SyntheticCriteo(seed=0, zipf_a=zipf_a, vocab_sizes=[40, 64, 1000], n_dense=0)
        t = np.random.default_rng(1).random((50_000, 3)) * gen._zipf_total
        head = t < gen._zipf_head_mass
        exact = np.searchsorted(np.cumsum(np.arange(1, 65) ** -zipf_a), t, side="right") + 1
        np.testing.assert_array_equal(gen._ranks(t)[head], exact[head])


# ------------------------------------------------------------------ packaging

def test_imports_and_generates_without_pyarrow():
    code = textwrap.dedent("""
        import sys
        sys.modules["pyarrow"] = None  # any import of pyarrow now fails
        import hps.data as d
        b = next(iter(d.SyntheticCriteo(seed=1, batch_size=8, examples=8)))
        assert b.keys.shape == (8, 26)
        for reader in (d.CriteoTsv, d.CriteoParquet):
            try:
                reader("x.tsv")
            except ImportError as e:
                assert "pip install pyarrow" in str(e), e
            else:
                raise AssertionError("no ImportError")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_docstring_examples():
    result = doctest.testmod(hps.data)
    assert result.attempted > 0
    assert result.failed == 0
