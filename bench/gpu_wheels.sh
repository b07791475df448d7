#!/usr/bin/env bash
# Download, into .whl/ (ignored by git), the wheels that a bare CUDA machine with Python 3.12,
# torch, triton and transformers lacks for `python -m bench gpu` (see bench/README.md).  Needs
# the package index; bench/gpu_run.sh installs them on the GPU machine, which needs none.  They
# travel with the working tree, whose limit there is 64 MiB in all: the script says their size.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
download() {
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"
}
# pyopenssl wants cryptography below 51.
download trio outcome sniffio 'aioquic>=1.7,<1.8' pylsqpack pyopenssl service-identity pyasn1 \
    pyasn1-modules 'cryptography<51' cffi pycparser cbor2 gguf ifaddr pytest-trio pytest-timeout \
    'bitsandbytes>=0.50'
# The HTTP stack of the endpoint (bench api): pure-Python wheels (anyio and idna are there).
download hypercorn h2 hpack hyperframe priority wsproto starlette sse-starlette
du -sh .whl
