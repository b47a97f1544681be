"""Scenarios that tests/test_distributed.py runs under ``mpiexec -n N``.

    mpiexec -n N python tests/mpi_scenarios.py SCENARIO OUT_DIR [options]

Each rank writes what it saw to OUT_DIR/rank<r>.npz (or .json); the test compares
that with a single-process reference. The inputs are made by functions here that
the test imports too, so both sides see the same numbers.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np

DIM = 4


# ---------------------------------------------------------------- launching (the tests' side)

MPIEXEC = shutil.which("mpiexec")
SCRIPT = os.path.abspath(__file__)
# What a test that launches ranks needs: pytest.mark.skipif(not MPI_READY, reason=MPI_MISSING).
MPI_READY = MPIEXEC is not None and importlib.util.find_spec("mpi4py") is not None
MPI_MISSING = "needs mpi4py and mpiexec (pip install '.[mpi]')"


def mpirun(n: int, *args, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """``mpiexec -n n ARGS`` outside any MPI job this process may be in; with `check`,
    a nonzero exit raises with the tails of both streams."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.run([MPIEXEC, "-n", str(n), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"mpiexec -n {n} {' '.join(map(str, args))} exited {p.returncode}\n"
                             f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}")
    return p


def scenario(n: int, name: str, out, *args, **kw) -> subprocess.CompletedProcess:
    """Runs scenario `name` of this script on n ranks."""
    return mpirun(n, sys.executable, SCRIPT, name, out, *args, **kw)


# ---------------------------------------------------------------- shared inputs

def pullpush_round(rank: int, rnd: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys (with repeats, some shared between ranks) and gradients of one round:
    150 keys a rank, more than its MEM-PS budget holds."""
    rng = np.random.default_rng(1000 * rank + rnd)
    keys = rng.integers(1, 150 * world, size=40 + 7 * rank).astype(np.uint64)
    grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
    return keys, grads


def herald_example_keys(rank: int) -> np.ndarray:
    """A rank's example keys for one Herald prefetch: (n, 8) uint64; rank 1's have
    more than 65,536 distinct keys (their places among them need 4 bytes, not 2)."""
    rng = np.random.default_rng(60 + rank)
    n = 9000 if rank == 1 else 40 + 7 * rank
    return rng.integers(1, 10_000_000, size=(n, 8)).astype(np.uint64)


def herald_step_keys(rank: int, step: int) -> np.ndarray:
    """A rank's example keys (n, 3) of one step of the heraldpush scenario: about
    100 keys between the ranks, shared, more than a cache of 20 holds."""
    rng = np.random.default_rng(70 + 10 * step + rank)
    return rng.integers(1, 120, size=(10 + 3 * rank, 3)).astype(np.uint64)


def key_gradient(keys: np.ndarray) -> np.ndarray:
    """A gradient (n, DIM) for each of keys that depends on the key alone, so that a
    key's sum does not depend on which rank trains its examples."""
    k = np.asarray(keys, np.float64).reshape(-1, 1)
    return (0.5 * np.sin(k * np.arange(1, DIM + 1))).astype(np.float32)


#: MEM-PS's room for a lookahead window (ParameterServerConfig.lookahead_room),
#: on top of a scenario's budget for rows: a few batches' keys of these jobs.
WINDOW_ROOM = 1 << 20


def ps_config(path: str, optimizer: str = "adagrad", budget: str = "16KiB"):
    import hps
    opt = hps.AdaGrad(lr=0.1) if optimizer == "adagrad" else hps.Adam(lr=0.01)
    # A budget of a few dozen rows: pulls and pushes go through SSD-PS too. A
    # lookahead window's room comes on top of it, so the rows stay as many.
    return hps.ParameterServerConfig(dim=DIM, path=path, optimizer=opt, seed=3, write_buffer_rows=16,
                                    mem_budget=hps.config.parse_bytes(budget) + WINDOW_ROOM,
                                    lookahead_room=WINDOW_ROOM)


def global_batches(steps: int, per_rank: int, world: int, seed: int = 5, multi_hot: bool = False,
                   empty_bags_at: int = -1) -> list:
    """`steps` global batches of world * per_rank examples; rank r trains on rows
    [r * per_rank, (r + 1) * per_rank) of each. `multi_hot`: two multi-hot fields too;
    at step `empty_bags_at` the last rank's examples have no key in them."""
    import dataclasses
    from hps.data import Bags, SyntheticCriteo
    vocab = [50, 200, 1000, 30] * 6 + [100, 7]
    kw = {"multi_hot": [(300, 3.0), (40, 2.0)]} if multi_hot else {}
    batches = list(SyntheticCriteo(seed=seed, batch_size=per_rank * world, examples=steps * per_rank * world,
                                   vocab_sizes=vocab, **kw))
    if 0 <= empty_bags_at < steps:
        b, cut = batches[empty_bags_at], (world - 1) * per_rank
        head = [bags.rows(0, cut) for bags in b.bags]
        empty = [Bags(h.keys, np.concatenate([h.offsets, np.full(per_rank, h.offsets[-1])]), h.weights)
                 for h in head]
        batches[empty_bags_at] = dataclasses.replace(b, bags=tuple(empty))
    return batches


def rank_part(batch, rank: int, per_rank: int):
    return batch.rows(np.arange(rank * per_rank, (rank + 1) * per_rank))


def train_config(path: str, dense_sync: str = "allreduce", k: int = 1, hierarchical: bool = False,
                 ranks_per_node: int = 0, timeout: float = 60.0, pipelined: bool = True,
                 mem_budget: str = "256KiB"):
    import hps
    from hps.distributed import DistributedConfig
    from hps.train import DataConfig, TrainConfig
    return TrainConfig(
        ps=hps.ParameterServerConfig(dim=8, path=path, optimizer=hps.AdaGrad(lr=0.05), mem_budget=mem_budget,
                                     devices=2, seed=1),
        data=DataConfig(batch_size=64), hidden=(16,), dense_lr=0.01, pipelined=pipelined, torch_threads=1,
        distributed=DistributedConfig(dense_sync=dense_sync, k=k, hierarchical=hierarchical,
                                      ranks_per_node=ranks_per_node, timeout=timeout))


def admission_config(threshold: int):
    """[admission] with a sketch small enough (1 KiB) that keys share counters."""
    from hps.train import AdmissionConfig
    return AdmissionConfig(threshold=threshold, sketch_bytes="1KiB")


def kstep_gradient(rank: int, step: int, x: np.ndarray) -> np.ndarray:
    """A rank's gradient at x: of 0.5 |x - target_r|^2 plus rank- and step-dependent noise."""
    target = np.linspace(-1, 1, len(x)).astype(np.float32) * (rank + 1)
    noise = np.random.default_rng(97 * rank + step).standard_normal(len(x)).astype(np.float32) * 0.1
    return (x - target + noise).astype(np.float32)


KSTEP_X0 = np.linspace(0.5, -0.5, 10).astype(np.float32)


# ---------------------------------------------------------------- scenarios

def run_pullpush(node, out: str, args) -> None:
    import hps
    from hps.distributed import DistributedServer
    ds = DistributedServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), args.optimizer)),
                           node, sparse_rows=args.sparse_codec, sparse_grads=args.sparse_codec)
    pulled = {}
    for rnd in range(args.rounds):
        keys, grads = pullpush_round(node.rank, rnd, node.size)
        pulled[f"pull{rnd}"] = ds.pull(keys)
        ds.push(keys, grads)
    keys, _ = pullpush_round(node.rank, args.rounds, node.size)
    pulled["final"] = ds.pull(keys)
    np.savez(os.path.join(out, f"rank{node.rank}.npz"), **pulled, bytes=np.array(
        [node.bytes_sent[k] for k in ("sparse_keys", "sparse_rows", "sparse_grads")]),
        ssd_hits=np.array(ds.stats()["counts"]["ssd_hits"]))
    ds.close()


