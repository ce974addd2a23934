#!/usr/bin/env bash
# The GPU check on a machine whose Python already has JAX for CUDA (and
# flax, optax, Orbax) but no network: installs the project's other
# dependencies, where they are missing, from the wheels in .whl/ (fetched
# beforehand on a machine with PyPI access by benchmarks/fetch_gpu_wheels.sh)
# into a folder of their own, never touching the JAX stack, then runs
# benchmarks/gpu_check.py with the given arguments. docs/gpu.md#the-gpu-check says what it measures.
#
#   benchmarks/gpu_check.sh --out /tmp/gpu_check
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Only where the project's own dependencies are missing (a machine that
# has them, a CI runner or a dev box, keeps its environment as it is).
if ! "$PYTHON" -c 'import grain, ml_collections, mlxtend, ftfy' 2>/dev/null \
    && compgen -G '.whl/*.whl' >/dev/null; then
  site=${TMPDIR:-/tmp}/prolip_gpu_check_site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
