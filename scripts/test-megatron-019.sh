#!/usr/bin/env bash
# The second test leg (what `tox -e megatron019` runs), on a fresh machine: the Megatron-Core
# tests on megatron-core 0.19.2, and the tests that touch what changed between torch, Triton
# and NumPy releases (torch's float8 casts, private torch APIs, Triton's interpreter), on the
# software of the lent GPU node (H200): Python 3.12, torch 2.11.0 (its CUDA build, which runs
# on the CPU), Triton 3.6.0 and NumPy 2.5.2. Creates (or reuses)
# .venv-mcore019 with those, megatron-core==0.19.2 and gradverify's [test] extra. The main leg
# runs everything on torch 2.13.0, so the two legs span the releases users train with. Extra
# arguments go to pytest.
#
#   VENV               where the environment lives (default: .venv-mcore019 in the repository)
#   PYTHON             a Python 3.12 interpreter (default: python3.12 on PATH, else pyenv's
#                      /root/.pyenv/versions/3.12.*/bin/python)
#   GRADVERIFY_TORCH_019  the torch version of this leg (default 2.11.0, the GPU node's)
#
# megatron-core 0.17 on ships Python 3.12 wheels only, and torch for Python 3.12 comes from the
# registry as its CUDA build (about 4.7 GB installed): the first run installs for several
# minutes, later runs reuse the environment.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo/.venv-mcore019}"
megatron_core="0.19.2"
torch_version="${GRADVERIFY_TORCH_019:-2.11.0}"
# The lent GPU node's other versions; torch 2.11.0 itself requires Triton 3.6.0.
numpy_version="2.5.2"
# What the leg runs: tests/second_leg_paths.txt (pytest reads it as arguments; tox.ini's
# megatron019 runs the same file).

is_python312() {
  "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1
}

find_python312() {
  local candidate
  if [ -n "${PYTHON:-}" ]; then
    if is_python312 "$PYTHON"; then echo "$PYTHON"; return 0; fi
    echo "test-megatron-019: PYTHON=$PYTHON is not a working Python 3.12" >&2
    return 1
  fi
  # A pyenv shim named python3.12 exists even where 3.12 is not selected: try it, then
  # pyenv's own installs.
  for candidate in "$(command -v python3.12 || true)" /root/.pyenv/versions/3.12.*/bin/python; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && is_python312 "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  echo "test-megatron-019: no Python 3.12 found (looked for python3.12 on PATH and" \
       "/root/.pyenv/versions/3.12.*/bin/python); megatron-core $megatron_core ships Python 3.12" \
       "wheels only. Install Python 3.12 or set PYTHON=/path/to/python3.12." >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  python="$(find_python312)"
  echo "test-megatron-019: creating $venv with $python" >&2
  "$python" -m venv "$venv"
elif ! is_python312 "$venv/bin/python"; then
  echo "test-megatron-019: $venv exists but is not Python 3.12; remove it or set VENV" >&2
  exit 1
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
installed() {  # the installed version of a distribution, or nothing
  "$venv/bin/python" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}
torch_installed="$(installed torch)"
if [ "${torch_installed%%+*}" != "$torch_version" ]; then  # PyTorch's own index adds +cu130
  echo "test-megatron-019: installing torch==$torch_version (Python 3.12: the CUDA build, ~4.7 GB)" >&2
  "${pip[@]}" install "torch==$torch_version"
fi
if [ "$(installed megatron-core)" != "$megatron_core" ]; then
  echo "test-megatron-019: installing megatron-core==$megatron_core" >&2
  "${pip[@]}" install "megatron-core==$megatron_core"
fi
"${pip[@]}" install -e "${repo}[test,plot]" "numpy==$numpy_version"  # the GPU node has matplotlib

cd "$repo"
echo "test-megatron-019: $("$venv/bin/python" --version), torch $(installed torch)," \
     "triton $(installed triton), numpy $(installed numpy), megatron-core $(installed megatron-core)" >&2
exec "$venv/bin/python" -m pytest -n auto @tests/second_leg_paths.txt "$@"
