# Sourced by the README's two commands (bench/demo.sh and tests/run.sh), from the
# repository root: what a fresh Debian 12 machine lacks, and a Python that pip may
# install into.
#
#   apt_install PKG...   installs those of the Debian packages that are missing
#                        (apt-get, as root or through sudo)
#   choose_python        sets PY and says which Python it is
#
# PYTHON names the interpreter (default python3). It is used as it is inside a
# virtual environment, or where pip may install into it (pyenv, conda, a
# container's Python). A Python whose distribution manages its packages (PEP 668:
# Debian 12's /usr/bin/python3 answers `pip install` with
# "externally-managed-environment") gets a virtual environment instead, at
# $HPS_VENV (default: .venv in the repository), made on the first run and
# reused after; `rm -rf .venv` removes all that was installed there.

apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  if ! command -v apt-get >/dev/null; then
    echo "setup: missing ${missing[*]} and no apt-get here: install them with your package manager" >&2
    return 1
  fi
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: apt-get install ${missing[*]}" >&2
  $sudo apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >&2
}

# Prints "venv", "managed" (PEP 668: pip refuses) or "free" for the interpreter $1.
_python_kind() {
  "$1" - <<'EOF'
import os, sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("venv")
elif os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")):
    print("managed")
else:
    print("free")
EOF
}

choose_python() {
  local base="${PYTHON:-python3}"
  command -v "$base" >/dev/null || { [ -z "${PYTHON:-}" ] && apt_install python3; }
  command -v "$base" >/dev/null || { echo "setup: no Python at '$base' (PYTHON)" >&2; return 1; }
  local kind
  kind=$(_python_kind "$base")
  if [ "$kind" != managed ]; then
    PY="$base"
    echo "setup: Python $(command -v "$base") ($kind)" >&2
  else
    local venv="${HPS_VENV:-$PWD/.venv}"
    if [ ! -x "$venv/bin/python" ]; then
      # Debian's Python has venv, pip and the C headers the build needs in packages of their own.
      "$base" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
      "$base" -m venv "$venv"
    fi
    PY="$venv/bin/python"
    export PATH="$venv/bin:$PATH"  # the `hps` command and the tools pip installs there
    echo "setup: $(command -v "$base") manages its own packages (PEP 668); using the virtual environment" \
         "$venv (remove it with: rm -rf $venv)" >&2
  fi
  local include
  include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  if [ ! -f "$include/Python.h" ]; then
    apt_install python3-dev
  fi
}
