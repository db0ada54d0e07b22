#!/usr/bin/env bash
# Set up what the suite needs and run it: what CI runs (.ci/run calls this and nothing else).
#   1. ./.venv (scripts/setup.sh);
#   2. Chromium, for the morning report's page test (apt-get, as root or with sudo);
#   3. the Slurm test clusters, each a script with `up` and `down` (CLUSTERS below);
#   4. ruff check . (lint, the rules in pyproject.toml; only without arguments);
#   5. pytest on three workers, extra arguments passed on (e.g. `bash scripts/test.sh tests/core -x`);
#   6. the daemon-side tests again on Python 3.10 (scripts/py310.sh; only without arguments), on one
#      worker beside step 5, its output printed after it.
# Everything it starts is stopped when it exits, passed, failed or interrupted (trap).
# OOM_SUPERVISOR_TEST_SLURM=0 leaves the clusters alone (their tests then skip; under CI=true
# they fail, naming what is missing); OOM_SUPERVISOR_TEST_INSTALL=0 installs no package;
# OOM_SUPERVISOR_TEST_PY310=0 skips step 6.
set -euo pipefail
cd "$(dirname "$0")/.."

# --fast: the fast tier (ruff, then the pure and in-process tests, `-m "not slow"`, ~1 min on 2 cores): no Chromium,
# no Slurm clusters, no Python 3.10 rerun. Extra arguments after it go to pytest.
if [ "${1:-}" = "--fast" ]; then
  shift
  bash scripts/setup.sh
  .venv/bin/ruff check -q .
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${OOM_SUPERVISOR_TEST_WORKERS:-2}" -m "not slow" "$@"
fi

# The Slurm test clusters: scripts/slurm.sh (one node); scripts/slurm2.sh (two nodes) joins
# when it exists. Each: `bash SCRIPT up` (idempotent, waits until ready) and `bash SCRIPT down`.
CLUSTERS=${OOM_SUPERVISOR_TEST_CLUSTERS:-"scripts/slurm.sh scripts/slurm2.sh"}

