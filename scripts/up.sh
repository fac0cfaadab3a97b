#!/usr/bin/env bash
# Set up (if needed) and run the service on the embedded default: local Ray, the tiny CPU model,
# a private redis-server. Extra arguments go to `rollout-service up` (e.g. --port 8001).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0
exec .venv/bin/rollout-service up "$@"
