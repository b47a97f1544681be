#!/usr/bin/env python3
"""Builds the generated tables of docs/benchmarks.md from the benchmarks' JSON lines.

    python3 bench/report.py                      # rewrite the generated regions of the docs
    python3 bench/report.py --check              # exit 1 when a region differs from its JSON lines
    python3 bench/report.py --add RESULT.json    # append a benchmark's JSON line to docs/results/

Every benchmark prints one JSON line with a "provenance" object (bench/_provenance.py:
commit, uncommitted files, date, machine, command). `--add` files each such line under
docs/results/<workload>.jsonl (w1, w2, w3, w4, w4s, w4m, w4a, w4f, w4l, w5, w6, w7, w7s, w8, w10, w11, w11w, w11m, w12, w13, reader and ps_lookahead, told apart by the line's
"benchmark" field); it refuses --quick lines and lines without provenance, since a table
must come from a real run of a recorded command.

docs/benchmarks.md holds one region per workload between the markers

    <!-- report:w4 -->
    ...
    <!-- /report:w4 -->

which this script rewrites from the latest line (by provenance date) of that workload's
file. A workload without a line gets "not measured at this commit", never older
hand-written figures. Each table gives medians with min-max over the rounds or repeats,
every round's ratio against the peer with their median, and the commit, date, machine
and command of the line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = os.path.join(ROOT, "docs", "results")
WORKLOADS = ("w1", "w2", "w3", "w4", "w4s", "w4m", "w4a", "w4f", "w4l", "w5", "w6", "w7", "w7s", "w8", "w10", "w11", "w11w", "w11m", "w12", "w13", "reader", "ps_lookahead")
REGION = re.compile(r"<!-- report:(?P<id>[A-Za-z0-9_]+) -->\n(?P<body>.*?)<!-- /report:(?P=id) -->", re.S)
OPEN = re.compile(r"<!-- (/?)report:([A-Za-z0-9_]+) -->")


class ReportError(Exception):
    """A results file or the docs cannot be read as this script expects; the
    message names the file and line."""


# ------------------------------------------------------------------ lines
def workload_of(line: dict) -> str | None:
    """The workload a benchmark's JSON line belongs to, from its "benchmark" field."""
    name = str(line.get("benchmark") or line.get("bench") or "")
    if name == "reader":  # bench/reader_bench.py: the readers against the training they feed
        return "reader"
    if name.startswith("W11") and line.get("cgroup_limit_bytes"):  # lookup_bench.py --cgroup: its own table
        return "w11m"
    if name.startswith("W11") and line.get("writer"):  # lookup_bench.py --writer: its own table
        return "w11w"
    if name.startswith("W4") and line.get("malloc_ab"):  # train_bench.py --malloc-ab: hps against itself
        return "w4a"
    if name.startswith("W4") and line.get("first_layer_ab"):  # train_bench.py --first-layer-ab: the same
        return "w4f"
    if name == "parameter_server prefetch lookahead":  # parameter_server_bench.py --lookahead
        return "ps_lookahead"
    if name == "first layer's input gradient":  # bench/first_layer_bench.py: W4's first layer, two products
        return "w4l"
    for prefix, wid in (("W10", "w10"), ("W11", "w11"), ("W12", "w12"), ("W13", "w13"), ("W1", "w1"), ("W2", "w2"), ("W3", "w3"), ("W4s", "w4s"), ("W4m", "w4m"), ("W4", "w4"),
                        ("W5", "w5"), ("W6", "w6"), ("w6", "w6"), ("W7s", "w7s"), ("W7", "w7"), ("W8", "w8")):
        if name.startswith(prefix):
            return wid
    return None


def read_lines(path: str) -> list[tuple[int, dict]]:
    """(line number, object) of every non-empty line of a .jsonl file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for no, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise ReportError(f"{path}:{no}: not a JSON line ({e})") from None
            if not isinstance(obj, dict):
                raise ReportError(f"{path}:{no}: a JSON line must be an object, not {type(obj).__name__}")
            out.append((no, obj))
    return out


def check_provenance(obj: dict, where: str) -> None:
    p = obj.get("provenance")
    if not isinstance(p, dict):
        raise ReportError(f"{where}: no \"provenance\" object (commit, date, machine, command); "
                          "run the benchmark at a commit that records it")
    for field in ("commit", "date", "command"):
        if not p.get(field):
            raise ReportError(f"{where}: provenance.{field} is missing")


def latest(results_dir: str, wid: str) -> tuple[str, int, int, dict] | None:
    """(file, line number, lines in the file, object) of the workload's latest line."""
    path = os.path.join(results_dir, f"{wid}.jsonl")
    if not os.path.exists(path):
        return None
    lines = read_lines(path)
    for no, obj in lines:
        where = f"{path}:{no}"
        check_provenance(obj, where)
        if workload_of(obj) != wid:
            raise ReportError(f"{where}: a {workload_of(obj) or 'unknown'} line (benchmark "
                              f"{obj.get('benchmark')!r}) in the {wid} file")
    if not lines:
        return None
    no, obj = max(lines, key=lambda x: (x[1]["provenance"]["date"], x[0]))
    return path, no, len(lines), obj


# ------------------------------------------------------------------ formatting
def num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def spread(median, lo, hi, fmt: str) -> str:
    """"median (min-max)"; the range is left out when there is one value."""
    if median is None:
        return "-"
    if lo is None or hi is None or (lo == hi == median):
        return format(median, fmt)
    return f"{format(median, fmt)} ({format(lo, fmt)}-{format(hi, fmt)})"


