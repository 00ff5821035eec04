#!/usr/bin/env bash
# Creates .venv-verifiers, a second environment for verifiers environments (rollout.verifiers).
# Why a second environment: verifiers 0.4.0 requires mcp==2.0.0, while OpenEnv 0.10.0 (the main
# .venv's openenv extra) brings fastmcp 3, which requires mcp < 2: the two cannot share one
# environment. verifiers also declares openai < 3; groupflow's tests pin openai 3.57.0, on which
# verifiers runs (its own model calls go through httpx), so verifiers goes in without its
# dependencies, after every requirement it declares but openai.
# Idempotent; .venv-verifiers/.groupflow-ready marks a finished setup (scripts/test.sh skips the
# setup when it is there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-verifiers
pip_install() {
  # pip's "Location ... is ignored" warnings about this machine's local indexes are noise.
  local log
  log=$(mktemp)
  if ! "$VENV/bin/python" -m pip install -q -c constraints.txt "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    echo "setup_verifiers: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$VENV/.groupflow-ready"
pip_install torch==2.13.0
pip_install -e ".[serve]" "pytest>=8" "openai==3.57.0"
pip_install "aiohttp>=3.14.1" "anthropic>=1.0.0" "gepa>=0.0.6" "h11>=0.16.0" "httpx2>=2.12.0" \
  "loguru>=0.7.0" "math-verify>=0.8.0" "mcp==2.0.0" "msgpack>=1.1.2" "numpy>=2.1.0" \
  "prime-pydantic-config[toml]>=0.4.3" "prime-runs>=0.1.4" "prime-sandboxes>=0.4.2" \
  "prime-tunnel>=0.1.14" "pydantic>=2.12.3" "pyzmq>=27.1.0" "renderers[multimodal]>=0.1.12" \
  "rich>=11.0.0" "tenacity>=8.5.0" "tomli-w>=1.0.0" "uvicorn>=0.52.0" "uv>=0.9"
pip_install --no-deps verifiers==0.4.0
"$VENV/bin/python" -c "import verifiers.v1, groupflow.envs.verifiers; print('verifiers ready:', verifiers.__version__)"
touch "$VENV/.groupflow-ready"
