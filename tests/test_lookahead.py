"""Lookahead (issue 16): the pipeline hands each prefetch the keys of the next K
batches, the same windows pipelined or not; the caches keep those rows."""
import numpy as np
import pytest

import hps
from hps.parameter_server import ParameterServer, ParameterServerConfig
from hps.pipeline import Pipeline


# MEM-PS of 80 rows of 4 * 2 floats (AdaGrad at dim 4), charged 112 bytes each, and
# ROOM bytes more for the lookahead window (the rows the same with it or without).
ROOM = 64 << 10
EIGHTY_ROWS = {"mem_budget": 80 * (4 * 2 * 4 + 112) + ROOM, "lookahead_room": ROOM, "cache_policy": "lru"}


class Data:
    def __init__(self, i):
        self.keys = np.array([[i, 1000 + i]], np.uint64)
        self.labels = np.zeros(1, np.float32)


def windows(tmp_path, pipelined, k, n=9):
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / f"{pipelined}{k}"), mem_budget="1MiB",
                                               lookahead=k))
    seen = []
    real = ps.prefetch

    def prefetch(keys, upcoming=None):
        seen.append((int(keys[0, 0]), None if upcoming is None else [int(u[0, 0]) for u in upcoming]))
        return real(keys, upcoming=upcoming)

    ps.prefetch = prefetch
    Pipeline(ps, lambda loaded: None).run([Data(i) for i in range(n)], pipelined=pipelined)
    return seen


@pytest.mark.parametrize("k", [0, 1, 3, 7])  # 7: past the read queue's default depth, which grows to it
def test_each_prefetch_gets_the_next_k_batches_pipelined_or_not(tmp_path, k):
    expect = [(i, None if k == 0 else list(range(i + 1, min(i + 1 + k, 9)))) for i in range(9)]
    assert windows(tmp_path, False, k) == expect
    for _ in range(3):  # the reader's pace changes nothing
        assert windows(tmp_path, True, k) == expect


def test_lookahead_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"lookahead must be an int >= 0 \(batches\), got -1"):
        ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "a"), lookahead=-1))
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "b"), lookahead=65))
    with pytest.raises(ValueError, match=r"lookahead must be an int in \[0, 64\] \(batches\), got 65"):
        Pipeline(ps, lambda loaded: None)
    assert Pipeline(ps, lambda loaded: None, lookahead=64).depths == (64, 1, 1)  # the read queue holds the window
    assert Pipeline(ps, lambda loaded: None, lookahead=2).depths == (4, 1, 1)
    with pytest.raises(ValueError, match=r"lookahead must be an int in \[0, 2\] \(the read queue's depth\), got 3"):
        Pipeline(ps, lambda loaded: None, depths=(2, 1, 1), lookahead=3)
    with pytest.raises(TypeError, match=r"upcoming\[1\] must be an array of uint64 or int64, got float64"):
        ps.prefetch(np.array([1, 2], np.uint64), upcoming=[np.array([3], np.uint64), np.array([1.5])])


def test_hps_train_refuses_a_window_past_the_read_queue_before_it_makes_the_job(tmp_path):
    # The pipeline refused lookahead = 65, but only once the server was open: the job's
    # directory was left behind as a run "that ended before its first checkpoint".
    pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
    from hps.train import DataConfig, TrainConfig, train
    path = tmp_path / "ps"
    cfg = TrainConfig(ps=ParameterServerConfig(dim=4, path=str(path), mem_budget="1MiB", lookahead=65),
                      data=DataConfig(batch_size=64, train_examples=128, eval_examples=0), hidden=())
    with pytest.raises(ValueError, match=r"^\[ps\]: lookahead must be an int in \[0, 64\] \(batches\), got 65"):
        train(cfg, progress=False)
    assert not path.exists()


