"""Online training: a directory that grows while the run reads it (hps.data.GrowingDirectory),
its stop conditions and named errors, and progressive validation (hps.progressive) against a
reference scored in the test with the model as it is before each step."""
import collections
import gzip
import json
import os
import re
import threading
import time

import numpy as np
import pytest

from hps.data import DataError, GrowingDirectory, open_criteo, open_schema
from hps.data.online import ready_files
from hps.progressive import ProgressiveWindow

SCHEMA = {"label": "click", "dense": ["price"], "categorical": ["site"], "multi_hot": {"tags": "|"}}
HEADER = "click,price,site,tags\n"


def rows(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        site = int(rng.integers(0, 20))
        tags = sorted(set(rng.integers(0, 8, rng.integers(0, 4)).tolist()))
        p = 0.1 + 0.4 * (site < 5) + 0.45 * (3 in tags)
        out.append(f"{int(rng.random() < p)},{rng.integers(0, 100)},s{site},{'|'.join(f't{t}' for t in tags)}\n")
    return out


def csv_reader(path):
    return open_schema([path], SCHEMA, 16)


def pair_auc(y, p):
    """AUC by counting pairs (ties half): the definition, independent of hps.metrics's ranks."""
    pos, neg = p[y > 0.5], p[y <= 0.5]
    return ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))


@pytest.mark.parametrize("n_scores", [3, 5, 1])
def test_metrics_refuse_labels_and_scores_of_different_lengths_naming_both(n_scores):
    """auc raised numpy's IndexError (boolean index did not match), naming neither
    length; logloss broadcast a single score against every label, a number with no
    error."""
    from hps.metrics import auc, logloss
    y = np.array([0, 1, 0, 1], np.float32)
    p = np.linspace(0.1, 0.9, n_scores).astype(np.float32)
    with pytest.raises(ValueError, match=f"auc: 4 labels but {n_scores} scores"):
        auc(y, p)
    with pytest.raises(ValueError, match=f"logloss: 4 labels but {n_scores} probs"):
        logloss(y, p)


def test_metrics_refuse_scores_of_more_than_one_dimension():
    """Scores of shape (n, 1) (a model's output left unsqueezed) against labels of
    shape (n,): logloss broadcast them to (n, n) pairs and auc sorted each one-score
    row, both a number with no error."""
    from hps.metrics import auc, logloss
    y = np.array([0, 1, 0, 1], np.float32)
    p = np.array([[0.2], [0.7], [0.4], [0.6]], np.float32)
    with pytest.raises(ValueError, match=r"auc: scores of shape \(4, 1\), labels of shape \(4,\): give 1-D arrays"):
        auc(y, p)
    with pytest.raises(ValueError, match=r"logloss: probs of shape \(4, 1\), labels of shape \(4,\)"):
        logloss(y, p)
    assert auc(y, p[:, 0]) == 1.0


def test_ready_files_are_those_unchanged_since_the_last_poll():
    before = {"a.csv": (10, 1), "b.csv": (5, 1), "c.csv": (7, 1)}
    now = {"c.csv": (7, 1), "a.csv": (10, 1), "b.csv": (9, 2), "d.csv": (1, 3)}
    assert ready_files(before, now) == ["a.csv", "c.csv"]  # b grew, d is new: both wait a poll


def test_files_that_appear_during_the_run_are_read_whole_in_name_order(tmp_path):
    data = tmp_path / "stream"
    data.mkdir()
    (data / "part-000.csv").write_text(HEADER + "".join(rows(20, 0)))
    expected = {"part-000.csv": 20, "part-001.csv": 30, "part-002.csv": 25, "part-003.csv": 40}
    slow_done, read_000, read_001 = threading.Event(), threading.Event(), threading.Event()

    def writer():
        read_000.wait(10)
        # Under a temporary name, then renamed: never a candidate while written. The rename
        # waits until part-001 (written after it) was read, so the polls that took part-001 saw it.
        (data / "part-002.csv.tmp").write_text(HEADER + "".join(rows(25, 2)))
        (data / "part-001.csv").write_text(HEADER + "".join(rows(30, 1)))
        read_001.wait(10)
        os.rename(data / "part-002.csv.tmp", data / "part-002.csv")
        # Written in place, a line every 10 ms for 0.4 s: its size changes between any two polls
        # (0.2 s apart; a writer that paused longer would be taken for done: hence the rule above).
        with open(data / "part-003.csv", "w") as f:
            f.write(HEADER)
            for line in rows(40, 3):
                f.write(line)
                f.flush()
                time.sleep(0.01)
        slow_done.set()

    t = threading.Thread(target=writer)
    t.start()
    src = GrowingDirectory(data, csv_reader, poll=0.2, idle=1.0, marker=None)
    seen = {}
    for b in src:
        for s in b.sources:
            name = os.path.basename(s.path)
            seen[name] = seen.get(name, 0) + s.count
        current = os.path.basename(b.sources[0].path)
        if current == "part-000.csv":
            read_000.set()
        elif current == "part-001.csv":
            read_001.set()
        elif current == "part-003.csv":
            assert slow_done.is_set(), "the file being written was read before its writer finished"
    t.join()
    assert seen == expected
    assert [os.path.basename(f) for f in src.files_read] == sorted(expected)
    assert src.examples_read == sum(expected.values())


