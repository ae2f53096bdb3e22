#!/usr/bin/env bash
# Runs the test suite: sets up .venv if needed (CPU torch), finds or fetches the Megatron-LM
# clones (scripts/megatron_clones.sh), then ruff, mypy (the files and settings in
# pyproject.toml's [tool.mypy]), the API reference (scripts/docs.sh) and pytest.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k replica -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/megatron_clones.sh || exit 1
source scripts/setup_env.sh
ruff check .
mypy &  # beside the API reference's build: each takes one core
mypy_pid=$!
./scripts/docs.sh
wait "$mypy_pid"
if [ "$#" -gt 0 ]; then
    exec python -m pytest "$@"
fi
# the tests with short protocol timers (marked `timed`) alone in one process, then the rest
# on pyproject's two xdist workers (tests/README.md)
status=0
python -m pytest -n 0 -m "timed and not extended" || status=$?
python -m pytest -m "not timed and not extended" || status=$?
exit "$status"
