#!/usr/bin/env bash
# The test command: on a fresh Debian machine it installs what the build needs
# (apt-get; pip, into a virtual environment .venv where the system's Python
# refuses pip: bench/setup.sh), builds and installs hps (with torch and the
# training extras), runs the hash-table benchmark in --quick mode, builds the
# native core under AddressSanitizer+UBSan and ThreadSanitizer in the
# background while the Python tests run (which run the other benchmarks' quick
# modes), then runs the native tests under both. Any failure ends it with a
# non-zero exit (a failure of pytest after the native tests have run too).
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

native_build() {  # name, extra cmake args...
  local dir="build-$1"; shift
  # -g1 (functions and line tables), not RelWithDebInfo's -g: a sanitizer's
  # stack traces need only functions, files and lines, and the rest of -g
  # (variables, types) is a quarter to a third of gcc's time on the largest
  # test files. The code is the same: gcc's debug level does not change it.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DHPS_BUILD_TESTS=ON -DHPS_CUDA=OFF "$@" >"build-logs/configure-$(basename "$dir").log"
  # A compiler a core (not ninja's cores + 2): each nice-19 process still takes a
  # small share of a core from pytest's, and the cores are what it waits for.
  cmake --build "$dir" --parallel "$(nproc)"
}
native_test() {  # name
  # Two tests at a time: the suite's time is mostly one thread each, and every
  # test writes under a directory of its own process id (tests/native/temp_dir.h).
  ctest --test-dir "build-$1" --output-on-failure -j "$(nproc)"
}

step "hash-table benchmark, --quick"
# Before the sanitizer builds start: it measures throughput on an otherwise idle machine.
bash bench/hash_table.sh --quick

step "sanitizer builds (ASan+UBSan, TSan) start in the background, at nice 19, beside pytest"
# Most of pytest's tests run in one process (only the MPI jobs and some of the
# benchmarks take both cores), leaving a core idle much of its ~15 minutes; the
# builds (gcc alone: nothing timed) take it, and at nice 19 they yield the CPU
# to pytest's processes whenever those want it. The native tests run after
# pytest, alone. The builds run in a process group of their own (set -m), so
# that an exit of this script ends them too.
set -m
(
  renice -n 19 -p "$BASHPID" >/dev/null
  native_build asan -DHPS_SANITIZE=address,undefined
  native_build tsan -DHPS_SANITIZE=thread
) </dev/null >build-logs/sanitizer-builds.log 2>&1 &
builds=$!
set +m
trap 'kill -- -"$builds" 2>/dev/null || true' EXIT
trap 'exit 130' INT  # (exit runs the EXIT trap; a signal's default action would not)
trap 'exit 143' TERM

step "pytest"
# The source package sits in python/hps, so this imports the installed build.
pytest_rc=0
"$PY" -m pytest -p no:cacheprovider tests || pytest_rc=$?

step "sanitizer builds: waiting for them to end"
if ! wait "$builds"; then
  tail -n 60 build-logs/sanitizer-builds.log
  echo "a sanitizer build failed; the whole log is build-logs/sanitizer-builds.log" >&2
  exit 1
fi
trap - EXIT INT TERM
step "native tests under AddressSanitizer + UBSan"
native_test asan
step "native tests under ThreadSanitizer"
native_test tsan
if ((pytest_rc != 0)); then
  echo "tests/run.sh: pytest failed (exit $pytest_rc)" >&2
  exit "$pytest_rc"
fi
echo "tests/run.sh: all passed in $SECONDS s"
