"""W8: two-phase relay vs direct through host memory on the paper's Figure 1 node (issue 17).

    python3 bench/w8_bench.py                 # the model at full size, the host executor at full size
    python3 bench/w8_bench.py --quick         # the model at full size, the executor on 1/16 of the rows
    python3 bench/w8_bench.py --file examples/topologies/dgx1.toml

The workload: an all-to-all pull of 1M rows of 64 float32 (256 B a row) spread evenly
over the 8 GPUs' pairs (each ordered pair moves 1M / 64 rows, 4 MB; a device's own share
stays put), then the push of the same rows back (the transposed matrix).

For each of three schedules (include/hps/topology.h):
  host     every pair through the CPUs' memory (a peer copy without peer access): the
           paper's "direct" baseline of its Figure 6
  direct   the pair's own NVLink where there is one, the host path elsewhere
  relay    the router's routes: two-phase through a middleman GPU where that lowers the
           all-to-all's modelled time
it reports the modelled time (the cost model: link sharing per direction, hop latencies,
two phases) and, with the host executor (memcpy between host buffers, relays staged in
the middleman's buffer), the measured time on this machine, checking that every schedule
delivers exactly the bytes a direct copy does. The host executor checks the schedule, not
NVLink: its times say what staging costs in memory bandwidth here, nothing about GPUs.
It also takes the transfer matrix `hps train` records with 8 host-partition devices
on the synthetic data (routed through the same topology file; 100 batches of 4096,
--quick 8 of 1024) and models a batch's pull and push of it under the three schedules.
It also models two hard-coded relay rules beside the router's choice (Paddle's
(s + 4) % 8, and the destination's partner (d + 4) % 8), the modelled ratio on the
other shipped nodes, and the core binding plan
(hps.topology.BindingPlan) of this machine and of fake 2- and 4-node sysfs trees.

Prints one JSON line (also written to bench/results/w8-DATE.json unless --no-save).
Target (issue 17): relayed >= 75% less modelled time than host, pull and push.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

import numpy as np

from _provenance import provenance, save_result  # bench/ is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURE1 = os.path.join(ROOT, "examples", "topologies", "figure1.toml")
TARGET = 0.75
SCHEDULES = ("host", "direct", "relay")


def modelled(topo, m: np.ndarray) -> dict:
    out = {}
    for s in SCHEDULES:
        p = topo.plan(m, s)
        out[s] = {"seconds": p["seconds"], "phase_seconds": p["phase_seconds"], "route_count": p["route_count"],
                  "relayed_bytes": p["relayed_bytes"], "hops": p["hops"]}
    host = out["host"]["seconds"]
    for s in SCHEDULES:
        out[s]["reduction_vs_host"] = round(1 - out[s]["seconds"] / host, 4) if host > 0 else None
    return out


def fixed_rules(topo, m: np.ndarray) -> dict:
    """The modelled time of two hard-coded relay rules for the pairs without a direct
    link: Paddle's GPU PS (via (s + 4) % 8) and the partner rule (via the GPU in the
    source's socket whose cross link reaches d: (d + 4) % 8 on the Figure 1 mesh)."""
    from hps.topology import TopologyError  # noqa: F401 - errors of a rule are ValueErrors
    e = m.shape[0]
    plain = topo.plan(m, "direct")
    unlinked = {(r["src"], r["dst"]) for r in plain["routes"] if r["kind"] == "host"}
    out = {}
    for name, rule in (("paddle_(s+4)%8", lambda s, d: (s + 4) % e), ("partner_(d+4)%8", lambda s, d: (d + 4) % e)):
        via = np.full((e, e), -1, dtype=np.int64)
        for s, d in unlinked:
            via[s, d] = rule(s, d)
        try:
            p = topo.plan_fixed(m, via)
        except ValueError as err:
            out[name] = {"error": str(err)}
            continue
        out[name] = {"seconds": p["seconds"], "route_count": p["route_count"],
                     "reduction_vs_host": round(1 - p["seconds"] / topo.plan(m, "host")["seconds"], 4)}
    return out


