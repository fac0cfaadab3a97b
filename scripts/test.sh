#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite against the real engine, Ray, Redis and HTTP.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_test_clients.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
rc=$?
set -e
# pytest exit 5 = no tests collected (e.g. a -k filter that matches nothing): not a failure.
[ "$rc" -eq 5 ] && rc=0
exit "$rc"
