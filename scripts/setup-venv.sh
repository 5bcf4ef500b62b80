#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install gradverify into it.
#
#   VENV               where the environment lives (default: .venv in the repository)
#   GRADVERIFY_TORCH   the torch requirement to install when no torch is importable
#                      (default: torch==2.13.0, the CPU build, no CUDA downloads)
#   GRADVERIFY_EXTRAS  extras to install (default: none; scripts/test.sh asks for test,plot,lint,gpu,megatron)
#
# If the python3 on PATH can already import torch (a GPU node's CUDA build), the
# environment is created with --system-site-packages and that torch is reused.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo/.venv}"
torch_spec="${GRADVERIFY_TORCH:-torch==2.13.0}"
extras="${GRADVERIFY_EXTRAS:-}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the torch already importable by $python ($("$python" -c 'import torch; print(torch.__version__)'))" >&2
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $torch_spec" >&2
  "${pip[@]}" install "$torch_spec"
fi
target="$repo"
[ -n "$extras" ] && target="$repo[$extras]"
"${pip[@]}" install -e "$target"