def looping(batches=24, n=16, keys=96, fields=2):
    """A loop over `keys` keys, a little more than the caches hold: without lookahead
    LRU evicts each row just before it comes back."""
    ring = np.arange(keys, dtype=np.uint64) * 11 + 5
    flat = np.concatenate([ring] * (batches * n * fields // keys + 1))[:batches * n * fields]
    return [flat[i * n * fields:(i + 1) * n * fields].reshape(n, fields) for i in range(batches)]


class Step:
    """A train step that reads its rows and pushes gradients that depend on them."""

    def __init__(self):
        self.n = 0

    def __call__(self, loaded):
        keys = loaded.data.keys
        for w, idx in enumerate(loaded.minibatches):
            if len(idx):
                k = keys[idx].reshape(-1)
                e = loaded.batch.pull(k, worker=w)
                loaded.batch.push(k, (0.3 * e + 0.02).astype(np.float32), worker=w)


class Keys:
    def __init__(self, keys):
        self.keys = keys
        self.labels = np.zeros(len(keys), np.float32)


def run_loop(tmp_path, name, k, pipelined=True, **cfg):
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / name), optimizer=hps.AdaGrad(lr=0.1),
                                               lookahead=k, **cfg))
    batches = looping()
    Pipeline(ps, Step()).run([Keys(b) for b in batches], pipelined=pipelined)
    rows = ps.pull(np.unique(np.concatenate([b.ravel() for b in batches])))
    return ps, rows


def test_mem_ps_keeps_the_coming_batches_rows(tmp_path):
    # MEM-PS of 80 rows (LRU) for a loop of 96 keys, 32 keys a batch.
    # Stage after stage: pipelined, when a write-back unpins a batch's rows races the next
    # prefetch's evictions, so which rows stay (not their values) changes run to run.
    cfg = EIGHTY_ROWS
    plain, rows0 = run_loop(tmp_path, "k0", 0, pipelined=False, **cfg)
    ahead, rows2 = run_loop(tmp_path, "k2", 2, pipelined=False, **cfg)
    np.testing.assert_array_equal(rows0, rows2)  # which rows stay in memory changes no value
    m0, m2 = plain.stats()["mem"], ahead.stats()["mem"]
    assert m2["misses"] < m0["misses"], (m0["misses"], m2["misses"])


def test_herald_caches_keep_the_coming_batches_rows(tmp_path):
    cfg = {"devices": 2, "schedule": "herald", "worker_cache_rows": 40, "mem_budget": "4MiB"}
    plain, rows0 = run_loop(tmp_path, "k0", 0, **cfg)
    ahead, rows2 = run_loop(tmp_path, "k2", 2, **cfg)
    np.testing.assert_allclose(rows0, rows2, rtol=1e-6, atol=1e-7)  # the same model, other partitions
    h0, h2 = plain.stats()["device"]["herald"], ahead.stats()["device"]["herald"]
    assert h2["ps_loads"] < h0["ps_loads"], (h0["ps_loads"], h2["ps_loads"])


@pytest.mark.parametrize("k", [3, 9])  # 9: a read queue grown past its default 4
@pytest.mark.parametrize("cfg", [EIGHTY_ROWS,
                                 {"devices": 2, "schedule": "herald", "worker_cache_rows": 40, "mem_budget": "4MiB"}])
def test_pipelined_run_equals_the_sequential_one_with_lookahead_on(tmp_path, cfg, k):
    batches = looping()
    rows = []
    for pipelined in (False, True):
        ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / str(pipelined)),
                                                   optimizer=hps.AdaGrad(lr=0.1), lookahead=k, **cfg))
        Pipeline(ps, Step()).run([Keys(b) for b in batches], pipelined=pipelined)
        rows.append(ps.pull(np.unique(np.concatenate([b.ravel() for b in batches]))))
    np.testing.assert_array_equal(rows[0], rows[1])


# ---- the window across the ranks of an MPI job (hps.distributed.sparse: WindowSender, OwnerWindows)

def u64(*keys):
    return np.array(keys, np.uint64)


BIG = 2**64 - 3  # past float64's 53 bits: a key cast through float64 on the way would change


