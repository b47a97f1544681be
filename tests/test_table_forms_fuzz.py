"""Randomized checks of the paths that move a trained table between forms: a
reshard of a job of N ranks onto M (hps.reshard, and to one process), one cut
short by a failure, and the readers that serve the table (hps.Lookup, `hps
serve`'s HTTP lookups, a full `hps export`).

The jobs are built without mpiexec or training: each rank's directory is a
parameter server holding the keys its rank owns (hps.distributed.owner_ranks),
pushed to a few times (so rows carry optimizer state and different stamps),
checkpointed with a small dense state, and job.json names the checkpoint, as
hps train's ranks leave it. Tables are drawn by hypothesis: keys small, large,
around 2**63 and up to 2**64 - 2 (2**64 - 1 is reserved), 1-9 floats a row,
each optimizer, ranks with no rows. Derandomized (no example database), so a
run is repeatable."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import threading

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("torch", reason="a reshard writes each rank's dense state with torch.save")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hps  # noqa: E402
from hps import reshard  # noqa: E402
from hps.distributed.sparse import owner_ranks  # noqa: E402
from hps.jobdir import write_trainer_state  # noqa: E402
from table_helpers import budget_for, rows_of  # noqa: E402

SETTINGS = dict(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LAST_KEY = (1 << 64) - 2  # the largest key a table holds: 2**64 - 1 is hps.EMPTY_KEY
OPTIMIZERS = [hps.SGD(lr=0.5), hps.AdaGrad(lr=0.1), hps.RowWiseAdaGrad(lr=0.1), hps.Adam(lr=0.05)]
STEPS = 3

keys_st = st.one_of(st.integers(0, 300), st.integers(0, LAST_KEY), st.integers(LAST_KEY - 40, LAST_KEY),
                    st.integers((1 << 63) - 20, (1 << 63) + 20))


@st.composite
def tables(draw, most_world: int = 5):
    """(world, dim, optimizer, keys of the table, keys it has not, seed): the ranks in
    `empty` hold no row (their keys go to the keys the table has not)."""
    world = draw(st.integers(1, most_world))
    seed = draw(st.integers(0, 2 ** 16))
    # A few keys drawn one by one (hypothesis shrinks them), and up to 150 more from a
    # seed: small ones, any 64-bit ones, and the top 64 below the reserved key.
    rng = np.random.default_rng(seed + 1)
    bulk = draw(st.integers(0, 150))
    kinds = rng.integers(0, 3, bulk)
    keys = np.concatenate([np.array(draw(st.lists(keys_st, max_size=8)), np.uint64),
                           rng.integers(0, 1000, bulk, dtype=np.uint64)[kinds == 0],
                           rng.integers(0, LAST_KEY, bulk, dtype=np.uint64, endpoint=True)[kinds == 1],
                           (np.uint64(LAST_KEY) - rng.integers(0, 64, bulk, dtype=np.uint64))[kinds == 2]])
    keys = np.unique(keys)
    empty = draw(st.sets(st.integers(0, world - 1), max_size=world - 1 if world > 1 else 0))
    owners = owner_ranks(keys, world) if len(keys) else np.zeros(0, np.int64)
    absent = np.isin(owners, sorted(empty))
    return {"world": world, "dim": draw(st.integers(1, 9)), "optimizer": draw(st.sampled_from(OPTIMIZERS)),
            "keys": keys[~absent], "absent": keys[absent], "seed": seed}


def _save_dense(directory: str) -> None:
    import torch
    buf = io.BytesIO()
    torch.save({"mlp": {"w": torch.ones(2)}, "opt": {"state": {}}, "batches_done": STEPS,
                "examples_done": STEPS * 10}, buf)
    write_trainer_state(directory, buf.getvalue(), STEPS, STEPS * 10)


def make_job(root: str, table: dict, one_process: bool = False) -> dict:
    """Writes the table as a job of table["world"] ranks at root (one_process: one
    parameter server at root, world 1) and returns {key: embedding bytes} as its
    servers pulled them after the checkpoint."""
    rng = np.random.default_rng(table["seed"])
    world, dim = table["world"], table["dim"]
    keys = table["keys"]
    owners = owner_ranks(keys, world) if len(keys) else np.zeros(0, np.int64)
    want, numbers = {}, []
    for r in range(world):
        path = root if one_process else os.path.join(root, f"rank{r}")
        config = hps.ParameterServerConfig(dim=dim, path=path, optimizer=table["optimizer"], mem_budget="1MiB",
                                           write_buffer_rows=16, ssd=hps.SsdOptions(file_records=8))
        ps = hps.ParameterServer(config)
        mine = keys[owners == r]
        for step in range(STEPS):  # rows updated at different steps, some once, some every time
            part = mine if step == 0 else mine[rng.random(len(mine)) < 0.5]
            ps.push(part, rng.standard_normal((len(part), dim)).astype(np.float32))
            number = ps.checkpoint(_save_dense)  # (its rows stamped with this step)
        numbers.append(number)
        if len(mine):
            want.update(zip(mine.tolist(), (row.tobytes() for row in ps.pull(mine))))
        ps.close()
    if not one_process:
        assert len(set(numbers)) == 1
        with open(os.path.join(root, "job.json"), "w") as f:
            json.dump({"world": world, "step": STEPS, "checkpoint": numbers[0], "run": "fuzz-run"}, f)
    return want




def reshard_to(root: str, world: int) -> None:
    """The reshard's steps as hps train's ranks run them (_prepare_job), every new
    rank's in turn in this process, under rank 0's Hold."""
    with reshard.Hold(root) as hold:
        reshard.finish_removal(root)
        old = reshard.check_source(root, hold)
        reshard.take_new_ranks(root, world, hold)
        done = [reshard.write_rank(root, world, r, held=True) for r in range(world)]
        reshard.commit(root, world, old, done[0][1], hold)


def assert_at_owners(after: dict, before: dict, world: int) -> None:
    """after holds exactly before's rows (whole, with their stamps), each at its owner under world."""
    assert after.keys() == before.keys()
    if not after:
        return
    keys = np.array(sorted(after), np.uint64)
    for k, owner in zip(keys.tolist(), owner_ranks(keys, world).tolist()):
        assert after[k] == (owner, *before[k][1:]), k


