"""`hps size` (hps.sizing): its per-row and index sizes against a real SsdStore and
MemCache, its hit-rate replay on a trace whose LRU hit rate is known by hand, the
command's errors and JSON, and the check against a real run (bench/size_check.py --quick)."""
import doctest
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hps
from hps import sizing
from hps.cli import main

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """\
[ps]
dim = 16
path = "{path}"
mem_budget = "{budget}"
cache_policy = "{policy}"

[ps.optimizer]
kind = "{optimizer}"

[data]
source = "{source}"
batch_size = 512
eval_examples = 0
"""


def write_config(tmp_path, budget="2MiB", policy="tinylfu-lfu", optimizer="adagrad", source="synthetic",
                 examples=20000) -> str:
    path = tmp_path / "run.toml"
    text = CONFIG.format(path=tmp_path / "job", budget=budget, policy=policy, optimizer=optimizer, source=source)
    path.write_text(text + ("" if examples is None else f"train_examples = {examples}\n"))
    return str(path)


def store(path, row_bytes, file_records=1 << 16):
    return hps.SsdStore(path, row_bytes, file_records=file_records, use_io_uring=False, direct_io=False,
                        background_compaction=False)


# ---------------------------------------------------------------- sizes against the real thing

def test_docstring_examples():
    result = doctest.testmod(sizing)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("row_bytes, rows, file_records", [(128, 2500, 1000), (68, 70_000, 1 << 16), (196, 1, 7)])
def test_disk_bytes_are_the_real_files(tmp_path, row_bytes, rows, file_records):
    """A freshly written store's files are exactly the estimate (the layout of docs/ssd_format.md)."""
    s = store(tmp_path / "s", row_bytes, file_records)
    keys = np.arange(1, rows + 1, dtype=np.uint64)
    s.put(keys, np.zeros((rows, row_bytes), np.uint8))
    s.commit()
    on_disk = sum(os.path.getsize(f) for f in glob.glob(str(tmp_path / "s" / "*.hpf")))
    assert on_disk == s.stats()["disk_bytes"] == sizing.ssd_disk_bytes(rows, row_bytes, file_records)


