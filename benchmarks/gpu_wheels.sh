#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels of the dsjax dependencies that a prepared GPU image
# without network access may lack: Python 3.12, x86-64 Linux, the versions the CPU test suite runs with.
# The image is expected to hold jax with its CUDA plugin, flax, optax, orbax-checkpoint, chex, numpy,
# scipy, absl-py, etils, protobuf, tokenizers, pillow, scikit-learn, matplotlib and psutil.
#
#   benchmarks/gpu_wheels.sh            # here, where pip can download
#   # there, from the repository root (with .whl/ copied along):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#
# experiments/README.md ("On a GPU") and benchmarks/README.md give the commands that then run there.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(
  ml-collections==1.1.0 grain==0.2.18 tensorflow-datasets==4.9.10 array-record==0.8.6
  importlib-resources==7.1.0 tensorboardX==2.6.5 dm-tree==0.1.10 immutabledict==4.3.1
  simple-parsing==0.1.9 docstring-parser==0.18.0 tensorflow-metadata==1.21.0
  googleapis-common-protos==1.76.0 termcolor==3.3.0 toml==0.10.2 portpicker==1.6.0
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${wheels[@]}"
# promise (which tensorflow-datasets imports) is published as source only: build its pure-Python wheel.
python3 -m pip wheel -q --no-deps promise==2.3 -w .whl
ls -1 .whl