class WindowCalls:
    """A MemCache's lookahead calls, kept batch by batch: the window they give."""

    def __init__(self):
        self.batches, self.calls = [], []

    def set_lookahead(self, keys):
        self.calls.append("set")
        self.batches = [keys.tolist()]

    def push_lookahead(self, keys):
        self.calls.append("push")
        self.batches.append(keys.tolist())

    def pop_lookahead(self):
        self.calls.append("pop")
        self.batches.pop(0)

    def slide_lookahead(self, keys):
        self.calls.append("slide")
        self.batches = self.batches[1:] + [keys.tolist()]

    def window(self) -> list:
        """The keys in the order of their first need (what evictions compare)."""
        return list(dict.fromkeys(k for b in self.batches for k in b))


def owner_window(windows: list, world: int = 1):
    """The window rank 0 of `world` keeps of ranks' windows, sent (set) once."""
    from hps.distributed.sparse import OwnerWindows, WindowSender
    owner, cache = OwnerWindows(len(windows)), WindowCalls()
    owner.update([WindowSender().blocks(w, world)[0] for w in windows])
    owner.apply(cache)
    return cache


def test_the_jobs_window_orders_keys_by_the_first_batch_any_rank_needs_them_in():
    """Each owner's MEM-PS evicts, of the rows in the window, the one needed latest:
    its window must follow the batches. 8: rank 0's batch 0 and rank 1's batch 3,
    so batch 0's place; BIG: the largest key, needed first, not last (sorted by value)."""
    from hps.distributed.sparse import WINDOW_SET, WindowSender
    rank0 = [u64(9, 8, 9), u64(2, 9), u64(), np.array([7], np.int64)]
    rank1 = [u64(BIG), u64(), u64(), u64(2, 1, 8)]
    # A window set anew: its kind, its batches' counts of distinct keys, then those keys.
    sent = WindowSender().blocks(rank0, 1)[0]
    assert sent.dtype == np.uint64 and sent.tolist() == [WINDOW_SET, 4, 2, 2, 0, 1, 8, 9, 2, 9, 7]
    want = [8, 9, BIG, 2, 1, 7]  # batch 0's keys ascending, batch 1's, batch 3's
    for ranks in ([rank0, rank1], [rank1, rank0]):
        cache = owner_window(ranks)
        assert cache.window() == want and cache.calls == ["set", "push", "push", "push"]
        assert cache.batches == [[8, 9, BIG], [2, 9], [], [1, 2, 7, 8]]


def test_an_empty_window_and_a_rank_with_no_coming_batch_add_nothing():
    assert owner_window([[], []]).batches == [[]]
    assert owner_window([[], [u64(), u64()]]).batches == [[], []]
    rank1 = [u64(5, 3), u64(1)]
    assert owner_window([[], rank1]).window() == [3, 5, 1]
    assert owner_window([[u64(), u64()], rank1, []]).window() == [3, 5, 1]


