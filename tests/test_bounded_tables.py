"""Bounded tables (issue 20): [ps] ttl_steps and max_rows against a model of what
expires and what the cap takes, across checkpoints and reopens, with MEM-PS
copies dropped, SSD-PS space given back, and the erased keys as `hps export`
tombstones (docs/parameter_server.md, "Bounded tables")."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

import hps

DIM = 4
UNIVERSE = 400


def config(path, **kw):
    kw.setdefault("mem_budget", "4MiB")  # every row stays in MEM-PS: stamps are checkpoint steps
    return hps.ParameterServerConfig(dim=DIM, path=str(path), optimizer=hps.SGD(lr=0.5), seed=3,
                                     ssd=hps.parameter_server.SsdOptions(file_records=32, compaction_trigger=1.2),
                                     **kw)


class Model:
    """key -> the step of the checkpoint after its last update: the granularity
    of "last updated" when MEM-PS holds every row between checkpoints (each
    updated row reaches SSD-PS at the checkpoint's flush, stamped with its step)."""

    def __init__(self, ttl, cap):
        self.ttl, self.cap = ttl, cap
        self.stamp = {}
        self.touched = set()  # updated since the last checkpoint

    def update(self, keys):
        self.touched |= {int(k) for k in keys}

    def checkpoint(self, step):
        for k in self.touched:
            self.stamp[k] = step
        self.touched = set()
        expired = sorted(k for k, s in self.stamp.items() if self.ttl and step - s > self.ttl)
        for k in expired:
            del self.stamp[k]
        capped = []
        if self.cap and len(self.stamp) > self.cap:
            order = sorted(self.stamp, key=lambda k: (self.stamp[k], k))
            capped = sorted(order[:len(self.stamp) - self.cap])
            for k in capped:
                del self.stamp[k]
        return expired, capped


def initial_rows(tmp_path, keys):
    """What a server that never saw keys reads for them: erased keys read so."""
    fresh = hps.ParameterServer(config(tmp_path / "fresh"))
    try:
        return fresh.pull(np.asarray(keys, np.uint64))
    finally:
        fresh.close()


@pytest.mark.parametrize("ttl,cap", [(6, 0), (0, 120), (5, 150)])
def test_rows_expire_and_are_capped_as_the_model_says(tmp_path, ttl, cap):
    path = tmp_path / "ps"
    ps = hps.ParameterServer(config(path, ttl_steps=ttl, max_rows=cap))
    model = Model(ttl, cap)
    rng = np.random.default_rng(7)
    all_keys = np.arange(1, UNIVERSE + 1, dtype=np.uint64)
    expired_total = capped_total = 0
    for round_ in range(8):
        for _ in range(3):  # steps: hot keys every time, the rest now and then
            keys = np.unique(np.concatenate([rng.integers(1, 40, 20), rng.integers(1, UNIVERSE + 1, 30)]))
            keys = keys.astype(np.uint64)
            ps.push(keys, np.ones((len(keys), DIM), np.float32))
            model.update(keys)
        before = ps.pull(all_keys)
        ps.checkpoint()
        expired, capped = model.checkpoint(ps.step)
        counts = ps.stats()["counts"]
        assert counts["expired"] - expired_total == len(expired), f"round {round_}"
        assert counts["capped"] - capped_total == len(capped), f"round {round_}"
        expired_total, capped_total = counts["expired"], counts["capped"]
        # SSD-PS holds exactly the model's keys, each stamped as the model says.
        stamps, found = ps._ssd.stamps(all_keys)
        assert {int(k) for k in all_keys[found]} == set(model.stamp), f"round {round_}"
        assert {int(k): int(s) for k, s in zip(all_keys[found], stamps[found])} == model.stamp
        # MEM-PS dropped the erased rows: none is cached, and each reads as new.
        erased = np.array(expired + capped, np.uint64)
        assert not any(int(k) in ps._cache for k in erased)
        after = ps.pull(all_keys)
        np.testing.assert_array_equal(after[found], before[found])
        if len(erased):
            np.testing.assert_array_equal(ps.pull(erased), initial_rows(tmp_path / f"r{round_}", erased))
        if cap:
            assert len(ps._ssd) <= cap
        if round_ % 3 == 2:  # resume: the step and the stamps go on
            step = ps.step
            ps.close()
            ps = hps.ParameterServer.open(path)
            assert ps.step == step
            expired_total = capped_total = 0  # the counts are the process's
    assert model.stamp and ps._ssd.stats()["files"] > 0  # something is still live
    ps.close()


def test_the_bounds_bit_in_the_model_runs():
    """The model runs above erase rows by each bound (or they would prove nothing)."""
    rng = np.random.default_rng(7)
    for ttl, cap in [(6, 0), (0, 120), (5, 150)]:
        model, expired, capped, step = Model(ttl, cap), 0, 0, 0
        for _ in range(8):
            for _ in range(3):
                step += 1
                model.update(np.unique(np.concatenate([rng.integers(1, 40, 20), rng.integers(1, UNIVERSE + 1, 30)])))
            e, c = model.checkpoint(step)
            expired, capped = expired + len(e), capped + len(c)
        assert (expired > 50) == bool(ttl) and (capped > 50) == bool(cap), (ttl, cap, expired, capped)


def test_ttl_is_a_lower_bound_with_evictions_and_the_cap_is_hard(tmp_path):
    """With a MEM-PS too small for the keys, dirty rows reach SSD-PS between
    checkpoints, stamped with the step of their eviction: a row is never
    erased within ttl_steps of its last update, and never more than max_rows stay."""
    ttl, cap = 4, 300
    ps = hps.ParameterServer(config(tmp_path / "ps", ttl_steps=ttl, max_rows=cap, mem_budget="16KiB",
                                    write_buffer_rows=16))
    last = {}
    rng = np.random.default_rng(1)
    for step in range(1, 31):
        keys = np.unique(rng.integers(1, 1000, 60)).astype(np.uint64)
        ps.push(keys, np.ones((len(keys), DIM), np.float32))
        for k in keys:
            last[int(k)] = step
        if step % 3 == 0:
            ps.checkpoint()
            assert len(ps._ssd) <= cap
            all_keys = np.array(sorted(last), np.uint64)
            _, found = ps._ssd.stamps(all_keys)
            for k, f in zip(all_keys, found):
                recent = step - last[int(k)] <= ttl
                if recent and not f:
                    # only the cap may take a recent row, and only when it binds
                    assert ps.stats()["counts"]["capped"] > 0, f"key {k} last updated at {last[int(k)]}"
    counts = ps.stats()["counts"]
    assert counts["expired"] > 0 and counts["capped"] > 0
    assert ps.stats()["mem"]["dirty_evictions"] > 0
    ps.close()


@pytest.mark.parametrize("ttl", [0, 1000])
def test_stamps_move_each_batch_with_bounds_on_and_at_checkpoints_with_them_off(tmp_path, ttl):
    """Bounds off, the batch path makes no stamping call (issue 15's crossings): rows
    evicted between checkpoints carry the last checkpoint's step. Bounds on (a TTL
    that expires nothing here), they carry the step of their eviction."""
    ps = hps.ParameterServer(config(tmp_path / "ps", ttl_steps=ttl, mem_budget="16KiB", write_buffer_rows=16))
    rng = np.random.default_rng(1)
    seen = set()
    for step in range(1, 13):
        keys = np.unique(rng.integers(1, 1000, 60)).astype(np.uint64)
        ps.push(keys, np.ones((len(keys), DIM), np.float32))
        seen |= {int(k) for k in keys}
        if step % 4 == 0:
            ps.checkpoint()
    stamps, found = ps._ssd.stamps(np.array(sorted(seen), np.uint64))
    assert found.all() and ps.stats()["mem"]["dirty_evictions"] > 0
    between = {int(s) for s in stamps} - {0, 4, 8, 12}
    if ttl:
        assert between, "no row stamped with a step between checkpoints"
    else:
        assert not between, f"stamps between checkpoints with bounds off: {sorted(between)}"
    ps.close()


def _checkpointed_at_step_1(root):
    """(a server at root whose keys 1..100 were pushed once and checkpointed, its keys)."""
    ps = hps.ParameterServer(config(root, ttl_steps=100))
    keys = np.arange(1, 101, dtype=np.uint64)
    ps.push(keys, np.ones((len(keys), DIM), np.float32))  # step 1
    ps.checkpoint(_trainer_state(1))
    return ps, keys


def _trainer_state(step):
    """hps train's dense state for a checkpoint at `step` (what a reshard reads beside the rows)."""
    import io
    import torch
    from hps.jobdir import write_trainer_state
    buf = io.BytesIO()
    torch.save({"mlp": {}, "opt": {}, "batches_done": step, "examples_done": step}, buf)
    return lambda directory: write_trainer_state(directory, buf.getvalue(), step, step)


def test_a_resharded_rank_goes_on_from_the_jobs_step(tmp_path):
    """A rank of a resharded job opens a checkpoint its metadata does not name: its
    step is the job's, not the newest stamp of the rows it got, which is older when
    the last interval updated none of them (its TTL would then run late, and its
    rows be stamped behind the other ranks')."""
    pytest.importorskip("torch", reason="a reshard reads hps train's dense state")
    from hps import reshard
    root = tmp_path / "job"
    ps, keys = _checkpointed_at_step_1(root)
    for _ in range(3):  # steps 2 to 4: key 1 alone
        ps.push(keys[:1], np.ones((1, DIM), np.float32))
    ps.checkpoint(_trainer_state(4))
    ps.close()
    old = reshard.check_source(str(root))
    done = [reshard.write_rank(str(root), 2, r) for r in range(2)]
    reshard.commit(str(root), 2, old, done[0][1])
    newest = []
    for r in range(2):
        rank = hps.ParameterServer(config(root / f"rank{r}", ttl_steps=100), checkpoint=done[0][1])
        stamps, found = rank._ssd.stamps(keys)
        newest.append(int(stamps[found].max()))
        assert rank.step == 4, f"rank {r}"
        rank.close()
    assert sorted(newest) == [1, 4]  # one rank holds rows of step 1 only


def test_a_rank_that_got_further_than_the_job_takes_the_reshards_step(tmp_path):
    """A rank finished checkpoint K+1 (its metadata names it, at a later step) before
    the job died with job.json at K; resharded, the reshard's own checkpoint K+1
    replaces that rank's: the rank goes on from the job's step at K."""
    pytest.importorskip("torch", reason="a reshard reads hps train's dense state")
    from hps import reshard
    root = tmp_path / "job"
    ps, keys = _checkpointed_at_step_1(root)
    ps.close()
    old = reshard.check_source(str(root))  # to a job of 2 ranks at checkpoint 2, step 1
    reshard.commit(str(root), 2, old, [reshard.write_rank(str(root), 2, r) for r in range(2)][0][1])
    rank0 = hps.ParameterServer(config(root / "rank0", ttl_steps=100), checkpoint=2)
    for _ in range(3):
        rank0.push(keys, np.ones((len(keys), DIM), np.float32))
    assert rank0.checkpoint(_trainer_state(4), keep_previous=True) == 3  # job.json still names 2
    rank0.close()
    old = reshard.check_source(str(root))
    done = [reshard.write_rank(str(root), 3, r) for r in range(3)]
    reshard.commit(str(root), 3, old, done[0][1])
    assert done[0][1] == 3
    for r in range(3):
        rank = hps.ParameterServer(config(root / f"rank{r}", ttl_steps=100), checkpoint=3)
        assert rank.step == 1, f"rank {r}"
        rank.close()


def test_a_server_rolled_back_goes_on_from_that_checkpoints_step(tmp_path):
    """An MPI rank rolls back to the checkpoint job.json names, which its metadata no
    longer names: it goes on from that checkpoint's step, even when the batches
    before it updated none of its rows (a rank that owned no key of those steps)."""
    path = tmp_path / "ps"
    ps = hps.ParameterServer(config(path, ttl_steps=100))
    keys = np.arange(1, 101, dtype=np.uint64)
    ps.push(keys, np.ones((len(keys), DIM), np.float32))  # step 1
    ps.checkpoint()
    for _ in range(2):  # steps 2 and 3 update no row
        with ps.batch(keys[:5]):
            pass
    assert ps.checkpoint(keep_previous=True) == 2
    ps.push(keys, np.ones((len(keys), DIM), np.float32))  # step 4
    assert ps.checkpoint(keep_previous=True) == 3
    ps.close()
    ps = hps.ParameterServer(config(path, ttl_steps=100), checkpoint=2)
    assert ps.step == 3
    assert int(ps._ssd.stamps(keys)[0].max()) == 1  # the rows' stamps alone say step 1
    ps.close()
    ps = hps.ParameterServer.open(path)  # the metadata names checkpoint 2 now, at its step
    assert ps.checkpoint_number == 2 and ps.step == 3
    ps.close()


@pytest.mark.parametrize("devices", [1, 2])
def test_a_row_a_prefetch_holds_across_the_checkpoint_comes_back_as_new(tmp_path, devices):
    """A prefetch made before a checkpoint that expires one of its keys pins that
    key's row in MEM-PS: the checkpoint cannot drop it, and it kept the erased row,
    which its batch then trained on and the next checkpoint wrote back (a key erased
    from SSD-PS, resurrected from MEM-PS). The pinned copy now gets the key's
    initial row, as a key never seen: unless its batch updates it, it is not stored."""
    ps = hps.ParameterServer(config(tmp_path / "ps", ttl_steps=1, devices=devices))
    key, other = np.array([5], np.uint64), np.array([9], np.uint64)
    ps.push(key, np.ones((1, DIM), np.float32))  # step 1
    ps.checkpoint()
    for _ in range(2):  # steps 2 and 3: key 5 not updated for 2 > ttl_steps steps
        ps.push(other, np.ones((1, DIM), np.float32))
    pre = ps.prefetch(key)
    ps.checkpoint()
    assert ps.stats()["counts"]["expired"] == 1 and not ps._ssd.stamps(key)[1][0]
    initial = initial_rows(tmp_path / "fresh", key)
    with ps.batch(pre) as b:  # reads the row, updates nothing
        np.testing.assert_array_equal(b.pull(key), initial)
    ps.checkpoint()
    assert not ps._ssd.stamps(key)[1][0]  # not written back
    np.testing.assert_array_equal(ps.pull(key), initial)
    ps.close()


def test_expired_space_is_given_back(tmp_path):
    ps = hps.ParameterServer(config(tmp_path / "ps", ttl_steps=2))
    keys = np.arange(1, 2001, dtype=np.uint64)
    ps.push(keys, np.ones((len(keys), DIM), np.float32))
    ps.checkpoint()
    full = ps._ssd.stats()["disk_bytes"]
    hot = keys[:10]
    for _ in range(4):
        ps.push(hot, np.ones((len(hot), DIM), np.float32))
    ps.checkpoint()
    st = ps._ssd.stats()
    assert st["live_records"] == 10 and st["disk_bytes"] < full / 20
    store = tmp_path / "ps" / "ssd"
    assert sum(name.endswith(".hpf") for name in os.listdir(store)) == st["files"]
    ps.close()
    # the checkpoint's snapshot holds the bounded store too
    ps = hps.ParameterServer.open(tmp_path / "ps")
    assert len(ps._ssd) == 10
    ps.close()


def test_a_crash_before_the_checkpoint_keeps_every_row(tmp_path):
    ps = hps.ParameterServer(config(tmp_path / "ps", ttl_steps=1))
    keys = np.arange(1, 101, dtype=np.uint64)
    ps.push(keys, np.ones((len(keys), DIM), np.float32))
    ps.checkpoint()
    rows = ps.pull(keys)
    ps.push(keys[:5], np.ones((5, DIM), np.float32))
    ps.push(keys[:5], np.ones((5, DIM), np.float32))
    # A checkpoint's first half (flush, bound), then a crash: a close with no commit.
    ps._cache.flush_dirty()
    ps._backing.flush()
    ps._bound()  # erased in the live store, not committed
    assert len(ps._ssd) == 5
    ps.close()
    ps = hps.ParameterServer.open(tmp_path / "ps")
    np.testing.assert_array_equal(ps.pull(keys), rows)
    assert len(ps._ssd) == 100
    ps.close()


def test_erased_keys_are_export_tombstones(tmp_path):
    pytest.importorskip("pyarrow", reason="hps export writes Parquet through pyarrow")
    import pyarrow.parquet as pq
    from hps.export import export
    path = tmp_path / "ps"
    ps = hps.ParameterServer(config(path, ttl_steps=2, max_rows=50))
    keys = np.arange(1, 81, dtype=np.uint64)
    ps.push(keys, np.ones((len(keys), DIM), np.float32))
    ps.checkpoint()  # the cap keeps 50: 1..30 go (one stamp, smaller keys first)
    assert ps.stats()["counts"]["capped"] == 30
    meta = export(path, tmp_path / "e1", "c", full=True)
    assert meta["rows"] == 50 and meta["tombstones"] == 0
    hot = keys[60:]
    for _ in range(3):
        ps.push(hot, np.ones((len(hot), DIM), np.float32))
    ps.checkpoint()  # 31..60 not updated for 3 steps: expired
    assert ps.stats()["counts"]["expired"] == 30
    ps.close()
    meta = export(path, tmp_path / "e2", "c")
    table = pq.read_table(tmp_path / "e2").to_pydict()
    gone = {k for k, t in zip(table["key"], table["tombstone"]) if t}
    assert gone == set(range(31, 61)) and meta["tombstones"] == 30
    assert {k for k, t in zip(table["key"], table["tombstone"]) if not t} == set(range(61, 81))


@pytest.mark.parametrize("field,value", [("ttl_steps", -1), ("ttl_steps", "7"), ("ttl_steps", True),
                                         ("max_rows", -5), ("max_rows", 2.5),
                                         ("max_rows", 1 << 64), ("ttl_steps", 1 << 64)])
def test_bad_bounds_are_named(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        hps.ParameterServer(config(tmp_path / "ps", **{field: value}))
    assert not os.path.exists(tmp_path / "ps" / "ssd")


def test_bounds_are_refused_with_herald_worker_caches(tmp_path):
    with pytest.raises(ValueError, match="ttl_steps = 5 and max_rows = 0.*schedule = 'sequential'"):
        hps.ParameterServer(config(tmp_path / "ps", ttl_steps=5, schedule="herald"))


def test_the_toml_fields_reach_the_server(tmp_path):
    toml = tmp_path / "ps.toml"
    toml.write_text(f'dim = 4\npath = "{tmp_path / "ps"}"\nttl_steps = 100\nmax_rows = 7\n')
    cfg = hps.ParameterServerConfig.from_toml(toml)
    assert (cfg.ttl_steps, cfg.max_rows) == (100, 7)
    toml.write_text(f'dim = 4\npath = "{tmp_path / "ps"}"\nttl_step = 100\n')
    with pytest.raises(ValueError, match="ttl_step"):
        hps.ParameterServerConfig.from_toml(toml)


# ---------------------------------------------------------------- hps train

TRAIN_TOML = """
hidden = [8]
torch_threads = 1
checkpoint_every = 2

[ps]
dim = 4
path = "{path}"
mem_budget = "512KiB"
write_buffer_rows = 256
ttl_steps = 3
max_rows = {cap}

[ps.ssd]
file_records = 256

[data]
batch_size = 128
train_examples = 1280
eval_examples = 128
vocab_sizes = {vocab}

[distributed]
timeout = 60
"""
VOCAB = [50, 200, 1000, 5000] + [300] * 22


def _train_config(tmp_path, cap):
    path = tmp_path / "job"
    cfg = tmp_path / "train.toml"
    cfg.write_text(TRAIN_TOML.format(path=path, cap=cap, vocab=VOCAB))
    return path, cfg


def test_hps_train_bounds_the_table_and_reports_it(tmp_path):
    pytest.importorskip("torch", reason="hps train needs torch")
    from hps.cli import main
    cap = 3000
    path, cfg = _train_config(tmp_path, cap)
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    with open(path / "train-summary.json") as f:
        summary = json.load(f)
    counts = summary["ps"]["counts"]
    assert counts["expired"] > 0 and counts["capped"] > 0
    assert summary["ps"]["ssd"]["live_records"] <= cap
    ps = hps.ParameterServer.open(path)
    assert ps.step == summary["batches"] == 10 and len(ps._ssd) <= cap
    ps.close()


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH (pip install mpich)")
def test_under_mpiexec_each_rank_bounds_its_shard(tmp_path):
    pytest.importorskip("torch", reason="hps train needs torch")
    pytest.importorskip("mpi4py", reason="an MPI job needs mpi4py")
    from mpi_scenarios import mpirun  # tests/ is on pytest's sys.path
    cap = 1500
    path, cfg = _train_config(tmp_path, cap)
    mpirun(2, sys.executable, "-m", "hps.cli", "train", "--config", cfg, "--no-progress")
    for rank in range(2):
        with open(path / f"rank{rank}" / "train-summary.json") as f:
            counts = json.load(f)["ps"]["counts"]
        assert counts["expired"] > 0 and counts["capped"] > 0, f"rank {rank}: {counts}"
        ps = hps.ParameterServer.open(path / f"rank{rank}")
        assert ps.step == 10, f"rank {rank}"  # one local batch per global step
        assert len(ps._ssd) == cap, f"rank {rank}"  # the cap bites on each rank's own shard
        ps.close()


def test_hps_train_refuses_bounds_with_herald_before_writing(tmp_path):
    pytest.importorskip("torch", reason="hps train needs torch")
    from hps.train import TrainConfig, train
    path, cfg = _train_config(tmp_path, 100)
    cfg.write_text(cfg.read_text().replace("ttl_steps = 3", "ttl_steps = 3\nschedule = \"herald\""))
    with pytest.raises(ValueError, match=r"ttl_steps = 3 and max_rows = 100.*schedule = 'sequential'"):
        train(TrainConfig.from_toml(cfg))
    assert not path.exists()


def test_a_job_resharded_onto_fewer_ranks_keeps_the_cap_in_its_checkpoint(tmp_path):
    """max_rows is per rank and hard at each checkpoint: a job of 2 ranks each at the
    cap, resharded to one process, gets at most max_rows rows in the reshard's own
    checkpoint (it held both ranks' until the next checkpoint: an export or a
    Lookup of it read twice the cap), the oldest gone as a checkpoint takes them."""
    pytest.importorskip("torch", reason="a reshard reads hps train's dense state")
    from hps import reshard
    from hps.distributed import owner_ranks
    from hps.jobdir import JOB_MANIFEST, read_job
    from hps.parameter_server import RUN
    cap = 60
    root = tmp_path / "job"
    ps = hps.ParameterServer(config(root, max_rows=cap))
    keys = np.arange(1, cap + 1, dtype=np.uint64)
    ps.push(keys, np.ones((len(keys), DIM), np.float32))  # step 1: the cap just holds them
    ps.checkpoint(_trainer_state(1))
    ps.close()
    old = reshard.check_source(str(root))  # to 2 ranks at checkpoint 2, about cap / 2 rows each
    done = [reshard.write_rank(str(root), 2, r) for r in range(2)]
    assert sum(rows for _, _, rows in done) == cap
    reshard.commit(str(root), 2, old, done[0][1])
    more = np.arange(1000, 1000 + 4 * cap, dtype=np.uint64)
    for r in range(2):  # step 2: each rank fills up to the cap with new keys of its own
        rank = hps.ParameterServer(config(root / f"rank{r}", max_rows=cap), checkpoint=2)
        mine = more[owner_ranks(more, 2) == r][:cap - len(rank._ssd)]
        rank.push(mine, np.ones((len(mine), DIM), np.float32))
        assert rank.checkpoint(_trainer_state(2), keep_previous=True) == 3
        assert len(rank._ssd) == cap
        rank.close()
    job = read_job(str(root))
    (root / JOB_MANIFEST).write_text(json.dumps({"world": 2, "step": 2, "checkpoint": 3, RUN: job.run}))
    _, number, rows = reshard.to_one_process(str(root))
    ps = hps.ParameterServer.open(root)
    assert ps.checkpoint_number == number and len(ps._ssd) == cap
    assert rows == cap  # what hps train says is "now in one process": the rows kept, not the 2 x cap put
    stamps, found = ps._ssd.stamps(keys)
    assert not found.any()  # the oldest (step 1's) went first
    ps.close()


def test_keys_an_export_that_failed_after_its_files_delivered_get_tombstones_once_erased(tmp_path, monkeypatch):
    """An export writes its Parquet files and _export.json, then moves the consumer's
    position: failed in between, its directory looks complete, and a consumer may have
    read its rows. The next export goes on from the position before it: the keys only
    that export delivered, erased since, were in no key set it compared against, and
    got no tombstone (the consumer kept them for good)."""
    pytest.importorskip("pyarrow", reason="hps export writes Parquet through pyarrow")
    import pyarrow.parquet as pq
    from hps import export as hexport
    path = tmp_path / "ps"
    ps = hps.ParameterServer(config(path, ttl_steps=2))
    kept, delivered = np.arange(1, 51, dtype=np.uint64), np.arange(101, 121, dtype=np.uint64)
    ps.push(kept, np.ones((len(kept), DIM), np.float32))  # step 1
    ps.checkpoint()
    hexport.export(path, tmp_path / "e0", "c")
    both = np.concatenate([kept, delivered])
    ps.push(both, np.ones((len(both), DIM), np.float32))  # step 2
    ps.checkpoint()

    def no_commit(src, dst):
        raise OSError(28, "No space left on device", dst)
    with monkeypatch.context() as m:
        m.setattr(hexport, "_replace_durable", no_commit)
        with pytest.raises(OSError, match="No space"):
            hexport.export(path, tmp_path / "e1", "c")
    assert set(pq.read_table(tmp_path / "e1").to_pydict()["key"]) >= set(delivered.tolist())  # as a reader finds it
    assert (tmp_path / "e1" / hexport.EXPORT_META).exists()
    for _ in range(3):  # steps 3 to 5: the delivered keys not updated for 3 > ttl_steps steps
        ps.push(kept, np.ones((len(kept), DIM), np.float32))
    ps.checkpoint()
    assert ps.stats()["counts"]["expired"] == len(delivered)
    ps.close()
    # And a key set a crash cut short as it was written (its export never looked whole): skipped.
    whole = next(n for n in os.listdir(path / "exports") if n.endswith(".keys.npy"))
    (path / "exports" / "c.000009-0badcafe.rank00000.keys.npy").write_bytes((path / "exports" / whole).read_bytes()[:90])
    meta = hexport.export(path, tmp_path / "e2", "c")
    table = pq.read_table(tmp_path / "e2").to_pydict()
    assert {k for k, t in zip(table["key"], table["tombstone"]) if t} == set(delivered.tolist())
    assert meta["tombstones"] == len(delivered)
    # The failed export's key sets went with this export's commit: one set, the position's.
    pos = json.loads((path / "exports" / "c.json").read_text())
    assert sorted(n for n in os.listdir(path / "exports") if n.endswith(".keys.npy")) == [pos["ranks"][0]["keys"]]


def test_a_training_iteration_of_several_hps_torch_lookups_is_one_step(tmp_path):
    """Without a batch, each hps.torch lookup's backward pushes to the server; a push
    alone is a step, and a model of two embedding modules (one of them looking up
    twice) aged its rows three steps an iteration: ttl_steps = T expired a row
    unused for T iterations at a third of them. One backward pass is one step."""
    torch = pytest.importorskip("torch")
    import hps.torch as ht
    ttl = 4
    ps = hps.ParameterServer(config(tmp_path / "ps", ttl_steps=ttl))
    user, item = ht.EmbeddingBag(ps), ht.EmbeddingBag(ps)
    once = np.uint64(7)  # looked up at the first iteration only
    for it in range(1, 11):
        keys = [1, 2] + ([int(once)] if it == 1 else [])
        out = (user(torch.tensor([keys])).sum() + user(torch.tensor([[3]])).sum()
               + item(torch.tensor([[4, 5]])).sum())
        out.backward()
        assert ps.step == it
        ps.checkpoint()
        # Stamped at step 1 (the checkpoint after its update), erased at the first
        # checkpoint more than ttl steps later: step ttl + 2, never before.
        _, found = ps._ssd.stamps(np.array([once, 1, 4], np.uint64))
        assert list(found) == [it <= ttl + 1, True, True], f"iteration {it}"
    # A push outside a backward pass is a step, as before; step=False is part of the last.
    ones = np.ones((1, DIM), np.float32)
    ps.push(np.array([1], np.uint64), ones)
    ps.push(np.array([4], np.uint64), ones, step=False)
    assert ps.step == 11
    ps.close()


@pytest.mark.parametrize("ttl,cap", [(2, 0), (0, 3)])
def test_the_admission_default_row_outlives_the_bounds(tmp_path, ttl, cap):
    """Admission's default row (hps.ADMISSION_DEFAULT_KEY) is never trained, and
    the checkpoint holds it once a batch read it (docs/serving.md): a serving
    Lookup answers keys never admitted with it, and an export writes it. Not read
    for ttl_steps, or the oldest beyond max_rows, it was erased like a row (and
    exported as a tombstone). It is exempt: each checkpoint stamps it anew."""
    default = np.array([hps.ADMISSION_DEFAULT_KEY], np.uint64)
    ps = hps.ParameterServer(config(tmp_path / "ps", ttl_steps=ttl, max_rows=cap))
    ps.push(default, np.zeros((1, DIM), np.float32))  # read once, its gradient dropped
    row = ps.pull(default)
    ps.checkpoint()
    for step in range(2, 10):
        keys = np.array([step, 100 + step], np.uint64)
        ps.push(keys, np.ones((2, DIM), np.float32))
        ps.checkpoint()
        _, found = ps._ssd.stamps(default)
        assert found.all(), f"the default row erased at step {step}"
        if cap:
            assert len(ps._ssd) <= cap
    assert ps.stats()["counts"]["expired" if ttl else "capped"] > 0  # the bounds erased others
    ps.close()
    ps = hps.ParameterServer.open(tmp_path / "ps")
    np.testing.assert_array_equal(ps.pull(default), row)
    ps.close()