def of_runs(values, fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return spread(statistics.median(values), min(values), max(values), fmt)


def per_round(ratios, fmt: str = ".2f") -> str:
    """"1.02 (rounds: 0.98, 1.02, 1.05)": the median of the same-round ratios, and each."""
    ratios = [r for r in ratios if r is not None]
    if not ratios:
        return "-"
    med = format(statistics.median(ratios), fmt)
    if len(ratios) == 1:
        return f"{med} (one round)"
    return f"{med} (rounds: {', '.join(format(r, fmt) for r in ratios)})"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def provenance_lines(path: str, no: int, count: int, obj: dict, root: str) -> list[str]:
    p = obj["provenance"]
    m = p.get("machine") or {}
    dirty = p.get("dirty")
    commit = f"`{p['commit'][:12]}`"
    if dirty:
        commit += f" plus uncommitted changes to {', '.join(f'`{d}`' for d in dirty)}"
    elif dirty is None:
        commit += " (whether the tree was clean was not recorded)"
    machine = ", ".join(x for x in (m.get("cpu_model"), f"{m['cpus']} CPUs" if m.get("cpus") else None,
                                    f"{m['mem_gib']} GiB" if m.get("mem_gib") else None,
                                    f"kernel {m['kernel']}" if m.get("kernel") else None) if x)
    rel = os.path.relpath(path, root)
    lines = [f"_Generated by `python3 bench/report.py` from `{rel}` (line {no}, the latest of {count}); "
             "edit the JSON lines, not this region._", "",
             f"- **Commit:** {commit}",
             f"- **Date:** {p['date']}",
             f"- **Machine:** {machine or 'not recorded'}",
             f"- **Command:** `{p['command']}`"]
    if obj.get("quick"):
        lines.append("- **A --quick run:** a smoke test, not a measurement to quote.")
    return lines + [""]


# ------------------------------------------------------------------ W1
def render_w1(o: dict) -> list[str]:
    dists = list(o.get("dists") or ["uniform", "zipf"])
    head = ["store", "status", "load rows/s"]
    for d in dists:
        head += [f"{d} get rows/s", f"{d} put rows/s"]
    rows = []
    for name, e in o.get("stores", {}).items():
        if e.get("status") != "ok":
            rows.append([name, str(e.get("status"))] + ["-"] * (len(head) - 2))
            continue
        row = [name, "ok", num(e["load"]["rows_per_s"], ",.0f")]
        for d in dists:
            dd = e.get("distributions", {}).get(d)
            for side in ("get_rows_per_s", "put_rows_per_s"):
                s = dd and dd.get(side)
                row.append(spread(s["median"], s["min"], s["max"], ",.0f") if s else "-")
        rows.append(row)
    rounds = o.get("rounds")  # since issue 14: interleaved rounds, each store's figures over them
    spread_of = (f"the {rounds} rounds' batch medians" if rounds and rounds > 1
                 else "one round (its batch median)" if rounds else "the batches of one run")
    limit = o.get("memory_limit")
    out = [f"{o.get('rows', 0):,} rows of {o.get('row_bytes')} B, {o.get('batches')} batches of "
           f"{o.get('batch_keys', 0):,} keys per distribution; rows/s: median (min-max) over {spread_of}; "
           f"memory limit {f'{limit / 2**30:.2f} GiB' if limit else 'none'}.", ""]
    out += table(head, rows) + [""]
    # What each store ran as: the I/O path SSD-PS took (never an assumed one),
    # the RocksDB variant whose figures are the peer's.
    for name, e in o.get("stores", {}).items():
        if e.get("status") != "ok":
            continue
        io_path = (e.get("store_stats") or {}).get("io_path")
        if io_path:
            fallback = (e.get("store_stats") or {}).get("io_fallback")
            out.append(f"- {name} moved rows by {io_path}" + (f" (fell back: {fallback})" if fallback else ""))
        if e.get("options_of"):
            out.append(f"- {name}: {e['options_of']}")
        for d in (d for d in dists if "get_median_by_variant" in (e.get("distributions", {}).get(d) or {})):
            dd = e["distributions"][d]
            out.append(f"- {name} variants, {d} get / put rows/s (round {e.get('figures_from_round', 0) + 1}): "
                       + "; ".join(f"{v} {dd['get_median_by_variant'][v]:,.0f} / "
                                   f"{dd['put_median_by_variant'].get(v, 0):,.0f}"
                                   for v in dd["get_median_by_variant"]))
        failed = {v: f.get("status") for r in e.get("rounds", []) for v, f in (r.get("variants_failed") or {}).items()}
        if failed:
            out.append(f"- {name} variants that did not finish: "
                       + ", ".join(f"{v} ({st})" for v, st in sorted(failed.items())))
    for key, label in (("ratios_hps_over_rocksdb_tuned", "hps / rocksdb_tuned"),
                       ("ratios_hps_node_over_rocksdb_tuned", "hps_node / rocksdb_tuned")):
        r = o.get(key)
        if not r:
            out.append(f"- {label}: not measured (a side is missing or failed)")
            continue
        parts = [f"load {r['load']:.2f}"] if "load" in r else []
        for d in (d for d in dists if d in r):
            sides = [f"{side} " + (per_round(r[d][f"{side}_per_round"]) if f"{side}_per_round" in r[d]
                                   else f"{r[d][f'{side}_median']:.2f} (one run)") for side in ("get", "put")]
            parts.append(f"{d} " + ", ".join(sides))
        how = "same-round ratios of the batch medians" if rounds else "ratio of the batch medians"
        out.append(f"- {label} ({how}): " + "; ".join(parts))
    met = o.get("targets_met")
    if met:
        out.append("- Targets (issue 14, against rocksdb_tuned at its best): " +
                   "; ".join(f"{rule}: {'met' if ok else 'missed'}" for rule, ok in met.items()))
    fio = o.get("hps_uniform_get_over_fio_randread_iops")
    if fio is not None:
        out.append(f"- hps uniform get rows/s over fio's 4 KiB random-read IOPS (queue depth 64): {fio:.2f}")
    return out


# ------------------------------------------------------------------ W2
W2_OPS = ("insert", "find_hit", "find_mix", "accumulate")
W2_PEERS = ("absl", "absl_pf", "boost")
W2_PLAIN = ("absl", "boost")


def w2_over_best(r: dict, op: str, key: str, peers) -> tuple[float | None, str | None]:
    """hps_t1 over the best peer for one op, as W2 defines it, in one place: the
    best peer is the one of `peers` with the highest median, and the ratio is
    hps_t1's median over that peer's (hash_table_bench writes this to its JSON
    line, under ratios[key], and judges its targets on it). The line's figure is
    read where it has one, so that the table and the targets say the same;
    computed the same way for lines without it."""
    ops = r["ops"]
    given = (r.get("ratios") or {}).get(key, {}).get(op)
    if isinstance(given, dict) and given.get("best_peer"):
        return given.get("ratio"), given["best_peer"]
    present = [p for p in peers if p in ops[op]]
    if "hps_t1" not in ops[op] or not present:
        return None, None
    best = max(present, key=lambda p: ops[op][p]["median"])
    return ops[op]["hps_t1"]["median"] / ops[op][best]["median"], best


def w2_cell(r: dict, op: str, key: str, peers) -> str:
    """"0.87 vs boost (rounds: 0.80, 0.90, 0.87)": W2's ratio (w2_over_best) and,
    to show its spread, hps_t1 over that same peer repeat by repeat."""
    ratio, best = w2_over_best(r, op, key, peers)
    if best is None:
        return "-"
    ops = r["ops"]
    rounds = [h / p for h, p in zip(ops[op]["hps_t1"].get("runs", []), ops[op][best].get("runs", []))]
    shown = f" (rounds: {', '.join(format(x, '.2f') for x in rounds)})" if len(rounds) > 1 else ""
    return f"{num(ratio, '.2f')} vs {best}{shown}"


def w2_scaling_cell(r: dict, op: str) -> str:
    """hps_t2 / hps_t1: the ratio of medians the line's targets judge (ratios.
    hps_t2_over_hps_t1), then the repeats'."""
    ops = r["ops"]
    t1, t2 = ops[op].get("hps_t1"), ops[op].get("hps_t2")
    if not t1 or not t2:
        return "-"
    ratio = (r.get("ratios") or {}).get("hps_t2_over_hps_t1", {}).get(op)
    if ratio is None:
        ratio = t2["median"] / t1["median"]
    rounds = [b / a for a, b in zip(t1.get("runs", []), t2.get("runs", []))]
    shown = f" (rounds: {', '.join(format(x, '.2f') for x in rounds)})" if len(rounds) > 1 else ""
    return f"{ratio:.2f}{shown}"


def render_w2(o: dict) -> list[str]:
    cfg = o["config"]
    impls = list(cfg.get("impls") or ["hps_t1", "hps_t2", "absl", "boost"])
    out = [f"{cfg['keys']:,} keys, {cfg['repeats']} repeat(s), hps load {cfg['hps_load']:.2f}, peer huge pages "
           f"{cfg['peer_hugepages']}" + (f", absl_pf prefetches {cfg['peer_prefetch']} keys ahead"
                                         if "absl_pf" in impls else ", no prefetching peer in this run")
           + "; Mops/s, median (min-max) over the repeats.", ""]
    for width, r in o["results"].items():
        ops = r["ops"]
        out.append(f"**Rows of {width} floats** (load: "
                   + ", ".join(f"{k} {v:.2f}" for k, v in r["load"].items()) + ")")
        out.append("")
        head = ["op"] + impls + ["hps_t1 / best peer", "hps_t1 / best unprefetched peer", "hps_t2 / hps_t1"]
        rows = []
        for op in W2_OPS:
            cells = [spread(ops[op][i]["median"], ops[op][i]["min"], ops[op][i]["max"], ".2f")
                     if i in ops[op] else "-" for i in impls]
            ratio_cells = [w2_cell(r, op, "hps_t1_over_best_peer", W2_PEERS),
                           w2_cell(r, op, "hps_t1_over_best_plain_peer", W2_PLAIN)]
            rows.append([op] + cells + ratio_cells + [w2_scaling_cell(r, op)])
        out += table(head, rows) + [""]
    t = o.get("targets") or {}
    if t:
        met = {True: "met", False: "missed", None: "not judged (not every implementation ran)"}[t.get("met")]
        out.append(f"- Targets ({t.get('rule')}): {met}" +
                   (f"; misses: {'; '.join(t['misses'])}" if t.get("misses") else ""))
    oc = o.get("other_cpus") or {}
    if oc:
        out.append(f"- Other work on the machine: {num(oc.get('before'), '.2f')} CPUs before, "
                   f"{num(oc.get('during'), '.2f')} during the run")
    return out


# ------------------------------------------------------------------ W3
def w3_trace(name: str, t: dict) -> list[str]:
    if "skipped" in t:
        return [f"**{name}**: skipped ({t['skipped']})", ""]
    desc = ", ".join(f"{k} {t[k]}" for k in ("zipf_a", "universe", "seed") if k in t)
    out = [f"**{name}**: {t['accesses']:,} accesses, {t['unique_keys']:,} unique keys"
           + (f" ({desc})" if desc else ""), ""]
    caps = t["capacities"]
    if not caps:
        return out
    policies = [p for p in caps[0]["hit_rate"] if p != "py_lru"]
    head = ["capacity"] + policies + ["best native / Belady"]
    rows = []
    for c in caps:
        ch = c.get("checks", {})
        best = ch.get("best_native")
        rows.append([f"{c['fraction'] * 100:g}% = {c['rows']:,} rows"]
                    + [num(c["hit_rate"][p], ".4f") for p in policies]
                    + [f"{num(ch.get('best_ratio_to_belady'), '.4f')} ({best})" if best else "-"])
    return out + table(head, rows) + [""] + w3_lookahead(t)


def w3_lookahead(t: dict) -> list[str]:
    """The trace's lookahead replays (issue 16), as fractions of Belady's hits."""
    la = t.get("lookahead")
    caps = t["capacities"]
    if not la or not la.get("ks") or "lookahead" not in caps[0]:
        return []
    policy, ks = la["policy"], [str(k) for k in la["ks"]]
    out = [f"With lookahead ({policy}, batches of {la['batch']}): hit rate / Belady's; "
           f"in brackets, / the ideal LFU's. K=0: no window; batch only: the rest of each batch alone "
           f"(what the pipeline's pins keep); K=k: the next k batches too", ""]
    batch = "batch" in caps[0]["lookahead"]  # the rest of each batch alone: what the pins keep
    head = (["capacity", "K=0"] + (["batch only"] if batch else []) + [f"K={k}" for k in ks]
            + ["ideal LFU", f"K={ks[-1]}: >= 0.95 / > ideal LFU"])
    rows = []
    for c in caps:
        la_c = c["lookahead"]
        last = la_c[ks[-1]]
        rows.append([f"{c['fraction'] * 100:g}% = {c['rows']:,} rows", num(c["ratio_to_belady"].get(policy), ".4f")]
                    + [f"{num(la_c[k]['ratio_to_belady'], '.4f')} ({num(la_c[k]['over_ideal_lfu'], '.3f')})"
                       for k in (["batch"] if batch else []) + ks]
                    + [num(c["ratio_to_belady"].get("ideal_lfu"), ".4f"),
                       f"{'yes' if last['aim_0.95'] else 'no'} / {'yes' if last['gt_ideal_lfu'] else 'no'}"])
    return out + table(head, rows) + [""]


def render_w3(o: dict) -> list[str]:
    out = ["Hit rates from a cold cache (a replay is deterministic: one run, no range).", ""]
    tuned = o.get("tuned_on")
    if tuned:
        out += [f"Traces the policies' parameters were tuned on: {tuned}", ""]
    for name, t in o.get("traces", {}).items():
        out += w3_trace(name, t)
    held = o.get("held_out")
    out.append("**Held out** (never used to choose a parameter):")
    out.append("")
    if not held:
        out += ["Not measured: this line has no held-out trace.", ""]
    else:
        for name, t in held.get("traces", {}).items():
            out += w3_trace(name, t)
    def listed(targets: dict) -> str:
        return ", ".join(f"{k}: {format(v, '.4f') if isinstance(v, float) else v}" for k, v in targets.items())

    if o.get("targets"):
        out.append("- Targets on the tuning traces: " + listed(o["targets"]))
    if held and held.get("targets"):
        out.append("- Targets on the held-out trace: " + listed(held["targets"]))
    for where, targets in (("tuning traces", o.get("lookahead_targets")),
                           ("held-out trace", (held or {}).get("lookahead_targets"))):
        for k, v in (targets or {}).items():
            out.append(f"- Lookahead {k}, {where}: " + listed(v))
    la = o.get("lookahead")
    if la and la.get("ks") and la.get("rule"):
        out.append(f"- Lookahead replays: {la.get('replay')}; {la['rule'].replace('`scan`', str(la.get('scan')))} "
                   "(MemCache::kLookaheadScan)")
    elif la and la.get("ks"):  # lines before 57ac656: the latest-needed of the candidates scanned
        out.append(f"- Lookahead replays: {la.get('replay')}; eviction scans at most {la.get('scan')} "
                   "candidates (MemCache::kLookaheadScan)")
    return out


# ------------------------------------------------------------------ W4 / W4s
W4_NAMES = {"hps": "hps", "torch": "PyTorch", "torchrec": "TorchRec", "mlp_alone": "the MLP alone (the bound)",
            "hps_device": "hps, device-tier path", "hps_glibc_malloc": "hps, glibc's malloc as it comes",
            "hps_torch_first_layer": "hps, torch's nn.Linear as the first layer"}


def render_w4(o: dict) -> list[str]:
    bags = o.get("multi_hot") or []
    fields = (", multi-hot fields " + ", ".join(f"{int(v):,} ids with bags of mean length {n:g}" for v, n in bags)
              if bags else "")
    out = [f"{o.get('examples', 0):,} training examples, {o.get('eval_examples', 0):,} held out, batch "
           f"{o.get('batch_size')}, MLP {o.get('mlp')}{fields}, {o.get('rounds')} round(s) (each system in its "
           "own process, the systems taking turns); examples/s: median (min-max) over the rounds.", ""]
    rows = []
    fraction = o.get("fraction_of_mlp_alone") or {}
    for s in ("hps", "hps_device", "hps_glibc_malloc", "hps_torch_first_layer", "torch", "torchrec", "mlp_alone"):
        e = o.get(s)
        if not e:
            continue
        runs = e.get("examples_per_s_runs") or [e["examples_per_s"]]
        name = W4_NAMES[s] + (f" ({o.get('device_path')} host partitions)" if s == "hps_device" else "")
        row = [name, spread(e["examples_per_s"], min(runs), max(runs), ",.0f"), str(len(runs)),
               num(e.get("auc"), ".4f"), num(e.get("logloss"), ".4f")]
        if fraction:
            row.append("1" if s == "mlp_alone" else num(fraction.get(s), ".2f"))
        rows.append(row)
    out += table(["system", "examples/s", "rounds", "eval AUC", "eval logloss"] +
                 (["/ the MLP alone"] if fraction else []), rows) + [""]
    out.append(f"- hps / PyTorch, examples/s: {per_round(o.get('ratio_per_round') or [])}")
    if "ratio_over_torchrec_per_round" in o:
        out.append(f"- hps / TorchRec, examples/s: {per_round(o['ratio_over_torchrec_per_round'])}")
    per = o.get("fraction_of_mlp_alone_per_round") or {}
    for s in ("torch", "torchrec"):
        if per.get(s):
            out.append(f"- the MLP alone / {W4_NAMES[s]}, examples/s (the most over it for a system that runs the MLP as torch does): "
                       f"{per_round([1.0 / f for f in per[s]])}")
    if per.get("hps"):
        out.append(f"- hps / the MLP alone: {per_round(per['hps'])}")
    if o.get("ratio_device_path_over_in_place_per_round"):
        out.append(f"- the device-tier path over {o.get('device_path')} host partitions / the in-place path, "
                   f"examples/s: {per_round(o['ratio_device_path_over_in_place_per_round'])}")
    if o.get("ratio_keep_freed_memory_per_round"):
        out.append("- hps (keep_freed_memory, the default) / hps with glibc's malloc as it comes, examples/s: "
                   f"{per_round(o['ratio_keep_freed_memory_per_round'])}")
    if o.get("ratio_own_first_layer_per_round"):
        out.append("- hps (its own first layer, the default) / hps with torch's nn.Linear as the first layer, "
                   f"examples/s: {per_round(o['ratio_own_first_layer_per_round'])}")
    if o.get("auc_difference") is not None:
        out.append(f"- AUC hps - PyTorch: {o['auc_difference']:+.4f}")
    p = (o.get("hps") or {}).get("pipeline") or {}
    if p:
        out.append(f"- W9, the median hps run: wall time / slowest stage {num(p.get('wall_over_slowest_stage'), '.2f')}"
                   f", bound by {p.get('bound_by')}")
    return out


# ------------------------------------------------------------------ W5
W5_NAMES = {"hps_ssd": "hps, table on SSD-PS", "rocksdb": "RocksDB peer", "hps_mem": "hps, table in memory",
            "rocksdb_rowcache": "RocksDB peer, row-cache split"}


def render_w5(o: dict) -> list[str]:
    limit = o.get("memory_limit")
    out = [f"{o.get('examples', 0):,} training examples, {o.get('repeat')} round(s), MLP {o.get('mlp')}; "
           f"{o.get('table', {}).get('rows', 0):,} rows, the hps MEM budget "
           f"{o.get('hps_mem_budget_bytes', 0) / 2**20:.1f} MiB; memory limit "
           + (f"{limit / 2**30:.2f} GiB" if limit else "none") + "; examples/s: median (min-max) over the rounds.",
           ""]
    rows = []
    for name, e in o.get("runs", {}).items():
        if e.get("status") != "ok":
            rows.append([W5_NAMES.get(name, name), str(e.get("status")), "-", "-", "-"])
            continue
        rng = e.get("examples_per_s_range") or {}
        rows.append([W5_NAMES.get(name, name), "ok",
                     spread(e["examples_per_s"], rng.get("min"), rng.get("max"), ",.0f"),
                     str(len(e.get("examples_per_s_rounds") or [1])), num(e.get("auc"), ".4f")])
    out += table(["run", "status", "examples/s", "rounds", "eval AUC"], rows) + [""]
    ratios = o.get("ratios") or {}
    best = o.get("rocksdb_best_per_round")  # several RocksDB splits: the faster of each round is the peer
    rocks_label = "hps on SSD / RocksDB" + (f" (the faster split of each round: {', '.join(map(str, best))})"
                                            if best else "")
    for key, label in (("hps_ssd_over_rocksdb", rocks_label),
                       ("hps_ssd_over_hps_in_memory", "hps on SSD / hps in memory")):
        if key in ratios:
            out.append(f"- {label}, examples/s: {per_round(ratios[key + '_per_round'])}")
        else:
            out.append(f"- {label}: not measured (a side is missing or failed)")
    h = o.get("runs", {}).get("hps_ssd", {})
    if h.get("status") == "ok":
        out.append(f"- hps on SSD, the median round: MEM-PS hit rate {num(h.get('mem_hit_rate'), '.3f')}, "
                   f"{h.get('rows_from_ssd', 0):,} rows read back from SSD-PS, bound by "
                   f"{(h.get('pipeline') or {}).get('bound_by')}")
    return out


# ------------------------------------------------------------------ W6
def render_w6(o: dict) -> list[str]:
    out = [f"{o.get('ranks')} ranks on {o.get('cores')} cores, {o.get('examples', 0):,} examples, batches of "
           f"{o.get('batch_per_rank')} a rank, MLP {o.get('hidden')}; one run each.", ""]
    rows = []
    for r in o.get("kstep", []):
        name = f"k-step Adam, k = {r['k']}" if r["dense_sync"] == "kstep" else "gradient all-reduce, torch Adam"
        rows.append([name, num(r.get("auc"), ".4f"), num(r.get("auc_minus_k1"), "+.4f"),
                     num(r.get("dense_bytes_per_rank", 0) / 1e6, ",.1f"), num(r.get("dense_bytes_over_k1"), ".3f"),
                     str(r.get("dense_merges", "-")), num(r.get("examples_per_s"), ",.0f")])
    out += table(["dense sync", "AUC", "AUC - (k = 1)", "dense MB sent per rank", "/ (k = 1)", "merges",
                  "examples/s"], rows) + [""]
    scaling = o.get("scaling") or []
    if scaling:
        one = scaling[0]["examples_per_s"]
        rows = [[str(r["ranks"]), num(r["examples_per_s"], ",.0f"), f"{r['examples_per_s'] / one:.2f}",
                 num(r.get("auc"), ".4f"),
                 ", ".join(f"{v / 1e3:,.0f} kB" for v in r["sparse_bytes_per_rank_per_batch"].values())
                 if r.get("sparse_bytes_per_rank_per_batch") else "-"] for r in scaling]
        out += table(["ranks", "examples/s", "vs 1 rank", "AUC", "sparse bytes per rank per batch"], rows) + [""]
    else:
        out.append("Scaling over ranks: not measured in this run.")
    return out


# ------------------------------------------------------------------ W7
W7_ORDER = ("naive", "on_demand", "location", "herald")


def render_w7(o: dict) -> list[str]:
    t = o.get("targets") or {}
    out = [f"{o.get('workers')} workers, LRU caches of {o.get('cache_fraction', 0):.0%} of a trace's distinct keys "
           f"each, {o.get('per_worker')} examples a worker a batch, rows of dim {o.get('dim')}; counts as ratios of "
           f"naive (sequential partition, write-through). Targets for Herald: pull <= {t.get('pull')}x, "
           f"push <= {t.get('push')}x, overall <= {t.get('overall')}x.", ""]
    rows = []
    for name, tr in (o.get("traces") or {}).items():
        if "modes" not in tr:
            rows.append([name, "skipped: " + str(tr.get("skipped")), "-", "-", "-", "-", "-"])
            continue
        modes = tr["modes"]
        for mode in sorted(modes, key=lambda m: (W7_ORDER.index(m) if m in W7_ORDER else len(W7_ORDER), m)):
            c = modes[mode]
            rows.append([f"{name} ({tr['examples']:,} ex, {tr['distinct_keys']:,} keys)", mode, f"{c['pulls']:,}",
                         num(c.get("pull_ratio"), ".3f"), f"{c['pushes']:,}", num(c.get("push_ratio"), ".3f"),
                         num(c.get("overall_ratio"), ".3f")])
    out += table(["trace", "schedule", "pulls", "/ naive", "pushes", "/ naive", "bytes / naive"], rows) + [""]
    rows = []
    for name, tr in (o.get("traces") or {}).items():
        if "lookahead" not in tr:
            continue
        naive_pulls = tr["modes"].get("naive", {}).get("pulls")

        def from_ps(c: dict) -> list[str]:
            """The pulls no peer served (the PS's), and their ratio to naive's pulls."""
            if c.get("peer_pulls") is None:
                return ["-", "-"]
            ps = c["pulls"] - c["peer_pulls"]
            return [f"{ps:,}", num(ps / naive_pulls if naive_pulls else None, ".3f")]

        for k, c in sorted(tr["lookahead"].items(), key=lambda kc: int(kc[0])):
            rows.append([name, f"K={k}", f"{c['pulls']:,}", num(c.get("pull_ratio"), ".3f"), *from_ps(c),
                         f"{c['pushes']:,}", num(c.get("push_ratio"), ".3f"), num(c.get("overall_ratio"), ".3f")])
        u = tr.get("unbounded")
        if u:
            rows.append([name, "unbounded caches", f"{u['pulls']:,}", num(u.get("pull_ratio"), ".3f"), *from_ps(u),
                         f"{u['pushes']:,}", num(u.get("push_ratio"), ".3f"), num(u.get("overall_ratio"), ".3f")])
        # Every first use is a pull from the PS: the pull floor is one too.
        floor_ps = [f"{tr['distinct_keys']:,}", num(tr.get("pull_floor_ratio"), ".3f")]
        if "forced_pushes" in tr:
            rows.append([name, "floors (any schedule)", f"{tr['distinct_keys']:,}",
                         num(tr.get("pull_floor_ratio"), ".3f"), *floor_ps, f"{tr['forced_pushes']:,}",
                         num(tr.get("push_floor_ratio"), ".3f"), num(tr.get("overall_floor_ratio"), ".3f")])
        else:  # lines before the push and overall floors
            rows.append([name, "distinct keys (pull floor)", "-", num(tr.get("pull_floor_ratio"), ".3f"), *floor_ps,
                         "-", "-", "-"])
    if rows:
        out += [f"Herald with lookahead: the keys of the next K batches as each batch's window (K=0: the herald row "
                f"above); beside them, Herald with unbounded caches (no eviction: about the most an eviction order "
                f"can save) and the floors no schedule of these caches goes below: each distinct key is pulled once "
                f"at least (its first use), and each key the caches cannot hold at the end, the distinct keys less "
                f"workers x capacity, was pushed once at least (it was trained, so dirty, and left its last cache). "
                f"\"From the PS\": the pulls no peer's cache served (with unbounded caches, the keys' first uses, "
                f"one for each worker that trains a key in its first batch), as a ratio of naive's pulls. "
                f"Ratios of naive; targets pull <= {t.get('pull')}x, push <= {t.get('push')}x, overall <= "
                f"{t.get('overall')}x.", ""]
        out += table(["trace", "Herald", "pulls", "/ naive", "from the PS", "/ naive", "pushes", "/ naive",
                      "bytes / naive"], rows) + [""]
        below = [f"{name}: {what} (target {t.get(what)}x, floor {tr[f'{what}_floor_ratio']:.3f}x)"
                 for name, tr in (o.get("traces") or {}).items() if "targets_reachable" in tr
                 for what, ok in tr["targets_reachable"].items() if not ok]
        if below:
            out += ["Targets below their floor, which no schedule meets on that trace with these caches: "
                    + "; ".join(below) + ".", ""]
    rows = []
    for name, tr in (o.get("traces") or {}).items():
        if "last_quarter" not in tr:  # lines before the per-batch pulls
            continue
        q = tr["last_quarter"]
        runs = [("herald", tr["modes"]["herald"])]
        runs += [(f"herald, K={k}", c) for k, c in sorted(tr.get("lookahead", {}).items(), key=lambda kc: int(kc[0]))
                 if k != "0"][-1:]
        runs += [("herald, unbounded caches", tr["unbounded"])] if "unbounded" in tr else []
        for label, c in runs:
            rows.append([name, num(tr.get("pull_floor_ratio"), ".3f"), label, num(c.get("pull_ratio"), ".3f"),
                         num(c.get("past_first_uses_ratio"), ".3f"),
                         f"{q['first_batch'] + 1}-{tr['batches']}", num(q.get("first_uses_over_naive_pulls"), ".3f"),
                         num(c.get("last_quarter_pull_ratio"), ".3f")])
    if rows:
        out += ["Past the first uses: a key's first use is a pull in every schedule, so a short trace's pulls are "
                "largely first uses, which a long trace (the paper's) has few of. \"Past first uses\": a schedule's "
                "pulls less the trace's distinct keys, over naive's pulls less them. \"Last quarter\": the trace's "
                "last quarter of batches alone, its first uses (keys no earlier batch had) and Herald's pulls as "
                "ratios of naive's pulls in those batches. The pull target is on the whole trace.", ""]
        out += table(["trace", "first uses / naive", "schedule", "pulls / naive", "past first uses / naive's",
                      "last quarter: batches", "first uses / naive", "pulls / naive"], rows) + [""]
    for name, tr in (o.get("traces") or {}).items():
        p = tr.get("partition_headroom")
        if p:
            out.append(f"- Partition headroom, {name}, first {p['batches']} batches: Herald's partition pulls "
                       f"{p['herald_pulls']:,}; after a local search of two-example swaps between workers (shares "
                       f"kept, the same caches) {p['swap_refined_pulls']:,}, {p['refined_over_herald']:.4f}x")
    cost = o.get("schedule_cost") or {}
    for w, c in sorted((cost.get("workers") or {}).items(), key=lambda wc: int(wc[0])):
        out.append(f"- Herald.schedule, {w} workers, batches of {cost.get('batch')} x {cost.get('fields')} keys: "
                   f"{spread(c['median_ms'], c.get('min_ms'), c.get('max_ms'), '.1f')} ms"
                   + (f" (CPU {c['cpu_median_ms']:.1f} ms)" if c.get("cpu_median_ms") is not None else "")
                   + (f", mean {c['mean_ms']:.1f} ms (compaction batches included)"
                      if c.get("mean_ms") is not None else "")
                   + ", snapshot "
                   f"{c['snapshot_bytes'] / max(1, c['cached_keys']):.1f} bytes a cached key")
    return out


# ------------------------------------------------------------------ W8
def render_w8(o: dict) -> list[str]:
    out = [f"`{o['topology']}` ({o['topology_name']}, {o['endpoints']} GPUs): an all-to-all of {o['rows']:,} rows of "
           f"{o['dim']} floats spread evenly over the pairs ({o['bytes_per_pair'] / 1e6:.1f} MB a pair), then the push "
           f"back. Modelled times (include/hps/topology.h's cost model); target: relay >= {o['target_reduction']:.0%} "
           f"below host, met: {'yes' if o.get('meets_target') else 'NO'}.", ""]
    rows = []
    for d in ("pull", "push"):
        for s in ("host", "direct", "relay"):
            m = o["model"][d][s]
            counts = ", ".join(f"{k} {v}" for k, v in m["route_count"].items() if v and k != "none")
            rows.append([d, s, f"{m['seconds'] * 1e3:.3f}", num(1 - m["reduction_vs_host"], ".3f"), counts])
    out += table(["transfer", "schedule", "modelled ms", "/ host", "routes"], rows) + [""]
    rows = [[name, "-", "-", f["error"]] if "error" in f else
            [name, f"{f['seconds'] * 1e3:.3f}", num(1 - f["reduction_vs_host"], ".3f"), "-"]
            for name, f in ((o.get("fixed_rules") or {}).get("pull") or {}).items()]
    if rows:
        out += ["Hard-coded relay rules for the pairs without a link, the pull (modelled):", ""]
        out += table(["rule", "modelled ms", "/ host", "error"], rows) + [""]
    ex = o.get("executor") or {}
    rows = [[s, spread(x["median_s"] * 1e3, x["min_s"] * 1e3, x["max_s"] * 1e3, ".2f"), f"{x['staged_bytes'] / 1e6:,.1f}",
             "yes" if x["delivered_as_direct"] else "NO"] for s, x in (ex.get("pull") or {}).items()]
    out += [f"Host executor on this machine (memcpy; {ex.get('rows', 0):,} rows, {ex.get('repeats')} runs a schedule; "
            "it checks the schedule, not NVLink):", ""]
    out += table(["schedule", "ms, median (min-max)", "MB staged", "bytes as a direct copy"], rows) + [""]
    tm = o.get("train_matrices")
    if tm:
        rr = tm["run_routes"]
        out += [f"`hps train`'s recorded matrix: {tm['devices']} host partitions, dim {tm['dim']}, {tm['batches']} "
                f"batches of {tm['batch_size']}, the tier's transfers routed through `{o['topology']}` (executed: "
                f"{'yes' if rr['executed'] else 'no'}; rows direct / relayed: {rr['rows_by_route']['direct']:,} / "
                f"{rr['relayed_rows']:,}); the pull counted from the data, plus its transpose, equals the recorded "
                f"matrix: {'yes' if tm['pull_plus_transpose_equals_recorded'] else 'NO'}. A batch's mean pull "
                f"({tm['pull_bytes_per_batch_offdiag'] / 1e6:.2f} MB between devices) and push, modelled:", ""]
        rows = []
        for d in ("pull", "push"):
            m = tm["model_per_batch"][d]
            rows += [[d, s, f"{m[s]['seconds'] * 1e6:.1f}", num(1 - m[s]["reduction_vs_host"], ".3f")]
                     for s in ("host", "direct", "relay")]
        out += table(["transfer", "schedule", "modelled us", "/ host"], rows) + [""]
    rows = [[name, *(f"{v[s]['seconds'] * 1e3:.3f}" for s in ("host", "direct", "relay")),
             num(1 - v["relay"]["reduction_vs_host"], ".3f")] for name, v in (o.get("other_nodes") or {}).items()]
    if rows:
        out += ["The same pull on the other shipped nodes (modelled):", ""]
        out += table(["node", "host ms", "direct ms", "relay ms", "relay / host"], rows) + [""]
    out.append(f"- CUDA executor: {(o.get('cuda') or {}).get('note', 'not run')}")
    bind = o.get("binding") or {}
    if bind:
        out += ["", "Core binding plans (`Pipeline(binding=...)` pins each helper thread to its stage's cores):", ""]
        rows = []
        for name, p in bind.items():
            if p["noop"]:
                rows.append([name.replace("_", " "), "every stage", "-", "-", p["reason"]])
                continue
            for x in p["stages"]:
                rows.append([name.replace("_", " "), x["stage"], str(x["numa"]), cpulist(x["cores"]), x["reason"]])
        out += table(["machine", "stage", "node", "cores", "why"], rows)
    return out


def cpulist(cores: list) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts) or "-"


