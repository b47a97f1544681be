"""hps.data with a declared schema: CSV/TSV, Parquet and libsvm files of any columns, against
hand-written files whose keys are computed here independently of the readers."""
import bz2
import gzip
import re
import textwrap

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from hps.data import (Bags, Batch, DataError, EmptyFileWarning, Libsvm, Schema, SchemaCsv, SchemaParquet,  # noqa: E402
                      missing_key, open_schema, value_keys)

M64 = (1 << 64) - 1


def splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_key(field: int, value) -> int:
    """The documented key of a categorical value, in plain Python integers."""
    b = value.encode() if isinstance(value, str) else value
    if b == b"":
        return ref_missing(field)
    h = len(b)
    for i in range(0, len(b), 8):
        h = splitmix(h ^ int.from_bytes(b[i:i + 8].ljust(8, b"\0"), "little"))
    k = splitmix(((field + 1) << 32) ^ h)
    return 0xFFFF_FFFF_FFFF_FFFE if k == M64 else k


def ref_missing(field: int) -> int:
    return splitmix(((field + 1) << 32) ^ (1 << 63))


def log1p(x):
    return np.log1p(np.maximum(np.asarray(x, np.float64), 0)).astype(np.float32)


def read_all(reader):
    batches = list(reader)
    labels = np.concatenate([b.labels for b in batches])
    dense = np.concatenate([b.dense for b in batches])
    keys = np.concatenate([b.keys for b in batches])
    bags = [Bags.concat([b.bags[j] for b in batches]) for j in range(len(batches[0].bags))]
    return labels, dense, keys, bags, batches


CSV = textwrap.dedent("""\
    id,click,price,site,os,tags
    1,0,3.5,a.com,ios,x|y
    2,1,,b.com,-1,
    3,1,7,,android,z||x
    4,0,-2,a.com,"i,os",y
    """)
# The expected rows of CSV under SCHEMA: fields site (0), os (1), tags (2).
SCHEMA = {"label": "click", "dense": ["price"], "categorical": "rest", "multi_hot": {"tags": "|"}, "skip": ["id"]}
LABELS = [0, 1, 1, 0]
PRICES = [3.5, 0, 7, 0]
SITES = ["a.com", "b.com", "", "a.com"]
OSES = ["ios", "-1", "android", "i,os"]
TAGS = [["x", "y"], [], ["z", "x"], ["y"]]


def expected_keys(sites=SITES, oses=OSES):
    return np.array([[ref_key(0, s), ref_key(1, o)] for s, o in zip(sites, oses, strict=True)], np.uint64)


def check_rows(labels, dense, keys, bags, tags=TAGS):
    np.testing.assert_array_equal(labels, np.array(LABELS, np.float32))
    np.testing.assert_array_equal(dense, log1p(PRICES)[:, None])
    np.testing.assert_array_equal(keys, expected_keys())
    assert len(bags) == 1
    np.testing.assert_array_equal(bags[0].offsets, np.cumsum([0] + [len(t) for t in tags]))
    np.testing.assert_array_equal(bags[0].keys, np.array([ref_key(2, t) for ts in tags for t in ts], np.uint64))


# ------------------------------------------------------------------ keys and the schema

def test_value_keys_hash_any_bytes_with_the_field():
    values = ["ios", "-1", "", "68fd1e64", "a" * 17, "é"]
    got = value_keys(5, values).tolist()
    assert got == [ref_key(5, v) for v in values]
    assert got[2] == missing_key(5) == ref_missing(5)
    assert value_keys(5, ["ios"])[0] != value_keys(6, ["ios"])[0]
    # A value and the same bytes padded with a zero byte are different values.
    assert value_keys(0, [b"ab"])[0] != value_keys(0, [b"ab\0"])[0]


def test_hashing_values_mixes_each_word_of_the_data_once(monkeypatch):
    # Values were hashed in rounds of one 8-byte word over every distinct value of
    # a block, as many rounds as the longest value has words: one long text among
    # many short ones (a free-text column under categorical = "rest") cost the
    # block (values x the longest's words). Counted here: the words mixed.
    import hps.data.schema as schema_module
    real, mixed = schema_module._splitmix64, []

    def counting(x):
        mixed.append(len(x))
        return real(x)
    monkeypatch.setattr(schema_module, "_splitmix64", counting)
    values = [f"v{i}" for i in range(500)] + ["x" * 8000, "y" * 9, ""]
    got = value_keys(2, values).tolist()
    assert sum(mixed) == 500 + 1000 + 2  # one word a short value, 1000 the long one, 2 for 9 bytes
    assert got == [ref_key(2, v) for v in values]


def test_value_keys_of_values_of_any_lengths_are_the_documented_hash():
    # The rounds above skip values without a k-th word: keys must not change
    # (they live in checkpoints), whatever the mix of lengths in one call.
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @hypothesis.given(st.lists(st.binary(max_size=70), max_size=30), st.integers(0, 40))
    def check(values, field):
        assert value_keys(field, values).tolist() == [ref_key(field, v) for v in values]
    check()


