"""How many examples `hps train` trains, and what it says about them: --examples on
synthetic data and on files (the first N, or a note that the files hold fewer),
a resumed run that picks up at the example where the last one stopped (whatever
batch it ended on), a resumed run that is already finished, and a summary table
that agrees with the run's JSON line."""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
import hps.data as hdata  # noqa: E402
from hps.cli import main  # noqa: E402
from hps.train import stored_checkpoint  # noqa: E402

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "criteo-sample",
                      "train_examples_10k.tsv")

TOML = """
hidden = [8]
torch_threads = 1

[ps]
dim = 4
path = "{path}"
mem_budget = "256KiB"      # rows go through SSD-PS, so there is SSD traffic to report

[data]
batch_size = 1000
eval_examples = 500
vocab_sizes = [50, 200, 1000, 5000]
"""


def run(capsys, tmp_path, *args, toml=TOML):
    cfg = tmp_path / "run.toml"
    cfg.write_text(toml.format(path=tmp_path / "ps"))
    rc = main(["train", "--config", str(cfg), "--no-progress", *args])
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return rc, (lines[-1] if lines else None), err


def test_first_examples_cuts_the_batch_that_crosses_the_limit():
    gen = hdata.SyntheticCriteo(seed=3, batch_size=4, examples=10, vocab_sizes=[7, 9],
                                multi_hot=[(20, 2.0)])
    whole = list(gen)
    first = hdata.FirstExamples(gen, 6)
    got = list(first)
    assert [len(b) for b in got] == [4, 2] and first.examples_seen == 6
    assert np.array_equal(got[1].keys, whole[1].keys[:2])
    lens = np.diff(whole[1].bags[0].offsets)[:2]
    assert np.array_equal(got[1].bags[0].keys, whole[1].bags[0].keys[:lens.sum()])
    more = hdata.FirstExamples(gen, 25)
    assert sum(len(b) for b in more) == 10 and more.examples_seen == 10  # the data holds fewer
    with pytest.raises(ValueError, match="examples must be an int >= 0"):
        hdata.FirstExamples(gen, -1)


def test_skip_examples_starts_inside_a_batch():
    gen = hdata.SyntheticCriteo(seed=3, batch_size=4, examples=10, vocab_sizes=[7, 9])
    keys = np.concatenate([b.keys for b in gen])
    rest = list(hdata.skip_examples(gen, 6))
    assert [len(b) for b in rest] == [2, 2]
    assert np.array_equal(np.concatenate([b.keys for b in rest]), keys[6:])
    assert list(hdata.skip_examples(gen, 10)) == []


