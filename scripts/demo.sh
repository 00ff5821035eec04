#!/usr/bin/env bash
# The CPU demo: set up (idempotent), then GRPO on the built-in digit-reversal task.
# Each run starts afresh in runs/reverse-demo (run.overwrite=true). Extra arguments are config
# overrides, e.g. `bash scripts/demo.sh run.seed=1`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/groupflow ] || bash scripts/setup.sh
exec .venv/bin/groupflow train examples/reverse_demo.yaml run.overwrite=true "$@"
