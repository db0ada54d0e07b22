#!/usr/bin/env bash
# The daemon and CLI on Python 3.10 (Ubuntu 22.04's python3, a common ROCm host): ./.venv-py310
# with the light dependencies only (no torch, no LLaMA-Factory: the job's environment is the
# job's business), every module imported, then the tests that need no ML stack (a real daemon
# included). Extra arguments go to pytest. Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON310:-}
if [ -z "$PY" ]; then
  for cand in python3.10 "$HOME"/.pyenv/versions/3.10*/bin/python /root/.pyenv/versions/3.10*/bin/python; do
    if "$cand" -c "import sys; sys.exit(sys.version_info[:2] != (3, 10))" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "py310.sh: no Python 3.10 interpreter found (set PYTHON310, or install python3.10)" >&2
  exit 1
fi
stamp=.venv-py310/.installed
want=$(sha256sum pyproject.toml scripts/py310.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  rm -rf .venv-py310
  "$PY" -m venv .venv-py310
  echo "py310.sh: installing oom-supervisor (light dependencies) + pytest into .venv-py310" >&2
  .venv-py310/bin/pip install --disable-pip-version-check -q -e . 'pytest>=8' 'pytest-xdist>=3.5' 'hypothesis>=6.100'
  echo "$want" > "$stamp"
fi
.venv-py310/bin/python - <<'PY'
import importlib, pkgutil, sys
import supervisor
assert sys.version_info[:2] == (3, 10), sys.version
skip = ("hooks.startup", "introspect", "generate_keys", "__main__")
bad = []
for m in pkgutil.walk_packages(supervisor.__path__, "supervisor."):
    if any(s in m.name for s in skip):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as exc:  # noqa: BLE001 - every failure is reported
        bad.append(f"{m.name}: {exc!r}")
if "torch" in sys.modules:
    bad.append("importing the daemon's modules imported torch")
if bad:
    sys.exit("py310.sh: on Python 3.10:\n  " + "\n  ".join(bad))
print(f"py310.sh: every module imports on Python {sys.version.split()[0]}")
PY
if [ $# -eq 0 ]; then
  set -- tests/architecture tests/intake tests/core/test_spool.py tests/core/test_states_store.py tests/hostile \
    tests/core/test_daemon.py tests/core/test_output_dir.py
fi
exec .venv-py310/bin/python -m pytest -q -p no:cacheprovider -n "${OOM_SUPERVISOR_TEST_WORKERS:-2}" "$@"