def test_a_shifted_window_sends_the_entering_batch_and_the_owner_slides():
    """The pipeline's windows, the same arrays shifted by one batch: a rank sends only
    the batch that enters, and the owner's MEM-PS slides (keeping 9, which leaves with
    batch 0 but is needed again in batch 1), to the window setting it anew gives. A
    rank that sets its window anew while the other slides has the owner set it anew
    from both; a batch entering a rank's shorter window lands inside the owner's, not
    at its end: set anew too."""
    from hps.distributed.sparse import WINDOW_SET, WINDOW_SLIDE, OwnerWindows, WindowSender
    a = [u64(9, 8), u64(2, 9), u64(4), u64(6, 9), u64(3)]
    b = [u64(BIG), u64(5), u64(4, 1), u64(8), u64(7)]
    senders, owner, cache = [WindowSender(), WindowSender()], OwnerWindows(2), WindowCalls()

    def move(windows: list) -> list:
        sent = [s.blocks(w, 1)[0] for s, w in zip(senders, windows)]
        owner.update(sent)
        owner.apply(cache)
        assert cache.batches == owner_window(windows).batches  # what setting it anew gives
        return sent

    move([a[0:3], b[0:3]])
    sent = move([a[1:4], b[1:4]])
    assert [m.tolist() for m in sent] == [[WINDOW_SLIDE, 1, 2, 6, 9], [WINDOW_SLIDE, 1, 1, 8]]
    assert cache.calls[-1] == "slide" and cache.window() == [2, 5, 9, 1, 4, 6, 8]
    move([a[2:5], b[2:5]])
    assert cache.calls[-1] == "slide"
    move([a[3:5], b[3:5]])  # the end of the data: nothing enters
    assert cache.calls[-1] == "pop"
    b3 = [u64(8), u64(7)]  # rank 1's arrays anew (the same keys): it sets, rank 0 slides
    sent = move([a[4:5], b3[1:]])
    assert sent[0].tolist() == [WINDOW_SLIDE, 0] and sent[1].tolist() == [WINDOW_SET, 1, 1, 7]
    assert cache.calls[-1] == "set"
    assert cache.calls.count("slide") == 2 and cache.calls.count("pop") == 1
    # Rank 1 sets a window of one batch; both slide, a batch entering each: rank 1's
    # is the owner's batch 1 of 2, not its last.
    c = [u64(1), u64(2), u64(3)]
    move([a[2:4], c[0:1]])
    move([a[3:5], c[1:2]])
    assert cache.calls[-2:] == ["set", "push"]
    assert cache.calls.count("slide") == 2


def test_the_leader_is_sent_every_key_and_the_owners_theirs():
    """Herald's leader gets every rank's whole batches (its scheduler takes the job's
    window as a set) and keeps in MEM-PS those it owns; the other owners get theirs."""
    from hps.distributed.sparse import OwnerWindows, WindowSender, owner_ranks, unpack_window
    world = 2
    batches = [u64(9, 4), u64(2, 11), u64(7, 4)]
    blocks = WindowSender().blocks(batches, world, whole=0)
    assert [k.tolist() for k in unpack_window(blocks[0], 0)[1]] == [[4, 9], [2, 11], [4, 7]]
    for r in range(world):
        owner, cache = OwnerWindows(1, (lambda k, r=r: owner_ranks(k, world) == r) if r == 0 else None), WindowCalls()
        owner.update([blocks[r]])
        owner.apply(cache)
        want = [sorted(int(k) for k in b if owner_ranks(u64(k), world)[0] == r) for b in batches]
        assert cache.batches == want, r
        assert owner.keys().tolist() == ([2, 4, 7, 9, 11] if r == 0 else sorted({k for b in want for k in b})), r


def test_window_errors_name_the_batch_and_the_rank():
    from hps.distributed.sparse import WINDOW_SLIDE, OwnerWindows, WindowSender, pack_window
    with pytest.raises(TypeError, match=r"upcoming\[1\] must be an array of uint64 or int64 keys, got float64"):
        WindowSender().blocks([u64(1), np.array([2.0])], 1)
    with pytest.raises(TypeError, match="upcoming must be a list of key arrays"):
        WindowSender().blocks(u64(1), 1)
    damaged = WindowSender().blocks([u64(1, 2)], 1)[0][:-1]  # its counts name a key it does not hold
    good = WindowSender().blocks([], 1)[0]
    with pytest.raises(RuntimeError, match="rank 1's lookahead window: 4 words do not match"):
        OwnerWindows(2).update([good, damaged])
    with pytest.raises(RuntimeError, match="rank 0's lookahead window"):
        OwnerWindows(1).update([u64()])
    with pytest.raises(RuntimeError, match="rank 0's lookahead window"):  # a slide carries one batch at most
        OwnerWindows(1).update([pack_window(WINDOW_SLIDE, [u64(1), u64(2)])])
    with pytest.raises(RuntimeError, match="rank 1's lookahead window slid from a window it never sent"):
        OwnerWindows(2).update([good, pack_window(WINDOW_SLIDE, [u64(1)])])


