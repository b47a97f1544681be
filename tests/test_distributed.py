"""hps.distributed under mpiexec on localhost (2, 3 and 4 ranks), each scenario
checked against a single-process reference (tests/mpi_scenarios.py runs the ranks)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import hps

pytest.importorskip("mpi4py", reason="hps.distributed needs mpi4py (pip install '.[mpi]')")
import mpi_scenarios as sc  # noqa: E402 (tests/ is on pytest's sys.path; after the skip: it launches MPI jobs)
from mpi_scenarios import MPIEXEC, mpirun, scenario  # noqa: E402

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


# ---------------------------------------------------------------- jobs that share a launch

class Batches:
    """The jobs of this module that end normally and patch nothing (BATCHED, below),
    run in one launch a world size (mpi_scenarios.py batch), made when a test first
    asks for one: each rank then imports torch, hps and mpi4py once (about 2.8 s of
    CPU time, most of a small job's) rather than once a job. The first job of a
    launch runs in fresh processes, each other one after those before it, as in a
    process that runs jobs one after another (hps.distributed.Node.close). Where a
    launch failed, each job it did not finish runs alone, as every job did before;
    the job that failed there (a rank raised in it; else the last that every rank
    began and not every rank ended: one that hung past the launch's timeout, say)
    fails its test with the launch's output even if it passes alone."""

    def __init__(self, root, jobs):
        self.root = root
        self.jobs: dict = {}  # world -> [(scenario, *options)], in launch order
        for world, job in jobs:
            self.jobs.setdefault(world, []).append(tuple(map(str, job)))
        self.launches: dict = {}  # world -> (the launch's CompletedProcess, the job it failed in or None)

    def job(self, out, world: int, name: str, *args) -> None:
        """Scenario `name` with `args` on `world` ranks: its files at `out`, a copy of
        those its job wrote in the launch."""
        key = (name, *map(str, args))
        assert key in self.jobs.get(world, []), f"{world} ranks, {key}: not in BATCHED (or launch it with scenario)"
        where, jobs, i = self.root / f"world{world}", self.jobs[world], self.jobs[world].index(key)

        def marked(what: str, j: int) -> bool:
            return all((where / f"{what}{j}.rank{r}").exists() for r in range(world))
        if world not in self.launches:
            where.mkdir()
            (where / "jobs.json").write_text(json.dumps([[job[0], str(where / f"job{j}"), *job[1:]]
                                                         for j, job in enumerate(jobs)]))
            try:
                p = mpirun(world, sys.executable, sc.SCRIPT, "batch", where / "jobs.json", timeout=600, check=False)
            except subprocess.TimeoutExpired as e:  # (a job hung: the marks name it)
                def text(x) -> str:  # (TimeoutExpired's streams are bytes, text=True or not)
                    return x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                p = subprocess.CompletedProcess(e.cmd, -9, text(e.stdout),
                                                f"{text(e.stderr)}\n(killed after {e.timeout:g} s)")
            raised = [j for j in range(len(jobs)) if list((where / f"job{j}").glob("rank*.raised"))]
            cut = [j for j in range(len(jobs)) if marked("began", j) and not marked("done", j)]
            self.launches[world] = (p, (raised[:1] or cut[-1:] or [None])[0] if p.returncode else None)
        p, failed = self.launches[world]
        said = f"{'' if failed is None else f'job {failed} of '}mpiexec -n {world} {sc.SCRIPT} batch " \
               f"{where / 'jobs.json'} failed (exit {p.returncode})\nstdout:\n{p.stdout[-3000:]}\n" \
               f"stderr:\n{p.stderr[-5000:]}"
        assert p.returncode == 0 or failed is not None, said  # (failed before its first job, or after its last)
        if marked("done", i):
            shutil.copytree(where / f"job{i}", out, dirs_exist_ok=True)
            return
        scenario(world, name, out, *args)  # (its own error, if it fails alone too)
        assert i != failed, f"{' '.join(key)}: passed alone, but {said}"


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    return Batches(tmp_path_factory.mktemp("batched"), BATCHED)


# ---------------------------------------------------------------- sparse: remote pull and push

@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_remote_pull_push_equals_one_server(tmp_path, world, optimizer):
    rounds = 6
    scenario(world, "pullpush", tmp_path, "--rounds", rounds, "--optimizer", optimizer)
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    ref = hps.ParameterServer(sc.ps_config(str(tmp_path / "reference"), optimizer, budget="1MiB"))
    for rnd in range(rounds):
        inputs = [sc.pullpush_round(r, rnd, world) for r in range(world)]
        for r, (keys, _) in enumerate(inputs):
            np.testing.assert_allclose(got[r][f"pull{rnd}"], ref.pull(keys), rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {r}, round {rnd}")
        # Every rank's pairs of the round in one push: one step per key with the summed gradient.
        ref.push(np.concatenate([k for k, _ in inputs]), np.concatenate([g for _, g in inputs]))
    for r in range(world):
        keys, _ = sc.pullpush_round(r, rounds, world)
        np.testing.assert_allclose(got[r]["final"], ref.pull(keys), rtol=1e-5, atol=1e-6)
        assert got[r]["bytes"].min() > 0  # keys, rows and gradients all crossed to other ranks
    assert sum(int(g["ssd_hits"]) for g in got) > 0, "the ranks' budgets were meant to push rows through SSD-PS"
    ref.close()


def test_a_push_is_a_step_of_every_rank_s_server(tmp_path):
    """DistributedServer.push is one push of the job's pairs: every rank's server counts
    the step ([ps] ttl_steps counts them), also a rank that owns none of the keys. It
    pushed nothing to its server, whose step then fell behind, and whose rows a TTL
    erased that many steps late."""
    scenario(2, "pushstep", tmp_path, "--rounds", 3)
    steps = [json.loads((tmp_path / f"rank{r}.json").read_text())["step"] for r in range(2)]
    assert steps == [3, 3]


def test_a_push_that_would_wait_for_an_open_batch_is_refused_on_every_rank(tmp_path):
    """A rank's push steps its owned keys with its server's push, which waits for
    every batch of that server to be written back: a batch not yet applied (this
    thread applies it, after the push), or applied and not yet written back by
    this thread, never is. An hps.torch module with no batch attached, its
    backward inside a batch, hung every rank there, after the push's exchanges.
    Such a push is refused before the first, on every rank, whichever ranks see
    it: here the backward's on each, then a direct push with the batch applied
    and written back on every rank but the last (which raises its error, the
    others RankFailure naming it). Nothing is pushed; once the batch is finished
    the same push goes ahead."""
    world = 2
    p = scenario(world, "openbatchpush", tmp_path, "--timeout", 30, check=False, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    said = "RuntimeError: DistributedServer.push: each owner steps its keys with its server's push, which waits " \
           "for every batch of the server to be written back; a batch of this rank's is open ({}) and is finished " \
           "only after this push, on the thread that trains it: the push would wait for it forever. Nothing was " \
           "pushed, on any rank."
    for r in range(world):
        assert got[r]["backward in a batch"].startswith(said.format("made and not yet applied")), \
            (r, got[r]["backward in a batch"])
    last = got[-1]["push of an applied batch"]
    assert last.startswith(said.format("applied on this thread and not yet written back")), last
    for r in range(world - 1):
        assert got[r]["push of an applied batch"] == f"RankFailure: push keys: rank {world - 1} failed before the " \
                                                      f"exchange ({last}): every rank gives it up", r
    for r in range(world):
        assert all(got[r][k] for k in ("rows as before the backward", "backward after it", "rows as before the push",
                                       "push after it")), (r, got[r])


def test_a_rank_batch_takes_its_positions_from_the_prefetch_or_searches_for_them(tmp_path):
    """hps.torch looks up a worker's share of the examples (a view of the prefetched
    keys): its positions are the prefetch's, not searched again; a copy of the
    same keys is searched for, with the same rows and the same sums per key."""
    scenario(2, "distbatch", tmp_path)
    for r in range(2):
        got = np.load(tmp_path / f"rank{r}.npz")
        assert bool(got["view_is_prefetched"]), f"rank {r}: the share's positions were searched for"
        np.testing.assert_array_equal(got["pos_view"], got["pos_copy"])
        np.testing.assert_array_equal(got["rows_view"], got["rows_copy"])
        np.testing.assert_array_equal(got["sums_view"], got["sums_copy"])
        np.testing.assert_allclose(got["sums_view"], got["want_sums"], rtol=1e-6)
        assert "key 1000 is not in this batch's working set" in str(got["error"])


def test_keys_neither_uint64_nor_int64_are_refused_not_cast(tmp_path):
    """hps.ParameterServer refuses float and int32 keys; the DistributedServer cast
    them to uint64, so a float key 1.7 pulled and trained key 1's row. Every call
    refuses them now, on every rank, before any exchange: the job goes on."""
    scenario(2, "badkeys", tmp_path)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["errors"] == {
            "pull float64": "pull keys must be an array of uint64 or int64 keys, got float64",
            "pull int32": "pull keys must be an array of uint64 or int64 keys, got int32",
            "push float64": "push keys must be an array of uint64 or int64 keys, got float64",
            "prefetch float64": "prefetch keys must be an array of uint64 or int64 keys, got float64",
            "lookahead float64": "upcoming[0] must be an array of uint64 or int64 keys, got float64",
            "batch pull float64": "keys must be an array of uint64 or int64 keys, got float64"}, f"rank {r}"
        assert np.asarray(got["rows"]).shape == (2, sc.DIM)


# What the last rank raises in each call of onerankrefuses (its own error), and the
# exchange its peers name with it.
ONE_RANK_REFUSES = {
    "server codec": ("", "ValueError: unknown codec 'zstd'"),
    "pull float keys": ("pull keys", "TypeError: pull keys must be an array of uint64 or int64 keys, got float64"),
    "pull reserved key": ("pull keys", "ValueError: pull keys: key 0xffffffffffffffff is reserved (the empty-slot "
                                       "sentinel)"),
    "push grads of another shape": ("push keys", "ValueError: grads must have shape (40, 4), got (39, 4)"),
    "push nan": ("push keys", "DivergedError: push gradients: 1 non-finite value in the gradients of 1 key (key 4 "
                              "first: nan): training diverged"),
    "push reserved key": ("push keys", "ValueError: push keys: key 0xffffffffffffffff is reserved (the empty-slot "
                                       "sentinel)"),
    "prefetch float keys": ("prefetch keys", "TypeError: prefetch keys must be an array of uint64 or int64 keys, "
                                             "got float64"),
    "lookahead float keys": ("lookahead keys", "TypeError: upcoming[0] must be an array of uint64 or int64 keys, got "
                                               "float64"),
    "batch nan": ("push positions", "DivergedError: push gradients: 1 non-finite value in the gradients of 1 key "
                                    "(key 4 first: nan): training diverged")}


def test_a_call_the_last_rank_alone_refuses_is_refused_on_every_rank_naming_it(tmp_path):
    """A direct user's call that one rank refuses for its own input (its node's
    config, its server's codec, its keys, its gradients, its window, its data):
    that rank raised before the call's first exchange and went on, while the others
    waited in the exchange for it, until the watchdog's timeout ended the job (for
    a node's config, for ever: no watchdog runs yet), or until the rank's next call
    met them there, each taking the other's call for its own. A reserved key in a
    push reached its owner, which refused it after the exchange, alone, while the
    other owners stepped their keys. The refusal is told in the exchange now: every
    rank raises, the last rank its error, the others RankFailure naming it and the
    error; no row changes, and the job goes on."""
    world = 3
    p = scenario(world, "onerankrefuses", tmp_path, "--timeout", 30, check=False, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    last = got[-1]["errors"]
    for name, (what, said) in ONE_RANK_REFUSES.items():
        assert last[name].startswith(said), (name, last[name])
        for r in range(world - 1):
            named = (f"RankFailure: {what}: rank {world - 1} failed before the exchange ({last[name]}): every rank "
                     f"gives it up") if what else (f"RankFailure: DistributedServer: rank {world - 1} refused its "
                                                   f"arguments ({last[name]}): every rank's server is refused")
            assert got[r]["errors"][name] == named, (r, name)
    assert last["source raises"] == "ValueError: line 3 of this rank's data is malformed"
    for r in range(world - 1):
        assert got[r]["errors"]["source raises"] == (f"RankFailure: read: rank {world - 1}'s data failed (ValueError: "
                                                     f"line 3 of this rank's data is malformed): every rank stops"), r
    assert [g["rows_as_before"] for g in got] == [True] * world
    config = "ValueError: [distributed]: timeout must be > 0 seconds, got -1.0"
    assert last["node config"] == config
    for r in range(world - 1):
        assert got[r]["errors"]["node config"] == (f"RankFailure: hps.distributed.Node: rank {world - 1} refused its "
                                                   f"config ({config}): every rank's node is refused"), r


def test_a_herald_call_one_rank_refuses_is_refused_on_every_rank_naming_it(tmp_path):
    """As above with schedule = 'herald': rank 1's server of a cache of no rows
    (refused after the servers' first exchange, rank 0 gone on to its first
    call), its keys of one field, with a reserved key, or of other fields than
    rank 0's (which the leader alone saw: it raised in its prefetch, after the
    exchanges, and rank 1 waited in the step's first), its push of a NaN gradient,
    its step's NaN gradient (after which every rank's server stops alike: a pull
    is refused on every rank, with no exchange), and its step given one example
    less than it prefetched (refused after the step's plan reached it)."""
    p = scenario(2, "heraldonerankrefuses", tmp_path, "--timeout", 30, check=False, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    leader, last = (json.loads((tmp_path / f"rank{r}.json").read_text())["errors"] for r in range(2))

    def named(what: str, by: int, error: str) -> str:
        return f"RankFailure: {what}: rank {by} failed before the exchange ({error}): every rank gives it up"
    no_rows = "ValueError: worker_cache_rows must be >= 1 with schedule = 'herald', got 0"
    assert last["server of no cache rows"] == no_rows
    assert leader["server of no cache rows"] == (f"RankFailure: HeraldServer: rank 1 refused its arguments "
                                                 f"({no_rows}): every rank's server is refused")
    assert last["prefetch one key an example"] == ("ValueError: schedule = 'herald' takes (n_examples, fields) uint64 "
                                                   "keys, got uint64 (39,)")
    assert re.fullmatch(r"ValueError: keys\[\d+\] is 0xffffffffffffffff \(-1 as int64\), the reserved empty-slot "
                        r"key; .*", last["prefetch reserved key"]), last
    for name in ("prefetch one key an example", "prefetch reserved key"):
        assert leader[name] == named("herald example keys", 1, last[name]), name
    fields = "ValueError: herald example keys: the ranks' examples have other numbers of fields: rank 0's 3, rank 1's 2"
    assert leader["prefetch another number of fields"] == fields
    assert last["prefetch another number of fields"] == named("herald keys to their owners", 0, fields)
    assert last["push nan"].startswith("DivergedError: push gradients: 1 non-finite value"), last
    assert leader["push nan"] == named("push keys", 1, last["push nan"])
    assert leader["step"] == last["step"] == ""
    assert last["step nan"].startswith("DivergedError: herald shared gradients: 1 non-finite value"), last
    assert leader["step nan"] == named("herald shared gradients", 1, last["step nan"])
    short = "RuntimeError: the Herald plan places 13 examples of rank 1, which has 12 this step"
    assert last["step of one example less"] == short
    assert leader["step of one example less"] == named("herald examples (keys)", 1, short)
    for rank, errors in enumerate((leader, last)):
        assert errors["pull after the failed step"] == (f"RuntimeError: the rank's Herald cache stopped after a failed "
                                                        f"batch ({errors['step nan']}); rerun the job with --resume "
                                                        f"from its last checkpoint"), rank


def test_an_exchange_the_last_rank_alone_refuses_is_refused_on_every_rank(tmp_path):
    """Node.alltoallv's refusals after the counts crossed were each rank's own: rows
    of another size only by the two ranks of a pair they went between, MPI's 2 GiB
    limit only by the rank that sent or received that much. The others went on
    into the exchange and waited there until the watchdog's timeout (rank 0, which
    sends the odd rank nothing; every rank but the one past the limit). Every rank
    refuses them now: the header carries every rank's row size and largest block,
    and a rank past the limit tells the others. An exchange each rank's part of
    which fits goes on (under a limit of 1 KiB that the ranks' largest blocks
    together pass, each rank checks its own and they agree)."""
    world = 3
    p = scenario(world, "alltoallvrefuses", tmp_path, "--timeout", 30, check=False, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text())["errors"] for r in range(world)]
    sizes = ("RankFailure: push gradients: the ranks' rows differ in size (rank 0's 16 bytes, rank 1's 16 bytes, "
             "rank 2's 12 bytes): the ranks run other versions of hps or configs")
    for name in ("rows of another size to rank 1 alone", "rows of another size"):
        assert [g[name] for g in got] == [sizes] * world, name
    limit = {"sends past 2 GiB": "ValueError: push gradients: this rank sends 134217729 rows of 16 bytes, past MPI's "
                                 "2 GiB message limit; use smaller batches",
             "receives past 2 GiB": "ValueError: push gradients: this rank receives 134217728 rows of 16 bytes, past "
                                    "MPI's 2 GiB message limit; use smaller batches"}
    for name, said in limit.items():
        assert got[-1][name] == said, name
        for r in range(world - 1):
            assert got[r][name] == (f"RankFailure: push gradients: rank {world - 1} failed before the exchange "
                                    f"({said}): every rank gives it up"), (r, name)
    assert [g["fits under the limit"] for g in got] == [[0, 0, 0], [40, 0, 0], [0, 40, 0]]


# What the last rank raises in each call of ownerrefuses (its own error), and the
# exchange its peers name with it.
OWNER_REFUSES = {
    "prefetch past device_capacity": ("load rows", "ValueError: a batch of 14 distinct keys puts 14 on one device, "
                                                   "more than device_capacity = 4; raise device_capacity"),
    "push whose sum overflows": ("push sums", "DivergedError: push gradients: 4 values of the sums of 1 key (key 7 "
                                              "first: inf) at their owner, rank 2, overflow float32: training "
                                              "diverged (finite gradients whose sum overflowed); no rank's owner "
                                              "stepped a key"),
    "prefetch full and not tried again": ("load rows", "CacheFullError: MEM-PS is full (mpi_scenarios: "
                                                       "ownerrefuses)")}
OWNER_REFUSES["batch whose sum overflows"] = OWNER_REFUSES["push whose sum overflows"]


def test_a_call_the_last_rank_refuses_as_an_owner_is_refused_on_every_rank_naming_it(tmp_path):
    """A DistributedServer call the last rank refused as an owner, after the call's
    last exchange: its prefetch's working set past its device_capacity, or its
    MEM-PS full (CacheFullError) and the prefetch not tried again, raised there
    while the others' prefetches went on and their batches waited for its rows
    until the watchdog's timeout; a key it owns whose sum of every rank's finite
    gradients overflows (in a push, in a batch) was refused by it alone, and the
    other owners stepped their keys. Now the batch raises the failed pins on every
    rank (a prefetch not tried again is told by the rank's next one, which goes
    on), and where the ranks' gradients could overflow (each rank tells a bound
    in the step's first exchange) the owners check their sums and agree before any
    steps: every rank raises, the last rank its error, the others RankFailure
    naming it; no row changes, and the next step goes on.

    So does what the last rank refuses of what rank 0 sends it (another hps's
    layout): a lookahead window (refused between the prefetch's exchanges: the
    others waited in its next one until the watchdog's timeout) and a batch's rows
    (after the load's exchange: the others' batches waited in their apply until
    the watchdog's timeout), told where the others wait; a pull's rows, after which
    the others went on none the wiser, are told in the last rank's next exchange,
    which every rank gives up."""
    from hps.distributed import owner_ranks
    world = 3
    p = scenario(world, "ownerrefuses", tmp_path, "--timeout", 30, check=False, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    # (keys 1..40, untrained: rank 0 sends the last rank its window's keys that rank
    # owns, and the rows it asked rank 0 for as a bit each, and a word or byte more)
    owners = owner_ranks(np.arange(1, 41, dtype=np.uint64), world)
    malformed_rows = (f"RuntimeError: rank 0's rows: a block that marks 0 of {int((owners == 0).sum())} rows as sent "
                      f"holds 1 bytes of rows, not 0 (does that rank run another hps?)")
    refused = {**OWNER_REFUSES,
               "lookahead window sent malformed": (
                   "prefetch keys", f"RuntimeError: rank 0's lookahead window: {4 + int((owners == world - 1).sum())} "
                                    f"words do not match its header (does that rank run another hps?)"),
               "batch rows sent malformed": ("push positions", malformed_rows)}
    for name, (what, said) in refused.items():
        assert got[-1]["errors"][name] == said, name
        for r in range(world - 1):
            assert got[r]["errors"][name] == (f"RankFailure: {what}: rank {world - 1} failed before the exchange "
                                              f"({said}): every rank gives it up"), (r, name)
    assert got[-1]["errors"]["pull rows sent malformed"] == malformed_rows
    assert [g["errors"]["pull rows sent malformed"] for g in got[:-1]] == [""] * (world - 1)
    after = malformed_rows.replace("RuntimeError: ", "RuntimeError after pull rows: ", 1)
    told = f"RankFailure: pull keys: rank {world - 1} failed before the exchange ({after}): every rank gives it up"
    assert [g["errors"]["the pull after it"] for g in got] == [told] * world
    assert [g["errors"]["the next step"] for g in got] == [""] * world
    assert [g["rows_as_before"] for g in got] == [True] * world


def test_a_herald_step_one_rank_fails_after_its_prefetch_fails_on_every_rank_naming_it(tmp_path):
    """A Herald step that one rank failed after the prefetch's exchanges, each on a
    server of its own: the leader's schedule raised in its batch (other than its
    refusal of a step past device_capacity, which the plan carries), or rank 1's
    pins raised in its prefetch (a read, or MEM-PS full and not tried again), on
    that rank alone, and the other's step waited for the plan until the watchdog's
    timeout. The step raises it on every rank now, in its first exchange; the
    servers stop alike (a prefetch not tried again is told by the rank's next one,
    whose step every rank then refuses as the stopped server's).

    Then calls rank 1 failed after their last exchange: the rows rank 0 sent it in
    a step's partition (another hps's layout), where rank 0's step went on to its
    apply and waited in its first exchange until the watchdog's timeout; its keep
    of the rows sent to it as their owner (its SSD-PS's write), in a pull's flush,
    where rank 0 went on into the pull's exchange and waited there, and in a step's
    apply (the evicted rows), after which rank 1's server stopped alone and its
    next step was refused before its first exchange, rank 0's waiting for its plan
    until the watchdog's timeout. Now rank 1 tells rank 0 in the exchange rank 0
    waits in (the partition's failure by rank 1's next collective), or, its server
    stopped alone, in its next step's first exchange: rank 0 raises RankFailure
    naming rank 1's error, and both servers stop."""
    p = scenario(2, "heraldrefusesafter", tmp_path, "--timeout", 30, check=False, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    leader, last = (json.loads((tmp_path / f"rank{r}.json").read_text())["errors"] for r in range(2))

    def named(by: int, error: str, what: str = "herald plan parts") -> str:
        return f"RankFailure: {what}: rank {by} failed before the exchange ({error}): every rank gives it up"
    assert leader["leader's schedule raises"] == "RuntimeError: the schedule failed (mpi_scenarios)"
    assert last["leader's schedule raises"] == named(0, leader["leader's schedule raises"])
    assert last["pin raises"] == "OSError: [Errno 5] Input/output error (mpi_scenarios)"
    assert leader["pin raises"] == named(1, last["pin raises"])
    assert last["prefetch full and not tried again"] == "CacheFullError: MEM-PS is full (mpi_scenarios)"
    assert leader["prefetch full and not tried again"] == named(1, last["prefetch full and not tried again"])
    for rank, errors in enumerate((leader, last)):
        assert errors["the next step"].startswith("RuntimeError: the rank's Herald cache stopped after a failed "
                                                  "batch ("), rank
    malformed = last["fetched rows sent malformed"]
    assert re.fullmatch(r"RuntimeError: rank 0's rows: a block that marks 0 of \d+ rows as sent holds 1 bytes of "
                        r"rows, not 0 \(does that rank run another hps\?\)", malformed), malformed
    assert leader["fetched rows sent malformed"] == named(1, malformed, "herald shared gradients")
    kept = "OSError: [Errno 5] Input/output error (mpi_scenarios: keep)"
    assert last["flushed rows kept fail"] == last["evicted rows kept fail"] == kept
    assert leader["flushed rows kept fail"] == named(1, kept, "pull keys")
    assert leader["evicted rows kept fail"] == ""  # (its step applied; rank 1's stopped)
    stopped = "RuntimeError: the rank's Herald cache stopped after a failed batch ({}); rerun the job with --resume " \
              "from its last checkpoint"
    assert last["the step after fetched rows sent malformed"] == stopped.format(malformed)
    assert leader["the step after fetched rows sent malformed"] == stopped.format(
        leader["fetched rows sent malformed"])
    for name in ("evicted rows kept fail", "flushed rows kept fail"):
        said = stopped.format(f"OSError while the rows sent to their owner were kept: {kept[len('OSError: '):]}")
        assert last[f"the step after {name}"] == said, name
        assert leader[f"the step after {name}"] == named(1, said), name


def test_ranks_whose_servers_make_other_initial_rows_are_refused(tmp_path):
    """A rank makes the untrained rows it pulls (hps.distributed.FreshRows): a rank
    whose server has another seed would make other rows than their owner holds, so
    every rank refuses the job, naming the rank."""
    scenario(3, "otherseed", tmp_path)
    for r in range(3):
        assert "rank 1's parameter server makes other initial rows than rank 0's" in \
            (tmp_path / f"rank{r}.txt").read_text(), f"rank {r}"


@pytest.mark.parametrize("world,codec", [(2, "bf16"), (3, "int8")])
def test_remote_pull_push_through_a_codec_equals_one_server_of_rounded_traffic(tmp_path, world, codec):
    """[distributed] sparse_rows / sparse_grads: every row a rank pulls and every
    gradient it pushes crosses as the codec rounds it, no more and no less: the pulls
    are one server's rows rounded, the pushes one server's steps with rounded gradients."""
    from hps.hierarchical.codecs import make_codec
    c = make_codec(codec)

    def rounded(x):
        return c.decode(c.encode(np.ascontiguousarray(x, np.float32)))

    rounds = 4
    scenario(world, "pullpush", tmp_path, "--rounds", rounds, "--sparse-codec", codec)
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    ref = hps.ParameterServer(sc.ps_config(str(tmp_path / "reference"), "adagrad", budget="1MiB"))
    for rnd in range(rounds):
        inputs = [sc.pullpush_round(r, rnd, world) for r in range(world)]
        for r, (keys, _) in enumerate(inputs):
            np.testing.assert_allclose(got[r][f"pull{rnd}"], rounded(ref.pull(keys)), rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {r}, round {rnd}")
            assert not np.array_equal(got[r][f"pull{rnd}"], ref.pull(keys))  # the codec did round them
        ref.push(np.concatenate([k for k, _ in inputs]), rounded(np.concatenate([g for _, g in inputs])))
    ref.close()


# ---------------------------------------------------------------- training: k = 1 equals one process

def _single_process_reference(tmp_path, world: int, steps: int, per_rank: int, uneven: bool,
                              multi_hot: bool = False, admission: int = 0):
    from hps.train import train
    batches = sc.global_batches(steps, per_rank, world, multi_hot=multi_hot)
    if uneven:  # the last rank's data ended two steps early
        batches = batches[:-2] + [sc.rank_part(b, 0, per_rank * (world - 1)) for b in batches[-2:]]
    cfg = sc.train_config(str(tmp_path / "single"))
    if admission:
        cfg.admission = sc.admission_config(admission)
    train(cfg, progress=False, train_batches=batches, eval_batches=[])
    return batches


def _ps_rows(path: str, keys: np.ndarray) -> np.ndarray:
    ps = hps.ParameterServer.open(path)
    try:
        return ps.pull(keys)
    finally:
        ps.close()


def _assert_job_equals_single(tmp_path, world: int, steps: int, batches) -> dict:
    """Every rank's MLP and shard of the job under tmp_path/job equal the single
    process's under tmp_path/single (float tolerance); returns its trainer state."""
    import torch
    from hps.distributed import owner_ranks
    from hps.train import load_trainer_state
    single = load_trainer_state(str(tmp_path / "single"))
    for r in range(world):
        state = load_trainer_state(str(tmp_path / "job" / "job" / f"rank{r}"))
        assert state["batches_done"] == steps
        assert state["examples_done"] == sum(len(b) for b in batches)
        for name, value in single["mlp"].items():
            torch.testing.assert_close(state["mlp"][name], value, rtol=1e-4, atol=1e-6, msg=f"rank {r}: {name}")
    keys = np.unique(np.concatenate([b.all_keys().ravel() for b in batches]))
    expected = _ps_rows(str(tmp_path / "single"), keys)
    owners = owner_ranks(keys, world)
    for r in range(world):
        mine = owners == r
        assert mine.any()
        got = _ps_rows(str(tmp_path / "job" / "job" / f"rank{r}"), keys[mine])
        # atol 1e-5, 2e-4 of AdaGrad's lr: the job sums a key's gradients in another order, and
        # where they nearly cancel AdaGrad's g / sqrt(sum g^2) magnifies the rounding (2.2e-6
        # seen on one element of 8,232 with numpy 2.4). A lost or doubled example moves a row
        # by a sizeable part of lr (0.05), far above it.
        np.testing.assert_allclose(got, expected[mine], rtol=1e-4, atol=1e-5, err_msg=f"rank {r}'s shard")
    return single


ALLREDUCE_CASES = [
    (2, ()),
    (4, ("--sequential", "--uneven", "--hierarchical", "--ranks-per-node", "2")),
    # A budget for little more than one batch in flight: prefetches wait for write-backs
    # after their keys went to the owners (a retry must not exchange them again).
    (2, ("--mem-budget", "96KiB")),
    # Multi-hot fields: bags travel with each rank's examples, their keys to the owners.
    (3, ("--multi-hot",)),
    # Lookahead: the coming keys go to their owners, whose MEM-PS keeps them; no value changes.
    (2, ("--lookahead", "2", "--mem-budget", "96KiB")),
    # Codecs on the sparse traffic: rows and gradients between ranks as bf16, then int8.
    (2, ("--sparse-codec", "bf16")),
    (3, ("--sparse-codec", "int8")),
]


@pytest.mark.parametrize("world,extra", ALLREDUCE_CASES)
def test_allreduce_training_equals_one_process_over_global_batches(tmp_path, batched, world, extra):
    from hps.distributed import owner_ranks
    steps, per_rank = 6, 48
    batched.job(tmp_path / "job", world, "train", "--steps", steps, "--per-rank", per_rank, *extra)
    uneven, multi_hot = "--uneven" in extra, "--multi-hot" in extra
    batches = _single_process_reference(tmp_path, world, steps, per_rank, uneven, multi_hot)
    codec = extra[extra.index("--sparse-codec") + 1] if "--sparse-codec" in extra else "none"
    if codec == "none":
        single = _assert_job_equals_single(tmp_path, world, steps, batches)
    else:  # rounded traffic: the values are the codec test's (above); here, what it sends
        from hps.train import load_trainer_state
        single = load_trainer_state(str(tmp_path / "single"))

    reports = [json.loads((tmp_path / "job" / f"rank{r}.json").read_text()) for r in range(world)]
    if "--mem-budget" in extra:
        assert sum(r["prefetch_waits"] for r in reports) > 0
    sent = [r["bytes_sent"] for r in reports]
    n_params = sum(v.numel() for v in single["mlp"].values())
    dim = 8
    # Each step a rank sends each distinct key it does not own to its owner once (8 B),
    # and later that key's gradient and position; it sends rows for the keys the
    # others asked it for. Every key gets a gradient. A prefetch that waited for room
    # did not send its keys again.
    distinct = {}  # (step, rank) -> the rank's distinct keys
    for t, g in enumerate(sc.global_batches(steps, per_rank, world, multi_hot=multi_hot)):
        for q in range(world):
            mine = not (uneven and q == world - 1 and t >= steps - 2)
            distinct[t, q] = np.unique(sc.rank_part(g, q, per_rank).all_keys()) if mine else np.empty(0, np.uint64)
    seen = {t: np.unique(np.concatenate([distinct[u, q] for u in range(t) for q in range(world)] or
                                        [np.empty(0, np.uint64)])) for t in range(steps)}  # keys trained before step t
    for r, b in enumerate(sent):
        asks = sum(int((owner_ranks(u, world) != q).sum()) for (t, q), u in distinct.items() if q == r)
        asked = sum(int((owner_ranks(u, world) == r).sum()) for (t, q), u in distinct.items() if q != r)
        # Lookahead: each step a rank also sends every other rank the distinct keys it
        # owns of each batch the rank's window gained, 8 bytes each, after the message's
        # kind, its number of batches and each one's count of keys (8 bytes each:
        # pack_window): at the first step its next 2 batches (set), then, as the window
        # slides, the one that enters (none at the end of the data). The owners slid
        # their MEM-PS windows at every step after the first.
        window = 0
        for t in range(steps if "--lookahead" in extra else 0):
            gained = [u for u in ((t + 1, t + 2) if t == 0 else (t + 2,)) if (u, r) in distinct]
            for o in range(world):
                if o != r:
                    owned = sum(int((owner_ranks(distinct[u, r], world) == o).sum()) for u in gained)
                    window += (2 + len(gained) + owned) * 8
        if "--lookahead" in extra:
            assert reports[r]["mem"]["lookahead_slides"] == steps - 1, f"rank {r}"
        assert b["sparse_keys"] == asks * (8 + 4) + window, f"rank {r}"
        row_bytes = {"none": dim * 4, "bf16": dim * 2, "int8": dim + 4}[codec]  # int8: a float32 scale a row
        assert b["sparse_grads"] == asks * row_bytes, f"rank {r}"
        # Rows go back to the ranks that asked, a block a rank a step: a bit a row,
        # then the rows a step before it trained; a key no step before trained is
        # still its initial row, sent as its bit alone (hps.distributed.FreshRows).
        blocks = [(t, distinct[t, q][owner_ranks(distinct[t, q], world) == r]) for (t, q) in distinct if q != r]
        trained = [np.isin(k, seen[t]) for t, k in blocks]
        rows_sent = sum(int(x.sum()) for x in trained)
        fresh = asked - rows_sent
        assert 0 < fresh < asked and reports[r]["fresh_rows"] == fresh, f"rank {r}"
        assert b["sparse_rows"] == sum((len(k) + 7) // 8 for _, k in blocks) + rows_sent * row_bytes, f"rank {r}"
        c = reports[r]["codecs"]
        assert c["sparse_rows"]["before"] == rows_sent * dim * 4 and c["sparse_rows"]["after"] == rows_sent * row_bytes
        assert c["sparse_grads"]["before"] == asks * dim * 4 and c["sparse_grads"]["after"] == b["sparse_grads"]
        if "--hierarchical" not in extra:
            # One gradient all-reduce of every dense parameter a step (payload counted).
            assert b["dense"] == steps * n_params * 4


def test_a_rank_whose_multi_hot_bags_are_all_empty_trains_as_one_process(tmp_path, batched):
    """At step 2 rank 1's examples have no multi-hot key (a file's short last batch of
    rows without tags, say): its lookups gather no row and send back no gradient. The
    distributed batch's accumulate reshaped the empty gradients to (0, -1), which numpy
    refuses, and the job aborted; one process's native batch took them."""
    from hps.train import train
    world, steps, per_rank = 2, 4, 16
    batched.job(tmp_path / "job", world, "train", "--steps", steps, "--per-rank", per_rank, "--multi-hot",
                "--empty-bags-at", 2)
    batches = sc.global_batches(steps, per_rank, world, multi_hot=True, empty_bags_at=2)
    assert len(sc.rank_part(batches[2], 1, per_rank).all_keys()) == per_rank * 26  # its single-hot keys alone
    train(sc.train_config(str(tmp_path / "single")), progress=False, train_batches=batches, eval_batches=[])
    _assert_job_equals_single(tmp_path, world, steps, batches)


@pytest.mark.parametrize("schedule", [[], ["--herald", 256]], ids=["sequential", "herald"])
def test_a_resumed_rank_picks_up_after_its_own_examples_not_the_jobs_steps(tmp_path, batched, schedule):
    """Rank 1's data ends two steps before rank 0's (it takes part in them empty);
    resumed with more data on each rank (a directory that grew, a larger --examples),
    rank 1 goes on from its third batch. It skipped as many of its batches as the job
    had taken steps, and lost the two it never trained (under Herald, whose steps
    train examples the other ranks read, the job trained 384 of its 480 examples):
    now it counts the examples of its own data it read into the job's steps,
    wherever they were trained."""
    from hps.train import load_trainer_state
    per_rank = 48
    batched.job(tmp_path / "job", 2, "train", "--steps", 4, "--per-rank", per_rank, "--uneven", *schedule)
    scenario(2, "train", tmp_path / "job", "--steps", 6, "--per-rank", per_rank, "--uneven", *schedule, "--resume")
    reports = [json.loads((tmp_path / "job" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["examples"] for r in reports] == [(6 + 4) * per_rank] * 2  # rank 0's 6 batches, rank 1's 4
    assert reports[0]["batches"] == 6
    for r in range(2):
        state = load_trainer_state(str(tmp_path / "job" / "job" / f"rank{r}"))
        assert state["rank_examples"] == {"rank": r, "world": 2, "examples": (6 if r == 0 else 4) * per_rank}


# ---------------------------------------------------------------- admission: the job's counts

@pytest.mark.parametrize("world,extra,resume", [(2, (), True), (3, ("--multi-hot", "--uneven"), False)])
def test_admission_counts_the_jobs_keys_as_one_process_over_global_batches(tmp_path, batched, world, extra, resume):
    """[admission] threshold = 3 under mpiexec counts the job's keys (every rank's
    sketch counts each global step's keys of every rank): the job admits, reads the
    default row and drops gradients exactly where one process trained on the global
    batches does, so its parameters are that process's; resumed from a checkpoint
    halfway (the sketch is in it) too. Per-rank counting would differ."""
    from hps.admission import Admission
    steps, per_rank, f = 6, 48, 3
    uneven, multi_hot = "--uneven" in extra, "--multi-hot" in extra
    args = ("--per-rank", per_rank, "--admission", f, *extra)
    if resume:
        batched.job(tmp_path / "job", world, "train", "--steps", steps - 2, "--checkpoint-every", 2, *args)
        scenario(world, "train", tmp_path / "job", "--steps", steps, "--checkpoint-every", 2, "--resume", *args)
    else:
        batched.job(tmp_path / "job", world, "train", "--steps", steps, *args)
    batches = _single_process_reference(tmp_path, world, steps, per_rank, uneven, multi_hot, admission=f)
    _assert_job_equals_single(tmp_path, world, steps, batches)

    single = json.loads((tmp_path / "single" / "train-summary.json").read_text())["admission"]
    reports = [json.loads((tmp_path / "job" / f"rank{r}.json").read_text())["admission"] for r in range(world)]
    job_fields = ("occurrences_counted", "keys_admitted", "default_reads", "dropped_gradients", "sketch_bytes")
    for rep in reports:  # the job's counts, on every rank, are one process's
        assert {k: rep[k] for k in job_fields} == {k: single[k] for k in job_fields}
        assert rep["ranks"] == reports[0]["ranks"]
    ranks = reports[0]["ranks"]
    assert sum(r["occurrences"] for r in ranks) == single["occurrences_counted"] == \
        sum(int(b.all_keys().size) for b in batches)
    assert sum(r["default_reads"] for r in ranks) == single["default_reads"] > 0
    assert single["keys_admitted"] > 0
    # Each rank counting only its own batches would admit later: more default reads.
    per_rank_defaults = 0
    for q in range(world):
        own = Admission(f, sc.admission_config(f).sketch_bytes)
        for t, g in enumerate(sc.global_batches(steps, per_rank, world, multi_hot=multi_hot)):
            if not (uneven and q == world - 1 and t >= steps - 2):
                own.train_batch(sc.rank_part(g, q, per_rank))
        per_rank_defaults += own.default_reads
    assert per_rank_defaults > single["default_reads"]


# ---------------------------------------------------------------- Herald: examples to the rows

HERALD_CASES = [(2, ()), (4, ("--sequential", "--uneven")), (2, ("--lookahead", "3")), (2, ("--mem-budget", "84KiB"))]


@pytest.mark.parametrize("world,extra", HERALD_CASES)
def test_herald_job_equals_one_process_over_global_batches(tmp_path, batched, world, extra):
    """BSP with Herald's schedule (ranks with caches of 150 rows, smaller than a step's
    keys: evictions every step) ends with the parameters of one process trained on the
    global batches, as the sequential job does. Also where MEM-PS holds little more
    than a step's keys (84 KiB: 488 rows a rank, a step pins up to 469): the rows the
    caches drop reach their owners without a pin, which found no room beside the next
    step's prefetch (CacheFullError)."""
    steps, per_rank = 6, 48
    batched.job(tmp_path / "job", world, "train", "--steps", steps, "--per-rank", per_rank, "--herald", 150, *extra)
    batches = _single_process_reference(tmp_path, world, steps, per_rank, "--uneven" in extra)
    _assert_job_equals_single(tmp_path, world, steps, batches)  # the final checkpoint flushed the caches
    reports = [json.loads((tmp_path / "job" / f"rank{r}.json").read_text()) for r in range(world)]
    if "--lookahead" in extra:  # each owner's MEM-PS window slid at every step after the first
        assert [rep["mem"]["lookahead_slides"] for rep in reports] == [steps - 1] * world
    h = [rep["herald"] for rep in reports]
    # Every rank planned the same steps; what moved is what the plan said.
    assert len({(x["plan_pulls"], x["plan_shared"], x["distinct"]) for x in h}) == 1
    assert sum(x["ps_loads"] + x["peer_fetches"] for x in h) == h[0]["plan_pulls"]
    assert sum(x["rows_served"] for x in h) == h[0]["plan_pulls"]
    assert sum(x["peer_fetches"] for x in h) == h[0]["plan_peer_pulls"] > 0
    assert sum(x["replica_copies"] for x in h) == h[0]["plan_shared"] > 0
    assert sum(x["examples_sent"] + x["examples_kept"] for x in h) == sum(len(b) for b in batches)
    assert all(x["evict_pushes"] > 0 and x["cached"] <= 150 for x in h)
    assert sum(rep["bytes_sent"]["examples"] for rep in reports) > 0
    # One rank plans: only the leader holds a snapshot and sends plan parts.
    assert h[0]["scheduler_bytes"] > 0 and reports[0]["bytes_sent"]["plan"] > 0
    assert all(x["scheduler_bytes"] == 0 for x in h[1:]) and all(rep["bytes_sent"]["plan"] == 0 for rep in reports[1:])


def test_herald_evaluations_inside_a_step_see_what_the_sequential_job_sees(tmp_path, batched):
    """An evaluation in a step's hook pulls while the leader has scheduled the next
    step (the pipeline's load stage makes it): the caches flush the rows as the last
    applied step left them, evicted ones included, so every evaluation of the job
    equals the sequential job's (up to the order floats are summed in)."""
    steps, per_rank = 8, 48
    for schedule, extra in (("seq", ()), ("her", ("--herald", 150))):
        batched.job(tmp_path / schedule, 2, "train", "--steps", steps, "--per-rank", per_rank, "--eval-every", 2,
                    *extra)
    seq, her = (json.loads((tmp_path / s / "rank0.json").read_text()) for s in ("seq", "her"))
    assert [e["batches"] for e in her["evals"]] == [e["batches"] for e in seq["evals"]] == [2, 4, 6, 8, 8]
    for a, b in zip(seq["evals"], her["evals"]):
        assert b["logloss"] == pytest.approx(a["logloss"], rel=1e-6, abs=1e-7), a["batches"]
        assert b["auc"] == pytest.approx(a["auc"], abs=1e-6), a["batches"]
    # One flush an evaluation (five); the final checkpoint, with no step applied
    # since the last evaluation, flushes nothing.
    assert her["herald"]["evict_pushes"] > 0 and her["herald"]["flushes"] == 5


def test_a_herald_rank_given_no_examples_still_takes_part(tmp_path, batched):
    """Steps of fewer examples than ranks (1 a rank, and the last rank's data ended two
    steps early: 3 examples for 4 ranks) leave a rank with no examples and no keys to
    train; the job still ends with one process's parameters."""
    world, steps, per_rank = 4, 4, 1
    batched.job(tmp_path / "job", world, "train", "--steps", steps, "--per-rank", per_rank, "--herald", 150,
                "--uneven")
    batches = _single_process_reference(tmp_path, world, steps, per_rank, True)
    assert min(len(b) for b in batches) < world
    _assert_job_equals_single(tmp_path, world, steps, batches)
    h = [json.loads((tmp_path / "job" / f"rank{r}.json").read_text())["herald"] for r in range(world)]
    assert sum(x["examples_sent"] + x["examples_kept"] for x in h) == sum(len(b) for b in batches)
    assert [x["batches"] for x in h] == [steps] * world  # a step a rank trains nothing in counts too


def test_the_herald_leader_gets_every_ranks_example_keys_however_many_distinct_keys_a_rank_has(tmp_path):
    """A rank sends the leader its distinct keys and each example key's place among
    them, in 2 bytes while it has at most 65,536 distinct keys, else 4: the leader's
    global batch is every rank's examples, in rank order, either way (rank 1 has
    about 72,000 distinct keys, ranks 0 and 2 a few hundred)."""
    world = 3
    scenario(world, "heraldkeys", tmp_path)
    got = np.load(tmp_path / "rank0.npz")
    keys = [sc.herald_example_keys(r) for r in range(world)]
    assert len(np.unique(keys[1])) > 1 << 16 > len(np.unique(keys[2]))
    np.testing.assert_array_equal(got["starts"], np.cumsum([0] + [len(k) for k in keys]))
    np.testing.assert_array_equal(got["examples"], np.concatenate(keys))


def test_a_direct_push_between_herald_steps_empties_the_caches_and_the_steps_after_it_load_from_the_owners(tmp_path):
    """HeraldServer.push writes the caches to their owners, empties them, and
    steps the owners' rows; the leader forgets what the caches held, so the steps
    after it load every row from MEM-PS: the rows at the end are one server's that
    took the same steps and the push (each key's summed gradient, one step each)."""
    world = 2
    scenario(world, "heraldpush", tmp_path)
    got = np.load(tmp_path / "rank0.npz")
    ref = hps.ParameterServer(sc.ps_config(str(tmp_path / "reference"), "adagrad", budget="1MiB"))
    for step in range(4):
        if step == 2:
            keys = np.concatenate([sc.pullpush_round(r, 0, world)[0] for r in range(world)])
            ref.push(keys, sc.key_gradient(keys))
        keys = np.concatenate([sc.herald_step_keys(r, step).reshape(-1) for r in range(world)])
        ref.push(keys, sc.key_gradient(keys))
    np.testing.assert_allclose(got["final"], ref.pull(np.arange(150, dtype=np.uint64)), rtol=1e-5, atol=1e-6)
    ref.close()
    herald = json.loads(str(got["herald"]))
    assert herald["batches"] == 4 and herald["evict_pushes"] > 0 and herald["peer_fetches"] > 0


@pytest.mark.parametrize("rows", [1000, 20])  # no evictions; evictions and peer fetches
def test_a_herald_flush_and_eviction_write_only_the_rows_trained_since_the_last_write(tmp_path, rows):
    """A flush (a pull, a checkpoint) wrote every cached row to its owner, changed
    or not: every checkpoint wrote the whole caches, and an export's delta listed
    rows that had not changed. The ranks' tables keep a trained bit a row now: after
    a step of keys 1..world, 2 and 3, those alone are written, once each. An
    eviction push wrote every row whose last copy a cache dropped, clean or not:
    with caches of 20 rows, a last step of 20 new keys a rank drops the rows the
    pull before it flushed, without a write (the steps before it pushed dirty
    ones). The rows end as one process's."""
    world = 2
    scenario(world, "heraldflush", tmp_path, "--herald", rows)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    flushed = np.array([g["flushed_rows"] for g in got])
    evicted = np.array([g["evicted"] for g in got])  # (rank, step, [pushes, clean dropped])
    first = np.unique(np.concatenate([sc.herald_step_keys(r, s).reshape(-1) for r in range(world) for s in range(2)]))
    again = len({2, 3} | set(range(1, world + 1)))
    if rows == 1000:
        assert flushed[:, 0].sum() == len(first)  # every key trained, all cached
        assert evicted.sum() == 0
    else:
        assert evicted[:, 0, 0].sum() > 0 and sum(g["peer_fetches"] for g in got) > 0
        # The last step: the new keys fit; the caches drop every other row, flushed by the pull before it.
        pushes, dropped = (evicted[:, 1] - evicted[:, 0]).sum(axis=0)
        assert pushes == 0 and dropped > 0
    assert (flushed[:, 1] - flushed[:, 0]).sum() == again
    assert (flushed[:, 2] - flushed[:, 1]).sum() == 20 * world  # the last step's keys, all trained
    ref = hps.ParameterServer(sc.ps_config(str(tmp_path / "reference"), "adagrad", budget="1MiB"))
    for step in range(4):
        keys = np.concatenate([(sc.herald_step_keys(r, step) if step < 2 else np.array([[1 + r, 2, 3]], np.uint64)
                                if step == 2 else sc.heraldflush_last_keys(r)).reshape(-1) for r in range(world)])
        ref.push(keys, sc.key_gradient(keys))
    np.testing.assert_allclose(np.load(tmp_path / "final.npy"), ref.pull(np.arange(300, dtype=np.uint64)),
                               rtol=1e-5, atol=1e-6)
    ref.close()


def _pulls_equal_one_servers(tmp_path, events: list):
    """Checks that each pull the heraldrandom scenario's rank 0 saved equals one
    server's given the same steps and pushes (every rank's keys, in rank order);
    returns what rank 0 saved."""
    got = np.load(tmp_path / "rank0.npz")
    ref = hps.ParameterServer(sc.ps_config(str(tmp_path / "reference"), "adagrad", budget="1MiB"))
    pulls = 0
    for kind, keys, *_ in events:
        if kind == "pull":
            np.testing.assert_allclose(got[f"arr_{pulls}"], ref.pull(keys), rtol=1e-5, atol=1e-6,
                                       err_msg=f"pull {pulls}")
            pulls += 1
        else:
            flat = np.concatenate([k.reshape(-1) for k in keys])
            ref.push(flat, sc.key_gradient(flat))
    ref.close()
    return got


@pytest.mark.parametrize("world,seed,rows", [(2, 1, 6), (3, 2, 10), (2, 4, 12), (3, 5, 8)])
def test_random_herald_steps_pulls_and_pushes_read_what_one_server_holds(tmp_path, world, seed, rows):
    """Steps of random skewed keys on caches of a few rows (evictions, peer fetches,
    keys several ranks train, ranks given no examples, lookahead windows), with flushes (pulls) and
    direct pushes at random points: every pull reads the rows one server holds
    that took the same steps and pushes, so no trained row was dropped, left
    unwritten by a flush or an eviction, or written stale over a newer one."""
    events = sc.heraldrandom_events(seed, 14, world)
    scenario(world, "heraldrandom", tmp_path, "--herald", rows, "--seed", seed, "--steps", 14)
    got = _pulls_equal_one_servers(tmp_path, events)
    herald = json.loads(str(got["stats"]))
    # the draws reach what they are for: evictions, peer fetches and flushes
    assert herald["evict_pushes"] > 0 and herald["peer_fetches"] > 0 and herald["flushed_rows"] > 0, herald


@pytest.mark.parametrize("world,seed", [(2, 6), (3, 7)])
def test_random_steps_pulls_and_pushes_of_the_sequential_job_read_what_one_server_holds(tmp_path, world, seed):
    """The same random steps, pulls and pushes on the sequential job's servers, each
    rank's MEM-PS of 2 KiB (7 rows: evictions every step): every pull reads the rows
    of one server that took the same steps."""
    events = sc.heraldrandom_events(seed, 14, world)
    scenario(world, "heraldrandom", tmp_path, "--sequential", "--mem-budget", "2KiB", "--seed", seed, "--steps", 14)
    got = _pulls_equal_one_servers(tmp_path, events)
    counts = json.loads(str(got["stats"]))["counts"]
    assert counts["pending_hits"] + counts["ssd_hits"] > 0, counts  # evicted rows read back


def test_a_compacted_herald_table_holds_only_the_keys_its_cache_holds(tmp_path):
    """A compaction rebuilds a rank's table (the tier that holds its cache's rows)
    with the keys the cache holds and nothing else: the rows of keys it evicted
    go, also where the table keeps its size. So after each step a table holds
    the keys its cache held at its last compaction and every row fetched since,
    as one Herald scheduled here on the same steps gives them. With caches of 20
    rows (herald_step_keys: about 100 keys) the tables grow from 64 rows to 128
    at step 1, then are compacted at 128 at steps 3 and 5."""
    from hps.herald import Herald
    from hps.worker_caches import first_table_rows
    world, steps, capacity = 2, 6, 20
    scenario(world, "heraldtable", tmp_path, "--steps", steps)
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    her = Herald(world, capacity)
    contents = [np.empty(0, np.uint64)] * world  # the keys each table should hold
    tables = [[0, first_table_rows(capacity)] for _ in range(world)]
    compactions, kinds = [0] * world, [set() for _ in range(world)]
    for t in range(steps):
        keys = np.concatenate([sc.herald_step_keys(r, t) for r in range(world)])
        for r, held, size in _compactions(her, keys, tables):
            kinds[r].add("same size" if tables[r][1] == size else "grown")
            contents[r] = held
            compactions[r] += 1
        plan = her.schedule(keys)
        for r, fetched in enumerate(np.split(plan.fetch_keys, plan.fetch_offsets[1:-1].astype(np.int64))):
            contents[r] = np.union1d(contents[r], fetched)
            tables[r][0] += len(fetched)
            np.testing.assert_array_equal(got[r][f"table{t}"], contents[r],
                                          err_msg=f"rank {r}'s table after step {t} ({compactions[r]} compactions)")
            assert (got[r]["compactions"][t], got[r]["table_rows"][t]) == (compactions[r], tables[r][1]), (r, t)
    # Both kinds of compaction happened on every rank: to a larger table, and at the same size.
    assert kinds == [{"grown", "same size"}] * world


HERALDRETRY_STEPS = 3


@pytest.fixture(scope="module")
def heraldretry_plain(tmp_path_factory):
    """The heraldretry job whose MEM-PS is never full, made once for the module: each
    case compares its retried job with it (and only reads it)."""
    out = tmp_path_factory.mktemp("heraldretry_plain")
    scenario(2, "heraldretry", out, "--steps", HERALDRETRY_STEPS)
    return out


@pytest.mark.parametrize("failing", ["0,1", "1"])
def test_a_herald_prefetch_retried_after_mem_ps_was_full_only_pins_again(tmp_path, heraldretry_plain, failing):
    """A prefetch whose pin finds MEM-PS full keeps its exchange (the example keys
    sent to the leader, the distinct keys to their owners); the retry with the
    same keys object only pins again. So every rank sends the bytes of a job whose
    MEM-PS was never full, by kind, and the steps end with the same rows. Where
    every rank retries, an exchange repeated would send each rank's keys twice;
    where rank 1 alone does, it would wait in a collective the others never enter,
    and the watchdog ends the job after --timeout seconds."""
    from hps.distributed import COMM_KINDS
    world, steps = 2, HERALDRETRY_STEPS
    scenario(world, "heraldretry", tmp_path / "retried", "--steps", steps, "--fail-ranks", failing, "--timeout", 10)
    full = {int(r) for r in failing.split(",")}
    for r in range(world):
        plain, retried = (np.load(d / f"rank{r}.npz") for d in (heraldretry_plain, tmp_path / "retried"))
        # MEM-PS was full once where the test made it so (else the retry went untested).
        assert int(retried["full"]) == (r in full) and int(plain["full"]) == 0, f"rank {r}"
        sent = dict(zip(COMM_KINDS, retried["bytes"].tolist()))
        assert sent == dict(zip(COMM_KINDS, plain["bytes"].tolist())), f"rank {r}: bytes sent with a retry"
        assert sent["sparse_keys"] > 0  # each rank's exchange sends keys: an exchange repeated would show
        np.testing.assert_array_equal(retried["final"], plain["final"], err_msg=f"rank {r}")


def _compactions(her, keys: np.ndarray, tables: list) -> list:
    """The table compactions the leader orders before a step of example `keys`
    (hps.worker_caches' rules), on `her`, the Herald scheduled so far: each rank's
    table, [rows present (live or stale; a key fetched again counts twice), size],
    updated in place. Returns (rank, the keys its cache holds, the size before) for
    each rank whose table is compacted to those keys."""
    from hps.worker_caches import most_fetched, needs_rebuild, rebuilt_table_rows
    incoming = most_fetched(len(keys), keys.shape[1], len(tables), len(np.unique(keys)))
    done = []
    for r, (held, table) in enumerate(zip(her.cached_by_worker(), tables)):
        if needs_rebuild(table[0], incoming, table[1]):
            done.append((r, held, table[1]))
            table[:] = [len(held), rebuilt_table_rows(table[1], len(held), incoming)]
    return done


def _herald_replay(world: int, steps: int, per_rank: int, capacity: int, lookahead: int) -> dict:
    """What each rank of a Herald job should count, from one Herald scheduled here
    on the job's global batches (the ranks' examples in rank order, the next
    `lookahead` global batches as its window): per rank, the examples it kept and
    sent, the rows it loaded from MEM-PS, fetched from a peer and served (from its
    cache, or as owner from its MEM-PS), the keys it summed as primary and the sums
    it got back as a replica, the rows its evictions pushed, the keys its cache holds
    at the end, and the rows the final flush has it write (each cached key once, by
    the lowest rank that holds it); and its table's compactions and final size (a
    table is compacted to the keys its cache holds, before a step whose most
    fetched rows would fill it past hps.worker_caches.needs_rebuild's load)."""
    from hps.distributed import owner_ranks
    from hps.herald import Herald
    from hps.worker_caches import first_table_rows, primaries
    batches = sc.global_batches(steps, per_rank, world)
    # An example's bytes (8 a key, 4 a dense value and the label) over a fetched row's
    # (the job's dim 8 and AdaGrad's 8 accumulators, 4 bytes a float): the leader's cost.
    cost = (8 * batches[0].keys.shape[1] + 4 * (batches[0].dense.shape[1] + 1)) / (4 * 2 * 8)
    her = Herald(world, capacity, example_cost=cost)
    names = ("examples_kept", "examples_sent", "ps_loads", "peer_fetches", "rows_served", "primary_steps",
             "replica_copies", "evict_pushes", "compactions")
    want = {name: np.zeros(world, np.int64) for name in names}
    tables = [[0, first_table_rows(capacity)] for _ in range(world)]  # rows present (live or stale), size
    totals = dict.fromkeys(("plan_pulls", "plan_peer_pulls", "plan_shared", "distinct"), 0)
    for t, b in enumerate(batches):
        keys = np.ascontiguousarray(b.keys).view(np.uint64)
        ahead = [np.ascontiguousarray(x.keys).view(np.uint64).reshape(-1) for x in batches[t + 1:t + 1 + lookahead]]
        for r, _, _ in _compactions(her, keys, tables):
            want["compactions"][r] += 1
        ranks = np.repeat(np.arange(world), per_rank)
        plan = her.schedule(keys, upcoming=np.unique(np.concatenate(ahead)) if ahead else None, origin=ranks)
        want["examples_kept"] += np.bincount(ranks[plan.assignment == ranks], minlength=world)
        want["examples_sent"] += np.bincount(ranks[plan.assignment != ranks], minlength=world)
        fdest = np.repeat(np.arange(world), np.diff(plan.fetch_offsets).astype(np.int64))
        for table, n in zip(tables, np.bincount(fdest, minlength=world)):
            table[0] += int(n)
        src = plan.fetch_from
        want["ps_loads"] += np.bincount(fdest[src < 0], minlength=world)
        want["peer_fetches"] += np.bincount(fdest[src >= 0], minlength=world)
        want["rows_served"] += np.bincount(np.where(src >= 0, src, owner_ranks(plan.fetch_keys, world)),
                                           minlength=world)
        uniq = np.unique(keys)
        trains = np.zeros((len(uniq), world), bool)
        trains[np.searchsorted(uniq, keys.reshape(-1)), np.repeat(plan.assignment, keys.shape[1])] = True
        prim = primaries(uniq, trains)
        want["primary_steps"] += np.bincount(prim, minlength=world)
        want["replica_copies"] += (trains & (prim[:, None] != np.arange(world))).sum(axis=0)
        want["evict_pushes"] += np.bincount(plan.lost_from, minlength=world)
        for name, n in zip(totals, (plan.pulls, plan.peer_pulls, plan.shared, plan.distinct)):
            totals[name] += int(n)
    want["cached"] = np.array([her.cached_count(r) for r in range(world)])
    want["table_rows"] = np.array([rows for _, rows in tables])
    written, flushed = np.empty(0, np.uint64), []
    for held in her.cached_by_worker():
        flushed.append(int((~np.isin(held, written)).sum()))
        written = np.union1d(written, held)
    want["flushed_rows"] = np.array(flushed)
    return {"per_rank": {k: v.tolist() for k, v in want.items()}, "totals": totals, "example_cost": cost}


@pytest.mark.parametrize("schedule", [[], ["--herald", 20]], ids=["sequential", "herald"])
@pytest.mark.parametrize("owner", [0, 1])
def test_an_owners_mem_ps_evicts_the_window_row_the_job_needs_latest(tmp_path, schedule, owner):
    """Each rank's coming batches go to the owners, whose MEM-PS, when every row it
    could evict is in the window, evicts the one the job needs latest: the window
    must follow the global batches (a key's first batch over the ranks), not the
    keys' values. mpi_scenarios.run_lookaheadorder: the owner's rows k[0] < ... <
    k[C-1] are needed in the opposite order, so a new row evicts k[0]."""
    scenario(2, "lookaheadorder", tmp_path, "--mem-budget", "1KiB", "--owner", owner, *schedule)
    got = json.loads((tmp_path / "owner.json").read_text())
    rows = len(got["keys"]) - 1
    assert rows >= 3, rows
    assert got["forced"] == 1  # every row it could evict was in the window
    assert got["cached"] == [False] + [True] * rows, got


@pytest.mark.parametrize("schedule", [[], ["--herald", 150]], ids=["sequential", "herald"])
def test_owners_slide_their_windows_and_evict_as_setting_them_each_batch(tmp_path, batched, schedule):
    """The pipeline's windows are the last ones shifted by a batch: each rank sends
    its owners only the batch that enters, and each owner's MEM-PS slides its window
    (a slide a batch after the first; Herald's leader still gives its scheduler the
    job's window). The same job whose windows are fresh arrays each batch sets them
    anew every batch but the last: the same evictions, rows and MLP, bit for bit. (The sequential
    pipeline: a pipelined one's evictions follow its threads' pace.)"""
    import torch
    from hps.train import load_trainer_state
    steps, per_rank, world = 6, 48, 2
    common = ("--steps", steps, "--per-rank", per_rank, "--lookahead", 2, "--mem-budget", "96KiB", "--sequential",
              *schedule)
    batched.job(tmp_path / "slid", world, "train", *common)
    scenario(world, "train", tmp_path / "set", *common, "--fresh-windows")
    mem = {run: [json.loads((tmp_path / run / f"rank{r}.json").read_text())["mem"] for r in range(world)]
           for run in ("slid", "set")}
    assert [m["lookahead_slides"] for m in mem["slid"]] == [steps - 1] * world
    # Fresh arrays: set anew, but for the last window, empty: the one before less its
    # batch (nothing to compare by identity), popped.
    assert [m["lookahead_slides"] for m in mem["set"]] == [1] * world
    assert all(m["evictions"] > 0 for m in mem["slid"]) and sum(m["lookahead_spared"] for m in mem["slid"]) > 0
    for slid, set_ in zip(mem["slid"], mem["set"]):
        assert {k: v for k, v in slid.items() if k != "lookahead_slides"} == \
            {k: v for k, v in set_.items() if k != "lookahead_slides"}
    keys = np.unique(np.concatenate([b.all_keys().ravel() for b in sc.global_batches(steps, per_rank, world)]))
    for r in range(world):
        runs = [str(tmp_path / run / "job" / f"rank{r}") for run in ("slid", "set")]
        np.testing.assert_array_equal(*[_ps_rows(p, keys) for p in runs], err_msg=f"rank {r}")
        states = [load_trainer_state(p)["mlp"] for p in runs]
        for name, value in states[0].items():
            torch.testing.assert_close(states[1][name], value, rtol=0, atol=0, msg=f"rank {r}: {name}")


PLAN_CASES = [(3, 400, 2, "192KiB", 72), (2, 5000, 0, "256KiB", 48)]


@pytest.mark.parametrize("world,capacity,lookahead,mem_budget,per_rank", PLAN_CASES)
def test_each_herald_rank_moves_and_steps_what_the_leaders_plan_gives_it(tmp_path, batched, world, capacity,
                                                                          lookahead, mem_budget, per_rank):
    """Every rank's share of the work is the plan's, rank by rank, not only in sum:
    the examples it keeps and sends, the rows it loads, fetches and serves (a
    peer's from its cache, an owner's from its MEM-PS), the shared keys it sums
    as primary (the trainer the key's hash picks) and the sums it copies as a
    replica, the rows its evictions push, what its cache holds at the end and
    the rows the final checkpoint's flush has it write, when its table is
    compacted and to what size; the leader plans with
    every rank's lookahead window. All as one Herald scheduled on the global
    batches (with the next global batches as its window) gives them. Caches of
    400 rows (fewer than the job's keys) evict and are compacted unevenly; caches
    of 5,000 never fill, and hold different numbers of rows. MEM-PS (192 KiB a
    rank, with 3 ranks) holds only a few steps' pinned rows: each step unpins the
    rows it pinned. (Plans that spread evenly compact every rank alike: since
    examples stay on the rank that read them unless their keys are cached
    elsewhere, 3 ranks of 48 or 64 examples do at every capacity from 300 to 1,000,
    and of 72 examples at 350 to 450 rows do not.)"""
    steps = 6
    batched.job(tmp_path / "job", world, "train", "--steps", steps, "--per-rank", per_rank, "--herald", capacity,
                "--lookahead", lookahead, "--mem-budget", mem_budget)
    h = [json.loads((tmp_path / "job" / f"rank{r}.json").read_text())["herald"] for r in range(world)]
    want = _herald_replay(world, steps, per_rank, capacity, lookahead)
    for name, counts in want["per_rank"].items():
        assert [x[name] for x in h] == counts, name
    assert all({name: x[name] for name in want["totals"]} == want["totals"] for x in h)
    assert [x["example_cost"] for x in h] == [want["example_cost"]] * world
    assert [x["flushes"] for x in h] == [1] * world  # the final checkpoint's
    assert sum(want["per_rank"]["peer_fetches"]) > 0 and min(want["per_rank"]["replica_copies"]) > 0
    assert min(want["per_rank"]["examples_sent"]) > 0
    if capacity < 1000:
        assert min(want["per_rank"]["evict_pushes"]) > 0 and len(set(want["per_rank"]["compactions"])) > 1
    else:
        assert len(set(want["per_rank"]["cached"])) == world and max(want["per_rank"]["cached"]) < capacity


# ---------------------------------------------------------------- dense: k-step Adam

def _kstep_reference(world: int, steps: int, k: int, beta1: float, beta2: float = 0.99, eps: float = 1e-8,
                     lr: float = 0.05):
    """Algorithm 2 in NumPy, float32: per rank (x, v, m) after each step."""
    x = [sc.KSTEP_X0.copy() for _ in range(world)]
    m = [np.zeros_like(sc.KSTEP_X0) for _ in range(world)]
    v = [np.full_like(sc.KSTEP_X0, eps) for _ in range(world)]
    b1, b2 = np.float32(beta1), np.float32(beta2)
    out = {"x": [], "v": [], "m": []}
    for t in range(steps):
        for i in range(world):
            g = sc.kstep_gradient(i, t, x[i])
            m[i] = b1 * m[i] + (np.float32(1) - b1) * g
            v[i] = b2 * v[i] + (np.float32(1) - b2) * g * g
            x[i] = x[i] - np.float32(lr) * m[i] / np.sqrt(v[i])
        if (t + 1) % k == 0:
            xbar = np.sum(x, axis=0, dtype=np.float32) / np.float32(world)
            vbar = np.sum(v, axis=0, dtype=np.float32) / np.float32(world)
            x = [xbar.copy() for _ in range(world)]
            v = [vbar.copy() for _ in range(world)]
        for name, arr in (("x", x), ("v", v), ("m", m)):
            out[name].append([a.copy() for a in arr])
    return {name: np.array(a) for name, a in out.items()}  # (steps, world, n)


KSTEP_CASES = [(2, 3, 0.0, False), (4, 2, 0.9, True), (3, 1, 0.0, False)]
KSTEP_STEPS = 7


def _kstep_args(k: int, beta1: float, hier: bool) -> list:
    return ["--steps", KSTEP_STEPS, "--k", k, "--beta1", beta1] + (["--hierarchical", "--ranks-per-node", "2"]
                                                                     if hier else [])


@pytest.mark.parametrize("world,k,beta1,hier", KSTEP_CASES)
def test_kstep_adam_matches_algorithm_2_step_by_step(tmp_path, batched, world, k, beta1, hier):
    steps = KSTEP_STEPS
    batched.job(tmp_path, world, "kstep", *_kstep_args(k, beta1, hier))
    ref = _kstep_reference(world, steps, k, beta1)
    for r in range(world):
        got = np.load(tmp_path / f"rank{r}.npz")
        for name in ("x", "v", "m"):
            np.testing.assert_allclose(got[name], ref[name][:, r], rtol=2e-5, atol=1e-6,
                                       err_msg=f"rank {r}, {name}")
        assert int(got["merges"]) == steps // k
        if not hier:  # x and v of 10 floats each, every k steps
            assert int(got["dense_bytes"]) == (steps // k) * 2 * 10 * 4
    # Between merges the ranks differ (m stays local), at merges x agrees everywhere.
    merged = [t for t in range(steps) if (t + 1) % k == 0]
    xs = np.array([np.load(tmp_path / f"rank{r}.npz")["x"] for r in range(world)])
    assert np.ptp(xs[:, merged], axis=0).max() < 1e-6
    apart = [t for t in range(steps) if (t + 1) % k]
    if apart:
        assert np.ptp(xs[:, apart], axis=0).max() > 1e-3


# The jobs the batched fixture runs (Batches), each with the options its test above
# gives it: a launch a world size, its jobs in this order.
BATCHED = ([(w, ("train", "--steps", 6, "--per-rank", 48, *extra)) for w, extra in ALLREDUCE_CASES] +
           [(2, ("train", "--steps", 4, "--per-rank", 16, "--multi-hot", "--empty-bags-at", 2)),
            (3, ("train", "--steps", 6, "--per-rank", 48, "--admission", 3, "--multi-hot", "--uneven"))] +
           [(w, ("train", "--steps", 6, "--per-rank", 48, "--herald", 150, *extra)) for w, extra in HERALD_CASES] +
           [(2, ("train", "--steps", 8, "--per-rank", 48, "--eval-every", 2, *extra))
            for extra in ((), ("--herald", 150))] +
           [(4, ("train", "--steps", 4, "--per-rank", 1, "--herald", 150, "--uneven"))] +
           [(w, ("train", "--steps", 6, "--per-rank", per_rank, "--herald", capacity, "--lookahead", lookahead,
                 "--mem-budget", mem_budget)) for w, capacity, lookahead, mem_budget, per_rank in PLAN_CASES] +
           [(w, ("kstep", *_kstep_args(k, beta1, hier))) for w, k, beta1, hier in KSTEP_CASES] +
           # The first runs of jobs a test then resumes in a launch of its own, and the job whose
           # windows slide (its twin with windows set anew patches hps: a launch of its own).
           [(2, ("train", "--steps", 4, "--per-rank", 48, "--uneven", *schedule))
            for schedule in ((), ("--herald", 256))] +
           [(2, ("train", "--steps", 4, "--checkpoint-every", 2, "--per-rank", 48, "--admission", 3))] +
           [(2, ("train", "--steps", 6, "--per-rank", 48, "--lookahead", 2, "--mem-budget", "96KiB", "--sequential",
                 *schedule)) for schedule in ((), ("--herald", 150))])


@pytest.mark.parametrize("beta2,flush", [(0.0, False), (0.5, False), (0.9, True)])
def test_kstep_adam_keeps_a_parameter_whose_gradient_stays_zero_finite(beta2, flush):
    """Without eps in the denominator, v is all that keeps m / sqrt(v) finite: a
    parameter whose gradient stays 0 (a dead unit's) saw v decay to 0, at once with
    beta2 = 0, after 124 steps with 0.5, after about 650 with 0.9 where denormals
    are flushed, and 0 / 0 made it NaN. It stays where it is now; the others train."""
    import torch
    from hps.distributed import KStepAdam
    if flush and not torch.set_flush_denormal(True):  # (x86 with SSE3 and AArch64 can)
        pytest.skip(f"torch.set_flush_denormal(True) returned False: this CPU ({platform.machine()}) has no "
                    f"flush-to-zero mode for torch to set, so v never decays to 0 with beta2 = 0.9")
    try:
        x = torch.nn.Parameter(torch.ones(2))
        opt = KStepAdam([x], lr=0.01, beta1=0.0, beta2=beta2, eps=1e-8)
        for _ in range(1000):
            x.grad = torch.tensor([0.0, 1.0])
            opt.step()
        assert x[0].item() == 1.0, x
        assert math.isfinite(x[1].item()) and x[1].item() < 0.0, x  # (trained)
    finally:
        torch.set_flush_denormal(False)


def _kstep_adam_reference_step(params, state, lr, b1, b2, eps):
    """KStepAdam.step as it was before it checked the gradients (torch's ops in its
    order), for a bit-for-bit comparison."""
    import torch
    with torch.no_grad():
        for p in params:
            st = state.setdefault(p, {"m": torch.zeros_like(p), "v": torch.full_like(p, eps)})
            g = p.grad
            st["m"].mul_(b1).add_(g, alpha=1 - b1)
            st["v"].mul_(b2).addcmul_(g, g, value=1 - b2).clamp_min_(torch.finfo(p.dtype).tiny)
            p.addcdiv_(st["m"], st["v"].sqrt(), value=-lr)


def _bits(t):
    import torch
    return t.detach().contiguous().view(torch.int32)  # (-0.0 and 0.0 told apart, NaNs by their bits)


@pytest.mark.parametrize("bad", [1e20, -1e20, float("inf"), float("nan")])
def test_kstep_adam_refuses_a_gradient_whose_square_overflows_before_any_parameter_changes(bad):
    """A gradient past 1.8e19 made g^2, and with it v, an infinity: from then on
    m / sqrt(v) is 0 (the parameter never moves) or NaN, and the model was kept so
    without a word. The step is refused (DivergedError, naming the parameter), all or
    nothing: the parameter stepped before the bad one is unchanged too, as are m and v."""
    import torch
    from hps.distributed import KStepAdam
    from hps.errors import DivergedError
    gen = torch.Generator().manual_seed(3)
    xs = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))]
    opt = KStepAdam(xs, lr=0.01, beta1=0.5, beta2=0.999, eps=1e-8)
    for x in xs:
        x.grad = torch.randn(x.shape, generator=gen)
    opt.step()
    for x in xs:
        x.grad = torch.randn(x.shape, generator=gen)
    xs[1].grad[1] = bad
    before = [_bits(t).clone() for x in xs for t in (x, opt.state[x]["m"], opt.state[x]["v"])]
    with pytest.raises(DivergedError, match=r"^k-step Adam step: dense parameter 1 of 2 \(shape \(3,\)\) has .*: "
                                            r"training diverged; no dense parameter was changed$"):
        opt.step()
    after = [_bits(t) for x in xs for t in (x, opt.state[x]["m"], opt.state[x]["v"])]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_kstep_adam_steps_bit_for_bit_as_before_its_gradient_check():
    """The check reads the gradients and changes nothing: parameters, m and v after
    each of a few steps are those of the step without it, bit for bit, large
    gradients (1e15, under the bound) and zeros among them."""
    import torch
    from hps.distributed import KStepAdam
    gen = torch.Generator().manual_seed(5)
    shapes = [(16, 9), (16,), (1, 16), (1,)]
    xs = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(x.detach().clone()) for x in xs]
    opt, state = KStepAdam(xs, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8), {}
    for step in range(6):
        for x, r in zip(xs, ref):
            g = torch.randn(x.shape, generator=gen) * (1e15 if step == 2 else 1.0)
            g[g.abs() < 0.3] = 0.0
            x.grad, r.grad = g.clone(), g.clone()
        opt.step()
        _kstep_adam_reference_step(ref, state, 0.01, 0.9, 0.99, 1e-8)
        for x, r in zip(xs, ref):
            assert torch.equal(_bits(x), _bits(r)), step
            assert torch.equal(_bits(opt.state[x]["m"]), _bits(state[r]["m"])), step
            assert torch.equal(_bits(opt.state[x]["v"]), _bits(state[r]["v"])), step


@pytest.mark.parametrize("setting,value,message", [
    ("lr", -0.1, "lr must be a finite number >= 0, got -0.1"), ("lr", float("nan"), "lr must be a finite number"),
    ("beta1", 1.0, "beta1 must be in [0, 1), got 1.0"), ("beta2", -0.5, "beta2 must be in [0, 1), got -0.5"),
    ("beta2", "0.9", "beta2 must be in [0, 1), got '0.9'"), ("eps", 0.0, "eps must be a finite number > 0, got 0.0")])
def test_kstep_adam_refuses_settings_naming_them(setting, value, message):
    """KStepAdam used directly went on with any of these (a negative lr steps uphill)."""
    import torch
    from hps.distributed import KStepAdam
    with pytest.raises(ValueError, match=re.escape(f"KStepAdam: {message}")):
        KStepAdam([torch.nn.Parameter(torch.ones(2))], **{setting: value})


class _TwoEqualRanks:
    """DenseSync's node for a test in this process: 2 ranks holding the same numbers
    (an all-reduce doubles the buffer), the buffers host memory, as MPI's are."""
    size = 2

    def __init__(self, dense_sync: str):
        from hps.distributed import DistributedConfig
        self.config = DistributedConfig(dense_sync=dense_sync)

    def allreduce(self, stage, buf, kind, what, hierarchical=False):
        assert isinstance(buf, np.ndarray) and buf.dtype == np.float32
        buf *= 2.0
        return buf


def _off_host_class():
    import torch

    class OffHost(torch.Tensor):
        """A tensor whose memory numpy cannot read, as a GPU's (model_devices = "cuda"):
        .numpy() refuses it as it refuses a CUDA tensor; .cpu() and .to("cpu")
        hand back a plain host tensor, and copy_ writes into it from the host."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.numpy:
                raise TypeError("can't convert an off-host tensor to numpy. Use Tensor.cpu() to copy the tensor "
                                "to host memory first.")
            out = super().__torch_function__(func, types, args, kwargs)
            to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(
                str(a) == "cpu" for a in [*args[1:], kwargs.get("device")]))
            return out.as_subclass(torch.Tensor) if to_host else out
    return OffHost


def test_dense_sync_reads_parameters_numpy_cannot_and_writes_them_back_where_they_are():
    """DenseSync read the dense parameters, their gradients and k-step Adam's v with
    .numpy(), which refuses a model on a GPU (and a bfloat16 one): the all-reduce
    and the merge raised. They now go to host float32 for MPI and back into the
    tensors, which keep their kind and dtype."""
    import torch
    from hps.distributed import DenseSync
    OffHost = _off_host_class()
    off = torch.arange(6, dtype=torch.float32).reshape(2, 3).as_subclass(OffHost).requires_grad_(True)
    half = torch.nn.Parameter(torch.tensor([0.5, -1.5], dtype=torch.bfloat16))
    off.grad = torch.full((2, 3), 0.25).as_subclass(OffHost)
    half.grad = torch.tensor([1.0, -3.0], dtype=torch.bfloat16)
    sync = DenseSync(_TwoEqualRanks("allreduce"), [off, half], lr=0.1)
    sync.reduce_gradients()
    assert type(off.grad) is OffHost and half.grad.dtype == torch.bfloat16
    assert torch.equal(off.grad.as_subclass(torch.Tensor), torch.full((2, 3), 0.5))
    assert torch.equal(half.grad, torch.tensor([2.0, -6.0], dtype=torch.bfloat16))

    sync = DenseSync(_TwoEqualRanks("kstep"), [off], lr=0.1)
    sync.make_optimizer(None)
    sync.merge()  # the mean of two equal ranks: the same numbers, back where they were
    assert type(off) is OffHost and sync.merges == 1
    assert torch.equal(off.detach().as_subclass(torch.Tensor), torch.arange(6, dtype=torch.float32).reshape(2, 3))


# ---------------------------------------------------------------- hierarchical all-reduce

@pytest.mark.parametrize("world,ranks_per_node", [(4, 2), (3, 1), (4, 1), (2, 0)])
def test_hierarchical_allreduce_sums_and_counts_bytes(tmp_path, world, ranks_per_node):
    scenario(world, "allreduce", tmp_path, "--ranks-per-node", ranks_per_node)
    total = world * (world + 1) / 2
    nodes = world // ranks_per_node if ranks_per_node else 1
    per_node = world // nodes
    pof2 = 1 << (nodes.bit_length() - 1)
    for r in range(world):
        got = np.load(tmp_path / f"rank{r}.npz")
        assert int(got["nodes"]) == nodes
        for n in (1, 5, 1000):
            np.testing.assert_array_equal(got[f"sum{n}"], (np.arange(n) + 1) * total)
            node_index = r // per_node
            sends = (pof2.bit_length() - 1) if node_index < pof2 else 1  # log2 exchanges, or one fold-in
            if node_index < pof2 and node_index + pof2 < nodes:
                sends += 1  # the result back to the folded node
            sends += 1 if per_node > 1 else 0  # within the node
            assert int(got[f"bytes{n}"]) == sends * n * 8, (r, n)


@pytest.mark.parametrize("world,node_size", [(3, 2), (5, 2), (5, 3)])
def test_hierarchical_allreduce_sums_over_nodes_of_other_sizes(tmp_path, world, node_size):
    """Nodes of 2 and 1 ranks: the lone rank summed only the ranks of local index 0
    (rank 0's and its own), the dense gradients of the others missed without a word."""
    scenario(world, "unevenallreduce", tmp_path, "--node-size", node_size)
    total = (np.arange(5) + 1) * sum(10.0 ** r for r in range(world))
    for r in range(world):
        np.testing.assert_array_equal(json.loads((tmp_path / f"rank{r}.json").read_text()), total,
                                      err_msg=f"rank {r}")


# ---------------------------------------------------------------- admission: the sketch's memory

def test_the_sketch_memory_check_counts_the_ranks_mpi_puts_on_the_machine(tmp_path):
    """Under a launcher that sets no variable of the ranks on a machine, the config's
    check sees one rank; once MPI runs, its shared-memory communicator counts both
    ranks here, and a sketch the machine holds once but not twice is refused on
    every rank before anything is trained."""
    scenario(2, "sketchmemory", tmp_path, timeout=120)
    for r in range(2):
        error = json.loads((tmp_path / f"rank{r}.json").read_text())["error"]
        assert error is not None, f"rank {r} trained with 2 sketches of 300 KiB on a machine of 600 KiB - 1"
        for q in range(2):
            assert (f"rank {q}: ValueError: [admission]: admission.sketch_bytes = 307200 (307,200 bytes a rank; "
                    "2 ranks on this machine (MPI's shared-memory communicator) hold 614,400 bytes) is more than "
                    "this machine's memory (614,399 bytes)") in error, error


# ---------------------------------------------------------------- failures

@pytest.mark.parametrize("how", ["hang", "die"])
def test_a_lost_rank_ends_the_job_with_a_clear_error(tmp_path, how):
    t0 = time.monotonic()
    p = scenario(2, "fail", tmp_path, "--how", how, "--timeout", 4, check=False, timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert elapsed < 90, f"the job took {elapsed:.0f} s to end"
    if how == "hang":
        assert "rank 0 of 2: waited" in p.stderr and "a rank has died or hung; aborting the job" in p.stderr, \
            f"exit {p.returncode}\nstdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-3000:]}"


def test_a_rank_whose_train_step_raises_ends_the_job_naming_the_rank_and_the_error(tmp_path):
    """Rank 1's train stage raises at step 3. Its peer waits in that step's exchanges
    and rank 1's loader in the next batch's, for the peer's loader, which waits for
    its step: the pipeline's join of rank 1's stages never ended, and the job ended
    only at the watchdog's timeout, saying a rank had hung and not what failed. Now
    the failed stage ends the job at once, naming the rank and the error."""
    p = scenario(2, "train", tmp_path, "--steps", 8, "--fail-in-step", 3, "--timeout", 60, check=False, timeout=200)
    assert p.returncode != 0
    assert "hps.distributed: rank 1 of 2: RuntimeError: rank 1's step 3 failed; aborting the job" in p.stderr, \
        p.stderr[-3000:]
    assert_aborted_once(p, 1)
    assert "waited" not in p.stderr, p.stderr[-3000:]


def assert_aborted_once(p, rank: int) -> None:
    """Rank `rank` of scenario run `p` said "aborting the job" once: the failure that
    ended it, not again for a stage that failed after it (abort_job)."""
    said = re.findall(rf"hps\.distributed: rank {rank} of \d+: [^\n]*; aborting the job", p.stderr)
    assert len(said) == 1, p.stderr[-3000:]


class _WorldWhoseFirstAbortWaits:
    """A communicator whose Abort returns (the real one ends the process), and
    waits in the thread `first` until `ended` is set: the first abort still under
    way while the others come."""

    def __init__(self):
        import threading
        self.codes, self.ended, self.first = [], threading.Event(), None

    def Abort(self, code):  # noqa: N802 (mpi4py's name)
        import threading
        self.codes.append(code)
        if threading.current_thread() is self.first:
            self.ended.wait(30)


def test_a_ranks_second_failure_during_its_abort_is_said_as_coming_after_the_first(monkeypatch):
    """Two stages of a rank fail, the second in the moment before the first's
    MPI_Abort ends the process (its exchanges or batches went with the first): each
    said "...; aborting the job", and the second read as a second cause (a Herald
    job's NaN said it twice, by the train stage and the writer). Now only the first
    says it; the second is marked as coming after it (the same reason: not again),
    and each still ends the job. (A communicator whose first Abort waits, so that
    the second comes while it is under way.)"""
    import io
    import threading
    from hps.distributed import comm
    from hps.distributed.comm import abort_job

    monkeypatch.setattr(comm, "_aborting", None)  # this process's abort: a first again after the test

    class Stderr(io.StringIO):
        def __init__(self):
            super().__init__()
            self.said = threading.Event()

        def write(self, text):
            n = super().write(text)
            self.said.set()
            return n

    err, world = Stderr(), _WorldWhoseFirstAbortWaits()
    monkeypatch.setattr(sys, "stderr", err)
    first = threading.Thread(target=abort_job, args=(world, "rank 1 of 2: RuntimeError: step 3 failed", 1))
    world.first = first
    first.start()
    try:
        assert err.said.wait(30)
        abort_job(world, "rank 1 of 2: OSError: the loader's exchange broke", 1)
        abort_job(world, "rank 1 of 2: RuntimeError: step 3 failed", 1)
    finally:
        world.ended.set()
        first.join()
    assert err.getvalue().splitlines() == [
        "rank 1 of 2: RuntimeError: step 3 failed; aborting the job",
        "rank 1 of 2: OSError: the loader's exchange broke (after the failure above, whose abort of the job is "
        "under way)"]
    assert world.codes == [1, 1, 1]


def test_a_failure_said_after_the_first_abort_returned_is_not_a_second_cause(monkeypatch):
    """MPICH's MPI_Abort returns (mpiexec's proxy kills the ranks a moment later),
    and abort_job took the return for the end of the abort: a Herald job's NaN was
    said "aborting the job" by the train stage, then again by the train loop's
    handler reporting the same error once the stage's Abort had returned (a CI-like
    load made it 1 run in 6). The abort stays under way for the rest of the process:
    the same reason says nothing more, another is marked as coming after it."""
    import io
    from hps.distributed import comm
    from hps.distributed.comm import abort_job

    class ReturningWorld:  # as MPICH's: Abort asks the launcher to end the job and returns
        def __init__(self):
            self.codes = []

        def Abort(self, code):  # noqa: N802 (mpi4py's name)
            self.codes.append(code)

    monkeypatch.setattr(comm, "_aborting", None)
    monkeypatch.setattr(comm.time, "sleep", lambda s: None)
    err, world = io.StringIO(), ReturningWorld()
    monkeypatch.setattr(sys, "stderr", err)
    abort_job(world, "rank 1 of 2: DivergedError: herald shared gradients", 70, "Traceback: the stage's\n")
    abort_job(world, "rank 1 of 2: DivergedError: herald shared gradients", 70, "Traceback: the loop's\n")
    abort_job(world, "rank 1 of 2: RuntimeError: the cache stopped", 70)
    assert err.getvalue().splitlines() == [
        "Traceback: the stage's",
        "rank 1 of 2: DivergedError: herald shared gradients; aborting the job",
        "rank 1 of 2: RuntimeError: the cache stopped (after the failure above, whose abort of the job is under way)"]
    assert world.codes == [70, 70, 70]  # each call still ends the job


def test_a_ranks_traceback_is_printed_once_with_the_line_that_says_its_failure(monkeypatch):
    """_abort_rank prints the failure's traceback, then abort_job says it. A stage
    whose error comes again in the moment before the first's MPI_Abort ends the
    process (the writer raising the train stage's error, which the pipeline's
    on_error heard first) printed the whole traceback a second time, though
    abort_job said its reason once; it now goes with the line: each traceback once,
    a second failure's before its "(after the failure above ...)" line."""
    import io
    import threading
    from hps.distributed import comm
    from hps.distributed.comm import Node
    from hps.train import _abort_rank

    monkeypatch.setattr(comm, "_aborting", None)  # this process's abort: a first again after the test

    class OneRank:
        rank, size, abort = 1, 2, Node.abort

    def raised(error):
        try:
            raise error
        except Exception as e:  # noqa: BLE001 - (its traceback is what is printed)
            return e

    node = OneRank()
    node.world = _WorldWhoseFirstAbortWaits()
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    step, loader = raised(RuntimeError("step 3 failed")), raised(OSError("the loader's exchange broke"))
    node.world.first = first = threading.Thread(target=_abort_rank, args=(node, step))
    first.start()
    try:
        deadline = time.monotonic() + 30
        while "aborting the job" not in err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        _abort_rank(node, step)  # (the writer re-raising the train stage's error)
        _abort_rank(node, loader)
    finally:
        node.world.ended.set()
        first.join()
    text = err.getvalue()
    assert text.count("Traceback (most recent call last)") == 2, text
    assert text.count("RuntimeError: step 3 failed\n") == 1, text
    assert text.count("OSError: the loader's exchange broke\n") == 1, text
    assert text.index("RuntimeError: step 3 failed\n") < text.index("RuntimeError: step 3 failed; aborting")
    assert text.index("OSError: the loader's exchange broke\n") < text.index("(after the failure above")
    assert node.world.codes == [1, 1, 1]


def assert_every_rank_raised(out, p, said: str, ranks: int) -> None:
    """Every rank of scenario run `p` raised an error whose text holds `said`: read
    from each rank's own file (mpi_scenarios writes rankN.raised), since mpiexec may
    interleave the ranks' stderr inside a line."""
    for rank in range(ranks):
        raised = out / f"rank{rank}.raised"
        assert raised.exists(), (rank, p.stderr[-3000:])
        assert said in raised.read_text(), (rank, raised.read_text())


@pytest.mark.parametrize("how, error", [("disk", "OSError: [Errno 28] No space left on device"),
                                        ("corrupt", "CorruptionError: rank 1's store: a damaged checkpoint")])
def test_a_rank_whose_server_fails_to_open_ends_the_job_on_every_rank_naming_it(tmp_path, how, error):
    """Rank 1's server fails to open; rank 0's opens and waits in the servers' first
    exchange (their initial rows). Before: an OSError went to the setup exchange,
    which met rank 0's initial rows, so rank 1 reported rank 0's row bytes as its
    error and rank 0 (told rank 1's rows differ) waited in the setup exchange until
    the watchdog's timeout; a CorruptionError was not exchanged at all (rank 0
    waited the same). Now every rank raises at once, naming rank 1 and its error."""
    p = scenario(2, "train", tmp_path, "--fail-open", how, "--timeout", 60, check=False, timeout=200)
    assert p.returncode != 0
    said = (f"RankFailure: the ranks are out of step: rank 0 in the ranks' initial rows; rank 1 in setup "
            f"(rank 1: {error})")
    assert_every_rank_raised(tmp_path, p, said, 2)
    assert "waited" not in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("setting, values", [("dense_lr", "0.01 on rank 0, 0.1 on rank 1"),
                                             ("distributed.sparse_grads", "'none' on rank 0, 'bf16' on rank 1")])
def test_ranks_given_different_configs_are_refused_naming_the_setting(tmp_path, setting, values):
    """Rank 1 runs another config. Before: another dense_lr trained on without a word,
    each rank stepping its copy of the MLP with its own rate (all-reduce keeps them
    equal only if every rank steps alike); another sparse_grads codec ended in an MPI
    error ("See the MPI_ERROR field") of an alltoallv whose blocks the ranks sized
    differently. Now every rank refuses it before anything is written, naming it."""
    name = setting.split(".")[-1]
    p = scenario(2, "train", tmp_path, "--rank1-config", name, check=False, timeout=120)
    assert p.returncode != 0
    said = f"ValueError: the ranks run different configs ({setting} = {values}): every rank of a job must run the same"
    assert_every_rank_raised(tmp_path, p, said, 2)
    assert not (tmp_path / "job").exists()


def test_a_herald_job_whose_ranks_data_give_other_fields_is_refused_on_every_rank(tmp_path):
    """Rank 1's data has two multi-hot fields, rank 0's none, under schedule =
    "herald" (which trains single-hot fields only). Rank 1 refused its multi-hot
    fields on its own, before the ranks compare their data's fields, and rank 0
    waited in that comparison until the watchdog's timeout, which said only that a
    rank had hung. Now every rank raises at once, naming both ranks' fields."""
    p = scenario(2, "train", tmp_path, "--herald", 150, "--rank1-config", "multi_hot", "--timeout", 20,
                 check=False, timeout=120)
    assert p.returncode != 0
    assert "waited" not in p.stderr, p.stderr[-3000:]
    said = ("ValueError: the ranks' data give different fields (dense, single-hot, multi-hot): rank 0: (13, 26, 0); "
            "rank 1: (13, 26, 2) (every rank's data must give the same fields)")
    assert_every_rank_raised(tmp_path, p, said, 2)
    assert not (tmp_path / "job").exists()


def test_the_settings_ranks_must_share_leave_out_only_the_machines_own():
    from hps.train import MACHINE_SETTINGS, _job_settings
    cfg = sc.train_config("/tmp/unused")
    settings = _job_settings(cfg)
    assert settings["ps.optimizer.kind"] == "adagrad" and settings["ps.optimizer.lr"] == 0.05
    assert settings["dense_lr"] == 0.01 and settings["hidden"] == [16] and settings["ps.path"] == "/tmp/unused"
    assert settings["distributed.sparse_rows"] == "none" and "distributed.timeout" not in settings
    assert not any(k == m or k.startswith(m + ".") for k in settings for m in MACHINE_SETTINGS)


def test_an_exchange_whose_ranks_send_rows_of_other_sizes_is_refused_not_misread(tmp_path):
    """Rank 0 sends rows of 16 bytes, rank 1 of 12. The receivers sized their buffers
    from the rows they were told of and their own row size: rank 1's alltoallv failed
    with an MPI error, and rank 0 took rank 1's 24 bytes for 2 rows of 16, the rest of
    its buffer whatever memory held. Both refuse it now, naming the sizes."""
    scenario(2, "rowbytes", tmp_path, timeout=120)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # And rows one way only (rank 0 sends 2, rank 1 none): the same on both ranks.
    said = ("RankFailure: push gradients: the ranks' rows differ in size (rank 0's 16 bytes, rank 1's 12 bytes): the "
            "ranks run other versions of hps or configs")
    for name in ("error", "one_way"):
        assert [g[name] for g in got] == [said, said], name


@pytest.mark.parametrize("codec", ["int8", "bf16", "none"])
def test_a_nan_sparse_gradient_ends_the_job_naming_the_rank_the_traffic_and_the_key(tmp_path, codec):
    """Rank 1's summed sparse gradients of step 3 hold a NaN (a step that diverged with
    a finite loss). The int8 codec raised on rank 1 alone, saying only that a row
    held a non-finite value; bf16 and none carried the NaN into the owner's row and
    the job finished. Now every codec refuses it before the exchange, and the job
    ends at once naming the rank, the traffic, the count and the key."""
    p = scenario(2, "train", tmp_path, "--steps", 6, "--nan-grad-at-step", 3, "--sparse-codec", codec,
                 "--timeout", 60, check=False, timeout=200)
    _assert_rank_1s_nan_ended_the_job(p, "push gradients")


def _assert_rank_1s_nan_ended_the_job(p, traffic: str) -> None:
    """The job failed at once (no rank waited out its timeout), naming rank 1, the
    traffic and the key."""
    assert p.returncode != 0, p.stderr[-3000:]
    assert re.search(rf"hps\.distributed: rank 1 of 2: DivergedError: {traffic}: 1 non-finite value in the "
                     r"gradients of 1 key \(key \d+ first: nan\): training diverged .*; aborting the job",
                     p.stderr), p.stderr[-3000:]
    assert_aborted_once(p, 1)
    assert "waited" not in p.stderr, p.stderr[-3000:]


def test_a_kstep_dense_gradient_whose_square_overflows_ends_the_job_before_a_merge_or_checkpoint(tmp_path):
    """Rank 1's dense gradient of step 3 holds 1e20 (k-step Adam's gradients are each
    rank's own). Its square made v an infinity, the parameter never moved again, and
    the job finished and kept that model. Now rank 1's step refuses it before any
    parameter changes and the job ends at once, naming the rank and the parameter;
    the merge of step 3 and the checkpoint of step 4 never happen: job.json keeps step 2."""
    p = scenario(2, "train", tmp_path, "--steps", 6, "--dense-sync", "kstep", "--k", 3, "--checkpoint-every", 2,
                 "--huge-dense-grad-at-step", 3, "--timeout", 60, check=False, timeout=200)
    assert p.returncode != 0, p.stderr[-3000:]
    assert re.search(r"hps\.distributed: rank 1 of 2: DivergedError: k-step Adam step: dense parameter 0 of \d+ "
                     r"\(shape \(\d+, \d+\)\) has gradients whose sum of squares is [^;]*: training diverged; no "
                     r"dense parameter was changed; aborting the job", p.stderr), p.stderr[-3000:]
    assert_aborted_once(p, 1)
    assert "waited" not in p.stderr, p.stderr[-3000:]
    with open(tmp_path / "job" / "job.json") as f:
        assert json.load(f)["step"] == 2


def test_a_nan_sparse_gradient_ends_a_herald_job_before_the_shared_gradients_cross(tmp_path):
    """As above with schedule = "herald": rank 1's gradients of step 3 hold a NaN.
    Herald's exchange of shared keys' gradients carried it to the key's primary,
    whose sum every trainer stepped its copy with, and the job finished (with NaN
    rows). Now rank 1 refuses it before that exchange and the job ends at once
    naming the rank, the traffic and the key."""
    p = scenario(2, "train", tmp_path, "--steps", 6, "--herald", 150, "--nan-grad-at-step", 3,
                 "--timeout", 60, check=False, timeout=200)
    _assert_rank_1s_nan_ended_the_job(p, "herald shared gradients")


def test_a_herald_sum_that_overflows_at_a_primary_ends_the_job_before_any_trainer_steps(tmp_path):
    """A key both ranks train gets 3e38 from each: finite, so each rank's check lets
    it by, but its primary's sum (the trainers' step) is an infinity. Every trainer
    stepped its copy with it, and only the next batch's loss, NaN, stopped the job,
    the rows of NaN made (a checkpoint between would have kept them, and a row no
    later loss reads would have gone unnoticed). Now each trainer's step refuses the
    sum, naming the key, and the job ends at once."""
    p = scenario(2, "train", tmp_path, "--steps", 6, "--herald", 150, "--huge-shared-grad-at-step", 3,
                 "--timeout", 60, check=False, timeout=200)
    assert p.returncode != 0, p.stderr[-3000:]
    assert re.search(r"hps\.distributed: rank [01] of 2: DivergedError: (device tier apply|apply_summed_gradients): "
                     r"\d+ non-finite values? in the summed gradients of \d+ keys? \(key \d+ first: inf\): training "
                     r"diverged .*no row was stepped; aborting the job", p.stderr), p.stderr[-3000:]
    for unsaid in ("waited", "the loss is", "RuntimeWarning"):  # (numpy's, of the sum)
        assert unsaid not in p.stderr, p.stderr[-3000:]


def test_a_herald_step_past_device_capacity_ends_the_job_on_every_rank_naming_the_settings(tmp_path):
    """Step 2 of a Herald job would fetch about 900 rows onto rank 0 beside its cache's
    512, more than its table's device_capacity = 1100. The leader refused it while it
    scheduled the step, on its own: its MPI_Abort ended the job, and rank 1 died saying
    nothing of why. Now the step's plan parts carry the refusal, every rank raises it
    alike, and step 1's checkpoint is kept: resumed with room, the job trains on."""
    from hps.train import load_trainer_state
    p = scenario(2, "train", tmp_path, "--steps", 4, "--herald", 512, "--device-capacity", 1100,
                 "--checkpoint-every", 1, "--timeout", 60, check=False, timeout=200)
    assert p.returncode != 0, p.stderr[-3000:]
    assert "waited" not in p.stderr, p.stderr[-3000:]
    said = re.compile(r"ValueError: a step may fetch \d+ rows onto rank 0, whose cache holds 512 \(worker_cache_rows "
                      r"= 512\), more than \[ps\] device_capacity = 1100 together; raise device_capacity or lower "
                      r"worker_cache_rows")
    for rank in range(2):
        raised = tmp_path / f"rank{rank}.raised"
        assert raised.exists(), (rank, p.stderr[-3000:])
        assert said.fullmatch(raised.read_text().strip()), (rank, raised.read_text())
        assert load_trainer_state(str(tmp_path / "job" / f"rank{rank}"))["batches_done"] == 1
        raised.unlink()
    scenario(2, "train", tmp_path, "--steps", 4, "--herald", 512, "--checkpoint-every", 1, "--resume", timeout=200)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["batches"] for r in range(2)] == [4, 4]


def test_refuse_nonfinite_counts_values_and_keys_and_lets_numbers_pass():
    from hps.distributed.sparse import refuse_nonfinite
    keys = np.array([5, 9, 11, 13], np.uint64)
    grads = np.ones((4, 3), np.float32)
    refuse_nonfinite(grads, keys, "push gradients")
    grads[1, 2] = np.inf
    grads[3, 0:2] = np.nan
    with pytest.raises(hps.errors.DivergedError,
                       match=r"^push gradients: 3 non-finite values in the gradients of 2 keys \(key 9 first: inf\)"):
        refuse_nonfinite(grads, keys, "push gradients")


@pytest.mark.parametrize("codec", ["none", "bf16"])
def test_refuse_nonfinite_returns_the_largest_magnitude_and_refuses_a_lone_nan_or_infinity(codec):
    """refuse_nonfinite reads the gradients' largest and smallest value only (the
    bound each rank tells in a step's first exchange: sum_bound), where an isfinite
    pass read them first: a NaN alone, +inf alone and -inf alone among numbers are
    each refused through that reading, with the message of the pass (under bf16
    too); numbers give their largest |value| (0.0 for no gradient)."""
    from hps.distributed.sparse import refuse_nonfinite
    keys = np.array([5, 9, 11], np.uint64)
    grads = np.array([[1.0, -2.0], [0.5, 0.0], [1.5, -0.25]], np.float32)
    assert refuse_nonfinite(grads, keys, "push gradients", codec) == 2.0
    assert refuse_nonfinite(-grads, keys, "push gradients", codec) == 2.0
    assert refuse_nonfinite(np.empty((0, 2), np.float32), keys[:0], "push gradients", codec) == 0.0
    for bad in (np.nan, np.inf, -np.inf):
        odd = grads.copy()
        odd[1, 1] = bad
        said = r"^push gradients: 1 non-finite value in the gradients of 1 key \(key 9 first: " + str(bad)
        with pytest.raises(hps.errors.DivergedError, match=said):
            refuse_nonfinite(odd, keys, "push gradients", codec)


def test_refuse_nonfinite_under_bf16_refuses_the_finite_values_bf16_rounds_to_infinity():
    """bfloat16 rounds a float32 from 0x7F7F8000 on (about 3.3962e38, below float32's
    largest) up to an infinity: under [distributed] sparse_grads = "bf16" those are
    refused as an infinity is, naming the key; the largest value bf16 keeps finite
    passes, and under the other codecs (which carry such a value as a number) it does too."""
    from hps.distributed.sparse import refuse_nonfinite
    from hps.hierarchical.codecs import BFloat16
    keys = np.array([5, 9, 11], np.uint64)
    grads = np.ones((3, 2), np.float32)
    largest = np.float32(BFloat16.largest_finite_input)
    grads[1, 0], grads[2, 1] = largest, -largest
    refuse_nonfinite(grads, keys, "push gradients", "bf16")
    assert np.isfinite(BFloat16().decode(BFloat16().encode(grads))).all()
    grads[2, 1] = -np.nextafter(largest, np.float32(np.inf))  # 0x7F7F8000: rounds to -inf
    grads[1, 1] = np.nan
    for codec in ("none", "int8"):  # (the NaN alone)
        with pytest.raises(hps.errors.DivergedError, match=r"1 non-finite value in the gradients of 1 key \(key 9 "):
            refuse_nonfinite(grads, keys, "push gradients", codec)
    with pytest.raises(hps.errors.DivergedError,
                       match=r"^push gradients: 2 values in the gradients of 2 keys \(key 9 first: nan\) that "
                             r"bfloat16 rounds to an infinity \(past 3\.396177e\+38\) or that are not a number: "
                             r"training diverged \(\[distributed\] sparse_grads = 'bf16' would carry them into the "
                             r"owners' rows\)$"):
        refuse_nonfinite(grads, keys, "push gradients", "bf16")
    grads[1, 1] = 0.0
    with pytest.raises(hps.errors.DivergedError, match=r"1 value in the gradients of 1 key \(key 11 first: "
                                                       r"-3\.39617\d*e\+38\) that bfloat16 rounds to an infinity"):
        refuse_nonfinite(grads, keys, "push gradients", "bf16")


class _OneRankNode:
    """hps.distributed's Node for a job of one rank, without MPI: each exchange gives
    back what it was given."""
    rank, size, nodes = 0, 1, 1

    def alltoallv(self, stage, blocks, kind, what, tell=0, heard=None):
        if heard is not None:
            heard[:] = tell
        return [b.copy() for b in blocks]

    def allgather(self, stage, obj, what, note=None):
        return [obj]

    def give_up(self, stage, what, failed):
        raise failed  # (no peer to tell)

    def confirm(self, stage, what, failed=None):
        if failed is not None:
            raise failed


def test_a_new_jobs_directory_is_durable_once_its_record_is_written(tmp_path, monkeypatch):
    """Rank 0 makes a new job's directory (and any above it) and writes job.json
    there; the directories' entries were never synced in their parents, so a
    power loss could take the job, its checkpoints with it, after they finished
    (an fsync of a directory does not persist its own entry). The calls are
    logged (tests/durable_names.py): the page cache hides this from a reopen."""
    from durable_names import NameLog
    from hps.train import _prepare_job
    log = NameLog(monkeypatch)
    cfg = sc.train_config(str(tmp_path / "new" / "job"))
    assert _prepare_job(cfg, _OneRankNode(), resume=False) is None
    manifest = tmp_path / "new" / "job" / "job.json"
    assert os.path.exists(manifest)
    assert log.unsynced(tmp_path, before=log.index_of_entry(manifest)) == []  # (a rename may reach the disk unsynced)
    assert log.unsynced(tmp_path) == []


@pytest.mark.parametrize("how", ["push", "batch"])
def test_a_finite_sparse_gradient_that_bf16_rounds_to_infinity_is_refused_before_any_owner_steps(tmp_path, how):
    """A sparse gradient of 3.4e38 (float32's largest) is finite, so the check for
    non-finite gradients let it by; the bf16 codec of [distributed] sparse_grads then
    rounded it to an infinity on its way, and its owner stepped the key's row with it
    (AdaGrad: a row of NaN, which every later pull and checkpoint held). It is refused
    now, as a NaN is, naming the key, before the exchange: the row is as it was."""
    from hps.distributed.sparse import DistributedServer
    cfg = hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), optimizer=hps.AdaGrad(lr=0.1), seed=3)
    server = DistributedServer(hps.ParameterServer(cfg), _OneRankNode(), sparse_grads="bf16")
    keys = np.array([5, 9], np.uint64)
    before = server.pull(keys)
    grads = np.ones((2, 4), np.float32)
    grads[1, 2] = np.finfo(np.float32).max
    said = (r"^push gradients: 1 value in the gradients of 1 key \(key 9 first: 3\.4028235e\+38\) that bfloat16 "
            r"rounds to an infinity")
    with pytest.raises(hps.errors.DivergedError, match=said):
        _push_by(server, how, keys, grads)
    np.testing.assert_array_equal(server.pull(keys), before)
    server.close()


class _RecordingOneRankNode(_OneRankNode):
    """A one-rank node that writes down each exchange by name (give_up's too)."""

    def __init__(self):
        self.exchanges = []

    def alltoallv(self, stage, blocks, kind, what):
        self.exchanges.append(what)
        return super().alltoallv(stage, blocks, kind, what)

    def allgather(self, stage, obj, what, note=None):
        self.exchanges.append(what)
        return [obj]

    def give_up(self, stage, what, failed):
        self.exchanges.append(f"{what} (given up)")
        raise failed


def test_hps_train_setup_owes_no_exchange_after_a_server_a_rank_refused(tmp_path):
    """A rank that refuses its DistributedServer's arguments (a codec) says so in the
    servers' first exchange, where its peers raise RankFailure naming it (the
    onerankrefuses scenario). hps train's setup (_collective) then took that rank's
    own error for one its peers had not heard of, and waited for them in an
    exchange of its own, which they, past their RankFailure, never entered. It
    passes the error on now, as it passes on a RankFailure."""
    from hps.distributed.sparse import DistributedServer
    from hps.train import _collective
    node = _RecordingOneRankNode()
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps")))
    with pytest.raises(ValueError, match=r"^unknown codec 'zstd'"):
        _collective(node, lambda: DistributedServer(ps, node, sparse_rows="zstd"))
    assert node.exchanges == ["the ranks' initial rows"]
    ps.close()


def test_a_herald_step_whose_start_failed_is_refused_again_with_no_exchange(tmp_path):
    """A Herald step whose start failed (its rank given no examples to move) failed
    on every rank, told in its exchanges (Node.give_up), and stopped the servers.
    Started again (a later call of the step: gather, apply), it is refused as the
    stopped server, with no exchange: the peers, past the step, are in none of it."""
    from hps.distributed.herald import HeraldServer
    node = _RecordingOneRankNode()
    server = HeraldServer(hps.ParameterServer(hps.ParameterServerConfig(
        dim=4, path=str(tmp_path / "ps"), optimizer=hps.AdaGrad(lr=0.1), mem_budget="1MiB")), node, 20)
    batch = server.batch(server.prefetch(np.arange(1, 7, dtype=np.uint64).reshape(3, 2)))
    with pytest.raises(RuntimeError, match="was given no examples"):
        batch.partition()
    assert node.exchanges[-2:] == ["herald plan parts", "herald examples (keys) (given up)"]
    node.exchanges.clear()
    with pytest.raises(RuntimeError, match=r"stopped after a failed batch \(RuntimeError: rank 0's Herald step was "
                                           r"given no examples"):
        batch.partition()
    assert node.exchanges == []
    batch.abort()
    server.close()


def _push_by(server, how: str, keys: np.ndarray, grads: np.ndarray) -> None:
    """grads to keys through `server`: its push ("push"), or a batch's ("batch":
    prefetch, batch, push, finish, the prefetch released whatever happens)."""
    if how == "push":
        server.push(keys, grads)
        return
    pre = server.prefetch(keys)
    batch = server.batch(pre)
    batch.push(keys, grads)
    try:
        batch.finish()
    finally:
        pre.release()


class _TwinRanksNode:
    """hps.distributed's Node for a job of 2 ranks without MPI, seen from rank 0,
    whose peer does what it does with keys that rank 0 owns: rank 1 sends rank 0
    the keys, positions and gradients rank 0 sends itself, and, owning none of the
    keys, no rows."""
    rank, size, nodes = 0, 2, 1

    def alltoallv(self, stage, blocks, kind, what, tell=0, heard=None):
        if heard is not None:
            heard[:] = tell
        if kind == "sparse_rows":
            return [blocks[0].copy(), np.empty(0, np.uint8)]
        assert len(blocks[1]) == 0, f"{what}: a key of rank 1's"
        return [blocks[0].copy(), blocks[0].copy()]

    def allgather(self, stage, obj, what, note=None):
        return [obj, obj]

    def give_up(self, stage, what, failed):
        raise failed  # (its peer, doing what it does, fails alike)

    def confirm(self, stage, what, failed=None):
        if failed is not None:
            raise failed


def _keys_of_rank_0(n: int, world: int) -> np.ndarray:
    from hps.distributed.sparse import owner_ranks
    keys = np.arange(1, 64, dtype=np.uint64)
    return keys[owner_ranks(keys, world) == 0][:n]


@pytest.mark.parametrize("node,how", [("one", "push"), ("twin", "push"), ("twin", "batch")])
def test_a_sparse_gradient_sum_that_overflows_at_the_owner_is_refused_naming_the_key(tmp_path, node, how):
    """Finite gradients of one key, 2e38 each, that meet at its owner (twice in one
    push on one rank, or from two ranks) sum to an infinity there: each rank's check
    let them by, and the owner stepped the row to -inf (then NaN), which every later
    pull and checkpoint held. The owner refuses the sum now, naming the key, before
    any row changes, and leaves nothing pinned: the ranks' bounds on their gradients
    let it overflow, so the owner sums and checks its keys before any owner steps."""
    from hps.distributed.sparse import DistributedServer
    cfg = hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), optimizer=hps.SGD(lr=0.5), seed=3,
                                    mem_budget="1MiB")
    world = 1 if node == "one" else 2
    server = DistributedServer(hps.ParameterServer(cfg), _OneRankNode() if node == "one" else _TwinRanksNode())
    fine, big = _keys_of_rank_0(2, world)
    keys = np.array([fine, big] + ([big] if node == "one" else []), np.uint64)
    before = server.local.pull(np.array([fine, big], np.uint64))
    grads = np.ones((len(keys), 4), np.float32)
    grads[1:] = 2e38
    with pytest.raises(hps.errors.DivergedError, match=rf"push gradients: 4 values of the sums of 1 key \(key {big} "
                                                       rf"first: inf\) at their owner, rank 0, overflow float32: "
                                                       rf"training diverged"):
        _push_by(server, how, keys, grads)
    np.testing.assert_array_equal(server.local.pull(np.array([fine, big], np.uint64)), before)
    assert server.local.stats()["mem"]["pinned"] == 0
    server.close()


@pytest.mark.parametrize("how", ["push", "batch"])
def test_a_sparse_step_whose_sums_may_overflow_and_do_not_steps_as_one_server(tmp_path, how):
    """Gradients of 1e38 from two ranks let a key's sum overflow as far as their
    bounds tell (past a quarter of float32's largest value): the owner sums and
    checks its keys before it steps, and, the sums finite (2e38), steps them as one
    server given every rank's pairs does."""
    from hps.distributed.sparse import DistributedServer
    cfg = hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), optimizer=hps.SGD(lr=0.5), seed=3,
                                    mem_budget="1MiB")
    server = DistributedServer(hps.ParameterServer(cfg), _TwinRanksNode())
    ref = hps.ParameterServer(dataclasses.replace(cfg, path=str(tmp_path / "reference")))
    keys = _keys_of_rank_0(3, 2)
    grads = np.ones((len(keys), 4), np.float32)
    grads[1] = 1e38
    _push_by(server, how, keys, grads)
    ref.push(np.concatenate([keys, keys]), np.concatenate([grads, grads]))  # (rank 1 pushes what rank 0 does)
    got = server.local.pull(keys)
    assert np.isfinite(got).all() and got[1, 0] < -9e37, got
    np.testing.assert_array_equal(got, ref.pull(keys))
    server.close()
    ref.close()


class _LosesItsPeer(_OneRankNode):
    """A one-rank node whose exchange `what` fails (a peer gone)."""

    def __init__(self, what: str):
        self.failing = what

    def alltoallv(self, stage, blocks, kind, what, **told):
        if what == self.failing:
            raise ConnectionError(f"{what}: rank 1 is gone")
        return super().alltoallv(stage, blocks, kind, what, **told)


def _failing_release(obj, name: str):
    """obj.name() releases, then raises (an unpin of a key something else unpinned)."""
    real = getattr(obj, name)

    def released():
        real()
        raise RuntimeError("a key was unpinned by something else")
    setattr(obj, name, released)


@pytest.mark.parametrize("exchange", ["load rows", "push gradients"])
def test_a_rank_batch_whose_abort_fails_after_its_exchange_failed_raises_the_exchange_s_error(tmp_path, capfd,
                                                                                            monkeypatch, exchange):
    """A rank's batch aborts its owner's batch when an exchange fails (the load's
    rows, apply's gradients); an abort that failed too (an unpin of a key something
    else unpinned) took the place of the exchange's error, so the job said a key was
    unpinned, not that a peer was gone. The exchange's error stands now, and the
    abort's goes to stderr."""
    from hps.distributed.sparse import DistributedServer
    cfg = hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), optimizer=hps.SGD(lr=0.5), mem_budget="1MiB")
    server = DistributedServer(hps.ParameterServer(cfg), _LosesItsPeer(exchange))
    made = server.local.batch

    def batch(*args, **kw):
        b = made(*args, **kw)
        _failing_release(b, "abort")
        return b
    monkeypatch.setattr(server.local, "batch", batch)
    keys = np.array([3, 4], np.uint64)
    pre = server.prefetch(keys)
    with pytest.raises(ConnectionError, match=f"{exchange}: rank 1 is gone"):
        b = server.batch(pre)
        b.push(keys, np.ones((2, 4), np.float32))
        b.apply()
    assert "a key was unpinned by something else" in capfd.readouterr().err
    pre.release()
    assert server.local.stats()["mem"]["pinned"] == 0
    server.close()


def test_a_herald_step_whose_release_fails_after_its_schedule_failed_raises_the_schedule_s_error(tmp_path, capfd,
                                                                                                 monkeypatch):
    """A Herald step whose schedule fails releases its pins and stops the server; a
    release that failed too took the place of the schedule's error and left the
    server running, though the leader's tables may have taken the step. The
    schedule's error stands now, the server stops for it, and the release's error
    goes to stderr."""
    from hps.distributed.herald import HeraldServer
    cfg = hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), optimizer=hps.AdaGrad(lr=0.1),
                                    mem_budget="1MiB")
    server = HeraldServer(hps.ParameterServer(cfg), _OneRankNode(), capacity=64)
    pre = server.prefetch(np.arange(1, 9, dtype=np.uint64).reshape(4, 2))

    def schedule(pre):
        raise MemoryError("the leader's plan")
    monkeypatch.setattr(server, "_schedule", schedule)
    _failing_release(pre, "release")
    with pytest.raises(MemoryError, match="the leader's plan"):
        server.batch(pre)
    assert "a key was unpinned by something else" in capfd.readouterr().err
    with pytest.raises(RuntimeError, match=r"stopped after a failed batch \(MemoryError while a step was scheduled"):
        server.check()
    assert server.local.stats()["mem"]["pinned"] == 0
    server.close()