def test_schema_config_errors_name_the_source_and_field():
    with pytest.raises(ValueError, match=r"run.toml: unknown field\(s\) data.schema.lable"):
        Schema.from_dict({"lable": "click"}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: column 'site' is in both data.schema.dense and "
                                         r"data.schema.categorical"):
        Schema.from_dict({"dense": ["site"], "categorical": ["site"]}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: data.schema.header = false: columns are 0-based positions, "
                                         r"got the name 'click'"):
        Schema.from_dict({"label": "click", "header": False}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: data.schema.categorical must be a list or \"rest\""):
        Schema.from_dict({"categorical": "all"}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: data.schema.delimiter must be one character"):
        Schema.from_dict({"delimiter": ",,"}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: data.schema.fields.b .* overlap at index 5|"
                                         r"run.toml: data.schema.fields.a and data.schema.fields.b overlap"):
        Schema.from_dict({"fields": {"a": [0, 5], "b": [5, 9]}}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: data.schema.dense: -1 is not a column name"):
        Schema.from_dict({"dense": [-1]}, "run.toml")
    # Any negative label position is refused, not only -1: label = -2 had passed the
    # check and then read a column from the end (also a categorical one under "rest").
    for label in (-1, -2, -40):
        with pytest.raises(ValueError, match=rf"run.toml: data.schema.label must be a column name or a 0-based "
                                             rf"position, got {label}"):
            Schema.from_dict({"label": label, "header": False}, "run.toml")
    # A Schema made in Python is checked by the reader.
    with pytest.raises(ValueError, match=r"column 'a' is in both data.schema.dense and data.schema.skip"):
        SchemaCsv(__file__, Schema(dense=["a"], skip=["a"]))


# ------------------------------------------------------------------ CSV / TSV

def test_csv_with_header_gives_the_known_keys_in_any_batching(tmp_path):
    p = tmp_path / "clicks.csv"
    p.write_text(CSV)
    for batch_size, block_bytes in ((4096, 1 << 20), (1, 40), (3, 64)):
        r = SchemaCsv(p, SCHEMA, batch_size, block_bytes=block_bytes)
        labels, dense, keys, bags, batches = read_all(r)
        check_rows(labels, dense, keys, bags)
        assert [b.locate(i) for b in batches for i in range(len(b))] == [(str(p), n) for n in (2, 3, 4, 5)]


def test_headerless_tsv_by_position_compressed(tmp_path):
    rows = [CSV.splitlines()[1:][i].replace(",", "\t").replace('"i\tos"', "i,os") for i in range(4)]
    text = "\n".join(rows) + "\n"
    schema = {"label": 1, "dense": [2], "categorical": [3, 4], "multi_hot": {"5": "|"}, "header": False}
    (tmp_path / "a.tsv").write_text(text)
    (tmp_path / "b.tsv.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "c.tsv.bz2").write_bytes(bz2.compress(text.encode()))
    paths = [tmp_path / "a.tsv", tmp_path / "b.tsv.gz", tmp_path / "c.tsv.bz2"]
    if pa.Codec.is_available("zstd"):
        (tmp_path / "d.tsv.zst").write_bytes(pa.compress(text.encode(), "zstd", asbytes=True))
        paths.append(tmp_path / "d.tsv.zst")
    for p in paths:
        check_rows(*read_all(open_schema(p, schema))[:4])


def test_csv_errors_name_file_line_and_column(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("id,click,price,site,os,tags\n1,0,3.5,a,b,\n2,1,abc,a,b,\n3,2,1,a,b,\n4,1\n")
    with pytest.raises(DataError, match=r"bad.csv:3: column 'price': 'abc' is not a number") as e:
        list(SchemaCsv(p, SCHEMA))
    assert (e.value.line, e.value.field) == (3, "price")
    r = SchemaCsv(p, SCHEMA, skip_malformed=True)
    labels = np.concatenate([b.labels for b in r])
    assert labels.tolist() == [0.0] and r.malformed == 3
    assert r.malformed_examples == [
        f"{p}:3: column 'price': 'abc' is not a number", f"{p}:4: column 'click': '2' is not 0 or 1",
        f"{p}:5: has 2 fields, expected 6"]
    # With the values mended, the wrong field count is raised.
    p.write_text("id,click,price,site,os,tags\n1,0,3.5,a,b,\n2,1,4,a,b,\n3,1,1,a,b,\n4,1\n")
    with pytest.raises(DataError, match=r"bad.csv:5: has 2 fields, expected 6") as e:
        list(SchemaCsv(p, SCHEMA))
    assert (e.value.line, e.value.field) == (5, None)


@pytest.mark.parametrize("bad_value", [("click", "2", "is not 0 or 1"), ("price", "abc", "is not a number"),
                                       ("title", '"two\nlines"',
                                        "runs on past the end of its line (a quote not closed on it?)")])
def test_csv_first_error_is_the_lowest_lines_at_any_block_and_batch_size(tmp_path, bad_value):
    # A row of a wrong field count was raised before the value errors of its batch, and
    # pyarrow's blocks decided which rows shared a batch: a file with a bad value on line
    # 9 and a short row on line 30 named line 30 at the default block size (line 9 at a
    # small one), so a user fixing errors one by one was sent down the file and back.
    # The lowest line's error comes first however the file is cut, and so do the
    # malformed_examples kept when skipping.
    schema = {"label": "click", "dense": ["price"], "categorical": ["site", "title"]}
    column, value, why = bad_value
    rows = [f"{i % 2},{i},s{i % 3},t{i}" for i in range(2, 40)]
    rows[9 - 2] = {"click": f"{value},9,s,t", "price": f"1,{value},s,t", "title": f"1,9,s,{value}"}[column]
    rows[30 - 2] = "1,30"
    p = tmp_path / "order.csv"
    p.write_text("click,price,site,title\n" + "\n".join(rows) + "\n")
    spans = value.count("\n")  # (a value over a line end moves the short row down)
    examples = [f"{p}:9: column {column!r}: {value.strip(chr(34))!r} {why}",
                f"{p}:{30 + spans}: has 2 fields, expected 4"]
    for block_bytes in (1 << 20, 4096, 300, 100, 40, 16):
        for batch_size in (4096, 16, 7, 1):
            with pytest.raises(DataError, match=rf"order.csv:9: column '{column}':") as e:
                list(SchemaCsv(p, schema, batch_size, block_bytes=block_bytes))
            assert (e.value.line, e.value.field) == (9, column), (block_bytes, batch_size)
            r = SchemaCsv(p, schema, batch_size, block_bytes=block_bytes, skip_malformed=True)
            list(r)
            assert r.malformed_examples == examples, (block_bytes, batch_size)


@pytest.mark.parametrize("kind", ["csv", "parquet", "libsvm"])
def test_a_malformed_line_past_the_first_examples_asked_is_neither_raised_nor_counted(tmp_path, kind):
    # A block is parsed whole (1 MiB of CSV, 65,536 Parquet rows): --examples and
    # eval_examples raised, or counted as skipped, a bad line past the examples they read.
    from hps.data import FirstExamples
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"]}
    if kind == "csv":
        p = tmp_path / "m.csv"
        p.write_text("click,price,site\n" + "".join(f"{i % 2},{'x' if i == 150 else i},s{i}\n" for i in range(300)))
        named, options = f"{p}:152: column 'price': 'x' is not a number", [{}, dict(block_bytes=256)]
    elif kind == "parquet":
        p = tmp_path / "m.parquet"
        pq.write_table(pa.table({"click": [i % 2 for i in range(300)],
                                 "price": [str(i) if i != 150 else "x" for i in range(300)],
                                 "site": [f"s{i}" for i in range(300)]}), p, row_group_size=200)
        named, options = f"{p}: row group 0, row 151: column 'price': 'x' is not a number", [{}, dict(read_rows=7)]
    else:
        p = tmp_path / "m.svm"
        p.write_text("".join(f"{i % 2} {i}:{'x' if i == 150 else 1}\n" for i in range(300)))
        schema, options = None, [{}]
        named = f"{p}:151: '150:x': the value is not a number"
    for option in options:
        for batch_size in (50, 4096):
            for skip in (False, True):
                def first(n):
                    reader = open_schema(p, schema, batch_size, skip_malformed=skip, **option) if schema else \
                        Libsvm(p, None, batch_size, skip_malformed=skip)
                    try:
                        return [len(b) for b in FirstExamples(reader, n)], reader.malformed
                    except DataError as e:
                        return str(e)
                at = (option, batch_size, skip)
                assert first(100) == ([50, 50] if batch_size == 50 else [100], 0), at
                assert first(150) == ([50, 50, 50] if batch_size == 50 else [150], 0), at
                assert first(120) == ([50, 50, 20] if batch_size == 50 else [120], 0), at
                assert first(151) == (([50, 50, 50, 1] if batch_size == 50 else [151], 1) if skip else named), at


def test_dense_values_past_float32s_range_are_refused(tmp_path):
    # Dense values read as they are are stored as float32: a finite double that
    # would round to inf there is refused, naming line and column, as a non-number
    # is; the largest float32 reads as it is, and so does any count under "log".
    p = tmp_path / "big.csv"
    p.write_text("id,click,price,site,os,tags\n1,0,3.4028234e38,a,b,\n2,1,-3.4028236e38,a,b,\n3,0,1e39,a,b,\n")
    as_read = {**SCHEMA, "dense_transform": "none"}
    with pytest.raises(DataError, match=r"big.csv:3: column 'price': '-3.4028236e38' is past float32's range") as e:
        list(SchemaCsv(p, as_read))
    assert (e.value.line, e.value.field) == (3, "price")
    r = SchemaCsv(p, as_read, skip_malformed=True)
    dense = np.concatenate([b.dense for b in r])
    assert dense.tolist() == [[np.finfo(np.float32).max]] and r.malformed == 2
    logged = np.concatenate([b.dense for b in SchemaCsv(p, SCHEMA)])
    np.testing.assert_allclose(logged[:, 0], np.log1p([3.4028234e38, 0, 1e39]), rtol=1e-6)


@pytest.mark.parametrize("transform", ["none", "log"])
def test_nan_text_is_a_missing_value_as_a_parquet_nan_is(tmp_path, transform):
    # "nan" in a CSV's dense column had reached the batch as NaN under
    # dense_transform = "none" (and poisoned the model's loss), where the same
    # value in a Parquet float column is a missing one. Both read as missing now,
    # in a clean block and in one that also holds a bad value (read value by value).
    schema = {"label": "click", "dense": ["price"], "categorical": "rest", "dense_transform": transform}
    p = tmp_path / "nan.csv"
    p.write_text("click,price,site\n0,nan,a\n1,NaN,b\n0,2.5,c\n1,-nan,d\n")
    q = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"click": [0, 1, 0, 1], "price": [np.nan, np.nan, 2.5, np.nan],
                             "site": ["a", "b", "c", "d"]}), q)
    want = np.array([[0.0], [0.0], [2.5 if transform == "none" else np.log1p(2.5)], [0.0]], np.float32)
    for source in (p, q):
        _, dense, _, _, _ = read_all(open_schema(source, schema))
        np.testing.assert_array_equal(dense, want)
    p.write_text("click,price,site\n0,nan,a\n1,abc,b\n0,2.5,c\n")
    r = SchemaCsv(p, schema, skip_malformed=True)
    _, dense, _, _, _ = read_all(r)
    np.testing.assert_array_equal(dense, want[[0, 2]])
    assert r.malformed_examples == [f"{p}:3: column 'price': 'abc' is not a number"]
    # A label must still be 0 or 1.
    p.write_text("click,price,site\nnan,1,a\n")
    with pytest.raises(DataError, match=r"nan.csv:2: column 'click': 'nan' is not 0 or 1"):
        list(SchemaCsv(p, schema))


def test_csv_schema_that_does_not_match_the_file(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("click,price,site\n0,1,a\n")
    with pytest.raises(DataError, match=r"a.csv: no column 'tags' \(the file's columns: click, price, site\)"):
        list(SchemaCsv(p, SCHEMA))
    with pytest.raises(DataError, match=r"a.csv: column 7 is past the file's 3 columns"):
        list(SchemaCsv(p, {"label": 0, "dense": [7], "header": False}))
    # Two files whose columns give the model different fields.
    q = tmp_path / "b.csv"
    q.write_text("click,price,site,os\n0,1,a,b\n")
    with pytest.raises(DataError, match=r"b.csv: the schema gives other fields here than in .*a.csv"):
        list(SchemaCsv([p, q], {"label": "click", "dense": ["price"], "categorical": "rest"}))


def test_a_repeated_column_name_is_refused_only_where_the_schema_names_it(tmp_path):
    # A repeated header name was refused even where the schema does not use it: a header
    # ending in ",," (two empty names) refused the file ("column '' appears 2 times").
    p = tmp_path / "a.csv"
    p.write_text("click,price,site,,\n1,2,a,,\n0,3,b,x,\n")
    labels, dense, keys, _, _ = read_all(SchemaCsv(p, {"label": "click", "dense": ["price"],
                                                       "categorical": ["site"]}))
    assert labels.tolist() == [1, 0] and keys[:, 0].tolist() == [ref_key(0, "a"), ref_key(0, "b")]
    np.testing.assert_array_equal(dense, log1p([[2], [3]]))
    # "rest" takes them by position, each a field.
    _, _, keys, _, _ = read_all(SchemaCsv(p, {"label": "click", "dense": ["price"], "categorical": "rest"}))
    assert keys.tolist() == [[ref_key(0, "a"), ref_missing(1), ref_missing(2)],
                             [ref_key(0, "b"), ref_key(1, "x"), ref_missing(2)]]
    # A name the schema gives must say which column it is.
    p.write_text("click,site,price,site\n1,a,2,b\n")
    for schema in ({"label": "click", "categorical": ["site"]}, {"label": "click", "skip": ["site"]}):
        with pytest.raises(DataError, match=r"a.csv: the schema names column 'site', which the file has 2 times "
                                            r"\(at positions 1, 3, 0-based\): which one is meant is ambiguous") as e:
            list(SchemaCsv(p, schema))
        assert e.value.field == "site"
    # Parquet: a repeated name not read is let be; one read (by "rest") is refused, since
    # pyarrow reads Parquet columns by name.
    table = pa.Table.from_arrays([pa.array([1, 0]), pa.array([2, 3]), pa.array(["a", "b"]), pa.array(["x", "y"])],
                                 names=["click", "price", "s", "s"])
    pq.write_table(table, tmp_path / "a.parquet")
    (batch,) = list(SchemaParquet(tmp_path / "a.parquet", {"label": "click", "dense": ["price"]}))
    assert batch.labels.tolist() == [1, 0] and batch.keys.shape == (2, 0)
    with pytest.raises(DataError, match=r"a.parquet: column 's' is at 2 positions \(2, 3, 0-based\) and the schema "
                                        r"reads it: Parquet columns are read by name"):
        list(SchemaParquet(tmp_path / "a.parquet", {"label": "click", "dense": ["price"], "categorical": "rest"}))
    with pytest.raises(DataError, match=r"a.parquet: the schema names column 's', which the file has 2 times"):
        list(SchemaParquet(tmp_path / "a.parquet", {"label": "click", "categorical": ["s"]}))


def test_headerless_field_count_errors_say_where_the_count_comes_from(tmp_path):
    # Without a header the expected field count is the one most of the first lines
    # have; "a.csv:2: has 4 fields, expected 3" pointed at a good line without saying
    # where the 3 came from.
    p = tmp_path / "a.csv"
    p.write_text("1,2,x\n1,2,x,y\n0,3,y\n")
    schema = {"label": 0, "dense": [1], "categorical": "rest", "header": False}
    with pytest.raises(DataError, match=r"a.csv:2: has 4 fields, expected 3, as most of its first lines have "
                                        r"\(the file has no header\)$") as e:
        list(SchemaCsv(p, schema))
    assert (e.value.line, e.value.field) == (2, None)
    r = SchemaCsv(p, schema, skip_malformed=True)
    assert sum(len(b) for b in r) == 2 and r.malformed == 1
    assert r.malformed_examples[0].endswith("as most of its first lines have (the file has no header)")
    # With a header its field count is what is expected, and the message says no more.
    p.write_text("a,b,c\n1,2,x,y\n")
    with pytest.raises(DataError, match=r"a.csv:2: has 4 fields, expected 3$"):
        list(SchemaCsv(p, {"label": "a", "dense": ["b"], "categorical": "rest"}))


@pytest.mark.parametrize("line_1", ["1,2,x,extra", "1,2"])
@pytest.mark.parametrize("categorical", ["rest", [2]])
def test_headerless_malformed_line_1_is_one_malformed_line(tmp_path, line_1, categorical):
    # Line 1's field count was the one expected: a malformed line 1 made every good
    # line after it malformed (with skip_malformed, all skipped: one row trained on),
    # or, with too few fields for the schema, refused the file ("column 2 is past the
    # file's 2 columns") even with skip_malformed.
    p = tmp_path / "a.csv"
    p.write_text(line_1 + "\n" + "".join(f"{i % 2},{i},v{i}\n" for i in range(6)) + "1,9\n")
    schema = {"label": 0, "dense": [1], "categorical": categorical, "header": False}
    r = SchemaCsv(p, schema, skip_malformed=True)
    labels, dense, keys, _, _ = read_all(r)
    assert labels.tolist() == [i % 2 for i in range(6)]
    assert keys[:, 0].tolist() == [ref_key(0, f"v{i}") for i in range(6)]
    n = len(line_1.split(","))
    assert r.malformed == 2 and r.malformed_examples == [
        f"{p}:1: has {n} fields, expected 3, as most of its first lines have (the file has no header)",
        f"{p}:8: has 2 fields, expected 3, as most of its first lines have (the file has no header)"]
    assert r.widths() == (1, 1, 0)
    with pytest.raises(DataError, match=rf"a.csv:1: has {n} fields, expected 3, as most"):
        list(SchemaCsv(p, schema))
    # Two lines that disagree: the earlier one's count.
    p.write_text("1,2,x\n0,3,y,z\n")
    with pytest.raises(DataError, match=r"a.csv:2: has 4 fields, expected 3, as most"):
        list(SchemaCsv(p, schema))


# ------------------------------------------------------------------ Parquet

def test_parquet_gives_the_keys_of_the_same_text(tmp_path):
    p = tmp_path / "clicks.parquet"
    table = pa.table({"id": [1, 2, 3, 4], "click": pa.array(LABELS, pa.int8()),
                      "price": pa.array([3.5, None, 7, -2]), "site": ["a.com", "b.com", None, "a.com"],
                      "os": ["ios", "-1", "android", "i,os"], "tags": [["x", "y"], None, ["z", "", "x"], ["y"]]})
    pq.write_table(table, p, row_group_size=3)
    schema = dict(SCHEMA, multi_hot={"tags": ""})
    check_rows(*read_all(open_schema(p, schema, batch_size=3))[:4])
    # Integers are keyed by their decimal text, as in a CSV.
    q = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"click": [1], "n": pa.array([-1], pa.int32())}), q)
    keys = read_all(SchemaParquet(q, {"label": "click", "categorical": ["n"]}))[2]
    assert keys.tolist() == [[ref_key(0, "-1")]]


