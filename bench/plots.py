#!/usr/bin/env python3
"""Plots for docs/benchmarks.md from the benchmarks' JSON lines.

    python3 bench/plots.py w1 bench/results/ssd_store-<date>.json     -> docs/img/w1.png
    python3 bench/plots.py w3 bench/results/cache_policy-<date>.json  -> docs/img/w3.png
    python3 bench/plots.py w4 w4.json [w4s.json]                       -> docs/img/w4.png
    python3 bench/plots.py w6 w6.json                                  -> docs/img/w6.png
    python3 bench/plots.py w7 docs/results/w7.jsonl                    -> docs/img/w7.png
"""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = os.path.join(ROOT, "docs", "img")


def load(path):
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def w1(path):
    d = load(path)
    stores = [s for s, e in d["stores"].items() if e.get("status") == "ok"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(stores)
    ops = [("uniform", "get"), ("zipf", "get"), ("uniform", "put"), ("zipf", "put")]
    for i, s in enumerate(stores):
        e = d["stores"][s]
        gets = [e["distributions"][dist]["get_rows_per_s"]["median"] for dist, op in ops if op == "get"]
        puts = [e["distributions"][dist]["put_rows_per_s"]["median"] for dist, op in ops if op == "put"]
        ax[0].bar([x + i * width for x in range(2)], gets, width, label=s)
        ax[1].bar([x + i * width for x in range(2)], puts, width, label=s)
    fio = d.get("fio", {}).get("rand_read_4k_qd64", {}).get("iops")
    if fio:
        ax[0].axhline(fio, color="k", linestyle="--", label="fio 4K random read IOPS")
    for a, title in zip(ax, ("batch get", "batch put (durable)")):
        a.set_xticks([x + 0.4 - width / 2 for x in range(2)], ["uniform", "Zipf 1.05"])
        a.set(ylabel="rows/s (median over batches)", title=title)
    ax[1].set_yscale("log")
    ax[0].legend(fontsize="small")
    fig.suptitle(f"W1: {d['rows'] / 1e6:.0f}M rows of {d['row_bytes']} B, {d['batches']} batches of "
                 f"{d['batch_keys'] // 1000}k keys, 1 GiB memory cgroup")
    save(fig, "w1.png")


def w3(path):
    d = load(path)
    traces = [t for t, v in d["traces"].items() if "capacities" in v]
    fig, ax = plt.subplots(1, len(traces), figsize=(6 * len(traces), 3.8), squeeze=False)
    for a, t in zip(ax[0], traces):
        caps = d["traces"][t]["capacities"]
        policies = [p for p in caps[0]["ratio_to_belady"] if p not in ("belady", "belady_bypass", "py_lru")]
        width = 0.8 / len(policies)
        for i, p in enumerate(policies):
            a.bar([x + i * width for x in range(len(caps))], [c["ratio_to_belady"][p] for c in caps], width, label=p)
        a.axhline(0.95, color="k", linestyle="--", linewidth=0.8)
        a.axhline(0.90, color="r", linestyle=":", linewidth=0.8)
        a.set_xticks([x + 0.4 - width / 2 for x in range(len(caps))],
                     [f"{c['fraction']:.0%}" for c in caps])
        a.set(ylim=(0.7, 1.0), xlabel="capacity (share of unique keys)", ylabel="hit rate / Belady's", title=t)
    ax[0][0].legend(fontsize="small", ncol=2)
    save(fig, "w3.png")


def w4(*paths):
    runs = [load(p) for p in paths]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    names = []
    for i, r in enumerate(runs):
        peers = [("hps", r["hps"]["examples_per_s"]), ("PyTorch", r["torch"]["examples_per_s"])]
        if "torchrec" in r and "examples_per_s" in r["torchrec"]:
            peers.append(("TorchRec", r["torchrec"]["examples_per_s"]))
        for j, (n, v) in enumerate(peers):
            ax.bar(i + j * 0.25, v, 0.25, color=f"C{j}", label=n if i == 0 else None)
        names.append(f"MLP {'-'.join(map(str, r['mlp']))}")
    ax.set_xticks([i + 0.25 for i in range(len(runs))], names)
    ax.set(ylabel="examples/s", title="W4 / W4s: training throughput, same model and data")
    ax.legend()
    save(fig, "w4.png")


def w6(path):
    d = load(path)
    kstep = [r for r in d["kstep"] if r["dense_sync"] == "kstep"]
    ar = [r for r in d["kstep"] if r["dense_sync"] == "allreduce"]
    fig, axes = plt.subplots(1, 3 if d["scaling"] else 2, figsize=(11 if d["scaling"] else 8, 3.6))
    ks = [r["k"] for r in kstep]
    axes[0].semilogx(ks, [r["auc"] for r in kstep], "o-", label="k-step Adam")
    if ar:
        axes[0].axhline(ar[0]["auc"], color="C1", ls="--", label="gradient all-reduce, Adam")
    axes[0].set(xlabel="k", ylabel="held-out AUC", title=f"W6: AUC, {d['ranks']} ranks")
    axes[0].legend(fontsize=8)
    axes[1].loglog(ks, [r["dense_bytes_per_rank"] / 1e6 for r in kstep], "o-", label="measured")
    b1 = kstep[0]["dense_bytes_per_rank"] / 1e6 * ks[0]
    axes[1].loglog(ks, [b1 / k for k in ks], ":", color="gray", label="1/k")
    axes[1].set(xlabel="k", ylabel="dense MB sent per rank", title="W6: dense bytes")
    axes[1].legend(fontsize=8)
    if d["scaling"]:
        n = [r["ranks"] for r in d["scaling"]]
        axes[2].plot(n, [r["examples_per_s"] for r in d["scaling"]], "o-")
        axes[2].set(xlabel="ranks", ylabel="examples/s", title=f"scaling on {d['cores']} cores", xticks=n)
        axes[2].set_ylim(bottom=0)
    save(fig, "w6.png")


def w7(path):
    """Herald's replay: pulls, pushes and bytes of each schedule as ratios of naive's,
    a panel a trace, with the issue's targets and the floors no schedule of these
    caches goes below (bench/herald_replay.py), and Herald with caches that never
    evict beside them."""
    d = load(path)
    traces = [t for t, v in d["traces"].items() if "modes" in v]
    fig, ax = plt.subplots(1, len(traces), figsize=(4.6 * len(traces), 3.8), squeeze=False, sharey=True)
    kinds = (("pull", "pulls"), ("push", "pushes"), ("overall", "bytes"))
    for a, t in zip(ax[0], traces):
        v = d["traces"][t]
        order = [m for m in ("naive", "on_demand", "location", "herald") if m in v["modes"]]
        runs = {**{m: v["modes"][m] for m in order},
                **({"herald, caches never evict": v["unbounded"]} if "unbounded" in v else {})}
        width = 0.8 / len(runs)
        for i, (name, r) in enumerate(runs.items()):
            a.bar([x + i * width for x in range(len(kinds))], [r[f"{k}_ratio"] for k, _ in kinds], width,
                  label=name.replace("_", " "), color=f"C{i}", hatch="//" if "never" in name else None)
        for x, (k, _) in enumerate(kinds):
            a.hlines(d["targets"][k], x - width / 2, x + 0.8 - width / 2, color="k", linestyle="--", linewidth=1,
                     label="target" if x == 0 else None)
        floors = [(x, v.get(f"{k}_floor_ratio")) for x, (k, _) in enumerate(kinds)]
        for x, f in [(x, f) for x, f in floors if f]:  # lines before the push and overall floors have the pull's
            a.hlines(f, x - width / 2, x + 0.8 - width / 2, color="r", linestyle=":", linewidth=1.5,
                     label="floor (any schedule)" if x == 0 else None)
        a.set_xticks([x + 0.4 - width / 2 for x in range(len(kinds))], [f"{label}" for _, label in kinds])
        a.set(ylim=(0, 1.05), title=f"{t}: {v['examples']:,} examples, {v['distinct_keys']:,} keys")
    ax[0][0].set_ylabel("ratio to naive (lower is better)")
    handles, labels = ax[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small", frameon=False)
    fig.suptitle(f"W7: Herald's replay, {d['workers']} workers, LRU caches of {d['cache_fraction']:.0%} of the "
                 f"distinct keys, {d['per_worker']} examples a worker a batch")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save(fig, "w7.png", tight=False)


def save(fig, name, tight=True):
    os.makedirs(IMG, exist_ok=True)
    if tight:
        fig.tight_layout()
    out = os.path.join(IMG, name)
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    {"w1": w1, "w3": w3, "w4": w4, "w6": w6, "w7": w7}[sys.argv[1]](*sys.argv[2:])
