#!/usr/bin/env bash
# Herald A/B: the working tree's scheduler against BASE_REV's in one binary,
# interleaved batch by batch (harness.cc). Checks that every plan matches,
# then times ROUNDS rounds at 8 and 64 workers, alternating, one JSON line each.
#
#   bench/herald_ab/run.sh BASE_REV [ROUNDS] [REPS] [BATCHES]
#
# HERALD_AB_PLANS_DIFFER=1: the tree changes the plans on purpose (a new
# partition or eviction rule), so the check's mismatches are reported, not fatal.
# HERALD_AB_DIR: where it builds (default /tmp/herald-ab); HERALD_AB_FLAGS:
# extra compiler flags (e.g. -fsanitize=address,undefined). Builds under nice.
# The generated hps/config.h comes from a configured CMake build directory,
# HERALD_AB_CMAKE_BUILD (default: build/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
base=${1:?usage: run.sh BASE_REV [ROUNDS] [REPS] [BATCHES]}
rounds=${2:-3}
reps=${3:-3}
batches=${4:-60}
out=${HERALD_AB_DIR:-/tmp/herald-ab}
mkdir -p "$out/old/include/hps" "$out/old/src/ps" "$out/old/src/util" "$out/obj"
for f in src/ps/herald.cc include/hps/herald.h src/util/keys.cc include/hps/keys.h src/util/mix64.h src/util/huge_pages.h; do
  # (huge_pages.h since the snapshot went on huge pages; older bases lack it)
  if git -C "$root" cat-file -e "$base:$f" 2>/dev/null; then git -C "$root" show "$base:$f" >"$out/old/$f"; fi
done
config=${HERALD_AB_CMAKE_BUILD:-$root/build}/include
[[ -f $config/hps/config.h ]] || { echo "no $config/hps/config.h: configure a build first (cmake -S . -B build)" >&2; exit 1; }
flags="-std=c++20 -O3 -g -Wall -Wextra -Wshadow ${HERALD_AB_FLAGS:-}"
old="-Dhps=hps_old -I$out/old/include -I$out/old/src -I$config"
new="-I$root/include -I$root/src -I$config"
cxx() { nice -n 19 c++ $flags "$@"; }
# shellcheck disable=SC2086
{
  cxx $old -c "$out/old/src/ps/herald.cc" -o "$out/obj/old_herald.o"
  cxx $old -c "$out/old/src/util/keys.cc" -o "$out/obj/old_keys.o"
  cxx $old -I"$here" -c "$here/old_api.cc" -o "$out/obj/old_api.o"
  cxx $new -c "$root/src/ps/herald.cc" -o "$out/obj/herald.o"
  cxx $new -c "$root/src/util/keys.cc" -o "$out/obj/keys.o"
  cxx $new -I"$here" -c "$here/harness.cc" -o "$out/obj/harness.o"
  cxx "$out"/obj/*.o -o "$out/harness"
}
echo "base $(git -C "$root" rev-parse --short "$base"), new: the working tree at $(git -C "$root" rev-parse --short HEAD)" >&2
nice -n 19 "$out/harness" check 2 || [[ ${HERALD_AB_PLANS_DIFFER:-0} == 1 ]]
for ((r = 0; r < rounds; ++r)); do
  for w in 8 64; do nice -n 19 "$out/harness" time "$w" "$reps" "$batches"; done
done
