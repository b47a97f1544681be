#!/usr/bin/env bash
# The main job: `hps demo` on its embedded default (synthetic Criteo-like data, a
# MEM-PS budget small enough that rows move through all three tiers, a few
# minutes on 2 cores), after installing what it needs on a fresh machine:
# liburing (apt-get, for io_uring), torch 2.13.0 (the CPU build) and hps with its
# training extras (pip). Arguments go to `hps demo` (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

missing=()
for p in liburing-dev pkg-config; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})) && command -v apt-get >/dev/null; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "demo.sh: apt-get install ${missing[*]}" >&2
  $SUDO apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" >&2
fi
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
if ! "$PY" -c 'import hps.cli, tqdm, matplotlib, pyarrow' 2>/dev/null; then
  echo "demo.sh: pip install .[train]" >&2
  "$PY" -m pip install -q ".[train]"
fi
exec "$PY" -m hps.cli demo "$@"
