#!/usr/bin/env bash
# Runs the test suite: sets up .venv if needed (CPU torch), then ruff and pytest.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k replica -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
ruff check .
python -m pytest "$@"
