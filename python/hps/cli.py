"""The `hps` command: `hps train --config FILE.toml`, `hps demo`, and for a job's
directory `hps inspect`, `hps export`, `hps serve` (docs/serving.md)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

DEMO_DEFAULTS = {
    # Synthetic Criteo-like data; a MEM-PS budget far below the rows the run
    # touches, so rows move between all three tiers; a few minutes on 2 cores.
    "train_examples": 1_500_000,
    "eval_examples": 100_000,
    "batch_size": 4096,
    "mem_budget": "24MiB",
    "dim": 16,
}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", help="where the parameter server lives (overrides [ps] path)")
    p.add_argument("--batch-size", type=_positive, help="examples a mini-batch (overrides [data] batch_size)")
    p.add_argument("--examples", type=_positive, metavar="N",
                   help="train on N examples a pass: synthetic data's count, or the first N of the files "
                        "(overrides [data] train_examples; default: all of the files, 1000000 synthetic, the demo 1500000)")
    p.add_argument("--eval-examples", type=_positive, metavar="N",
                   help="held-out examples each evaluation scores (overrides [data] eval_examples)")
    p.add_argument("--mem-budget", help="MEM-PS budget, e.g. 512MiB")
    p.add_argument("--devices", type=_positive, help="devices of the device tier (host partitions without GPUs)")
    p.add_argument("--schedule", choices=("sequential", "herald"),
                   help="herald: devices keep rows in caches between batches and take the examples whose rows "
                        "they hold (overrides [ps] schedule)")
    p.add_argument("--eval-every", type=_non_negative, help="evaluate every N batches (0: at the end)")
    p.add_argument("--checkpoint-every", type=_non_negative, help="checkpoint every N batches (0: at the end)")
    p.add_argument("--sequential", action="store_true", help="run the stages one after another, not pipelined")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")


def _int_at_least(low: int):
    """An argparse type: an int >= low (checked as the config's field is: with
    --checkpoint-every -1 a run trained no batch and ended as a success)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _apply_flags(cfg, a, source: str = "") -> None:
    """The flags over `cfg`, whose [ps] came from `source` (a TOML file; "" when none did)."""
    ps_flags = []
    if a.path:
        cfg.ps.path = a.path
    if a.batch_size is not None:
        cfg.data.batch_size = a.batch_size
    if a.examples is not None:
        cfg.data.train_examples = a.examples
    if a.eval_examples is not None:
        cfg.data.eval_examples = a.eval_examples
    if a.mem_budget:
        cfg.ps.mem_budget = a.mem_budget
        ps_flags.append(f"--mem-budget {a.mem_budget}")
    if a.devices is not None:
        cfg.ps.devices = a.devices
        ps_flags.append(f"--devices {a.devices}")
    if a.schedule:
        cfg.ps.schedule = a.schedule
        ps_flags.append(f"--schedule {a.schedule}")
    if a.eval_every is not None:
        cfg.eval_every = a.eval_every
    if a.checkpoint_every is not None:
        cfg.checkpoint_every = a.checkpoint_every
    if a.sequential:
        cfg.pipelined = False
    if ps_flags:
        # [ps] was checked with the file's values; a flag can make one the file left unused
        # count (--schedule herald reads worker_cache_rows): named with both.
        cfg.ps.check(f"{source + ': ' if source else ''}[ps] with {' '.join(ps_flags)}")


def _apply_online_flags(cfg, a) -> None:
    """--online, --online-window and --online-stop (see their help)."""
    if a.online:
        cfg.online = True
    if a.online_window is not None:
        if a.online_window < 1:
            raise ValueError(f"--online-window: must be >= 1 examples, got {a.online_window}")
        cfg.online_window, cfg.online_window_batches = a.online_window, 0
    for part in (a.online_stop.split(",") if a.online_stop else []):
        key, _, value = part.strip().partition("=")
        try:
            if key == "idle":
                cfg.data.online_idle = None if value == "none" else float(value)
            elif key == "marker" and value:
                cfg.data.online_marker = None if value == "none" else value
            elif key == "examples":
                cfg.data.online_examples = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--online-stop: {part!r} is not idle=SECONDS, marker=NAME or examples=N") from None
    if (a.online_window is not None or a.online_stop) and not cfg.online:
        raise ValueError("--online-window and --online-stop need --online (or online = true in the config)")


