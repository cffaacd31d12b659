#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (torch 2.13.0, CPU),
# builds the extension against it, then runs what was asked.
#   bash scripts/dev.sh demo     # the demo
#   bash scripts/dev.sh test     # every test: GoogleTest (CTest), pytest, the quick benchmark run
#   bash scripts/dev.sh opinfo   # the full OpInfo conformance report
#   bash scripts/dev.sh bench [--quick]
#   bash scripts/dev.sh cuda-compile   # compile-only check against torch 2.14.1 (CUDA 13)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="$ROOT/.venv/bin/python"
TORCH_VERSION=2.13.0

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv .venv
  fi
  # Pinned torch from local disk; never let a build pull another one.
  if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
  fi
  "$PY" -m pip install -q numpy pytest expecttest hypothesis matplotlib 2>&1 | grep -v "^WARNING: Location" || true
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
  "$PY" -c "import torch_mgpu" || { echo "build failed"; exit 1; }
}

cpp_tests() {
  if [ ! -f /usr/include/gtest/gtest.h ]; then
    if command -v apt-get >/dev/null; then
      (apt-get update -qq && apt-get install -y -qq libgtest-dev) >/dev/null 2>&1 || true
    fi
  fi
  [ -f /usr/include/gtest/gtest.h ] || { echo "GoogleTest is missing: apt-get install libgtest-dev"; exit 1; }
  cmake -S . -B build-tests -DCMAKE_BUILD_TYPE=Release -DTORCH_MGPU_BUILD_TESTS=ON -DTORCH_MGPU_BUILD_PYTHON=OFF \
    -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
  cmake --build build-tests -j "$(nproc)"
  (cd build-tests && ctest --output-on-failure)
}

# Compile-only check against the CUDA 13 build of torch 2.14.1 (from local
# disk, in its own venv): PyTorch's newest headers (C++20) and its CUDA
# configuration, so that neither can rot unseen. Nothing runs: no GPU here.
cuda_compile() {
  local venv="$ROOT/.venv-cuda"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.14.1')" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q "torch==2.14.1" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  local prefix nvrtc
  prefix=$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  nvrtc=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so* 2>/dev/null | head -1)
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DCUDA_TOOLKIT_ROOT_DIR="${CUDA_HOME:-/usr/local/cuda}" ${nvrtc:+-DCUDA_nvrtc_LIBRARY="$nvrtc"} \
    -DTORCH_MGPU_USE_CUDA=ON -DTORCH_MGPU_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$venv/bin/python" \
    -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$ROOT/build-cuda/lib" >/dev/null
  cmake --build build-cuda -j "$(nproc)"
  echo "CUDA compile check: built against torch 2.14.1 (CUDA 13)"
}

cmd=${1:-test}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; "$PY" examples/demo.py "$@" ;;
  test) setup; cpp_tests; "$PY" -m pytest -q test "$@"; "$PY" benchmarks/run.py --quick ;;
  opinfo) setup; "$PY" test/opinfo_harness.py "$@" ;;
  bench) setup; "$PY" benchmarks/run.py "$@" ;;
  cuda-compile) cuda_compile ;;
  *) echo "usage: $0 {setup|demo|test|opinfo|bench|cuda-compile}"; exit 2 ;;
esac