# ------------------------------------------------------------------ W12
def w12_memory_verdict(o: dict) -> str:
    """"yes", or NO with the OOM kills the cgroup counted in each process of the job."""
    kills, before = [], 0
    for p in o.get("phases") or []:  # the processes share one cgroup: its counter adds up over them
        cg = p.get("cgroup") or {}
        total = cg.get("oom_control.oom_kill", 0) + cg.get("events.oom_kill", 0)
        kills.append((p.get("phase"), total - before))
        before = total
    if any(k for _, k in kills):
        return "NO: the kernel killed it for memory (" + ", ".join(f"{name} run: {k}" for name, k in kills if k) + ")"
    return "yes" if o.get("within_memory_limit") else "NO"


def render_w12(o: dict) -> list[str]:
    plan, mem, io, dev = o["plan"], o.get("memory") or {}, o.get("io") or {}, o.get("device_limits") or {}
    cpu = o.get("cpu") or {}
    limit = o.get("memory_limit")
    keys = o.get("distinct_keys", 0)
    out = [f"`hps train`, {o.get('examples_trained', 0):,} examples in batches of {o['batch_size']}, MLP "
           f"{o['mlp']}, dim {o['dim']}, {o['optimizer']}; Zipf({plan['zipf_a']}) over "
           f"{plan['vocab_per_field']:,} ids in each of {plan['fields']} fields: {keys:,} distinct keys (target "
           f"{plan['keys_target']:,}, the plan expected {plan['expected_distinct_keys']:,.0f}), "
           f"{keys * o['row_bytes'] / 2**30:.1f} GiB of rows and state; MEM-PS budget {o['mem_budget']}; the job in "
           + (f"a {limit / 2**30:.2f} GiB memory cgroup" if limit
              else f"no memory cgroup ({o.get('memory_limit_note')})")
           + ". One run, killed once and resumed.", ""]
    first = (o.get("phases") or [{}])[0]
    killed = first.get("killed") or {}
    v = o.get("verify") or {}
    rows = [["finished", "yes" if o.get("finished") else "NO"],
            ["SIGKILL", f"{killed.get('moment', 'none')}, {killed.get('seconds', 0):,.0f} s into the run; resumed "
                        f"from its last checkpoint (the killed run's last eval entry: "
                        f"{o.get('examples_at_resume', 0):,} examples)"
             if o.get("killed") else
             f"not sent: the kernel killed the first run for memory {first.get('seconds', 0):,.0f} s in; resumed "
             f"from its last checkpoint (the killed run's last eval entry: {o.get('examples_at_resume', 0):,} examples)"
             if first.get("returncode") == -9 and "NO: the kernel" in w12_memory_verdict(o)
             else "NO (the job was not killed)"],
            ["examples trained / planned", f"{o.get('examples_trained', 0):,} / {plan['examples']:,}"],
            ["final checkpoint reopened", f"{v.get('from_ssd', 0):,} of the first batch's "
                                          f"{v.get('first_batch_keys', 0):,} keys from SSD-PS, "
                                          f"{v.get('initialized', '-')} initialised anew"
             if v.get("returncode") == 0 else f"FAILED: {str(v.get('error', ''))[-200:]}"],
            ["disk / live, max over the run (limit 2)", f"{num(o.get('space_amplification_max'), '.2f')}; at the end "
                                                        f"{num(o.get('space_amplification_end'), '.2f')}"],
            ["within the memory limit", w12_memory_verdict(o)]]
    out += table(["check", "result"], rows) + [""]
    rows = [["examples/s over the job (the kill, restart and skip included)",
             num(o.get("examples_per_s_overall"), ",.0f")],
            ["examples/s, the resumed run's pipeline", num(o.get("examples_per_s_resumed_run"), ",.0f")],
            ["MEM-PS hit rate: first run (to its last checkpoint) / resumed run",
             f"{num(o.get('mem_hit_rate_first_run'), '.3f')} / {num(o.get('mem_hit_rate_resumed_run'), '.3f')}"],
            ["wall time", f"{o.get('wall_seconds', 0) / 60:,.1f} min"],
            ["bound by (resumed run's busiest stage)", str((o.get("pipeline") or {}).get("bound_by"))],
            ["cores busy: the job / the whole machine (of its cores)",
             f"{num(cpu.get('job_cores_busy_mean'), '.2f')} / {num(cpu.get('machine_cores_busy_mean'), '.2f')} "
             f"(of {cpu.get('cores', '-')})"]]
    out += table(["throughput", "value"], rows) + [""]
    rows = [["read", num(io.get("read_MB_per_s_mean"), ",.1f"), num(io.get("read_MB_per_s_max_interval"), ",.1f"),
             f"{num(dev.get('seq_read_MB_per_s'), ',.0f')} sequential, {num(dev.get('rand_read_4k_MB_per_s'), ',.0f')} "
             f"random 4 KiB"],
            ["write", num(io.get("write_MB_per_s_mean"), ",.1f"), num(io.get("write_MB_per_s_max_interval"), ",.1f"),
             f"{num(dev.get('seq_write_MB_per_s'), ',.0f')} sequential"]]
    out += table(["SSD I/O (the job's /proc/pid/io)", "MB/s, mean", "MB/s, busiest interval", "device limit (fio)"],
                 rows) + [""]

    def gib(b):
        return "-" if b is None else f"{b / 2**30:.2f} GiB"
    rows = [["MEM-PS budget (rows + bookkeeping)", gib(mem.get("mem_ps_budget_bytes")), "-"],
            ["MEM-PS row arena", gib(mem.get("mem_ps_arena_bytes")), "-"],
            ["SSD-PS key index", gib(mem.get("ssd_index_bytes")),
             f"{num(mem.get('ssd_index_bytes_per_key'), '.1f')} B a key"],
            ["process peak RSS", gib(mem.get("process_rss_peak_bytes")), "-"],
            ["cgroup peak (RSS + page cache)", gib(mem.get("cgroup_peak_bytes")), "-"],
            ["cgroup RSS, the largest sample", gib(mem.get("cgroup_anon_max_sampled_bytes")), "-"],
            ["limit", gib(limit), "-"]]
    out += table(["memory", "bytes", "per key"], rows)
    return out