class _FlushLosesItsPeer(_OneRankNode):
    """A one-rank node whose exchange of a flush's keys fails (a peer gone)."""

    def alltoallv(self, stage, blocks, kind, what):
        if what == "flush trained keys":
            raise ConnectionError(f"{what}: rank 1 is gone")
        return super().alltoallv(stage, blocks, kind, what)


def test_a_herald_flush_whose_bits_fail_to_return_after_its_exchange_failed_raises_the_exchange_s_error(
        tmp_path, capfd):
    """A Herald flush whose exchange fails gives the rows it took their trained bits
    back; a call that failed there too took the place of the exchange's error. The
    exchange's error stands now, and the other goes to stderr."""
    from hps.distributed.herald import HeraldServer

    class BitsFail:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return getattr(self._real, name)

        def set_trained(self, *args):
            self._real.set_trained(*args)
            raise RuntimeError("the tier's bits could not be set")
    cfg = hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), optimizer=hps.AdaGrad(lr=0.1),
                                    mem_budget="1MiB")
    server = HeraldServer(hps.ParameterServer(cfg), _FlushLosesItsPeer(), capacity=64)
    server._tier = BitsFail(server._tier)
    server._dirty = True
    with pytest.raises(ConnectionError, match="flush trained keys: rank 1 is gone"):
        server.flush()
    assert "the tier's bits could not be set" in capfd.readouterr().err
    server.close()