def test_an_owner_whose_window_call_raised_sets_the_next_one_anew():
    """A MemCache call that raised (a reserved key) leaves MEM-PS's window unknown:
    the next update sets it from the ranks' windows, even where every rank slid."""
    from hps.distributed.sparse import OwnerWindows, WindowSender

    class Refusing(WindowCalls):
        def slide_lookahead(self, keys):
            raise ValueError("refused")

    w = [u64(1), u64(2), u64(3), u64(4)]
    sender, owner, cache = WindowSender(), OwnerWindows(1), Refusing()
    owner.update([sender.blocks(w[0:2], 1)[0]])
    owner.apply(cache)
    owner.update([sender.blocks(w[1:3], 1)[0]])
    with pytest.raises(ValueError, match="refused"):
        owner.apply(cache)
    owner.update([sender.blocks(w[2:4], 1)[0]])
    owner.apply(cache)
    assert cache.calls[-2:] == ["set", "push"] and cache.batches == [[3], [4]]


class OneRank:
    """hps.distributed's Node for a job of one rank, without MPI: each exchange
    gives back what it was given, and is written down by name."""
    rank, size, nodes = 0, 1, 1

    def __init__(self):
        self.exchanges = []

    def alltoallv(self, stage, blocks, kind, what):
        self.exchanges.append(what)
        return [b.copy() for b in blocks]

    def allgather(self, stage, obj, what, note=None):
        self.exchanges.append(what)
        return [obj]

    def give_up(self, stage, what, failed):
        raise failed  # (no peer to tell)


@pytest.mark.parametrize("schedule", ["sequential", "herald"])
def test_an_mpi_prefetch_whose_window_passes_its_room_is_tried_again_without_an_exchange(tmp_path, schedule):
    """An owner's window past MEM-PS's lookahead_room raises CacheFullError, which
    the pipeline's prefetch waits out and tries again with the same keys, as when
    the pins find MEM-PS full. The first try's exchanges are done and the other
    ranks wait in the next one: the retry must run none. It ran the lookahead
    exchange again, which met the peers' key exchange (each took the other's
    keys for its own kind of message)."""
    from hps.distributed.sparse import DistributedServer
    from hps.mem_cache import CacheFullError
    cfg = ParameterServerConfig(dim=4, path=str(tmp_path / schedule), optimizer=hps.AdaGrad(lr=0.1),
                                mem_budget="1MiB", lookahead=1, lookahead_room="4KiB")
    node = OneRank()
    if schedule == "herald":
        from hps.distributed.herald import HeraldServer
        server = HeraldServer(ParameterServer(cfg), node, capacity=64)
        keys = np.arange(1, 9, dtype=np.uint64).reshape(4, 2)
    else:
        server = DistributedServer(ParameterServer(cfg), node)
        keys = np.arange(1, 9, dtype=np.uint64)
    setup = len(node.exchanges)
    upcoming = [np.arange(100, 20_100, dtype=np.uint64)]  # far past 4 KiB of window tables
    for attempt in range(2):
        with pytest.raises(CacheFullError):
            server.prefetch(keys, upcoming=upcoming)
        # Each exchange of the prefetch once, as the peers whose windows fit ran them.
        assert node.exchanges[setup:] == (["lookahead keys", "herald example keys", "herald keys to their owners"]
                                          if schedule == "herald" else ["lookahead keys", "prefetch keys"]), attempt
    server.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_prefetch_slides_the_mem_ps_window(tmp_path, pipelined):
    # Each prefetch after the first gets the last window shifted by one batch (the
    # same arrays), so MEM-PS's window slides (or, at the end, drops its first batch)
    # instead of being set anew.
    ps, _ = run_loop(tmp_path, str(pipelined), 3, pipelined=pipelined, **EIGHTY_ROWS)
    assert ps.stats()["mem"]["lookahead_slides"] == len(looping()) - 1


