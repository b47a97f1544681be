"""W13 (not one of BENCHMARKS.md's workloads): admission at f = 1, 2, 4, 8 (issue 20).

    python3 bench/admission_bench.py              # 2M synthetic examples a run, and the Criteo sample
    python3 bench/admission_bench.py --quick      # a few batches of each (the tests run this)

For each threshold f, `hps.train.train()` with ``[admission] threshold = f`` on:
  synthetic  the Zipf generator (hps.data.SyntheticCriteo), --examples training
             examples in batches of --batch, dim --dim, evaluated on its held-out stream
             (after one unreported warm-up run)
  criteo     the shared Criteo sample (/work/shared/data/criteo-sample/train_examples_10k.tsv):
             trained on its first 8,000 lines, evaluated on its last 2,000 (the two parts
             written to a temporary directory); skipped, saying so, when the file is absent
and reports the rows the parameter server created (initialised), the rows stored at the
end (the live table), the sketch's bytes, the reads of the default row and the gradients
dropped, eval AUC and logloss, and examples/s. f = 1 admits every key (no sketch).

Prints one JSON line (also written to bench/results/admission-DATE.json unless --no-save);
`python3 bench/report.py --add FILE` files it under docs/results/w13.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from _provenance import provenance, save_result  # bench/ is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRITEO = "/work/shared/data/criteo-sample/train_examples_10k.tsv"
THRESHOLDS = (1, 2, 4, 8)


def run_one(data: dict, threshold: int, a, path: str, train_examples=None) -> dict:
    from hps.train import TrainConfig, train
    cfg = TrainConfig.from_dict({
        "hidden": a.hidden, "dense_lr": 0.001, "torch_threads": a.torch_threads, "seed": 0,
        "ps": {"dim": a.dim, "path": path, "mem_budget": "1GiB", "optimizer": {"kind": "adagrad", "lr": 0.05}},
        "data": data, "admission": {"threshold": threshold, "sketch_bytes": a.sketch_bytes}}, source="admission_bench")
    t0 = time.perf_counter()
    s = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    ps, adm, f = s["ps"], s["admission"], s["final"]
    row_bytes = 2 * a.dim * 4  # AdaGrad: the embedding and its sum of squares, float32
    return {"threshold": threshold, "examples": s["examples"], "rows_created": ps["counts"]["initialized"],
            "rows_stored": ps["ssd"]["live_records"], "table_bytes": ps["ssd"]["live_records"] * row_bytes,
            "sketch_bytes": adm["sketch_bytes"], "keys_admitted": adm["keys_admitted"],
            "occurrences": adm["occurrences_counted"], "default_reads": adm["default_reads"],
            "dropped_gradients": adm["dropped_gradients"], "default_read_fraction": adm["default_read_fraction"],
            "eval_default_read_fraction": adm["eval_default_reads"] / adm["eval_reads"] if adm["eval_reads"] else 0.0,
            "auc": f.get("auc"), "logloss": f.get("logloss"), "eval_examples": f.get("eval_examples"),
            "examples_per_s": s["examples_per_s"], "wall_seconds": wall}


def criteo_parts(tmp: str, lines_train: int, lines_eval: int):
    """The sample's first lines_train lines and its last lines_eval, as two files under tmp."""
    with open(CRITEO, "rb") as f:
        lines = f.readlines()
    train_path, eval_path = os.path.join(tmp, "train.tsv"), os.path.join(tmp, "eval.tsv")
    with open(train_path, "wb") as f:
        f.writelines(lines[:lines_train])
    with open(eval_path, "wb") as f:
        f.writelines(lines[len(lines) - lines_eval:])
    return train_path, eval_path, len(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few small batches of each run (for the tests)")
    ap.add_argument("--examples", type=int, default=2_000_000, help="synthetic training examples a run")
    ap.add_argument("--eval-examples", type=int, default=100_000, help="synthetic held-out examples")
    ap.add_argument("--batch", type=int, default=4096, help="synthetic batch size")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--sketch-bytes", default="4MiB")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    a = ap.parse_args(argv)
    if a.examples < 1 or a.batch < 1 or a.dim < 1:
        print("admission_bench: --examples, --batch and --dim must be >= 1", file=sys.stderr)
        return 2
    a.hidden = [64, 32]
    criteo_batch, criteo_lines = 256, (8000, 2000)
    if a.quick:
        a.examples, a.eval_examples, a.batch, a.dim, a.hidden = 4096, 2048, 1024, 4, [8]
        criteo_lines = (800, 200)
    out = {"bench": "w13", "benchmark": "W13 admission", "quick": a.quick, "thresholds": list(THRESHOLDS),
           "config": {"dim": a.dim, "mlp": a.hidden, "sparse_optimizer": "adagrad lr 0.05", "sketch_bytes": a.sketch_bytes,
                      "torch_threads": a.torch_threads, "mem_budget": "1GiB"},
           "synthetic": {"examples": a.examples, "eval_examples": a.eval_examples, "batch_size": a.batch, "runs": []}}
    with tempfile.TemporaryDirectory(prefix="hps-admission-") as tmp:
        # A warm-up run, not reported, so that the first measured run pays no first-use costs.
        run_one({"source": "synthetic", "batch_size": a.batch, "train_examples": a.batch, "eval_examples": a.batch},
                1, a, os.path.join(tmp, "warmup"))
        for f in THRESHOLDS:
            data = {"source": "synthetic", "batch_size": a.batch, "train_examples": a.examples,
                    "eval_examples": a.eval_examples}
            r = run_one(data, f, a, os.path.join(tmp, f"syn{f}"))
            out["synthetic"]["runs"].append(r)
            print(f"admission_bench: synthetic f={f}: {r['rows_created']:,} rows, AUC {r['auc']:.4f}, "
                  f"{r['examples_per_s']:,.0f} ex/s", file=sys.stderr)
        if not os.path.exists(CRITEO):
            out["criteo"] = {"skipped": f"{CRITEO} is absent"}
            print(f"admission_bench: skipping the Criteo sample: {CRITEO} is absent", file=sys.stderr)
        else:
            train_path, eval_path, total = criteo_parts(tmp, *criteo_lines)
            out["criteo"] = {"file": CRITEO, "lines": total, "train_lines": criteo_lines[0],
                             "eval_lines": criteo_lines[1], "batch_size": criteo_batch, "runs": []}
            for f in THRESHOLDS:
                data = {"source": train_path, "eval_source": eval_path, "batch_size": criteo_batch,
                        "eval_examples": criteo_lines[1]}
                r = run_one(data, f, a, os.path.join(tmp, f"criteo{f}"))
                out["criteo"]["runs"].append(r)
                print(f"admission_bench: criteo f={f}: {r['rows_created']:,} rows, AUC {r['auc']:.4f}",
                      file=sys.stderr)
    out["provenance"] = provenance()
    line = json.dumps(out)
    print(line)
    if not a.no_save:
        path = save_result(line, "admission")
        print(f"admission_bench: wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
