#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite against the real engine, Ray, Redis and HTTP.
# Prints pytest's 25 slowest tests and, last, the set-up and test-phase wall times (the suite's
# budget is 15 minutes in all: docs/benchmarks.md, "CI wall time").
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/setup.sh
bash scripts/setup_test_clients.sh
t1=$(date +%s)
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# This clone's code first, also in the processes the tests start (the cached venv may have another
# clone registered: scripts/setup.sh).
export PYTHONPATH="$(pwd -P)${PYTHONPATH:+:$PYTHONPATH}"
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
rc=$?
set -e
t2=$(date +%s)
echo "[test] set-up $((t1 - t0))s, tests $((t2 - t1))s, total $((t2 - t0))s (budget 900s)"
# pytest exit 5 = no tests collected (e.g. a -k filter that matches nothing): not a failure.
[ "$rc" -eq 5 ] && rc=0
exit "$rc"
