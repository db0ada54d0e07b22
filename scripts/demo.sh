#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo: a real LLaMA-Factory fine-tune on a tiny local
# model that runs out of host memory mid-run and is finished by the supervisor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m supervisor.demo.run "$@"
