"""W10 (issue 18, part): Hierarchical Training's codecs and dense replicas on this machine.

    python3 bench/w10_bench.py --quick        # 30k training examples a run
    python3 bench/w10_bench.py                # 200k

Workloads, each one `hps train` job on synthetic Criteo-like data (the same examples,
held-out set and seeds in every run; MLP 429 -> 512 -> 256 -> 1, batch 1024):
  reference      today's training, one process
  codec:A/G      one group of a trainer and a group PS holding the first two Linears
                 (vertical, horizontal), activations through codec A, gradients
                 through G: bytes per step each way before and after, AUC change
  allreduce:4    today's training under `mpiexec -n 4` (no [hierarchical]): the
                 all-reduce peer of the two below at the same rank count
  replicas:1x4   one group of 4 trainers (one dense replica, gradients all-reduced)
  replicas:4x1   4 groups of one trainer (4 replicas) and a centre, EASGD every step
                 (alpha 0.1): the paper's Observation 2.1 on our data
AUC and logloss are measured on the held-out examples; examples/s is measured but on
2 shared cores with every rank a process it says little about a cluster (the group
PS computes on the same cores as its trainer).

Prints one JSON line per workload as it ends, then one line with all of them
("benchmark": "W10 ...", provenance), also written to bench/results/w10-DATE.json
unless --no-save; `python3 bench/report.py --add FILE` files it under
docs/results/w10.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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


def workloads(quick: bool) -> list:
    """(name, ranks, [hierarchical] TOML or None)."""
    split = 'placement = ["ps:vertical", "ps:horizontal", "trainer"]\n'
    out = [("reference", 1, None)]
    for a, g in (("none", "none"), ("bf16", "bf16"), ("int8", "bf16"), ("int8", "topk:0.1")):
        out.append((f"codec:{a}/{g}", 2, f'group_ps = 1\nactivations = "{a}"\ngradients = "{g}"\n{split}'))
    out.append(("allreduce:4", 4, None))
    out.append(("replicas:1x4", 4, "groups = 1\n"))
    out.append(("replicas:4x1", 5, "groups = 4\nalpha = 0.1\nperiod = 1\n"))
    return out


def run(name: str, ranks: int, ht, examples: int, eval_examples: int, tmp: str) -> dict:
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
    res.update(workload=name, ranks=ranks, wall_seconds=round(time.monotonic() - t0, 1))
    return res


def worker(toml: str, out: str) -> None:
    """One rank of a workload's job; rank 0 writes what the table needs."""
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
        from hps.hierarchical.roles import HierarchicalConfig, train_hierarchical
        summary = train_hierarchical(cfg, HierarchicalConfig.from_dict(ht_table), progress=False)
        if "final" not in summary or summary.get("distributed", {}).get("rank", 0) != 0:
            return
        h = summary["hierarchical"]
        steps = max(1, summary["batches"])
        res = {"plan": h["plan"], "roles": h["roles"], "exchanges": h.get("exchanges", 0),
               "bytes_per_step": {k: {"before": round(v["before"] / steps), "after": round(v["after"] / steps)}
                                  for k, v in h["bytes"].items() if v["before"]}}
    f = summary["final"]
    res.update(auc=round(f["auc"], 5), logloss=round(f["logloss"], 5), examples=summary["examples"],
               examples_per_s=round(summary["examples_per_s"]))
    with open(out, "w") as fh:
        json.dump(res, fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", help="comma-separated workload names (default: all)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("TOML", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    examples, eval_examples = (30_000, 10_000) if a.quick else (200_000, 50_000)
    chosen = set(a.only.split(",")) if a.only else None
    lines = []
    with tempfile.TemporaryDirectory(prefix="hps-w10-") as tmp:
        for name, ranks, ht in workloads(a.quick):
            if chosen and name not in chosen:
                continue
            res = run(name, ranks, ht, examples, eval_examples, tmp)
            ref = next((x for x in lines if x["workload"] == "reference"), None)
            if ref is not None:
                res["auc_change_vs_reference"] = round(res["auc"] - ref["auc"], 5)
            lines.append(res)
            print(json.dumps(res), flush=True)
    line = json.dumps({"benchmark": "W10 hierarchical training", "quick": a.quick,
                       "examples": examples, "eval_examples": eval_examples, "workloads": lines,
                       "provenance": provenance()})
    print(line, flush=True)
    if not a.no_save:
        print(f"w10_bench: wrote {save_result(line, 'w10')}", file=sys.stderr)


if __name__ == "__main__":
    main()
