"""Scenarios that tests/test_ht_split.py runs under ``mpiexec -n N`` (Hierarchical
Training, hps.hierarchical).

    mpiexec -n 3 python tests/ht_scenarios.py SCENARIO OUT_DIR

Rank 0 is the trainer, ranks 1..P the group PSs. The models, plans and inputs are
made by functions here that the test imports too, so both sides see the same numbers.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import zlib

import numpy as np

GROUP_PS = 2
LR = 0.01


def models():
    """{name: (Sequential, SplitPlan)}: each split kind, co-partitioned pairs and the
    CtrModel's MLP."""
    import torch
    from torch import nn
    from hps.hierarchical.split_mlp import FcPlacement as F, SplitPlan
    from hps.torch import mlp

    def deep():
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh(), nn.Linear(4, 12),
                             nn.ReLU(inplace=True), nn.Linear(12, 3), nn.Linear(3, 1))
    return {
        "vertical_horizontal": (deep(), SplitPlan([F("ps", "vertical"), F("ps", "horizontal"), F(), F(), F()],
                                                  GROUP_PS)),
        "pair_and_whole": (deep(), SplitPlan([F("ps", "vertical", pair=True), F("ps", "horizontal"),
                                              F("ps", "none", ps=1), F(), F()], GROUP_PS)),
        "two_pairs": (deep(), SplitPlan([F("ps", "vertical", pair=True), F("ps", "horizontal"),
                                         F("ps", "vertical", pair=True), F("ps", "horizontal"),
                                         F("ps", "none", ps=0)], GROUP_PS)),
        "ctr_mlp": (mlp(26 * 8 + 13, (64, 32), seed=3),
                    SplitPlan([F("ps", "vertical"), F("ps", "horizontal"), F()], GROUP_PS)),
    }


def inputs(name: str, width: int, step: int):
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 17 * step)
    return rng.standard_normal((8, width)).astype(np.float32), rng.random(8).astype(np.float32)


class MomentumSgd:
    """SGD with momentum (state per weight, so that a step after the first checks the
    PSs' optimizer state too). Not torch.optim: its first use imports torch._dynamo,
    4 s of CPU in every rank."""

    def __init__(self, params, lr: float = LR, momentum: float = 0.9):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.velocity = [None] * len(self.params)

    def step(self):
        import torch
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                v = self.velocity[i]
                self.velocity[i] = v = p.grad.clone() if v is None else v.mul_(self.momentum).add_(p.grad)
                p.sub_(self.lr * v)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)


def make_optimizer(params):
    return MomentumSgd(params)


def loss_of(y, labels):
    import torch
    return torch.nn.functional.binary_cross_entropy_with_logits(y.squeeze(1), torch.from_numpy(labels))


def run_split(comm, out: str) -> None:
    """For each model: two steps; rank 0 saves outputs, input gradients, every
    weight's gradient after the first backward and every weight after both steps."""
    import torch
    from hps.hierarchical.split_mlp import GroupPsServer, MpiTransport, SplitTrainer, serve
    rank = comm.Get_rank()
    saved = {}
    for name, (seq, plan) in models().items():
        if rank > 0:
            serve(comm, GroupPsServer(seq, plan, rank - 1, make_optimizer), trainers=1, idle_timeout=60)
            continue
        tr = SplitTrainer(seq, plan, MpiTransport(comm, range(1, GROUP_PS + 1), timeout=60))
        params = list(tr.parameters())
        opt = make_optimizer(params) if params else None
        width = seq[0].in_features
        for step in range(2):
            xs, labels = inputs(name, width, step)
            x = torch.from_numpy(xs).requires_grad_(True)
            y = tr(x)
            loss_of(y, labels).backward()
            if step == 0:
                saved[f"{name}/y"] = y.detach().numpy()
                saved[f"{name}/dx"] = x.grad.numpy()
                for n, (_, g) in tr.full_state().items():
                    saved[f"{name}/grad/{n}"] = g
            if opt:
                opt.step()
                opt.zero_grad()
            tr.ps_step()
        for n, (v, _) in tr.full_state().items():
            saved[f"{name}/weight/{n}"] = v
        tr.stop()
    if rank == 0:
        np.savez(os.path.join(out, "split.npz"), **saved)