def _examples_per_s(summary: dict) -> str:
    """The run's rate; with evaluations in the run (eval_every), which run inside the
    train stage and so inside its wall time, the rate without their time too."""
    rate = f"{summary['examples_per_s']:,.0f}"
    evals = summary.get("eval_seconds") or 0.0
    if evals:
        rate += (f" (evaluations' {evals:,.1f} s included; {summary['examples_per_s_without_eval']:,.0f} "
                 f"without them)")
    return rate


def _summary_table(summary: dict) -> str:
    from hps.train import format_rate, mem_hit_rate
    f = summary["final"]
    p = summary["pipeline"]
    ps = summary["ps"]
    mem, ssd = ps["mem"], ps["ssd"]
    counts = ps["counts"]
    rows = [
        ("examples trained", f"{summary['examples']:,}"),
        ("examples/s", _examples_per_s(summary)),
        ("eval AUC", f"{f.get('auc', float('nan')):.4f}"),
        ("eval logloss", f"{f.get('logloss', float('nan')):.4f}"),
        ("MEM-PS hit rate", format_rate(mem_hit_rate(mem))),
        ("MEM-PS rows (capacity)", f"{mem['size']:,} ({mem['capacity']:,})"),
        ("rows from SSD-PS / initialised", f"{counts['ssd_hits']:,} / {counts['initialized']:,}"),
        ("SSD-PS read / written", f"{ssd['bytes_read'] / 1e6:,.1f} MB / {ssd['bytes_written'] / 1e6:,.1f} MB"),
        ("SSD-PS files, live rows", f"{ssd['files']:,}, {ssd['live_records']:,}"),
        ("bound by stage", p["bound_by"]),
        ("wall / slowest stage", f"{p['wall_over_slowest_stage']:.2f}" if p["wall_over_slowest_stage"] else "-"),
    ]
    cpu = p.get("cpu_seconds", {})  # the stage thread's CPU time; train's leaves out torch's threads
    stages = ", ".join(f"{k} {v:.1f}s" + (f" (CPU {cpu[k]:.1f}s)" if k in cpu else "")
                       for k, v in p["busy_seconds"].items())
    rows.append(("stage busy time", stages))
    threads = summary.get("torch_threads", {})
    tried = ", ".join(f"{n}: {r:,.0f} ex/s" for n, r in threads.get("examples_per_s", {}).items())
    rows.append(("torch threads", f"{threads.get('chosen', '-')}" + (f" (tuned; {tried})" if tried else "")))
    dev = ps["device"]
    moved = dev["transfer_rows"]  # (G, G) lists: from, to
    between = sum(n for i, row in enumerate(moved) for j, n in enumerate(row) if i != j)
    rows.append(("device tier", dev["kind"] + (f", {dev['devices']} devices, {between:,} rows between them"
                                               if dev["devices"] > 1 else "")))
    routes = dev.get("routes")
    if routes:
        by = ", ".join(f"{k} {v:,}" for k, v in routes["rows_by_route"].items() if v)
        rows.append(("routes", f"{routes['topology']} ({'executed' if routes['executed'] else 'counted'}): "
                     f"{by or 'no rows'}; {routes['relayed_rows']:,} rows relayed"))
    bound = summary.get("core_binding")
    if bound:
        from hps.topology import _cpulist
        got = "; ".join(f"{t} on {_cpulist(g['cores'])}" for t, g in sorted(bound["threads"].items())
                        if g["cores"] is not None)
        rows.append(("core binding", got or bound["reason"]))
    dense = summary.get("dense_model")
    if dense:
        rows.append(("dense model", f"{dense['replicas']} replica(s) on {', '.join(dense['devices'])}"))
    her = ps["device"].get("herald") or ps.get("herald")  # across devices, or this rank's across ranks
    if her:
        rows.append(("herald: rows from MEM-PS, peers", f"{her['ps_loads']:,} of {her['distinct']:,} batch keys, "
                     f"{her['peer_fetches']:,} from peers, {her['replica_copies']:,} replica copies, "
                     f"{her['evict_pushes']:,} evicted to MEM-PS, {her['evict_clean_dropped']:,} clean ones dropped"))
    if "examples_sent" in (her or {}):
        rows.append(("herald: examples moved", f"{her['examples_sent']:,} sent to other ranks, "
                     f"{her['examples_kept']:,} kept"))
    adm = summary.get("admission") or {}
    if adm.get("threshold", 1) > 1:
        rows.append(("admission: threshold, sketch", f"{adm['threshold']}, {adm['sketch_bytes'] / 2**20:,.1f} MiB; "
                     f"{adm['keys_admitted']:,} keys admitted, {adm['default_reads']:,} reads of the default row "
                     f"({adm['default_read_fraction']:.1%}, gradients dropped)"))
    online = summary.get("online")
    if online:
        win = online["window"]
        size = f"{win['batches']:,} batches" if "batches" in win else f"{win['examples']:,} examples"
        rows.insert(4, ("online AUC / logloss (window)", f"{online['auc']:.4f} / {online['logloss']:.4f} "
                                                         f"(latest {size}, before training on them)"))
    dist = summary.get("distributed")
    if dist:
        sync = dist["dense_sync"] + (f", k = {dist['k']}" if dist["dense_sync"] == "kstep" else "")
        rows.insert(2, ("ranks (nodes)", f"{dist['world']} ({dist['nodes']}), dense sync {sync}"))
        sent = [r["bytes_sent"] for r in dist["ranks"]]
        sparse = sum(b["sparse_keys"] + b["sparse_rows"] + b["sparse_grads"] for b in sent) / len(sent)
        dense = sum(b["dense"] for b in sent) / len(sent)
        moved = sum(b.get("examples", 0) + b.get("plan", 0) for b in sent) / len(sent)  # Herald's
        rows.insert(3, ("sent per rank: sparse / dense", f"{sparse / 1e6:,.1f} MB / {dense / 1e6:,.1f} MB"
                        + (f"; examples and plans {moved / 1e6:,.1f} MB" if moved else "")))
        rows.insert(4, ("tiers and stages below", "rank 0's"))
    for part, got in (summary.get("skipped_lines") or {}).items():  # skip_malformed's count, and the first
        first = got["malformed_examples"][:1]
        rows.append((f"malformed lines skipped ({part})",
                     f"{got['malformed']:,}" + (f"; the first: {first[0]}" if first else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _files_or_names(paths) -> list:
    """The files that ``paths`` (files, globs, directories) name, or the paths themselves
    when they name none yet (an online run's empty directory; a missing path, named later)."""
    from hps.data import list_files
    try:
        return list_files(paths)
    except (FileNotFoundError, ValueError):
        return list(paths)


def _config_without_toml(a):
    """`hps train --data PATH`: defaults for everything but the data; Criteo's layout, or with
    --label a schema of that label, --dense columns and every other column categorical;
    libsvm files (.svm, .libsvm, .libfm, .ffm, compressed or not) by their name, as open_schema
    tells them (a directory or glob by the files in it)."""
    from hps.data import Schema
    from hps.data.tabular import _kind
    from hps.parameter_server import ParameterServerConfig
    from hps.train import DataConfig, TrainConfig
    schema = None
    if a.label is not None:
        schema = {"label": a.label, "dense": [c for c in (a.dense or "").split(",") if c], "categorical": "rest"}
    elif a.dense:
        raise ValueError("--dense needs --label (without it the data is in Criteo's layout)")
    elif all(_kind(p) == "libsvm" for p in _files_or_names(a.data)):
        schema = {}
    path = a.path or "hps-run"
    print(f"hps train: parameter server in {os.path.abspath(path)}", file=sys.stderr)
    return TrainConfig(ps=ParameterServerConfig(dim=16, path=path, mem_budget="1GiB"),
                       data=DataConfig(source=a.data, schema=None if schema is None else Schema.from_dict(schema,
                                                                                                    "hps train")))


def cmd_train(a) -> int:
    from hps.train import TrainConfig, _jsonable, train
    if a.config is None and not a.data:
        raise ValueError("give --config FILE.toml, or --data PATH to train on files with the defaults")
    ht = None
    if a.config is not None:
        from hps.config import load_toml
        raw = load_toml(a.config)
        if "hierarchical" in raw:  # Hierarchical Training (hps.hierarchical): its own ranks' roles
            from hps.hierarchical.roles import HierarchicalConfig
            ht = HierarchicalConfig.from_dict(raw.pop("hierarchical"), f"{a.config}: [hierarchical]")
            cfg = TrainConfig.from_dict(raw, source=os.fspath(a.config))
        else:
            cfg = TrainConfig.from_toml(a.config)
        if a.data:
            cfg.data.source = a.data
            # from_dict refused synthetic data's fields with files only where the file named files
            from hps.train import refuse_synthetic_only
            refuse_synthetic_only(cfg.data, set(raw.get("data", {})), os.fspath(a.config), data_flag=True)
        if a.label is not None or a.dense:
            raise ValueError("--label and --dense are for --data without --config; put [data.schema] in the TOML")
    else:
        cfg = _config_without_toml(a)
    if a.eval_data:
        cfg.data.eval_source = a.eval_data
    _apply_flags(cfg, a, os.fspath(a.config) if a.config is not None else "")
    _apply_online_flags(cfg, a)
    # --report DIR is checked before training (the plots are written at its end), with
    # the job's directories: under mpiexec by every rank together, since a rank that
    # refused it alone left the others waiting for it.
    report = a.report or None
    if ht is None:
        summary = train(cfg, resume=a.resume, progress=not a.no_progress, report=report)
    else:
        from hps.hierarchical.roles import train_hierarchical
        summary = train_hierarchical(cfg, ht, resume=a.resume, progress=not a.no_progress, report=report)
        if summary.get("role") in ("group_ps", "centre"):
            return 0
    if summary.get("distributed", {}).get("rank", 0) != 0:
        return 0  # rank 0 speaks for the job
    done = summary.get("finished_before")
    if done is not None:
        print(f"hps train: the run in {done['path']} is finished: {done['examples']:,} examples in "
              f"{done['batches']:,} batches, and its data has none left. To train further, raise --examples "
              f"(or [data] train_examples / epochs) and --resume again. Its summary:", file=sys.stderr)
        if "final" not in summary:
            return 0
    print(_summary_table(summary), file=sys.stderr)
    if "short" in summary:
        print(f"hps train: {summary['short']}", file=sys.stderr)
    if ht is not None:
        h = summary["hierarchical"]
        moved = ", ".join(f"{k} {v['before'] / 1e6:,.2f} -> {v['after'] / 1e6:,.2f} MB"
                          for k, v in h["bytes"].items() if v["before"])
        averaged = (f"; {h['exchanges']} background exchange(s), {h['corrections']} correction(s) applied"
                    if h.get("exchanges") or h.get("corrections") else "")
        print(f"  hierarchical: {h['roles']}; plan {', '.join(h['plan'])}; trainer 0 sent {moved or 'nothing'}"
              f"{averaged}", file=sys.stderr)
    line = {"final": summary["final"], "examples_per_s": summary["examples_per_s"], "pipeline": summary["pipeline"],
            "device": summary["ps"]["device"]}
    for key in ("eval_seconds", "examples_per_s_without_eval"):  # (a summary of a run before they were kept: none)
        if key in summary:
            line[key] = summary[key]
    if "herald" in summary["ps"]:  # Herald across ranks: this rank's counts
        line["herald"] = summary["ps"]["herald"]
    for key in ("finished_before", "short"):
        if key in summary:
            line[key] = summary[key]
    if ht is not None:
        line["hierarchical"] = summary["hierarchical"]
    if "online" in summary:
        line["online"] = {k: v for k, v in summary["online"].items() if k != "history"}
    if a.report:
        from hps.report import write_report
        line["report"] = write_report(summary, a.report)
    # An AUC or logloss that is undefined (one class in the window or eval set) is
    # NaN in the summary: null here, since a bare NaN is not JSON.
    print(json.dumps(_jsonable(line)))
    return 0


def cmd_demo(a) -> int:
    from hps.optim import AdaGrad
    from hps.parameter_server import ParameterServerConfig
    from hps.report import write_report
    from hps.train import DataConfig, TrainConfig, _jsonable, train
    path = a.path or tempfile.mkdtemp(prefix="hps-demo-")
    if os.path.exists(path) and os.listdir(path):
        print(f"hps demo: {path} is not empty; give a new directory", file=sys.stderr)
        return 2
    d = DEMO_DEFAULTS
    cfg = TrainConfig(
        ps=ParameterServerConfig(dim=d["dim"], path=os.path.join(path, "ps"), optimizer=AdaGrad(lr=0.05),
                                 mem_budget=d["mem_budget"], write_buffer_rows=1 << 16),
        data=DataConfig(source="synthetic", batch_size=d["batch_size"], train_examples=d["train_examples"],
                        eval_examples=d["eval_examples"]),
        eval_every=40, checkpoint_every=0)
    _apply_flags(cfg, a)
    cfg.ps.path = os.path.join(path, "ps")  # --path names the demo's directory, the server lives inside
    print(f"hps demo: synthetic Criteo-like data, {cfg.data.train_examples:,} examples, MEM-PS budget "
          f"{cfg.ps.mem_budget}, parameter server in {cfg.ps.path}", file=sys.stderr)
    t0 = time.time()
    summary = train(cfg, progress=not a.no_progress)
    report_dir = a.report or os.path.join(path, "report")
    written = write_report(summary, report_dir)
    print("\nhps demo summary", file=sys.stderr)
    print(_summary_table(summary), file=sys.stderr)
    print(f"  {'report':<30}  {', '.join(written)}" if written else "  (no plots: pip install matplotlib)",
          file=sys.stderr)
    print(f"  {'wall time':<30}  {time.time() - t0:.0f} s", file=sys.stderr)
    print(f"  {'demo folder':<30}  {os.path.abspath(path)} (remove it with: rm -rf {os.path.abspath(path)})",
          file=sys.stderr)
    print(json.dumps(_jsonable({"final": summary["final"], "examples_per_s": summary["examples_per_s"],
                                "pipeline": summary["pipeline"], "report": written})))
    return 0


def cmd_inspect(a) -> int:
    from hps.jobdir import format_report, inspect
    report = inspect(a.path, verify=a.verify)
    print(json.dumps(report) if a.json else format_report(report))
    return 1 if a.verify and not report["verify"]["ok"] else 0


def cmd_export(a) -> int:
    from hps.export import export
    try:
        meta = export(a.path, a.to, a.consumer, full=a.full, int8=a.int8, with_state=a.with_state)
    except ImportError as e:  # pyarrow, an optional dependency
        print(f"hps export: {e}", file=sys.stderr)
        return 2
    print(json.dumps(meta))
    return 0


def cmd_plan(a) -> int:
    from hps.hierarchical.planner import format_plan, plan_of_config
    print(format_plan(plan_of_config(a.config)))
    return 0


def cmd_topology(a) -> int:
    from hps.topology import cli
    print(cli(a.file, a.sysfs, a.plot, a.rows))
    return 0


def cmd_size(a) -> int:
    from hps.sizing import estimate, format_table
    from hps.train import TrainConfig
    if a.rows is not None and a.rows < 1:
        raise ValueError(f"--rows: must be >= 1 (the distinct keys the run stores), got {a.rows}")
    if a.sample < 1:
        raise ValueError(f"--sample: must be >= 1 examples, got {a.sample}")
    if not os.path.exists(a.config):
        raise FileNotFoundError(f"--config: {a.config}: no such file")
    cfg = TrainConfig.from_toml(a.config)
    if a.mem_budget:
        cfg.ps.mem_budget = a.mem_budget
    e = estimate(cfg, rows=a.rows, sample=a.sample)
    print(json.dumps(e) if a.json else format_table(e))
    return 0


def cmd_serve(a) -> int:
    from hps.serve import serve
    serve(a.path, host=a.host, port=a.port, memory_budget=a.memory_budget, max_concurrent=a.max_concurrent,
          refresh_every=a.refresh_every, quiet=not a.log, max_connections=a.max_connections,
          request_timeout=a.request_timeout)
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the documented commands with it)."""
    from hps import __version__
    # allow_abbrev=False: a prefix of a flag (--check for --checkpoint-every) would work in a
    # script or a doc until a new flag made it ambiguous.
    ap = argparse.ArgumentParser(prog="hps", description="hps: a hierarchical parameter server for CTR models",
                                 allow_abbrev=False)
    ap.add_argument("--version", action="version", version=f"hps {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, allow_abbrev=False)
    t = command("train", help="train a CTR model from a TOML config")
    t.add_argument("--config", help="TOML file: training fields, [ps], [ps.optimizer], [data], [data.schema]")
    t.add_argument("--data", nargs="+", metavar="PATH",
                   help="training files, globs or directories (overrides [data] source; without --config: "
                        "train with the defaults, the parameter server in --path or ./hps-run)")
    t.add_argument("--eval-data", nargs="+", metavar="PATH", help="held-out files (overrides [data] eval_source)")
    t.add_argument("--label", help="without --config: the label column of CSV or Parquet files; every column "
                                   "but it and --dense is a categorical field")
    t.add_argument("--dense", help="without --config: dense columns, comma-separated (needs --label)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint at the path")
    t.add_argument("--online", action="store_true",
                   help="progressive validation: score each batch before training on it (windowed AUC and logloss "
                        "in the progress bar, summary and plots); a --data directory is read as files appear")
    t.add_argument("--online-window", type=int, metavar="N", help="online: metrics over the latest N examples "
                                                                   "(default 100000; the config's online_window)")
    t.add_argument("--online-stop", metavar="SPEC",
                   help="online: when a growing directory ends, comma-separated: idle=SECONDS without a new file "
                        "(default 60; 'idle=none': never), marker=NAME (a file whose presence ends it once the files "
                        "present are read; default _DONE; 'marker=none'), examples=N")
    t.add_argument("--report", metavar="DIR", help="also write the run's plots (PNG) into DIR")
    _add_common(t)
    d = command("demo", help="train on synthetic data through all three tiers and write a report")
    d.add_argument("--report", help="report directory (default: <path>/report)")
    _add_common(d)
    i = command("inspect", help="what a job directory holds; --verify checks every file's checksums")
    i.add_argument("path", help="the job's path ([ps] path)")
    i.add_argument("--verify", action="store_true", help="check every checkpoint's files (reads them all)")
    i.add_argument("--json", action="store_true", help="one JSON object instead of the summary")
    e = command("export", help="rows changed since a consumer's last export, as Parquet")
    e.add_argument("path", help="the job's path ([ps] path)")
    e.add_argument("--to", required=True, help="a new or empty directory for this export's files")
    e.add_argument("--consumer", default="default", help="whose position (each consumer keeps its own)")
    e.add_argument("--full", action="store_true", help="every row, not only the changed ones")
    e.add_argument("--int8", action="store_true", help="embeddings as int8 with a float32 scale per row")
    e.add_argument("--with-state", action="store_true", help="the optimizer state beside each embedding")
    v = command("serve", help="lookups of a job's last checkpoint over local HTTP (docs/serving.md)")
    v.add_argument("path", help="the job's path ([ps] path)")
    v.add_argument("--host", default="127.0.0.1",
                   help="address or name to listen on, a name at each of its addresses (default: this host only)")
    v.add_argument("--port", type=int, default=8470, help="0: any free port (printed)")
    v.add_argument("--memory-budget", default="256MiB",
                   help="all the lookup holds (key index, read buffers, a refresh's reserve, row cache), e.g. 1GiB")
    v.add_argument("--max-concurrent", type=int, default=8, help="lookups at once; more are answered 429")
    v.add_argument("--max-connections", type=int, default=64,
                   help="connections open at once, idle kept-alive ones included; more are answered 503 and closed")
    v.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a request has to send its line, headers and body, from its first byte "
                        "(a new connection's first: from connecting), and its client to take the answer, "
                        "from the answer's first byte; then it is closed")
    v.add_argument("--refresh-every", type=float, default=0.0,
                   help="seconds between moves to a newer checkpoint (0: only on POST /refresh)")
    v.add_argument("--log", action="store_true", help="log every request to stderr")
    pl = command("plan", help="Hierarchical Training: where each dense layer runs, and each node's "
                              "modelled CPU, network and memory")
    pl.add_argument("--config", required=True, help="TOML file: hidden, [ps] dim, [data] batch_size, [hierarchical]")
    tp = command("topology", help="this node's (or a file's) devices, links, routes and core binding")
    tp.add_argument("--file", help="a topology file (examples/topologies/); default: discover this machine")
    tp.add_argument("--sysfs", default="/sys", help="sysfs root to discover from (default /sys)")
    tp.add_argument("--plot", metavar="PNG", help="also draw the devices, links and relayed routes (matplotlib)")
    tp.add_argument("--rows", type=int, default=1_000_000, help="rows of the all-to-all whose routes are shown")
    sz = command("size", help="memory, disk and index a config will take, and its MEM-PS hit rate "
                              "(replaying a sample of its data through the cache policy)")
    sz.add_argument("--config", required=True, help="the TOML file hps train reads ([ps], [ps.optimizer], [data])")
    sz.add_argument("--rows", type=int, metavar="N", help="distinct keys the run stores (default: estimated from "
                                                          "the sample; needed when the data's length is unknown)")
    sz.add_argument("--sample", type=int, metavar="N", default=200_000,
                    help="training examples read and replayed through MEM-PS (default 200000)")
    sz.add_argument("--mem-budget", help="MEM-PS budget to size instead of the config's, e.g. 512MiB")
    sz.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    commands = {"train": cmd_train, "demo": cmd_demo, "inspect": cmd_inspect, "export": cmd_export, "serve": cmd_serve,
                "plan": cmd_plan, "topology": cmd_topology, "size": cmd_size}
    from hps.errors import HpsError
    try:
        return commands[a.command](a)
    except (ValueError, FileNotFoundError) as e:  # the config, the paths, the data
        print(f"hps {a.command}: {e}", file=sys.stderr)
        return 2
    except (HpsError, OSError) as e:  # the system: a full disk (naming the file), a failed read
        print(f"hps {a.command}: {type(e).__name__}: {e}", file=sys.stderr)
        if a.command == "train":
            print(f"hps {a.command}: the last finished checkpoint is intact; once the cause is fixed, "
                  f"run again with --resume to continue from it", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