def test_files_in_subdirectories_are_read_in_the_order_a_finite_directory_lists_them(tmp_path):
    # A growing directory listed its top level alone: the files of a writer that puts
    # them in partitions or buckets (Spark's day=.../part-0, Flink's 2026-01-01--12/)
    # were never read, without a word, and the source ended at its idle time. Hidden
    # names ("_spark_metadata/", Flink's ".part-1.inprogress") and temporary suffixes
    # are left out at every depth, directories too.
    from hps.data import list_files
    from hps.data.online import owner
    (tmp_path / "day=1").mkdir()
    (tmp_path / "day=2" / "hour=3").mkdir(parents=True)
    (tmp_path / "top.csv").write_text(HEADER + "".join(rows(10, 1)))
    (tmp_path / "day=1" / "part-0.csv").write_text(HEADER + "".join(rows(20, 2)))
    (tmp_path / "day=2" / "hour=3" / "part-0.csv").write_text(HEADER + "".join(rows(30, 3)))
    names = ["day=1/part-0.csv", "day=2/hour=3/part-0.csv", "top.csv"]
    assert [os.path.relpath(f, tmp_path) for f in list_files(tmp_path)] == names
    for junk in ("_spark_metadata/0", "day=1/.part-1.csv.inprogress", "day=3.tmp/part-0.csv", "day=1/x.csv.tmp"):
        (tmp_path / junk).parent.mkdir(exist_ok=True)
        (tmp_path / junk).write_text("not,a,csv,file,at,all\n")
    (tmp_path / "_DONE").write_text("")
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05)
    assert sum(len(b) for b in src) == 60
    assert [os.path.relpath(f, tmp_path) for f in src.files_read] == names
    # Shared between ranks by the name in the directory (two files are part-0.csv).
    assert owner("day=1/part-0.csv", 2) != owner("day=2/hour=3/part-0.csv", 2)  # (blake2b of these names)
    read = []
    for rank in (0, 1):
        part = GrowingDirectory(tmp_path, csv_reader, poll=0.05, rank=rank, world=2)
        assert sum(len(b) for b in part) == sum(n for f, n in zip(names, (20, 30, 10)) if owner(f, 2) == rank)
        read += [os.path.relpath(f, tmp_path) for f in part.files_read]
    assert sorted(read) == names
    # A resumed run replays the names files_read gave, subdirectories and all.
    again = GrowingDirectory(tmp_path, csv_reader, poll=0.05)
    again.replay([src.name(f) for f in src.files_read][::-1])
    assert sum(len(b) for b in again) == 60
    assert [os.path.relpath(f, tmp_path) for f in again.files_read] == names[::-1]


def test_stop_conditions_marker_examples_idle(tmp_path):
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(30, 4)))
    (tmp_path / "b.csv").write_text(HEADER + "".join(rows(30, 5)))
    (tmp_path / "_DONE").write_text("")
    # The marker: the files present are read at once (no stability poll), then the source ends.
    t0 = time.monotonic()
    src = GrowingDirectory(tmp_path, csv_reader, poll=5.0, idle=8.0)
    assert sum(len(b) for b in src) == 60 and time.monotonic() - t0 < 4.0  # without the marker: 8 s
    # A number of examples: the last batch is cut to it.
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05, idle=None, examples=37)
    assert [len(b) for b in src] == [16, 14, 7]  # a.csv's 16 + 14, then 7 of b.csv
    # Idle: no marker, nothing new for 0.3 s after the last file.
    os.remove(tmp_path / "_DONE")
    t0 = time.monotonic()
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05, idle=0.3)
    assert sum(len(b) for b in src) == 60
    assert 0.3 <= time.monotonic() - t0


def test_the_batch_cut_to_the_examples_asked_still_names_its_rows_lines(tmp_path):
    # The cut batch had lost its sources: locate() raised for its rows.
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(30, 4)))
    (tmp_path / "b.csv").write_text(HEADER + "".join(rows(30, 5)))
    (tmp_path / "_DONE").write_text("")
    last = list(GrowingDirectory(tmp_path, csv_reader, poll=0.05, idle=None, examples=37))[-1]
    assert [last.locate(i) for i in range(len(last))] == [(str(tmp_path / "b.csv"), line) for line in range(2, 9)]

@pytest.mark.parametrize("skip", [False, True])
def test_a_bad_line_past_the_examples_asked_is_neither_raised_nor_counted(tmp_path, skip):
    # A file's reader parses a block whole: online_examples = 20 over a file whose 31st
    # row is bad raised naming it (or counted it as skipped), though the run reads 20.
    bad = "2,1,s1,t1\n"  # a label that is not 0 or 1
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(30, 4)) + bad + "".join(rows(5, 5)))
    (tmp_path / "_DONE").write_text("")
    src = GrowingDirectory(tmp_path, lambda path: open_schema([path], SCHEMA, 16, skip_malformed=skip), poll=0.05,
                           examples=20)
    assert [len(b) for b in src] == [16, 4] and src.malformed == 0
    src = GrowingDirectory(tmp_path, lambda path: open_schema([path], SCHEMA, 16, skip_malformed=skip), poll=0.05,
                           examples=31)
    if skip:
        assert [len(b) for b in src] == [16, 15] and src.malformed == 1
    else:
        with pytest.raises(DataError, match=r"a.csv:32: column 'click': '2' is not 0 or 1"):
            list(src)


