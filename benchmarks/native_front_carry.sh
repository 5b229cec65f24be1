#!/usr/bin/env bash
# Prepares `.native-front/` for a session with a lent GPU: the native Forward port (`--native-port`)
# built here for the GPU machine's Python 3.12, and the gRPC C++ runtime libraries it links, so
# `benchmarks/gpu_session.sh floor` can measure that port on the GPU host's cores. That machine has
# no network and no libgrpc++, so nothing can be built there; name `.native-front` (and `.whl`) in
# the device tool's `carry`. gpu_session.sh's setup copies the module into ~/.cache/expertd (where
# `build_module` finds it by its key: sources, descriptors, flags, Python) and puts lib/ on
# LD_LIBRARY_PATH.
#
#   bash benchmarks/native_front_carry.sh        # needs python3.12 (PY312=...), apt-get, network
#
# The module's key covers server/native_front/csrc/ (every source and header) and the descriptors:
# after either changes, run this again (an old .native-front is then not found, and the floor step
# leaves the port out, saying why).
#
# Layout: .native-front/cache/native_front/<key>/expertd_native_front.cpython-312-*.so, and
# .native-front/lib/*.so* (Debian 12's libgrpc++ 1.51 and what it needs beyond glibc, libstdc++,
# OpenSSL 3 and zlib, which the GPU image has). About 20 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.native-front
PY312=${PY312:-python3.12}
RUNTIME_DEBS=(libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 libre2-9 libc-ares2)

if ! "$PY312" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2> /dev/null; then
  echo "native_front_carry: $PY312 is not a Python 3.12 (PY312=/path/to/python3.12)" >&2
  exit 1
fi
if ! compgen -G ".whl/*cp312*.whl" > /dev/null; then
  echo "native_front_carry: .whl holds no cp312 wheels (gpu_session.sh's setup says how to fetch them)" >&2
  exit 1
fi
rm -rf "$DEST"
mkdir -p "$DEST/lib" "$DEST/cache"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# The module: built by the package's own build_module under Python 3.12, with the same gRPC-family
# wheels the GPU session installs (the key hashes their descriptors).
"$PY312" -m venv "$scratch/venv"
"$scratch/venv/bin/pip" install -q --no-deps .whl/*.whl
"$scratch/venv/bin/pip" install -q .
"$scratch/venv/bin/python" -c "import sys; from expertd.server.native_front import build_module; \
print(build_module(sys.argv[1]))" "$PWD/$DEST/cache"

# The runtime libraries, from Debian's packages (unpacked, not installed).
(cd "$scratch" && apt-get download "${RUNTIME_DEBS[@]}" 2>/dev/null)
for deb in "$scratch"/*.deb; do dpkg-deb -x "$deb" "$scratch/root"; done
cp -a "$scratch"/root/usr/lib/x86_64-linux-gnu/*.so.* "$DEST/lib/"
du -sh "$DEST"
