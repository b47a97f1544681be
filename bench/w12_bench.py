#!/usr/bin/env python3
"""W12: a table larger than the machine's memory, trained by `hps train`.

The job: `hps train` (as a user runs it, from a TOML config) on synthetic
Criteo-like data whose 26 fields each draw Zipf(a) ranks (a = 1.0) over a
vocabulary of 2e9 ids, so that the run touches >= --keys distinct keys (dim 16, AdaGrad:
128 B of row and state a key, plus its 8 B key on disk), with a MEM-PS budget
(default 4 GiB) far below the table, the whole job inside a memory cgroup
(default 8 GiB; bench/ssd_store_bench.py's MemCgroup). The driver

  1. plans the run: the examples whose expected distinct keys reach --keys
     (expected_distinct: the Zipf law's sum of 1 - exp(-n p_r), no sampling);
  2. starts `python -m hps.cli train --config ...` in the cgroup, samples every
     --interval seconds the job's RSS, its /proc/<pid>/io bytes, the cgroup's
     usage and peak, and the bytes on disk under the server's path (inodes
     counted once: checkpoints are hard links to the store's files; the bytes
     only a checkpoint still holds are reported apart);
  3. SIGKILLs the job once, while it makes the first checkpoint at or past
     --kill-at of the run (when that checkpoint's staging directory appears);
  4. runs it again with --resume, which rolls back to the last finished
     checkpoint and trains to the end;
  5. opens the final checkpoint in a third process (in the cgroup too) and checks
     that it serves every key of the first training batch from SSD-PS (none
     initialised anew) and holds as many keys as the run reported;
  6. prints one JSON line (bench/_provenance.py) and writes it to bench/results/.

--quick: 2M keys, a 64 MiB budget, a 1 GiB cgroup, under a minute.

Space: the store compacts at 1.5x its live records; a checkpoint's hard links
keep the files that compaction deleted until the next checkpoint. The figure
"space_amplification_max" is the largest (bytes on disk under the path) /
(live records x (row + key) bytes) over the samples, live taken from the
job's last eval entry before the sample (eval entries carry the wall clock).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _provenance import provenance  # noqa: E402  commit, date, machine, command of the JSON line
from ssd_store_bench import MemCgroup  # noqa: E402  the W1 cgroup code, v1 and v2

FIELDS = 26
DIM = 16
ROW_BYTES = 4 * 2 * DIM  # AdaGrad: the row and its accumulator, float32
RECORD_BYTES = ROW_BYTES + 8  # on disk: the row and its key
CAT_MISSING = 0.05  # hps.data.SyntheticCriteo's default
GiB = 1 << 30
# The device's limits, fio on this machine (docs/benchmarks.md, W1 section).
FIO_LIMITS = {"rand_read_4k_iops": 76_000, "rand_read_4k_MB_per_s": 76_000 * 4096 / 1e6,
              "seq_write_MB_per_s": 1340.0, "seq_read_MB_per_s": 754.0,
              "source": "docs/benchmarks.md W1: fio O_DIRECT io_uring, random 4 KiB read at iodepth 64, "
                        "sequential 1 MiB"}


def log(*a):
    print("w12:", *a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the plan
def expected_distinct(examples: float, zipf_a: float, vocab: int, fields: int = FIELDS,
                      missing: float = CAT_MISSING, head: int = 1 << 20) -> float:
    """Expected distinct keys among `examples` examples of SyntheticCriteo with
    `fields` fields of `vocab` ids each: per field, n = examples (1 - missing)
    draws of a Zipf(a) law truncated to [1, vocab] touch sum_r 1 - exp(-n p_r)
    ranks (Poisson); ranks up to `head` are summed, the rest integrated on a
    geometric grid. The missing values add one key per field."""
    import numpy as np
    n = examples * (1.0 - missing)
    r = np.arange(1, min(head, vocab) + 1, dtype=np.float64)
    w = r ** -zipf_a
    z = w.sum()
    tail = 0.0
    if vocab > head:
        lo, hi = head + 0.5, vocab + 0.5
        z += math.log(hi / lo) if zipf_a == 1.0 else (hi ** (1 - zipf_a) - lo ** (1 - zipf_a)) / (1 - zipf_a)
        x = np.geomspace(head + 0.5, vocab + 0.5, 100_001)
        mid, width = np.sqrt(x[1:] * x[:-1]), np.diff(x)
        tail = float((-np.expm1(-n * mid ** -zipf_a / z) * width).sum())
    head_sum = float((-np.expm1(-n * w / z)).sum())
    return fields * (head_sum + tail + (1.0 if missing > 0 else 0.0))


def plan_examples(keys: int, zipf_a: float, vocab: int, batch: int, margin: float = 1.01) -> int:
    """The fewest whole batches whose expected distinct keys reach keys x margin (bisection)."""
    lo, hi = 0, batch
    while expected_distinct(hi, zipf_a, vocab) < keys * margin:
        lo, hi = hi, hi * 2
    while hi - lo > batch:
        mid = (lo + hi) // 2
        if expected_distinct(mid, zipf_a, vocab) < keys * margin:
            lo = mid
        else:
            hi = mid
    return -(-hi // batch) * batch


# ------------------------------------------------------------------ sampling
def disk_usage(root: str) -> dict:
    """Bytes allocated under root, each inode once; 'checkpoint_only': inodes no
    longer in the live store (files compaction deleted that a checkpoint keeps)."""
    seen: dict = {}
    live_store = os.path.join(root, "ssd")
    for dirpath, _dirs, files in os.walk(root):
        in_live = dirpath == live_store
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            key = (st.st_dev, st.st_ino)
            size, was_live = seen.get(key, (st.st_blocks * 512, False))
            seen[key] = (size, was_live or in_live)
    total = sum(s for s, _ in seen.values())
    only = sum(s for s, live in seen.values() if not live)
    return {"bytes": total, "checkpoint_only_bytes": only}


def read_proc(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        out["cpu_seconds"] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("read_bytes", "write_bytes"):
                    out[k] = int(v)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent outside idle and iowait since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def read_cgroup(cg) -> dict:
    if cg is None:
        return {}
    names = {1: ("memory.usage_in_bytes", "memory.max_usage_in_bytes"), 2: ("memory.current", "memory.peak")}
    out = {}
    for name, label in zip(names[cg.version], ("usage", "peak")):
        v = cg._read(name)
        if v is not None:
            out[label] = int(v)
    stat = cg._read("memory.stat") or ""
    for line in stat.splitlines():
        k, _, v = line.partition(" ")
        if k in ("rss", "cache", "anon", "file", "total_rss", "total_cache"):
            out[k] = int(v)
    return out


class Sampler(threading.Thread):
    def __init__(self, pid: int, root: str, cg, interval: float, phase: str, samples: list):
        super().__init__(daemon=True)
        self.pid, self.root, self.cg, self.interval, self.phase = pid, root, cg, interval, phase
        self.samples = samples
        self.stop = threading.Event()

    def sample(self):
        s = {"t": time.time(), "phase": self.phase, "machine_busy_seconds": machine_busy_seconds(),
             **read_proc(self.pid)}
        cgm = read_cgroup(self.cg)
        if cgm:
            s["cgroup"] = cgm
        if os.path.isdir(self.root):
            s["disk"] = disk_usage(self.root)
        self.samples.append(s)

    def run(self):
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval)


# ------------------------------------------------------------------ the job
def write_config(path: str, args, examples: int) -> str:
    cfg = os.path.join(path, "w12.toml")
    vocab = ", ".join([str(args.vocab)] * FIELDS)
    hidden = ", ".join(str(h) for h in args.hidden)
    with open(cfg, "w") as f:
        f.write(f"""# W12 (bench/w12_bench.py): >= {args.keys:,} distinct keys, MEM-PS budget {args.mem_budget}
