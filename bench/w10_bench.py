"""W10 (issue 18, part): Hierarchical Training's codecs and dense replicas on this machine.

    python3 bench/w10_bench.py --quick        # 30k training examples a job, 2 rounds
    python3 bench/w10_bench.py                # 200k, 3 rounds
    python3 bench/w10_bench.py --rounds 5 --only codec:none/none,allreduce:4,replicas:1x4

Workloads, each one `hps train` job on synthetic Criteo-like data (the same examples,
held-out set and seeds in every run; MLP 429 -> 512 -> 256 -> 1, batch 1024):
  reference      today's training, one process
  codec:A/G      one group of a trainer and a group PS holding the first two Linears
                 (vertical, horizontal), activations through codec A, gradients
                 through G: bytes per step each way before and after, AUC change
  hogwild:2      codec:none/none with 2 Hogwild nets on the trainer (`nets = 2`: two
                 threads on one shared copy of its layers, each on half of a batch)
  allreduce:4    today's training under `mpiexec -n 4` (no [hierarchical]): the
                 all-reduce peer of the two below at the same rank count
  replicas:1x4   one group of 4 trainers (one dense replica, gradients all-reduced)
  replicas:4x1   4 groups of one trainer (4 replicas) and a centre, EASGD every step
                 (alpha 0.1): the paper's Observation 2.1 on our data
AUC and logloss are measured on the held-out examples; examples/s is measured but on
2 shared cores with every rank a process it says little about a cluster (the group
PS computes on the same cores as its trainer).

Rounds. The jobs run interleaved, every job once a round, the order rotated by one each
round (round r starts at job r), so a slow spell of the shared machine falls on other
jobs each time. A job's examples/s is the median (min-max) over the rounds; the ratios
(HT against all-reduce at 4 ranks; each codec, and Hogwild, against the uncompressed
split) are taken within each round and given as their median (min-max) and each round's.
AUC, logloss, bytes and the plan must repeat exactly in every round for the jobs without
background averaging or Hogwild nets (a job that does not is a problem: the bench exits 1
naming it); for the EASGD job, whose corrections land whenever the background thread has
them, and the Hogwild job, whose nets' lock-free updates interleave as the threads are
scheduled, a figure that moves is the median with each round's value beside it
(`<field>_runs`).

Modelled against measured, per node of each codec job and of the Hogwild job (one
trainer, one group PS):
  modelled  the planner's step for the plan the job ran (planner.node_costs on the
            job's own config): FLOPs (6 * B * in * out a Linear), CPU seconds = FLOPs at
            a rate measured here (below), network bytes from the codecs' bytes per
            value, and network seconds at the planner's default 10 Gb/s: modelled only,
            there is no network between ranks on one machine.
  measured  group PS: the CPU time (all its threads) spent handling the trainer's
            training requests (forward with activations kept, backward, step), timed
            around GroupPsServer.handle in the PS's process; beside it the whole
            process's CPU and wall time (train_hierarchical's cpu_seconds and
            wall_seconds: evaluation, start-up and the sleeping poll for requests in them too).
            trainer: its whole process's CPU and wall time (the same fields). Data,
            embeddings, the sparse rows, the loss, the codecs, waiting and evaluation
            are in it; the planner models only the dense layer it holds (fc2, 256 -> 1),
            so its ratio says how much of a trainer the model leaves out.
            bytes: the codec payloads of the training requests and replies as the codecs
            count them (not MPI's envelopes), in the PS's process; a trainer's link
            carries its PSs' sum.
  A step is batch_size (1,024) training examples: totals * 1,024 / examples.
  The rate: FLOPs per CPU second of one torch thread multiplying (1024 x 429) by
  (429 x 512) float32 (the first Linear's forward), measured before each round; each
  round's modelled seconds use that round's rate, and the ratios are paired by round.

Prints one JSON line per job as it ends, then one line with all of them
("benchmark": "W10 ...", provenance), also written to bench/results/w10-DATE.json
unless --no-save; `python3 bench/report.py --add FILE` files it under
docs/results/w10.jsonl.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _provenance import provenance, save_result  # bench/ is sys.path[0]


BASE = """hidden = [512, 256]
dense_lr = 0.001
torch_threads = 1
[ps]
dim = 16
path = "{path}"
mem_budget = "64MiB"
[ps.optimizer]
kind = "adagrad"
lr = 0.05
[data]
source = "synthetic"
batch_size = 1024
train_examples = {examples}
eval_examples = {eval_examples}
"""

BATCH = 1024
CALIBRATION = (BATCH, 429, 512)  # (B, in, out) of the timed matmul: the first Linear's forward
SPLIT = ["ps:vertical", "ps:horizontal", "trainer"]
# Figures that repeat exactly from round to round unless the job averages in the background
# or runs Hogwild nets.
REPEATABLE = ("auc", "logloss", "examples", "bytes_per_step", "plan", "roles", "nets", "exchanges")
# (workload, peer): examples/s ratios taken within each round.
RATIOS = [("replicas:1x4", "allreduce:4"), ("replicas:4x1", "allreduce:4")] + \
    [(w, "codec:none/none") for w in ("codec:bf16/bf16", "codec:int8/bf16", "codec:int8/topk:0.1", "hogwild:2")]
FIGURES = {
    "modelled": "the planner's step for the plan the job ran (planner.node_costs on the job's config): FLOPs, CPU "
                "seconds at the rate measured here (flops_per_cpu_second), network bytes from the codecs' bytes per "
                "value, network seconds at the planner's default bandwidth (no network here)",
    "measured": "group PS: CPU time handling the trainer's training requests (timed around GroupPsServer.handle), "
                "and its whole process's CPU and wall time; trainer: its whole process's CPU and wall time (data, "
                "embeddings, sparse rows, codecs, evaluation: more than the one dense layer the planner gives it); "
                "bytes: the codec payloads of the training requests and replies, counted in the PS's process",
    "per_step": "per batch_size training examples: totals * batch_size / examples",
}


def workloads(quick: bool) -> list:
    """(name, ranks, [hierarchical] TOML or None, whether its quality may move between rounds: background
    averaging, or Hogwild nets' interleaved updates)."""
    split = f"placement = {json.dumps(SPLIT)}\n"
    out = [("reference", 1, None, False)]
    for a, g in (("none", "none"), ("bf16", "bf16"), ("int8", "bf16"), ("int8", "topk:0.1")):
        out.append((f"codec:{a}/{g}", 2, f'group_ps = 1\nactivations = "{a}"\ngradients = "{g}"\n{split}', False))
    out.append(("hogwild:2", 2, f'group_ps = 1\nactivations = "none"\ngradients = "none"\nnets = 2\n{split}', True))
    out.append(("allreduce:4", 4, None, False))
    out.append(("replicas:1x4", 4, "groups = 1\n", False))
    out.append(("replicas:4x1", 5, "groups = 4\nalpha = 0.1\nperiod = 1\n", True))
    return out


def run(name: str, ranks: int, ht, examples: int, eval_examples: int, tmp: str) -> dict:
    """One job: its rank 0's figures, and under "nodes_raw" those of its group PSs and
    centre (each writes a file of its own beside rank 0's)."""
    path = os.path.join(tmp, name.replace(":", "_").replace("/", "_"))
    cfg = BASE.format(path=path, examples=examples, eval_examples=eval_examples)
    if ht is not None:
        cfg += "[hierarchical]\n" + ht
    toml = path + ".toml"
    with open(toml, "w") as f:
        f.write(cfg)
    out = path + ".json"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", toml, out]
    if ranks > 1 or ht is not None:
        cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(ranks)] + cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{name}: {' '.join(cmd)} exited {p.returncode}\n{p.stderr[-3000:]}")
    with open(out) as f:
        res = json.load(f)
    others = []
    for other in glob.glob(out + ".rank*"):
        with open(other) as f:
            others.append(json.load(f))
    if others:
        res["nodes_raw"] = sorted(others, key=lambda x: x["rank"])
    res.update(workload=name, ranks=ranks, wall_seconds=round(time.monotonic() - t0, 1), toml=toml)
    return res