def test_a_batch_cut_by_the_count_or_the_resume_point_still_names_its_rows_lines(tmp_path):
    # Batch.rows dropped the batch's sources: the batch FirstExamples cut (--examples)
    # and the first batch a resumed run trained (skip_examples) could not say where
    # their rows came from (locate: "the batch's sources do not cover its rows").
    gen = hdata.SyntheticCriteo(seed=3, batch_size=4, examples=10, vocab_sizes=[7, 9])
    where = [b.locate(i) for b in gen for i in range(len(b))]
    assert [b.locate(i) for b in hdata.FirstExamples(gen, 6) for i in range(len(b))] == where[:6]
    assert [b.locate(i) for b in hdata.skip_examples(gen, 6) for i in range(len(b))] == where[6:]
    # A batch over two files: the cut keeps each row's own file and line.
    for name in ("a.tsv", "b.tsv"):
        hdata.SyntheticCriteo(seed=3, batch_size=4).write_tsv(str(tmp_path / name), 3)
    reader = hdata.CriteoTsv([str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv")], batch_size=4)
    rest = list(hdata.skip_examples(reader, 2))
    assert [b.locate(i) for b in rest for i in range(len(b))] == \
        [(str(tmp_path / "a.tsv"), 3), (str(tmp_path / "b.tsv"), 1), (str(tmp_path / "b.tsv"), 2),
         (str(tmp_path / "b.tsv"), 3)]

def test_summary_table_and_json_line_report_the_same_ssd_traffic(capsys, tmp_path):
    rc, line, err = run(capsys, tmp_path, "--examples", "3000")
    assert rc == 0, err
    final = line["final"]
    # The final checkpoint writes the dirty rows; both read the counters after it.
    assert final["ssd_bytes_written"] > 0
    written = [x for x in err.splitlines() if "SSD-PS read / written" in x][0]
    assert written.split("/")[-1].strip() == f"{final['ssd_bytes_written'] / 1e6:,.1f} MB"
    assert f"{final['ssd_live_records']:,}" in [x for x in err.splitlines() if "live rows" in x][0]


def test_resume_with_more_examples_picks_up_after_a_short_last_batch(capsys, tmp_path):
    rc, line, err = run(capsys, tmp_path, "--examples", "2500")  # batches 1000, 1000, 500
    assert rc == 0, err
    assert line["final"]["examples"] == 2500 and line["final"]["batches"] == 3
    rc, line, err = run(capsys, tmp_path, "--examples", "5000", "--resume")
    assert rc == 0, err
    # Examples 2500-4999: the stream's third batch cut to its last 500, then two of
    # 1000 (skipping three whole batches would have trained 3000-4999).
    assert line["final"]["examples"] == 5000 and line["final"]["batches"] == 6
    assert line["pipeline"]["examples"] == 2500


def test_resume_refuses_data_files_not_in_the_order_the_run_read_them(capsys, tmp_path):
    # A resumed run skips the examples done, which is right only if the data comes in the
    # order it came before. A file added where the listing sorts it before one read (day2
    # between day1 and day3) moved the examples: the resumed run skipped day1 and half of
    # day2, never trained the half of day3 it had not, and trained day2's rest, without a
    # word. A file added after the ones read only adds examples.
    files = TOML.replace("vocab_sizes = [50, 200, 1000, 5000]\n", "")
    data = tmp_path / "data"
    data.mkdir()
    gen = hdata.SyntheticCriteo(seed=3, batch_size=500)
    for name in ("day1.tsv", "day3.tsv"):
        gen.write_tsv(str(data / name), 1000)
    big = ("--mem-budget", "4MiB", "--batch-size", "500", "--data", str(data))
    rc, line, err = run(capsys, tmp_path, "--examples", "1500", *big, toml=files)
    assert rc == 0, err
    gen.write_tsv(str(data / "day4.tsv"), 1000)
    rc, line, err = run(capsys, tmp_path, "--examples", "2000", "--resume", *big, toml=files)
    assert rc == 0, err
    assert line["final"]["examples"] == 2000 and line["pipeline"]["examples"] == 500
    # The data set moved: the same files by name, in the same order, resume.
    moved = tmp_path / "moved"
    data.rename(moved)
    rc, line, err = run(capsys, tmp_path, "--examples", "2500", "--resume", *big[:-1], str(moved), toml=files)
    assert rc == 0, err
    assert line["final"]["examples"] == 2500 and line["pipeline"]["examples"] == 500
    moved.rename(data)
    gen.write_tsv(str(data / "day2.tsv"), 1000)
    rc, line, err = run(capsys, tmp_path, "--examples", "3500", "--resume", *big, toml=files)
    assert rc == 2
    assert (f"--resume: the data files are not those the run resumed from read, in its order: file 2 is "
            f"{data / 'day2.tsv'} here, {moved / 'day3.tsv'} there") in err, err  # (the last run read them there)

def test_resume_holds_a_partitioned_data_set_to_its_files_paths_under_the_directory(capsys, tmp_path):
    # A partitioned set repeats base names (day=1/part-0, day=3/part-0): a partition added
    # before one read moves the examples as a file would, and is refused by its path.
    files = TOML.replace("vocab_sizes = [50, 200, 1000, 5000]\n", "")
    data = tmp_path / "data"
    gen = hdata.SyntheticCriteo(seed=3, batch_size=500)
    for day in ("day=1", "day=3"):
        (data / day).mkdir(parents=True)
        gen.write_tsv(str(data / day / "part-0.tsv"), 1000)
    gen.write_tsv(str(data / "day=1" / "part-1.tsv"), 1000)
    big = ("--mem-budget", "4MiB", "--batch-size", "500", "--data", str(data / "day=1"))
    rc, line, err = run(capsys, tmp_path, "--examples", "500", *big, toml=files)
    assert rc == 0, err
    # The whole set now, day=1 still first: the files read come first, by their paths.
    big = big[:-1] + (str(data),)
    rc, line, err = run(capsys, tmp_path, "--examples", "1500", "--resume", *big, toml=files)
    assert rc == 0, err
    assert line["final"]["examples"] == 1500 and line["pipeline"]["examples"] == 1000
    (data / "day=2").mkdir()
    gen.write_tsv(str(data / "day=2" / "part-0.tsv"), 1000)
    rc, line, err = run(capsys, tmp_path, "--examples", "2000", "--resume", *big, toml=files)
    assert rc == 2
    assert (f"file 3 is {data / 'day=2' / 'part-0.tsv'} here, {data / 'day=3' / 'part-0.tsv'} there") in err, err


def test_resuming_a_finished_run_says_so_and_changes_nothing(capsys, tmp_path):
    rc, first, err = run(capsys, tmp_path, "--examples", "2000")
    assert rc == 0, err
    summary = tmp_path / "ps" / "train-summary.json"
    kept = (stored_checkpoint(str(tmp_path / "ps")), summary.stat().st_mtime_ns)
    rc, line, err = run(capsys, tmp_path, "--examples", "2000", "--resume")
    assert rc == 0, err
    assert "is finished: 2,000 examples in 2 batches" in err and "raise --examples" in err
    assert line["finished_before"]["examples"] == 2000
    assert line["final"] == first["final"]  # the summary of the run that finished it
    assert (stored_checkpoint(str(tmp_path / "ps")), summary.stat().st_mtime_ns) == kept  # no new checkpoint



def test_resuming_a_run_finished_by_a_run_that_failed_after_its_checkpoint_shows_no_older_summary(
        capsys, tmp_path, monkeypatch):
    """A resumed run trains to its last checkpoint and fails before it writes its
    summary (a crash, a full disk): train-summary.json is still the one of the run
    before it. Resumed again with nothing left to train, the run said it was finished
    at the checkpoint's 4,000 examples and showed that older summary as its own: the
    final AUC of 2,000 examples, "batches": 2."""
    import hps.train
    rc, first, err = run(capsys, tmp_path, "--examples", "2000")
    assert rc == 0, err
    with monkeypatch.context() as m:
        def fails(*args):
            raise OSError("no space left on device")
        m.setattr(hps.train, "_malformed_report", fails)  # after the final checkpoint, before the summary
        rc, _, err = run(capsys, tmp_path, "--examples", "4000", "--resume")
        assert rc != 0 and "no space left on device" in err
    assert stored_checkpoint(str(tmp_path / "ps"))[1] is not None
    rc, line, err = run(capsys, tmp_path, "--examples", "4000", "--resume")
    assert rc == 0, err
    assert "is finished: 4,000 examples in 4 batches" in err
    assert line is None or line.get("final", {}).get("batches") in (None, 4), line


def test_resuming_a_run_whose_summary_a_full_disk_cut_short_says_it_is_finished(capsys, tmp_path, monkeypatch):
    """A run's disk fills (RLIMIT_FSIZE: a write past it fails with EFBIG) as it
    writes train-summary.json, after its final checkpoint. The summary was written
    in place: the run that failed had emptied the one before and left a few bytes
    of its own, and resuming the finished run then failed on them (a JSON error)
    until the file was removed by hand. Written aside and renamed over, it is the
    whole summary before, or the whole one after."""
    import resource
    import signal
    import hps.train
    rc, first, err = run(capsys, tmp_path, "--examples", "2000")
    assert rc == 0, err
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails; the process goes on)
    try:
        with monkeypatch.context() as m:  # (called after the final checkpoint, before the summary)
            m.setattr(hps.train, "_malformed_report",
                      lambda *args: resource.setrlimit(resource.RLIMIT_FSIZE, (64, limits[1])))
            rc, _, err = run(capsys, tmp_path, "--examples", "4000", "--resume")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, xfsz)
    assert rc != 0 and "File too large" in err, err
    summary = tmp_path / "ps" / "train-summary.json"
    json.loads(summary.read_text())  # whole
    rc, line, err = run(capsys, tmp_path, "--examples", "4000", "--resume")
    assert rc == 0, err
    assert "is finished: 4,000 examples in 4 batches" in err
    # One that an older hps left cut short is taken for none.
    summary.write_text(summary.read_text()[:64])
    rc, line, err = run(capsys, tmp_path, "--examples", "4000", "--resume")
    assert rc == 0, err
    assert "is finished: 4,000 examples in 4 batches" in err