def run_dead_ps(comm, out: str, how: str) -> None:
    """Group PS 1 (rank 2) hangs or is killed before answering; the trainer must end
    the job within its timeout, naming it."""
    from hps.distributed.comm import abort_job
    from hps.hierarchical.split_mlp import GroupPsServer, GroupPsTimeout, MpiTransport, SplitTrainer, serve
    import torch
    seq, plan = models()["vertical_horizontal"]
    rank = comm.Get_rank()
    # The roles with their pids, as a job's start prints them: the launcher names a
    # killed process by its pid only.
    pids = comm.allgather(os.getpid())
    if rank == 0:
        for p in (1, 2):
            sys.stderr.write(f"hps.hierarchical: group PS {p - 1}: rank {p}, pid {pids[p]}\n")
        sys.stderr.flush()
    comm.Barrier()
    if rank == 2:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
        return
    if rank == 1:
        serve(comm, GroupPsServer(seq, plan, 0, make_optimizer), trainers=1, idle_timeout=120)
        return
    tr = SplitTrainer(seq, plan, MpiTransport(comm, [1, 2], timeout=2.0))
    try:
        tr(torch.zeros(4, 6))
    except GroupPsTimeout as e:
        abort_job(comm, f"hps.hierarchical: trainer rank 0: {e}")


IDLE_SECONDS = 1.5  # how long run_idle_wait's group PS waits for its first request


def run_idle_wait(comm, out: str) -> None:
    """hps.distributed.poll.recv and the group PS's idle wait (2 ranks). Rank 1
    receives a tag-5 message that rank 0 sends after a tag-6 one (a wildcard source,
    the status filled), waits for a tag that never comes (its timeout, then serve's
    idle_timeout), then serves with no idle timeout while rank 0 sleeps
    IDLE_SECONDS before its first request; rank 1 writes what it saw to
    OUT/idle_wait.json."""
    import json
    from mpi4py import MPI
    from hps.distributed import poll
    from hps.hierarchical.split_mlp import GroupPsServer, GroupPsTimeout, serve
    seq, plan = models()["vertical_horizontal"]
    rank = comm.Get_rank()
    if rank == 0:
        time.sleep(0.2)
        comm.send("other", dest=1, tag=6)
        comm.send("hello", dest=1, tag=5)
        comm.Barrier()
        time.sleep(IDLE_SECONDS)
        comm.send(("stop",), dest=1, tag=1)
        comm.recv(source=1, tag=1)
        return
    got: dict = {}
    status = MPI.Status()
    got["first"] = [poll.recv(comm, MPI.ANY_SOURCE, 5, timeout=30, status=status), status.Get_source(),
                    status.Get_tag()]
    got["second"] = poll.recv(comm, 0, 6, timeout=30)
    for what, wait in (("timeout", lambda: poll.recv(comm, 0, 7, timeout=0.3, expired=lambda: GroupPsTimeout(
                           "group PS 0 (rank 0) did not answer the test within 0.3 s"))),
                       ("idle_timeout", lambda: serve(comm, GroupPsServer(seq, plan, 0, make_optimizer), trainers=1,
                                                      idle_timeout=0.5))):
        t0 = time.monotonic()
        try:
            wait()
            got[what] = ["returned", time.monotonic() - t0]
        except GroupPsTimeout as e:
            got[what] = [str(e), time.monotonic() - t0]
    server = GroupPsServer(seq, plan, 0, make_optimizer)
    comm.Barrier()
    cpu0, wall0 = time.process_time(), time.monotonic()
    serve(comm, server, trainers=1, idle_timeout=None)
    got["idle"] = {"cpu_seconds": time.process_time() - cpu0, "wall_seconds": time.monotonic() - wall0}
    with open(os.path.join(out, "idle_wait.json"), "w") as f:
        json.dump(got, f)


ETA = 0.05


def easgd_grad(g: int, t: int, x: np.ndarray) -> np.ndarray:
    """Group g's stochastic gradient at step t: of 0.5 |x - target_g|^2 plus noise."""
    target = np.linspace(-1, 1, x.size).astype(np.float32) * (g + 1)
    noise = np.random.default_rng(31 * g + t).standard_normal(x.size).astype(np.float32) * 0.1
    return (x - target + noise).astype(np.float32)


EASGD_X0 = np.linspace(0.5, -0.5, 12).astype(np.float32)