# ------------------------------------------------------------------ W7s
def max_over_mean(vals) -> str:
    """How far the busiest of some devices or ranks is above their mean."""
    return f"{max(vals) / (sum(vals) / len(vals)):.2f}" if sum(vals) else "-"


def clean_dropped(h: dict) -> str:
    """The evicted rows dropped unwritten (not trained since their last write), where
    the line counts them (lines before that wrote every evicted row)."""
    return f" ({h['evict_clean_dropped']:,} clean ones dropped unwritten)" if "evict_clean_dropped" in h else ""


def render_w7s(o: dict) -> list[str]:
    c, res = o["config"], o["results"]
    seq, her = res["sequential"], res["herald"]
    out = [f"`hps train` on {c['devices']} host-partition devices, {c['examples']:,} examples of {c['data']} in "
           f"batches of {c['batch_size']} ({c['distinct_keys']:,} distinct keys; {c['batch_distinct_keys']:,} "
           f"summed over batches), dim {c['dim']}, MLP {c['mlp']}, {c['sparse_optimizer']}, torch threads "
           f"{c['torch_threads']}; Herald's caches {c['cache_rows']:,} rows a device ({c['cache_fraction']:.0%} of "
           f"the distinct keys). Counts are the same every round; examples/s is the median (min-max) of "
           f"{c['rounds']} rounds, the schedules interleaved. Eval AUC differs by {o['auc_difference']:.5f}.", ""]
    rows = []

    def ratio(x, y):
        return f"{y / x:.3f}" if x else "-"

    for name, key, scale, fmt in (("MEM-PS -> devices, rows", "mem_to_devices", 1, ",.0f"),
                                  ("devices -> MEM-PS, rows", "devices_to_mem", 1, ",.0f"),
                                  ("between devices, rows", "between_devices_rows", 1, ",.0f"),
                                  ("between devices, MB", "between_devices_bytes", 1e6, ",.1f")):
        x, y = seq[key] / scale, her[key] / scale
        rows.append([name, format(x, fmt), format(y, fmt), ratio(x, y)])
    rows.append(["examples/s", f"{seq['examples_per_s']:,.0f} ({seq['examples_per_s_min']:,.0f}-"
                 f"{seq['examples_per_s_max']:,.0f})", f"{her['examples_per_s']:,.0f} ({her['examples_per_s_min']:,.0f}-"
                 f"{her['examples_per_s_max']:,.0f})", ratio(seq["examples_per_s"], her["examples_per_s"])])
    rows.append(["eval AUC", num(seq.get("auc"), ".4f"), num(her.get("auc"), ".4f"), "-"])
    out += table(["", "sequential", "herald", "herald / sequential"], rows)
    if "device_in_rows" in seq and "device_in_rows" in her:
        out += ["", "The transfer matrix by device: rows each device sent to other devices and received from "
                "them (off the diagonal; the whole matrix is in the JSON line).", ""]
        devices = range(len(seq["device_in_rows"]))
        out += table(["", *(f"device {d}" for d in devices), "max / mean"],
                     [[f"{name}, {what}", *(f"{v:,}" for v in x[key]), max_over_mean(x[key])]
                      for name, x in (("sequential", seq), ("herald", her))
                      for what, key in (("sent", "device_out_rows"), ("received", "device_in_rows"))])
    h = her.get("herald") or {}
    if h:
        out += ["", f"Herald's rows: {h['ps_loads']:,} from MEM-PS and {h['peer_fetches']:,} from peers "
                f"(the plan's {h['plan_pulls']:,} pulls), {h['replica_copies']:,} replica copies (keys trained on "
                f"several devices), {h['evict_pushes']:,} evicted to MEM-PS"
                f"{clean_dropped(h)}, {h['flushed_rows']:,} flushed; "
                f"{h['compactions']} table rebuilds; scheduler snapshot {h['scheduler_bytes'] / 1e6:,.1f} MB."]
    mpi = o.get("mpi")
    if mpi:
        ms, mh = mpi["results"]["sequential"], mpi["results"]["herald"]
        out += ["", f"Under `mpiexec -n {mpi['ranks']}` (each rank one worker, batches of {mpi['batch_per_rank']:,} a "
                f"rank): bytes sent between ranks, summed over ranks, by kind; examples/s of the slowest rank. "
                f"Eval AUC differs by {mpi['auc_difference']:.5f}.", ""]
        rows = []
        for kind in ms["bytes_sent"]:
            x, y = ms["bytes_sent"][kind] / 1e6, mh["bytes_sent"][kind] / 1e6
            rows.append([f"{kind}, MB", f"{x:,.2f}", f"{y:,.2f}", ratio(x, y)])
        x, y = sum(ms["bytes_sent"].values()) / 1e6, sum(mh["bytes_sent"].values()) / 1e6
        rows.append(["all, MB", f"{x:,.2f}", f"{y:,.2f}", ratio(x, y)])
        if "fresh_rows_sent_as_bits" in ms and "fresh_rows_sent_as_bits" in mh:  # since FreshRows
            x, y = ms["fresh_rows_sent_as_bits"], mh["fresh_rows_sent_as_bits"]
            rows.append(["rows never trained, sent as a bit", f"{x:,}", f"{y:,}", ratio(x, y)])
        rows.append(["examples/s", f"{ms['examples_per_s']:,.0f} ({ms['examples_per_s_min']:,.0f}-"
                     f"{ms['examples_per_s_max']:,.0f})", f"{mh['examples_per_s']:,.0f} ({mh['examples_per_s_min']:,.0f}-"
                     f"{mh['examples_per_s_max']:,.0f})", ratio(ms["examples_per_s"], mh["examples_per_s"])])
        rows.append(["eval AUC", num(ms.get("auc"), ".4f"), num(mh.get("auc"), ".4f"), "-"])
        out += table(["", "sequential", "herald", "herald / sequential"], rows)
        if "bytes_sent_by_rank" in ms and "bytes_sent_by_rank" in mh:
            out += ["", "By rank: MB each rank sent, every kind but dense (which is the same for every rank).", ""]
            ranks = range(len(ms["bytes_sent_by_rank"]))
            sparse = {name: [sum(v for k, v in r.items() if k != "dense") / 1e6 for r in x["bytes_sent_by_rank"]]
                      for name, x in (("sequential", ms), ("herald", mh))}
            out += table(["", *(f"rank {r}" for r in ranks), "max / mean"],
                         [[name, *(f"{v:,.2f}" for v in vals), max_over_mean(vals)]
                          for name, vals in sparse.items()])
    return out


