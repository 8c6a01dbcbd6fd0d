#!/usr/bin/env bash
# The tests as CI runs them, in the environment scripts/setup.sh made: the fast lane, then the end-to-end lane
# (scripts, the notebook, the README's commands, the shipped models), each on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    . .venv/bin/activate
fi
pytest -q -n 2 --dist worksteal -m "not gpu and not slow and not e2e"
pytest -q -n 2 --dist worksteal -m "e2e and not gpu and not slow"
