#!/usr/bin/env python3
"""Do the readers keep up with training? Each of hps.data's file readers against the
training step on the same data (issue 19: the read stage busy under a third of the
train stage on 2 cores).

    python3 bench/reader_bench.py            # 300,000 examples a format, 3 rounds
    python3 bench/reader_bench.py --quick    # 20,000 examples, 1 round (the test's)

The files are the shared Criteo sample (../shared/data/criteo-sample) repeated
--copies times, written once in each format a user may bring: Criteo TSV (the
reader without a schema), CSV with a header read by a [data.schema], libsvm text
(one field per Criteo column, indices by field), Parquet by the same schema; and
"TSV, dirty": the TSV with one malformed line every 2,000, read with
skip_malformed, so that every block falls back to the per-line parser that names
errors: the compiled one (hps.data._criteo_lines, Cython) and, as "TSV, dirty,
Python", the pure-Python reference it replaced (criteo._parse_line). Each round reads every format once (interleaved), batches of 4,096; the
figure is examples/s of reading alone, median (min-max) over rounds, on one thread
(pyarrow's parsers use threads of their own); beside it the CPU seconds of the whole
process while it reads (median).

The training side: one `hps.train` of the W4 model (dim 16 by AdaGrad, MLP 512-256,
batches of 4,096, torch on the cores the pipeline leaves) on the TSV, pipelined; its
read and train stages' busy (wall) seconds give the ratio the issue bounds, and its
examples/s the rate a reader must beat. Beside it, the read stage's CPU seconds (the
read thread's time.thread_time, without its waits for a core and for the GIL that
the wall time includes) over the train stage's busy seconds: what the reader's work
costs against the stage that bounds the run. The read thread's CPU time leaves out
pyarrow's parser threads (the TSV's blocks are parsed by pyarrow.csv with threads), so
the TSV's read alone, CPU of every thread, over the train stage's busy time is reported
too: the reader's whole cost.

Prints a table and one JSON line (also written to bench/results/reader-*.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from _provenance import provenance, save_result  # bench/ is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "..", "shared", "data", "criteo-sample", "train_examples_10k.tsv")
DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
SCHEMA = {"label": "label", "dense": DENSE, "categorical": CATEGORICAL}


def write_files(directory: str, copies: int) -> dict:
    """The sample repeated `copies` times in each format; returns {name: (path, reader kwargs)}."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq
    with open(SAMPLE, "rb") as f:
        lines = [ln for ln in f.read().split(b"\n") if ln]
    rows = lines * copies
    tsv = os.path.join(directory, "train.tsv")
    with open(tsv, "wb") as f:
        f.write(b"\n".join(rows) + b"\n")
    dirty = os.path.join(directory, "dirty.tsv")
    with open(dirty, "wb") as f:
        for i, ln in enumerate(rows):
            f.write(ln + b"\n")
            if i % 2000 == 1999:
                f.write(b"not\ta\tcriteo\tline\n")
    cols = [ln.split(b"\t") for ln in lines]
    names = ["label"] + DENSE + CATEGORICAL
    table = pa.table({name: pa.array([c[j].decode() for c in cols] * copies) for j, name in enumerate(names)})
    table = table.set_column(0, "label", table.column("label").cast(pa.int8()))
    csv = os.path.join(directory, "train.csv")
    pacsv.write_csv(table, csv)
    parquet = os.path.join(directory, "train.parquet")
    pq.write_table(table, parquet, row_group_size=65536)
    svm = os.path.join(directory, "train.svm")
    with open(svm, "wb") as f:
        # Field j's value v as index j * 2^32 + hash(v) % 2^32: one index range a field.
        for c in cols * copies:
            feats = [f"{j << 32 | (int(v, 16) if v else 0)}:1" for j, v in enumerate(c[14:]) if v]
            feats += [f"{(26 + j) << 32}:{v.decode()}" for j, v in enumerate(c[1:14]) if v]
            f.write(c[0] + b" " + " ".join(feats).encode() + b"\n")
    svm_schema = {"fields": {f"f{j}": [j << 32, (j << 32) + (1 << 32) - 1] for j in range(39)}}
    return {"criteo_tsv": (tsv, {}), "csv_schema": (csv, {"schema": SCHEMA}),
            "parquet_schema": (parquet, {"schema": SCHEMA}), "libsvm": (svm, {"schema": svm_schema}),
            "tsv_dirty": (dirty, {"skip_malformed": True}),
            "tsv_dirty_python": (dirty, {"skip_malformed": True, "python_lines": True})}


def open_reader(path: str, kw: dict, batch: int):
    import hps.data as hdata
    kw = dict(kw)
    schema = kw.pop("schema", None)
    if schema is None:
        return hdata.open_criteo([path], batch, **kw)
    return hdata.open_schema([path], schema, batch, **kw)