def executed(topo, m: np.ndarray, repeats: int) -> dict:
    """Median, min, max seconds of the host executor per schedule, and whether each
    delivered the same bytes as the direct copy of every segment."""
    e = m.shape[0]
    rng = np.random.default_rng(11)
    send = [rng.integers(0, 256, size=int(m[s].sum()), dtype=np.uint8) for s in range(e)]
    want = []
    for d in range(e):
        parts = [send[s][int(m[s, :d].sum()):int(m[s, :d + 1].sum())] for s in range(e)]
        want.append(np.concatenate(parts))
    out = {}
    for s in SCHEDULES:
        times, phases, same, stats = [], [], True, {}
        for _ in range(repeats):
            recv = [np.zeros(int(m[:, d].sum()), dtype=np.uint8) for d in range(e)]
            stats = topo.execute_on_host(m, s, send, recv)
            times.append(stats["seconds"])
            phases.append(stats["phase_seconds"])
            same = same and all(np.array_equal(recv[d], want[d]) for d in range(e))
        out[s] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                  "phase_median_s": [statistics.median(p[i] for p in phases) for i in range(2)],
                  "bytes_copied": stats["bytes_copied"], "staged_bytes": stats["staged_bytes"],
                  "delivered_as_direct": bool(same)}
    return out


def train_matrices(topo_file: str, topo, quick: bool) -> dict:
    """The transfer matrix `hps train` records with 8 host-partition devices on the
    synthetic data, routed through topo_file, and the modelled time of a batch's pull
    and push on that topology. The tier's matrix sums Get (owner -> worker) and
    Accumulate (worker -> owner); the pull part is counted here from the same data
    (each worker's mini-batch keys by their modulo owner) and checked: pull + its
    transpose must equal the recorded matrix."""
    import tempfile
    import hps
    from hps import _core
    from hps.data import SyntheticCriteo
    from hps.train import DataConfig, TrainConfig, train
    devices, dim = 8, 64
    batch_size, batches = (1024, 8) if quick else (4096, 100)
    vocab = [1000, 5000, 20_000, 200_000] + [20_000] * 22
    with tempfile.TemporaryDirectory() as path:
        data = DataConfig(batch_size=batch_size, train_examples=batch_size * batches, eval_examples=batch_size,
                          vocab_sizes=vocab)
        ps = hps.ParameterServerConfig(dim=dim, path=path, mem_budget="256MiB", devices=devices, topology=topo_file)
        cfg = TrainConfig(ps=ps, data=data, hidden=(64,), torch_threads=1, eval_every=0)
        t0 = time.perf_counter()
        summary = train(cfg, progress=False)
        train_s = time.perf_counter() - t0
    device = summary["ps"]["device"]
    recorded = np.array(device["transfer_bytes"], dtype=np.uint64)
    pull = np.zeros((devices, devices), dtype=np.uint64)
    for b in SyntheticCriteo(seed=0, batch_size=batch_size, examples=batch_size * batches, vocab_sizes=vocab):
        for w, idx in enumerate(np.array_split(np.arange(len(b.labels)), devices)):
            owners = _core.DeviceTier.modulo_owners(np.ascontiguousarray(b.keys[idx].ravel()), devices)
            pull[:, w] += np.bincount(owners, minlength=devices).astype(np.uint64) * np.uint64(4 * dim)
    split_ok = bool(np.array_equal(pull + pull.T, recorded))
    e = len(topo.endpoints)
    per_batch = np.zeros((e, e), dtype=np.uint64)
    per_batch[:devices, :devices] = pull // np.uint64(summary["batches"])
    np.fill_diagonal(per_batch, 0)  # a device's own rows stay put
    routes = device["routes"]
    return {"devices": devices, "dim": dim, "batch_size": batch_size, "batches": summary["batches"],
            "train_seconds": round(train_s, 2), "recorded_bytes": recorded.tolist(),
            "pull_bytes": pull.tolist(), "pull_plus_transpose_equals_recorded": split_ok,
            "pull_bytes_per_batch_offdiag": int(per_batch.sum()),
            "model_per_batch": {"pull": modelled(topo, per_batch), "push": modelled(topo, np.ascontiguousarray(per_batch.T))},
            "run_routes": {k: routes[k] for k in ("topology", "executed", "rows_by_route", "relayed_rows",
                                                  "relayed_bytes", "hop_bytes")},
            "run_plan_row0": routes["plan"][0]}