def test_a_dense_gradient_sum_that_overflows_is_refused_before_the_gradients_change():
    """The all-reduce sums the ranks' dense gradients: finite ones (2e38 on each of
    two ranks) can sum to an infinity, which the optimizer then stepped every
    rank's parameters with. Every rank holds the same sum and refuses it now, alike,
    naming the parameter, before any gradient is written; so does k-step Adam's
    merge of the parameters and their v."""
    import torch
    from hps.distributed import DenseSync
    w = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2, 2))
    w.grad = torch.ones(3)
    b.grad = torch.tensor([[1.0, 2e38], [3e38, 1.0]])
    sync = DenseSync(_TwoEqualRanks("allreduce"), [w, b], lr=0.1)
    with pytest.raises(hps.errors.DivergedError,
                       match=r"^dense gradient all-reduce: 2 non-finite values summed over the ranks \(dense "
                             r"parameter 1 of 2, shape \(2, 2\), first: inf\): training diverged"), \
            np.errstate(over="ignore"):  # (the fake all-reduce's numpy sum; MPI's says nothing)
        sync.reduce_gradients()
    assert torch.equal(w.grad, torch.ones(3)) and torch.equal(b.grad, torch.tensor([[1.0, 2e38], [3e38, 1.0]]))

    sync = DenseSync(_TwoEqualRanks("kstep"), [w, b], lr=0.1)
    sync.make_optimizer(None)
    with torch.no_grad():
        w.fill_(3e38)
    with pytest.raises(hps.errors.DivergedError, match=r"^k-step Adam merge: 3 non-finite values summed over the "
                                                       r"ranks \(dense parameter 0 of 2, shape \(3,\), first: inf\)"), \
            np.errstate(over="ignore"):
        sync.merge()
    assert torch.equal(w.detach(), torch.full((3,), 3e38)) and sync.merges == 0


