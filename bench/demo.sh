#!/usr/bin/env bash
# The main job: `hps demo` on its embedded default (synthetic Criteo-like data, a
# MEM-PS budget small enough that rows move through all three tiers, a few
# minutes on 2 cores), after installing what it needs on a fresh machine:
# g++, liburing and pkg-config (apt-get), then torch 2.13.0 (the CPU build) and hps
# with its training extras (pip), into a virtual environment .venv where the
# system's Python refuses pip (PEP 668; bench/setup.sh). Arguments go to
# `hps demo` (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/setup.sh

apt_install g++ liburing-dev pkg-config
choose_python
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
if ! "$PY" -c 'import hps.cli, tqdm, matplotlib, pyarrow' 2>/dev/null; then
  echo "demo.sh: pip install .[train]" >&2
  "$PY" -m pip install -q ".[train]"
fi
exec "$PY" -m hps.cli demo "$@"
