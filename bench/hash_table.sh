#!/usr/bin/env bash
# W2 (BENCHMARKS.md): builds and runs the hash table benchmark against
# absl::flat_hash_map and boost::unordered_flat_map, on a fresh Debian machine.
#
#   bench/hash_table.sh            # full: 10M keys, widths 16 and 64, 3 repeats
#   bench/hash_table.sh --quick    # 1M keys, 1 repeat, well under a minute
#   bench/hash_table.sh --keys 5e6 --repeats 5 --widths 16 --no-peer-hugepages
#
# Arguments go to hash_table_bench unchanged (--help lists them). Progress goes
# to stderr; the final JSON line, stamped with its provenance (commit, date,
# machine, this command: bench/_provenance.py), is printed and kept in
# bench/results/hash_table-<date>.json; `python3 bench/report.py --add FILE`
# files a full run's line for docs/benchmarks.md. HPS_BENCH_BUILD names the
# build directory (default build-bench).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
build="$root/${HPS_BENCH_BUILD:-build-bench}"

# ---- toolchain and peers: apt-get, only what is missing ----
missing=()
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in libabsl-dev libboost1.81-dev; do
  installed "$pkg" || missing+=("$pkg")
done
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v c++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || command -v ninja >/dev/null 2>&1 || missing+=(make)
if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "hash_table.sh: installing ${missing[*]}" >&2
  $sudo apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

# ---- configure (once) and build ----
gen=()
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
cmake -S "$root" -B "$build" "${gen[@]}" \
  -DHPS_BUILD_BENCH=ON -DHPS_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >&2
cmake --build "$build" --target hash_table_bench -j "$(nproc)" >&2

# ---- run; keep the JSON line ----
mkdir -p "$root/bench/results"
out="$root/bench/results/hash_table-$(date +%Y%m%d-%H%M%S).json"
tmp="$out.partial"
trap 'rm -f "$tmp"' EXIT
"$build/bench/hash_table_bench" "$@" | python3 "$here/_provenance.py" stamp -- bench/hash_table.sh "$@" | tee "$tmp"
if [ -s "$tmp" ]; then
  mv "$tmp" "$out"
  echo "hash_table.sh: result in ${out#"$root"/}" >&2
fi