# ------------------------------------------------------------------ W13
def render_w13(o: dict) -> list[str]:
    c, syn, cri = o["config"], o["synthetic"], o.get("criteo") or {}
    out = [f"`hps train` once a threshold f: dim {c['dim']}, MLP {c['mlp']}, {c['sparse_optimizer']}, sketch "
           f"{c['sketch_bytes']} (f = 1: no sketch). Synthetic: {syn['examples']:,} examples in batches of "
           f"{syn['batch_size']}, {syn['eval_examples']:,} held out."
           + (f" Criteo sample: its first {cri['train_lines']:,} lines trained in batches of {cri['batch_size']}, "
              f"its last {cri['eval_lines']:,} held out." if "runs" in cri else
              f" Criteo sample: skipped ({cri.get('skipped', 'not run')}).")
           + " Rows created: rows the parameter server initialised; stored: rows in the table at the end; default "
             "reads: training occurrences that read the default row (their gradients dropped).", ""]
    rows = []
    for name, part in (("synthetic", syn), ("Criteo sample", cri)):
        for r in part.get("runs") or []:
            rows.append([name, str(r["threshold"]), f"{r['rows_created']:,}", f"{r['rows_stored']:,}",
                         f"{r['table_bytes'] / 1e6:,.2f}", f"{r['sketch_bytes'] / 2**20:,.1f}",
                         f"{r['default_reads']:,} ({r['default_read_fraction']:.1%})",
                         f"{r['eval_default_read_fraction']:.1%}", num(r.get("auc"), ".4f"),
                         num(r.get("logloss"), ".4f"), num(r.get("examples_per_s"), ",.0f")])
    out += table(["data", "f", "rows created", "rows stored", "table MB", "sketch MiB", "default reads (share)",
                  "eval default reads", "AUC", "logloss", "examples/s"], rows)
    return out