hidden = [{hidden}]
eval_every = {args.eval_every}
checkpoint_every = {args.checkpoint_every}
torch_threads = {args.torch_threads}

[ps]
dim = {DIM}
path = "{os.path.join(path, 'ps')}"
mem_budget = "{args.mem_budget}"

[ps.optimizer]
kind = "adagrad"

[data]
source = "synthetic"
batch_size = {args.batch_size}
train_examples = {examples}
eval_examples = {args.eval_examples}
seed = {args.seed}
zipf_a = {args.zipf_a}
vocab_sizes = [{vocab}]
""")
    return cfg


def spawn(cmd: list, cg, log_path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    logf = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, env=env,
                            preexec_fn=cg.enter if cg is not None else None)


def run_phase(name, cmd, cg, root, args, samples, kill_checkpoint=None) -> dict:
    """One process of the job: sampled, and SIGKILLed while it makes checkpoint
    `kill_checkpoint` (its staging directory exists) when given."""
    if cg is not None:
        cg.reset()
    t0 = time.time()
    proc = spawn(cmd, cg, os.path.join(args.dir, f"{name}.log"))
    sampler = Sampler(proc.pid, os.path.join(root, "ps"), cg, args.interval, name, samples)
    sampler.start()
    out = {"phase": name, "command": cmd}
    if kill_checkpoint is not None:
        ck = os.path.join(root, "ps", "checkpoints")
        staging, done = os.path.join(ck, f"{kill_checkpoint:06d}.tmp"), os.path.join(ck, f"{kill_checkpoint:06d}")
        while proc.poll() is None:
            if os.path.isdir(staging) or os.path.isdir(done):
                mid = os.path.isdir(staging) and not os.path.isdir(done)
                proc.send_signal(signal.SIGKILL)
                out["killed"] = {"at_checkpoint": kill_checkpoint, "seconds": time.time() - t0, "inside": mid,
                                 "moment": f"inside checkpoint {kill_checkpoint} (its snapshot being made)" if mid
                                 else f"just after checkpoint {kill_checkpoint} finished"}
                log(f"SIGKILL {name} at {out['killed']['seconds']:.0f} s, {out['killed']['moment']}")
                break
            time.sleep(0.01)
    stdout, _ = proc.communicate()
    sampler.stop.set()
    sampler.join()
    sampler.sample()  # the end state on disk
    out["returncode"] = proc.returncode
    out["seconds"] = time.time() - t0
    out["peak_rss_bytes"] = max((s.get("VmHWM", 0) for s in samples if s["phase"] == name), default=0)
    if cg is not None:
        out["cgroup"] = cg.snapshot()
    lines = [ln for ln in stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if lines:
        out["result"] = json.loads(lines[-1])
    return out


VERIFY = r"""
import json, sys
import numpy as np
import hps
from hps.data import SyntheticCriteo
from hps.parameter_server import ParameterServer
path, summary_path, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with open(summary_path) as f:
    summary = json.load(f)