def test_an_aborted_job_of_the_suite_leaves_no_topology_file_in_tmp(tmp_path):
    """Each job the suite aborted left MPICH's /tmp/hydra_hwloc_xmlfile_* (a mkstemp name) behind
    (hydra removes it only on a clean exit). tests/conftest.py gives mpiexec an
    HWLOC_XMLFILE, in whose presence hydra writes none: the ranks of an aborted job
    see that one, not a file of hydra's."""
    # Rank 0 writes what it sees to a file before it aborts: printed, the line could be
    # lost with the job (hydra forwards a rank's output, and an abort may end it first).
    seen_file = tmp_path / "seen"
    p = mpirun(2, sys.executable, "-c", "import os, sys, time; from mpi4py import MPI\n"
               "if MPI.COMM_WORLD.rank == 0:\n"
               "    with open(sys.argv[1], 'w') as f: f.write(os.environ.get('HWLOC_XMLFILE', ''))\n"
               "    MPI.COMM_WORLD.Abort(3)\n"
               "time.sleep(60)", str(seen_file), check=False, timeout=120)
    assert p.returncode != 0
    seen = seen_file.read_text()
    assert seen == os.environ.get("HWLOC_XMLFILE") and not seen.startswith("/tmp/hydra"), (p.stdout, p.stderr[-3000:])