def test_idle_does_not_end_the_source_on_a_file_that_appeared_but_is_not_ready_yet(tmp_path):
    # b.csv is written while a.csv is read: the next poll sees it for the first time (not
    # ready: its size must hold across two polls), and the idle time, shorter than a poll,
    # has passed. b.csv is a new file within the idle time: the source must wait the poll
    # that makes it ready rather than end without it.
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(20, 11)))

    def reader(path):
        if path.endswith("a.csv"):
            (tmp_path / "b.csv").write_text(HEADER + "".join(rows(10, 12)))
        return csv_reader(path)

    src = GrowingDirectory(tmp_path, reader, poll=0.3, idle=0.1, marker=None)
    assert sum(len(b) for b in src) == 30
    assert [os.path.basename(f) for f in src.files_read] == ["a.csv", "b.csv"]


def test_an_idle_time_of_0_reads_the_files_present_then_ends(tmp_path):
    # idle = 0 (online_idle = 0, --online-stop idle=0: "read what is there and stop"): the
    # first poll sees the files, not ready yet (their size must hold across two polls),
    # and the idle time has passed at once. The source ended there having read nothing,
    # though a file seen but not ready is waited for.
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(20, 13)))
    (tmp_path / "b.csv").write_text(HEADER + "".join(rows(10, 14)))
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05, idle=0, marker=None)
    assert sum(len(b) for b in src) == 30
    assert [os.path.basename(f) for f in src.files_read] == ["a.csv", "b.csv"]


def test_ranks_that_saw_the_files_arrive_in_another_order_still_split_them(tmp_path):
    # Each rank polls on its own: rank 1 took b.csv first (its widths() waited for the
    # first file while a.csv was still being written), rank 0 came later and saw a.csv
    # and b.csv in one poll, in name order. Every file must be read by exactly one rank.
    names = ["a.csv", "b.csv", "c.csv", "d.csv", "e.csv", "f.csv"]
    (tmp_path / "b.csv").write_text(HEADER + "".join(rows(10, 20)))
    rank1 = GrowingDirectory(tmp_path, csv_reader, poll=0.05, rank=1, world=2)
    assert os.path.basename(rank1.first_file()) == "b.csv"
    for k, name in enumerate(names):
        if name != "b.csv":
            (tmp_path / name).write_text(HEADER + "".join(rows(10, 20 + k)))
    (tmp_path / "_DONE").write_text("")
    rank0 = GrowingDirectory(tmp_path, csv_reader, poll=0.05, rank=0, world=2)
    read = [{os.path.basename(f) for f in r.files_read} for r in (rank0, rank1) if list(r) is not None]
    assert read[0].isdisjoint(read[1]) and read[0] | read[1] == set(names)
    assert rank0.examples_read + rank1.examples_read == 10 * len(names)
    # The shares are even over many files, and names that differ in a digit spread too.
    from hps.data.online import owner
    assert sorted(collections.Counter(owner(f"part-{i:05d}.tsv", 2) for i in range(8)).values()) == [3, 5]
    assert min(collections.Counter(owner(f"part-{i:05d}.tsv", 4) for i in range(400)).values()) > 80


def test_lines_skipped_in_every_file_add_up(tmp_path):
    # Each file has a reader of its own, whose skip_malformed count was lost with it:
    # the directory's malformed and malformed_examples now add up every file's.
    bad = "2,1,s1,t1\n"  # a label that is not 0 or 1
    (tmp_path / "a.csv").write_text(HEADER + bad + "".join(rows(20, 9)) + bad)
    (tmp_path / "b.csv").write_text(HEADER + "".join(rows(10, 10)) + bad)
    (tmp_path / "_DONE").write_text("")
    src = GrowingDirectory(tmp_path, lambda path: open_schema([path], SCHEMA, 16, skip_malformed=True), poll=0.05)
    for _ in range(2):  # each pass counts afresh
        assert sum(len(b) for b in src) == 30
        assert src.malformed == 3 and src.stats()["malformed"] == 3
        assert [m.split(":", 2)[1] for m in src.malformed_examples] == ["2", "23", "12"]
        assert [os.path.basename(m.split(":")[0]) for m in src.malformed_examples] == ["a.csv", "a.csv", "b.csv"]


@pytest.mark.parametrize("compressed", [False, True])
def test_an_empty_csv_file_in_a_growing_directory_warns_and_the_others_are_read(tmp_path, compressed):
    # A file without a byte (an empty partition's part) warns and gives no rows in a
    # finite data set. Here checking its fields raised AttributeError ('NoneType' object
    # has no attribute 'names'), naming no file, and ended the run.
    from hps.data import EmptyFileWarning
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(10, 4)))
    empty = tmp_path / ("b.csv.gz" if compressed else "b.csv")
    if compressed:
        with gzip.open(empty, "wb"):
            pass
    else:
        empty.write_bytes(b"")
    (tmp_path / "c.csv").write_text(HEADER + "".join(rows(10, 5)))
    (tmp_path / "_DONE").write_text("")
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05)
    with pytest.warns(EmptyFileWarning, match=re.escape(str(empty))):
        assert sum(len(b) for b in src) == 20
    assert [os.path.basename(f) for f in src.files_read] == ["a.csv", empty.name, "c.csv"]