def read_rate(path: str, kw: dict, batch: int) -> tuple[float, int, float]:
    """(examples/s, examples, CPU seconds of the whole process: pyarrow's threads too)."""
    from hps.data import criteo
    kw = dict(kw)
    compiled = criteo._criteo_lines
    if kw.pop("python_lines", False):
        criteo._criteo_lines = None  # the reader's fallback: _parse_line for every line
    try:
        t, c = time.perf_counter(), time.process_time()
        n = sum(len(b) for b in open_reader(path, kw, batch))
        return n / (time.perf_counter() - t), n, time.process_time() - c
    finally:
        criteo._criteo_lines = compiled


def train_rate(path: str, directory: str, batch: int) -> dict:
    from hps.parameter_server import ParameterServerConfig
    from hps.optim import AdaGrad
    from hps.train import DataConfig, TrainConfig, train
    cfg = TrainConfig(ps=ParameterServerConfig(dim=16, path=os.path.join(directory, "ps"), optimizer=AdaGrad(lr=0.05),
                                               mem_budget="512MiB"),
                      data=DataConfig(source=[path], batch_size=batch), hidden=(512, 256))
    s = train(cfg, progress=False)
    busy = s["pipeline"]["busy_seconds"]
    cpu = s["pipeline"]["cpu_seconds"]
    p = s["pipeline"]
    return {"examples_per_s": s["examples_per_s"], "read_busy_s": busy["read"], "train_busy_s": busy["train"],
            "read_over_train": busy["read"] / busy["train"] if busy["train"] else None,
            "read_cpu_s": cpu["read"], "train_cpu_s": cpu["train"],
            "read_cpu_over_train_busy": cpu["read"] / busy["train"] if busy["train"] else None,
            "bound_by": p["bound_by"], "wall_over_slowest_stage": p["wall_over_slowest_stage"],
            "mean_queue_depth": p["mean_queue_depth"], "examples": s["examples"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=30, help="times the 10,000-line sample is repeated (default 30)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of reading every format (default 3)")
    ap.add_argument("--batch", type=int, default=4096, help="examples a batch (default 4096)")
    ap.add_argument("--quick", action="store_true", help="2 copies, 1 round: seconds (the test's)")
    ap.add_argument("--no-save", action="store_true", help="print only; write nothing to bench/results")
    a = ap.parse_args(argv)
    if a.quick:
        a.copies, a.rounds = 2, 1
    if not os.path.exists(SAMPLE):
        print(f"reader_bench: {SAMPLE} is absent (the shared Criteo sample)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hps-reader-bench-") as tmp:
        files = write_files(tmp, a.copies)
        rates = {name: [] for name in files}
        cpus = {name: [] for name in files}
        counts = {}
        for _ in range(a.rounds):
            for name, (path, kw) in files.items():
                rate, n, cpu = read_rate(path, kw, a.batch)
                rates[name].append(rate)
                cpus[name].append(cpu)
                counts[name] = n
        trained = train_rate(files["criteo_tsv"][0], tmp, a.batch)
    read_cpu = {k: statistics.median(v) for k, v in cpus.items()}
    trained["read_alone_cpu_over_train_busy"] = (read_cpu["criteo_tsv"] / trained["train_busy_s"]
                                                 if trained["train_busy_s"] else None)
    out = {"benchmark": "reader", "copies": a.copies, "rounds": a.rounds, "batch": a.batch, "quick": a.quick,
           "read_examples_per_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                   for k, v in rates.items()},
           "read_cpu_s": read_cpu, "examples": counts, "train": trained, "provenance": provenance()}
    t = trained["examples_per_s"]
    print(f"{'format':<16} {'read examples/s':>30} {'/ training':>11}")
    for k, v in out["read_examples_per_s"].items():
        print(f"{k:<16} {v['median']:>14,.0f} ({v['min']:,.0f}-{v['max']:,.0f}) {v['median'] / t:>10.1f}x")
    ratio = trained["read_over_train"]
    print(f"training (TSV, pipelined): {t:,.0f} examples/s; read stage busy {trained['read_busy_s']:.2f} s "
          f"(CPU {trained['read_cpu_s']:.2f} s), train stage {trained['train_busy_s']:.2f} s: read / train = "
          f"{ratio:.3f} busy, {trained['read_cpu_over_train_busy']:.3f} read CPU / train busy; "
          f"bound by {trained['bound_by']}, "
          f"wall / slowest stage {trained['wall_over_slowest_stage']:.2f}, batches waiting after read "
          f"{trained['mean_queue_depth']['read']:.2f} on average; the TSV read alone costs "
          f"{read_cpu['criteo_tsv']:.2f} s of CPU (every thread): "
          f"{trained['read_alone_cpu_over_train_busy']:.3f} of the train stage's busy time")
    print(json.dumps(out))
    if not a.no_save:
        save_result(json.dumps(out), "reader")
    return 0


if __name__ == "__main__":
    sys.exit(main())
