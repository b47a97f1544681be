#!/usr/bin/env python3
"""The input gradient of a CTR model's first layer, two ways with the same torch: every
input column (what nn.Linear's autograd computes) against the embedding columns only
(what hps.torch's CtrModel computes on the CPU, hps.torch._FirstLayer: the dense
features' gradient is read by nothing). At k <= 16 units, where CtrModel runs hps's
own kernels (hps/narrow_linear.h), those too: the embedding columns' gradient and the
forward product (x (4096, 429) times the weight, plus the bias) and the weight's and
bias's gradients by hps against torch's mm, addmm, and mm with sum. Above 16 units, the
weight's gradient grad.T times x over x's 429 columns (nn.Linear's) against over its
rows padded to 432 floats, a multiple of 64 bytes, with the weight's columns copied out
after (hps.torch._FirstLayer's).

    python3 bench/first_layer_bench.py            # k = 16 .. 512 units, 1 and 2 threads
    python3 bench/first_layer_bench.py --quick    # fewer repeats and shapes (the test's)

The shapes are W4's and W4s's: a batch of 4096 examples, 26 fields of dim 16 (416
embedding columns) and 13 dense features (429 columns), so grad (4096, k) times the
weight (k, 429), or its first 416 columns. Each product starts from cold caches (a 64 MiB
pass before it), as in a training step, and writes a fresh output, as autograd does;
glibc keeps freed memory as `hps train` has it (hps.tuning.keep_freed_memory). The two
alternate product by product, so that the machine's drift hits both alike; medians with
min-max in milliseconds, and the ratio of the medians. One JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from hps import _core

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _provenance import provenance  # noqa: E402


# hps.torch runs the narrow kernels on one thread whatever torch's threads (_NARROW_THREADS).
from hps.torch import _NARROW_THREADS as NARROW_THREADS  # noqa: E402
# A wider first layer's input rows and weight's gradient (hps.torch._FirstLayer).
from hps.torch import _ROW_FLOATS as ROW_FLOATS, _weight_grad as weight_grad_over_rows  # noqa: E402


def narrow_input_grad(grad, weight, width: int, threads: int):
    """hps's kernel for the embedding columns' gradient, into a fresh output (as hps.torch._FirstLayer)."""
    out = np.empty((grad.shape[0], width), dtype=np.float32)
    _core.narrow_linear_input_grad(grad.numpy(), weight.numpy(), width, out, threads=threads)
    return torch.from_numpy(out)


def narrow_forward(x, weight, bias, threads: int):
    """hps's forward kernel, into a fresh output (as hps.torch._FirstLayer)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _core.narrow_linear_forward(x.numpy(), weight.numpy(), bias.numpy(), out.numpy(), threads=threads)
    return out


def narrow_weight_grad(grad, x, threads: int):
    """hps's kernel for the weight's and the bias's gradients, into fresh outputs (as
    hps.torch._FirstLayer); the weight's is returned."""
    grad_weight = torch.empty(grad.shape[1], x.shape[1], dtype=torch.float32)
    grad_bias = torch.empty(grad.shape[1], dtype=torch.float32)
    _core.narrow_linear_weight_grad(grad.numpy(), x.numpy(), grad_weight.numpy(), grad_bias.numpy(), threads=threads)
    return grad_weight


def torch_weight_grad(grad, x):
    """The weight's and the bias's gradients as nn.Linear's autograd computes them; the weight's is returned."""
    grad.sum(0)
    return grad.t().mm(x)