# ---------------------------------------------------------------- `mpiexec hps train`, checkpoint and resume

TOML = """
hidden = [16]
dense_lr = 0.01
torch_threads = 1  # not tuned: runs compared to each other must sum in the same order
checkpoint_every = {every}

[ps]
dim = 8
path = "{path}"
mem_budget = "1MiB"

[ps.optimizer]
kind = "adagrad"
lr = 0.05

[data]
batch_size = 256
train_examples = {examples}
eval_examples = 1024
vocab_sizes = {vocab}

[distributed]
dense_sync = "{sync}"
k = 4  # divides the checkpoint interval and the first run: no extra merge at its end
timeout = 120
"""


VOCAB = [100, 1000, 5000, 20] * 6 + [50, 50]


def _hps_train(n: int, config, *flags, check: bool = True):
    return mpirun(n, sys.executable, "-m", "hps.cli", "train", "--config", config, "--no-progress", *flags,
                  check=check)


def _write_config(tmp_path, name, path, examples, every=0, sync="kstep"):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(TOML.format(path=path, examples=examples, every=every, sync=sync, vocab=VOCAB))
    return cfg


def test_the_herald_example_runs_unchanged_under_mpiexec(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = mpirun(2, sys.executable, "-m", "hps.cli", "train", "--config", os.path.join(root, "examples", "herald.toml"),
                  "--path", str(tmp_path / "job"), "--examples", "8192", "--eval-examples", "2048",
                  "--batch-size", "1024", "--no-progress")
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < line["final"]["auc"] < 1 and line["herald"]["batches"] == 4  # 4 global steps of 2 x 1024
    assert line["herald"]["examples_sent"] + line["herald"]["examples_kept"] > 0
    assert "herald: examples moved" in done.stderr and "examples and plans" in done.stderr
    assert "herald" in (tmp_path / "job" / "rank1" / "train-summary.json").read_text()


def test_hps_train_under_mpiexec_resumes_to_the_same_parameters(tmp_path, capsys):
    import torch
    # The synthetic stream goes to the ranks in blocks of 4096 examples.
    straight = _write_config(tmp_path, "straight", tmp_path / "straight", 32768)
    p = _hps_train(2, straight)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["final"]["examples"] == 32768 and 0.5 < out["final"]["auc"] <= 1.0
    assert "ranks (nodes)" in p.stderr and "2 (1), dense sync kstep, k = 4" in p.stderr

    first = _write_config(tmp_path, "first", tmp_path / "resumed", 16384, every=8)
    _hps_train(2, first)
    job = json.loads((tmp_path / "resumed" / "job.json").read_text())
    run = job.pop("run")  # the run's id (docs/serving.md): a resumed job keeps it
    assert job == {"world": 2, "step": 32, "checkpoint": 5}  # batches 8, 16, 24, 32, and the end
    second = _write_config(tmp_path, "second", tmp_path / "resumed", 32768, every=8)
    _hps_train(2, second, "--resume")
    assert json.loads((tmp_path / "resumed" / "job.json").read_text())["run"] == run
    # Where the resumed process started, for its report's intervals: the job's examples
    # (rank 0's pipeline trained only its half of them).
    summary = json.loads((tmp_path / "resumed" / "rank0" / "train-summary.json").read_text())
    assert summary["started_at"] == {"examples": 16384, "batches": 32}
    assert summary["pipeline"]["examples"] == 8192

    from hps.data import SyntheticCriteo
    from hps.distributed import owner_ranks
    from hps.train import load_trainer_state
    keys = np.unique(np.concatenate([b.keys.ravel() for b in SyntheticCriteo(
        batch_size=256, examples=32768, vocab_sizes=VOCAB)]))
    for r in range(2):
        a = load_trainer_state(str(tmp_path / "straight" / f"rank{r}"))
        b = load_trainer_state(str(tmp_path / "resumed" / f"rank{r}"))
        assert a["batches_done"] == b["batches_done"] == 64
        for name in a["mlp"]:
            torch.testing.assert_close(b["mlp"][name], a["mlp"][name], rtol=1e-5, atol=1e-7)
        mine = keys[owner_ranks(keys, 2) == r]
        np.testing.assert_allclose(_ps_rows(str(tmp_path / "resumed" / f"rank{r}"), mine),
                                   _ps_rows(str(tmp_path / "straight" / f"rank{r}"), mine), rtol=1e-5, atol=1e-7)

    # One process reshards a job to itself (tests/test_reshard.py), but not a k-step job's:
    # its state is a rank's own, which one process has no optimizer for; nothing is written.
    from hps.cli import main
    before = sorted(p.name for p in (tmp_path / "resumed").iterdir())
    assert main(["train", "--config", str(second), "--resume", "--no-progress"]) == 2
    assert "dense_sync = 'kstep'), whose state (m a rank) one process has no optimizer for; resume it under " \
           "mpiexec" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == before
    # A new job refuses a used path.
    p = _hps_train(2, straight, check=False)
    assert p.returncode == 2 and "is not empty; pass --resume" in p.stderr


def test_hps_train_under_mpiexec_counts_every_ranks_skipped_lines(tmp_path):
    # train-summary.json's skipped_lines (and the table rank 0 prints) counted only the
    # reporting rank's files: a job whose rank 1 skipped lines said it skipped none.
    bad = {0: [3], 1: [2, 5, 6]}  # 1-based lines of each rank's file (files[rank::world])
    for r, lines in bad.items():
        rows = ["click,price,site"] + [f"{i % 2},{i},s{i % 5}" for i in range(64)]
        for ln in lines:
            rows[ln - 1] = "2,1,s1"  # a label that is not 0 or 1
        (tmp_path / f"part-{r}.csv").write_text("\n".join(rows) + "\n")
    config = tmp_path / "run.toml"
    config.write_text(f"""hidden = [4]
torch_threads = 1
[ps]
dim = 4
path = "{tmp_path / 'job'}"
mem_budget = "1MiB"
[data]
source = "{tmp_path / 'part-*.csv'}"
batch_size = 16
skip_malformed = true
[data.schema]
label = "click"
dense = ["price"]
categorical = ["site"]
[distributed]
timeout = 120
""")
    p = _hps_train(2, config)
    first = [f"{tmp_path / 'part-0.csv'}:3: column 'click': '2' is not 0 or 1",
             f"{tmp_path / 'part-1.csv'}:2: column 'click': '2' is not 0 or 1"]
    assert f"malformed lines skipped (train)  4; the first: {first[0]}" in p.stderr
    for r in range(2):
        summary = json.loads((tmp_path / "job" / f"rank{r}" / "train-summary.json").read_text())
        train = summary["skipped_lines"]["train"]
        assert (train["malformed"], train["ranks"]) == (4, [1, 3])
        assert train["malformed_examples"][:2] == first and len(train["malformed_examples"]) == 4


DAMAGED_JOBS = [("{", "not JSON"),
                ("[2, 1]", "not a job record (a JSON list, not an object)"),
                ('{"checkpoint": 1}', "no field 'world'"),
                ('{"world": "one", "checkpoint": null}', "field 'world' must be a number of ranks >= 1, got 'one'"),
                ('{"world": 2, "checkpoint": "1"}', "field 'checkpoint' must be a checkpoint number or null, got '1'")]


@pytest.mark.parametrize("schedule,record,named", [("sequential", *d) for d in DAMAGED_JOBS] +
                         [("herald", *d) for d in DAMAGED_JOBS[1::3]])  # (Herald's ranks check it alike: two)
def test_a_damaged_job_json_ends_the_job_naming_the_file_and_field(tmp_path, schedule, record, named):
    """A job of ranks resumed on a damaged job.json: rank 0 parsed it itself, so the
    job ended on json's message without the file, a bare TypeError (a list, a world
    "one") or KeyError, and a checkpoint "1" was taken as the one to roll back to.
    It now reads it with hps.jobdir.read_job_record: every rank exits 2 naming the
    file and the field, and nothing of the job is changed."""
    path = tmp_path / "job"
    for r in range(2):
        (path / f"rank{r}").mkdir(parents=True)
        (path / f"rank{r}" / "marker").write_text(f"rank {r}'s files")
    (path / "job.json").write_text(record)

    def files():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    before = files()
    cfg = _write_config(tmp_path, "damaged", path, 4096, every=8)
    if schedule == "herald":
        cfg.write_text(cfg.read_text().replace('mem_budget = "1MiB"', 'mem_budget = "1MiB"\nschedule = "herald"'))
    p = _hps_train(2, cfg, "--resume", check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"{path / 'job.json'}: {named}" in p.stderr, p.stderr[-3000:]
    assert files() == before


def test_a_rank_killed_in_the_middle_of_a_checkpoint_rolls_every_rank_back(tmp_path):
    """Rank 1 dies (SIGKILL) while making checkpoint 2, after rank 0 finished its
    own: job.json names checkpoint 1, the one every rank finished. --resume rolls
    both ranks back to it and ends with exactly the parameters of a run that was
    never interrupted."""
    from hps.train import load_trainer_state, stored_checkpoint
    steps, per_rank, every = 12, 48, 4
    common = ("--steps", steps, "--per-rank", per_rank, "--checkpoint-every", every)
    scenario(2, "train", tmp_path / "straight", *common)
    p = scenario(2, "train", tmp_path / "crash", *common, "--die-at-checkpoint", 2, check=False)
    assert p.returncode != 0
    job = json.loads((tmp_path / "crash" / "job" / "job.json").read_text())
    assert len(job.pop("run")) == 32 and job == {"world": 2, "step": every, "checkpoint": 1}
    assert stored_checkpoint(str(tmp_path / "crash" / "job" / "rank0")) == (True, 2)  # rank 0 was ahead
    assert stored_checkpoint(str(tmp_path / "crash" / "job" / "rank1")) == (True, 1)
    scenario(2, "train", tmp_path / "crash", *common, "--resume")
    keys = np.unique(np.concatenate([b.keys.ravel() for b in sc.global_batches(steps, per_rank, 2)]))
    for r in range(2):
        want = load_trainer_state(str(tmp_path / "straight" / "job" / f"rank{r}"))
        got = load_trainer_state(str(tmp_path / "crash" / "job" / f"rank{r}"))
        assert got["batches_done"] == want["batches_done"] == steps
        for name, value in want["mlp"].items():
            assert torch_equal(got["mlp"][name], value), (r, name)
        np.testing.assert_array_equal(_ps_rows(str(tmp_path / "crash" / "job" / f"rank{r}"), keys),
                                      _ps_rows(str(tmp_path / "straight" / "job" / f"rank{r}"), keys))
        assert os.listdir(tmp_path / "crash" / "job" / f"rank{r}" / "checkpoints") == \
            os.listdir(tmp_path / "straight" / "job" / f"rank{r}" / "checkpoints")


FAILED_BEFORE_FIRST_CHECKPOINT = ("--steps", 6, "--per-rank", 48, "--checkpoint-every", 4)


@pytest.fixture(scope="module")
def failed_before_first_checkpoint(tmp_path_factory):
    """The job whose rank 1's data fails at step 2, before its first checkpoint
    (step 4), made once for the module: each rerun of it works on a copy."""
    out = tmp_path_factory.mktemp("failed_before_first_checkpoint")
    p = scenario(2, "train", out, *FAILED_BEFORE_FIRST_CHECKPOINT, "--fail-at-step", 2, check=False)
    assert p.returncode != 0  # (MPI_Abort may cut the traceback short: its text is not checked)
    return out


@pytest.mark.parametrize("rerun", ["plain", "--resume"])
def test_a_job_that_failed_before_its_first_checkpoint_is_started_over(tmp_path, failed_before_first_checkpoint,
                                                                       rerun):
    """Rank 1's data fails at step 2, before the first checkpoint (step 4): the
    job ends, and the next run, --resume or not, starts it over from batch 0."""
    import shutil
    from hps.train import load_trainer_state
    common = FAILED_BEFORE_FIRST_CHECKPOINT
    shutil.copytree(failed_before_first_checkpoint, tmp_path, dirs_exist_ok=True)
    job = json.loads((tmp_path / "job" / "job.json").read_text())
    failed = job.pop("run")
    assert job == {"world": 2, "step": 0, "checkpoint": None}
    p = scenario(2, "train", tmp_path, *common, *([rerun] if rerun != "plain" else []))
    assert "ended before its first checkpoint: starting it over from batch 0" in p.stderr, p.stderr[-2000:]
    for r in range(2):
        assert load_trainer_state(str(tmp_path / "job" / f"rank{r}"))["batches_done"] == 6
    if rerun == "plain":  # a new job.json, so a new run (--resume keeps the id of a run no export can have read)
        assert json.loads((tmp_path / "job" / "job.json").read_text())["run"] != failed


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)


# ---------------------------------------------------------------- configuration

def test_distributed_config_errors_name_the_field():
    from hps.train import TrainConfig
    base = {"ps": {"dim": 8, "path": "/tmp/unused"}}
    cfg = TrainConfig.from_dict({**base, "distributed": {"dense_sync": "kstep", "k": 50}})
    assert cfg.distributed.dense_sync == "kstep" and cfg.distributed.k == 50 and cfg.distributed.beta1 == 0.0
    with pytest.raises(ValueError, match=r"job.toml: unknown field\(s\) distributed.kk"):
        TrainConfig.from_dict({**base, "distributed": {"kk": 5}}, source="job.toml")
    with pytest.raises(ValueError, match="dense_sync must be 'allreduce' or 'kstep', got 'ring'"):
        TrainConfig.from_dict({**base, "distributed": {"dense_sync": "ring"}})
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        TrainConfig.from_dict({**base, "distributed": {"k": 0}})
    with pytest.raises(ValueError, match="timeout must be > 0"):
        TrainConfig.from_dict({**base, "distributed": {"timeout": 0}})
    # Values of the wrong type: each passed as something else (true as k = 1, "yes" as
    # true, 1.5 ranks a node) or failed in a comparison without naming the field.
    for field, value, message in [
            ("k", True, "k must be an int >= 1, got True"),
            ("hierarchical", "yes", "hierarchical must be true or false, got 'yes'"),
            ("ranks_per_node", 1.5, r"ranks_per_node must be an int >= 0 \(0: the ranks sharing a machine\), got 1.5"),
            ("timeout", "60", "timeout must be > 0 seconds, got '60'"),
            ("beta1", "0.9", r"beta1 and beta2 must be in \[0, 1\), got '0.9', 0.999"),
            ("eps", float("inf"), "eps must be a finite number > 0, got inf")]:
        with pytest.raises(ValueError, match=r"job.toml: \[distributed\]: " + message):
            TrainConfig.from_dict({**base, "distributed": {field: value}}, source="job.toml")


def test_only_a_launcher_with_several_ranks_makes_a_job(monkeypatch):
    from hps.distributed import launched_by_mpi
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_mpi()
    monkeypatch.setenv("PMI_SIZE", "1")
    assert not launched_by_mpi()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert launched_by_mpi()


def test_owner_ranks_spread_keys_independently_of_the_device_hash():
    from hps.data import mix64
    from hps.distributed import owner_ranks
    keys = mix64(np.arange(1, 200_001, dtype=np.uint64))
    ranks = owner_ranks(keys, 4)
    counts = np.bincount(ranks, minlength=4)
    assert counts.min() > 0.24 * len(keys)
    # Within one rank, the device tier's mix64(k) mod 2 still splits the keys evenly.
    devices = mix64(keys[ranks == 0]) % np.uint64(2)
    assert 0.48 < devices.mean() < 0.52


def run_toml(path, source: str, batch_size: int, schema: str = "") -> str:
    """An hps train config of the ranks' file tests: their job at `path`, [data]
    source and batch_size, and `schema` ([data.schema]'s lines) where given."""
    schema = f"\n[data.schema]\n{schema}" if schema else ""
    return f"""
hidden = [8]
dense_lr = 0.01
torch_threads = 1

[ps]
dim = 4
path = "{path}"
mem_budget = "1MiB"

[data]
source = "{source}"
batch_size = {batch_size}
{schema}
[distributed]
timeout = 60
"""


def test_ranks_that_list_different_data_files_are_refused_naming_one(tmp_path):
    """Each rank lists the data files itself and reads files[rank::world] of its list.
    Ranks whose lists differ (a relative glob in another working directory, a part
    written while the job started) read overlapping or missing shards: here rank 0
    listed p0, p1 and rank 1 p0, p1, p2, so rank 1 read p1 alone and p2 went unread,
    without a word. Every rank now refuses it before anything is written, naming a
    file one rank lists and another does not."""
    pytest.importorskip("torch", reason="hps train needs torch")
    gen = hps.data.SyntheticCriteo(seed=3, batch_size=64)
    for wdir, parts in (("a", 2), ("b", 3)):
        (tmp_path / wdir / "data").mkdir(parents=True)
        for i in range(parts):
            gen.write_tsv(str(tmp_path / wdir / "data" / f"p{i}.tsv"), 128)
    p = train_in_two_working_directories(tmp_path)
    said = ("the ranks list different data files (data.source = 'data/*.tsv'): data/p2.tsv is rank 1's file 3 "
            "of 3 and not among rank 0's 2")
    assert said in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "job").exists()


