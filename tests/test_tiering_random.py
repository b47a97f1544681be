"""Which tier holds a row never changes what a pull returns: a parameter server
whose MEM-PS holds a handful of rows (so rows spill to SSD-PS every few calls,
come back from the write buffer and from SSD-PS, and SSD-PS compacts at each
checkpoint) against an in-memory table of the same optimizer given the same
steps, through random pushes, pulls, batches (overlapped too, with lookahead
windows), aborted batches and released prefetches, checkpoints, and closes and
reopens (at the last checkpoint or an earlier one kept). Not here: bounded
tables (their erase changes values by design: tests/test_bounded_tables.py)
and Herald's worker caches (tests/test_worker_caches.py has their own)."""
import tempfile

import hypothesis
import hypothesis.strategies as st
import numpy as np

import hps
from hps import _core
from hps.optim import native_optimizer
from test_parameter_server import batch_alongside  # tests/ is on pytest's sys.path

UNIVERSE = 48  # keys 0 .. UNIVERSE - 1, several times what MEM-PS holds
MOST_DISTINCT = 8  # distinct keys of a batch; two batches in flight pin at most twice that
OPTIMIZERS = {"sgd": lambda: hps.SGD(lr=0.3), "adagrad": lambda: hps.AdaGrad(lr=0.2),
              "rowwise_adagrad": lambda: hps.RowWiseAdaGrad(lr=0.2), "adam": lambda: hps.Adam(lr=0.05)}


ROOM = 64 << 10  # MEM-PS's lookahead room: the windows drawn take at most this


def budget_for(rows: int, row_bytes: int) -> int:
    """The smallest MEM-PS budget that holds `rows` rows (bookkeeping included)
    besides a lookahead room of ROOM bytes."""
    per_row = 1
    while _core.MemCache.capacity_for_budget(per_row, row_bytes) < 1:
        per_row += 1
    return rows * per_row + ROOM


class Reference:
    """The steps the server took, on an in-memory table of the same optimizer: a
    step is the per-key sum of its gradients (in the order given, as the server
    sums them), applied once. A reopen at checkpoint c keeps the steps before it."""

    def __init__(self, cfg: hps.ParameterServerConfig):
        self.cfg = cfg
        self.steps: list = []  # (distinct keys, summed gradients)
        self.at_checkpoint = {}  # checkpoint number -> steps it holds
        self.table = self._new_table()

    def _new_table(self) -> hps.EmbeddingTable:
        return hps.EmbeddingTable(4 * UNIVERSE, self.cfg.dim, optimizer=self.cfg.optimizer,
                                  initializer=self.cfg.initializer, seed=self.cfg.seed)

    def step(self, keys: np.ndarray, grads: np.ndarray) -> None:
        if len(keys) == 0:
            return
        distinct, at = np.unique(keys, return_inverse=True)
        summed = np.zeros((len(distinct), self.cfg.dim), np.float32)
        np.add.at(summed, at, grads)  # in order, float32, as the server adds them
        self.steps.append((distinct, summed))
        self.table.push(distinct, summed)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        return self.table.pull(keys)

    def checkpoint(self, number: int, keep_previous: bool) -> None:
        if not keep_previous:
            self.at_checkpoint.clear()
        self.at_checkpoint[number] = len(self.steps)

    def reopen(self, number) -> None:
        """The server opened at checkpoint `number` (None: none yet, empty)."""
        kept = 0 if number is None else self.at_checkpoint[number]
        self.steps = self.steps[:kept]
        self.at_checkpoint = {} if number is None else {number: kept}
        self.table = self._new_table()
        for keys, grads in self.steps:
            self.table.push(keys, grads)