def _time_group_ps_requests() -> dict:
    """Times GroupPsServer.handle in this process: CPU time (time.process_time, every
    thread) and codec payload bytes in and out, by kind of request. "train": forward
    with the activations kept, backward, step; "eval": forward without; "other":
    state and stop. Returns the dict it fills as requests come."""
    from hps.hierarchical import split_mlp
    from hps.hierarchical.codecs import Encoded
    stats = {k: {"requests": 0, "cpu_seconds": 0.0, "bytes_in": 0, "bytes_out": 0} for k in ("train", "eval", "other")}
    handle = split_mlp.GroupPsServer.handle

    def timed(self, src, msg):
        c0 = time.process_time()
        reply = handle(self, src, msg)
        spent = time.process_time() - c0
        op = msg[0]
        s = stats["eval" if op == "forward" and not msg[4] else
                  "train" if op in ("forward", "backward", "step") else "other"]
        s["requests"] += 1
        s["cpu_seconds"] += spent
        if op in ("forward", "backward"):
            s["bytes_in"] += msg[3].nbytes
        if isinstance(reply, Encoded):
            s["bytes_out"] += reply.nbytes
        return reply

    split_mlp.GroupPsServer.handle = timed
    return stats


def worker(toml: str, out: str) -> None:
    """One rank of a workload's job; rank 0 writes what the table needs, a group PS or
    the centre its own figures to OUT.rankN."""
    from hps.config import load_toml
    from hps.train import TrainConfig, train
    raw = load_toml(toml)
    ht_table = raw.pop("hierarchical", None)
    cfg = TrainConfig.from_dict(raw, source=toml)
    if ht_table is None:
        summary = train(cfg, progress=False)
        if summary.get("distributed", {}).get("rank", 0) != 0:
            return  # under mpiexec rank 0 writes what the table needs
        res = {}
    else:
        import torch
        from mpi4py import MPI
        from hps.hierarchical.roles import HierarchicalConfig, train_hierarchical
        requests = _time_group_ps_requests()
        summary = train_hierarchical(cfg, HierarchicalConfig.from_dict(ht_table), progress=False)
        rank = MPI.COMM_WORLD.Get_rank()
        if summary.get("role") in ("group_ps", "centre"):
            node = {k: summary.get(k) for k in ("role", "group", "index", "steps", "exchanges", "corrections",
                                                "bytes", "cpu_seconds", "wall_seconds")}
            node.update(rank=rank, torch_threads=torch.get_num_threads(),
                        requests=requests if summary["role"] == "group_ps" else None)
            with open(f"{out}.rank{rank}", "w") as fh:
                json.dump(node, fh)
            return
        if "final" not in summary or summary.get("distributed", {}).get("rank", 0) != 0:
            return
        h = summary["hierarchical"]
        steps = max(1, summary["batches"])
        res = {"plan": h["plan"], "roles": h["roles"], "nets": h.get("nets", 1), "exchanges": h.get("exchanges", 0),
               "bytes_per_step": {k: {"before": round(v["before"] / steps), "after": round(v["after"] / steps)}
                                  for k, v in h["bytes"].items() if v["before"]},
               "trainer_raw": {"rank": rank, "steps": summary["batches"], "bytes": h["bytes"],
                               "cpu_seconds": h.get("cpu_seconds"), "wall_seconds": h.get("wall_seconds"),
                               "torch_threads": torch.get_num_threads()}}
    f = summary["final"]
    res.update(auc=round(f["auc"], 5), logloss=round(f["logloss"], 5), examples=summary["examples"],
               examples_per_s=round(summary["examples_per_s"]))
    with open(out, "w") as fh:
        json.dump(res, fh)


