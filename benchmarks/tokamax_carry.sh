#!/usr/bin/env bash
# Fetches into `.whl/` the wheels `benchmarks/gpu_session.sh tokamax` needs on the lent GPU machine
# (Python 3.12, no network): tokamax and what it imports that the machine's image lacks or may hold
# too old (the image has absl-py, jaxtyping, msgpack, optax, orbax-checkpoint, tensorstore, treescope,
# tqdm, rich, pyyaml; /work/.library/device/KINDS.md lists it). pyproject's pins: tokamax==0.0.12.
# gpu_session.sh's setup installs every wheel in .whl with --no-deps; name `.whl` in the device
# tool's `carry`. About 5 MB (the gRPC family's wheels for the serving steps can sit beside them).
#
#   bash benchmarks/tokamax_carry.sh        # needs pip and network here
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(tokamax==0.0.12 qwix==0.1.8 flax==0.12.8 einshape==1.0 typeguard==2.13.3 immutabledict==4.3.1
        tensorboardx==2.6.5 pydantic==2.14.4 pydantic-core annotated-types typing-inspection
        "typing-extensions>=4.16.0")
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