class Run:
    """One random sequence of calls on a server and its reference."""

    def __init__(self, data, path: str):
        self.data = data
        self.rng = np.random.default_rng(self.draw(st.integers(0, 2**32 - 1), "seed"))
        self.dim = self.draw(st.sampled_from([1, 3, 4, 8]), "dim")
        opt = self.draw(st.sampled_from(sorted(OPTIMIZERS)), "optimizer")
        self.devices, in_place = self.draw(st.sampled_from([(1, True), (1, False), (2, False)]), "devices, in place")
        row_bytes = 4 * native_optimizer(self.dim, OPTIMIZERS[opt](), hps.Uniform(), 0).row_floats
        self.row_bytes = row_bytes
        self.cfg = hps.ParameterServerConfig(
            dim=self.dim, path=path, seed=5, optimizer=OPTIMIZERS[opt](),
            mem_budget=budget_for(2 * MOST_DISTINCT + self.draw(st.integers(0, 6), "spare rows"), row_bytes),
            cache_policy=self.draw(st.sampled_from(hps.mem_cache.POLICIES), "cache_policy"), lookahead_room=ROOM,
            devices=self.devices, host_in_place=in_place,
            write_buffer_rows=self.draw(st.sampled_from([1, 3, 16]), "write_buffer_rows"),
            ssd=hps.SsdOptions(file_records=self.draw(st.sampled_from([2, 4, 8]), "file_records"),
                               compaction_trigger=self.draw(st.sampled_from([1.0, 1.2, 1.5]), "compaction_trigger"),
                               use_io_uring=self.draw(st.booleans(), "io_uring"), direct_io=False))
        self.ps = hps.ParameterServer(self.cfg)
        self.ref = Reference(self.cfg)
        self.done = {"dirty_evictions": 0, "ssd_hits": 0, "pending_hits": 0, "compactions": 0, "reopens": 0,
                     "batches": 0, "overlapped": 0}

    def draw(self, strategy, label):
        return self.data.draw(strategy, label)

    def keys(self, label: str, most: int = 12) -> np.ndarray:
        """Up to `most` keys, repeats among them, of at most MOST_DISTINCT distinct ones."""
        pool = self.draw(st.lists(st.integers(0, UNIVERSE - 1), min_size=1, max_size=MOST_DISTINCT, unique=True),
                         label)
        return np.array(pool, np.uint64)[self.rng.integers(0, len(pool), int(self.rng.integers(1, most + 1)))]

    def grads(self, n: int) -> np.ndarray:
        return (self.rng.standard_normal((n, self.dim)) / 2).astype(np.float32)

    def check_pull(self, keys: np.ndarray, got: np.ndarray, what: str) -> None:
        np.testing.assert_array_equal(got, self.ref.pull(keys), err_msg=f"{what}: keys {keys.tolist()}")

    # ---------------------------------------------------------------- the calls
    def push(self) -> None:
        keys = self.keys("push keys")
        grads = self.grads(len(keys))
        self.ps.push(keys, grads, step=self.draw(st.booleans(), "push counts a step"))
        self.ref.step(keys, grads)

    def pull(self) -> None:
        keys = self.keys("pull keys", most=20)
        self.check_pull(keys, self.ps.pull(keys), "pull")

    def upcoming(self):
        if not self.draw(st.booleans(), "lookahead window"):
            return None
        return [self.keys("upcoming keys") for _ in range(self.draw(st.integers(0, 3), "window batches"))]

    def train(self, b, keys: np.ndarray, worker_gradients: list, what: str) -> None:
        """Random gathers and gradients of a batch's keys (by position or by key),
        before it applies; the gradients it got go to worker_gradients."""
        for _ in range(self.draw(st.integers(0, 3), f"{what} calls")):
            some = keys[self.rng.integers(0, len(keys), int(self.rng.integers(1, 2 * len(keys) + 1)))]
            worker = int(self.rng.integers(0, self.devices))
            by_positions = self.draw(st.booleans(), f"{what} by positions")
            if self.draw(st.booleans(), f"{what} gathers"):
                got = (b.gather(b.positions(some), worker=worker) if by_positions else b.pull(some, worker=worker))
                self.check_pull(some, got, f"{what}: a gather")
            else:
                grads = self.grads(len(some))
                if by_positions:
                    b.accumulate(b.positions(some), grads, worker=worker)
                else:
                    b.push(some, grads, worker=worker)
                worker_gradients.append((some, grads))

    def one_batch(self) -> None:
        keys = self.keys("batch keys")
        pre = self.ps.prefetch(keys, upcoming=self.upcoming())
        if self.draw(st.integers(0, 5), "released prefetch") == 0:
            pre.release()  # a prefetch that never becomes a batch
            return
        b = self.ps.batch(pre)
        pushed: list = []
        self.train(b, keys, pushed, "batch")
        if self.draw(st.integers(0, 5), "aborted") == 0:
            b.abort()  # its gradients are dropped
            return
        b.apply()
        self.step(pushed)
        b.write_back()
        self.done["batches"] += 1

    def overlapped_batches(self) -> None:
        """The pipeline's order: batch B is prefetched while A trains and loaded
        (overlap) once A applied, A written back before or after B trains (A made
        with overlap, as the pipeline makes every batch, or without)."""
        first, second = self.keys("first batch keys"), self.keys("second batch keys")
        a = self.ps.batch(self.ps.prefetch(first, upcoming=self.upcoming()),
                          overlap=self.draw(st.booleans(), "first made with overlap"))
        pushed_a: list = []
        self.train(a, first, pushed_a, "first batch")
        pre = self.ps.prefetch(second, upcoming=self.upcoming())
        a.apply()
        self.step(pushed_a)
        b = batch_alongside(self.ps, pre, a)
        a_written_first = self.draw(st.booleans(), "first written back before the second trains")
        if a_written_first:
            a.write_back()
        pushed_b: list = []
        self.train(b, second, pushed_b, "second batch")
        b.apply()
        self.step(pushed_b)
        if not a_written_first:
            a.write_back()
        b.write_back()
        self.done["overlapped"] += 1

    def step(self, pushed: list) -> None:
        if pushed:
            self.ref.step(np.concatenate([k for k, _ in pushed]), np.concatenate([g for _, g in pushed]))

    def checkpoint(self) -> None:
        keep = self.draw(st.booleans(), "keep previous")
        self.ref.checkpoint(self.ps.checkpoint(keep_previous=keep), keep)

    def reopen(self) -> None:
        self.count(self.ps.stats())
        self.ps.close()
        kept = sorted(self.ref.at_checkpoint)
        how = self.draw(st.sampled_from(["open", "construct", "earlier"]), "reopen")
        if how == "open":
            # Another budget and policy: what MEM-PS held and how it evicts change nothing stored.
            self.ps = hps.ParameterServer.open(
                self.cfg.path, mem_budget=budget_for(2 * MOST_DISTINCT + self.draw(st.integers(0, 6), "spare rows"),
                                                     self.row_bytes),
                cache_policy=self.draw(st.sampled_from(hps.mem_cache.POLICIES), "cache_policy"))
            number = kept[-1] if kept else None
        elif how == "construct" or not kept:
            self.ps = hps.ParameterServer(self.cfg)
            number = kept[-1] if kept else None
        else:
            number = self.draw(st.sampled_from(kept), "checkpoint reopened")
            self.ps = hps.ParameterServer(self.cfg, checkpoint=number)
        assert self.ps.checkpoint_number == number
        self.ref.reopen(number)
        self.done["reopens"] += 1
        probe = np.arange(UNIVERSE, dtype=np.uint64)
        self.check_pull(probe, self.ps.pull(probe), f"after a reopen at checkpoint {number}")

    def count(self, s: dict) -> None:
        self.done["dirty_evictions"] += s["mem"]["dirty_evictions"]
        self.done["ssd_hits"] += s["counts"]["ssd_hits"]
        self.done["pending_hits"] += s["counts"]["pending_hits"]
        self.ps._ssd.wait_for_compaction()
        self.done["compactions"] += self.ps._ssd.stats()["compactions"]

    def run(self) -> dict:
        calls = {"push": self.push, "pull": self.pull, "batch": self.one_batch,
                 "overlapped batches": self.overlapped_batches, "checkpoint": self.checkpoint,
                 "reopen": self.reopen}
        weights = ["push"] * 4 + ["pull"] * 3 + ["batch"] * 3 + ["overlapped batches"] * 2 + ["checkpoint"] * 2 \
            + ["reopen"]
        for _ in range(self.draw(st.integers(1, 40), "calls")):
            calls[self.draw(st.sampled_from(weights), "call")]()
        probe = np.arange(UNIVERSE, dtype=np.uint64)
        self.check_pull(probe, self.ps.pull(probe), "at the end")
        self.count(self.ps.stats())
        self.ps.close()
        return self.done