def padded_weight_grad(grad, x):
    """The weight's and the bias's gradients as hps.torch._FirstLayer computes them at
    more than 16 units: x's rows padded to a multiple of 64 bytes (hps.torch._model_input),
    the product over the whole rows (hps.torch._weight_grad); the weight's is returned."""
    grad.sum(0)
    return weight_grad_over_rows(grad, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repeats, k = 16 and 64, one thread")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--examples", type=int, default=4096)
    args = ap.parse_args()
    import hps.tuning

    hps.tuning.keep_freed_memory()
    repeats = 3 if args.quick else args.repeats
    units = (16, 64) if args.quick else (16, 64, 256, 512)
    threads = (1,) if args.quick else (1, 2)
    fields, dim, n_dense = 26, 16, 13
    width, columns = fields * dim, fields * dim + n_dense
    sweep = torch.empty(64 << 20, dtype=torch.uint8)
    rng = np.random.default_rng(0)
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for k in units:
            grad = torch.from_numpy(rng.standard_normal((args.examples, k)).astype(np.float32))
            weight = torch.from_numpy(rng.standard_normal((k, columns)).astype(np.float32))
            sides = {"every_column": lambda: torch.mm(grad, weight),
                     "embedding_columns": lambda: torch.mm(grad, weight[:, :width])}
            want = {name: (grad.double() @ weight.double())[:, :width] for name in sides}
            if k <= _core.NARROW_LINEAR_MAX_OUTPUTS:
                x = torch.from_numpy(rng.standard_normal((args.examples, columns)).astype(np.float32))
                bias = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
                sides["hps_embedding_columns"] = lambda: narrow_input_grad(grad, weight, width, NARROW_THREADS)
                sides["torch_forward"] = lambda: torch.addmm(bias, x, weight.t())
                sides["hps_forward"] = lambda: narrow_forward(x, weight, bias, NARROW_THREADS)
                sides["torch_weight_grad"] = lambda: torch_weight_grad(grad, x)
                sides["hps_weight_grad"] = lambda: narrow_weight_grad(grad, x, NARROW_THREADS)
                want["torch_weight_grad"] = want["hps_weight_grad"] = grad.double().t() @ x.double()
                want["hps_embedding_columns"] = want["embedding_columns"]
                want["torch_forward"] = want["hps_forward"] = x.double() @ weight.double().t() + bias.double()
            else:  # torch's products: the weight's gradient over x's 429 columns, or as hps.torch pads them
                x = torch.from_numpy(rng.standard_normal((args.examples, columns)).astype(np.float32))
                padded = torch.zeros(args.examples, -(-columns // ROW_FLOATS) * ROW_FLOATS)[:, :columns]
                padded.copy_(x)
                sides["torch_weight_grad"] = lambda: torch_weight_grad(grad, x)
                sides["padded_weight_grad"] = lambda: padded_weight_grad(grad, padded)
                want["torch_weight_grad"] = want["padded_weight_grad"] = grad.double().t() @ x.double()
            times = {name: [] for name in sides}
            for _ in range(repeats):
                for name, product in sides.items():
                    sweep.add_(1)
                    start = time.perf_counter()
                    out = product()
                    times[name].append(1e3 * (time.perf_counter() - start))
                    got = out[:, :width] if want[name].shape[1] == width else out
                    if not torch.allclose(got.double(), want[name], rtol=1e-4, atol=1e-4 * max(k, columns)):
                        raise SystemExit(f"{name} at k = {k}: the product differs from float64's")
            row = {"threads": t, "k": k}
            for name, v in times.items():
                row[name] = {"median_ms": round(float(np.median(v)), 3), "min_ms": round(min(v), 3),
                             "max_ms": round(max(v), 3)}
            row["ratio"] = round(row["every_column"]["median_ms"] / row["embedding_columns"]["median_ms"], 2)
            if "padded_weight_grad" in row:  # over 429 columns / over padded rows
                row["padded_weight_grad_ratio"] = round(
                    row["torch_weight_grad"]["median_ms"] / row["padded_weight_grad"]["median_ms"], 2)
            if "hps_forward" in row:  # torch's time over hps's
                row["hps_input_grad_ratio"] = round(
                    row["embedding_columns"]["median_ms"] / row["hps_embedding_columns"]["median_ms"], 2)
                row["hps_forward_ratio"] = round(row["torch_forward"]["median_ms"] / row["hps_forward"]["median_ms"], 2)
                row["hps_weight_grad_ratio"] = round(
                    row["torch_weight_grad"]["median_ms"] / row["hps_weight_grad"]["median_ms"], 2)
            rows.append(row)
            e, c = row["every_column"], row["embedding_columns"]
            print(f"threads {t} k {k:4d}: every column {e['median_ms']:7.3f} ms ({e['min_ms']:.3f}-{e['max_ms']:.3f}), "
                  f"embedding columns {c['median_ms']:7.3f} ms ({c['min_ms']:.3f}-{c['max_ms']:.3f}): "
                  f"{row['ratio']:.2f}x", file=sys.stderr)
            if "padded_weight_grad" in row:
                print(f"    weight's gradient over {columns} columns {row['torch_weight_grad']['median_ms']:7.3f} ms, "
                      f"over padded rows {row['padded_weight_grad']['median_ms']:7.3f} ms "
                      f"({row['padded_weight_grad_ratio']:.2f}x)", file=sys.stderr)
            if "hps_forward" in row:
                h, f, hf = row["hps_embedding_columns"], row["torch_forward"], row["hps_forward"]
                print(f"    hps embedding columns {h['median_ms']:7.3f} ms ({row['hps_input_grad_ratio']:.2f}x torch's); "
                      f"forward torch {f['median_ms']:7.3f} ms, hps {hf['median_ms']:7.3f} ms "
                      f"({row['hps_forward_ratio']:.2f}x); weight's gradient torch "
                      f"{row['torch_weight_grad']['median_ms']:7.3f} ms, hps {row['hps_weight_grad']['median_ms']:7.3f} "
                      f"ms ({row['hps_weight_grad_ratio']:.2f}x)", file=sys.stderr)
    print(json.dumps({"benchmark": "first layer's input gradient", "examples": args.examples,
                      "embedding_columns": width, "columns": columns, "repeats": repeats,
                      "torch": torch.__version__, "torch_blas": "mkl" if torch.backends.mkl.is_available() else "other",
                      "hps_kernel": _core.narrow_linear_kernel(),
                      "rows": rows, "provenance": provenance()}))


if __name__ == "__main__":
    main()
