#!/usr/bin/env bash
# Main job on a fresh machine: set up .venv, then run every check on the CPU and
# write report.json and report.md (and the plots beside them) in the current directory.
# Extra arguments go to `verify run`. The plot extra (matplotlib) is installed unless
# GRADVERIFY_EXTRAS says otherwise.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADVERIFY_EXTRAS="${GRADVERIFY_EXTRAS:-plot}" "$repo/scripts/setup-venv.sh"
venv="${VENV:-$repo/.venv}"
exec "$venv/bin/verify" run --json report.json --markdown report.md "$@"
