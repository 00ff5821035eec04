#!/usr/bin/env bash
# The GPU check in one command (benchmarks/gpu_check.py; how to run it: benchmarks/README.md,
# "GPU check"). On a machine with one CUDA GPU, its own CUDA torch and no network:
#   1. installs the wheels carried in .gpu_wheels/ (made here by scripts/gpu_wheels.sh) into a
#      folder of their own, with --no-deps and never torch, and records which did not install;
#   2. puts that folder and this tree (groupflow, uninstalled) first on PYTHONPATH;
#   3. runs benchmarks/gpu_check.py, which writes gpu_check.json and gpu_check.txt under $OUT when
#      set, else runs/gpu_check/ (plus gpu_check.log, this script's whole output).
# With --dry-run: the same on CPU with tiny shapes and no install (the test suite runs this).
# Other arguments go to gpu_check.py. PYTHON: the interpreter (default python3, the one that holds
# the machine's torch). GPU_CHECK_TIMEOUT_S: hard limit on the Python part (default 480 s: 8 min).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-runs/gpu_check}
WHEELS=${GPU_WHEELS_DIR:-.gpu_wheels}
SITE=${GPU_CHECK_SITE:-/tmp/groupflow-gpu-site}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
INSTALL_LOG=$(mktemp)
DRY=0
for arg in "$@"; do [ "$arg" = --dry-run ] && DRY=1; done

{
  echo "gpu_check.sh: $(date -u +%FT%TZ) on $(uname -n); python: $(command -v "$PYTHON")"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

  if [ "$DRY" = 1 ]; then
    echo "gpu_check.sh: dry run: nothing installed"
    printf 'wheels\tnot installed (dry run)\n' >"$INSTALL_LOG"
  elif ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check.sh: no wheels in $WHEELS (run scripts/gpu_wheels.sh here and carry $WHEELS)"
    printf 'wheels\tFAILED: no wheels in %s\n' "$WHEELS" >"$INSTALL_LOG"
  else
    rm -rf "$SITE" && mkdir -p "$SITE"
    for whl in "$WHEELS"/*.whl; do
      name=$(basename "$whl")
      case "$name" in
        torch-* | nvidia_* | triton-*)
          printf '%s\tFAILED: refused (the machine brings its own CUDA torch)\n' "$name" >>"$INSTALL_LOG"
          continue ;;
      esac
      # One wheel at a time, so one that does not fit this Python leaves the others installed.
      if err=$("$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
                 --disable-pip-version-check --upgrade --target "$SITE" "$whl" 2>&1); then
        printf '%s\tinstalled\n' "$name" >>"$INSTALL_LOG"
      else
        printf '%s\tFAILED: %s\n' "$name" "$(echo "$err" | tail -1 | tr '\t' ' ')" >>"$INSTALL_LOG"
      fi
    done
    echo "gpu_check.sh: wheels ($SITE):"
    sed 's/^/  /' "$INSTALL_LOG"
  fi
  # groupflow from this tree, without installing it (no dependency resolution, torch untouched)
  if [ "$DRY" = 1 ]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-480}" \
    "$PYTHON" benchmarks/gpu_check.py --out "$OUT_DIR" --install-log "$INSTALL_LOG" "$@"
  rc=$?
  [ "$rc" = 124 ] && echo "gpu_check.sh: the check ran past ${GPU_CHECK_TIMEOUT_S:-480} s; $OUT_DIR/gpu_check.json holds the parts that finished"
  exit "$rc"
} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
rm -f "$INSTALL_LOG"
exit "$rc"
