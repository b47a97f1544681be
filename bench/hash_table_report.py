"""Turns a hash_table_bench JSON line into the markdown tables of docs/benchmarks.md.

    python bench/hash_table_report.py bench/results/hash_table-<date>.json
"""
import json
import sys

OPS = ["insert", "find_hit", "find_mix", "accumulate"]
IMPLS = ["hps_t1", "hps_t2", "absl", "boost"]


def fmt(stat):
    return f"{stat['median']:.2f} ({stat['min']:.2f}-{stat['max']:.2f})"


def report(result):
    cfg = result["config"]
    lines = [
        f"keys {cfg['keys']:,}, {cfg['repeats']} repeats, hps load {cfg['hps_load']:.2f}, "
        f"peer huge pages {cfg['peer_hugepages']}; Mops/s, median (min-max)",
        "",
    ]
    for width, r in result["results"].items():
        lines += [f"**rows of {width} floats** (slots: " +
                  ", ".join(f"{k} {v:,} (load {r['load'][k]:.2f})" for k, v in r["slots"].items()) + ")",
                  "",
                  "| op | " + " | ".join(IMPLS) + " | hps_t1 / best peer | hps_t2 / hps_t1 |",
                  "|---|" + "---|" * (len(IMPLS) + 2)]
        for op in OPS:
            cells = [fmt(r["ops"][op][impl]) for impl in IMPLS]
            best = r["ratios"]["hps_t1_over_best_peer"][op]
            scaling = r["ratios"]["hps_t2_over_hps_t1"][op]
            lines.append(f"| {op} | " + " | ".join(cells) +
                         f" | {best['ratio']:.2f} ({best['best_peer']}) | {scaling:.2f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        print(report(json.loads(f.readline())))