def run_easgd(comm, out: str, mode: str) -> None:
    """Ranks 0..G-1 are groups, rank G the centre. sync: local SGD steps and a
    foreground exchange every period (alpha 0.3, period 2, 6 steps); background:
    no training, group g holds g + 1 everywhere and a BackgroundEasgd thread
    exchanges every period of GroupAverage steps, through bf16; its corrections
    land at the steps after."""
    from hps.hierarchical.codecs import CodecStreams
    from hps.hierarchical.easgd import BackgroundEasgd, EasgdCentre, EasgdClient, EasgdConfig, GroupAverage
    rank, G = comm.Get_rank(), comm.Get_size() - 1
    if mode == "sync":
        cfg, codecs, x = EasgdConfig(alpha=0.3, period=2, mode="sync"), CodecStreams(), EASGD_X0.copy()
    else:
        cfg, codecs = EasgdConfig(alpha=0.5, period=2), CodecStreams({"averaging": "bf16"})
        x = np.full(12, rank + 1, np.float32)
    x0 = EASGD_X0.copy() if mode == "sync" else np.zeros(12, np.float32)
    if rank == G:
        centre = EasgdCentre(comm, x0, list(range(G)), cfg, codecs)
        c = centre.serve(timeout=60)
        bc = centre.counter.as_dict()["averaging"]
        np.savez(os.path.join(out, "centre.npz"), centre=c, exchanges=centre.easgd.exchanges,
                 bytes=np.array([bc["before"], bc["after"]]))
        return
    client = EasgdClient(comm, G, rank, cfg, codecs, timeout=60)
    if mode == "sync":
        for t in range(1, 7):
            x -= np.float32(ETA) * easgd_grad(rank, t, x)
            if t % cfg.period == 0:
                client.exchange(x)
        client.stop()
    else:
        avg = GroupAverage(x, BackgroundEasgd(client, x))
        for _ in range(20):
            avg.step()
            time.sleep(0.01)
        avg.finish()
    np.savez(os.path.join(out, f"group{rank}.npz"), x=x, exchanges=client.exchanges)


EASGD_GROUP_STEPS, EASGD_GROUP_ALPHA = 6, 0.3


