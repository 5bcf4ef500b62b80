#!/usr/bin/env bash
# Test suite on a fresh machine: set up .venv with the test extras, then run every
# test (unit, property, multi-rank gloo; GPU tests skip without CUDA) in parallel.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADVERIFY_EXTRAS="${GRADVERIFY_EXTRAS:-test,plot,lint,gpu,megatron}" "$repo/scripts/setup-venv.sh"
venv="${VENV:-$repo/.venv}"
cd "$repo"
exec "$venv/bin/python" -m pytest -n auto "$@"
