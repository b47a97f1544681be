"""PNG plots of a training run: AUC, throughput, MEM-PS hit rate, SSD traffic and
stage times, each captioned with the run's settings.

The rates are per interval between two evaluations (:func:`intervals`), so a
change of pace shows where it happens instead of fading into a cumulative mean.
The last interval usually covers fewer examples than the others (the data ends
between two evaluations) and is drawn hollow and labelled.
"""
from __future__ import annotations

import os
import statistics


def intervals(history: list) -> list[dict]:
    """The run between consecutive eval points of ``history`` (hps.train's
    summary["history"]): for each, ``examples`` (at its end, and ``trained`` in
    it), ``examples_per_s`` (evaluation time included), ``hit_rate`` (MEM-PS
    hits over lookups in it; None without lookups or counts), ``ssd_read_mb_s``
    and ``ssd_write_mb_s``, ``busy`` (each stage's busy seconds over the
    interval's seconds, at most 1: a stage's time is counted when its batch
    ends, so a batch that straddles two points would push the later one over 1)
    and ``partial`` (fewer examples than the median interval)."""
    out = []
    for prev, cur in zip(history, history[1:]):
        dt = cur["seconds"] - prev["seconds"]
        trained = cur["examples"] - prev["examples"]
        if dt <= 0 or trained <= 0:
            continue
        entry = {"examples": cur["examples"], "trained": trained, "seconds": dt,
                 "examples_per_s": trained / dt, "hit_rate": None,
                 "ssd_read_mb_s": (cur.get("ssd_bytes_read", 0) - prev.get("ssd_bytes_read", 0)) / dt / 1e6,
                 "ssd_write_mb_s": (cur.get("ssd_bytes_written", 0) - prev.get("ssd_bytes_written", 0)) / dt / 1e6,
                 "busy": {}, "partial": False}
        if "mem_hits" in cur and "mem_hits" in prev:
            hits = cur["mem_hits"] - prev["mem_hits"]
            lookups = hits + cur["mem_misses"] - prev["mem_misses"]
            entry["hit_rate"] = hits / lookups if lookups else None
        if "stages" in cur and "stages" in prev:
            entry["busy"] = {name: min(1.0, max(0.0, (cur["stages"][name] - prev["stages"].get(name, 0.0)) / dt))
                             for name in cur["stages"]}
        out.append(entry)
    if len(out) > 1:
        typical = statistics.median(e["trained"] for e in out[:-1])
        out[-1]["partial"] = out[-1]["trained"] < 0.9 * typical
    return out


def caption(settings: dict) -> str:
    """One line of the run's settings (hps.train.settings) for a figure's foot."""
    if not settings:
        return ""
    s = settings
    parts = [f"data {s['data']}", f"batch {s['batch_size']:,}",
             f"examples {s['examples']:,}" if isinstance(s["examples"], int) else "examples: all",
             f"dim {s['dim']}", f"MEM-PS {s['mem_budget']} ({s['cache_policy']})",
             f"{s['devices']} device{'s' if s['devices'] != 1 else ''}", f"sparse {s['sparse_optimizer']}",
             f"MLP {'-'.join(map(str, s['hidden']))}", "pipelined" if s["pipelined"] else "sequential"]
    if s.get("epochs", 1) != 1:
        parts.insert(3, f"{s['epochs']} epochs")
    return ", ".join(parts)