def test_random_calls_through_every_tier_pull_what_an_in_memory_table_holds():
    """Exact equality: the server and the table run the same native optimizer
    on the same sums, so any difference is a row lost, stale, or stepped twice
    on its way between the tiers. (The paths between the tiers are each taken in
    the built run below, whatever Hypothesis draws.)"""

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[hypothesis.HealthCheck.too_slow,
                                                hypothesis.HealthCheck.data_too_large])
    @hypothesis.given(st.data())
    def check(data):
        with tempfile.TemporaryDirectory() as path:
            Run(data, path + "/ps").run()

    check()


class Scripted:
    """Run's draws from a script instead of Hypothesis: script[label] lists the
    values drawn under that label one after another, its last one repeated."""

    def __init__(self, script: dict):
        self.script = {label: list(values) for label, values in script.items()}

    def draw(self, strategy, label):
        left = self.script[label]
        return left.pop(0) if len(left) > 1 else left[0]


def test_a_built_run_takes_every_path_between_the_tiers(tmp_path):
    """The random runs' check on a run built to take each path it is about, which
    Hypothesis's cases took or not by its draws (and which cases it draws depends
    on the process: tests/test_worker_caches.py's note): MEM-PS of 16 rows, and
    blocks of 8 new keys pushed, so rows are evicted dirty into a write buffer of
    16 rows (the pull of 0-7 after 24 keys finds some there) and go on to SSD-PS
    (the pull of 8-15 reads them back); checkpoints after keys rewritten compact
    files of 2 records (trigger 1.0); a batch and overlapped batches with
    lookahead windows; a reopen."""
    calls = ["push"] * 3 + ["pull"] + ["push"] * 2 + ["pull", "checkpoint", "push", "push", "checkpoint", "batch",
                                                      "overlapped batches", "reopen"]
    script = {
        "seed": [0], "dim": [4], "optimizer": ["adagrad"], "devices, in place": [(1, False)], "spare rows": [0],
        "cache_policy": ["lru"], "write_buffer_rows": [16], "file_records": [2], "compaction_trigger": [1.0],
        "io_uring": [False], "calls": [len(calls)], "call": calls,
        "push keys": [list(range(start, start + 8)) for start in (0, 8, 16, 24, 32, 0, 8)],
        "push counts a step": [True], "pull keys": [list(range(0, 8)), list(range(8, 16))], "keep previous": [False],
        "batch keys": [list(range(40, 48))], "first batch keys": [list(range(16, 24))],
        "second batch keys": [list(range(24, 32))], "lookahead window": [True], "window batches": [1],
        "upcoming keys": [list(range(32, 40))], "released prefetch": [1], "aborted": [1],
        # gathers and gradients, by position and by key
        "batch calls": [2], "batch by positions": [True, False], "batch gathers": [True, False],
        "first batch calls": [2], "first batch by positions": [False], "first batch gathers": [False],
        "second batch calls": [2], "second batch by positions": [True], "second batch gathers": [True, False],
        "first made with overlap": [True], "first written back before the second trains": [False],
        "reopen": ["open"]}
    done = Run(Scripted(script), str(tmp_path / "ps")).run()
    assert all(done.values()), done