def run_pushstep(node, out: str, args) -> None:
    """Rounds of DistributedServer.push whose keys all belong to rank 0: each rank's
    server step (what [ps] ttl_steps counts) after them."""
    import hps
    from hps.distributed import DistributedServer, owner_ranks
    ds = DistributedServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"))), node)
    keys = np.arange(1, 200, dtype=np.uint64)
    keys = keys[owner_ranks(keys, node.size) == 0][:10]
    for _ in range(args.rounds):
        ds.push(keys, np.ones((len(keys), DIM), np.float32))
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"step": ds.local.step}, f)
    ds.close()


def run_otherseed(node, out: str, args) -> None:
    """Rank 1's server has another seed: its initial rows are not the owners', so
    the DistributedServer refuses it on every rank, and says which."""
    import dataclasses
    import hps
    from hps.distributed import DistributedServer
    cfg = ps_config(os.path.join(out, f"ps{node.rank}"))
    if node.rank == 1:
        cfg = dataclasses.replace(cfg, seed=4)
    try:
        DistributedServer(hps.ParameterServer(cfg), node)
        error = ""
    except ValueError as e:
        error = str(e)
    with open(os.path.join(out, f"rank{node.rank}.txt"), "w") as f:
        f.write(error)


def run_badkeys(node, out: str, args) -> None:
    """Keys of another dtype than uint64 or int64, given to every collective call of
    a DistributedServer and to a rank's batch: each is refused on every rank before
    any exchange (so the job goes on), naming the call."""
    import hps
    from hps.distributed import DistributedServer
    server = DistributedServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"))), node)
    floats, small = np.array([1.7, 2.0]), np.array([1, 2], np.int32)
    grads = np.ones((2, DIM), np.float32)
    calls = {"pull float64": lambda: server.pull(floats), "pull int32": lambda: server.pull(small),
             "push float64": lambda: server.push(floats, grads), "prefetch float64": lambda: server.prefetch(floats),
             "lookahead float64": lambda: server.prefetch(np.array([1, 2], np.uint64), upcoming=[floats])}
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except TypeError as e:
            errors[name] = str(e)
    pre = server.prefetch(np.array([1, 2], np.uint64))
    batch = server.batch(pre)
    try:
        batch.pull(floats)
        errors["batch pull float64"] = None
    except TypeError as e:
        errors["batch pull float64"] = str(e)
    batch.finish()
    pre.release()
    rows = server.pull(np.array([1, 2], np.uint64))  # the job goes on
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"errors": errors, "rows": rows.tolist()}, f)
    server.close()


