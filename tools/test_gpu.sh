#!/usr/bin/env bash
# The whole test suite on a machine with one GPU, in parallel (pytest-xdist), in about four
# minutes on an H100 machine with 16 cores:
#
#   bash tools/test_gpu.sh [pytest arguments]      # e.g. -m gpu: the GPU-only tests alone
#
# Tests that need TensorFlow Datasets, the GCS emulator or shellcheck skip where those are not
# installed. Runs started as subprocesses use the CPU (tests/cli.py); the rest use the GPU,
# with float32 matrix products pinned to full precision (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# The workers share one GPU: none may take most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
exec python3 -m pytest -q -n "${TEST_WORKERS:-12}" -p no:cacheprovider "$@"