def write_report(summary: dict, directory: str) -> list[str]:
    """Writes the plots of `summary` (hps.train.train's) into `directory`;
    returns the files written, or [] when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(directory, exist_ok=True)
    history = [h for h in summary["history"] if "auc" in h]
    foot = caption(summary.get("settings", {}))
    written = []

    def save(fig, name):
        path = os.path.join(directory, name)
        if foot:
            fig.text(0.01, 0.01, foot, fontsize="x-small", color="0.35", wrap=True)
            fig.tight_layout(rect=(0, 0.06, 1, 1))
        else:
            fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    if history:
        x = [h["examples"] / 1e6 for h in history]
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
        ax[0].plot(x, [h["auc"] for h in history], marker="o")
        ax[0].set(xlabel="examples trained (M)", ylabel="eval AUC", title="AUC")
        ax[1].plot(x, [h["logloss"] for h in history], marker="o", color="C1")
        ax[1].set(xlabel="examples trained (M)", ylabel="eval logloss", title="logloss")
        save(fig, "auc.png")

    points = summary["history"]
    started = _started_at(summary)
    if started is not None and points:
        # The run's start (its counters start at 0 in each process): the first interval.
        start = {"examples": started, "seconds": 0.0,
                 "mem_hits": 0, "mem_misses": 0, "ssd_bytes_read": 0, "ssd_bytes_written": 0,
                 "stages": {name: 0.0 for name in summary["pipeline"]["busy_seconds"]}}
        # A resumed run's history begins with the points of the runs before it (their
        # own clocks and counters): this process's start goes before its first point,
        # and the interval into it, its seconds 0, is skipped.
        here = next((i for i, p in enumerate(points) if p["examples"] > start["examples"]), len(points))
        points = points[:here] + [start] + points[here:]
    spans = intervals(points)
    if spans:
        _plot_intervals(plt, spans, save)

    online = summary.get("online")
    if online and online["history"]:
        _plot_online(plt, online, save)

    busy = summary["pipeline"]["busy_seconds"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(busy)
    ax[0].barh(names, [busy[n] for n in names], color="C4")
    ax[0].axvline(summary["pipeline"]["wall_seconds"], color="k", linestyle="--", label="wall time")
    ax[0].set(xlabel="seconds (all of the stage's threads)",
              title=f"stage busy time (bound by {summary['pipeline']['bound_by']})")
    ax[0].legend(loc="lower right")
    # Busy fraction per stage between evaluations: which stage bounds when.
    drawn = False
    for i, name in enumerate(names):
        pts = [(e["examples"] / 1e6, e["busy"][name]) for e in spans if name in e["busy"]]
        if pts:
            ax[1].plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name, color=f"C{i}")
            drawn = True
    ax[1].set(xlabel="examples trained (M)", ylabel="busy fraction of the interval", ylim=(0, 1.05),
              title="stage busy fraction between evaluations")
    if drawn:
        ax[1].legend(fontsize="small")
    save(fig, "stages.png")
    return written


def _started_at(summary: dict):
    """The examples trained when this process started (hps.train's ``started_at``).
    A summary written before it was recorded: a one-process run's examples less those
    its pipeline trained; a job's is unknown (its ranks' pipelines count their own
    examples, its points the job's), so None."""
    if "started_at" in summary:
        return summary["started_at"]["examples"]
    if "distributed" in summary:
        return None
    return summary["examples"] - summary["pipeline"]["examples"]


def _mark_partial(ax, spans, ys, color) -> None:
    """Draws the last interval hollow and says why, when it is a partial one."""
    if spans[-1]["partial"] and ys[-1] is not None:
        ax.plot([spans[-1]["examples"] / 1e6], [ys[-1]], marker="o", markersize=9, markerfacecolor="white",
                color=color, linestyle="none", label=f"last interval: {spans[-1]['trained']:,} examples")
        ax.legend(fontsize="small", loc="lower left")


def _plot_intervals(plt, spans: list, save) -> None:
    x = [e["examples"] / 1e6 for e in spans]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    rate = [e["examples_per_s"] for e in spans]
    ax.plot(x, rate, marker="o", color="C3")
    ax.set(xlabel="examples trained (M)", ylabel="examples/s (evaluation included)",
           title="throughput between evaluations", ylim=(0, max(rate) * 1.1))
    _mark_partial(ax, spans, rate, "C3")
    save(fig, "throughput.png")

    hit = [e["hit_rate"] for e in spans]
    if any(h is not None for h in hit):
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        pts = [(xi, h) for xi, h in zip(x, hit) if h is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color="C2")
        ax.set(xlabel="examples trained (M)", ylabel="MEM-PS hits / lookups in the interval",
               title="MEM-PS hit rate between evaluations", ylim=(0, 1))
        _mark_partial(ax, spans, hit, "C2")
        save(fig, "hit_rate.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(x, [e["ssd_read_mb_s"] for e in spans], marker="o", color="C0", label="read")
    ax.plot(x, [e["ssd_write_mb_s"] for e in spans], marker="s", color="C1", label="written")
    top = max(max(e["ssd_read_mb_s"], e["ssd_write_mb_s"]) for e in spans)
    ax.set(xlabel="examples trained (M)", ylabel="MB/s", title="SSD-PS traffic between evaluations",
           ylim=(0, top * 1.1 if top > 0 else 1))
    ax.legend(fontsize="small")
    save(fig, "ssd_traffic.png")


def _plot_online(plt, online: dict, save) -> None:
    """Progressive validation: windowed AUC and logloss of each batch scored before its step."""
    h = online["history"]
    x = [e["examples"] / 1e6 for e in h]
    win = online["window"]
    size = f"{win['batches']:,} batches" if "batches" in win else f"{win['examples']:,} examples"
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].plot(x, [e["auc"] for e in h], color="C0")
    ax[0].set(xlabel="examples trained (M)", ylabel="AUC", title=f"progressive AUC (latest {size})")
    ax[1].plot(x, [e["logloss"] for e in h], color="C1")
    ax[1].set(xlabel="examples trained (M)", ylabel="logloss", title=f"progressive logloss (latest {size})")
    fig.suptitle("each batch scored by the model before training on it", fontsize="small")
    save(fig, "online.png")