# ------------------------------------------------------------------ W10
def render_w10(o: dict) -> list[str]:
    rounds = o.get("rounds")  # since the rounds were added: lines before ran each job once
    intro = (f"Each workload one `hps train` job on the same {o['examples']:,} synthetic examples (MLP 429 -> 512 -> "
             f"256 -> 1, batch 1,024 a rank), evaluated on the same {o['eval_examples']:,} held-out ones. Bytes are "
             "per step, before and after the codec, between a trainer and its group PS (activations forward, "
             "gradients back) and for the background average. examples/s: every rank a process on the same 2 "
             "cores, so it measures the work, not a cluster.")
    if rounds:
        intro += (f" {rounds} round(s), every job once a round, the order rotated each round: examples/s is the "
                  "median (min-max) over the rounds; AUC, logloss and bytes repeated exactly in every round unless "
                  "a range is shown.")
    out = [intro, ""]
    rows = []
    for w in o["workloads"]:
        moved = "; ".join(f"{kind} {v['before'] / 1e3:,.1f} -> {v['after'] / 1e3:,.1f} kB"
                          for kind, v in sorted((w.get("bytes_per_step") or {}).items())) or "-"
        if w.get("bytes_per_step_runs"):
            moved += " (median of the rounds)"
        change = w.get("auc_change_vs_reference")
        placement = ", ".join(w["plan"]) if w.get("plan") else "-"
        if w.get("nets", 1) > 1:  # Hogwild nets on each trainer (lines before the Hogwild job have no "nets")
            placement += f"; {w['nets']} Hogwild nets"
        rows.append([f"`{w['workload']}`", str(w["ranks"]), placement, moved,
                     _w10_quality(w, "auc"), "-" if change is None else f"{change:+.4f}", _w10_quality(w, "logloss"),
                     spread(w["examples_per_s"], w.get("examples_per_s_min"), w.get("examples_per_s_max"), ",.0f")])
    out += table(["workload", "ranks", "placement", "bytes a step", "AUC", "vs reference", "logloss",
                  "examples/s"], rows)
    if o.get("ratios"):
        out += ["", "examples/s ratios taken within each round, their median and each round's:", ""]
        out += [f"- `{q['workload']}` / `{q['peer']}`: {per_round(q['runs'])}" for q in o["ratios"]]
    split = [w for w in o["workloads"] if w.get("nodes")]
    if split:
        out += [""] + _w10_nodes(o, split)
    return out


