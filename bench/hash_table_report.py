"""Prints a hash_table_bench JSON line as the markdown tables of docs/benchmarks.md
(bench/report.py's W2 tables: every implementation, absl_pf included, and hps_t1 over
the best peer and over the best unprefetched peer as the line's targets judge them:
medians, the best peer by median; then repeat by repeat against that peer).

    python3 bench/hash_table_report.py bench/results/hash_table-<date>.json

To put a full run into docs/benchmarks.md, file it instead:
python3 bench/report.py --add bench/results/hash_table-<date>.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import render_w2  # noqa: E402  (one W2 table, here and in the docs)


def report(result: dict) -> str:
    return "\n".join(render_w2(result))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        print(report(json.loads(f.readline())))