def test_parquet_decimal_columns_are_numbers(tmp_path):
    # Spark and pandas write SQL DECIMAL columns (prices, amounts) as Parquet
    # decimals, which a dense column or the label had refused as "has type
    # decimal128(10, 2), expected numbers". They read as the numbers they hold.
    import decimal
    p = tmp_path / "dec.parquet"
    prices = [decimal.Decimal("3.50"), None, decimal.Decimal("7.00"), decimal.Decimal("-2.25")]
    pq.write_table(pa.table({"click": pa.array([decimal.Decimal(x) for x in LABELS], pa.decimal128(1, 0)),
                             "price": pa.array(prices, pa.decimal128(10, 2)),
                             "big": pa.array([decimal.Decimal(10) ** 30] * 4, pa.decimal256(50, 0)),
                             "site": SITES}), p)
    schema = {"label": "click", "dense": ["price", "big"], "categorical": ["site"], "dense_transform": "none"}
    labels, dense, keys, _, _ = read_all(open_schema(p, schema))
    np.testing.assert_array_equal(labels, np.array(LABELS, np.float32))
    np.testing.assert_array_equal(dense, np.array([[3.5, 1e30], [0, 1e30], [7, 1e30], [-2.25, 1e30]], np.float32))
    np.testing.assert_array_equal(keys[:, 0], [ref_key(0, s) for s in SITES])


def test_parquet_columns_of_type_null_are_missing_values(tmp_path):
    # A column of None alone is written as type null (pyarrow, pandas, polars): a dense,
    # categorical or multi-hot one was refused ("has type null, expected numbers"), though
    # each of its values, missing, is valid. It reads as a typed column of nulls does.
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"], "multi_hot": {"tags": ""}}
    typed = pa.table({"click": LABELS, "price": pa.array([None] * 4, pa.float64()),
                      "site": pa.array([None] * 4, pa.string()), "tags": pa.array([None] * 4, pa.list_(pa.string()))})
    untyped = pa.table({"click": LABELS, "price": pa.nulls(4), "site": pa.nulls(4), "tags": pa.nulls(4)})
    pq.write_table(typed, tmp_path / "typed.parquet")
    pq.write_table(untyped, tmp_path / "untyped.parquet")
    want = read_all(open_schema(tmp_path / "typed.parquet", schema))
    got = read_all(open_schema(tmp_path / "untyped.parquet", schema))
    for w, g in zip(want[:3], got[:3]):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[3][0].offsets, [0, 0, 0, 0, 0])
    assert len(got[3][0].keys) == 0
    # Text multi-hot too (a separator given).
    got = read_all(open_schema(tmp_path / "untyped.parquet", dict(schema, multi_hot={"tags": "|"})))
    np.testing.assert_array_equal(got[3][0].offsets, [0, 0, 0, 0, 0])


def test_parquet_errors_name_row_group_row_and_column(tmp_path):
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"click": [0, 1, 1, 0], "price": ["1", "2", "x", "3"], "site": ["a", "b", "c", "d"]}),
                   p, row_group_size=2)
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"]}
    with pytest.raises(DataError, match=r"bad.parquet: row group 1, row 3: column 'price': 'x' is not a number") \
            as e:
        list(SchemaParquet(p, schema))
    assert (e.value.line, e.value.field) == (3, "price")
    with pytest.raises(DataError, match=r"bad.parquet: no column 'os'"):
        list(SchemaParquet(p, dict(schema, categorical=["os"])))
    q = tmp_path / "float.parquet"
    pq.write_table(pa.table({"click": [0], "site": [1.5]}), q)
    with pytest.raises(DataError, match=r"float.parquet: categorical column 'site' has type double"):
        list(SchemaParquet(q, schema | {"dense": []}))
    r = tmp_path / "text.parquet"
    r.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"text.parquet: not a readable Parquet file"):
        list(SchemaParquet(r, schema))