def train_in_two_working_directories(tmp_path, refused=True):
    """`hps train` of data/*.tsv under mpiexec, rank 0 in tmp_path/a and rank 1 in
    tmp_path/b, the job at tmp_path/job: the finished mpiexec, which must have failed
    (refused), or else succeeded."""
    cfg = tmp_path / "train.toml"
    cfg.write_text(run_toml(tmp_path / "job", "data/*.tsv", 64))
    train = [sys.executable, "-m", "hps.cli", "train", "--config", cfg, "--no-progress"]
    p = mpirun(1, "-wdir", tmp_path / "a", *train, ":", "-n", 1, "-wdir", tmp_path / "b", *train,
               check=not refused, timeout=200)
    if refused:
        assert p.returncode != 0, p.stderr[-3000:]
    return p


def test_ranks_whose_files_of_one_name_differ_are_refused_and_copies_train(tmp_path):
    """The ranks compared their lists of file names alone: a relative glob in two
    working directories gives the same names for different files (here rank 1's
    data/p1.tsv is another data set's part, of other rows), and each rank read its
    own share of its own files: the job trained on a mix of two data sets, without a
    word. Each local file's size is now compared too (a copy of the data, anywhere, is
    of the same size), and the ranks refuse, naming the file and both real paths; a
    copy of the data in the other working directory trains."""
    pytest.importorskip("torch", reason="hps train needs torch")
    for wdir, seed in (("a", 3), ("b", 4)):
        (tmp_path / wdir / "data").mkdir(parents=True)
        for i in range(2):
            hps.data.SyntheticCriteo(seed=3 if i == 0 else seed, batch_size=64).write_tsv(
                str(tmp_path / wdir / "data" / f"p{i}.tsv"), 128 if i == 0 or wdir == "a" else 96)
    p = train_in_two_working_directories(tmp_path)
    size = (tmp_path / "a" / "data" / "p1.tsv").stat().st_size
    said = (f"the ranks' data files differ (data.source = 'data/*.tsv'): data/p1.tsv is {size:,} bytes on rank 0 "
            f"({tmp_path / 'a' / 'data' / 'p1.tsv'}) and {(tmp_path / 'b' / 'data' / 'p1.tsv').stat().st_size:,} "
            f"bytes on rank 1 ({tmp_path / 'b' / 'data' / 'p1.tsv'})")
    assert said in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "job").exists()
    shutil.copy(tmp_path / "a" / "data" / "p1.tsv", tmp_path / "b" / "data" / "p1.tsv")
    train_in_two_working_directories(tmp_path, refused=False)
    assert json.loads((tmp_path / "job" / "rank0" / "train-summary.json").read_text())["examples"] == 256