def raised_by(call) -> str:
    """What call() raised, as "Type: message" ("" for nothing)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - written for the test
        return f"{type(e).__name__}: {e}"
    return ""


def run_onerankrefuses(node, out: str, args) -> None:
    """Calls of a DistributedServer and of its batches that the last rank alone
    refuses, for its own input (a float key, a reserved key, gradients of another
    shape or not finite, a window of float keys, a source that raises); every
    rank catches what its call raised and goes on to the next. Each rank writes
    what each call raised, and whether the rows of the keys pulled first are as
    they were after them: no refused call changed a row. First, a server whose
    codec the last rank alone refuses; last, a Node whose config it refuses."""
    import hps
    from hps.data import Batch
    from hps.distributed import DistributedConfig, DistributedServer, Node
    bad = node.rank == node.size - 1

    def refused_server():
        ps = hps.ParameterServer(ps_config(os.path.join(out, f"refused{node.rank}")))
        try:
            DistributedServer(ps, node, sparse_rows="zstd" if bad else "none")
        finally:
            ps.close()
    refused = raised_by(refused_server)
    server = DistributedServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), budget="1MiB")),
                               node)
    keys = np.arange(1, 41, dtype=np.uint64)
    grads = np.ones((len(keys), DIM), np.float32)
    nan = grads.copy()
    nan[3, 1] = np.nan
    reserved = np.append(keys, np.uint64(hps.EMPTY_KEY))
    before = server.pull(keys)

    def prefetched(k, upcoming=None):
        server.prefetch(k, upcoming=upcoming).release()

    def step(g):
        pre = server.prefetch(keys)
        try:
            batch = server.batch(pre)
            batch.push(keys, g)
            batch.finish()
        finally:
            pre.release()

    def source():
        yield Batch(np.zeros(2, np.float32), np.zeros((2, 1), np.float32), keys[:4].reshape(2, 2))
        if bad:
            raise ValueError("line 3 of this rank's data is malformed")
        yield Batch(np.zeros(2, np.float32), np.zeros((2, 1), np.float32), keys[4:8].reshape(2, 2))
    empty = Batch(np.zeros(0, np.float32), np.zeros((0, 1), np.float32), np.zeros((0, 2), np.uint64))
    calls = {"pull float keys": lambda: server.pull(keys.astype(np.float64) if bad else keys),
             "pull reserved key": lambda: server.pull(reserved if bad else keys),
             "push grads of another shape": lambda: server.push(keys, grads[1:] if bad else grads),
             "push nan": lambda: server.push(keys, nan if bad else grads),
             "push reserved key": lambda: server.push(reserved if bad else keys,
                                                      np.ones((len(reserved) if bad else len(keys), DIM), np.float32)),
             "prefetch float keys": lambda: prefetched(keys.astype(np.float64) if bad else keys),
             "lookahead float keys": lambda: prefetched(keys, [keys.astype(np.float64) if bad else keys]),
             "batch nan": lambda: step(nan if bad else grads),
             "source raises": lambda: list(server.aligned(source(), empty))}
    errors = {"server codec": refused, **{name: raised_by(call) for name, call in calls.items()}}
    # Last: on a rank that refused it alone, the others waited in its communicators' Dup, with no watchdog.
    errors["node config"] = raised_by(lambda: Node(DistributedConfig(timeout=-1.0 if bad else 10.0)).close())
    same = bool(np.array_equal(server.pull(keys), before))  # (the job goes on)
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"errors": errors, "rows_as_before": same}, f)
    server.close()


def run_heraldonerankrefuses(node, out: str, args) -> None:
    """As onerankrefuses with schedule = 'herald' (caches of 20 rows): first, a
    server the last rank refuses (a cache of no rows); the last rank's prefetch of
    keys of one field a row (not (n, fields)), with a reserved key, of another
    number of fields than the other ranks' (which the leader, rank 0, finds), its
    push of a NaN gradient; then a step every rank takes (the job goes on), a step
    whose last rank's gradients hold a NaN, and a pull, which every rank refuses
    alike after that failed step. Last, on a server of its own, a step whose last
    rank is given one example less than it prefetched. Each rank writes what each
    call raised."""
    import hps
    from hps.data import Batch
    from hps.distributed.herald import HeraldServer
    bad = node.rank == node.size - 1

    def refused_server():
        ps = hps.ParameterServer(ps_config(os.path.join(out, f"refused{node.rank}")))
        try:
            HeraldServer(ps, node, 0 if bad else 20)
        finally:
            ps.close()
    refused = raised_by(refused_server)
    server = herald_server(node, out)
    keys = herald_step_keys(node.rank, 0)
    flat = keys.reshape(-1)
    nan = key_gradient(flat)
    nan[0, 0] = np.nan
    reserved = np.append(keys[:-1], np.array([[1, 2, hps.EMPTY_KEY]], np.uint64), 0)

    def prefetched(k):
        server.prefetch(k).release()

    def step(on, nan_here: bool = False, examples: int = len(keys)):
        batch = on.batch(on.prefetch(keys))
        try:
            batch.bind(Batch(np.zeros(examples, np.float32), np.zeros((examples, 1), np.float32), keys[:examples]))
            batch.partition()
            mine = np.ascontiguousarray(batch.exchanged.keys).view(np.uint64).reshape(-1)
            g = key_gradient(mine)
            if nan_here and len(g):
                g[0, 0] = np.nan
            batch.push(mine, g)
            batch.apply()
            batch.write_back()
        except BaseException:
            batch.abort()
            raise
    calls = {"prefetch one key an example": lambda: prefetched(flat if bad else keys),
             "prefetch reserved key": lambda: prefetched(reserved if bad else keys),
             "prefetch another number of fields": lambda: prefetched(keys[:, :2] if bad else keys),
             "push nan": lambda: server.push(flat, nan if bad else key_gradient(flat)),
             "step": lambda: step(server),
             "step nan": lambda: step(server, nan_here=bad),
             "pull after the failed step": lambda: server.pull(flat)}
    errors = {"server of no cache rows": refused, **{name: raised_by(call) for name, call in calls.items()}}
    server.close()
    other = HeraldServer(hps.ParameterServer(ps_config(os.path.join(out, f"other{node.rank}"), budget="1MiB")),
                         node, 20)
    errors["step of one example less"] = raised_by(lambda: step(other, examples=len(keys) - bad))
    other.close()
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"errors": errors}, f)


def only(args, calls: dict) -> dict:
    """calls, or those --only names (comma-separated): a case run on its own."""
    names = [n for n in args.only.split(",") if n]
    return {n: c for n, c in calls.items() if not names or n in names}


def run_alltoallvrefuses(node, out: str, args) -> None:
    """Node.alltoallv calls that the last rank alone refuses after their counts
    crossed, with the others' own checks passing: its rows of another size (12
    bytes, 16 elsewhere), sent to rank 1 alone while ranks 0 and 1 exchange among
    themselves (rank 0 has no traffic with it), then to every rank; its 2 GiB to
    send (a third to each rank), or to receive (1 GiB from each other rank): views
    (np.broadcast_to) of 16 bytes, never copied. Last, under a limit of 1 KiB, an
    exchange each rank's part of which fits though the ranks' largest blocks
    together do not. Each rank writes what each call raised."""
    from hps.distributed import comm
    me, world, last = node.rank, node.size, node.size - 1

    def rows(n: int):
        return np.full((n, 3 if me == last else 4), me + 1, np.float32)

    def big(n: int):
        return np.broadcast_to(np.zeros((1, 16), np.uint8), (n, 16))

    def exchange(blocks):
        return lambda: node.alltoallv("train", blocks, "sparse_grads", "push gradients")
    apart = {0: 1, 1: 0, last: 1}  # the one rank each sends rows to
    third = 2**31 // (16 * world) + 1
    calls = {"rows of another size to rank 1 alone": exchange([rows(2 if r == apart[me] else 0) for r in range(world)]),
             "rows of another size": exchange([rows(2) for _ in range(world)]),
             "sends past 2 GiB": exchange([big(third if me == last else 0) for _ in range(world)]),
             "receives past 2 GiB": exchange([big(2**30 // 16 if r == last and me != last else 0)
                                             for r in range(world)])}
    errors = {name: raised_by(call) for name, call in only(args, calls).items()}
    limit = getattr(comm, "MESSAGE_LIMIT", None)
    comm.MESSAGE_LIMIT = 1024
    try:  # rank r sends rank r + 1 640 bytes: 1280 of the ranks' largest blocks together
        got = node.alltoallv("train", [big(40 if r == me + 1 else 0) for r in range(world)], "sparse_grads",
                             "push gradients")
        errors["fits under the limit"] = [len(g) for g in got]
    except Exception as e:  # noqa: BLE001 - written for the test
        errors["fits under the limit"] = f"{type(e).__name__}: {e}"
    finally:
        comm.MESSAGE_LIMIT = limit
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"errors": errors}, f)


def run_ownerrefuses(node, out: str, args) -> None:
    """DistributedServer calls refused after their last exchange, by the last rank
    alone, as an owner: its prefetch's working set past its device_capacity (its
    server's batches use a device tier: host_in_place = false), the sum of every
    rank's finite gradients of a key it owns that overflows (3e38 three times) in a
    push and in a batch; what rank 0, as if it ran another hps, sends it malformed
    (a word or a byte more): a lookahead window, a pull's rows (and the pull after
    it), a batch's rows; and, last, its prefetch's MEM-PS full (CacheFullError),
    not tried again: its next call is the next step's. Every rank catches what its
    call raised and goes on to the next. Each rank writes what each call raised,
    and whether the rows of the keys are as they were before the calls but the last
    step: no refused call changed a row."""
    import dataclasses
    import hps
    from hps.distributed import DistributedServer, owner_ranks
    from hps.mem_cache import CacheFullError
    bad = node.rank == node.size - 1
    cfg = ps_config(os.path.join(out, f"ps{node.rank}"), budget="1MiB")
    server = DistributedServer(hps.ParameterServer(dataclasses.replace(cfg, host_in_place=not bad)), node)
    keys = np.arange(1, 41, dtype=np.uint64)
    grads = np.ones((len(keys), DIM), np.float32)
    huge = grads.copy()
    huge[np.flatnonzero(owner_ranks(keys, node.size) == node.size - 1)[0]] = 3e38
    before = server.pull(keys)

    def step(k, g):
        pre = server.prefetch(k)
        try:
            batch = server.batch(pre)
            batch.push(k, g)
            batch.finish()
        finally:
            pre.release()

    def past_device_capacity():
        room = server.local.config.device_capacity
        if bad:
            server.local.config.device_capacity = 4
        try:
            step(keys, grads)
        finally:
            server.local.config.device_capacity = room

    def full_once(k):
        def no_room(*a, **kw):
            raise CacheFullError("MEM-PS is full (mpi_scenarios: ownerrefuses)")
        if bad:
            server.local.prefetch = no_room  # this instance's, this once
        try:
            step(k, grads)
        finally:
            if bad:
                del server.local.prefetch
    def sent_malformed(call, attribute: str, owner, word):
        """call(), rank 0's `attribute` of `owner` (a method that makes the blocks
        of an exchange) adding `word` to its block to the last rank."""
        if node.rank == 0:
            real = getattr(owner, attribute)

            def malformed(*a):
                blocks = list(real(*a))
                blocks[-1] = np.append(blocks[-1], word)
                return blocks
            setattr(owner, attribute, malformed)  # this instance's, this once
        try:
            return call()
        finally:
            if node.rank == 0:
                delattr(owner, attribute)
    calls = {"prefetch past device_capacity": past_device_capacity,
             "push whose sum overflows": lambda: server.push(keys, huge),
             "batch whose sum overflows": lambda: step(keys, huge),
             "lookahead window sent malformed": lambda: sent_malformed(
                 lambda: server.prefetch(keys, upcoming=[keys]).release(), "_window_blocks", server, np.uint64(7)),
             "pull rows sent malformed": lambda: sent_malformed(lambda: server.pull(keys), "pack",
                                                                server.fresh_rows, np.uint8(0)),
             "the pull after it": lambda: server.pull(keys),
             "batch rows sent malformed": lambda: sent_malformed(lambda: step(keys, grads), "pack",
                                                                 server.fresh_rows, np.uint8(0))}
    errors = {name: raised_by(call) for name, call in only(args, calls).items()}
    same = bool(np.array_equal(server.pull(keys), before))
    if not args.only or "prefetch full and not tried again" in args.only.split(","):
        errors["prefetch full and not tried again"] = raised_by(lambda: full_once(keys.copy()))
        errors["the next step"] = raised_by(lambda: step(keys.copy(), grads))
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"errors": errors, "rows_as_before": same}, f)
    server.close()


def run_heraldrefusesafter(node, out: str, args) -> None:
    """HeraldServer steps refused after their prefetch's exchanges by one rank
    alone, each on a server of its own (a failed step stops it): the leader's
    schedule raises (RuntimeError); the last rank's pin of its keys in MEM-PS
    fails (OSError: its SSD's read, say); it finds MEM-PS full (CacheFullError)
    and does not try again: its next call is the next step's. Then calls the
    last rank fails after their last exchange: the rows rank 0, as if it ran
    another hps, sends it in a step's partition (a byte more); its keep of the
    rows sent to it as an owner (OSError: its SSD-PS's write) in a step (the
    evicted rows) and in a pull's flush after a step. Each rank writes what each
    call raised, and what the next step raised after some of them."""
    from hps.data import Batch
    from hps.mem_cache import CacheFullError
    bad = node.rank == node.size - 1
    keys = herald_step_keys(node.rank, 0)

    def step(server, k):
        batch = server.batch(server.prefetch(k))
        try:
            batch.bind(Batch(np.zeros(len(k), np.float32), np.zeros((len(k), 1), np.float32), k))
            batch.partition()
            mine = np.ascontiguousarray(batch.exchanged.keys).view(np.uint64).reshape(-1)
            batch.push(mine, key_gradient(mine))
            batch.apply()
            batch.write_back()
        except BaseException:
            batch.abort()
            raise

    def failing(error):
        def fails(*a, **kw):
            raise error
        return fails

    def schedule_raises(server):
        if node.rank == 0:
            server.herald.schedule = failing(RuntimeError("the schedule failed (mpi_scenarios)"))
        step(server, keys)

    def pin_raises(server):
        if bad:
            server.local._cache.pin = failing(OSError(5, "Input/output error (mpi_scenarios)"))
        step(server, keys)

    def full_once(server):
        if bad:
            server.local._cache.pin = failing(CacheFullError("MEM-PS is full (mpi_scenarios)"))
        try:
            step(server, keys.copy())
        finally:
            if bad:
                del server.local._cache.pin
    def fetched_rows_malformed(server):
        if node.rank == 0:
            real = server.fetched_rows.pack

            def malformed(*a):
                blocks = real(*a)
                blocks[-1] = np.append(blocks[-1], np.uint8(0))
                return blocks
            server.fetched_rows.pack = malformed  # this instance's, this once
        try:
            step(server, keys)
        finally:
            if node.rank == 0:
                del server.fetched_rows.pack

    def keep_fails(server):
        if bad:
            server.local._cache.keep_updated = failing(OSError(5, "Input/output error (mpi_scenarios: keep)"))

    def evicted_kept_fails(server):
        keep_fails(server)
        step(server, keys)

    def flushed_kept_fails(server):
        step(server, keys)
        keep_fails(server)
        server.pull(keys.reshape(-1))
    errors = {}
    for n, (name, call) in enumerate(only(args, {"leader's schedule raises": schedule_raises,
                                                 "pin raises": pin_raises,
                                                 "prefetch full and not tried again": full_once,
                                                 "fetched rows sent malformed": fetched_rows_malformed,
                                                 "evicted rows kept fail": evicted_kept_fails,
                                                 "flushed rows kept fail": flushed_kept_fails}).items()):
        server = herald_server(node, os.path.join(out, f"case{n}"))
        errors[name] = raised_by(lambda: call(server))
        if name == "prefetch full and not tried again":
            errors["the next step"] = raised_by(lambda: step(server, keys.copy()))
        elif name not in ("leader's schedule raises", "pin raises"):
            errors[f"the step after {name}"] = raised_by(lambda: step(server, keys.copy()))
        server.close()
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"errors": errors}, f)


def run_distbatch(node, out: str, args) -> None:
    """A rank's DistBatch finds its keys' positions from the prefetch for a run of
    the prefetched keys (a worker's share, a view), by a search for a copy of
    them; both give the same rows and sums, and a key outside the batch is named."""
    import hps
    from hps.distributed import DistributedServer
    from hps.parameter_server import working_batch
    ds = DistributedServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), "adagrad",
                                                         budget="1MiB")), node)
    rng = np.random.default_rng(node.rank)
    keys = rng.integers(0, 40, size=(8, 3)).astype(np.uint64)
    batch = ds.batch(ds.prefetch(keys))
    share = keys[2:6]  # a view, as a worker's consecutive examples are
    copy = share.copy()
    # As hps.torch goes: the protocol's positions of a by-keys batch are the keys.
    work = working_batch(batch)
    at_view, at_copy = work.positions(share), work.positions(copy)
    got = {"pos_view": batch._positions(at_view), "pos_copy": batch._positions(at_copy)}
    got["view_is_prefetched"] = np.array(np.shares_memory(got["pos_view"], batch.pre.inverse))
    got["rows_view"], got["rows_copy"] = work.gather(at_view), work.gather(at_copy)
    grads = rng.random((share.size, ds.dim), dtype=np.float32)
    sums = []
    for at in (at_view, at_copy):
        batch.grads[:] = 0.0
        batch.touched[:] = False
        work.accumulate(at, grads)
        sums.append(batch.grads.copy())
    got["sums_view"], got["sums_copy"] = sums
    got["want_sums"] = np.zeros_like(sums[0])
    np.add.at(got["want_sums"], np.searchsorted(batch.keys, share.reshape(-1)), grads)
    try:
        batch.pull(np.array([1000], np.uint64))
        got["error"] = np.array("")
    except KeyError as e:
        got["error"] = np.array(str(e))
    batch.abort()
    np.savez(os.path.join(out, f"rank{node.rank}.npz"), **got)
    ds.close()


def run_heraldkeys(node, out: str, args) -> None:
    """Every rank prefetches its herald_example_keys with schedule = 'herald'; the
    leader saves the global batch it received (examples, starts)."""
    import hps
    from hps.distributed.herald import HeraldServer
    ps = hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), "adagrad", budget="64MiB"))
    server = HeraldServer(ps, node, 150)
    pre = server.prefetch(herald_example_keys(node.rank))
    if node.rank == 0:
        np.savez(os.path.join(out, "rank0.npz"), examples=pre.examples, starts=pre.starts)
    pre.release()
    server.close()


def run_heraldpush(node, out: str, args) -> None:
    """Four Herald steps driven by hand (caches of 20 rows; every example key's
    gradient is key_gradient's), with a direct push of pullpush_round's keys
    (key_gradient's gradients) between steps 2 and 3; rank 0 saves the rows of
    keys 0..149 at the end."""
    server = herald_server(node, out)
    for step in range(4):
        if step == 2:
            keys, _ = pullpush_round(node.rank, 0, node.size)
            server.push(keys, key_gradient(keys))
        keys = herald_step_keys(node.rank, step)
        herald_step(server, server.prefetch(keys), keys)
    final = server.pull(np.arange(150, dtype=np.uint64))
    if node.rank == 0:
        np.savez(os.path.join(out, "rank0.npz"), final=final, herald=np.array(json.dumps(server.stats()["herald"])))
    server.close()


def run_openbatchpush(node, out: str, args) -> None:
    """DistributedServer pushes that would wait for an open batch: an hps.torch
    module with no batch attached, its backward inside a batch made on every
    rank; then a direct push once the batch applied, with the last rank alone not
    yet having written it back (a write-back is a rank's own). Each rank writes
    what each push raised and whether the rows are as before it; after each, the
    batch finishes and the same push goes ahead."""
    import torch
    import hps
    import hps.torch as ht
    from hps.distributed import DistributedServer
    ds = DistributedServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), budget="1MiB")), node)
    keys = np.array([[1, 2], [3, 4]], np.uint64)
    ids = np.unique(keys)
    bag = ht.EmbeddingBag(ds)
    got = {}

    def backward():
        bag(torch.from_numpy(keys.astype(np.int64))).sum().backward()
    before = ds.pull(ids)
    batch = ds.batch(ds.prefetch(keys))
    got["backward in a batch"] = raised_by(backward)
    batch.finish()  # (no gradient: no row steps)
    got["rows as before the backward"] = bool(np.array_equal(ds.pull(ids), before))
    backward()  # the batch finished: the push goes ahead
    got["backward after it"] = bool(not np.array_equal(ds.pull(ids), before))
    before = ds.pull(ids)
    batch = ds.batch(ds.prefetch(keys))
    batch.apply()
    if node.rank != node.size - 1:
        batch.write_back()
    ones = np.ones((len(ids), DIM), np.float32)
    got["push of an applied batch"] = raised_by(lambda: ds.push(ids, ones))
    batch.write_back()
    got["rows as before the push"] = bool(np.array_equal(ds.pull(ids), before))
    ds.push(ids, ones)
    got["push after it"] = bool(not np.array_equal(ds.pull(ids), before))
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump(got, f)
    ds.close()


def heraldflush_last_keys(rank: int) -> np.ndarray:
    """The heraldflush scenario's last step's keys on a rank: 20 of its own, not
    seen before (7 examples, the last key twice), which fill a cache of 20 rows."""
    return (200 + 20 * rank + np.minimum(np.arange(21), 19)).astype(np.uint64).reshape(7, 3)


def run_heraldflush(node, out: str, args) -> None:
    """Two Herald steps of herald_step_keys (caches of --herald rows), a pull (a
    flush), a step of one example a rank (keys 1 + rank, 2, 3), a pull again, then
    a step of heraldflush_last_keys (the caches drop the flushed rows) and a pull;
    each rank saves its flushed_rows after each pull, its evict_pushes and
    evict_clean_dropped before and after the last step, and rank 0 the rows of
    keys 0..299 at the end."""
    import hps
    from hps.distributed.herald import HeraldServer
    server = HeraldServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), "adagrad",
                                                        budget="1MiB")), node, args.herald)
    flushed, evicted = [], []
    for step in range(2):
        keys = herald_step_keys(node.rank, step)
        herald_step(server, server.prefetch(keys), keys)
    server.pull(np.arange(150, dtype=np.uint64))
    flushed.append(server.stats()["herald"]["flushed_rows"])
    for keys in (np.array([[1 + node.rank, 2, 3]], np.uint64), heraldflush_last_keys(node.rank)):
        herald_step(server, server.prefetch(keys), keys)
        final = server.pull(np.arange(300, dtype=np.uint64))
        h = server.stats()["herald"]
        flushed.append(h["flushed_rows"])
        evicted.append([h["evict_pushes"], h["evict_clean_dropped"]])
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"flushed_rows": flushed, "evicted": evicted, "peer_fetches": h["peer_fetches"]}, f)
    if node.rank == 0:
        np.save(os.path.join(out, "final.npy"), final)
    server.close()


def heraldrandom_events(seed: int, steps: int, world: int) -> list:
    """The heraldrandom scenario's events, drawn from `seed` (every rank and the test
    draw the same): ("step", keys (n, 3) a rank, n from 0 to 9, some ranks given none,
    and a lookahead window of the next 0 to 3 steps' keys),
    ("pull", keys) (a flush: every rank pulls them), ("push", keys a rank) (a direct
    push between steps, which empties the caches). Keys from 0..59, skewed to the low
    ones, so that caches of a few rows evict, fetch from peers and share keys."""
    rng = np.random.default_rng(seed)
    events = []
    for _ in range(steps):
        n = [int(rng.integers(0, 10)) if rng.random() > 0.15 else 0 for _ in range(world)]
        events.append(("step", [np.minimum(rng.zipf(1.3, size=(k, 3)) - 1, 59).astype(np.uint64) for k in n],
                       int(rng.integers(0, 4))))
        roll = rng.random()
        if roll < 0.3:
            events.append(("pull", np.unique(rng.integers(0, 60, size=int(rng.integers(1, 30)))).astype(np.uint64)))
        elif roll < 0.4:
            events.append(("push", [rng.integers(0, 60, size=int(rng.integers(1, 8))).astype(np.uint64)
                                    for _ in range(world)]))
    events.append(("pull", np.arange(60, dtype=np.uint64)))
    return events


def run_heraldrandom(node, out: str, args) -> None:
    """heraldrandom_events(--seed, --steps) driven by hand on caches of --herald rows
    (every example key's gradient key_gradient's), or with --sequential on the
    sequential job's server (DistributedServer) over a MEM-PS of --mem-budget;
    rank 0 saves every pull's rows and the server's counts."""
    import hps
    from hps.distributed import DistributedServer
    from hps.distributed.herald import HeraldServer
    if args.sequential:
        server = DistributedServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), "adagrad",
                                                                 budget=args.mem_budget)), node)
    else:
        server = HeraldServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), "adagrad",
                                                            budget="1MiB")), node, args.herald)
    pulled = []
    events = heraldrandom_events(args.seed, args.steps, node.size)
    steps = [e for e in events if e[0] == "step"]
    done = 0
    for kind, keys, *window in events:
        if kind == "step":
            upcoming = [e[1][node.rank] for e in steps[done + 1:done + 1 + window[0]]] if window[0] else None
            mine = keys[node.rank]
            if args.sequential:  # a rank trains the examples it read
                batch = server.batch(server.prefetch(mine.reshape(-1), upcoming=upcoming))
                batch.push(mine.reshape(-1), key_gradient(mine.reshape(-1)))
                batch.apply()
                batch.write_back()
            else:
                herald_step(server, server.prefetch(mine, upcoming=upcoming), mine)
            done += 1
        elif kind == "push":
            server.push(keys[node.rank], key_gradient(keys[node.rank]))
        else:
            pulled.append(server.pull(keys))
    if node.rank == 0:
        stats = server.stats()
        np.savez(os.path.join(out, "rank0.npz"), *pulled, stats=np.array(json.dumps(stats.get("herald", stats))))
    server.close()


def herald_server(node, out: str):
    """A HeraldServer with caches of 20 rows and 1 MiB of MEM-PS a rank (the
    hand-driven Herald scenarios')."""
    import hps
    from hps.distributed.herald import HeraldServer
    return HeraldServer(hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), "adagrad",
                                                      budget="1MiB")), node, 20)


def herald_step(server, pre, keys: np.ndarray) -> None:
    """One Herald step driven by hand, from `pre`, the prefetch of this rank's
    example `keys` (no labels or dense features; every example key's gradient is
    key_gradient's), to its write-back."""
    from hps.data import Batch
    batch = server.batch(pre)
    batch.bind(Batch(np.zeros(len(keys), np.float32), np.zeros((len(keys), 1), np.float32), keys))
    batch.partition()
    mine = np.ascontiguousarray(batch.exchanged.keys).view(np.uint64).reshape(-1)
    batch.push(mine, key_gradient(mine))
    batch.apply()
    batch.write_back()


def run_heraldtable(node, out: str, args) -> None:
    """--steps Herald steps of herald_step_keys driven by hand; after each, a rank
    saves the keys its table (the tier that holds its cache's rows) holds, its
    compactions so far and its table's size."""
    server = herald_server(node, out)
    got = {"compactions": [], "table_rows": []}
    for step in range(args.steps):
        keys = herald_step_keys(node.rank, step)
        herald_step(server, server.prefetch(keys), keys)
        got[f"table{step}"] = np.sort(server._tier.read_back(server._row_floats)[0])
        stats = server.stats()["herald"]
        got["compactions"].append(stats["compactions"])
        got["table_rows"].append(stats["table_rows"])
    np.savez(os.path.join(out, f"rank{node.rank}.npz"), **got)
    server.close()


def run_heraldretry(node, out: str, args) -> None:
    """--steps Herald steps of herald_step_keys driven by hand. At step 1 the ranks
    in --fail-ranks find MEM-PS full: their first pin of the step's keys raises
    CacheFullError (holding no pin, as a full MEM-PS's does), and they prefetch the
    same keys object again, as hps.pipeline does after a write-back frees room.
    Each rank saves the bytes it sent by kind (COMM_KINDS), how many prefetches it
    saw fail, and the rows of keys 0..149 at the end."""
    from hps.distributed import COMM_KINDS
    from hps.mem_cache import CacheFullError
    server = herald_server(node, out)
    cache = server.local._cache
    failing = [int(r) for r in args.fail_ranks.split(",") if r]
    full = 0

    def no_room(keys):
        raise CacheFullError("MEM-PS is full (mpi_scenarios: heraldretry)")
    for step in range(args.steps):
        keys = herald_step_keys(node.rank, step)
        if step == 1 and node.rank in failing:
            cache.pin = no_room  # this instance's pin, this once
            try:
                server.prefetch(keys)
            except CacheFullError:
                full += 1
            finally:
                del cache.pin  # MemCache.pin again
        herald_step(server, server.prefetch(keys), keys)
    final = server.pull(np.arange(150, dtype=np.uint64))
    np.savez(os.path.join(out, f"rank{node.rank}.npz"), final=final, full=np.array(full),
             bytes=np.array([node.bytes_sent[k] for k in COMM_KINDS]))
    server.close()


def lookaheadorder_keys(world: int, owner: int, rows: int) -> np.ndarray:
    """rows + 1 keys `owner` owns, ascending: the rows its MEM-PS holds, then one more."""
    from hps.distributed import owner_ranks
    keys = np.arange(1, 1000, dtype=np.uint64)
    return keys[owner_ranks(keys, world) == owner][:rows + 1]


def run_lookaheadorder(node, out: str, args) -> None:
    """On 2 ranks: the owner's (--owner) MEM-PS is full of rows of keys k[0] < ... <
    k[C-1], all in the job's window, and the window needs them in the opposite
    order: k[C-1-j] first in batch j, by rank j % 2; the owner needs all of them
    again in a last batch. Then the owner pulls k[C], outside the window: MEM-PS
    must evict k[0], needed latest (a window sorted by key value would evict k[C-1],
    and one that took a key's last batch over the ranks, not its first, would see
    every key needed in the last batch). The sequential schedule's or, with
    --herald, Herald's _send_window (rank 0 leads). The owner saves which keys stay."""
    import hps
    from hps.distributed import DistributedServer
    local = hps.ParameterServer(ps_config(os.path.join(out, f"ps{node.rank}"), budget=args.mem_budget))
    if args.herald:
        from hps.distributed.herald import HeraldServer
        server = HeraldServer(local, node, args.herald)
    else:
        server = DistributedServer(local, node)
    cache, mine = server.local._cache, node.rank == args.owner
    rows = int(cache.stats()["capacity"])  # every rank's: the same config
    keys = lookaheadorder_keys(node.size, args.owner, rows)
    upcoming = [keys[rows - 1 - j:rows - j] if j % 2 == node.rank else keys[:0] for j in range(rows)]
    upcoming.append(keys[:rows] if mine else keys[:0])
    if mine:
        cache.pull(keys[:rows])  # MEM-PS full, nothing pinned
    server._send_window(upcoming)  # as a prefetch does, without its pins
    server._owner_windows.apply(cache)
    if mine:
        cache.pull(keys[rows:])
        with open(os.path.join(out, "owner.json"), "w") as f:
            json.dump({"keys": keys.tolist(), "cached": [int(k) in cache for k in keys],
                       "forced": cache.stats()["lookahead_forced"]}, f)
    server.close()


def run_train(node, out: str, args) -> None:
    from hps.train import train
    cfg = train_config(os.path.join(out, "job"), args.dense_sync, args.k, args.hierarchical, args.ranks_per_node,
                       pipelined=not args.sequential, mem_budget=args.mem_budget)
    cfg.checkpoint_every = args.checkpoint_every
    cfg.eval_every = args.eval_every
    if args.herald:
        cfg.ps.schedule, cfg.ps.worker_cache_rows = "herald", args.herald
    if args.device_capacity:
        cfg.ps.device_capacity = args.device_capacity
    cfg.ps.lookahead = args.lookahead
    if args.lookahead:
        from hps.config import parse_bytes
        cfg.ps.mem_budget = parse_bytes(cfg.ps.mem_budget) + WINDOW_ROOM
        cfg.ps.lookahead_room = WINDOW_ROOM
    if args.admission:
        cfg.admission = admission_config(args.admission)
    cfg.distributed.sparse_rows = cfg.distributed.sparse_grads = args.sparse_codec
    if args.die_at_checkpoint and node.rank == 1:
        # Rank 1 dies making that checkpoint, after its store's commit, once the
        # other ranks (which need no collective for theirs) have finished theirs.
        import time
        from hps.parameter_server import ParameterServer
        snapshot = ParameterServer._snapshot_store

        def dying(ps, dst):
            if (ps.checkpoint_number or 0) + 1 == args.die_at_checkpoint:
                time.sleep(2.0)
                os.kill(os.getpid(), signal.SIGKILL)
            return snapshot(ps, dst)
        ParameterServer._snapshot_store = dying
    if args.rank1_config in ("dense_lr", "sparse_grads") and node.rank == 1:
        # rank 1 given another config (another file on its host, say)
        if args.rank1_config == "dense_lr":
            cfg.dense_lr = 0.1
        else:
            cfg.distributed.sparse_grads = "bf16"
    if args.fail_open and node.rank == 1:
        # Rank 1's server does not open (its disk, its store), while rank 0's
        # opens and goes on to the servers' first exchange.
        import hps.train
        from hps.errors import CorruptionError

        def failing_open(*a, **kw):
            if args.fail_open == "corrupt":
                raise CorruptionError("rank 1's store: a damaged checkpoint")
            raise OSError(28, "No space left on device")
        hps.train.ParameterServer = failing_open
    if args.fresh_windows:
        # Each window's arrays copied: never the last window shifted (by identity), so
        # every rank sets its window anew each batch rather than sliding it.
        from hps.distributed.herald import HeraldServer
        from hps.distributed.sparse import DistributedServer
        for cls in (DistributedServer, HeraldServer):
            def copying(server, keys, upcoming=None, _prefetch=cls.prefetch):
                return _prefetch(server, keys, None if upcoming is None else [u.copy() for u in upcoming])
            cls.prefetch = copying
    batches = global_batches(args.steps, args.per_rank, node.size, multi_hot=args.multi_hot,
                             empty_bags_at=args.empty_bags_at)
    mine = [rank_part(b, node.rank, args.per_rank) for b in batches]
    if args.rank1_config == "multi_hot" and node.rank == 1:  # rank 1's data has two multi-hot fields more
        mine = [rank_part(b, node.rank, args.per_rank)
                for b in global_batches(args.steps, args.per_rank, node.size, multi_hot=True)]
    if args.uneven and node.rank == node.size - 1:
        mine = mine[:-2]  # this rank's data ends two steps early
    if args.fail_at_step and node.rank == 1:
        def failing(batches, at):  # a malformed line, say, in this rank's data
            for i, b in enumerate(batches):
                if i == at:
                    raise ValueError(f"rank 1's data: malformed at step {at}")
                yield b
        mine = failing(mine, args.fail_at_step)
    if args.fail_in_step and node.rank == 1:
        # Rank 1's train stage raises at that step (a diverged loss, say), while the
        # other ranks' stages go on to their next collectives.
        import hps.train
        step = hps.train.Trainer.step

        def failing_step(trainer, loaded):
            if trainer.batches_done + 1 == args.fail_in_step:
                raise RuntimeError(f"rank 1's step {args.fail_in_step} failed")
            return step(trainer, loaded)
        hps.train.Trainer.step = failing_step
    if args.nan_grad_at_step and node.rank == 1:
        # Rank 1's sparse gradients of that step hold a NaN (a step that diverged
        # with a finite loss), while the other ranks' are numbers.
        from hps.distributed.herald import HeraldDistBatch
        from hps.distributed.sparse import DistBatch
        if args.herald:  # (_apply: once a step, where apply returns at once when called again)
            herald_apply, herald_applied = HeraldDistBatch._apply, [0]

            def diverged_herald_apply(batch, *a):
                herald_applied[0] += 1
                if herald_applied[0] == args.nan_grad_at_step:
                    batch._grads[0, 1] = np.nan
                return herald_apply(batch, *a)
            HeraldDistBatch._apply = diverged_herald_apply
        apply, applied = DistBatch.apply, [0]

        def diverged_apply(batch):
            applied[0] += 1
            if applied[0] == args.nan_grad_at_step:
                batch.grads[np.flatnonzero(batch.touched)[0], 1] = np.nan
            return apply(batch)
        DistBatch.apply = diverged_apply
    if args.huge_dense_grad_at_step and node.rank == 1:
        # Rank 1's first dense gradient of that step holds 1e20 (its square past
        # float32's range; a step that diverged with a finite loss), the other ranks'
        # are as trained: k-step Adam's gradients are each rank's own.
        from hps.distributed.dense import DenseSync
        make = DenseSync.make_optimizer

        def making(sync, factory):
            opt = make(sync, factory)
            step, steps = opt.step, [0]

            def diverging_step(*a, **kw):
                steps[0] += 1
                if steps[0] == args.huge_dense_grad_at_step:
                    next(p for p in sync.params if p.grad is not None).grad.view(-1)[0] = 1e20
                return step(*a, **kw)
            opt.step = diverging_step
            return opt
        DenseSync.make_optimizer = making
    if args.huge_shared_grad_at_step:
        # Herald: from that step on, at the first step a key is trained on both
        # ranks, each rank's gradients of such keys are 3e38: finite (each rank's
        # check lets them by), but their sum at the key's primary is an infinity.
        from hps.distributed.herald import HeraldDistBatch
        herald_apply, steps = HeraldDistBatch._apply, [0]

        def overflowing_apply(batch, *a):
            steps[0] += 1
            shared = batch._trains.sum(axis=1) > 1
            if steps[0] >= args.huge_shared_grad_at_step and shared.any():
                batch._grads[shared] = 3e38
            return herald_apply(batch, *a)
        HeraldDistBatch._apply = overflowing_apply
    evals = [rank_part(b, node.rank, args.per_rank) for b in global_batches(2, args.per_rank, node.size, seed=77)] \
        if args.eval_every else []
    summary = train(cfg, resume=args.resume, progress=False, train_batches=mine, eval_batches=evals, node=node)
    if "finished_before" in summary:  # resumed with nothing left to train
        with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
            json.dump({"finished_before": summary["finished_before"]}, f)
        return
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"bytes_sent": summary["distributed"]["ranks"][node.rank]["bytes_sent"],
                   "batches": summary["batches"], "examples": summary["examples"],
                   "merges": summary["distributed"]["dense_merges"],
                   "prefetch_waits": summary["pipeline"]["prefetch_waits"],
                   "herald": summary["ps"].get("herald"), "admission": summary["admission"],
                   "codecs": summary["ps"]["distributed"]["codecs"],
                   "fresh_rows": summary["ps"]["distributed"]["fresh_rows_sent_as_bits"],
                   "mem": {k: summary["ps"]["mem"][k] for k in ("hits", "misses", "evictions", "lookahead_slides",
                                                                "lookahead_spared", "lookahead_forced")},
                   "evals": [{k: h.get(k) for k in ("batches", "auc", "logloss")} for h in summary["history"]]}, f)


def run_kstep(node, out: str, args) -> None:
    import torch
    from hps.distributed import DenseSync, DistributedConfig
    config = DistributedConfig(dense_sync="kstep", k=args.k, beta1=args.beta1, beta2=0.99, eps=1e-8,
                               hierarchical=args.hierarchical)
    x = torch.nn.Parameter(torch.from_numpy(KSTEP_X0.copy()))
    sync = DenseSync(node, [x], lr=0.05, config=config)
    opt = sync.make_optimizer(None)
    xs, vs, ms = [], [], []
    for t in range(args.steps):
        opt.zero_grad()
        x.grad = torch.from_numpy(kstep_gradient(node.rank, t, x.detach().numpy()))
        opt.step()
        sync.after_step()
        st = opt.state[x]
        xs.append(x.detach().numpy().copy())
        vs.append(st["v"].numpy().copy())
        ms.append(st["m"].numpy().copy())
    np.savez(os.path.join(out, f"rank{node.rank}.npz"), x=np.array(xs), v=np.array(vs), m=np.array(ms),
             dense_bytes=np.array(node.bytes_sent["dense"]), merges=np.array(sync.merges))


def run_unevenallreduce(node, out: str, args) -> None:
    """hierarchical_allreduce over nodes of --node-size ranks and one of fewer
    (the last): as MPI's shared-memory split makes them of a job whose ranks are
    spread unevenly over its machines."""
    from hps.distributed import hierarchical_allreduce
    world = node.world
    node_comm = world.Split(node.rank // args.node_size, node.rank)
    cross_comm = world.Split(node_comm.Get_rank(), node.rank)
    buf = (np.arange(5, dtype=np.float64) + 1) * 10.0 ** node.rank
    hierarchical_allreduce(buf, node_comm, cross_comm)  # (finds out that the nodes differ)
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump(buf.tolist(), f)


def run_allreduce(node, out: str, args) -> None:
    bufs = {}
    for n in (1, 5, 1000):
        buf = (np.arange(n, dtype=np.float64) + 1) * (node.rank + 1)
        before = node.bytes_sent["dense"]
        node.allreduce("train", buf, "dense", "test all-reduce", hierarchical=True)
        bufs[f"sum{n}"] = buf
        bufs[f"bytes{n}"] = np.array(node.bytes_sent["dense"] - before)
    np.savez(os.path.join(out, f"rank{node.rank}.npz"), nodes=np.array(node.nodes), **bufs)


def run_fail(node, out: str, args) -> None:
    """Trains; rank 1 stops (SIGSTOP: hung) or exits (died) at its third batch."""
    from hps.train import train
    cfg = train_config(os.path.join(out, "job"), timeout=args.timeout)
    batches = global_batches(12, 32, node.size)
    mine = [rank_part(b, node.rank, 32) for b in batches]

    def source():
        for i, b in enumerate(mine):
            if i == 3 and node.rank == 1:
                if args.how == "hang":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    os._exit(3)
            yield b
    train(cfg, progress=False, train_batches=source(), eval_batches=[], node=node)


def run_rowbytes(node, out: str, args) -> None:
    """One alltoallv whose rows are 16 bytes on rank 0 and 12 on rank 1 (a peer of
    another layout); each rank writes what it received or the error it raised. Then
    one whose rows of another size go one way only: rank 0 sends rows, rank 1 none."""
    width = 4 if node.rank == 0 else 3
    result = {}
    for name, rows in (("error", 2), ("one_way", 2 if node.rank == 0 else 0)):
        blocks = [np.full((rows, width), node.rank + 1, np.float32) for _ in range(node.size)]
        try:
            got = node.alltoallv("train", blocks, "sparse_grads", "push gradients")
            result[name] = None
            result[f"{name}_shapes"] = [list(g.shape) for g in got]
        except Exception as e:  # noqa: BLE001 - written for the test
            result[name] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump(result, f)


def run_sketchmemory(node, out: str, args) -> None:
    """[admission] with a sketch this machine holds once but not once a rank, under
    a launcher that says nothing of the ranks on a machine (as srun's PMI plugins):
    only MPI's count can refuse it. Writes what train() raised, a rank."""
    import hps.train
    from hps.train import AdmissionConfig, train
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        os.environ.pop(name, None)
    sketch = 300 * 1024
    hps.train._physical_memory = lambda: sketch * node.size - 1
    cfg = train_config(os.path.join(out, "job"))
    cfg.admission = AdmissionConfig(threshold=2, sketch_bytes=sketch)
    cfg.admission.check()  # the environment's count: one rank, whose sketch fits
    try:
        train(cfg, progress=False, train_batches=[], eval_batches=[], node=node)
        error = None
    except ValueError as e:
        error = str(e)
    with open(os.path.join(out, f"rank{node.rank}.json"), "w") as f:
        json.dump({"error": error}, f)


def parse_args(argv: list):
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["pullpush", "distbatch", "badkeys", "onerankrefuses", "heraldonerankrefuses",
                                         "heraldkeys", "heraldpush", "heraldflush",
                                         "heraldtable", "heraldrandom",
                                         "heraldretry", "train", "kstep", "allreduce", "unevenallreduce", "fail", "sketchmemory", "rowbytes",
                                         "otherseed", "pushstep", "lookaheadorder", "alltoallvrefuses",
                                         "ownerrefuses", "heraldrefusesafter", "openbatchpush"])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--optimizer", default="adagrad")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--per-rank", type=int, default=48)
    ap.add_argument("--dense-sync", default="allreduce")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--beta1", type=float, default=0.0)
    ap.add_argument("--hierarchical", action="store_true")
    ap.add_argument("--ranks-per-node", type=int, default=0)
    ap.add_argument("--node-size", type=int, default=1, help="unevenallreduce: the ranks of a node but the last")
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--uneven", action="store_true")
    ap.add_argument("--multi-hot", action="store_true")
    ap.add_argument("--empty-bags-at", type=int, default=-1, help="the step whose last rank's multi-hot bags are "
                    "all empty")
    ap.add_argument("--mem-budget", default="256KiB")
    ap.add_argument("--fresh-windows", action="store_true",
                    help="train: each prefetch's lookahead window as fresh arrays (set anew, never slid)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--how", default="hang")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0, help="evaluations every N steps, inside the step")
    ap.add_argument("--die-at-checkpoint", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--fail-at-step", type=int, default=0)
    ap.add_argument("--fail-in-step", type=int, default=0, help="rank 1's train stage raises at that step")
    ap.add_argument("--nan-grad-at-step", type=int, default=0, help="rank 1's sparse gradients of that step hold a NaN")
    ap.add_argument("--huge-dense-grad-at-step", type=int, default=0,
                    help="rank 1's first dense gradient of that step holds 1e20")
    ap.add_argument("--huge-shared-grad-at-step", type=int, default=0,
                    help="Herald: from that step, the first one with keys both ranks train, their gradients are 3e38")
    ap.add_argument("--rank1-config", default="", help="rank 1 runs another 'dense_lr' or 'sparse_grads', or "
                    "trains on data of other fields ('multi_hot')")
    ap.add_argument("--fail-open", default="", help="rank 1's server fails to open: 'disk' (OSError) or 'corrupt'")
    ap.add_argument("--lookahead", type=int, default=0, help="[ps] lookahead (batches)")
    ap.add_argument("--admission", type=int, default=0, metavar="F", help="[admission] threshold = F")
    ap.add_argument("--sparse-codec", default="none", help="[distributed] sparse_rows and sparse_grads")
    ap.add_argument("--seed", type=int, default=0, help="heraldrandom: the seed of its events")
    ap.add_argument("--herald", type=int, default=0, metavar="ROWS",
                    help="schedule = 'herald' with caches of ROWS rows a rank")
    ap.add_argument("--owner", type=int, default=0, help="lookaheadorder: the rank whose MEM-PS is watched")
    ap.add_argument("--device-capacity", type=int, default=0, help="[ps] device_capacity (rows a device)")
    ap.add_argument("--only", default="", help="alltoallvrefuses, ownerrefuses, heraldrefusesafter: the cases "
                    "to run (comma-separated names; default: all)")
    ap.add_argument("--fail-ranks", default="", help="heraldretry: the ranks (comma-separated) whose MEM-PS is "
                    "full once")
    return ap.parse_args(argv)


def run_job(args) -> None:
    """One job (scenario) on a Node of its own, closed at its end."""
    from hps.distributed import DistributedConfig, Node
    node = Node(DistributedConfig(ranks_per_node=args.ranks_per_node, timeout=args.timeout))
    os.makedirs(args.out, exist_ok=True)
    import hps.train
    abort_rank = hps.train._abort_rank

    def recorded_abort(node_, e):
        # The error this rank ends the job with, written before its MPI_Abort (which
        # ends the process before the handler below could); the first only (another
        # stage that raised after it, its consequence, would truncate the file).
        try:
            with open(os.path.join(args.out, f"rank{node.rank}.raised"), "x") as f:
                f.write(f"{type(e).__name__}: {e}\n")
        except FileExistsError:
            pass
        abort_rank(node_, e)
    hps.train._abort_rank = recorded_abort
    try:
        globals()[f"run_{args.scenario}"](node, args.out, args)
    except BaseException as e:
        # Each rank's error on its own: mpiexec forwards the ranks' stderr in chunks
        # that may interleave inside a line, so a test reads what a rank raised here.
        with open(os.path.join(args.out, f"rank{node.rank}.raised"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        raise
    node.close()
    hps.train._abort_rank = abort_rank  # (a batch's next job records its own)


# ---------------------------------------------------------------- several jobs in one launch

# What a batch may run: jobs that end normally and leave nothing of theirs behind in
# the process (no option below, which patches hps or fails on purpose; no --resume,
# which a test means to start in processes of its own).
BATCH_SCENARIOS = ("train", "kstep")
NOT_IN_A_BATCH = ("die_at_checkpoint", "rank1_config", "fail_open", "fresh_windows", "fail_at_step", "fail_in_step",
                  "nan_grad_at_step", "resume")


def batch_jobs(jobs: list) -> list:
    """The parsed args of each job ([scenario, out, *options]) of a batch; refuses a
    job a batch may not run, naming it."""
    parsed = []
    for i, job in enumerate(jobs):
        args = parse_args([str(a) for a in job])
        bad = [o for o in NOT_IN_A_BATCH if getattr(args, o)]
        if args.scenario not in BATCH_SCENARIOS or bad:
            raise SystemExit(f"mpi_scenarios.py batch: job {i} ({' '.join(map(str, job))}) cannot share its "
                             f"processes: {bad or args.scenario}; launch it alone")
        parsed.append(args)
    return parsed


def run_batch(path: str) -> None:
    """``mpi_scenarios.py batch FILE``: the jobs FILE (JSON) lists, one after the
    other in the same ranks, each as its own launch would run it, with a Node of
    its own; the launch's import of torch, hps and mpi4py (most of a small job's
    CPU time) is then paid once. Each rank marks each job begun and done in FILE's
    directory (``began<i>.rank<r>``, ``done<i>.rank<r>``), so that the launcher
    can tell the job that failed from those that never began."""
    from mpi4py import MPI
    with open(path) as f:
        jobs = batch_jobs(json.load(f))
    rank, where = MPI.COMM_WORLD.Get_rank(), os.path.dirname(os.path.abspath(path))
    for i, args in enumerate(jobs):
        open(os.path.join(where, f"began{i}.rank{rank}"), "w").close()
        run_job(args)
        open(os.path.join(where, f"done{i}.rank{rank}"), "w").close()


def main() -> None:
    if sys.argv[1:2] == ["batch"]:
        run_batch(sys.argv[2])
    else:
        run_job(parse_args(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