def job_world(root: str) -> int:
    with open(os.path.join(root, "job.json")) as f:
        return json.load(f)["world"]


def rank_dirs(root: str) -> list:
    return sorted(n for n in os.listdir(root) if n.startswith("rank"))


@contextlib.contextmanager
def scratch():
    d = tempfile.mkdtemp(prefix="hps-forms-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- reshard

@settings(max_examples=40, **SETTINGS)
@given(table=tables(), new_world=st.integers(1, 5))
def test_reshard_n_to_m_and_back_keeps_every_row_at_its_owner(table, new_world):
    with scratch() as d:
        root = os.path.join(d, "job")
        want = make_job(root, table)
        before = rows_of(root)
        assert {k: row[:4 * table["dim"]] for k, (_, row, _) in before.items()} == want
        assert_at_owners(before, before, table["world"])
        reshard_to(root, new_world)
        assert_at_owners(rows_of(root), before, new_world)
        assert rank_dirs(root) == [f"rank{r}" for r in range(new_world)]
        assert job_world(root) == new_world
        reshard_to(root, table["world"])
        assert rows_of(root) == before
        assert rank_dirs(root) == [f"rank{r}" for r in range(table["world"])]


@settings(max_examples=30, **SETTINGS)
@given(table=tables(), one_process_source=st.booleans(), new_world=st.integers(1, 5))
def test_reshard_between_one_process_and_ranks_keeps_every_row(table, one_process_source, new_world):
    """A one-process server resumed on M ranks, and a job of N ranks resumed by one
    process (to_one_process); back again, the rows are the ones it started with."""
    with scratch() as d:
        root = os.path.join(d, "job")
        if one_process_source:
            table = {**table, "world": 1}
            table["keys"] = np.union1d(table["keys"], table["absent"])
        make_job(root, table, one_process=one_process_source)
        before = rows_of(root)
        if one_process_source:
            reshard_to(root, new_world)
            assert_at_owners(rows_of(root), before, new_world)
            reshard.to_one_process(root)
        else:
            reshard.to_one_process(root)
            assert not os.path.exists(os.path.join(root, "job.json")) and not rank_dirs(root)
            assert_at_owners(rows_of(root), before, 1)
            reshard_to(root, table["world"])
        after = rows_of(root)
        assert after == before if not one_process_source else \
            {k: v[1:] for k, v in after.items()} == {k: v[1:] for k, v in before.items()}


class Failure(Exception):
    pass


@settings(max_examples=40, **SETTINGS)
@given(table=tables(), new_world=st.integers(1, 5), written=st.integers(0, 5), after_switch=st.booleans(),
       then=st.integers(1, 5))
def test_a_reshard_cut_short_is_finished_by_the_next(table, new_world, written, after_switch, then):
    """A reshard to new_world that failed after `written` of its ranks wrote (the
    old job stays, whole), or right after its switch before the old ranks were
    removed (the new job is whole; the removal is left): the job reads as one of
    the two, and the next reshard (to `then` ranks) finishes with every row at
    its owner and no directory of the ranks it does not have."""
    written = min(written, new_world)
    with scratch() as d, pytest.MonkeyPatch.context() as mp:
        root = os.path.join(d, "job")
        make_job(root, table)
        before = rows_of(root)
        write_rank = reshard.write_rank
        calls = []

        def failing_write_rank(*args, **kw):
            if len(calls) == written and not after_switch:
                raise Failure("the rank died")
            calls.append(args)
            return write_rank(*args, **kw)

        mp.setattr(reshard, "write_rank", failing_write_rank)
        if after_switch:
            mp.setattr(reshard, "remove_old", lambda root, hold=None: None)
        if after_switch or written < new_world:
            with contextlib.suppress(Failure):
                reshard_to(root, new_world)
        else:
            reshard_to(root, new_world)
        mp.undo()
        world = new_world if after_switch or written == new_world else table["world"]
        assert job_world(root) == world
        assert_at_owners(rows_of(root), before, world)
        if world == table["world"]:  # (failed before its switch: no directory of a rank the job lacks)
            assert rank_dirs(root) == [f"rank{r}" for r in range(world)]
        reshard_to(root, then)
        assert_at_owners(rows_of(root), before, then)
        assert rank_dirs(root) == [f"rank{r}" for r in range(then)]


@pytest.mark.parametrize("old_world", [1, 2])
def test_a_failed_reshard_leaves_no_directory_of_a_rank_the_job_does_not_have(tmp_path, monkeypatch, old_world):
    """A reshard onto 4 ranks whose rank 3 failed after ranks 0-2 wrote their share:
    the job stays as it was (old_world ranks), and the new ranks' directories go as
    the reshard lets go of them. Before, a new rank that had written its
    checkpoint stayed (only one holding nothing but its lock file went): a
    directory of no rank of the job, holding a copy of its share of the table,
    that no later run removed (a resume on old_world ranks, or a reshard onto
    fewer than 4, never names it)."""
    root = str(tmp_path / "job")
    table = {"world": old_world, "dim": 2, "optimizer": hps.AdaGrad(), "keys": np.arange(1, 40, dtype=np.uint64),
             "absent": np.zeros(0, np.uint64), "seed": 0}
    make_job(root, table)
    before = rows_of(root)
    write_rank = reshard.write_rank

    def write_rank_3_fails(root, world, rank, **kw):
        if rank == 3:
            raise Failure("rank 3 died")
        return write_rank(root, world, rank, **kw)

    monkeypatch.setattr(reshard, "write_rank", write_rank_3_fails)
    with pytest.raises(Failure):
        reshard_to(root, 4)
    monkeypatch.undo()
    assert job_world(root) == old_world
    assert rank_dirs(root) == [f"rank{r}" for r in range(old_world)]
    assert rows_of(root) == before
    reshard_to(root, 3)  # (and the next reshard writes them anew)
    assert_at_owners(rows_of(root), before, 3)
    assert rank_dirs(root) == ["rank0", "rank1", "rank2"]


# ---------------------------------------------------------------- serving



def _queries(draw, table: dict) -> list:
    """Lookups: keys of the table (repeated), keys it has not, fresh large keys."""
    pool = np.concatenate([table["keys"], table["absent"],
                           np.array(draw(st.lists(keys_st, max_size=10)), np.uint64)])
    out = []
    for _ in range(draw(st.integers(1, 4))):
        picks = draw(st.lists(st.integers(0, max(len(pool) - 1, 0)), max_size=60)) if len(pool) else []
        out.append(pool[np.array(picks, np.int64)] if picks else np.zeros(0, np.uint64))
    return out


def _answer(want: dict, dim: int, keys: np.ndarray) -> tuple:
    rows = np.zeros((len(keys), dim), np.float32)
    found = np.zeros(len(keys), bool)
    for i, k in enumerate(keys.tolist()):
        if k in want:
            rows[i] = np.frombuffer(want[k], np.float32)
            found[i] = True
    return rows, found


@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), table=tables(), one_process=st.booleans(), cache_rows=st.sampled_from([2, 7, None]))
def test_lookup_and_serve_answer_the_trained_rows(data, table, one_process, cache_rows):
    """hps.Lookup (with a cache of a few rows, or a roomy one) and `hps serve`'s
    JSON and binary lookups answer each key's trained row, and for a key the
    table has not a zero row with found = False (docs/serving.md)."""
    import http.client
    from hps.serve import LookupServer
    if one_process:
        table = {**table, "world": 1}
    with scratch() as d:
        root = os.path.join(d, "job")
        want = make_job(root, table, one_process=one_process)
        dim = table["dim"]
        budget = "1GiB" if cache_rows is None else budget_for(root, cache_rows)
        queries = _queries(data.draw, table)
        with hps.Lookup(root, memory_budget=budget) as lk:
            for keys in queries:
                rows, found = lk.lookup(keys)
                want_rows, want_found = _answer(want, dim, keys)
                np.testing.assert_array_equal(found, want_found)
                np.testing.assert_array_equal(rows, want_rows)
            srv = LookupServer(lk, ("127.0.0.1", 0), max_concurrent=2)
            t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            t.start()
            try:
                host, port = srv.server_address[:2]
                for keys in queries:
                    want_rows, want_found = _answer(want, dim, keys)
                    for kind in ("application/json", "application/octet-stream"):
                        body = json.dumps({"keys": keys.tolist()}) if kind == "application/json" else \
                            keys.astype("<u8").tobytes()
                        conn = http.client.HTTPConnection(host, port, timeout=30)
                        try:
                            conn.request("POST", "/lookup", body=body, headers={"Content-Type": kind})
                            r = conn.getresponse()
                            answer = r.read()
                        finally:
                            conn.close()
                        assert r.status == 200, answer
                        if kind == "application/json":
                            doc = json.loads(answer)
                            got = np.array(doc["rows"], np.float32).reshape(len(keys), dim)
                            got_found = np.array(doc["found"], bool)
                            assert doc["nonfinite"] == []
                        else:
                            got = np.frombuffer(answer[:4 * dim * len(keys)], "<f4").reshape(len(keys), dim)
                            got_found = np.frombuffer(answer[4 * dim * len(keys):], np.uint8).astype(bool)
                            assert int(r.getheader("X-Hps-Dim")) == dim
                        np.testing.assert_array_equal(got_found, want_found)
                        np.testing.assert_array_equal(got, want_rows)
            finally:
                srv.shutdown()
                srv.server_close()