def test_an_empty_first_file_does_not_shape_the_model_the_first_file_with_fields_does(tmp_path):
    # widths() took the model's shape from the first file ready, and a file without a
    # byte (an empty partition's part, first in name order or first written) has no
    # fields: "the data holds no examples (1 file(s), each empty)", and the run ended,
    # where the next file would have shaped it. It now waits for a file with fields.
    from hps.data import EmptyFileWarning
    (tmp_path / "a.csv").write_bytes(b"")
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05, idle=None)

    def writer():
        time.sleep(0.3)
        (tmp_path / "b.csv").write_text(HEADER + "".join(rows(10, 1)))
        (tmp_path / "_DONE").write_text("")
    t = threading.Thread(target=writer)
    t.start()
    try:
        assert src.widths() == (1, 1, 1)
    finally:
        t.join()
    assert src.widths_file() == str(tmp_path / "b.csv")
    with pytest.warns(EmptyFileWarning, match=re.escape(str(tmp_path / "a.csv"))):
        assert sum(len(b) for b in src) == 10
    assert [os.path.basename(f) for f in src.files_read] == ["a.csv", "b.csv"]
    # Empty files alone until the stop condition: named as such.
    os.remove(tmp_path / "b.csv")
    with pytest.raises(DataError, match=r"the online data gave no file with data before the stop condition "
                                        r"\(1 file\(s\) read, each empty\): no fields to take the model's shape from"):
        GrowingDirectory(tmp_path, csv_reader, poll=0.05).widths()


def test_a_file_of_other_fields_is_a_data_error_naming_it_and_the_first_file(tmp_path):
    # Each file has a reader of its own, which checks only its one file: with categorical =
    # "rest" a file of one more column reached the model as keys of another width ("keys
    # must have shape (B, 2), got (16, 3)"), naming no file. The finite readers refuse it.
    schema = {"label": "click", "dense": ["price"], "categorical": "rest"}
    (tmp_path / "a.csv").write_text("click,price,site,os\n" + "1,2,s1,o1\n" * 20)
    (tmp_path / "b.csv").write_text("click,price,site,os,app\n" + "0,3,s2,o2,p2\n" * 20)
    (tmp_path / "_DONE").write_text("")

    def reader(path):
        return open_schema([path], schema, 16)
    src = GrowingDirectory(tmp_path, reader, poll=0.05)
    with pytest.raises(DataError, match=r"b.csv: the schema gives other fields here than in .*a.csv \(.*"
                                        r"categorical \['site', 'os', 'app'\].* against .*categorical "
                                        r"\['site', 'os'\].*\): every file of a growing directory") as e:
        list(src)
    assert e.value.path.endswith("b.csv") and src.examples_read == 20
    # A rank whose own first file is not the one widths() shaped the model by compares with that one.
    from hps.data.online import owner
    a_rank = owner("a.csv", 2)
    assert owner("b.csv", 2) != a_rank  # (blake2b of these names: the case needs them on two ranks)
    other = GrowingDirectory(tmp_path, reader, poll=0.05, rank=1 - a_rank, world=2)
    assert other.widths() == (1, 2, 0)  # a.csv's, which this rank does not read
    with pytest.raises(DataError, match=r"b.csv: the schema gives other fields here than in .*a.csv"):
        list(other)
    # Files of the same fields are read (the label and dense columns anywhere; "rest" is in file order).
    (tmp_path / "b.csv").write_text("site,price,os,click\n" + "s2,3,o2,0\n" * 20)
    assert sum(len(b) for b in GrowingDirectory(tmp_path, reader, poll=0.05)) == 40


def test_ranks_whose_first_files_differ_hold_their_files_to_rank_0s(tmp_path):
    # Each rank's first file is the first to become ready at its own polls: rank 1 took
    # b.csv (a.csv was still being written), rank 0 a.csv. Each held its files to its own
    # first file, so a.csv and b.csv, of the same counts but other fields, were both read
    # without an error on two ranks. agree() makes rank 0's first file every rank's.
    from hps.data.online import owner
    assert (owner("a.csv", 2), owner("b.csv", 2)) == (0, 1)  # (blake2b of these names: each on its own rank)
    schema = {"label": "click", "dense": ["price"], "categorical": "rest"}

    def reader(path):
        return open_schema([path], schema, 16)
    (tmp_path / "b.csv").write_text("click,price,os,site\n" + "0,3,o2,s2\n" * 20)
    rank1 = GrowingDirectory(tmp_path, reader, poll=0.05, rank=1, world=2)
    assert os.path.basename(rank1.first_file()) == "b.csv"
    (tmp_path / "a.csv").write_text("click,price,site,os\n" + "1,2,s1,o1\n" * 20)
    (tmp_path / "_DONE").write_text("")
    rank0 = GrowingDirectory(tmp_path, reader, poll=0.05, rank=0, world=2)
    assert os.path.basename(rank0.first_file()) == "a.csv"
    assert rank0.widths() == rank1.widths() == (1, 2, 0)  # what the ranks' allgather of widths compares

    class Node:  # the two ranks' allgather, as hps.distributed's Node gives it
        def allgather(self, stage, obj, what):
            return [os.path.basename(rank0.first_file()), os.path.basename(rank1.first_file())]
    for r in (rank0, rank1):
        r.agree(Node())
    assert sum(len(b) for b in rank0) == 20
    with pytest.raises(DataError, match=r"b.csv: the schema gives other fields here than in .*a.csv \(.*"
                                        r"categorical \['os', 'site'\].* against .*categorical \['site', 'os'\]"):
        list(rank1)