# ---------------------------------------------------------------- modelled vs measured
def flops_per_cpu_second(repeats: int = 5, calls: int = 10) -> float:
    """The planner's per-FLOP rate for this machine: FLOPs per CPU second of one torch
    thread multiplying (B x in) by (in x out) float32, the median of `repeats` timings
    of `calls` products (CPU time, so another process on the cores does not slow it)."""
    import torch
    torch.set_num_threads(1)
    b, n_in, n_out = CALIBRATION
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(b, n_in, generator=gen), torch.randn(n_in, n_out, generator=gen)
    for _ in range(3):
        torch.mm(x, w)
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        for _ in range(calls):
            torch.mm(x, w)
        times.append((time.process_time() - c0) / calls)
    return 2.0 * b * n_in * n_out / statistics.median(times)


def node_round(res: dict, rate: float, problems: list) -> list | None:
    """One round of a codec job, per node: the planner's figures for the plan it ran at
    `rate` FLOP/s, and what the job measured, per step. None for a job without a group PS."""
    ps = [n for n in res.get("nodes_raw", []) if n["role"] == "group_ps"]
    t = res.get("trainer_raw")
    if not ps or t is None:
        return None
    from hps.hierarchical.planner import load_plan_config, node_costs
    from hps.hierarchical.roles import parse_placement, placement_name
    from hps.hierarchical.split_mlp import SplitPlan
    from hps.config import load_toml
    name = res["workload"]
    shapes, cfg = load_plan_config(res["toml"])
    cfg.trainer_flops = cfg.ps_flops = rate
    placement = load_toml(res["toml"])["hierarchical"]["placement"]
    plan = SplitPlan([parse_placement(s) for s in placement], cfg.group_ps)
    ran = [placement_name(p) for p in plan.fcs]  # (as the job's summary names them)
    if ran != res["plan"]:
        problems.append(f"{name}: the job reports plan {res['plan']}, its config places {ran}")
    modelled = node_costs(shapes, plan, cfg)
    per_step = cfg.batch_size / res["examples"]
    # The payloads each side counted agree: the trainer's sends are the PSs' requests,
    # the PSs' sends their replies (training and evaluation both).
    sent = sum(v["after"] for k, v in t["bytes"].items() if k in ("activations", "gradients"))
    got = sum(r["bytes_in"] for n in ps for r in n["requests"].values())
    if sent != got:
        problems.append(f"{name}: the trainer counted {sent} bytes sent, its group PSs {got} received")
    for n in ps:
        back = sum(v["after"] for k, v in n["bytes"].items() if k in ("activations", "gradients"))
        if back != sum(r["bytes_out"] for r in n["requests"].values()):
            problems.append(f"{name}: group PS {n['index']} counted {back} bytes sent, its requests' replies "
                            f"{sum(r['bytes_out'] for r in n['requests'].values())}")
    link = {n["index"]: n["requests"]["train"]["bytes_in"] + n["requests"]["train"]["bytes_out"] for n in ps}
    nodes = []
    for m in modelled:
        if m["node"] == "trainer":
            raw = t
            cpu = None if t["cpu_seconds"] is None else t["cpu_seconds"] * per_step
            process_cpu = cpu
            net = sum(link.values()) * per_step
        else:
            raw = next(n for n in ps if f"ps{n['index']}" == m["node"])
            cpu = raw["requests"]["train"]["cpu_seconds"] * per_step
            process_cpu = None if raw["cpu_seconds"] is None else raw["cpu_seconds"] * per_step
            net = link[raw["index"]] * per_step
        nodes.append({"node": m["node"], "rank": raw["rank"], "layers": m["layers"],
                      "torch_threads": raw.get("torch_threads"),
                      "modelled": {"flops_per_step": m["flops"], "cpu_s_per_step": m["cpu_s"],
                                   "net_bytes_per_step": m["net_bytes"], "net_s_per_step": m["net_s"],
                                   "memory_bytes": m["memory"]},
                      "measured": {"cpu_s_per_step": cpu, "process_cpu_s_per_step": process_cpu,
                                   "process_wall_s_per_step": None if raw["wall_seconds"] is None
                                   else raw["wall_seconds"] * per_step,
                                   "net_bytes_per_step": net}})
    return nodes