@settings(max_examples=40, **SETTINGS)
@given(table=tables(), one_process=st.booleans(), chunk_rows=st.integers(1, 40))
def test_a_full_export_holds_every_trained_row_at_its_owner(table, one_process, chunk_rows):
    """A full `hps export` (any chunk size) writes each trained key once, its
    embedding (and --with-state the optimizer state) exactly as the checkpoint
    holds it, under the rank that owns it, and no tombstone. --with-state of an
    SGD table, which keeps no state, is refused."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from hps.export import export
    if one_process:
        table = {**table, "world": 1}
        table["keys"] = np.union1d(table["keys"], table["absent"])
    with scratch() as d:
        root = os.path.join(d, "job")
        want = make_job(root, table, one_process=one_process)
        held = rows_of(root)
        dim = table["dim"]
        for n, with_state in enumerate((False, True)):
            to = os.path.join(d, f"e{n}")
            if with_state and table["optimizer"].kind == "sgd":
                with pytest.raises(ValueError, match="keeps no state"):
                    export(root, to, "fuzz", full=True, with_state=True, chunk_rows=chunk_rows)
                continue
            assert export(root, to, "fuzz", full=True, with_state=with_state, chunk_rows=chunk_rows)["full"]
            t = pq.read_table(to).to_pydict()
            assert len(t["key"]) == len(set(t["key"])) == len(want)
            assert not any(t["tombstone"])
            for i, k in enumerate(t["key"]):
                assert np.array(t["embedding"][i], np.float32).tobytes() == want[k], k
                rank, row, _ = held[k]
                assert t["rank"][i] == rank
                if with_state:
                    assert np.array(t["state"][i], np.float32).tobytes() == row[4 * dim:], k


def _apply_export(copy: dict, directory: str) -> None:
    """A consumer's copy {key: embedding bytes} updated by an export (docs/serving.md):
    a full export replaces it; a delta upserts its rows and drops its tombstones' keys."""
    import pyarrow.parquet as pq
    with open(os.path.join(directory, "_export.json")) as f:
        full = json.load(f)["full"]
    t = pq.read_table(directory).to_pydict()
    if full:
        copy.clear()
    for key, emb, tomb in zip(t["key"], t["embedding"], t["tombstone"]):
        if tomb:
            copy.pop(key, None)
        else:
            copy[key] = np.array(emb, np.float32).tobytes()


