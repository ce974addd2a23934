#!/usr/bin/env bash
# Fetches, on a machine with PyPI access, the wheels that benchmarks/gpu_check.sh
# installs on a GPU machine that has Python 3.12 with JAX, flax, optax, Orbax,
# TensorStore, etils, scikit-learn, matplotlib and sentencepiece but no
# network: the project's other run-time dependencies, for CPython 3.12 on
# x86-64 Linux, into .whl/ (git-ignored; about 6 MB). Usage (repository root):
#
#   benchmarks/fetch_gpu_wheels.sh
#
# The JAX stack itself is never fetched: the check runs on the JAX the GPU
# machine already has (docs/gpu.md#the-gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(grain==0.2.18 array-record==0.8.6 ml_collections==1.1.0
        portpicker==1.6.0 mlxtend==0.25.0 ftfy==6.3.1 wcwidth==0.2.13
        tensorboardX==2.6.4)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl "${WHEELS[@]}"
ls .whl