def sig(v, digits: int = 6):
    return None if v is None else float(f"{v:.{digits}g}")


def stat(values: list, digits: int = 6) -> dict | None:
    """{"median", "min", "max", "runs"} of one figure over the rounds (runs in round order)."""
    if not values or any(v is None for v in values):
        return None
    return {"median": sig(statistics.median(values), digits), "min": sig(min(values), digits),
            "max": sig(max(values), digits), "runs": [sig(v, digits) for v in values]}


def node_summary(rounds: list) -> list:
    """Per node over the rounds: modelled and measured per step, medians (min-max) with
    each round's, and measured / modelled paired by round."""
    out = []
    for k, first in enumerate(rounds[0]):
        per = [r[k] for r in rounds]
        mod = [p["modelled"] for p in per]
        mea = [p["measured"] for p in per]
        cpu_ratio = [None if b["cpu_s_per_step"] is None else b["cpu_s_per_step"] / a["cpu_s_per_step"]
                     for a, b in zip(mod, mea)]
        proc_ratio = [None if b["process_cpu_s_per_step"] is None else b["process_cpu_s_per_step"] / a["cpu_s_per_step"]
                      for a, b in zip(mod, mea)]
        out.append({
            "node": first["node"], "rank": first["rank"], "layers": first["layers"],
            "torch_threads": first["torch_threads"],
            "modelled": {"flops_per_step": mod[0]["flops_per_step"],
                         "cpu_s_per_step": stat([m["cpu_s_per_step"] for m in mod]),
                         "net_bytes_per_step": round(mod[0]["net_bytes_per_step"]),
                         "net_s_per_step": sig(mod[0]["net_s_per_step"]),
                         "memory_bytes": round(mod[0]["memory_bytes"])},
            "measured": {"cpu_s_per_step": stat([m["cpu_s_per_step"] for m in mea]),
                         "cpu_is": "whole process" if first["node"] == "trainer" else "training requests served",
                         "process_cpu_s_per_step": stat([m["process_cpu_s_per_step"] for m in mea]),
                         "process_wall_s_per_step": stat([m["process_wall_s_per_step"] for m in mea]),
                         "net_bytes_per_step": statistics.median(round(m["net_bytes_per_step"]) for m in mea)},
            "cpu_measured_over_modelled": stat(cpu_ratio),
            "process_cpu_measured_over_modelled": stat(proc_ratio),
            "net_bytes_measured_over_modelled": sig(statistics.median(m["net_bytes_per_step"] for m in mea)
                                                    / mod[0]["net_bytes_per_step"])
            if mod[0]["net_bytes_per_step"] else None})
    return out


