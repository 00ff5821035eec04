#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite, slow end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pytest ] || bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra "$@"