def run_easgd_groups(comm, out: str, trainers: int, period: int) -> None:
    """G groups of `trainers` ranks each (rank g * T + t is trainer t of group g), the
    last rank the centre. Each trainer holds a copy of its group's replica x (from
    EASGD_X0), takes SGD steps on the mean of its group's gradients (trainer i's:
    easgd_grad(i, step, x), all-reduced in the group) and calls GroupAverage.step
    after each; trainer 0 of the group runs the exchange, synchronous (wait, and
    mode "sync" at the centre) so that the sequence is the model's."""
    from mpi4py import MPI
    from hps.hierarchical.easgd import BackgroundEasgd, EasgdCentre, EasgdClient, EasgdConfig, GroupAverage
    rank, T = comm.Get_rank(), trainers
    G = (comm.Get_size() - 1) // T
    cfg = EasgdConfig(alpha=EASGD_GROUP_ALPHA, period=period, mode="sync")
    easgd_comm = comm.Dup()  # the exchanges' messages apart from the group's collectives
    group_comm = comm.Split(rank // T if rank < G * T else MPI.UNDEFINED, rank)
    if rank == G * T:
        centre = EasgdCentre(easgd_comm, EASGD_X0.copy(), [g * T for g in range(G)], cfg)
        np.savez(os.path.join(out, "centre.npz"), centre=centre.serve(timeout=60), exchanges=centre.easgd.exchanges)
        return
    g = rank // T
    x = EASGD_X0.copy()
    background = None
    if rank % T == 0:
        background = BackgroundEasgd(EasgdClient(easgd_comm, G * T, g, cfg, timeout=60), x, wait=True)
    avg = GroupAverage(x, background, group_comm, root=0)
    for step in range(1, EASGD_GROUP_STEPS + 1):
        grad = easgd_grad(rank, step, x)
        group_comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
        x -= np.float32(ETA) * (grad / np.float32(T))
        avg.step()
    avg.finish()
    np.savez(os.path.join(out, f"trainer{rank}.npz"), x=x, corrections=avg.corrections,
             exchanges=background.client.exchanges if background is not None else -1)


def _mpi_scenarios():
    import importlib.util
    spec = importlib.util.spec_from_file_location("mpi_scenarios", os.path.join(os.path.dirname(__file__),
                                                                                 "mpi_scenarios.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HT_STEPS, HT_PER_RANK = 5, 48


def ht_config(groups: int, group_ps: int, placement: list, alpha: float = 0.5, **kw):
    from hps.hierarchical.roles import HierarchicalConfig
    kw = {"period": 1, "timeout": 60, **kw}
    return HierarchicalConfig(groups=groups, group_ps=group_ps, placement=placement, alpha=alpha, **kw)


def _record_averages() -> list:
    """Each synchronous average's result on this rank, as a CRC of the replica's
    bytes (AllreduceAverage._average wrapped in this process only)."""
    from hps.hierarchical.easgd import AllreduceAverage
    seen: list = []
    average = AllreduceAverage._average

    def recorded(self):
        average(self)
        seen.append(zlib.crc32(self.live.tobytes()))
    AllreduceAverage._average = recorded
    return seen


def _crash_after_checkpoint(at: int) -> None:
    """This process ends (as if killed) right after its checkpoint at batch `at`
    is recorded; the launcher ends the job's other ranks."""
    import hps.train
    checkpoint = hps.train.Trainer.checkpoint

    def crashing(self):
        checkpoint(self)
        if self.batches_done == at:
            os._exit(3)
    hps.train.Trainer.checkpoint = crashing


def run_ht_train(comm, out: str, groups: int, group_ps: int, placement: list, record: bool = True, *,
                 steps: int = HT_STEPS, checkpoint_every: int = 0, crash_after: int = 0, resume: bool = False,
                 evaluate: bool = False, **kw) -> None:
    """hps train's HT path over tests/mpi_scenarios.py's global batches (trainer t of
    the job takes part t of each); every rank writes its summary's essentials (with
    ``across = "allreduce"`` and `record`, the CRC of its replica after each average
    too). `crash_after`: trainer rank 0 dies right after its checkpoint at that
    batch; `resume`: --resume of the job at OUT/job; `evaluate`: two held-out
    batches, the final AUC in the summary."""
    import json
    from hps.hierarchical.roles import Roles, train_hierarchical
    ms = _mpi_scenarios()
    cfg = ht_config(groups, group_ps, placement, **kw)
    averages = _record_averages() if cfg.across == "allreduce" and record else None
    roles = Roles.layout(comm.Get_size(), comm.Get_rank(), cfg)
    trainers = roles.trainer_ranks()
    mine = held_out = None
    if roles.role == "trainer":
        t = trainers.index(comm.Get_rank())
        mine = [ms.rank_part(b, t, HT_PER_RANK) for b in ms.global_batches(steps, HT_PER_RANK, len(trainers))]
        held_out = ms.global_batches(2, HT_PER_RANK, 1, seed=11) if evaluate else []
    if crash_after and comm.Get_rank() == 0:
        _crash_after_checkpoint(crash_after)
    train_cfg = ms.train_config(os.path.join(out, "job"))
    train_cfg.checkpoint_every = checkpoint_every
    summary = train_hierarchical(train_cfg, cfg, resume=resume, progress=False, train_batches=mine,
                                 eval_batches=held_out, return_mlp=True)
    if roles.role == "trainer":
        mlp = summary["hierarchical"].pop("mlp")
        np.savez(os.path.join(out, f"mlp{comm.Get_rank()}.npz"), **mlp)
        summary = {"role": "trainer", "hierarchical": summary["hierarchical"], "batches": summary["batches"],
                   "final": {k: summary["final"].get(k) for k in ("auc", "logloss")}}
    if averages is not None:
        summary["averages"] = averages
    with open(os.path.join(out, f"rank{comm.Get_rank()}.json"), "w") as f:
        json.dump(summary, f)


SPARE_COMMS = 24  # communicator ids run_ht_jobs leaves free: one job's take (about 10 a rank) fits, three do not
MOST_COMMS = 20000  # run_ht_jobs' Dups stop here: an MPI without a limit this low is not tested


def _take_every_comm(most: int) -> list:
    """Dups of COMM_SELF until MPI refuses one (this process has no communicator id
    left) or `most`. (The ids are the process's: a Dup of COMM_SELF takes one as a
    Dup of the world does, without waiting on the other ranks.)"""
    from mpi4py import MPI
    held = []
    while len(held) < most:
        try:
            held.append(MPI.COMM_SELF.Dup())
        except MPI.Exception:
            break
    return held


def run_ht_jobs(comm, out: str, jobs: int, groups: int, group_ps: int, placement: list, fail_job: int = -1,
                **kw) -> None:
    """`jobs` HT jobs, one after the other, in the same processes (a trainer script
    that runs several), with only SPARE_COMMS communicator ids left free: MPI caps
    the communicators a process holds at once (MPICH: 2048), so the jobs run only
    if each frees what it made. Each job's summaries go to OUT/jobJ; every rank
    writes OUT/comms{rank}.json: the ids free before the jobs and after them.
    Job `fail_job` (on one rank: a job of several ends them all) fails once its
    communicators are made: hps.train.train raises; its error is reported too."""
    import json
    import hps.train
    from mpi4py import MPI
    held = _take_every_comm(MOST_COMMS)
    counts = comm.allgather(len(held))
    # (what the test's skip names where there is no cap to fill, or the ranks' differ)
    report = {"limit": len(held) < MOST_COMMS and len(set(counts)) == 1, "counts": counts,
              "library": " ".join(MPI.Get_library_version().split("\n", 1)[0].split())}
    if report["limit"]:
        for c in held[-SPARE_COMMS:]:
            c.Free()
        del held[-SPARE_COMMS:]
        for j in range(jobs):
            job = os.path.join(out, f"job{j}")
            os.makedirs(job, exist_ok=True)
            if j != fail_job:
                run_ht_train(comm, job, groups, group_ps, placement, record=False, **kw)
                continue
            train = hps.train.train

            def failing(*a, **k):
                raise RuntimeError(f"job {j} fails")
            hps.train.train = failing
            try:
                run_ht_train(comm, job, groups, group_ps, placement, record=False, **kw)
            except RuntimeError as e:
                report["error"] = str(e)
            finally:
                hps.train.train = train
        after = _take_every_comm(2 * SPARE_COMMS)
        report.update(before=SPARE_COMMS, after=len(after))
        held += after
    for c in reversed(held):
        c.Free()
    with open(os.path.join(out, f"comms{comm.Get_rank()}.json"), "w") as f:
        json.dump(report, f)


def main() -> None:
    from mpi4py import MPI
    scenario, out = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    if not scenario.startswith("easgd"):
        import torch
        torch.set_num_threads(1)  # three processes on a small machine
    if scenario == "split":
        run_split(comm, out)
    elif scenario == "ht_train":
        groups, group_ps = int(sys.argv[3]), int(sys.argv[4])
        # Then the placement ("-": the default) and HierarchicalConfig fields as name=value (ints as ints).
        placement = sys.argv[5].split(",") if len(sys.argv) > 5 and sys.argv[5] != "-" else []
        kw = dict(a.split("=", 1) for a in sys.argv[6:])
        if kw.pop("plan_alone_on", None) == str(comm.Get_rank()):
            # This rank's planner ends elsewhere than the others' (its refinement's time
            # limit hit at another move on a loaded machine): the first Linear on the group
            # PSs, where the planner puts only the last one there.
            import hps.hierarchical.roles as roles_module
            from hps.hierarchical.split_mlp import FcPlacement, SplitPlan
            roles_module._plan_for = lambda mlp, cfg: SplitPlan([FcPlacement("ps", "vertical"), FcPlacement()],
                                                               cfg.group_ps)
        stall = {"stall_average_on": ("hps.hierarchical.easgd", "AllreduceAverage", "_average"),
                 "stall_net_on": ("hps.hierarchical.hogwild", "HogwildNets", "_net_step"),
                 "stall_reduce_on": ("hps.hierarchical.roles", "_HtDenseSync", "reduce_gradients"),
                 "stall_broadcast_on": ("hps.hierarchical.roles", "_HtDenseSync", "broadcast_parameters"),
                 "stall_land_on": ("hps.hierarchical.easgd", "GroupAverage", "_land"),
                 "stall_share_on": ("hps.hierarchical.hogwild", "HogwildNets", "_share_replica")}
        for name, (module, cls, method) in stall.items():
            if kw.pop(name, None) == str(comm.Get_rank()):
                # This rank stops taking part in a collective (its average across groups, its
                # Hogwild nets' gradients or replica, its group's gradients, first parameters or
                # correction): it hangs there, alive, until the job ends.
                import importlib
                setattr(getattr(importlib.import_module(module), cls), method,
                        lambda *a, **k: time.sleep(600))
        run_ht_train(comm, out, groups, group_ps, placement,
                     **{k: int(v) if v.isdigit() else v for k, v in kw.items()})
    elif scenario == "ht_jobs":
        # JOBS, GROUPS, GROUP_PS, the placement ("-": the default), then name=value as ht_train's.
        jobs, groups, group_ps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        placement = sys.argv[6].split(",") if sys.argv[6] != "-" else []
        kw = dict(a.split("=", 1) for a in sys.argv[7:])
        run_ht_jobs(comm, out, jobs, groups, group_ps, placement,
                    **{k: int(v) if v.isdigit() else v for k, v in kw.items()})
    elif scenario == "easgd_groups":
        run_easgd_groups(comm, out, int(sys.argv[3]), int(sys.argv[4]))
    elif scenario in ("easgd_sync", "easgd_background"):
        run_easgd(comm, out, scenario.split("_", 1)[1])
    elif scenario == "idle_wait":
        run_idle_wait(comm, out)
    elif scenario in ("dead_ps_hang", "dead_ps_kill"):
        run_dead_ps(comm, out, scenario.rsplit("_", 1)[1])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