@pytest.mark.parametrize("column", ["click", "price"])
def test_parquet_number_as_text_that_is_not_utf8_is_a_data_error_naming_it(tmp_path, column):
    # Parquet readers do not check string columns for UTF-8: a label or dense value
    # stored as text that is not UTF-8 raised UnicodeDecodeError, naming no file, row
    # or column, and skip_malformed could not skip it. It is a malformed row, quoted
    # as bytes.
    p = tmp_path / "latin.parquet"
    cols = {"click": pa.array(["1", "0", "1"]), "price": pa.array(["3.5", "2", "7"]), "site": ["a", "b", "c"]}
    cols[column] = pa.array([b"1", b"\xff\xfe", b"0"], pa.binary()).view(pa.string())
    pq.write_table(pa.table(cols), p)
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"]}
    why = "is not 0 or 1" if column == "click" else "is not a number"
    with pytest.raises(DataError) as e:
        list(SchemaParquet(p, schema))
    assert str(e.value) == f"{p}: row group 0, row 2: column {column!r}: b'\\xff\\xfe' {why}"
    assert (e.value.path, e.value.line, e.value.field) == (str(p), 2, column)
    reader = SchemaParquet(p, schema, skip_malformed=True)
    labels = read_all(reader)[0]
    assert len(labels) == 2 and reader.malformed == 1


# ------------------------------------------------------------------ libsvm

def test_libsvm_fields_by_index_range(tmp_path):
    p = tmp_path / "train.svm"
    p.write_text("1 3:1 12:0.5 4:2\n-1 11:1  # a comment\n\n+1 15:1\n")
    r = open_schema(p, {"fields": {"user": [0, 9], "item": [10, 19]}}, batch_size=2)
    labels, dense, keys, bags, batches = read_all(r)
    assert labels.tolist() == [1, 0, 1] and dense.shape == (3, 0) and keys.shape == (3, 0)
    user, item = bags
    np.testing.assert_array_equal(user.offsets, [0, 2, 2, 2])
    np.testing.assert_array_equal(user.keys, [ref_key(0, "3"), ref_key(0, "4")])
    np.testing.assert_array_equal(user.weights, np.array([1, 2], np.float32))
    np.testing.assert_array_equal(item.offsets, [0, 1, 2, 3])
    np.testing.assert_array_equal(item.keys, [ref_key(1, "12"), ref_key(1, "11"), ref_key(1, "15")])
    np.testing.assert_array_equal(item.weights, np.array([0.5, 1, 1], np.float32))
    assert [b.locate(i) for b in batches for i in range(len(b))] == [(str(p), 1), (str(p), 2), (str(p), 4)]
    # Without fields every index is one field.
    (one,) = read_all(Libsvm(p))[3]
    np.testing.assert_array_equal(one.offsets, [0, 3, 4, 5])


def test_libsvm_with_lone_cr_line_ends_reads_every_line(tmp_path):
    # Classic Mac OS "\r" line ends, as SchemaCsv reads them: the file was one line,
    # refused at its second label, or skipped whole with skip_malformed.
    p = tmp_path / "mac.svm"
    p.write_bytes(b"1 3:1 12:0.5 4:2\r-1 11:1  # a comment\r\r+1 15:1\r")
    reader = Libsvm(p, {"fields": {"user": [0, 9], "item": [10, 19]}}, skip_malformed=True)
    labels, _, _, (user, item), batches = read_all(reader)
    assert reader.malformed == 0 and labels.tolist() == [1, 0, 1]
    np.testing.assert_array_equal(user.offsets, [0, 2, 2, 2])
    np.testing.assert_array_equal(item.keys, [ref_key(1, "12"), ref_key(1, "11"), ref_key(1, "15")])
    assert [b.locate(i) for b in batches for i in range(len(b))] == [(str(p), 1), (str(p), 2), (str(p), 4)]
    p.write_bytes(b"1 3:1\r0 3:x\r")
    with pytest.raises(DataError, match=r"mac\.svm:2: '3:x'"):
        list(Libsvm(p))

def test_libsvm_errors_name_line_and_feature(tmp_path):
    p = tmp_path / "bad.svm"
    p.write_text("1 3:1\n0 3:x\n2 3:1\n1 3\n1 30:1\n")
    schema = {"fields": {"a": [0, 9]}}
    with pytest.raises(DataError, match=r"bad.svm:2: '3:x': the value is not a number"):
        list(Libsvm(p, schema))
    r = Libsvm(p, schema, skip_malformed=True)
    assert sum(len(b) for b in r) == 1
    assert r.malformed_examples == [f"{p}:2: '3:x': the value is not a number",
                                    f"{p}:3: label '2' is not 0, 1, -1 or +1",
                                    f"{p}:4: '3' is not index:value",
                                    f"{p}:5: feature index 30 is in no field of data.schema.fields"]


@pytest.mark.parametrize("token,message", [("12:x", "'12:x': the value is not a number"),
                                           ("12:inf", "'12:inf': the value is not finite"),
                                           ("2:12:1e39", "'2:12:1e39': the value is past float32's range"),
                                           ("12:1:x", "'12:1:x': the value is not a number")])
def test_libsvm_value_errors_name_the_field_of_their_index(tmp_path, token, message):
    # A malformed value raised DataError whose field was None, though its token's index
    # says which of data.schema.fields it is in (the CSV, Parquet and Criteo readers name
    # the column): the field named is the one holding the index (libFFM's own field
    # number, 2 in 2:12:1e39, is the file's, not the schema's).
    p = tmp_path / "bad.svm"
    p.write_text(f"1 3:1 12:1\n0 3:1 {token}\n")
    schema = {"fields": {"user": [0, 9], "item": [10, 19]}}
    with pytest.raises(DataError, match=re.escape(f"bad.svm:2: {message}")) as e:
        list(Libsvm(p, schema))
    want = "user" if token == "12:1:x" else "item"  # (12:1:x is field 12, index 1)
    assert (e.value.path, e.value.line, e.value.field) == (str(p), 2, want)
    with pytest.raises(DataError) as e:  # without fields every index is in one, "features"
        list(Libsvm(p))
    assert (e.value.line, e.value.field) == (2, "features")
    # An index that cannot be read, or that is in no field, leaves none to name.
    p.write_text("1 3:1\n0 x:1\n")
    with pytest.raises(DataError, match="the index is not a non-negative integer") as e:
        list(Libsvm(p, schema))
    assert (e.value.line, e.value.field) == (2, None)
    p.write_text("1 3:1\n0 30:x\n")
    with pytest.raises(DataError, match="'30:x': the value is not a number") as e:
        list(Libsvm(p, schema))
    assert (e.value.line, e.value.field) == (2, None)



def test_libsvm_token_of_more_than_three_parts_is_malformed(tmp_path):
    # A feature is index:value or libFFM's field:index:value. A token of more colons
    # ("1:2:3:4", "7:3:1:2") was read as the index between its last two and the value
    # after them, the rest dropped without a word: a misparse, not a feature.
    p = tmp_path / "colons.svm"
    p.write_text("1 3:1\n0 1:2:3:4\n1 7:3:1\n0 :3:1:2\n")
    with pytest.raises(DataError) as e:
        list(Libsvm(p))
    assert str(e.value) == f"{p}:2: '1:2:3:4' is not index:value or field:index:value"
    assert (e.value.path, e.value.line) == (str(p), 2)
    r = Libsvm(p, skip_malformed=True)
    _, _, _, (bag,), batches = read_all(r)
    assert r.malformed == 2
    assert [b.locate(i) for b in batches for i in range(len(b))] == [(str(p), 1), (str(p), 3)]
    np.testing.assert_array_equal(bag.keys, [ref_key(0, "3"), ref_key(0, "3")])  # (7:3:1: field 7, index 3)


# A bad line 9 and a later bad line 30 (see the test below): line, message.
LIBSVM_EARLIER = {"no-field": ("1 3:1 30:1", "feature index 30 is in no field of data.schema.fields"),
                  "value": ("1 3:x", "'3:x': the value is not a number")}
LIBSVM_LATER = {"value": ("0 4:1e400", "'4:1e400': the value is not finite"),
                "label": ("2 3:1", "label '2' is not 0, 1, -1 or +1"),
                "no-field": ("0 40:1", "feature index 40 is in no field of data.schema.fields")}


