#!/usr/bin/env bash
# The test command: on a fresh Debian machine it installs what the build needs
# (apt-get; pip, into a virtual environment .venv where the system's Python
# refuses pip: bench/setup.sh), builds and installs hps (with torch and the
# training extras), builds the native core under AddressSanitizer+UBSan and
# ThreadSanitizer and runs the native tests there, runs the hash-table benchmark
# in --quick mode, and ends with the Python tests (which run the other
# benchmarks' quick modes). Any failure stops it with a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==== %s (at %d s) ====\n' "$*" "$SECONDS"; }

source bench/setup.sh
step "apt packages, Python"
apt_install g++ liburing-dev libgtest-dev libabsl-dev libboost1.81-dev pkg-config
choose_python  # PY; a virtual environment .venv where the system's Python refuses pip (PEP 668)

step "pip install torch==2.13.0 and .[test,train,mpi,bench] (builds hps._core)"
mkdir -p build-logs
"$PY" -m pip install -q --upgrade cmake ninja
# torch first, pinned: the CPU build; an unpinned torch would pull a CUDA build of several GB.
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
if ! "$PY" -m pip install -v ".[test,train,mpi,bench]" >build-logs/pip-install.log 2>&1; then
  tail -n 60 build-logs/pip-install.log
  echo "pip install failed; the whole log is build-logs/pip-install.log" >&2
  exit 1
fi
grep -E -e "-- hps:" build-logs/pip-install.log
"$PY" -c "import hps; print('hps', hps.__version__, 'cuda compiled:', hps.cuda_compiled(), 'cuda devices:', hps.cuda_device_count())"

native() {  # name, extra cmake args...
  local dir="build-$1"; shift
  # -g1 (functions and line tables), not RelWithDebInfo's -g: a sanitizer's
  # stack traces need only functions, files and lines, and the rest of -g
  # (variables, types) is a quarter to a third of gcc's time on the largest
  # test files. The code is the same: gcc's debug level does not change it.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DHPS_BUILD_TESTS=ON -DHPS_CUDA=OFF "$@" >"build-logs/configure-$(basename "$dir").log"
  cmake --build "$dir"
  # Two tests at a time: the suite's time is mostly one thread each, and every
  # test writes under a directory of its own process id (tests/native/temp_dir.h).
  ctest --test-dir "$dir" --output-on-failure -j "$(nproc)"
}
step "native tests under AddressSanitizer + UBSan"
native asan -DHPS_SANITIZE=address,undefined
step "native tests under ThreadSanitizer"
native tsan -DHPS_SANITIZE=thread

step "hash-table benchmark, --quick"
bash bench/hash_table.sh --quick

step "pytest"
# The source package sits in python/hps, so this imports the installed build.
"$PY" -m pytest -p no:cacheprovider tests
echo "tests/run.sh: all passed in $SECONDS s"
