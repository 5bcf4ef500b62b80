#!/usr/bin/env bash
# Download the wheels that a GPU machine without network needs for bench/gpu_acceptance.sh into
# .whl/ (ignored by git; the acceptance script installs them into a temporary folder).
#
#   bash bench/gpu_wheels.sh            # Python 3.12, manylinux x86-64 (the lent H200's python3)
#   PY_VERSION=3.11 bash bench/gpu_wheels.sh
#
# What the lent machine's python3 lacks (its package list is in the device tool's notes):
#   megatron-core 0.19.2  the megatron-core candidate; its other needs (torch, numpy,
#                         packaging) are there (Requires-Dist without extras)
#   grimp 3.20            tests/test_import_graph.py and tests/test_seam_imports.py import it
# Together about 5 MB; the working tree that travels to the machine may hold 64 MiB.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo/.whl"
py_version="${PY_VERSION:-3.12}"
wheels=(megatron-core==0.19.2 grimp==3.20)

mkdir -p "$dest"
# One version of each package: two would stop the whole install on the machine.
rm -f "$dest"/megatron_core-*.whl "$dest"/grimp-*.whl
python3 -m pip download --no-deps --only-binary=:all: --python-version "$py_version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$dest" "${wheels[@]}"
for wheel in "$dest"/*.whl; do
  # Requirements that are not extras: each must already be on the machine or be downloaded here.
  needs="$(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
    | sed 's/^Requires-Dist: //' | paste -sd, - || true)"
  echo "$(basename "$wheel") ($(du -h "$wheel" | cut -f1)) needs: ${needs:-nothing}"
done
echo "total $(du -sh "$dest" | cut -f1) in $dest; git ignores it (.gitignore: /.whl/)"