@pytest.mark.parametrize("long_line", [None, 5, 20])
@pytest.mark.parametrize("end", ["\n", "\r\n"])
@pytest.mark.parametrize("later", LIBSVM_LATER)
@pytest.mark.parametrize("earlier", LIBSVM_EARLIER)
def test_libsvm_first_error_is_the_lowest_lines(tmp_path, earlier, later, end, long_line):
    # The lines of a block that the line parser refused were reported before those
    # whose index is in no field, whatever their lines: a file with index 30 on line 9
    # and '3:x' on line 30 raised line 30 when the two shared a 1 MiB block (line 9 when
    # they did not), and with skip_malformed the kept malformed_examples were in that
    # order. The lowest line's error comes first, and each line keeps its number past
    # blank lines, CRLF line ends, and a line longer than a block (on line 5: both bad
    # lines in the block after it; on line 20: in two blocks).
    schema = {"fields": {"a": [0, 9]}}
    lines = [f"{i % 2} 3:{i}" for i in range(1, 61)]
    if long_line:
        lines[long_line - 1] = f"{long_line % 2} 3:{'0' * (1 << 20)}{long_line}"
    lines[7 - 1] = "   # a comment: a blank line"
    lines[12 - 1] = ""
    lines[9 - 1], first = LIBSVM_EARLIER[earlier]
    lines[30 - 1], second = LIBSVM_LATER[later]
    p = tmp_path / "order.svm"
    p.write_bytes(end.join(lines).encode())  # (the last line without a line end)
    good = [n for n in range(1, 61) if n not in (7, 9, 12, 30)]
    for batch_size in (4096, 7):
        with pytest.raises(DataError) as e:
            list(Libsvm(p, schema, batch_size))
        assert (str(e.value), e.value.line) == (f"{p}:9: {first}", 9), batch_size
        r = Libsvm(p, schema, batch_size, skip_malformed=True)
        labels, _, _, (bag,), batches = read_all(r)
        assert r.malformed_examples == [f"{p}:9: {first}", f"{p}:30: {second}"], batch_size
        assert [b.locate(i)[1] for b in batches for i in range(len(b))] == good, batch_size
        assert bag.weights.tolist() == good and labels.tolist() == [n % 2 for n in good]  # (a row's value: its line)


# ------------------------------------------------------------------ batches

def test_batch_rows_and_all_keys_keep_bags_with_their_rows():
    bags = Bags(np.arange(10, 16, dtype=np.uint64), np.array([0, 2, 2, 5, 6]))
    b = Batch(np.zeros(4, np.float32), np.zeros((4, 0), np.float32), np.arange(4, dtype=np.uint64)[:, None],
              bags=(bags,))
    part = b.rows(np.array([1, 2]))
    assert part.keys.ravel().tolist() == [1, 2]
    assert part.bags[0].keys.tolist() == [12, 13, 14] and part.bags[0].offsets.tolist() == [0, 0, 3]
    assert b.all_keys().tolist() == [0, 1, 2, 3] + list(range(10, 16))
    with pytest.raises(ValueError, match="consecutive"):
        b.rows(np.array([0, 2]))


def test_docstring_examples():
    import doctest

    import hps.data.epochs
    import hps.data.schema
    assert doctest.testmod(hps.data.schema).failed == 0
    assert doctest.testmod(hps.data.epochs).failed == 0


# ------------------------------------------------------------------ epochs and shuffling

def test_epochs_shuffle_every_row_once_an_epoch_deterministically(tmp_path):
    from hps.data import Epochs
    p = tmp_path / "rows.csv"
    # Row i: id i, tags "t<i>|u<i % 3>" (so a bag's keys tell which row it travelled with).
    p.write_text("click,id,tags\n" + "".join(f"{i % 2},{i},t{i}|u{i % 3}\n" for i in range(50)))
    reader = SchemaCsv(p, {"label": "click", "categorical": ["id"], "multi_hot": {"tags": "|"}}, batch_size=8)
    by_id = {ref_key(0, str(i)): i for i in range(50)}

    def ids_and_check(batches):
        ids = []
        for b in batches:
            assert len(b) <= 8
            for r in range(len(b)):
                i = by_id[int(b.keys[r, 0])]
                assert b.labels[r] == i % 2
                bag = b.bags[0].keys[b.bags[0].offsets[r]:b.bags[0].offsets[r + 1]].tolist()
                assert bag == [ref_key(1, f"t{i}"), ref_key(1, f"u{i % 3}")]
                ids.append(i)
        return ids

    first = ids_and_check(Epochs(reader, epochs=3, shuffle_buffer=20, seed=5))
    assert len(first) == 150
    for e in range(3):
        assert sorted(first[50 * e:50 * (e + 1)]) == list(range(50))
    assert first[:50] != list(range(50)) and first[:50] != first[50:100]  # shuffled, differently each epoch
    assert ids_and_check(Epochs(reader, epochs=3, shuffle_buffer=20, seed=5)) == first  # deterministic
    assert ids_and_check(Epochs(reader, epochs=3, shuffle_buffer=20, seed=6)) != first
    # Without a buffer: the reader's batches in file order, each epoch.
    plain = list(Epochs(reader, epochs=2))
    assert ids_and_check(plain) == list(range(50)) * 2 and plain[0].locate(0) == (str(p), 2)
    with pytest.raises(ValueError, match="epochs must be an int >= 1, got 0"):
        Epochs(reader, epochs=0)
    with pytest.raises(ValueError, match=r"shuffle_buffer must be an int >= 0 \(rows\), got -1"):
        Epochs(reader, shuffle_buffer=-1)