@pytest.mark.skipif(not os.path.exists(SAMPLE), reason="../shared/data/criteo-sample is absent")
def test_examples_on_files_trains_the_first_n_or_says_the_files_hold_fewer(capsys, tmp_path):
    big = ("--mem-budget", "4MiB")  # Criteo's 26 fields
    files = TOML.replace("vocab_sizes = [50, 200, 1000, 5000]\n", "")  # --data refuses synthetic-only fields
    assert files != TOML
    rc, line, err = run(capsys, tmp_path, "--data", SAMPLE, "--examples", "2500", *big, toml=files)
    assert rc == 0, err
    assert line["final"]["examples"] == 2500 and "short" not in line
    (tmp_path / "more").mkdir()
    rc, line, err = run(capsys, tmp_path / "more", "--data", SAMPLE, "--examples", "50000", *big, toml=files)
    assert rc == 0, err
    assert line["final"]["examples"] == 10_000
    assert "the data held 10,000 examples, fewer than the 50,000 asked" in err
    assert line["short"].startswith("the data held 10,000 examples")


def test_examples_must_be_positive(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", "x.toml", "--examples", "0"])
    assert e.value.code == 2
    assert "--examples: must be >= 1, got 0" in capsys.readouterr().err
    cfg = tmp_path / "bad.toml"
    cfg.write_text(TOML.format(path=tmp_path / "ps") + "train_examples = 0\n")
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    assert "data.train_examples must be an int >= 1, got 0" in capsys.readouterr().err


def test_a_hit_rate_of_no_lookups_is_shown_as_not_measured(capsys, tmp_path):
    """A MEM-PS that served no lookup has no hit rate: "-" in the table, null in the
    JSON, not a rate of 0.000 (every lookup missing) from a denominator of max(1, 0)."""
    from hps.cli import _summary_table
    from hps.train import _tier_counters
    rc, line, err = run(capsys, tmp_path, "--examples", "1000")
    assert rc == 0, err
    rate = line["final"]["mem_hit_rate"]
    assert 0 <= rate <= 1 and "MEM-PS hit rate" in err
    summary = json.loads((tmp_path / "ps" / "train-summary.json").read_text())
    assert f"{rate:.3f}" in [x for x in err.splitlines() if "MEM-PS hit rate" in x][0]
    summary["ps"]["mem"].update(hits=0, misses=0)
    row = [x for x in _summary_table(summary).splitlines() if "MEM-PS hit rate" in x][0]
    assert row.split()[-1] == "-"
    assert _tier_counters(summary["ps"])["mem_hit_rate"] is None


def test_the_rate_says_the_evaluations_inside_the_run_are_in_it_and_gives_it_without_them(capsys, tmp_path,
                                                                                          monkeypatch):
    """eval_every's evaluations run inside the train stage, so inside the wall time of
    examples_per_s: the table says so and gives the rate without their time (each
    evaluation here made at least 0.2 s longer). The final evaluation runs after the
    pipeline, in neither."""
    import time

    from hps.train import Trainer
    evaluate = Trainer.evaluate

    def slow(self, batches):
        time.sleep(0.2)
        return evaluate(self, batches)
    monkeypatch.setattr(Trainer, "evaluate", slow)
    rc, line, err = run(capsys, tmp_path, "--examples", "4000", "--eval-every", "2")  # at batches 2 and 4
    assert rc == 0, err
    summary = json.loads((tmp_path / "ps" / "train-summary.json").read_text())
    assert 0.4 <= summary["eval_seconds"] < summary["train_seconds"]
    assert summary["examples_per_s_without_eval"] == pytest.approx(
        4000 / (summary["train_seconds"] - summary["eval_seconds"]))
    assert summary["examples_per_s_without_eval"] > summary["examples_per_s"]
    assert line["eval_seconds"] == summary["eval_seconds"]
    row = [x for x in err.splitlines() if "examples/s" in x][0]
    assert f"(evaluations' {summary['eval_seconds']:,.1f} s included; " \
           f"{summary['examples_per_s_without_eval']:,.0f} without them)" in row
    # Without eval_every nothing inside the run is an evaluation: the rate alone.
    (tmp_path / "none").mkdir()
    rc, line, err = run(capsys, tmp_path / "none", "--examples", "2000")
    assert rc == 0, err
    assert line["eval_seconds"] == 0.0 and line["examples_per_s_without_eval"] == pytest.approx(line["examples_per_s"])
    assert "evaluations'" not in [x for x in err.splitlines() if "examples/s" in x][0]


def test_the_evaluations_inside_the_run_are_not_the_train_stages_busy_time(capsys, tmp_path, monkeypatch):
    """eval_every's evaluations run inside the train step, and were counted as the
    train stage's busy time: a run whose evaluations dominate said it was bound by
    train whatever bounded its training. The pipeline's clock is a fake one here, so
    that nothing depends on timing: each batch read takes it 1 s on, each evaluation
    100 s, and nothing else moves it. The read stage bounds the training; the
    evaluations' 400 s are reported apart (set_aside_seconds, eval_seconds)."""
    import types

    import hps.pipeline
    from hps.data import SyntheticCriteo
    from hps.train import Trainer
    clock = [0.0]
    monkeypatch.setattr(hps.pipeline, "time", types.SimpleNamespace(perf_counter=lambda: clock[0],
                                                                    thread_time=lambda: clock[0]))
    evaluate, read = Trainer.evaluate, SyntheticCriteo.__iter__

    def slow_evaluate(self, batches):
        clock[0] += 100.0
        return evaluate(self, batches)

    def slow_read(self):
        for batch in read(self):
            clock[0] += 1.0
            yield batch
    monkeypatch.setattr(Trainer, "evaluate", slow_evaluate)
    monkeypatch.setattr(SyntheticCriteo, "__iter__", slow_read)
    # Sequential: every stage in this thread, so that only the read stage's timing
    # holds the reads' seconds. 4 batches, an evaluation after each (the final one
    # runs after the pipeline: in none of its figures).
    rc, line, err = run(capsys, tmp_path, "--examples", "4000", "--eval-every", "1", "--sequential")
    assert rc == 0, err
    p = line["pipeline"]
    assert p["busy_seconds"]["train"] == 0.0 and p["cpu_seconds"]["train"] == 0.0
    assert p["busy_seconds"]["read"] == 4.0 and p["bound_by"] == "read"
    assert p["set_aside_seconds"] == 400.0 and p["wall_seconds"] == 404.0
    assert line["eval_seconds"] == 400.0
    assert "bound by stage" in err and [x for x in err.splitlines() if "bound by stage" in x][0].split()[-1] == "read"