def test_named_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"online data: .*nowhere does not exist"):
        GrowingDirectory(tmp_path / "nowhere", csv_reader)
    (tmp_path / "f.csv").write_text(HEADER)
    with pytest.raises(FileNotFoundError, match=r"f.csv is not a directory"):
        GrowingDirectory(tmp_path / "f.csv", csv_reader)
    os.remove(tmp_path / "f.csv")
    with gzip.open(tmp_path / "a.csv.gz", "wt") as f:
        f.write(HEADER + "".join(rows(10, 6)))
    (tmp_path / "b.csv.gz").write_bytes(b"\x1f\x8b\x08\x00 not gzip at all" * 10)
    (tmp_path / "_DONE").write_text("")
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05)
    with pytest.raises(DataError, match=r"b.csv.gz") as e:
        list(src)
    assert e.value.path.endswith("b.csv.gz")
    # A file removed after it was taken, before its reader opens it or after (Criteo's TSV
    # reader, which leaves an OSError as it is, so the name comes from GrowingDirectory).
    for name in os.listdir(tmp_path):
        os.remove(tmp_path / name)
    (tmp_path / "_DONE").write_text("")
    for removed_first in (True, False):
        def vanishing(path):
            if removed_first:
                os.remove(path)
                return open_criteo([path], 16)
            reader = open_criteo([path], 16)
            os.remove(path)
            return reader
        (tmp_path / "c.tsv").write_text("1" + "\t" * 39 + "\n")
        with pytest.raises(DataError, match=r"c.tsv: cannot read: .*(?i:no such file)") as e:
            list(GrowingDirectory(tmp_path, vanishing, poll=0.05))
        assert e.value.path.endswith("c.tsv")
        if removed_first:  # the same when the model's widths are taken from the first file
            (tmp_path / "c.tsv").write_text("1" + "\t" * 39 + "\n")
            with pytest.raises(DataError, match=r"c.tsv: cannot read: .*(?i:no such file)"):
                GrowingDirectory(tmp_path, vanishing, poll=0.05).widths()
    with pytest.raises(ValueError, match="poll must be > 0"):
        GrowingDirectory(tmp_path, csv_reader, poll=0)
    with pytest.raises(ValueError, match="examples must be >= 1"):
        ProgressiveWindow(0)


def test_window_by_examples_and_by_batches():
    rng = np.random.default_rng(0)
    parts = [(rng.integers(0, 2, n).astype(float), rng.random(n)) for n in (5, 7, 3, 6)]
    by_ex, by_b = ProgressiveWindow(examples=10), ProgressiveWindow(batches=2)
    for y, p in parts:
        by_ex.add(y, p)
        by_b.add(y, p)
    y = np.concatenate([a for a, _ in parts])
    p = np.concatenate([b for _, b in parts])
    m = by_ex.metrics()
    assert (m["window_examples"], m["scored_examples"]) == (10, 21)
    assert m["auc"] == pytest.approx(pair_auc(y[-10:], p[-10:]))
    m = by_b.metrics()
    assert m["window_examples"] == 9 and m["auc"] == pytest.approx(pair_auc(y[-9:], p[-9:]))


def test_empty_batches_do_not_push_scored_examples_out_of_the_window():
    # Under mpiexec a rank whose data ended steps on with empty batches while the others
    # finish theirs (ParameterServer.aligned). They are no batches of examples: a window of
    # the latest 2 batches counted them, emptied, and reported the run's online AUC and
    # logloss as NaN (with numpy's "Mean of empty slice" at every point of the curve).
    w = ProgressiveWindow(batches=2)
    w.add(np.array([0.0, 1.0, 1.0]), np.array([0.2, 0.9, 0.6]))
    w.add(np.array([1.0, 0.0]), np.array([0.7, 0.4]))
    before = w.metrics()
    for _ in range(3):
        w.add(np.empty(0), np.empty(0))
        assert w.record(batches=1) == {"batches": 1, **before}  # the curve's point: the window's, not NaN
    assert w.metrics() == before and before["window_examples"] == 5 and before["auc"] == 1.0
    by_examples = ProgressiveWindow(examples=4)
    by_examples.add(np.empty(0), np.empty(0))
    m = by_examples.metrics()  # nothing scored yet: NaN without numpy's warning
    assert m["window_examples"] == 0 and np.isnan(m["auc"]) and np.isnan(m["logloss"])