def _w10_quality(w: dict, field: str) -> str:
    """AUC or logloss: one value, or median (min-max) where the rounds differed."""
    runs = w.get(f"{field}_runs")
    if runs:
        fmt = ".4f" if format(min(runs), ".4f") != format(max(runs), ".4f") else ".5f"  # a range that shows
        return spread(w[field], min(runs), max(runs), fmt)
    return f"{w[field]:.4f}"


def _w10_ratio(s: dict | None) -> str:
    if not s:
        return "-"
    fmt = ",.0f" if s["median"] >= 100 else ".2f"
    return spread(s["median"], s["min"], s["max"], fmt) + "x"


def _w10_ms(s: dict | None) -> str:
    if not s:
        return "-"
    return spread(s["median"] * 1e3, s["min"] * 1e3, s["max"] * 1e3, ".3g")


def _w10_nodes(o: dict, split: list) -> list[str]:
    """The planner's modelled per-node step beside the measured one, for the split jobs."""
    rate = o["flops_per_cpu_second"]
    out = [f"The planner's model against the jobs, per node of each split job and per step of {o['batch_size']:,} "
           "training examples; measured / modelled paired by round, median (min-max). **Modelled** (the "
           "planner's `node_costs` for the plan the job ran): CPU = FLOPs at "
           f"{spread(rate['median'] / 1e9, rate['min'] / 1e9, rate['max'] / 1e9, '.1f')} GFLOP per CPU second, "
           f"the rate measured here before each round ({rate['how']}); bytes from the codecs' bytes per value; "
           "network time at the planner's 10 Gb/s (modelled only: the ranks share one machine, there is no "
           "network to measure). **Measured**: the group PS's CPU time handling the trainer's training requests; "
           "the trainer's whole process (data, embeddings, sparse rows, codecs, evaluation, where the planner "
           "models only its dense layer); each process's CPU and wall time in all (the group PS's includes its "
           "sleeping poll for requests, hps.distributed.poll); bytes, the codec payloads of the training requests and replies.", ""]
    rows = []
    for w in split:
        for n in w["nodes"]:
            m, e = n["modelled"], n["measured"]
            rows.append([f"`{w['workload']}`", f"{n['node']} ({', '.join(n['layers']) or '-'})",
                         f"{m['flops_per_step'] / 1e9:.3g}", _w10_ms(m["cpu_s_per_step"]),
                         f"{_w10_ms(e['cpu_s_per_step'])} ({e['cpu_is']})", _w10_ratio(n["cpu_measured_over_modelled"]),
                         _w10_ms(e["process_cpu_s_per_step"]), _w10_ms(e["process_wall_s_per_step"]),
                         f"{m['net_s_per_step'] * 1e3:.3g}", f"{m['net_bytes_per_step'] / 1e6:,.2f}",
                         f"{e['net_bytes_per_step'] / 1e6:,.2f}",
                         "-" if n["net_bytes_measured_over_modelled"] is None
                         else f"{n['net_bytes_measured_over_modelled']:.3f}x"])
    out += table(["workload", "node (layers)", "GFLOP, modelled", "CPU ms, modelled", "CPU ms, measured",
                  "measured / modelled", "process CPU ms, measured", "process wall ms, measured",
                  "network ms, modelled", "MB, modelled", "MB, measured", "bytes measured / modelled"], rows)
    return out


# ------------------------------------------------------------------ W11
def _w11_writer(w) -> str:
    if not w:
        return " No writer."
    if w.get("mode") == "train":
        return (f" `hps train` trained meanwhile ({w['batches_checkpointed']:,} batches, "
                f"{w['examples_checkpointed']:,} examples and {w['checkpoints']:,} checkpoints in {w['wall_s']:,.0f} s).")
    return f" A writer pushed {w['pushes']:,} batches and made {w['checkpoints']:,} checkpoints during the runs."


def render_w11(o: dict) -> list[str]:
    mib = o["memory_budget_bytes"] / 2**20
    out = [f"{o['rows']:,} rows of dim {o['dim']}, batches of {o['batch_keys']:,} keys, {o['batches']} batches a "
           f"run after a warmup, {o['clients']} clients, memory {mib:,.1f} MiB for each store ({o['memory_ratio']:g}x "
           f"less than the rows); {o['repeats']} runs a store, interleaved; medians (min-max)."
           + (f" Every run in a memory cgroup of its own, limit {o['cgroup_limit_bytes'] / 2**20:,.0f} MiB (the "
              "largest peak of the runs is shown)." if o.get("cgroup_limit_bytes") else "")
           + _w11_writer(o.get("writer")), ""]
    rows = []
    for dist in ("uniform", "zipf"):
        for store, label in (("hps", "hps.Lookup"), ("rocksdb", "RocksDB multi_get")):
            r = o["results"].get(f"{store}/{dist}")
            if r is None:
                continue
            extra = ""
            if store == "hps":
                hit = r["cache_hit_rate"]
                extra = (f"hit rate of the last checkpoint's cache {hit:.2f}, {r['refreshes']} refreshes (slowest "
                         f"{r['refresh_max_s']:.2f} s)" if r.get("refreshes") else f"hit rate {hit:.2f}")
            if r.get("cgroup_peak_bytes") is not None:
                extra += ("; " if extra else "") + f"cgroup peak {r['cgroup_peak_bytes'] / 2**20:,.0f} MiB"
            if store == "hps" and r.get("measured_bytes") is not None:
                extra += (f"; memory measured {r['measured_bytes'] / 2**20:,.1f} MiB (by {r.get('measured_by', '?')}), "
                          f"its accounting's peak {r['memory']['peak_held_bytes'] / 2**20:,.1f} MiB: "
                          + ("within" if r["within_budget"] else "**over**") + " the budget")
            rows.append([dist, label, spread(r["keys_per_s"], r.get("keys_per_s_min"), r.get("keys_per_s_max"), ",.0f"),
                         spread(r["p50_ms"], r.get("p50_ms_min"), r.get("p50_ms_max"), ",.1f"),
                         spread(r["p99_ms"], r.get("p99_ms_min"), r.get("p99_ms_max"), ",.1f"), extra])
        q = o["results"].get(f"ratio/{dist}")
        if q is not None:
            rows.append([dist, "**hps / RocksDB**, x", f"**{per_round(q['keys_per_s_runs'])}**", "",
                         per_round(q["p99_runs"]), "p99: under 1 is better"])
    out += table(["distribution", "store", "keys/s", "p50 ms", "p99 ms", ""], rows)
    return out


# ------------------------------------------------------------------ readers
READER_FORMATS = (("criteo_tsv", "Criteo TSV"), ("csv_schema", "CSV with a header, by `[data.schema]`"),
                  ("parquet_schema", "Parquet, by `[data.schema]`"), ("libsvm", "libsvm"),
                  ("tsv_dirty", "Criteo TSV with malformed lines (`skip_malformed`)"),
                  ("tsv_dirty_python", "the same, by the pure-Python line parser"))


def render_reader(o: dict) -> list[str]:
    t = o["train"]
    rate = t["examples_per_s"]
    out = [f"Each format read alone ({next(iter(o['examples'].values())):,} examples, {o['rounds']} rounds, batches "
           f"of {o['batch']:,}), then the W4 model trained on the TSV through the pipeline at {rate:,.0f} "
           "examples/s (the last column: reading's rate over training's).", ""]
    rows = []
    for key, label in READER_FORMATS:
        r = o["read_examples_per_s"].get(key)
        if r is not None:
            rows.append([label, spread(r["median"], r["min"], r["max"], ",.0f"), f"{r['median'] / rate:.1f}x"])
    out += table(["format", "read examples/s, median (min-max)", "/ training"], rows)
    line = (f"In the pipeline: read stage busy / train stage busy {t['read_over_train']:.3f} (wall time)")
    if "read_cpu_over_train_busy" in t:
        line += f", read thread's CPU / train stage busy {t['read_cpu_over_train_busy']:.3f}"
    if "read_alone_cpu_over_train_busy" in t:
        line += f", the TSV read alone, CPU of every thread / train stage busy {t['read_alone_cpu_over_train_busy']:.3f}"
    out += ["", line + f"; bound by {t.get('bound_by', '-')}."]
    return out


