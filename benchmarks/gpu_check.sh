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
source benchmarks/gpu_wheels.sh
exec "$PYTHON" benchmarks/gpu_check.py "$@"