def binding_plans() -> dict:
    """The core binding plan of this machine (sysfs) and of fake 2- and 4-node trees
    (2 GPUs and 8 cores a node, the NVMe drive on the last node, the NIC on node 1)."""
    import tempfile
    from hps.topology import discover, write_fake_sysfs

    def summary(plan) -> dict:
        return {"noop": plan.noop, "reason": plan.reason,
                "stages": [{"stage": x.stage, "numa": x.numa, "cores": x.cores, "reason": x.reason}
                           for x in plan.stages]}
    here = discover()
    if not here.endpoints:  # no GPU: the load threads of one host partition a node
        from hps.topology import host_partitions
        here = host_partitions(max(1, len(here.cpu_nodes)), numa_cores=here.numa_cores)
    out = {"this_machine": summary(here.binding_plan())}
    for nodes in (2, 4):
        with tempfile.TemporaryDirectory() as root:
            write_fake_sysfs(root, nodes, cores_per_node=8, gpus_per_node=2, nvme_node=nodes - 1, nic_node=1)
            out[f"fake_{nodes}_nodes"] = summary(discover(root, gpus=False).binding_plan())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the executor on 1/16 of the rows, 2 repeats")
    ap.add_argument("--file", default=FIGURE1, help="topology file (default: the paper's Figure 1 node)")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the all-to-all (default 1M)")
    ap.add_argument("--dim", type=int, default=64, help="floats a row (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="host executor runs per schedule (default 5)")
    ap.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    a = ap.parse_args(argv)
    if a.rows < 1 or a.dim < 1 or a.repeats < 1:
        ap.error("--rows, --dim and --repeats must be >= 1")
    from hps.topology import TopologyError, even_all_to_all, load
    try:
        topo = load(a.file)
    except TopologyError as e:
        ap.error(str(e))
    e = len(topo.endpoints)
    row_bytes = 4 * a.dim
    pull = even_all_to_all(e, a.rows, row_bytes)
    push = np.ascontiguousarray(pull.T)
    exec_rows = a.rows // 16 if a.quick else a.rows
    repeats = 2 if a.quick else a.repeats
    t0 = time.perf_counter()
    result = {
        "bench": "w8", "benchmark": "W8 topology relay", "quick": a.quick,
        "topology": os.path.relpath(os.path.abspath(a.file), ROOT), "topology_name": topo.name,
        "endpoints": e, "rows": a.rows, "dim": a.dim, "row_bytes": row_bytes,
        "bytes_per_pair": int(pull[0, 1]), "target_reduction": TARGET,
        "model": {"pull": modelled(topo, pull), "push": modelled(topo, push)},
        "fixed_rules": {"pull": fixed_rules(topo, pull)},
        "routes": [{k: r[k] for k in ("src", "dst", "kind", "via", "reason")} for r in topo.plan(pull, "relay")["routes"]],
        "executor": {"rows": exec_rows, "repeats": repeats,
                     "pull": executed(topo, even_all_to_all(e, exec_rows, row_bytes), repeats)},
        "other_nodes": {},
    }
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "topologies", "*.toml"))):
        other = load(path)
        if len(other.endpoints) != e or os.path.abspath(path) == os.path.abspath(a.file):
            continue
        mm = modelled(other, pull)
        result["other_nodes"][other.name] = {s: {"seconds": mm[s]["seconds"], "reduction_vs_host": mm[s]["reduction_vs_host"]}
                                             for s in SCHEDULES}
    for d in ("pull", "push"):
        result[f"{d}_reduction"] = result["model"][d]["relay"]["reduction_vs_host"]
    result["meets_target"] = all(result[f"{d}_reduction"] >= TARGET for d in ("pull", "push"))
    result["cuda"] = {"executor_available": False, "note": "no GPU on this machine: the CUDA executor was not run"}
    try:
        from hps import _core
        if _core.cuda_executor_available():
            result["cuda"] = {"executor_available": True, "note": "a GPU is present; this bench does not time it yet"}
    except AttributeError:
        pass
    if len(topo.endpoints) >= 8:
        result["train_matrices"] = train_matrices(a.file, topo, a.quick)
        for d in ("pull", "push"):
            result[f"train_{d}_reduction"] = result["train_matrices"]["model_per_batch"][d]["relay"]["reduction_vs_host"]
    result["binding"] = binding_plans()
    result["wall_seconds"] = round(time.perf_counter() - t0, 3)
    result["provenance"] = provenance()
    line = json.dumps(result, sort_keys=False)
    print(line)
    if not a.no_save:
        print(f"wrote {os.path.relpath(save_result(line, 'w8'), ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
