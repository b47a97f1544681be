#!/usr/bin/env bash
# W1 (a) (BENCHMARKS.md): hps.SsdStore against RocksDB (rocksdict, defaults and
# tuned) and LMDB, with fio as the device limit, each store in a 1 GiB memory
# cgroup (needs root for the cgroup; without it the JSON says "memory_limit": null).
# The stores run in interleaved rounds (--rounds, default 3); RocksDB tuned is
# bulk-loaded through SstFileWriter + ingest and swept over reader processes
# (--rocksdb-readers 1,2,4,8), memory budgets (--rocksdb-memory 512MiB,256MiB) and
# memory splits (--rocksdb-splits), each variant in a worker process of its own,
# reporting its best variant per figure and every variant with its options.
#
#   bench/ssd_store.sh            # full: 20M rows of 128 B, 200 batches of 100k keys, 3 rounds
#   bench/ssd_store.sh --quick    # 1M rows, 10 batches of 20k keys, one round, a few minutes
#   bench/ssd_store.sh --rows 5e6 --batches 20 --stores hps,rocksdb_tuned --rocksdb-readers 4,8
#
# Arguments go to ssd_store_bench.py unchanged (--help lists them). Progress goes
# to stderr; the final JSON line is printed and kept in
# bench/results/ssd_store-<date>.json. Uses the system python3, where the hps
# package must already be installed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
py="${PYTHON:-python3}"

# ---- peers: pip and apt-get, only what is missing ----
if ! "$py" -c 'import rocksdict, lmdb, tqdm' >/dev/null 2>&1; then
  echo "ssd_store.sh: installing rocksdict lmdb tqdm" >&2
  "$py" -m pip install --quiet rocksdict lmdb tqdm >&2
fi
if ! command -v fio >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "ssd_store.sh: installing fio" >&2
  if ! { $sudo apt-get update >&2 &&
         $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends fio >&2; }; then
    echo "ssd_store.sh: fio could not be installed; the benchmark will skip it" >&2
  fi
fi
"$py" -c 'import hps' || { echo "ssd_store.sh: the hps package is not installed for $py" >&2; exit 1; }

# ---- run; keep the JSON line ----
mkdir -p "$root/bench/results"
out="$root/bench/results/ssd_store-$(date +%Y%m%d-%H%M%S).json"
tmp="$out.partial"
trap 'rm -f "$tmp"' EXIT
"$py" "$here/ssd_store_bench.py" "$@" | tee "$tmp"
if [ -s "$tmp" ]; then
  mv "$tmp" "$out"
  echo "ssd_store.sh: result in ${out#"$root"/}" >&2
fi
