"""hps.report: the plots of a training run. The series they draw come from
intervals() between evaluations (rates in each interval, not cumulative), the
busy fractions stay within [0, 1], the last short interval is marked, and each
figure carries the run's settings."""
import os

import pytest

from hps.report import caption, intervals, write_report

SETTINGS = {"data": "synthetic", "batch_size": 1000, "examples": 5000, "epochs": 1, "dim": 8,
            "mem_budget": "1MiB", "cache_policy": "lru", "devices": 2, "sparse_optimizer": "adagrad",
            "hidden": [16, 8], "pipelined": True, "online": False}


def point(examples, seconds, hits, misses, read, written, train_busy):
    return {"examples": examples, "seconds": seconds, "mem_hits": hits, "mem_misses": misses,
            "ssd_bytes_read": read, "ssd_bytes_written": written, "stages": {"train": train_busy, "read": 0.1},
            "auc": 0.7, "logloss": 0.5}


HISTORY = [point(0, 0.0, 0, 0, 0, 0, 0.0),
           point(2000, 2.0, 100, 300, 4e6, 2e6, 1.5),
           point(4000, 3.0, 400, 400, 6e6, 2e6, 2.7),   # the train stage's batch straddled the point: > 1
           point(4500, 3.5, 440, 410, 7e6, 3e6, 3.0)]


def test_intervals_are_per_interval_rates_with_a_marked_short_last_one():
    spans = intervals(HISTORY)
    assert [s["trained"] for s in spans] == [2000, 2000, 500]
    assert [s["examples_per_s"] for s in spans] == [1000.0, 2000.0, 1000.0]
    # Hits over lookups in each interval (the cumulative rate would read 0.52 at the end).
    assert [s["hit_rate"] for s in spans] == [0.25, 300 / 400, 40 / 50]
    assert [s["ssd_read_mb_s"] for s in spans] == [2.0, 2.0, 2.0]
    assert [s["ssd_write_mb_s"] for s in spans] == [1.0, 0.0, 2.0]
    assert [s["busy"]["train"] for s in spans] == pytest.approx([0.75, 1.0, 0.6])  # 1.2 clipped to 1
    assert [s["partial"] for s in spans] == [False, False, True]


def test_intervals_skip_points_without_progress_and_tolerate_missing_counters():
    bare = [{"examples": 0, "seconds": 0.0}, {"examples": 0, "seconds": 1.0}, {"examples": 100, "seconds": 2.0}]
    spans = intervals(bare)
    assert len(spans) == 1 and spans[0]["hit_rate"] is None and spans[0]["busy"] == {}
    assert spans[0]["partial"] is False  # one interval: nothing to compare it with
    assert intervals([]) == [] and intervals(bare[:1]) == []


def test_caption_names_the_settings():
    text = caption(SETTINGS)
    for part in ("data synthetic", "batch 1,000", "examples 5,000", "dim 8", "MEM-PS 1MiB (lru)", "2 devices",
                 "sparse adagrad", "MLP 16-8", "pipelined"):
        assert part in text
    assert "epochs" not in text
    assert "3 epochs" in caption(dict(SETTINGS, epochs=3))
    assert caption({}) == ""


def test_write_report_writes_every_plot(tmp_path):
    pytest.importorskip("matplotlib")
    summary = {"history": HISTORY[1:], "examples": 4500, "settings": SETTINGS,
               "pipeline": {"examples": 4500, "busy_seconds": {"train": 3.0, "read": 0.1}, "wall_seconds": 3.6,
                            "bound_by": "train"}}
    written = write_report(summary, str(tmp_path / "report"))
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["auc.png", "hit_rate.png", "ssd_traffic.png", "stages.png", "throughput.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def resumed_summary(pipeline_examples, **more):
    """The summary of a run resumed from one that stopped at 2000 examples: the
    earlier run's two points, then this process's two; its pipeline counted
    `pipeline_examples`."""
    earlier = [point(1000, 1.0, 50, 50, 0, 0, 0.5), point(2000, 2.0, 150, 50, 0, 0, 1.0)]
    resumed = [point(3000, 3.0, 30, 70, 3e6, 0, 2.0), point(4000, 4.0, 120, 80, 4e6, 0, 3.0)]
    return {"history": earlier + resumed, "examples": 4000, "settings": SETTINGS,
            "pipeline": {"examples": pipeline_examples, "busy_seconds": {"train": 3.0, "read": 0.1},
                         "wall_seconds": 4.0, "bound_by": "train"},
            **more}


def drawn_intervals(summary, tmp_path, monkeypatch):
    """The intervals write_report plots for `summary`."""
    import hps.report as report
    drawn = []
    monkeypatch.setattr(report, "_plot_intervals", lambda plt, spans, save: drawn.extend(spans))
    report.write_report(summary, str(tmp_path / "report"))
    return drawn


def test_write_report_of_a_resumed_run_starts_its_intervals_where_this_process_started(tmp_path, monkeypatch):
    """A resumed run's history holds the points of the run it resumed from, whose
    seconds and counters are that process's; this process's start (seconds 0,
    counters 0) belongs before its own first point. Put before every point, it left
    this process's first interval out, and the interval from the earlier run's last
    point to this run's first mixed two processes' counters (a hit rate of 1.2)."""
    pytest.importorskip("matplotlib")
    drawn = drawn_intervals(resumed_summary(2000), tmp_path, monkeypatch)
    assert [(s["examples"], s["trained"], s["seconds"]) for s in drawn] == \
        [(2000, 1000, 1.0), (3000, 1000, 3.0), (4000, 1000, 1.0)]
    assert [s["hit_rate"] for s in drawn] == [1.0, 0.3, 0.9]
    assert [s["ssd_read_mb_s"] for s in drawn] == [0.0, 1.0, 1.0]


def test_write_report_of_a_resumed_job_starts_its_intervals_where_this_process_started(tmp_path, monkeypatch):
    """Under mpiexec rank 0's history holds the job's examples but rank 0's clock and
    counters, and its pipeline counts rank 0's examples alone, so the start cannot be
    told from them: hps.train records it (``started_at``). Without a start a resumed
    job's report took the interval from the earlier run's last point to this run's
    first across two processes (a hit rate of 1.2), and lost this run's first."""
    pytest.importorskip("matplotlib")
    summary = resumed_summary(1000, started_at={"examples": 2000, "batches": 2},
                              distributed={"rank": 0, "world": 2, "ranks": []})
    drawn = drawn_intervals(summary, tmp_path, monkeypatch)
    assert [(s["examples"], s["trained"], s["seconds"]) for s in drawn] == \
        [(2000, 1000, 1.0), (3000, 1000, 3.0), (4000, 1000, 1.0)]
    assert [s["hit_rate"] for s in drawn] == [1.0, 0.3, 0.9]
    assert [s["ssd_read_mb_s"] for s in drawn] == [0.0, 1.0, 1.0]