def test_prefetch_sets_the_window_unless_it_is_the_last_one_shifted(tmp_path):
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "a"), mem_budget="1MiB",
                                               lookahead_room="64KiB"))  # (lookahead = 0: "auto" gives none)
    a, b, c = (np.array([[i, 100 + i]], np.uint64) for i in range(3))

    def prefetch(upcoming):
        ps.prefetch(np.array([[7, 8]], np.uint64), upcoming=upcoming).release()
        m = ps.stats()["mem"]
        return m["lookahead_slides"], m["lookahead_keys"]

    assert prefetch([a, b]) == (0, 4)  # set
    assert prefetch([b, c]) == (1, 4)  # slid: a out, c in
    assert prefetch([b, c]) == (1, 4)  # the same window (a prefetch tried again)
    assert prefetch([c.copy(), a]) == (1, 4)  # another array where c was: set anew
    assert prefetch([a]) == (2, 2)     # the end of the data: the first batch out
    assert prefetch([]) == (3, 0)
    assert prefetch([a, b, c]) == (3, 6)
    assert prefetch([c, a]) == (3, 4)  # not the last window shifted: set
    assert prefetch([a, b]) == (4, 4)
    with pytest.raises(ValueError, match="0xffffffffffffffff"):
        prefetch([b, np.array([hps.EMPTY_KEY], np.uint64)])
    assert prefetch([b, c]) == (5, 4), "a refused slide left the window as it was"


@pytest.mark.parametrize("room", ["auto", "64KiB"])
def test_mem_ps_with_lookahead_stays_within_its_budget(tmp_path, room):
    # The window's memory (tables, entries, what forced evictions list) is a share of
    # mem_budget: the rows get the rest, and the window never holds more than its share.
    budget = 256 << 10
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / room), optimizer=hps.AdaGrad(lr=0.1),
                                               mem_budget=budget, lookahead=3, lookahead_room=room,
                                               cache_policy="lru"))
    held = []
    real = ps.prefetch

    def prefetch(keys, upcoming=None):
        pre = real(keys, upcoming=upcoming)
        held.append(ps.stats()["mem"]["lookahead_bytes"])
        return pre

    ps.prefetch = prefetch
    # A loop over more keys than the rows: evictions meet the window.
    m = ps.stats()["mem"]
    batches = looping(batches=4 * m["capacity"] // 32, keys=m["capacity"] + 48)
    Pipeline(ps, Step()).run([Keys(b) for b in batches], pipelined=False)
    m = ps.stats()["mem"]
    row_charge = 4 * 2 * 4 + 112  # the row (AdaGrad at dim 4) and its bookkeeping (capacity_for_budget)
    assert m["lookahead_room"] > 0
    assert m["capacity"] * row_charge + m["lookahead_room"] <= budget
    assert 0 < max(held) <= m["lookahead_room"], (held, m["lookahead_room"])
    assert m["lookahead_forced"] + m["lookahead_spared"] > 0  # the window met evictions


def test_lookahead_room_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"lookahead_room = '2MiB' is more than mem_budget = '1MiB'"):
        ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "a"), mem_budget="1MiB",
                                              lookahead_room="2MiB"))
    with pytest.raises(ValueError, match=r"lookahead_room"):
        ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "b"), lookahead_room="lots"))
    # No room (lookahead = 0, "auto"): a window is refused, naming what it needs and the room.
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "c"), mem_budget="1MiB"))
    with pytest.raises(hps.CacheFullError, match=r"more than its room of 0 bytes"):
        ps.prefetch(np.array([[7, 8]], np.uint64), upcoming=[np.array([[1, 2]], np.uint64)])
    assert ps.stats()["mem"]["lookahead_bytes"] == 0


def train_config(path, budget, lookahead=2, room="auto", dim=4, **data):
    from hps.train import DataConfig, TrainConfig
    return TrainConfig(ps=ParameterServerConfig(dim=dim, path=str(path), mem_budget=budget, lookahead=lookahead,
                                                lookahead_room=room),
                       data=DataConfig(**{"batch_size": 256, "train_examples": 1536, "eval_examples": 0, **data}),
                       hidden=())