def render_w4l(o: dict) -> list[str]:
    out = [f"grad ({o['examples']:,}, k) times the first layer's weight: every one of its {o['columns']} input "
           f"columns, as nn.Linear's autograd computes, or the {o['embedding_columns']} embedding columns, as "
           f"hps.torch's CtrModel does on the CPU; milliseconds a product from cold caches, median (min-max) of "
           f"{o['repeats']}, torch {o['torch']} ({o['torch_blas']}).", ""]
    rows = [[str(r["threads"]), str(r["k"]),
             spread(r["every_column"]["median_ms"], r["every_column"]["min_ms"], r["every_column"]["max_ms"], ".2f"),
             spread(r["embedding_columns"]["median_ms"], r["embedding_columns"]["min_ms"],
                    r["embedding_columns"]["max_ms"], ".2f"),
             f"{r['ratio']:.2f}x"] for r in o["rows"]]
    out += table(["torch threads", "k (first layer's units)", "every column, ms", "embedding columns, ms",
                  "every / embedding"], rows)
    def ms(side):
        return spread(side["median_ms"], side["min_ms"], side["max_ms"], ".2f")

    padded = [r for r in o["rows"] if "padded_weight_grad" in r]  # the earlier lines lack it
    if padded:
        out += ["", f"Above 16 units, the weight's gradient (grad.T times x) over x's {o['columns']} columns, as "
                    f"nn.Linear's autograd computes it, and over x's rows padded to a multiple of 64 bytes, as "
                    f"hps.torch's CtrModel does on the CPU (the weight's columns copied out after); ratios are the "
                    f"first's time over the second's.", ""]
        out += table(["torch threads", "k", f"over {o['columns']} columns, ms", "over padded rows, ms",
                      "columns / padded"],
                     [[str(r["threads"]), str(r["k"]), ms(r["torch_weight_grad"]), ms(r["padded_weight_grad"]),
                       f"{r['padded_weight_grad_ratio']:.2f}x"] for r in padded])
    narrow = [r for r in o["rows"] if "hps_forward" in r]
    if narrow:
        weight = all("hps_weight_grad" in r for r in narrow)  # lines before its kernel lack it
        out += ["", f"At k <= 16, where CtrModel runs hps's own kernels (hps/narrow_linear.h, the "
                    f"{o.get('hps_kernel', '?')} version here), the same products by hps, and the forward product "
                    f"(x ({o['examples']:,}, {o['columns']}) times the weight, plus the bias) by torch's addmm and by "
                    f"hps" + (", and the weight's and bias's gradients (grad.T times x, grad's column sums) by torch's "
                              "mm and sum and by hps" if weight else "") + "; ratios are torch's time over hps's.", ""]
        out += table(["torch threads", "k", "embedding columns: torch mm, ms", "hps, ms", "torch / hps",
                      "forward: torch addmm, ms", "hps, ms", "torch / hps"]
                     + (["weight's and bias's gradients: torch mm + sum, ms", "hps, ms", "torch / hps"] if weight else []),
                     [[str(r["threads"]), str(r["k"]), ms(r["embedding_columns"]), ms(r["hps_embedding_columns"]),
                       f"{r['hps_input_grad_ratio']:.2f}x", ms(r["torch_forward"]), ms(r["hps_forward"]),
                       f"{r['hps_forward_ratio']:.2f}x"]
                      + ([ms(r["torch_weight_grad"]), ms(r["hps_weight_grad"]), f"{r['hps_weight_grad_ratio']:.2f}x"]
                         if weight else []) for r in narrow])
    return out


# ------------------------------------------------------------------ prefetch with a lookahead window
def render_ps_lookahead(o: dict) -> list[str]:
    examples, fields = o["batch"]
    d = o["distinct_keys"]
    out = [f"ParameterServer.prefetch + release, ms a batch: median (min-max) over {o['batches']} batches x "
           f"{o['rounds']} rounds; batches of {examples:,} x {fields} keys from Zipf({o['zipf_a']}) over "
           f"{o['universe']:,} keys (~{d['a_batch_median']:,} distinct a batch, {d['a_round']:,} a round), "
           f"MEM-PS of {o['mem_capacity_rows']:,} rows starting empty each run, every key on SSD-PS. "
           "\"/ no window\": the variant's median over K = 0's, per round. MEM-PS's counters are of one run "
           "(the one with the median hits of the rounds').", ""]
    base = o["variants"].get("K=0")
    rows = []
    # By K, slid before set (a JSON line's keys come back sorted as strings: "K=16" before "K=4").
    for name, v in sorted(o["variants"].items(), key=lambda nv: (nv[1]["k"], nv[1]["window"] != "slid")):
        t = v["ms_a_batch"]
        runs = sorted(v["mem"], key=lambda m: m["hits"])
        run = runs[(len(runs) - 1) // 2]  # one run's counters, which add up (misses + hits: the keys)

        def counter(c):
            return f"{run[c]:,}"

        ratio = "-" if base is None or name == "K=0" else per_round(
            [a / b for a, b in zip(v["ms_a_batch_round_medians"], base["ms_a_batch_round_medians"])])
        rows.append([str(v["k"]), v["window"], spread(t["median"], t["min"], t["max"], ".1f"), ratio,
                     counter("hits"), counter("misses"), counter("evictions"), counter("lookahead_spared"),
                     counter("lookahead_forced"), counter("lookahead_slides")])
    return out + table(["K", "window", "ms a batch", "/ no window", "hits", "misses", "evictions", "spared",
                        "forced", "slides"], rows)


RENDER = {"w1": render_w1, "w2": render_w2, "w3": render_w3, "w4": render_w4, "w4s": render_w4, "w4m": render_w4, "w4a": render_w4,
          "w4f": render_w4, "w4l": render_w4l, "w5": render_w5, "w6": render_w6, "w7": render_w7, "w7s": render_w7s, "w8": render_w8, "w12": render_w12,
          "w10": render_w10, "w11": render_w11, "w11w": render_w11, "w11m": render_w11, "w13": render_w13, "reader": render_reader,
          "ps_lookahead": render_ps_lookahead}


# ------------------------------------------------------------------ regions
def region_body(wid: str, results_dir: str, root: str) -> str:
    found = latest(results_dir, wid)
    if found is None:
        rel = os.path.relpath(os.path.join(results_dir, f"{wid}.jsonl"), root)
        return (f"_Generated by `python3 bench/report.py`._ Not measured at this commit: `{rel}` holds no "
                "result line yet.\n")
    path, no, count, obj = found
    try:
        lines = provenance_lines(path, no, count, obj, root) + RENDER[wid](obj)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ReportError(f"{path}:{no}: the {wid} line lacks a field the table needs ({type(e).__name__}: {e})")
    return "\n".join(lines).rstrip("\n") + "\n"


def check_markers(text: str, docs: str) -> None:
    """Every opening marker has its closing one, in order, and names a workload."""
    stack = []
    for m in OPEN.finditer(text):
        no = text.count("\n", 0, m.start()) + 1
        closing, wid = m.group(1) == "/", m.group(2)
        if wid not in RENDER:
            raise ReportError(f"{docs}:{no}: unknown workload {wid!r} in a report marker "
                              f"(known: {', '.join(WORKLOADS)})")
        if not closing:
            if stack:
                raise ReportError(f"{docs}:{no}: report:{wid} opens inside report:{stack[-1][0]} "
                                  f"(opened on line {stack[-1][1]})")
            stack.append((wid, no))
        elif not stack or stack[-1][0] != wid:
            raise ReportError(f"{docs}:{no}: /report:{wid} closes nothing that is open")
        else:
            stack.pop()
    if stack:
        raise ReportError(f"{docs}:{stack[-1][1]}: report:{stack[-1][0]} is never closed")


def render_docs(text: str, results_dir: str, docs: str, root: str) -> str:
    check_markers(text, docs)
    return REGION.sub(lambda m: f"<!-- report:{m['id']} -->\n{region_body(m['id'], results_dir, root)}"
                                f"<!-- /report:{m['id']} -->", text)


def add(paths: list[str], results_dir: str) -> list[str]:
    """Files every benchmark JSON line of `paths` under results_dir; returns what it wrote."""
    written = []
    pending = []
    for path in paths:
        if path == "-":
            found = list(json_lines(sys.stdin, "<stdin>"))
        else:
            with open(path, encoding="utf-8") as f:
                found = list(json_lines(f, path))
        if not found:
            raise ReportError(f"{path}: no JSON line (a benchmark prints one, starting with '{{')")
        for no, obj in found:
            where = f"{path}:{no}"
            wid = workload_of(obj)
            if wid is None:
                raise ReportError(f"{where}: benchmark {obj.get('benchmark')!r} is none of "
                                  f"{', '.join(WORKLOADS)}")
            check_provenance(obj, where)
            if obj.get("quick"):
                raise ReportError(f"{where}: a --quick line; the docs report full runs only")
            pending.append((wid, obj))
    os.makedirs(results_dir, exist_ok=True)
    for wid, obj in pending:  # nothing is written unless every line is acceptable
        target = os.path.join(results_dir, f"{wid}.jsonl")
        with open(target, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")
        written.append(target)
    return written


def json_lines(lines, name: str):
    """(line number, object) of the lines that hold a JSON object: a benchmark's
    output may have text lines before its JSON line (W6 prints its tables)."""
    for no, text in enumerate(lines, 1):
        if text.strip().startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise ReportError(f"{name}:{no}: not a JSON line ({e})") from None
            if isinstance(obj, dict):
                yield no, obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the docs differ from their JSON lines")
    ap.add_argument("--add", nargs="+", metavar="FILE", help="file these JSON lines ('-': stdin) under --results")
    ap.add_argument("--docs", default=DOCS, help="the markdown file with the regions (default docs/benchmarks.md)")
    ap.add_argument("--results", default=RESULTS, help="the folder of <workload>.jsonl (default docs/results)")
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(a.docs)))
    try:
        if a.add:
            for target in add(a.add, a.results):
                print(f"report: added a line to {target}", file=sys.stderr)
        with open(a.docs, encoding="utf-8") as f:
            text = f.read()
        new = render_docs(text, a.results, a.docs, root)
    except (ReportError, OSError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    if new == text:
        print(f"report: {a.docs} is up to date", file=sys.stderr)
        return 0
    stale = [m["id"] for m, n in zip(REGION.finditer(text), REGION.finditer(new)) if m["body"] != n["body"]]
    if a.check:
        print(f"report: {a.docs} is out of date in region(s) {', '.join(stale)}; run python3 bench/report.py",
              file=sys.stderr)
        return 1
    with open(a.docs, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"report: rewrote region(s) {', '.join(stale)} of {a.docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