def test_fsspec_urls(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    with fs.open("/schema-test/a.csv", "wb") as f:
        f.write(CSV.encode())
    with fs.open("/schema-test/b.csv.gz", "wb") as f:
        f.write(gzip.compress(CSV.encode()))
    pq.write_table(pa.table({"click": LABELS, "price": PRICES, "site": SITES, "os": OSES,
                             "tags": TAGS}), tmp_path / "c.parquet")
    with fs.open("/schema-test/c.parquet", "wb") as f:
        f.write((tmp_path / "c.parquet").read_bytes())
    try:
        for name, schema in (("a.csv", SCHEMA), ("b.csv.gz", SCHEMA), ("c.parquet", dict(SCHEMA, skip=[]))):
            check_rows(*read_all(open_schema(f"memory://schema-test/{name}", schema))[:4])
    finally:
        fs.rm("/schema-test", recursive=True)


@pytest.mark.parametrize("block_bytes", [1 << 20, 16])
def test_csv_quoted_value_over_a_line_end_is_malformed_and_later_lines_keep_their_numbers(tmp_path, block_bytes):
    # pyarrow's parser lets a quoted value run on over a line end: a quote not closed
    # on its line swallowed the lines after it into one value (rows silently gone, not
    # counted), and every later row, and error, was named one line too early per line
    # end swallowed. Such a row is now malformed, and lines are counted in the file.
    schema = {"label": "click", "dense": ["price"], "categorical": "rest"}
    p = tmp_path / "q.csv"
    p.write_bytes(b'click,price,title\r\n1,2,a\r\n0,3,"two\r\nlines"\r\n1,4,b\r\n1,5\r\n0,6,c\r\n')
    r = SchemaCsv(p, schema, skip_malformed=True, block_bytes=block_bytes)
    _, dense, _, _, batches = read_all(r)
    assert [b.locate(i)[1] for b in batches for i in range(len(b))] == [2, 5, 7]
    np.testing.assert_array_equal(dense[:, 0], log1p([2, 4, 6]))
    assert sorted(r.malformed_examples) == [
        f"{p}:3: column 'title': 'two\\r\\nlines' runs on past the end of its line (a quote not closed on it?)",
        f"{p}:6: has 2 fields, expected 3"]
    # A quote not closed on its line takes the lines up to the next quote (the same at
    # any block size); each row read is on the line it names (its price is its line
    # number).
    p.write_text('click,price,title\n1,2,a\n0,3,"open\n1,4,b\n1,5,"c"\n0,6,d\n1,7,e\n')
    with pytest.raises(DataError, match=r"q.csv:3: column 'title': 'open\\n1,4,b\\n1,5,c\"' runs on past the end"):
        list(SchemaCsv(p, schema, block_bytes=block_bytes))
    r = SchemaCsv(p, schema, skip_malformed=True, block_bytes=block_bytes)
    _, dense, _, _, batches = read_all(r)
    assert [b.locate(i)[1] for b in batches for i in range(len(b))] == [2, 6, 7] and r.malformed == 1
    np.testing.assert_array_equal(dense[:, 0], log1p([2, 6, 7]))
    # A quote never closed would take the rest of the file as one malformed line: the
    # file is damaged (cut short?), and that raises even when skipping.
    p.write_text('click,price,title\n1,2,a\n0,3,"open\n1,4,b\n1,5,c\n0,6,d\n1,7,e\n')
    for skip in (True, False):
        match = "a quoted value runs on to the end of the file" if skip else \
            "column 'title': 'open.* runs on past the end of its"
        with pytest.raises(DataError, match=rf"q.csv:3: {match}") as e:
            list(SchemaCsv(p, schema, skip_malformed=skip, block_bytes=block_bytes))
        assert e.value.line == 3


def test_csv_crlf_split_by_a_block_boundary_keeps_the_lines_after_it(tmp_path):
    # pyarrow 26 drops the "\n" of a "\r\n" inside a quoted value when its "\r" is the
    # last byte of a block and its "\n" the first of the next: the value read as one
    # line ('two\rlines'), its row valid, and every later row and error named a line
    # too early ('q.csv:6: has 2 fields' for line 7). Every block size here puts a "\r"
    # of the file, inside a quoted value or outside one, at a block's end.
    schema = {"label": "c", "dense": ["p"], "categorical": "rest"}
    p = tmp_path / "q.csv"
    data = b'c,p,t\r\n1,2,a\r\n0,3,"two\r\nlines"\r\n1,5,b\r\n1,6,"c"\r\n1,7\r\n0,8,d\r\n1,9,"e\r\nf"\r\n1,11,g\r\n'
    p.write_bytes(data)
    quoted = [i for i in range(len(data)) if data[:i].count(b'"') % 2]
    split = {"inside": [], "outside": []}  # block sizes whose first block ends in a "\r", by where it is
    for i in range(len(data) - 1):
        if data[i:i + 2] == b"\r\n" and i + 1 >= 8:
            split["inside" if i in quoted else "outside"].append(i + 1)
    assert split["inside"] and split["outside"]
    reference = read_all(SchemaCsv(p, schema, skip_malformed=True))
    for block_bytes in sorted(split["inside"] + split["outside"]) + [1 << 20]:
        r = SchemaCsv(p, schema, skip_malformed=True, block_bytes=block_bytes)
        labels, dense, keys, _, batches = read_all(r)
        assert [b.locate(i)[1] for b in batches for i in range(len(b))] == [2, 5, 6, 8, 11], block_bytes
        np.testing.assert_array_equal(dense[:, 0], log1p([2, 5, 6, 8, 11]))
        np.testing.assert_array_equal(keys, reference[2])
        np.testing.assert_array_equal(labels, reference[0])
        assert sorted(r.malformed_examples) == [
            f"{p}:3: column 't': 'two\\r\\nlines' runs on past the end of its line (a quote not closed on it?)",
            f"{p}:7: has 2 fields, expected 3",
            f"{p}:9: column 't': 'e\\r\\nf' runs on past the end of its line (a quote not closed on it?)"], \
            block_bytes
        with pytest.raises(DataError, match=r"q.csv:3: column 't': 'two\\r\\nlines' runs on") as e:
            list(SchemaCsv(p, schema, block_bytes=block_bytes))
        assert e.value.line == 3


@pytest.mark.parametrize("value", ["two\nlines", "a\nb\nc", "\nstarts", "x,\n,y"])
@pytest.mark.parametrize("before", [0, 1, 3])
def test_csv_quoted_value_over_a_line_end_reads_the_same_at_any_block_size(tmp_path, value, before):
    # pyarrow cut its blocks at any line end, inside a quoted value too (newlines_in_values
    # = False): where a block boundary fell inside the value, the read stopped ("cannot
    # read at or after line 5") even with skip_malformed, the value's tail came as a
    # malformed line of its own, or the rows after it were swallowed silently.
    schema = {"label": "c", "dense": ["p"], "categorical": "rest"}
    rows = [f"{i % 2},{i},r{i}" for i in range(before)] + [f'1,99,"{value}"'] \
        + [f"{i % 2},{i},s{i}" for i in range(4)] + ["1,5"] + ["0,7,z"]
    p = tmp_path / "q.csv"
    p.write_bytes(("c,p,t\n" + "\n".join(rows) + "\n").encode())
    at, spans = 2 + before, value.count("\n")
    want_lines = list(range(2, at)) + [at + spans + 1 + i for i in range(4)] + [at + spans + 7 - 1]
    for block_bytes in [*range(8, 130, 3), 1 << 20]:
        r = SchemaCsv(p, schema, skip_malformed=True, block_bytes=block_bytes)
        _, dense, _, _, batches = read_all(r)
        assert [b.locate(i)[1] for b in batches for i in range(len(b))] == want_lines, block_bytes
        assert sorted(r.malformed_examples) == sorted([
            f"{p}:{at}: column 't': {value!r} runs on past the end of its line (a quote not closed on it?)",
            f"{p}:{at + spans + 5}: has 2 fields, expected 3"]), block_bytes
    # Without skipping, the value is raised at every block size (before the line of the
    # wrong field count after it).
    for block_bytes in [*range(8, 130, 3), 1 << 20]:
        with pytest.raises(DataError, match=rf"q.csv:{at}: column 't': .* runs on past the end of its line"):
            list(SchemaCsv(p, schema, block_bytes=block_bytes))


@pytest.mark.parametrize("block_bytes", [8, 20, 40, 1 << 20])
def test_csv_lines_after_a_value_ending_in_a_line_end_keep_their_numbers(tmp_path, block_bytes):
    # A value that ends in a line end ('"x\n"') was taken for a quote never closed, which
    # had swallowed its row's own line end, and a row of a wrong field count over a
    # line end ('1,"y\nz"') did not count its line ends: every later row and error was
    # named a line too early.
    schema = {"label": "c", "dense": ["p"], "categorical": "rest"}
    p = tmp_path / "q.csv"
    p.write_bytes(b'c,p,t\n1,2,a\n0,3,"x\n"\n1,5,b\n1,6\n1,"y\nz"\n0,9,"\n"\n1,11,c\n0,12\n1,13,d\n')
    r = SchemaCsv(p, schema, skip_malformed=True, block_bytes=block_bytes)
    _, dense, _, _, batches = read_all(r)
    lines = [b.locate(i)[1] for b in batches for i in range(len(b))]
    assert lines == [2, 5, 11, 13]
    np.testing.assert_array_equal(dense[:, 0], log1p(lines))  # (a row's price: its line)
    assert sorted(r.malformed_examples, key=lambda m: int(m.split(":")[1])) == [
        f"{p}:3: column 't': 'x\\n' runs on past the end of its line (a quote not closed on it?)",
        f"{p}:6: has 2 fields, expected 3",
        f"{p}:7: has 2 fields, expected 3",
        f"{p}:9: column 't': '\\n' runs on past the end of its line (a quote not closed on it?)",
        f"{p}:12: has 2 fields, expected 3"]


@pytest.mark.parametrize("block_bytes", [8, 16, 40, 1 << 20])
@pytest.mark.parametrize("schema", [{"skip": ["id", "note"]}, {}])
def test_csv_line_ends_in_a_column_not_read_are_counted(tmp_path, block_bytes, schema):
    # Line ends were counted in the columns the schema reads only: after a quoted value
    # over a line end in a skipped column (or one the schema does not name), every later
    # row and error was named a line too early per line end, and a quote not closed
    # there took the lines up to the next quote unseen. Such a value makes its row
    # malformed as in any other column.
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"], **schema}
    p = tmp_path / "s.csv"
    p.write_text('id,click,price,site,note\n1,0,2,a,x\n2,1,3,b,"two\nlines"\n4,0,5,c,y\n5,1,abc,d,z\n6,0\n'
                 '7,1,8,e,w\n8,0,9,f,"open\n9,1,10,g,h\n10,0,11,h,"\n11,1,12,i,j\n')
    with pytest.raises(DataError, match=r"s.csv:3: column 'note': 'two\\nlines' runs on past the end of its line") \
            as e:
        list(SchemaCsv(p, schema, block_bytes=block_bytes))
    assert (e.value.line, e.value.field) == (3, "note")
    r = SchemaCsv(p, schema, skip_malformed=True, block_bytes=block_bytes)
    _, dense, _, _, batches = read_all(r)
    lines = [b.locate(i)[1] for b in batches for i in range(len(b))]
    assert lines == [2, 5, 8, 12]
    np.testing.assert_array_equal(dense[:, 0], log1p([2, 5, 8, 12]))  # (a row's price: its line)
    assert r.malformed_examples == [
        f"{p}:3: column 'note': 'two\\nlines' runs on past the end of its line (a quote not closed on it?)",
        f"{p}:6: column 'price': 'abc' is not a number", f"{p}:7: has 2 fields, expected 5",
        f"{p}:9: column 'note': 'open\\n9,1,10,g,h\\n10,0,11,h,' runs on past the end of its line (a quote not "
        f"closed on it?)"]
    # A quote never closed there raises even when skipping, as in a column read.
    p.write_text('id,click,price,site,note\n1,0,2,a,x\n2,1,3,b,"open\n3,0,4,c,y\n')
    for skip in (True, False):
        with pytest.raises(DataError, match=r"s.csv:3: a quoted value runs on to the end of the file|"
                                            r"s.csv:3: column 'note': 'open.* runs on past the end"):
            list(SchemaCsv(p, schema, skip_malformed=skip, block_bytes=block_bytes))


@pytest.mark.parametrize("at", [2, 3, 12, 40, 61])
def test_csv_line_longer_than_the_read_blocks(tmp_path, at):
    # pyarrow refuses a line longer than about two of its blocks ("straddling object
    # straddles two block boundaries"), and block_bytes is no [data] setting: a CSV
    # with one long multi-hot row could not be read at all (5 MB with the default
    # 1 MiB). The file is read again with larger blocks from the line not yet given;
    # every row comes once, in order, and a skipped line is counted once.
    lines = ["click,price,site,tags"] + [f"{i % 2},{i},s{i % 7},t{i % 3}|t{i % 5}" for i in range(60)]
    lines[at - 1] = "1,5,long," + "|".join(f"item{j}" for j in range(400))
    lines[7 - 1] = "1,abc,s,t"  # a bad value
    lines[30 - 1] = "1,2"  # a wrong field count
    p = tmp_path / "long.csv"
    p.write_text("\n".join(lines) + "\n")
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"], "multi_hot": {"tags": "|"}}
    whole = SchemaCsv(p, schema, 16, block_bytes=1 << 20, skip_malformed=True)
    want = read_all(whole)
    small = SchemaCsv(p, schema, 16, block_bytes=200, skip_malformed=True)
    got = read_all(small)
    for a, b in zip(got[:3], want[:3], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[3][0].keys, want[3][0].keys)
    np.testing.assert_array_equal(got[3][0].offsets, want[3][0].offsets)
    assert [b.locate(i) for b in got[4] for i in range(len(b))] == \
        [(str(p), ln) for ln in range(2, 62) if ln not in (7, 30)]
    assert small.malformed == whole.malformed == 2
    assert small.malformed_examples == whole.malformed_examples
    # Without skipping, the first bad line is named as before.
    with pytest.raises(DataError, match=r"long.csv:7: column 'price': 'abc' is not a number"):
        list(SchemaCsv(p, schema, 16, block_bytes=200))


@pytest.mark.parametrize("name", ["e.csv", "e.csv.gz"])
def test_csv_empty_line_is_named_an_empty_line_as_the_criteo_reader_names_it(tmp_path, name):
    # pyarrow reads an empty line as a row of empty values, so it was reported as
    # "column 'click': '' is not 0 or 1", a row of commas' message. Empty lines are
    # looked up in the file (past its first MiB too, CRLF or not, compressed or not);
    # a row of empty values keeps its column's message.
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"], "skip": ["id"]}
    rows = [f"{i},{i % 2},{i},s{i % 7}" for i in range(80000)]  # about 1.3 MB
    empty = {3, 5, 40000, 79999}  # 1-based lines of the file, the header line 1
    for ln in sorted(empty):
        rows[ln - 2] = ""
    rows[10 - 2] = ",,,"
    rows[11 - 2] = "7,,,"  # empty but for a column not read
    rows[12 - 2] = "\r"  # (an empty CRLF line)
    text = ("id,click,price,site\n" + "\n".join(rows) + "\n").encode()
    p = tmp_path / name
    p.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    with pytest.raises(DataError, match=rf"^{p}:3: is an empty line, expected 4 fields$") as e:
        list(SchemaCsv(p, schema))
    assert (e.value.line, e.value.field) == (3, None)
    r = SchemaCsv(p, schema, skip_malformed=True)
    _, dense, _, _, batches = read_all(r)
    lines = [b.locate(i)[1] for b in batches for i in range(len(b))]
    assert lines == [ln for ln in range(2, 80002) if ln not in empty | {10, 11, 12}]
    np.testing.assert_array_equal(dense[:, 0], log1p(np.array(lines) - 2))
    assert r.malformed == 7
    assert sorted(r.malformed_examples) == sorted(
        [f"{p}:{ln}: is an empty line, expected 4 fields" for ln in empty | {12}]
        + [f"{p}:{ln}: column 'click': '' is not 0 or 1" for ln in (10, 11)])


def test_open_schema_format_tsv_reads_tabs_whatever_the_name(tmp_path):
    # format="tsv" was taken as "csv", whose delimiter comes from the name: a tab-
    # separated clicks.txt was split at commas ("no column 'click' (the file's
    # columns: click\tprice\tsite)"). "tsv" now means tabs unless the schema says.
    p = tmp_path / "clicks.txt"
    p.write_text("click\tprice\tsite\n1\t2\ta,b\n")
    schema = {"label": "click", "dense": ["price"], "categorical": "rest"}
    (batch,) = list(open_schema(p, schema, format="tsv"))
    assert batch.keys.tolist() == [[ref_key(0, "a,b")]]
    with pytest.raises(DataError, match="no column 'click'"):
        list(open_schema(p, schema, format="csv"))
    q = tmp_path / "semi.txt"
    q.write_text("click;price;site\n1;2;x\n")
    (batch,) = list(open_schema(q, {**schema, "delimiter": ";"}, format="tsv"))  # the schema's delimiter wins
    assert batch.keys.tolist() == [[ref_key(0, "x")]]


def test_csv_line_ends_and_files_without_rows(tmp_path):
    schema = {"label": "click", "categorical": "rest"}
    want = [[ref_key(0, "x")], [ref_key(0, "y")]]
    for name, text in (("crlf.csv", "click,a\r\n1,x\r\n0,y\r\n"), ("no_end.csv", "click,a\n1,x\n0,y")):
        (tmp_path / name).write_bytes(text.encode())
        labels, _, keys, _, _ = read_all(SchemaCsv(tmp_path / name, schema))
        assert labels.tolist() == [1, 0] and keys.tolist() == want, name
    # A header alone gave no rows without a word, as a Parquet file of 0 rows did: it
    # warns, as an empty TSV or libsvm file does.
    for name, text in (("header.csv", "click,a\n"), ("header_no_end.csv", "click,a")):
        (tmp_path / name).write_bytes(text.encode())
        with pytest.warns(EmptyFileWarning) as got:
            assert list(SchemaCsv(tmp_path / name, schema)) == [], name
        assert [str(w.message) for w in got] == [f"{tmp_path / name}: empty file (a header, no rows): no examples "
                                                 f"read from it"]
    # Lines after the header, all malformed and skipped, are not an empty file (counted, not warned).
    (tmp_path / "bad.csv").write_bytes(b"click,a\n7,x\n")
    r = SchemaCsv(tmp_path / "bad.csv", schema, skip_malformed=True)
    assert list(r) == [] and r.malformed == 1
    # An empty line first is a malformed file, not an empty one.
    (tmp_path / "blank.csv").write_bytes(b"\n1,x\n")
    with pytest.raises(DataError, match=r"blank.csv:1: the first line is empty"):
        list(SchemaCsv(tmp_path / "blank.csv", schema))


@pytest.mark.parametrize("first", [b"\n", b"\r\n", b"\r"])
def test_an_empty_line_1_of_a_headerless_csv_is_skipped_as_any_empty_line_is(tmp_path, first):
    # It was refused even with skip_malformed ("the first line is empty"), where an empty
    # line anywhere else is skipped and counted.
    schema = {"label": 0, "categorical": "rest", "header": False}
    path = tmp_path / "blank.csv"
    path.write_bytes(first + b"1,x,a" + first + first + b"0,y,b" + first)  # lines 1 and 3 empty
    r = SchemaCsv(path, schema, skip_malformed=True)
    labels, _, keys, _, _ = read_all(r)
    assert labels.tolist() == [1, 0] and keys.tolist() == [[ref_key(0, "x"), ref_key(1, "a")],
                                                           [ref_key(0, "y"), ref_key(1, "b")]]
    assert r.malformed == 2
    one, three = r.malformed_examples
    assert one.startswith(f"{path}:1: ") and one.replace(":1: ", ":3: ") == three
    if first != b"\r":  # (an empty line of a lone "\r" reads as a row of one empty field)
        assert three == f"{path}:3: is an empty line, expected 3 fields"
    with pytest.raises(DataError, match=r"blank.csv:1: the first line is empty"):
        list(SchemaCsv(path, schema))
    # A file of empty lines alone has no field count to read the rest by: refused even so.
    path.write_bytes(first * 3)
    with pytest.raises(DataError, match=r"blank.csv:1: the first line is empty"):
        list(SchemaCsv(path, schema, skip_malformed=True))


@pytest.mark.parametrize("header", [True, False])
def test_a_csv_file_of_0_bytes_warns_naming_it_and_the_others_are_read(tmp_path, header):
    """A 0-byte CSV file was refused ('empty.csv:1: empty file') where a 0-byte Criteo
    TSV or libsvm file, and a CSV file of a header alone, warn and the other files are
    read: a directory of an export's parts may hold empty ones (Spark writes an empty
    partition's part without its header). It has no rows, so no fields to check."""
    import gzip
    schema = {"label": "click" if header else 0, "categorical": "rest", "header": header}
    d = tmp_path / "day"
    d.mkdir()
    (d / "part-0.csv").write_bytes(b"")  # first: the model's shape comes from the first file with data
    (d / "part-1.csv").write_bytes((b"click,a\n" if header else b"") + b"1,x\n0,y\n")
    (d / "part-2.csv.gz").write_bytes(gzip.compress(b""))
    reader = SchemaCsv(d, schema)
    assert reader.widths() == (0, 1, 0)
    with pytest.warns(EmptyFileWarning) as got:
        labels, _, keys, _, _ = read_all(reader)
    assert labels.tolist() == [1, 0] and keys.tolist() == [[ref_key(0, "x")], [ref_key(0, "y")]]
    assert [str(w.message) for w in got] == [
        f"{d / 'part-0.csv'}: empty file (no data): no examples read from it",
        f"{d / 'part-2.csv.gz'}: empty file (no data once decompressed): no examples read from it"]
    # Every file empty: no fields to take the model's shape from, said as such.
    reader = SchemaCsv([d / "part-0.csv", d / "part-2.csv.gz"], schema)
    with pytest.raises(DataError, match=re.escape(f"{d / 'part-0.csv'}: the data holds no examples (2 file(s), "
                                                  f"each empty): no fields to take the model's shape from")):
        reader.widths()
    with pytest.warns(EmptyFileWarning):
        assert list(reader) == []


# ------------------------------------------------------------------ synthetic multi-hot fields

def test_synthetic_multi_hot_fields():
    from hps.data import SyntheticCriteo
    plain = list(SyntheticCriteo(seed=3, batch_size=1000, examples=5000))
    fields = [(1000, 3.0), (50, 1.0)]
    multi = list(SyntheticCriteo(seed=3, batch_size=1000, examples=5000, multi_hot=fields, bag_length="geometric"))
    # The single-hot fields and dense features are the stream without bags.
    for a, b in zip(plain, multi, strict=True):
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.dense, b.dense)
    bags = [Bags.concat([b.bags[j] for b in multi]) for j in range(2)]
    for (vocab, mean), bag in zip(fields, bags, strict=True):
        lengths = np.diff(bag.offsets)
        assert len(lengths) == 5000 and abs(lengths.mean() - mean) < 0.1 * mean
        assert (lengths == 0).any() and lengths.max() > 3 * mean  # geometric: empty bags and a long tail
    # Keys of field 26 + j: the bijective hash of an id below the vocabulary.
    assert bags[1].keys[0] in {ref_id_key(26 + 1, i) for i in range(50)}
    # The same bags whatever the batch size.
    other = list(SyntheticCriteo(seed=3, batch_size=700, examples=5000, multi_hot=fields, bag_length="geometric"))
    for j in range(2):
        again = Bags.concat([b.bags[j] for b in other])
        np.testing.assert_array_equal(again.keys, bags[j].keys)
        np.testing.assert_array_equal(again.offsets, bags[j].offsets)
    # The bags carry signal: the hidden logit with them ranks the labels better than without.
    gen = SyntheticCriteo(seed=3, examples=20000, multi_hot=[(200, 4.0)], bag_length="fixed")
    b = next(iter(SyntheticCriteo(seed=3, batch_size=20000, examples=20000, multi_hot=[(200, 4.0)],
                                  bag_length="fixed")))
    assert (np.diff(b.bags[0].offsets) == 4).all()
    with_bags = gen.hidden_logit(b)
    without = gen.hidden_logit(Batch(b.labels, b.dense, b.keys))
    assert auc(b.labels, with_bags - without) > 0.55  # the bag's share of the logit alone
    assert auc(b.labels, with_bags) > auc(b.labels, without)
    with pytest.raises(ValueError, match=r"multi_hot\[0\] must be \(vocabulary size"):
        SyntheticCriteo(multi_hot=[(0, 1.0)])
    with pytest.raises(ValueError, match=r"bag_length must be 'poisson', 'geometric' or 'fixed'"):
        SyntheticCriteo(multi_hot=[(10, 1.0)], bag_length="zipf")