@pytest.mark.parametrize("hierarchical", ["", "[hierarchical]\ngroup_ps = 1\n"], ids=["train", "hierarchical"])
def test_a_report_directory_one_rank_finds_inside_the_data_is_refused_on_every_rank(tmp_path, hierarchical):
    """`hps train --report DIR` checked DIR against the data directories on each rank
    before train(), on its own: a relative DIR that on rank 0's host (its working
    directory) leads into the data while on rank 1's it does not was refused by rank 0
    alone, and rank 1 waited for it in the job's first exchange for good (a
    hierarchical job's group PS too). The check is now one of the setup checks that
    every rank makes together: both refuse, naming the rank and the directory."""
    pytest.importorskip("torch", reason="hps train needs torch")
    gen = hps.data.SyntheticCriteo(seed=3, batch_size=64)
    (tmp_path / "data").mkdir()
    for i in range(2):
        gen.write_tsv(str(tmp_path / "data" / f"p{i}.tsv"), 128)
    for wdir in ("a", "b"):
        (tmp_path / wdir).mkdir()
    (tmp_path / "a" / "plots").symlink_to(tmp_path / "data" / "plots")  # rank 0's plots: inside the data
    cfg = tmp_path / "train.toml"
    cfg.write_text(run_toml(tmp_path / "job", tmp_path / "data", 64) + hierarchical)
    train = [sys.executable, "-m", "hps.cli", "train", "--config", cfg, "--no-progress", "--report", "plots"]
    p = mpirun(1, "-wdir", tmp_path / "a", *train, ":", "-n", 1, "-wdir", tmp_path / "b", *train,
               check=False, timeout=200)
    assert p.returncode != 0, p.stderr[-3000:]
    said = (f"hps train: rank 0: ValueError: --report plots is inside the data directory {tmp_path / 'data'} "
            f"(data.source), whose files are read at every depth: the report's plots would be read as data")
    assert p.stderr.count(said) == 2, p.stderr[-3000:]  # rank 0's word, said by both ranks
    assert not (tmp_path / "job").exists() and not (tmp_path / "data" / "plots").exists()


