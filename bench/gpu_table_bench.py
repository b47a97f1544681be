#!/usr/bin/env python3
"""The device-tier hash table on a GPU against the same table on the CPU launcher.

    python3 bench/gpu_table_bench.py                 # 10M keys, rows of 16 and 64 floats, 3 repeats
    python3 bench/gpu_table_bench.py --quick         # 200k keys, 1 repeat (runs on the CPU alone too)

Each operation is one bulk call from host arrays, as the parameter server makes it:
`insert` of n fresh keys, `find` of n present keys (find_hit), `find` of n keys of which
half are absent (find_mix), `accumulate` of n present keys. Mops/s counts keys per
second over the whole call, so on the GPU it includes the host-to-device and back copies
of the keys and rows; the JSON gives, beside each GPU figure:
- `host_link_gb_s`: the bytes the call moves between host and GPU (keys in, rows in or
  out, masks out) over its time;
- `device_gb_s` and `of_memory_bandwidth`: the bytes the kernel must touch in GPU memory
  (the key and row of each probed slot once, the row written, the output written) over the
  call's time, and that as a fraction of the GPU's memory bandwidth limit (from the
  device's memory clock and bus width, through CuPy when it is there). Since the call's
  time includes the copies, this fraction is a floor on the kernel's own.
Repeats alternate the devices; figures are medians with min-max. Prints one JSON line
(with provenance) and keeps it in bench/results/gpu_table-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _provenance  # noqa: E402

import hps  # noqa: E402

OPS = ("insert", "find_hit", "find_mix", "accumulate")


def memory_bandwidth_gb_s(ordinal: int):
    """The GPU's memory bandwidth limit in GB/s (2 transfers a clock), or None without CuPy."""
    try:
        import cupy  # noqa: PLC0415 (optional, on GPU machines only)
    except ImportError:
        return None
    props = cupy.cuda.runtime.getDeviceProperties(ordinal)
    clock_khz, bus_bits = props.get("memoryClockRate"), props.get("memoryBusWidth")
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def bytes_moved(op: str, n: int, row_floats: int) -> tuple[int, int]:
    """(host link bytes, device memory bytes) of one call over n keys."""
    row = 4 * row_floats
    if op == "insert":        # keys + rows in, mask out; slot key and row written
        return n * (8 + row + 1), n * (8 + row)
    if op == "find_hit":      # keys in, rows + mask out; slot key and row read, output row written
        return n * (8 + row + 1), n * (8 + 2 * row)
    if op == "find_mix":      # half the keys miss: no row read, output row zeroed
        return n * (8 + row + 1), n * (8 + row + row // 2)
    if op == "accumulate":    # keys + deltas in; slot key read, row read and written, delta read
        return n * (8 + row), n * (8 + 3 * row)
    raise ValueError(op)


def run_once(device: str, n: int, row_floats: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    keys = rng.choice(np.iinfo(np.int64).max, size=2 * n, replace=False).astype(np.uint64)
    present, absent = keys[:n], keys[n:]
    rows = rng.standard_normal((n, row_floats), dtype=np.float32)
    table = hps.HashTable(int(n / 0.7) + 8, row_floats, device=device)
    mixed = np.concatenate([present[: n // 2], absent[: n - n // 2]])
    rng.shuffle(mixed)
    probe = present.copy()
    rng.shuffle(probe)
    seconds = {}
    t = time.perf_counter()
    inserted = table.insert(present, rows)
    seconds["insert"] = time.perf_counter() - t
    if not inserted.all():
        raise RuntimeError(f"{device}: {int((~inserted).sum())} of {n} distinct keys not inserted")
    t = time.perf_counter()
    got, found = table.find(probe)
    seconds["find_hit"] = time.perf_counter() - t
    if not found.all():
        raise RuntimeError(f"{device}: find missed {int((~found).sum())} present keys")
    t = time.perf_counter()
    _, found_mix = table.find(mixed)
    seconds["find_mix"] = time.perf_counter() - t
    if int(found_mix.sum()) != n // 2:
        raise RuntimeError(f"{device}: find_mix found {int(found_mix.sum())}, expected {n // 2}")
    t = time.perf_counter()
    table.accumulate(probe, got)
    seconds["accumulate"] = time.perf_counter() - t
    doubled, _ = table.find(probe[:1000])
    if not np.allclose(doubled, 2 * got[:1000]):
        raise RuntimeError(f"{device}: accumulate did not add the deltas")
    return seconds


def summarise(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="defaults of 200k keys, rows of 16 floats, 1 repeat")
    ap.add_argument("--keys", type=float, default=None, help="distinct keys (default 10M; --quick 200k)")
    ap.add_argument("--widths", default=None, help="row floats, comma-separated (default 16,64; --quick 16)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3; --quick 1")
    ap.add_argument("--device", default="cuda:0", help="the GPU to measure; 'none' measures the CPU alone")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/gpu_table-<date>.json)")
    args = ap.parse_args(argv)
    quick_or_full = (lambda q, f: q) if args.quick else (lambda q, f: f)
    args.keys = args.keys if args.keys is not None else quick_or_full(2e5, 10e6)
    args.widths = args.widths or quick_or_full("16", "16,64")
    args.repeats = args.repeats or quick_or_full(1, 3)
    n = int(args.keys)
    widths = [int(w) for w in args.widths.split(",")]
    devices = ["cpu"]
    gpus = hps.cuda_device_count()
    if args.device != "none":
        if gpus == 0:
            print(f"gpu_table_bench: no usable CUDA device, measuring the CPU launcher alone", file=sys.stderr)
        else:
            devices.append(args.device)
    limit = memory_bandwidth_gb_s(hps.hash_table.parse_device(devices[-1])) if len(devices) > 1 else None
    out = {"benchmark": "gpu_table", "quick": args.quick, "keys": n, "repeats": args.repeats,
           "devices": devices, "cuda_compiled": hps.cuda_compiled(), "cuda_devices": gpus,
           "memory_bandwidth_gb_s": limit, "widths": {}}
    for width in widths:
        samples = {d: {op: [] for op in OPS} for d in devices}
        for r in range(args.repeats):
            for d in (devices if r % 2 == 0 else devices[::-1]):
                print(f"gpu_table_bench: rows of {width} floats, repeat {r + 1}/{args.repeats}, {d}",
                      file=sys.stderr, flush=True)
                for op, s in run_once(d, n, width, seed=r).items():
                    samples[d][op].append(s)
        per = {}
        for d in devices:
            per[d] = {}
            for op in OPS:
                secs = samples[d][op]
                link, mem = bytes_moved(op, n, width)
                med = statistics.median(secs)
                fig = {"mops": summarise([n / s / 1e6 for s in secs]), "seconds": summarise(secs)}
                if d != "cpu":
                    fig["host_link_gb_s"] = link / med / 1e9
                    fig["device_gb_s"] = mem / med / 1e9
                    if limit:
                        fig["of_memory_bandwidth"] = fig["device_gb_s"] / limit
                per[d][op] = fig
        if len(devices) > 1:
            per["gpu_over_cpu"] = {op: per[devices[1]][op]["mops"]["median"] / per["cpu"][op]["mops"]["median"]
                                   for op in OPS}
        out["widths"][str(width)] = per
    out["provenance"] = _provenance.provenance(sys.argv)
    line = json.dumps(out, sort_keys=True)
    print(line)
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"gpu_table-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(line + "\n")
    for width, per in out["widths"].items():
        for op in OPS:
            cells = [f"{d} {per[d][op]['mops']['median']:8.1f} Mops/s" for d in devices]
            extra = ""
            if len(devices) > 1 and "of_memory_bandwidth" in per[devices[1]][op]:
                extra = f"  ({per[devices[1]][op]['of_memory_bandwidth']:.1%} of memory bandwidth, floor)"
            print(f"  {width:>3} floats {op:<10} " + "   ".join(cells) + extra, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
