#!/usr/bin/env bash
# The whole test suite on a machine with one GPU, in parallel (pytest-xdist). On an H100
# machine with 16 cores, 14 workers ran 435 of the tests in 400 s (issue #41): the slowest take
# 50-100 s each there, sharing the GPU and compiling for it. Needs more than one 10-minute
# device call; split it, e.g. `tests/test_[a-m]*.py` then `tests/test_[n-z]*.py`:
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
# tests/conftest.py compiles at -O0 on the CPU for speed; the GPU tests compile as users do.
export TEST_FULL_XLA_OPTIMIZATION=1
# pytest-benchmark (in some GPU images) only warns under xdist: off.
# (pytest.ini caps workers at 4 for a workstation: lifted here.)
exec python3 -m pytest -q -n "${TEST_WORKERS:-14}" --maxprocesses "${TEST_WORKERS:-14}" \
    -p no:cacheprovider -p no:benchmark "$@"
