#!/usr/bin/env bash
# Create ./.venv and install oom-supervisor with the ML extra (LLaMA-Factory, DeepSpeed,
# torch pinned to the release on this machine's disk). Idempotent: re-running after a
# finished install does nothing unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do command -v "$cand" >/dev/null && { PY=$cand; break; }; done
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.oom-supervisor-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "setup: installing oom-supervisor[llamafactory,test] into .venv (first time: ~5 minutes)" >&2
  # torch first, pinned, so nothing later can pull another build; then the rest.
  .venv/bin/pip install --disable-pip-version-check -q 'torch==2.14.1' 'torchvision==0.29.1'
  .venv/bin/pip install --disable-pip-version-check -q -e '.[llamafactory,test]'
  echo "$want" > "$stamp"
fi