def test_hps_train_sizes_the_window_room_for_its_batches(tmp_path, monkeypatch):
    # 256 examples of 26 keys a batch, mostly distinct (large vocabularies), 4 batches
    # ahead: a window of some 1.8 MB, past the room "auto" gave a server alone (a 16th of
    # the budget and the whole-shard lists' room, 1.4 MB), so the run's first full
    # window raised CacheFullError. hps train sizes the room for its batches instead.
    pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
    from hps.train import train, window_batch_keys
    held = []
    real = ParameterServer.prefetch

    def prefetch(self, keys, upcoming=None):
        pre = real(self, keys, upcoming=upcoming)
        held.append((self.stats()["mem"]["lookahead_bytes"], self.stats()["mem"]["lookahead_room"]))
        return pre

    monkeypatch.setattr(ParameterServer, "prefetch", prefetch)
    budget = 12 << 20
    cfg = train_config(tmp_path / "ps", budget, lookahead=4, dim=64, train_examples=256 * 7,
                       vocab_sizes=[1 << 24] * 26)
    assert window_batch_keys(cfg, (13, 26, 0)) == (256 * 26, True)
    summary = train(cfg, progress=False)
    mem = summary["ps"]["mem"]
    room = mem["lookahead_room"]
    assert budget // 16 < room < budget
    from hps.parameter_server import mem_lookahead_room
    assert max(b for b, _ in held) > mem_lookahead_room(cfg.ps, 64 * 2 * 4)  # past a server's "auto" alone
    assert max(b for b, _ in held) <= room and {r for _, r in held} == {room}
    assert mem["lookahead_slides"] > 0  # the window slid along the run, within its room
    assert mem["capacity"] == hps.MemCache.capacity_for_budget(budget - room, 64 * 2 * 4)


def test_hps_train_refuses_a_window_room_the_budget_cannot_hold_before_it_makes_the_job(tmp_path):
    pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
    from hps.train import train
    path = tmp_path / "ps"
    with pytest.raises(ValueError, match=r"^\[ps\]: lookahead = 2 keeps a window of 2 batches of up to 6,656 keys; "
                                         r"lookahead_room = 'auto' sizes its room at [\d,]+ bytes, more than "
                                         r"mem_budget = 1048576 \(1,048,576 bytes\): raise mem_budget"):
        train(train_config(path, 1 << 20), progress=False)
    assert not path.exists()
    # A room that fits but leaves no row: refused too, naming it.
    from hps.train import check_lookahead_room
    cfg = train_config(path, 1 << 20, room=(1 << 20) - 100)  # less than a row is left (32 bytes, 112 of bookkeeping)
    with pytest.raises(ValueError, match=r"lookahead_room = 1048476 is 1,048,476 bytes, which leaves mem_budget = "
                                         r"1048576 \(1,048,576 bytes\) no MEM-PS row"):
        check_lookahead_room(cfg, (256 * 26, True))
    with pytest.raises(ValueError, match=r"no MEM-PS row"):
        train(cfg, progress=False)
    assert not path.exists()
    # An explicit room is the user's: kept as given (the config's check bounds it by the budget).
    cfg = train_config(path, 1 << 20, room="64KiB")
    assert check_lookahead_room(cfg, (256 * 26, True)) == 64 << 10


def test_a_window_of_bags_of_no_fixed_length_keeps_at_least_the_budgets_16th(tmp_path):
    from hps.train import lookahead_room, window_batch_keys
    from hps.parameter_server import mem_lookahead_room
    cfg = train_config(tmp_path / "ps", 64 << 20, multi_hot=[[1000, 3.0]])
    assert window_batch_keys(cfg, (13, 26, 1)) == (256 * 26, False)  # Poisson bags: no bound
    sixteenth = mem_lookahead_room(cfg.ps, 32)
    assert lookahead_room(cfg, window_batch_keys(cfg, (13, 26, 1))) == sixteenth
    cfg.data.bag_length = "fixed"  # 3 keys a bag
    assert window_batch_keys(cfg, (13, 26, 1)) == (256 * 29, True)
    assert lookahead_room(cfg, (256 * 29, True)) == mem_lookahead_room(cfg.ps, 32, 256 * 29)
    assert window_batch_keys(cfg, (13, 26, 1), world=4) == (4 * 256 * 29, True)