@pytest.mark.parametrize("keys", [0, 1_000, 100_000, 400_000])
@pytest.mark.parametrize("rewritten", [False, True])
def test_index_bytes_within_2_percent(tmp_path, keys, rewritten):
    """The index's expected memory (Poisson spread over its shards) against its own
    accounting, for keys put once and for keys put again (as training does)."""
    s = store(tmp_path / "s", 8)
    k = np.arange(1, keys + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for _ in range(2 if rewritten else 1):
        if keys:
            s.put(k, np.zeros((keys, 8), np.uint8))
    real = s.stats()["index_bytes"]
    est = sizing.ssd_index_bytes(keys, rewritten=rewritten)
    assert abs(est - real) <= 0.02 * real, (est, real)


@pytest.mark.parametrize("row_bytes, budget", [(128, 24 << 20), (68, 3 << 20), (196, 1 << 30)])
def test_mem_capacity_and_charge_are_the_budgets(row_bytes, budget):
    """The rows a budget holds are MemCache's own capacity, and each is charged row + bookkeeping."""
    cache = hps.MemCache(row_bytes, budget=budget, policy="lru")
    st = cache.stats()
    cap = sizing.mem_capacity(budget, row_bytes)
    assert st["capacity"] == cap
    assert st["arena_bytes"] == cap * row_bytes
    charge = row_bytes + sizing.mem_overhead_per_row(row_bytes)
    assert cap * charge <= budget < (cap + 1) * charge


# ---------------------------------------------------------------- the hit-rate replay

def trace(batches):
    batches = [np.array(b, np.uint64) for b in batches]
    keys = np.unique(np.concatenate(batches))
    return sizing.Sample(examples=len(batches), batches=batches, field_first=[np.arange(len(keys))],
                         field_length=[int(sum(len(b) for b in batches))], exhausted=True)


LRU_TRACE = [[1, 2], [3, 4], [1, 2], [5, 6], [3, 4], [5, 6]]


@pytest.mark.parametrize("in_flight", [1, 2])
def test_lru_hit_rate_of_a_known_trace(in_flight):
    """LRU of 4 rows: [1 2] [3 4] miss, [1 2] hit, [5 6] evicts 3 4, [3 4] evicts 1 2, [5 6] hit:
    4 hits of 12, with or without the previous batch pinned."""
    smp = trace(LRU_TRACE)
    h = sizing.estimate_hit_rate(smp, capacity=4, policy="lru", rows=6, run_batches=6, in_flight=in_flight)
    assert h["method"] == "replay" and h["hit_rate"] == pytest.approx(4 / 12) and h["hit_rate_sample"] == 4 / 12


def test_steady_rate_extends_a_short_sample():
    """The run twice the sample: the batches after it hit at the sample's last-quarter rate."""
    smp = trace(LRU_TRACE * 2)  # the second half: [1 2] miss, [3 4] miss ... see above, then the same again
    h = sizing.estimate_hit_rate(smp, capacity=4, policy="lru", rows=6, run_batches=24, in_flight=1)
    hits = h["hit_rate_sample"] * 24
    assert h["hit_rate"] == pytest.approx((hits + h["hit_rate_steady"] * 24) / 48)


def test_rows_that_fit_are_compulsory_misses_only():
    h = sizing.estimate_hit_rate(trace(LRU_TRACE), capacity=100, policy="lru", rows=6, run_batches=6)
    assert h["method"] == "fits" and h["hit_rate"] == pytest.approx(1 - 6 / 12)


def test_a_sample_that_never_fills_the_cache_is_scaled():
    """The sample's 6 keys fit a cache of 8, the run's 12 would not: replayed at 8 x 6 / 12 = 4
    rows, the LRU trace above (4 hits of 12)."""
    h = sizing.estimate_hit_rate(trace(LRU_TRACE), capacity=8, policy="lru", rows=12, run_batches=12, in_flight=1)
    assert h["method"] == "scaled" and h["scaled_capacity"] == 4 and h["hit_rate"] == pytest.approx(4 / 12)
    assert "raise --sample" in h["note"]


def test_a_budget_below_one_batch_is_named():
    h = sizing.estimate_hit_rate(trace([[1, 2, 3, 4, 5]]), capacity=3, policy="lru", rows=10, run_batches=1)
    assert h["hit_rate"] is None and "CacheFullError" in h["error"] and "3 rows" in h["error"]


# ---------------------------------------------------------------- the command

def test_size_json_parses_and_is_consistent(tmp_path, capsys):
    cfg = write_config(tmp_path)
    assert main(["size", "--config", cfg, "--sample", "5000", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["mem"]["row_bytes"] == 4 * 32  # AdaGrad: dim + dim accumulators
    assert e["mem"]["capacity_rows"] == hps.MemCache(128, budget="2MiB").stats()["capacity"]
    assert e["sample"]["examples"] == 5000 and e["run"]["batches"] == -(-20000 // 512)
    assert 0 < e["hit"]["hit_rate"] < 1 and e["hit"]["method"] == "replay"
    assert e["ssd"]["disk_live_bytes"] <= e["ssd"]["disk_at_trigger_bytes"]
    assert e["run"]["rows"] >= e["sample"]["distinct_keys"]
    assert not (tmp_path / "job").exists()  # sizing writes nothing


def test_size_leaves_the_lookahead_room_out_of_the_rows(tmp_path, capsys):
    """With a lookahead window, MEM-PS's rows get the budget less the window's room
    (lookahead_room, "auto": sized by hps train for its batches): hps size gives the room
    and rows the run's server holds, and says so."""
    pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
    from hps.train import TrainConfig, train
    cfg = write_config(tmp_path, budget="16MiB", examples=2048)
    Path(cfg).write_text(Path(cfg).read_text().replace("[ps]\n", "[ps]\nlookahead = 4\n"))
    assert main(["size", "--config", cfg, "--sample", "2048", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["mem"]
    real = train(TrainConfig.from_toml(cfg), progress=False)["ps"]["mem"]
    assert m["lookahead_room_bytes"] == real["lookahead_room"] > (16 << 20) // 16
    assert m["capacity_rows"] == real["capacity"] < hps.MemCache(128, budget="16MiB").stats()["capacity"]
    assert main(["size", "--config", cfg, "--sample", "2048"]) == 0
    assert "for the lookahead window" in capsys.readouterr().out


def test_size_refuses_a_window_room_as_the_run_does(tmp_path, capsys):
    """A budget that cannot hold the room hps train sizes for its window: hps size says
    so as the run would, rather than size rows the run never has."""
    pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
    from hps.train import TrainConfig, train
    cfg = write_config(tmp_path, budget="2MiB", examples=2048)
    Path(cfg).write_text(Path(cfg).read_text().replace("[ps]\n", "[ps]\nlookahead = 4\n"))
    assert main(["size", "--config", cfg, "--sample", "2048"]) == 2
    err = capsys.readouterr().err
    with pytest.raises(ValueError) as e:
        train(TrainConfig.from_toml(cfg), progress=False)
    assert "lookahead = 4 keeps a window of 4 batches of up to 13,312 keys" in str(e.value)
    assert str(e.value) in err
    assert not (tmp_path / "job").exists()


def test_size_table_and_whole_data_sample(tmp_path, capsys):
    """A sample of the whole run counts its rows instead of extrapolating."""
    cfg = write_config(tmp_path, budget="64MiB", optimizer="sgd")
    assert main(["size", "--config", cfg, "--sample", "20000"]) == 0
    out = capsys.readouterr().out
    assert "MEM-PS hit rate" in out and "SSD-PS index memory" in out and "counted" in out
    assert "16 + state = 16 floats = 64 B (sgd)" in out


@pytest.mark.parametrize("args, flag", [
    (["--config", "{dir}/missing.toml"], "--config"),
    (["--config", "{cfg}", "--rows", "0"], "--rows"),
    (["--config", "{cfg}", "--sample", "0"], "--sample"),
])
def test_size_errors_name_the_flag(tmp_path, capsys, args, flag):
    cfg = write_config(tmp_path)
    assert main(["size", *[a.format(dir=tmp_path, cfg=cfg) for a in args]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hps size: ") and flag in err


@pytest.mark.parametrize("args, flag", [(["--rows", "many"], "--rows"), ([], "--config")])
def test_size_bad_arguments_exit_naming_the_flag(tmp_path, capsys, args, flag):
    with pytest.raises(SystemExit) as e:
        main(["size", *args] + (["--config", write_config(tmp_path)] if flag != "--config" else []))
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_files_of_unknown_length_need_rows(tmp_path, capsys):
    tsv = tmp_path / "day.tsv"
    hps.data.SyntheticCriteo(seed=3).write_tsv(str(tsv), 3000)
    cfg = write_config(tmp_path, source=str(tsv), examples=None)  # all of the files: their length unknown
    assert main(["size", "--config", cfg, "--sample", "1000"]) == 2
    assert "--rows" in capsys.readouterr().err
    assert main(["size", "--config", cfg, "--sample", "2000", "--rows", "50000", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["hit"]["method"] == "replay"
    assert e["run"]["rows"] == 50000 and e["run"]["batches"] is None
    assert e["hit"]["hit_rate"] == e["hit"]["hit_rate_steady"]  # the run's length unknown: the steady rate
    assert main(["size", "--config", cfg, "--sample", "5000", "--json"]) == 0  # the whole file: counted
    e = json.loads(capsys.readouterr().out)
    assert e["sample"]["exhausted"] is True and e["run"]["examples_per_pass"] == 3000
    assert e["run"]["rows"] == e["sample"]["distinct_keys"]
    cfg = write_config(tmp_path, source=str(tsv), examples=2500)  # the files' first 2500
    assert main(["size", "--config", cfg, "--sample", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["examples_per_pass"] == 2500


def test_data_without_an_example_is_named_not_divided_by(tmp_path, capsys):
    # 0 examples (a 0-byte export) ended hps size in a ZeroDivisionError traceback, or
    # with --rows in the sizes of a run of 0 batches.
    tsv = tmp_path / "day.tsv"
    tsv.write_bytes(b"")
    cfg = write_config(tmp_path, source=str(tsv), examples=None)
    for rows in ([], ["--rows", "1000"]):
        with pytest.warns(hps.data.EmptyFileWarning):
            assert main(["size", "--config", cfg, *rows]) == 2
        assert capsys.readouterr().err.strip() == \
            f"hps size: {tsv}: the training data holds no examples: nothing to size"


# ---------------------------------------------------------------- against a real run

def test_size_check_quick():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "size_check.py"), "--quick", "--no-save"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    q = {x["name"]: x for x in line["quantities"]}
    assert q["MEM-PS capacity (rows)"]["relative_error"] == 0
    assert abs(q["SSD-PS index bytes at the measured rows"]["relative_error"]) < 0.02
    assert abs(q["rows stored (distinct keys)"]["relative_error"]) < 0.15
    assert abs(q["MEM-PS hit rate"]["relative_error"]) < 0.15
    assert line["disk_at_end"]["within_trigger"] is True


def test_herald_tables_are_sized_as_a_run_sizes_them(tmp_path, capsys):
    """With schedule = "herald" the device tier persists: hps size gives the tables a
    run grows to (a cache and a batch's distinct keys at most half a table) and the
    scheduler's snapshot."""
    cfg = write_config(tmp_path, budget="8MiB", examples=4096)
    text = Path(cfg).read_text().replace("[ps]\n", "[ps]\ndevices = 4\nschedule = \"herald\"\nworker_cache_rows = 3000\n")
    Path(cfg).write_text(text)
    assert main(["size", "--config", cfg, "--sample", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["device"]
    assert d["kind"].endswith("herald worker caches") and d["tiers"] == 1 and d["cache_rows"] == 3000
    assert d["table_rows"] >= 2 * (3000 + d["most_keys_per_device"]) and d["scheduler_bytes"] == 19 * 4 * 3000
    # The real run: its tables end at that size (the estimate's batches are the run's).
    from hps.train import TrainConfig
    from hps.parameter_server import ParameterServer
    run = TrainConfig.from_toml(cfg)
    ps = ParameterServer(run.ps)
    for b in hps.data.SyntheticCriteo(seed=run.seed, batch_size=512, examples=4096):
        with ps.batch(ps.prefetch(b.keys)) as batch:
            for w, idx in enumerate(batch.partition()):
                k = b.keys[idx].reshape(-1)
                batch.push(k, np.zeros((len(k), 16), np.float32), worker=w)
    assert ps.stats()["device"]["capacity_per_device"] == d["table_rows"]


# A small hps train run; {top}: top-level lines, {bounds}: [ps] bounds (max_rows, ttl_steps).
RUN = """\
hidden = [8]
{top}checkpoint_every = 5
torch_threads = 1

[ps]
dim = 8
path = "{path}"
mem_budget = "4MiB"
{bounds}

[ps.optimizer]
kind = "adagrad"

[data]
source = "synthetic"
batch_size = 1024
train_examples = 20000
eval_examples = 0
"""


def test_worst_disk_before_a_commit_bounds_a_run_with_checkpoints(tmp_path, capsys):
    """'every row the run writes' counted each MEM-PS miss once, but a checkpoint before
    the last also writes the dirty rows cached then, and those are written again when
    evicted: with no compaction in the run (16,000 rows over 23,800 cached) the disk
    after the last checkpoint passed the 'worst before a commit' by a third."""
    pytest.importorskip("torch", reason="the run is hps train's")
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(top="eval_every = 1\n", path=tmp_path / "job", bounds=""))
    assert main(["size", "--config", str(cfg), "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["sample"]["exhausted"] and e["run"]["batches"] == 20  # the estimate replays the whole run
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "job" / "train-summary.json").read_text())
    peak = max(h["ssd_disk_bytes"] for h in summary["history"])
    assert peak <= e["ssd"]["disk_worst_bytes"], (peak, e["ssd"])




def test_max_rows_bounds_the_rows_and_disk_a_run_keeps(tmp_path, capsys):
    """[ps] max_rows = 5,000 of the data's 67k keys: hps size sized the store for every
    key (20 MiB of disk for 364 KiB) and MEM-PS for a full cache at the end; the run
    keeps 5,000 rows at each checkpoint, and the estimate now says so (the index,
    which never shrinks, stays sized for every key)."""
    pytest.importorskip("torch", reason="the run is hps train's")
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(top="", path=tmp_path / "job", bounds="max_rows = 5000"))
    assert main(["size", "--config", str(cfg), "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    b = e["run"]["bounds"]
    assert e["run"]["rows"] > 50_000 and b["rows_kept"] == e["ssd"]["live_rows"] == 5000
    assert b["rows_kept"] < b["rows_peak"] <= e["run"]["rows"] and not b["upper_bound"]
    assert e["ssd"]["disk_live_bytes"] == sizing.ssd_disk_bytes(5000, 64, 1 << 16)
    assert e["mem"]["cached_rows_at_end"] <= 5000
    assert "max_rows = 5,000 keeps at most that many" in b["notes"][0]
    assert main(["size", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "rows kept (max_rows)" in out and "5,000 at each checkpoint" in out

    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "job" / "train-summary.json").read_text())
    ssd, mem = summary["ps"]["ssd"], summary["ps"]["mem"]
    assert ssd["live_records"] == 5000 and ssd["disk_bytes"] <= e["ssd"]["disk_live_bytes"]
    assert mem["size"] <= e["mem"]["cached_rows_at_end"]
    assert max(h["ssd_disk_bytes"] for h in summary["history"]) <= e["ssd"]["disk_worst_bytes"]
    assert abs(ssd["index_bytes"] - e["ssd"]["index_bytes"]) < 0.02 * ssd["index_bytes"]


def test_ttl_and_admission_make_the_estimate_an_upper_bound(tmp_path, capsys):
    """ttl_steps and [admission] lower the rows by what the data does: not modelled,
    the estimate says it is an upper bound and which fields make it so."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(top="", path=tmp_path / "job", bounds="ttl_steps = 3")
                   + "\n[admission]\nthreshold = 2\n")
    assert main(["size", "--config", str(cfg), "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    b = e["run"]["bounds"]
    assert b["upper_bound"] and b["rows_kept"] == b["rows_peak"] == e["run"]["rows"]
    assert ("[ps] ttl_steps = 3" in b["notes"][0] and "[admission] threshold = 2" in b["notes"][0]
            and "upper bounds" in b["notes"][0])
    assert main(["size", "--config", str(cfg)]) == 0
    assert "note: not modelled: [ps] ttl_steps = 3" in capsys.readouterr().out
