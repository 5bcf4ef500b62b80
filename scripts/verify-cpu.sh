#!/usr/bin/env bash
# Main job on a fresh machine: set up .venv, then run every check on the CPU and
# write report.json and report.md in the current directory. Extra arguments go to `verify run`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup-venv.sh"
venv="${VENV:-$repo/.venv}"
exec "$venv/bin/verify" run --json report.json --markdown report.md "$@"
