# Sourced from the repository root at the start of a command on a GPU machine: makes dsjax importable
# there. Where the image lacks some of dsjax's dependencies and .whl/ came along (benchmarks/gpu_wheels.sh
# fills it), installs those wheels into /tmp/dsjax_site, leaving the image's own packages as they are.
#
#   source benchmarks/gpu_env.sh || exit 1
if ! python3 -c 'import grain, tensorflow_datasets, ml_collections, tensorboardX' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/dsjax_site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/dsjax_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# One process holds the GPU: let it take more than jax's default 75% of the memory.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
python3 -c 'import jax, dsjax.sweep; print("jax", jax.__version__, jax.devices())' || return 1