# ---------------------------------------------------------------- rounds
def summarise(name: str, runs: list, background: bool, problems: list) -> dict:
    """One workload over its rounds (runs in round order)."""
    first = runs[0]
    res = {k: v for k, v in first.items() if k not in ("nodes_raw", "trainer_raw", "toml", "round", "nodes")}
    varies = []
    for field in REPEATABLE:
        values = [r.get(field) for r in runs]
        if all(v == values[0] for v in values):
            continue
        if not background:
            problems.append(f"{name}: {field} differs between rounds: {values}")
            continue
        varies.append(field)
        res[f"{field}_runs"] = values
        if field == "bytes_per_step":
            res[field] = {kind: {side: statistics.median(v.get(kind, {}).get(side, 0) for v in values)
                                 for side in ("before", "after")} for kind in values[0]}
        elif all(isinstance(v, (int, float)) for v in values):
            res[field] = statistics.median(values)
    if varies:
        res["varies_across_rounds"] = varies
    rates = [r["examples_per_s"] for r in runs]
    res.update(examples_per_s=round(statistics.median(rates)), examples_per_s_min=min(rates),
               examples_per_s_max=max(rates), examples_per_s_runs=rates,
               wall_seconds=statistics.median(r["wall_seconds"] for r in runs),
               wall_seconds_runs=[r["wall_seconds"] for r in runs])
    nodes = [r["nodes"] for r in runs if r.get("nodes")]
    if nodes:
        res["nodes"] = node_summary(nodes)
    return res