ps = ParameterServer.open(path, mem_budget=cfg["mem_budget"])
live = ps.stats()["ssd"]["live_records"]
first = next(iter(SyntheticCriteo(seed=cfg["seed"], batch_size=cfg["batch_size"], examples=cfg["batch_size"],
                                  vocab_sizes=[cfg["vocab"]] * 26, zipf_a=cfg["zipf_a"])))
keys = np.unique(first.keys.reshape(-1))
rows = ps.pull(keys)
c = ps.stats()["counts"]
print(json.dumps({"checkpoint": ps.checkpoint_number, "live_records": live,
                  "summary_live_records": summary["ps"]["ssd"]["live_records"],
                  "first_batch_keys": int(len(keys)), "from_ssd": c["ssd_hits"], "initialized": c["initialized"],
                  "rows_finite": bool(np.isfinite(rows).all()), "index_bytes": ps.stats()["ssd"]["index_bytes"]}))
"""


# ------------------------------------------------------------------ figures
def figures(samples: list, history: list, phases: list) -> dict:
    """Peaks, I/O rates and space amplification from the samples."""
    out = {}
    rss = [s["VmRSS"] for s in samples if "VmRSS" in s]
    out["rss_peak_bytes"] = max([s.get("VmHWM", 0) for s in samples] + rss + [0])
    cg_peak = [s["cgroup"]["peak"] for s in samples if "cgroup" in s and "peak" in s["cgroup"]]
    cg_use = [s["cgroup"]["usage"] for s in samples if "cgroup" in s and "usage" in s["cgroup"]]
    if cg_peak:
        out["cgroup_peak_bytes"] = max(cg_peak)
        out["cgroup_usage_max_sampled_bytes"] = max(cg_use)
        rss_cg = [s["cgroup"].get("rss", s["cgroup"].get("anon", 0)) for s in samples if "cgroup" in s]
        out["cgroup_anon_max_sampled_bytes"] = max(rss_cg)
    disk = [s for s in samples if "disk" in s]
    out["disk_peak_bytes"] = max((s["disk"]["bytes"] for s in disk), default=0)
    out["disk_checkpoint_only_peak_bytes"] = max((s["disk"]["checkpoint_only_bytes"] for s in disk), default=0)
    # I/O rates per phase from /proc/<pid>/io (bytes that reached the block layer).
    rates = {"read": [], "write": []}
    totals = {"read_bytes": 0, "write_bytes": 0, "seconds": 0.0}
    for p in phases:
        ss = [s for s in samples if s["phase"] == p["phase"] and "read_bytes" in s]
        for a, b in zip(ss, ss[1:]):
            dt = b["t"] - a["t"]
            if dt > 0:
                rates["read"].append((b["read_bytes"] - a["read_bytes"]) / dt / 1e6)
                rates["write"].append((b["write_bytes"] - a["write_bytes"]) / dt / 1e6)
        if ss:
            totals["read_bytes"] += ss[-1]["read_bytes"]
            totals["write_bytes"] += ss[-1]["write_bytes"]
            totals["seconds"] += ss[-1]["t"] - ss[0]["t"]
    # Cores the job kept busy, and the whole machine (other processes included).
    job_cpu = machine_cpu = 0.0
    for p in phases:
        ss = [s for s in samples if s["phase"] == p["phase"] and "cpu_seconds" in s]
        if len(ss) > 1:
            job_cpu += ss[-1]["cpu_seconds"] - ss[0]["cpu_seconds"]
            machine_cpu += ss[-1]["machine_busy_seconds"] - ss[0]["machine_busy_seconds"]
    out["cpu"] = {"job_cores_busy_mean": job_cpu / max(totals["seconds"], 1e-9),
                  "machine_cores_busy_mean": machine_cpu / max(totals["seconds"], 1e-9),
                  "cores": os.cpu_count(), "job_cpu_seconds": job_cpu}
    out["io"] = {**totals,
                 "read_MB_per_s_mean": totals["read_bytes"] / max(totals["seconds"], 1e-9) / 1e6,
                 "write_MB_per_s_mean": totals["write_bytes"] / max(totals["seconds"], 1e-9) / 1e6,
                 "read_MB_per_s_max_interval": max(rates["read"], default=0.0),
                 "write_MB_per_s_max_interval": max(rates["write"], default=0.0)}
    # Space at each eval entry: the store's own bytes then (SSD-PS's stats, the
    # same moment as its live records) plus the bytes that only a checkpoint
    # still holds (files compaction deleted; the nearest disk sample), against
    # the live records x (row + key) bytes.
    worst, at = 0.0, None
    for e in history:
        if not e.get("ssd_live_records") or "unix_time" not in e or "ssd_disk_bytes" not in e:
            continue
        near = min(disk, key=lambda s: abs(s["t"] - e["unix_time"]), default=None)
        held = near["disk"]["checkpoint_only_bytes"] if near is not None else 0
        live = e["ssd_live_records"] * RECORD_BYTES
        ratio = (e["ssd_disk_bytes"] + held) / live
        if ratio > worst:
            worst, at = ratio, {"examples": e["examples"], "store_bytes": e["ssd_disk_bytes"],
                                "checkpoint_only_bytes": held, "live_bytes": live,
                                "sample_seconds_away": abs(near["t"] - e["unix_time"]) if near else None}
    out["space_amplification_max"] = worst
    out["space_amplification_max_at"] = at
    return out


# ------------------------------------------------------------------ driver
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    num = lambda s: int(float(s))  # noqa: E731  (2e8)
    ap.add_argument("--quick", action="store_true", help="2M keys, 64 MiB budget, 1 GiB cgroup: under a minute")
    ap.add_argument("--keys", type=num, default=200_000_000, help="distinct keys the run must touch")
    ap.add_argument("--examples", type=num, default=None, help="default: planned from --keys (expected_distinct)")
    ap.add_argument("--zipf-a", type=float, default=1.0,
                    help="the fields' Zipf exponent; 1.0 reaches 200M keys in 22M examples, 1.05 in 34M")
    ap.add_argument("--vocab", type=num, default=2_000_000_000, help="ids per field (<= 2^31)")
    ap.add_argument("--mem-budget", default="4GiB")
    ap.add_argument("--memory-limit", type=_parse_bytes, default=8 * GiB,
                    help="the job's memory cgroup limit, e.g. 8GiB")
    ap.add_argument("--no-cgroup", action="store_true")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--mlp", default="512,256", help="hidden widths (W4/W5's 512,256)")
    ap.add_argument("--checkpoints", type=int, default=8, help="checkpoints over the run (besides the last)")
    ap.add_argument("--kill-at", type=float, default=0.6, help="SIGKILL in the first checkpoint past this fraction")
    ap.add_argument("--eval-examples", type=int, default=16384)
    ap.add_argument("--evals", type=int, default=60, help="eval entries over the run (their stats time the space)")
    ap.add_argument("--torch-threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under bench/results/)")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--plan-only", action="store_true", help="print the plan and exit")
    ap.add_argument("--out", default=None, help="JSON line file (default: bench/results/w12-<time>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.keys = 2_000_000 if args.keys == 200_000_000 else args.keys
        args.mem_budget = "64MiB" if args.mem_budget == "4GiB" else args.mem_budget
        args.memory_limit = GiB if args.memory_limit == 8 * GiB else args.memory_limit
        args.interval = min(args.interval, 0.5)
        args.mlp = "64" if args.mlp == "512,256" else args.mlp
        args.checkpoints = min(args.checkpoints, 5)
        args.evals = min(args.evals, 10)
        args.eval_examples = min(args.eval_examples, 2048)
    args.hidden = [int(h) for h in args.mlp.split(",") if h]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    prov = provenance()
    examples = args.examples or plan_examples(args.keys, args.zipf_a, args.vocab, args.batch_size)
    batches = -(-examples // args.batch_size)
    expected = expected_distinct(examples, args.zipf_a, args.vocab)
    args.checkpoint_every = max(1, batches // (args.checkpoints + 1))
    args.eval_every = max(1, batches // args.evals)
    ckpts = batches // args.checkpoint_every
    kill_checkpoint = min(ckpts, max(1, math.ceil(args.kill_at * batches / args.checkpoint_every)))
    plan = {"keys_target": args.keys, "examples": examples, "batches": batches, "zipf_a": args.zipf_a,
            "vocab_per_field": args.vocab, "fields": FIELDS, "expected_distinct_keys": expected,
            "checkpoint_every": args.checkpoint_every, "eval_every": args.eval_every,
            "kill_in_checkpoint": kill_checkpoint, "table_bytes": expected * ROW_BYTES,
            "disk_live_bytes": expected * RECORD_BYTES}
    log(f"plan: {examples:,} examples ({batches:,} batches of {args.batch_size}), Zipf({args.zipf_a}) over "
        f"{args.vocab:,} ids x {FIELDS} fields: {expected / 1e6:,.1f}M distinct keys expected "
        f"({expected * ROW_BYTES / GiB:,.1f} GiB of rows and state); checkpoint every {args.checkpoint_every} "
        f"batches, SIGKILL inside checkpoint {kill_checkpoint}")
    if args.plan_only:
        print(json.dumps({"plan": plan}))
        return 0
    if args.dir is None:
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        args.dir = tempfile.mkdtemp(prefix="w12-", dir=os.path.join(HERE, "results"))
    os.makedirs(args.dir, exist_ok=True)
    if os.path.exists(os.path.join(args.dir, "ps")):
        log(f"{args.dir}/ps exists: give a new --dir")
        return 2
    out = {"benchmark": "W12 train, a table larger than the machine's memory", "quick": args.quick, "plan": plan,
           "mem_budget": args.mem_budget,
           "batch_size": args.batch_size, "mlp": args.hidden, "dim": DIM, "optimizer": "adagrad",
           "row_bytes": ROW_BYTES, "record_bytes_on_disk": RECORD_BYTES, "device_limits": FIO_LIMITS,
           "dir": args.dir}
    cg = None
    if args.no_cgroup:
        out["memory_limit"], out["memory_limit_note"] = None, "disabled by --no-cgroup"
    else:
        cg = MemCgroup(args.memory_limit, name=f"hps-w12-{os.getpid()}")
        if cg.path is None:
            out["memory_limit"], out["memory_limit_note"] = None, cg.error
            log(f"running WITHOUT a memory limit: {cg.error}")
            cg = None
        else:
            out["memory_limit"] = args.memory_limit
            out["memory_cgroup"] = {"path": cg.path, "version": cg.version}
    config = write_config(args.dir, args, examples)
    cmd = [sys.executable, "-m", "hps.cli", "train", "--config", config, "--no-progress"]
    samples: list = []
    phases = []
    try:
        t0 = time.time()
        phases.append(run_phase("first", cmd, cg, args.dir, args, samples, kill_checkpoint=kill_checkpoint))
        phases.append(run_phase("resumed", cmd + ["--resume"], cg, args.dir, args, samples))
        wall = time.time() - t0
        summary_path = os.path.join(args.dir, "ps", "train-summary.json")
        summary = None
        if os.path.exists(summary_path):
            with open(summary_path) as f:
                summary = json.load(f)
        vcfg = {"mem_budget": args.mem_budget, "seed": args.seed, "batch_size": args.batch_size,
                "vocab": args.vocab, "zipf_a": args.zipf_a}
        if summary is not None:
            verify = run_verify(args, cg, summary_path, vcfg)
            out["verify"] = verify
    finally:
        if cg is not None:
            cg.remove()
    first, resumed = phases
    out["phases"] = [{k: v for k, v in p.items() if k != "result"} for p in phases]
    out["killed"] = "killed" in first and first["returncode"] == -signal.SIGKILL
    # The kernel's OOM kills in the cgroup (SIGKILL too, so not told apart by the return code).
    # The processes share one cgroup, whose counter adds up over them.
    out["oom_kills"] = max(p.get("cgroup", {}).get("oom_control.oom_kill", 0) +
                           p.get("cgroup", {}).get("events.oom_kill", 0) for p in phases)
    out["finished"] = resumed["returncode"] == 0 and summary is not None
    out["wall_seconds"] = wall
    if summary is not None:
        ps = summary["ps"]
        mem, ssd = ps["mem"], ps["ssd"]
        history = summary["history"]
        out["examples_trained"] = summary["examples"]
        out["examples_expected"] = examples
        out["distinct_keys"] = ssd["live_records"]
        out["examples_per_s_resumed_run"] = summary["examples_per_s"]
        # Over the whole job: every example once, the killed process's lost
        # batches, its restart and the resumed run's skip over done batches included.
        out["examples_per_s_overall"] = examples / wall
        out["mem_hit_rate_resumed_run"] = mem["hits"] / max(1, mem["hits"] + mem["misses"])
        out["mem"] = {k: mem[k] for k in ("capacity", "size", "arena_bytes", "hits", "misses", "evictions",
                                          "dirty_evictions")}
        out["ssd"] = {k: ssd[k] for k in ("files", "live_records", "stale_records", "disk_bytes", "rows_written",
                                          "bytes_written", "rows_read", "bytes_read", "compactions",
                                          "compacted_records", "index_bytes", "io_path")}
        out["counts"] = ps["counts"]
        out["pipeline"] = {k: summary["pipeline"].get(k) for k in ("bound_by", "busy_seconds",
                                                                    "wall_over_slowest_stage")}
        out["torch_threads"] = summary.get("torch_threads")
        out["final_eval"] = {k: summary["final"].get(k) for k in ("auc", "logloss")}
        out["history"] = [{k: e.get(k) for k in ("examples", "seconds", "unix_time", "mem_hit_rate",
                                                  "ssd_bytes_read", "ssd_bytes_written", "ssd_live_records",
                                                  "ssd_disk_bytes")} for e in history]
        out["index_bytes_per_key"] = ssd["index_bytes"] / max(1, ssd["live_records"])
        out["live_bytes"] = ssd["live_records"] * RECORD_BYTES
        out.update(figures(samples, history, phases))
        last = [s for s in samples if "disk" in s][-1]
        out["space_amplification_end"] = last["disk"]["bytes"] / max(1, out["live_bytes"])
        # The killed process's entries that its checkpoint kept: cumulative
        # within a process, so the last one before the resumed run's first.
        resumed_from = next((i for i in range(1, len(history))
                             if history[i]["seconds"] < history[i - 1]["seconds"]), None)
        if resumed_from is not None:
            out["mem_hit_rate_first_run"] = history[resumed_from - 1]["mem_hit_rate"]
            out["examples_at_resume"] = history[resumed_from - 1]["examples"]
        out["keys_reached"] = ssd["live_records"] >= args.keys
        out["disk_within_2x_live"] = out["space_amplification_max"] <= 2.0
        out["memory"] = {
            "limit_bytes": out["memory_limit"],
            "mem_ps_budget_bytes": _parse_bytes(args.mem_budget, "mem_budget"),
            "mem_ps_arena_bytes": mem["arena_bytes"],
            "ssd_index_bytes": ssd["index_bytes"],
            "ssd_index_bytes_per_key": out["index_bytes_per_key"],
            "process_rss_peak_bytes": out["rss_peak_bytes"],
            "cgroup_peak_bytes": out.get("cgroup_peak_bytes"),
            "cgroup_anon_max_sampled_bytes": out.get("cgroup_anon_max_sampled_bytes"),
        }
        peak = max(out["rss_peak_bytes"], out.get("cgroup_peak_bytes", 0))
        out["within_memory_limit"] = (out["memory_limit"] is None or peak <= out["memory_limit"]) and \
            not out["oom_kills"]
    out["provenance"] = prov  # taken at the start: the code the job ran
    line = json.dumps(out)
    print(line)
    path = args.out or os.path.join(HERE, "results", f"w12-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        f.write(line + "\n")
    if summary is not None:
        log(f"{out['examples_trained']:,} examples, {out['distinct_keys']:,} keys; "
            f"{out['examples_per_s_overall']:,.0f} examples/s overall; hit rate "
            f"{out['mem_hit_rate_resumed_run']:.3f}; peak RSS {out['rss_peak_bytes'] / GiB:.2f} GiB, cgroup "
            f"{out.get('cgroup_peak_bytes', 0) / GiB:.2f} GiB; "
            f"disk <= {out['space_amplification_max']:.2f}x live; written to {path}")
    if not args.keep_data:
        shutil.rmtree(os.path.join(args.dir, "ps"), ignore_errors=True)
    return 0 if out["finished"] else 1


def run_verify(args, cg, summary_path: str, vcfg: dict) -> dict:
    cmd = [sys.executable, "-c", VERIFY, os.path.join(args.dir, "ps"), summary_path, json.dumps(vcfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cg.enter if cg is not None else None)
    if proc.returncode != 0:
        return {"returncode": proc.returncode, "error": proc.stderr[-2000:]}
    return {"returncode": 0, **json.loads(proc.stdout.strip().splitlines()[-1])}


def _parse_bytes(s: str, name: str = "size") -> int:
    from hps import parse_bytes
    return parse_bytes(s, name)


if __name__ == "__main__":
    sys.exit(main())