def test_where_the_file_lists_of_two_ranks_part():
    from hps.train import _where_lists_part
    assert _where_lists_part(["a", "b", "c"], ["a", "c"], 2) == "b is rank 0's file 2 of 3 and not among rank 2's 2"
    assert _where_lists_part(["a"], ["a", "c"], 1) == "c is rank 1's file 2 of 2 and not among rank 0's 1"
    assert _where_lists_part(["a", "b"], ["b", "a"], 1) == \
        "the same files in another order: file 1 is a on rank 0, b on rank 1"
    assert _where_lists_part(None, ["a"], 1) == "rank 0 reads no files, rank 1 files"


def test_ranks_whose_files_give_other_fields_are_refused_naming_both_files(tmp_path):
    """Each rank held its files to its own first file's fields, and the ranks compared
    only how many fields there are: rank 1's file with the columns of rank 0's in
    another order (site, os against os, site) trained its os values as field 0, which
    on rank 0 is the site, without a word. One process reading both files refuses the
    second; the ranks now do too, before anything is written."""
    pytest.importorskip("torch", reason="hps train needs torch")
    data = tmp_path / "data"
    data.mkdir()
    rows = "".join(f"{i % 2},{i},s{i % 5},o{i % 3}\n" for i in range(64))
    (data / "p0.csv").write_text("click,price,site,os\n" + rows)
    (data / "p1.csv").write_text("click,price,os,site\n" + rows)
    cfg = tmp_path / "train.toml"
    cfg.write_text(run_toml(tmp_path / "job", data, 16, 'label = "click"\ndense = ["price"]\ncategorical = "rest"\n'))
    p = mpirun(2, sys.executable, "-m", "hps.cli", "train", "--config", cfg, "--no-progress", check=False,
               timeout=200)
    assert p.returncode != 0, p.stderr[-3000:]
    said = (f"the ranks' data give other fields: rank 0's {data / 'p0.csv'} label 'click', dense ['price'], "
            f"categorical ['site', 'os'], multi-hot []; rank 1's {data / 'p1.csv'} label 'click', dense ['price'], "
            f"categorical ['os', 'site'], multi-hot []")
    assert said in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "job").exists()
