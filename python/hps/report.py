"""PNG plots of a training run: AUC, throughput, MEM-PS hit rate and stage times."""
from __future__ import annotations

import os


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
    written = []

    def save(fig, name):
        path = os.path.join(directory, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    if history:
        x = [h["examples"] / 1e6 for h in history]
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        ax[0].plot(x, [h["auc"] for h in history], marker="o")
        ax[0].set(xlabel="examples (M)", ylabel="eval AUC", title="AUC")
        ax[1].plot(x, [h["logloss"] for h in history], marker="o", color="C1")
        ax[1].set(xlabel="examples (M)", ylabel="eval logloss", title="logloss")
        save(fig, "auc.png")

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(x, [h["mem_hit_rate"] for h in history], marker="o", color="C2")
        ax.set(xlabel="examples (M)", ylabel="MEM-PS hit rate (cumulative)", title="cache hit rate", ylim=(0, 1))
        save(fig, "hit_rate.png")

        rates = []
        for prev, cur in zip(history, history[1:]):
            dt = cur["seconds"] - prev["seconds"]
            if dt > 0:
                rates.append(((cur["examples"]) / 1e6, (cur["examples"] - prev["examples"]) / dt))
        if rates:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            ax.plot([r[0] for r in rates], [r[1] for r in rates], marker="o", color="C3")
            ax.set(xlabel="examples (M)", ylabel="examples/s (incl. eval)", title="throughput")
            save(fig, "throughput.png")

    online = summary.get("online")
    if online and online["history"]:
        _plot_online(plt, online, save)

    busy = summary["pipeline"]["busy_seconds"]
    staged = [h for h in summary["history"] if "stages" in h]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
    names = list(busy)
    ax[0].barh(names, [busy[n] for n in names], color="C4")
    ax[0].axvline(summary["pipeline"]["wall_seconds"], color="k", linestyle="--", label="wall time")
    ax[0].set(xlabel="seconds", title=f"stage busy time (bound by {summary['pipeline']['bound_by']})")
    ax[0].legend()
    # Busy seconds per stage between evaluations: which stage bounds when.
    for name in names:
        xs, ys = [], []
        for prev, cur in zip(staged, staged[1:]):
            dt = cur["seconds"] - prev["seconds"]
            if dt > 0:
                xs.append(cur["examples"] / 1e6)
                ys.append((cur["stages"][name] - prev["stages"][name]) / dt)
        if xs:
            ax[1].plot(xs, ys, marker=".", label=name)
    ax[1].set(xlabel="examples (M)", ylabel="busy fraction of wall time", title="stage times over the run")
    if staged[1:]:
        ax[1].legend(fontsize="small")
    save(fig, "stages.png")
    return written


def _plot_online(plt, online: dict, save) -> None:
    """Progressive validation: windowed AUC and logloss of each batch scored before its step."""
    h = online["history"]
    x = [e["examples"] / 1e6 for e in h]
    win = online["window"]
    size = f"{win['batches']:,} batches" if "batches" in win else f"{win['examples']:,} examples"
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(x, [e["auc"] for e in h], color="C0")
    ax[0].set(xlabel="examples trained (M)", ylabel="AUC", title=f"progressive AUC (latest {size})")
    ax[1].plot(x, [e["logloss"] for e in h], color="C1")
    ax[1].set(xlabel="examples trained (M)", ylabel="logloss", title=f"progressive logloss (latest {size})")
    fig.suptitle("each batch scored by the model before training on it", fontsize="small")
    save(fig, "online.png")