@settings(max_examples=20, **SETTINGS)
@given(table=tables(most_world=3), one_process=st.booleans(), rounds=st.integers(1, 4),
       max_rows=st.sampled_from([0, 0, 5, 20]), data=st.data())
def test_a_consumer_s_copy_follows_the_job_through_delta_exports(table, one_process, rounds, max_rows, data):
    """A consumer that exports after each checkpoint of a job trained on (rows
    updated, new keys added, and with [ps] max_rows the least recently updated
    erased: tombstones), applying each delta to its copy, holds exactly the
    checkpoint's embeddings after every round."""
    pytest.importorskip("pyarrow")
    from hps.export import export
    if one_process:
        table = {**table, "world": 1}
    world, dim = table["world"], table["dim"]
    rng = np.random.default_rng(table["seed"])
    with scratch() as d:
        root = os.path.join(d, "job")
        make_job(root, table, one_process=one_process)
        servers = [hps.ParameterServer.open(root if one_process else os.path.join(root, f"rank{r}"),
                                            max_rows=max_rows) for r in range(world)]
        copy: dict = {}
        try:
            for n in range(rounds + 1):
                if n:  # train on: some of the table's keys and keys it had not, then a checkpoint of the job
                    pool = np.concatenate([table["keys"], table["absent"],
                                           np.array(data.draw(st.lists(keys_st, max_size=10)), np.uint64)])
                    keys = np.unique(pool[rng.random(len(pool)) < 0.4])
                    owners = owner_ranks(keys, world) if len(keys) else np.zeros(0, np.int64)
                    numbers = []
                    for r, ps in enumerate(servers):
                        mine = keys[owners == r]
                        ps.push(mine, rng.standard_normal((len(mine), dim)).astype(np.float32))
                        numbers.append(ps.checkpoint(_save_dense, keep_previous=not one_process))
                    if not one_process:  # (the job's protocol: job.json names it once every rank has it)
                        with open(os.path.join(root, "job.json"), "w") as f:
                            json.dump({"world": world, "step": STEPS + n, "checkpoint": numbers[0],
                                       "run": "fuzz-run"}, f)
                        for ps in servers:
                            ps.prune_checkpoints()
                export(root, os.path.join(d, f"e{n}"), "fuzz")
                _apply_export(copy, os.path.join(d, f"e{n}"))
                assert copy == {k: row[:4 * dim] for k, (_, row, _) in rows_of(root).items()}, n
        finally:
            for ps in servers:
                ps.close()