def ratios(by_name: dict) -> list:
    """examples/s of each (workload, peer) pair, taken within each round."""
    out = []
    for a, b in RATIOS:
        if a in by_name and b in by_name:
            runs = [x["examples_per_s"] / y["examples_per_s"] for x, y in zip(by_name[a], by_name[b])]
            out.append({"workload": a, "peer": b, "what": "examples/s, workload / peer, same round", **stat(runs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of every job (default 3; 2 with --quick)")
    ap.add_argument("--only", help="comma-separated workload names (default: all)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("TOML", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    rounds = a.rounds if a.rounds is not None else 2 if a.quick else 3
    if rounds < 1:
        ap.error("--rounds must be >= 1")
    examples, eval_examples = (30_000, 10_000) if a.quick else (200_000, 50_000)
    chosen = set(a.only.split(",")) if a.only else None
    jobs = [w for w in workloads(a.quick) if not chosen or w[0] in chosen]
    if chosen and chosen - {w[0] for w in jobs}:
        ap.error(f"--only: unknown workload(s) {', '.join(sorted(chosen - {w[0] for w in jobs}))}; known: "
                 f"{', '.join(w[0] for w in workloads(a.quick))}")
    by_name: dict = {w[0]: [] for w in jobs}
    rates, problems = [], []
    with tempfile.TemporaryDirectory(prefix="hps-w10-") as tmp:
        for r in range(rounds):
            rate = flops_per_cpu_second()
            rates.append(rate)
            folder = os.path.join(tmp, f"round{r + 1}")
            os.makedirs(folder)
            for name, ranks, ht, _ in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
                res = run(name, ranks, ht, examples, eval_examples, folder)
                res["round"] = r + 1
                nodes = node_round(res, rate, problems)
                if nodes is not None:
                    res["nodes"] = nodes
                by_name[name].append(res)
                print(json.dumps({k: v for k, v in res.items() if k not in ("nodes_raw", "trainer_raw", "toml")}),
                      flush=True)
    lines = [summarise(name, by_name[name], background, problems) for name, _, _, background in jobs]
    ref = next((x for x in lines if x["workload"] == "reference"), None)
    for res in lines:
        if ref is not None and res is not ref:
            res["auc_change_vs_reference"] = round(res["auc"] - ref["auc"], 5)
    out = {"benchmark": "W10 hierarchical training", "quick": a.quick, "examples": examples,
           "eval_examples": eval_examples, "batch_size": BATCH, "rounds": rounds,
           "order": "interleaved: every job once a round, the order rotated by one each round",
           "workloads": lines, "ratios": ratios(by_name),
           "flops_per_cpu_second": {**stat(rates), "how": f"torch.mm ({CALIBRATION[0]} x {CALIBRATION[1]}) @ "
                                    f"({CALIBRATION[1]} x {CALIBRATION[2]}) float32, one thread, CPU time, before "
                                    "each round"},
           "figures": FIGURES, "problems": problems, "provenance": provenance()}
    line = json.dumps(out)
    print(line, flush=True)
    if problems:
        raise SystemExit("w10_bench: " + "; ".join(problems) + " (not saved)")
    if not a.no_save:
        print(f"w10_bench: wrote {save_result(line, 'w10')}", file=sys.stderr)


if __name__ == "__main__":
    main()