def ref_id_key(field: int, value: int) -> int:
    k = splitmix(((field + 1) << 32) ^ value)
    return 0xFFFF_FFFF_FFFF_FFFE if k == M64 else k


def auc(labels, scores):
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    pos = labels > 0.5
    return (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


def test_libsvm_reads_plain_lines_as_written(tmp_path):
    p = tmp_path / "plain.svm"
    p.write_text("1 3:1 12:0.5 4:2\n\n  0\t11:1e-3   15:.5 \n+1 15:1\n-1 007:4 19:-2.5\n1.0 0:1")
    schema = {"fields": {"user": [0, 9], "item": [10, 19]}}
    labels, _, _, bags, batches = read_all(Libsvm(p, schema, batch_size=2))
    assert labels.tolist() == [1, 0, 1, 0, 1]  # the blank line is no example
    user, item = bags
    assert user.keys.tolist() == [ref_key(0, "3"), ref_key(0, "4"), ref_key(0, "7"), ref_key(0, "0")]
    assert user.offsets.tolist() == [0, 2, 2, 2, 3, 4] and user.weights.tolist() == [1, 2, 4, 1]
    assert item.keys.tolist() == [ref_key(1, "12"), ref_key(1, "11"), ref_key(1, "15"), ref_key(1, "15"),
                                  ref_key(1, "19")]
    assert item.offsets.tolist() == [0, 1, 3, 4, 5, 5]
    np.testing.assert_array_equal(item.weights, np.float32([0.5, 1e-3, 0.5, 1, -2.5]))
    # Each example keeps its line (4 and 5 share a span): line 2 was blank.
    assert [(s.first_line, s.count) for b in batches for s in b.sources] == [(1, 1), (3, 1), (4, 2), (6, 1)]
    # A bad token among plain lines is named by the reference line parser.
    q = tmp_path / "bad.svm"
    q.write_text("1 3:1\n0 3:1e400\n")
    with pytest.raises(DataError, match=r"bad.svm:2: '3:1e400': the value is not finite"):
        list(Libsvm(q, schema))
    # Values are stored as float32: one that would be inf there is refused by both
    # parsers (the first 3.4028235677973366e38 rounds to inf, the least that does).
    q.write_text("1 3:3.4028234e38\n0 3:3.4028235677973366e38\n1 3:-1e39\n")
    with pytest.raises(DataError, match=r"bad.svm:2: '3:3.4028235677973366e38': the value is past float32's range"):
        list(Libsvm(q, schema))
    r = Libsvm(q, schema, skip_malformed=True)
    weights = np.concatenate([b.bags[0].weights for b in r])
    assert weights.tolist() == [np.finfo(np.float32).max] and r.malformed == 2


def test_a_parquet_file_of_no_rows_warns_naming_it(tmp_path):
    # A Parquet part of 0 rows gave 0 examples without a word, where an empty TSV part warns.
    schema = {"label": "click", "categorical": ["site"]}
    table = pa.table({"click": [1, 0], "site": ["a", "b"]})
    pq.write_table(table, tmp_path / "a.parquet")
    pq.write_table(table.slice(0, 0), tmp_path / "b.parquet")
    with pytest.warns(EmptyFileWarning) as got:
        labels, *_ = read_all(SchemaParquet([tmp_path / "a.parquet", tmp_path / "b.parquet"], schema))
    assert labels.tolist() == [1, 0]
    assert [str(w.message) for w in got] == [f"{tmp_path / 'b.parquet'}: empty file (no rows): no examples read "
                                             f"from it"]


def test_an_empty_libsvm_file_warns_naming_it(tmp_path):
    # A 0-byte file gave 0 examples without a word; a file of blank lines or
    # comments is not empty (its lines are read, and hold no example).
    from hps.data import EmptyFileWarning
    (tmp_path / "a.svm").write_text("1 3:1\n")
    (tmp_path / "b.svm").write_bytes(b"")
    with pytest.warns(EmptyFileWarning, match=r"b.svm: empty file \(no data\): no examples read from it") as got:
        labels, *_ = read_all(Libsvm([tmp_path / "a.svm", tmp_path / "b.svm"]))
    assert labels.tolist() == [1] and len(got) == 1
    (tmp_path / "b.svm").write_text("\n# nothing yet\n")
    assert list(Libsvm(tmp_path / "b.svm")) == []


def test_libsvm_takes_no_block_lines(tmp_path):
    # Libsvm(block_lines=...) was accepted and never used (the reader parses 1 MiB of
    # lines at a time whatever it said): a caller tuning it changed nothing.
    p = tmp_path / "a.svm"
    p.write_text("1 3:1\n")
    with pytest.raises(TypeError, match="block_lines"):
        Libsvm(p, block_lines=16)
    with pytest.raises(TypeError, match="block_lines"):
        open_schema(p, Schema(), block_lines=16)


def test_directories_globs_and_mixed_kinds(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "part-0.csv").write_text(CSV)
    (d / "part-1.csv.gz").write_bytes(gzip.compress(CSV.encode()))
    (d / "_SUCCESS").write_text("")
    for source in (d, str(d / "part-*")):
        labels, dense, keys, bags, batches = read_all(open_schema(source, SCHEMA))
        assert labels.tolist() == LABELS * 2
        np.testing.assert_array_equal(keys, np.concatenate([expected_keys()] * 2))
        assert batches[0].sources[-1].path.endswith("part-1.csv.gz")
    (d / "part-2.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"mixes csv and parquet files; give one kind, or format="):
        open_schema(d, SCHEMA)
    with pytest.raises(ValueError, match=r"format must be 'csv', 'parquet' or 'libsvm' with a schema, got 'orc'"):
        open_schema(d / "part-0.csv", SCHEMA, format="orc")


@pytest.mark.parametrize("header", [True, False])
def test_csv_with_lone_cr_line_ends_reads_every_row(tmp_path, header):
    # "\r" alone ends a line for pyarrow (classic Mac files, Excel's "CSV (Macintosh)"),
    # but the header was looked for up to the first "\n": a file without one was taken
    # for a header with no line end, "no rows", and read as 0 examples without a word.
    schema = {"label": "click", "dense": ["price"], "categorical": ["site"], "header": header}
    if not header:
        schema.update(label=0, dense=[1], categorical=[2])
    p = tmp_path / "mac.csv"
    p.write_bytes((b"click,price,site\r" if header else b"") + b"1,2,a\r0,3,b\r1,4,c\r")
    labels, dense, keys, _, batches = read_all(SchemaCsv(p, schema))
    np.testing.assert_array_equal(labels, [1, 0, 1])
    np.testing.assert_array_equal(dense, log1p([2, 3, 4])[:, None])
    np.testing.assert_array_equal(keys[:, 0], [ref_key(0, v) for v in "abc"])
    first = 2 if header else 1
    assert [b.locate(i)[1] for b in batches for i in range(len(b))] == [first, first + 1, first + 2]
    # A bad row is named by that line (each "\r" ends one).
    p.write_bytes((b"click,price,site\r" if header else b"") + b"1,2,a\r0,x,b\r")
    with pytest.raises(DataError, match=rf"mac.csv:{first + 1}: column '(price|1)': 'x' is not a number"):
        list(SchemaCsv(p, schema))
