# Sourced by the GPU scripts (gpu_check.sh, gpu_elementwise.sh): on a
# machine whose Python has JAX for CUDA but not the project's other
# dependencies, installs them from the wheels in .whl/ (fetched beforehand
# by benchmarks/fetch_gpu_wheels.sh) into a folder of their own, never
# touching the JAX stack, and puts that folder and the repository on
# PYTHONPATH. A machine that has them keeps its environment as it is.
# Expects PYTHON and the repository root as the working directory.
if ! "$PYTHON" -c 'import grain, ml_collections, mlxtend, ftfy' 2>/dev/null \
    && compgen -G '.whl/*.whl' >/dev/null; then
  site=${TMPDIR:-/tmp}/prolip_gpu_check_site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