def test_window_curve_stays_bounded_by_doubling_its_stride():
    w = ProgressiveWindow(examples=6, max_points=4)
    rng = np.random.default_rng(1)
    kept = []
    for k in range(1, 20):
        w.add(np.array([0.0, 1.0]), rng.random(2))
        point = w.record(batches=k)
        if point is not None:
            kept.append(k)
            assert point["window_examples"] == min(6, 2 * k)
    # Points at batches 1, 2, 3, 4 -> 4 points: keep 2, 4, stride 2 -> 6, 8 -> keep 4, 8, stride 4 -> 12, 16 ...
    assert [p["batches"] for p in w.history] == [8, 16] and w.stride == 8
    assert kept == [1, 2, 3, 4, 6, 8, 12, 16]


def test_progressive_metrics_equal_scores_taken_before_each_step(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("pyarrow")
    from hps.train import TrainConfig, _bag_inputs, train
    data = tmp_path / "stream"
    data.mkdir()
    for i in range(3):
        (data / f"part-{i}.csv").write_text(HEADER + "".join(rows(80, 10 + i)))
    (data / "_DONE").write_text("")
    window = 100
    cfg = TrainConfig.from_dict({
        "ps": {"dim": 4, "path": str(tmp_path / "ps"), "mem_budget": "8MiB",
               "optimizer": {"kind": "adagrad", "lr": 0.3}},
        "data": {"source": str(data), "batch_size": 32, "schema": SCHEMA, "online_poll": 0.05},
        "hidden": [8], "dense_lr": 0.05, "torch_threads": 1, "pipelined": False,
        "online": True, "online_window": window}, "run.toml")
    before = []  # (labels, probabilities) of each batch, scored by the model before its step

    def hook(trainer):
        step = trainer.step

        def scored_step(loaded):
            b = loaded.data
            with torch.no_grad():
                logits = trainer.model(torch.from_numpy(b.keys.view(np.int64)), torch.from_numpy(b.dense),
                                       _bag_inputs(b))
            before.append((b.labels.astype(np.float64), torch.sigmoid(logits.double()).numpy()))
            step(loaded)
        trainer.step = scored_step

    summary = train(cfg, progress=False, dense_hook=hook)
    online = summary["online"]
    assert summary["examples"] == 240 and online["files_read"] == 3 and len(before) == summary["batches"] == 9
    history = online["history"]
    assert len(history) == len(before)
    for k, h in enumerate(history):
        y = np.concatenate([a for a, _ in before[:k + 1]])[-window:]
        p = np.concatenate([b for _, b in before[:k + 1]])[-window:]
        assert h["window_examples"] == len(y) and h["examples"] == sum(len(a) for a, _ in before[:k + 1])
        if 0 < y.sum() < len(y):
            assert h["auc"] == pytest.approx(pair_auc(y, p), abs=1e-6)
        pc = np.clip(p, 1e-7, 1 - 1e-7)
        assert h["logloss"] == pytest.approx(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc)), abs=1e-5)
    assert (online["auc"], online["logloss"]) == (history[-1]["auc"], history[-1]["logloss"])
    with open(tmp_path / "ps" / "train-summary.json") as f:
        assert json.load(f)["online"]["window"] == {"examples": window}


def test_hps_train_online_cli_reads_a_growing_criteo_directory(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("pyarrow")
    from hps.cli import main
    data = tmp_path / "stream"
    data.mkdir()
    rng = np.random.default_rng(3)

    def write(i):
        lines = []
        for _ in range(200):  # Criteo's layout: label, 13 counts, 26 hexadecimal categoricals
            cats = rng.integers(0, 30, 26)
            label = int(rng.random() < 0.2 + 0.6 * (cats[0] < 10))
            lines.append("\t".join([str(label)] + [str(v) for v in rng.integers(0, 9, 13)] +
                                   [f"{c:08x}" for c in cats]))
        (data / f"part-{i}.tsv.tmp").write_text("\n".join(lines) + "\n")
        os.rename(data / f"part-{i}.tsv.tmp", data / f"part-{i}.tsv")

    write(0)

    def writer():
        for i in (1, 2):
            time.sleep(0.3)
            write(i)

    t = threading.Thread(target=writer)
    t.start()
    args = ["train", "--data", str(data), "--path", str(tmp_path / "ps"), "--batch-size", "100", "--no-progress",
            "--online", "--online-window", "300", "--online-stop", "idle=1.5,marker=none", "--report",
            str(tmp_path / "plots")]
    assert main(args) == 0
    t.join()
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["online"]["files_read"] == 3 and line["online"]["scored_examples"] == 600
    assert line["online"]["window_examples"] == 300 and 0.0 < line["online"]["auc"] < 1.0
    assert str(tmp_path / "plots" / "online.png") in line["report"]
    # A directory that does not exist is named, and nothing is written.
    assert main(["train", "--data", str(tmp_path / "nowhere"), "--path", str(tmp_path / "ps2"), "--online",
                 "--no-progress"]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err and not (tmp_path / "ps2").exists()
    assert main(["train", "--data", str(data), "--path", str(tmp_path / "ps3"), "--online-stop", "idle=1"]) == 2
    assert "need --online" in capsys.readouterr().err
    assert main(["train", "--data", str(data), "--path", str(tmp_path / "ps3"), "--online",
                 "--online-stop", "wait=3"]) == 2
    assert "'wait=3' is not idle=SECONDS" in capsys.readouterr().err


def test_the_json_line_writes_an_undefined_auc_as_null(tmp_path, capsys):
    # A window of one class only (no click among its examples: common with a small window
    # on CTR data) has no AUC. The JSON line wrote it as a bare NaN, which is not JSON
    # (jq and JSON.parse refuse the line); docs/training.md says null.
    pytest.importorskip("torch")
    from hps.cli import main
    data = tmp_path / "stream"
    data.mkdir()
    rng = np.random.default_rng(4)
    lines = ["\t".join(["0"] + [str(v) for v in rng.integers(0, 9, 13)] + [f"{c:08x}" for c in rng.integers(0, 30, 26)])
             for _ in range(100)]
    (data / "part-0.tsv").write_text("\n".join(lines) + "\n")
    (data / "_DONE").write_text("")
    assert main(["train", "--data", str(data), "--path", str(tmp_path / "ps"), "--batch-size", "50",
                 "--no-progress", "--online"]) == 0

    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON line")
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1], parse_constant=refuse)
    assert line["online"]["auc"] is None and line["online"]["window_examples"] == 100


