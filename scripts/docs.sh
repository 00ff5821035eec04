#!/usr/bin/env bash
# Builds the documentation site (MkDocs + Material) and serves it on http://127.0.0.1:8001;
# `bash scripts/docs.sh build` only builds it into site/ (strict: a broken link fails).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -c "import mkdocs, material, mkdocstrings" 2>/dev/null ||
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[docs]"
export NO_MKDOCS_2_WARNING=1
if [ "${1:-serve}" = build ]; then
  exec .venv/bin/mkdocs build --strict
fi
exec .venv/bin/mkdocs serve --strict -a 127.0.0.1:8001