say() { echo "test.sh: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }

stop_clusters() {
  # The tests' own fixture may have started a cluster too (slurm.sh up is idempotent): stop them all.
  for s in $CLUSTERS; do
    [ -f "$s" ] || continue
    bash "$s" down >/dev/null 2>&1 || say "$s down failed; check for slurmctld/slurmd/munged left running"
  done
}

bash scripts/setup.sh

# The suite starts thousands of Python processes (daemons, CLI calls, trainings with the start-up
# hook): with PYTHONDONTWRITEBYTECODE set (some shells and containers set it) each one compiles this
# package from source again, and pytest rewrites every test module's asserts again in each worker.
unset PYTHONDONTWRITEBYTECODE

# DeepSpeed's CPU ops compile on their first use: its shared-memory collectives (every DeepSpeed
# process on a CPU box loads them: ~50 s of CPU) and CPU Adam (what ZeRO offload steps with: ~130 s
# of one core), which a fresh clone's first DeepSpeed tests would spend inside the suite. Build them
# now, beside Chromium's install, the clusters' start and lint, where every test's DeepSpeed finds
# them (tests/conftest_ml.py's TORCH_EXTENSIONS_DIR, also in the daemon-run jobs' env); a test that
# needs one first waits on torch's build lock (torch.utils.cpp_extension), so nothing depends on the
# build having finished.
if [ $# -eq 0 ]; then
  ext=${OOMSUP_TEST_CACHE:-$(pwd -P)/.cache/test-ml}/torch_extensions  # the path tests/conftest_ml.py uses
  mkdir -p "$ext"
  # The venv's bin first, as every test's DeepSpeed process has it (tests/conftest_ml.py's DS_ENV):
  # torch builds with the `ninja` on PATH, and the system's ninja would leave a build log the venv's
  # ninja does not trust, so the first test would build the ops again.
  PATH="$(pwd -P)/.venv/bin:$PATH" TORCH_EXTENSIONS_DIR=$ext setsid .venv/bin/python -c \
    'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()
from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
    >"$ext/../prebuild.log" 2>&1 &
  prebuild=$!
fi
stop_background() {
  # Interrupted while the compile or the 3.10 run goes on: stop them with everything they started
  # (each runs in its own session), and leave no build lock behind (torch would wait on it forever).
  if [ -n "${prebuild:-}" ] && kill -0 "$prebuild" 2>/dev/null; then
    kill -- -"$prebuild" 2>/dev/null || true
    rm -f "$ext/cpu_adam/lock" "$ext/deepspeed_shm_comm/lock"
  fi
  if [ -n "${py310:-}" ] && kill -0 "$py310" 2>/dev/null; then
    kill -- -"$py310" 2>/dev/null || true
  fi
}
trap stop_background EXIT

if [ "${OOM_SUPERVISOR_TEST_INSTALL:-1}" != 0 ] && ! command -v chromium >/dev/null 2>&1 \
    && ! command -v chromium-browser >/dev/null 2>&1; then
  say "installing Chromium (the report's page test opens the page in headless Chromium)"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends chromium >/dev/null \
    || say "could not install Chromium (needs root or sudo, and Debian's packages); its test will say so"
fi

if [ "${OOM_SUPERVISOR_TEST_SLURM:-1}" != 0 ]; then
  trap 'stop_background; stop_clusters' EXIT
  for s in $CLUSTERS; do
    [ -f "$s" ] || continue
    say "starting the test cluster of $s"
    bash "$s" up >/dev/null || say "$s up failed; its tests will say why"
  done
fi

# Not exec: the trap stops the clusters when pytest is done.
rc=0
# Lint first, under the rule set in pyproject.toml ([tool.ruff.lint]): a finding fails the run, but
# the tests still run so that one push says everything that is wrong.
if [ $# -eq 0 ]; then
  say "ruff check . (the rule set in pyproject.toml)"
  .venv/bin/ruff check . || rc=$?
fi
# The daemon and CLI on Python 3.10 (scripts/py310.sh), on one worker, beside the main run: its
# first minutes are the Slurm tests on one worker, mostly waiting on the scheduler, so the 3.10 run
# fills the idle core instead of adding a minute at the end. Its own temp folder; its output is
# printed after the main run's.
py310=
if [ $# -eq 0 ] && [ "${OOM_SUPERVISOR_TEST_PY310:-1}" != 0 ]; then
  mkdir -p .cache
  OOM_SUPERVISOR_TEST_WORKERS=1 PYTEST_ADDOPTS="--basetemp=$(pwd -P)/.cache/py310-tmp" \
    setsid bash scripts/py310.sh >.cache/py310.log 2>&1 &
  py310=$!
fi
# Three workers (pytest-xdist) on the 2-core CI box: with two, the cores sat ~7% idle over the run
# (vmstat; the chaos, control and Slurm tests wait on daemons and the scheduler), with three 3%, and
# the same commit's fresh-clone run took 1,610 s instead of 1,821 s. The tests that share the box's
# users or the Slurm clusters stay on one worker (tests/conftest.py). OOM_SUPERVISOR_TEST_WORKERS=N
# sets the number (0: in this process, one after another); `-n N` overrides.
# --durations=20: every run says where its time went (the 20 slowest tests).
.venv/bin/python -m pytest -q -ra --durations=20 -n "${OOM_SUPERVISOR_TEST_WORKERS:-3}" --dist load "$@" || rc=$?
if [ -n "$py310" ]; then
  r=0; wait "$py310" || r=$?
  say "the daemon and CLI on Python 3.10 (scripts/py310.sh), run beside the main run:"
  cat .cache/py310.log >&2
  [ "$rc" != 0 ] || rc=$r
fi
exit "$rc"
