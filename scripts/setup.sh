#!/usr/bin/env bash
# Create ./.venv and install oom-supervisor with the ML extra (LLaMA-Factory, DeepSpeed,
# torch pinned to the release on this machine's disk). Idempotent: re-running after a
# finished install does nothing unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.10 python3; do command -v "$cand" >/dev/null && { PY=$cand; break; }; done
fi
[ -n "$PY" ] || { echo "setup: no python3 found; install Python 3.10 or newer" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  err=$(mktemp)
  if ! "$PY" -m venv .venv >"$err" 2>&1; then  # Debian says why on stdout
    rm -rf .venv
    ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo 3)
    if grep -qi "ensurepip\|venv" "$err"; then
      echo "setup: '$PY -m venv' failed: this Python has no venv module. On Debian/Ubuntu:" >&2
      echo "  sudo apt-get install python3-venv   (or python$ver-venv)" >&2
    else
      cat "$err" >&2
    fi
    rm -f "$err"
    exit 1
  fi
  rm -f "$err"
fi
stamp=.venv/.oom-supervisor-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "setup: installing oom-supervisor[llamafactory,test] into .venv (first time: ~5 minutes)" >&2
  # torch first, pinned, so nothing later can pull another build; then the rest.
  .venv/bin/pip install --disable-pip-version-check -q 'torch==2.14.1' 'torchvision==0.29.1'
  .venv/bin/pip install --disable-pip-version-check -q -e '.[llamafactory,test]'
  echo "$want" > "$stamp"
fi