def test_hps_train_refuses_a_growing_directory_without_an_example_and_writes_nothing(tmp_path, capsys):
    # Files that held no example (each empty, or every line malformed and skipped)
    # until the stop condition trained nothing, wrote a checkpoint and a summary and
    # exited 0, where the same files given as files are refused: a growing directory
    # was not read ahead. It is now, up to its first example (waiting as the run would).
    pytest.importorskip("torch")
    from hps.cli import main
    from hps.data import EmptyFileWarning
    data = tmp_path / "stream"
    data.mkdir()
    (data / "part-0.tsv").write_bytes(b"")
    (data / "_DONE").write_text("")
    args = ["--batch-size", "50", "--no-progress", "--online"]
    with pytest.warns(EmptyFileWarning, match="part-0.tsv"):
        assert main(["train", "--data", str(data), "--path", str(tmp_path / "ps"), *args]) == 2
    assert f"{data}: the training data holds no examples (1 file(s) read before the online stop condition); " \
        f"nothing was written" in capsys.readouterr().err
    assert not (tmp_path / "ps").exists()
    # An example in a later file is found past the empty one, and the run reads them all.
    rng = np.random.default_rng(5)
    (data / "part-1.tsv").write_text("".join(
        "\t".join([str(i % 2)] + [str(v) for v in rng.integers(0, 9, 13)] +
                  [f"{c:08x}" for c in rng.integers(0, 30, 26)]) + "\n" for i in range(60)))
    with pytest.warns(EmptyFileWarning, match="part-0.tsv"):
        assert main(["train", "--data", str(data), "--path", str(tmp_path / "ps"), *args]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["final"]["examples"] == 60 and line["online"]["files_read"] == 2


def test_online_config_errors(tmp_path):
    from hps.train import TrainConfig
    base = {"ps": {"dim": 4, "path": str(tmp_path / "ps")}, "online": True}
    with pytest.raises(ValueError, match=r"run.toml: online training reads a growing directory once: data.epochs "
                                         r"must be 1"):
        TrainConfig.from_dict(dict(base, data={"source": str(tmp_path), "epochs": 2}), "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: online_window must be an int >= 1, got 0"):
        TrainConfig.from_dict(dict(base, online_window=0), "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: online_window_batches must be an int >= 0, got -1"):
        TrainConfig.from_dict(dict(base, online_window_batches=-1), "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: unknown field\(s\) data.online_stop"):
        TrainConfig.from_dict(dict(base, data={"online_stop": 3}), "run.toml")
    # Files (not a directory) are progressive validation of a finite stream: several epochs are fine.
    (tmp_path / "a.tsv").write_text("")
    cfg = TrainConfig.from_dict(dict(base, data={"source": str(tmp_path / "a.tsv"), "epochs": 2}), "run.toml")
    assert cfg.online and cfg.data.epochs == 2


def test_window_state_round_trips_and_refuses_another_window_size():
    rng = np.random.default_rng(2)
    w = ProgressiveWindow(examples=10, max_points=4)
    for k in range(1, 8):
        w.add(rng.integers(0, 2, 3).astype(float), rng.random(3))
        w.record(batches=k)
    copy = ProgressiveWindow(examples=10, max_points=4)
    copy.load_state_dict(w.state_dict())
    assert copy.metrics() == w.metrics() and copy.history == w.history and copy.stride == w.stride
    y, p = np.array([1.0, 0.0]), np.array([0.7, 0.2])
    for win in (w, copy):  # both go on alike: the partial oldest batch, the stride
        win.add(y, p)
        win.record(batches=8)
    assert copy.metrics() == w.metrics() and copy.history == w.history
    with pytest.raises(ValueError, match="the checkpoint's window is 10 examples, the config's 5 batches"):
        ProgressiveWindow(batches=5).load_state_dict(w.state_dict())


def test_a_resumed_online_run_goes_on_with_the_window_it_stopped_with(tmp_path):
    pytest.importorskip("torch")
    from hps.train import TrainConfig, train

    def run(path, examples, resume):
        cfg = TrainConfig.from_dict({
            "ps": {"dim": 4, "path": str(path), "mem_budget": "8MiB"},
            "data": {"batch_size": 64, "train_examples": examples, "eval_examples": 64,
                     "vocab_sizes": [50, 200, 1000]},
            "hidden": [8], "torch_threads": 1, "pipelined": False, "online": True,
            "online_window": 300}, "run.toml")
        return train(cfg, resume=resume, progress=False)["online"]

    def curve(online):
        return [(h["batches"], h["examples"], h["window_examples"], h["scored_examples"], h["auc"], h["logloss"])
                for h in online["history"]]

    straight = run(tmp_path / "straight", 64 * 12, False)
    run(tmp_path / "split", 64 * 6, False)
    resumed = run(tmp_path / "split", 64 * 12, True)
    # The window holds 300 examples, so its first points after the resume include the
    # batches before it: equal only if the checkpoint kept them.
    assert curve(resumed) == curve(straight)
    assert (resumed["auc"], resumed["logloss"]) == (straight["auc"], straight["logloss"])


def test_a_resumed_run_on_a_growing_directory_reads_each_file_once(tmp_path):
    # The first run read b.csv, the only file, and ended (idle). Then a.csv came, whose
    # name sorts first, and the marker. A resumed run skips the examples done: that is
    # right only if it reads the files in the order the first run did (b.csv, then
    # what is new), not in name order (it would skip 40 examples of a.csv and train
    # b.csv a second time).
    pytest.importorskip("torch")
    from hps.train import TrainConfig, train
    data = tmp_path / "stream"
    data.mkdir()
    (data / "b.csv").write_text(HEADER + "".join(rows(40, 30)))

    def run(resume):
        cfg = TrainConfig.from_dict({
            "ps": {"dim": 4, "path": str(tmp_path / "ps"), "mem_budget": "8MiB"},
            "data": {"source": str(data), "batch_size": 16, "schema": SCHEMA, "online_poll": 0.05,
                     "online_idle": 0.3},
            "hidden": [8], "torch_threads": 1, "pipelined": False, "online": True}, "run.toml")
        trained = []

        def hook(trainer):
            step = trainer.step

            def recording_step(loaded):
                trained.extend((os.path.basename(s.path), s.count) for s in loaded.data.sources)
                step(loaded)
            trainer.step = recording_step
        summary = train(cfg, resume=resume, progress=False, dense_hook=hook)
        return summary, trained

    summary, trained = run(False)
    assert summary["examples"] == 40 and {name for name, _ in trained} == {"b.csv"}
    (data / "a.csv").write_text(HEADER + "".join(rows(70, 31)))
    (data / "_DONE").write_text("")
    summary, trained = run(True)
    assert summary["examples"] == 110
    assert {name for name, _ in trained} == {"a.csv"} and sum(n for _, n in trained) == 70
    # A file the checkpoint names that is gone: the examples to skip are not there to skip.
    os.remove(data / "b.csv")
    src = GrowingDirectory(data, csv_reader, poll=0.05)
    src.replay(["b.csv", "a.csv"])
    with pytest.raises(DataError, match=r"b.csv: read before the checkpoint this run resumes from, and gone since"):
        list(src)


def test_a_file_changed_after_it_was_read_is_not_read_again_and_says_so(tmp_path):
    # Files are read once, whole, when ready: a file rewritten or appended to under the same
    # name afterwards (a writer that paused longer than a poll, then went on) is not read
    # again, since its first part was trained on already. That was silent; now it warns,
    # naming the file, once.
    from hps.data import FileChangedWarning
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(10, 40)))
    (tmp_path / "b.csv").write_text(HEADER + "".join(rows(10, 41)))
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05, idle=None)
    with pytest.warns(FileChangedWarning, match=r"a.csv: changed after it was read \(\d+ -> \d+ bytes\)") as got:
        names = []
        for b in src:
            names.append(os.path.basename(b.sources[0].path))
            if names == ["a.csv", "b.csv"]:  # a.csv read whole: the source is at b.csv
                with open(tmp_path / "a.csv", "a") as f:
                    f.write("".join(rows(5, 42)))
                (tmp_path / "_DONE").write_text("")
    assert names == ["a.csv", "b.csv"] and src.examples_read == 20
    assert len([w for w in got if issubclass(w.category, FileChangedWarning)]) == 1
    assert [os.path.basename(p) for p in src.changed_after_read] == ["a.csv"]
    # Changed while its reader was still at it: said when the reader is done.
    os.remove(tmp_path / "b.csv")
    (tmp_path / "a.csv").write_text(HEADER + "".join(rows(20, 43)))
    src = GrowingDirectory(tmp_path, csv_reader, poll=0.05)
    with pytest.warns(FileChangedWarning, match=r"a.csv: changed after it was read"):
        for i, b in enumerate(src):
            if i == 0:
                (tmp_path / "a.csv").write_text(HEADER + "".join(rows(30, 44)))
    assert [os.path.basename(p) for p in src.changed_after_read] == ["a.csv"]
