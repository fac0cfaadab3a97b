#!/usr/bin/env bash
# The clients the tests drive the service with, each in a directory of its own (not needed to run
# the service: scripts/setup.sh installs that; scripts/test.sh runs this too).
#
# The client installs are cached outside the clone, keyed on what they pin (and the Python they run
# on): ${ROLLOUT_SERVICE_CACHE:-~/.cache/rollout-service}/clients/<name>-<key>, and .venv/<name> is a
# link to it. A fresh clone (CI) reuses them; a changed pin builds a new one; a fresh machine builds
# them all (~2 min). ROLLOUT_SERVICE_CACHE=off installs into .venv/<name> as before.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(client_dir ...) stops the script too
cd "$(dirname "$0")/.."
[ -x .venv/bin/pip ] || bash scripts/setup.sh  # the venv these clients go beside

CACHE=${ROLLOUT_SERVICE_CACHE:-$HOME/.cache/rollout-service}
[ "$CACHE" = off ] || CACHE=$(realpath -m "$CACHE")
PYV=$(.venv/bin/python -c 'import sys; print(sys.version.split()[0])')

# client_dir NAME SPEC...: where NAME's install goes, echoed; .venv/NAME links to it. SPEC: every
# line of what the install pins (its key).
client_dir() {
  local name=$1; shift
  if [ "$CACHE" = off ]; then echo ".venv/$name"; return; fi
  local key; key=$(printf '%s\n' "$PYV" "$@" | sha256sum | cut -c1-12)
  local dir="$CACHE/clients/$name-$key"
  mkdir -p "$CACHE/clients"
  if [ "$(readlink .venv/"$name" 2>/dev/null)" != "$dir" ]; then
    rm -rf ".venv/$name"
    ln -s "$dir" ".venv/$name"
  fi
  echo "$dir"
}

# chromium renders the trajectory viewer and the rollout index in tests/test_serve_viewer.py.
if ! command -v chromium >/dev/null 2>&1; then
  echo "[setup] installing chromium (apt, for the viewer tests)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

# promtool (Debian's prometheus package) checks and unit-tests the alert rules in tests/test_deploy_manifests.py.
if ! command -v promtool >/dev/null 2>&1; then
  echo "[setup] installing promtool (apt prometheus, for the alert-rule tests)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# NeMo Gym 0.7's own vllm_model client, for tests/test_serve_required_prefix.py. nemo-gym 0.7 declares
# Python >= 3.13.14 and pins openai 2.44 (its Responses conversion fails on this venv's openai 3), so
# it goes into a directory of its own, without its dependency set (mlflow, wandb, datasets, ...): the
# package, its pinned openai (+ distro), and the modules its vllm_model server imports that the venv
# lacks. The test runs Gym's client in a subprocess with PYTHONPATH=<that directory>/pins:<that
# directory>: the pins ahead of the venv's packages, so Gym sees its own openai (Gym itself moves its
# install directory behind site-packages when it is imported).
GYM_PINS=("nemo-gym==0.7.0" "orjson==3.13.0" "omegaconf==2.4.0" "hydra-core==1.3.8" "antlr4-python3-runtime==4.9.3"
  "itsdangerous==2.2.0" "yappi==1.7.6" "pydot==4.0.1")
GYM_OWN=("openai==2.44.0" "distro==1.9.0")
gym=$(client_dir nemo-gym-0.7 "${GYM_PINS[@]}" -- "${GYM_OWN[@]}")
if [ ! -f "$gym/.installed" ]; then
  echo "[setup] installing nemo-gym 0.7 (its vllm_model client, for tests) into $gym"
  rm -rf "$gym"
  .venv/bin/pip install -q --no-deps --ignore-requires-python --target "$gym" "${GYM_PINS[@]}" >/dev/null
  .venv/bin/pip install -q --no-deps --target "$gym/pins" "${GYM_OWN[@]}" >/dev/null
  touch "$gym/.installed"
fi

# prime-rl's token-in client: renderers 0.1.12 (what verifiers 0.4's train client calls), for
# tests/test_serve_tokens.py. Its own directory, without its dependency set: the venv has openai,
# jinja2, numpy, tiktoken and transformers; renderers adds openai-harmony and prime-pydantic-config.
REND_PINS=("renderers==0.1.12" "openai-harmony==0.0.8" "prime-pydantic-config==0.4.3")
rend=$(client_dir renderers-0.1.12 "${REND_PINS[@]}")
if [ ! -f "$rend/.installed" ]; then
  echo "[setup] installing renderers 0.1.12 (prime-rl's token-in client, for tests) into $rend"
  rm -rf "$rend"
  .venv/bin/pip install -q --no-deps --target "$rend" "${REND_PINS[@]}" >/dev/null
  touch "$rend/.installed"
fi


# A whole verifiers 0.4 environment with its train client (prime-rl's path), for
# tests/test_serve_verifiers_env.py. verifiers 0.4 needs openai < 3 (this venv has openai 3) and
# ~100 packages of its own (mcp, anthropic, prime-*, no torch), so it gets a venv of its own.
VF_PINS=("verifiers==0.4.0" "renderers==0.1.12" "openai==2.54.0")
vf=$(client_dir verifiers-0.4 "${VF_PINS[@]}")
if [ ! -f "$vf/.installed" ]; then
  echo "[setup] installing verifiers 0.4 (a whole environment with its train client, for tests) into $vf"
  rm -rf "$vf"
  .venv/bin/python -m venv "$vf"
  if ! "$vf/bin/pip" install -q "${VF_PINS[@]}" > "$vf.log" 2>&1; then
    grep -v "is ignored" "$vf.log" | tail -20; rm -rf "$vf"; exit 1
  fi
  rm -f "$vf.log"
  touch "$vf/.installed"
fi

# UK AISI's inspect-ai, driving the service through its vllm provider, for tests/test_serve_inspect_ai.py
# (its re-serialization of a reasoning-only answer as content "\n"). inspect-ai brings ~90 packages of
# its own (textual, jsonschema, ...) the service's venv should not take on: a venv of its own.
INSP_PINS=("inspect-ai==0.3.285" "openai==3.57.0")
insp=$(client_dir inspect-ai-0.3 "${INSP_PINS[@]}")
if [ ! -f "$insp/.installed" ]; then
  echo "[setup] installing inspect-ai 0.3.285 (its vllm provider, for tests) into $insp"
  rm -rf "$insp"
  .venv/bin/python -m venv "$insp"
  if ! "$insp/bin/pip" install -q "${INSP_PINS[@]}" > "$insp.log" 2>&1; then
    grep -v "is ignored" "$insp.log" | tail -20; rm -rf "$insp"; exit 1
  fi
  rm -f "$insp.log"
  touch "$insp/.installed"
fi
