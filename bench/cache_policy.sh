#!/usr/bin/env bash
# W3 (BENCHMARKS.md): hit rate of the MEM-PS cache policies (hps.MemCache) against
# LRU, an ideal whole-history LFU and Belady's offline optimum, on a synthetic Zipf
# trace and the real Criteo sample, at 1%, 5% and 20% of each trace's unique keys; and
# the default policy again with a lookahead window of K = 1, 2, 4 batches (--lookahead;
# issue 16), as the pipeline's prefetch stage gives it.
#
#   bench/cache_policy.sh             # full: Zipf 2M accesses over 1M keys + Criteo
#   bench/cache_policy.sh --quick     # Zipf 200k over 100k + Criteo, under a minute
#   bench/cache_policy.sh --zipf-a 0.9 --capacities 0.01,0.1 --criteo ''
#
# Arguments go to cache_policy_bench.py unchanged (--help lists them). Progress and
# the tables go to stderr; the final JSON line is printed and kept in
# bench/results/cache_policy-<date>.json, also when the run fails its native-LRU
# cross-check (exit status 1), so that the failing figures stay on record. Uses the
# system python3, where the hps package must already be installed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
py="${PYTHON:-python3}"

# ---- dependencies: only what is missing ----
if ! "$py" -c 'import tqdm' >/dev/null 2>&1; then
  echo "cache_policy.sh: installing tqdm" >&2
  "$py" -m pip install --quiet tqdm >&2
fi
"$py" -c 'import hps; hps.MemCache' ||
  { echo "cache_policy.sh: hps with MemCache is not installed for $py" >&2; exit 1; }

# ---- run; keep the JSON line ----
mkdir -p "$root/bench/results"
out="$root/bench/results/cache_policy-$(date +%Y%m%d-%H%M%S).json"
tmp="$out.partial"
trap 'rm -f "$tmp"' EXIT
status=0
"$py" "$here/cache_policy_bench.py" "$@" | tee "$tmp" || status=$?
if [ -s "$tmp" ]; then
  mv "$tmp" "$out"
  echo "cache_policy.sh: result in ${out#"$root"/}" >&2
fi
exit "$status"
