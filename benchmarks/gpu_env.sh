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
# A compilation cache in the (git-ignored) repository root, shared by the processes of a call and kept
# for the next call on a machine still warm. With it jax also keeps XLA's per-fusion autotuning results
# there (`jax_persistent_cache_enable_xla_caches`, set here to what jax's default is). On an H100, GPT-2
# small's first step compiled in 46-53 s and the larger instrumented steps after it, in the same process,
# in 14-29 s (benchmarks/results/h100_gpt2_small_b16*.json): most of a first compile is work done once
# per process, such as autotuning the matmuls, which the cache lets later processes skip (on a GPU, not
# yet measured); a program an earlier call compiled is loaded, not compiled (on the CPU: 6.6 s -> 0.9 s).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
export JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=${JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES:-xla_gpu_per_fusion_autotune_cache_dir}
python3 -c 'import jax, dsjax.sweep; print("jax", jax.__version__, jax.devices())' || return 1
