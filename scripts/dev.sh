#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (torch 2.13.0, CPU),
# builds the extension against it, then runs what was asked.
#   bash scripts/dev.sh demo     # the demo
#   bash scripts/dev.sh test     # every test: GoogleTest (CTest), the installed C++ package and its examples, pytest, the quick benchmark run
#   bash scripts/dev.sh cpp-package   # the C++ tests, then install the core and build and run examples/cpp against it
#   bash scripts/dev.sh opinfo   # the full OpInfo conformance report
#   bash scripts/dev.sh bench [--quick]
#   bash scripts/dev.sh cuda-compile   # compile-only check against torch 2.14.1 (CUDA 13)
#   bash scripts/dev.sh gpu [--quick]  # on a GPU machine (CUDA torch installed): CUDA build, GPU tests, benchmarks/RESULTS-gpu.md
#   bash scripts/dev.sh gpu-tests [FILE...]  # there, after `gpu --quick`: the GPU test files it left out
#   bash scripts/dev.sh tsan     # the threaded C++ tests under ThreadSanitizer; fails on any report
#   bash scripts/dev.sh fuzz [SECONDS]   # differential fuzzing of mgpu against eager CPU (default 3600 s)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="$ROOT/.venv/bin/python"
TORCH_VERSION=2.13.0

setup() {
  # Checks and builds import torch without autoloading the torch_mgpu being
  # rebuilt (a stale or missing build of it would make `import torch` fail).
  local TORCH_DEVICE_BACKEND_AUTOLOAD=0
  export TORCH_DEVICE_BACKEND_AUTOLOAD
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

need_gtest() {
  if [ ! -f /usr/include/gtest/gtest.h ]; then
    if command -v apt-get >/dev/null; then
      (apt-get update -qq && apt-get install -y -qq libgtest-dev) >/dev/null 2>&1 || true
    fi
  fi
  [ -f /usr/include/gtest/gtest.h ] || { echo "GoogleTest is missing: apt-get install libgtest-dev"; exit 1; }
}

cpp_tests() {
  need_gtest
  cmake -S . -B build-tests -DCMAKE_BUILD_TYPE=Release -DTORCH_MGPU_BUILD_TESTS=ON -DTORCH_MGPU_BUILD_PYTHON=OFF \
    -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
  cmake --build build-tests -j "$(nproc)"
  (cd build-tests && ctest --output-on-failure)
}

# The core library as an installed CMake package, used by an outside
# project: installs what build-tests built (CMake alone, no Python), builds
# examples/cpp against the installed TorchMgpu package and runs them.
cpp_package() {
  local torch_prefix prefix="$ROOT/build-install"
  torch_prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  rm -rf "$prefix"
  cmake --install build-tests --prefix "$prefix" >/dev/null
  cmake -S examples/cpp -B build-examples -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix;$torch_prefix" >/dev/null
  cmake --build build-examples -j "$(nproc)"
  local exe
  for exe in hello train branches; do
    if ldd "build-examples/$exe" | grep -q libpython; then
      echo "examples/cpp: $exe links libpython"; exit 1
    fi
    echo "examples/cpp: $exe"
    "build-examples/$exe"
  done
}

# The C++ tests that run threads, built with ThreadSanitizer (every target of
# the project instrumented; libtorch, libc10 and libgomp are not, see
# test/tsan.supp). Any report fails the command, suppressed ones excepted.
# TORCH_MGPU_STRESS_SECONDS sets how long each stress test runs (default 3).
tsan() {
  need_gtest
  # Tests are listed when ctest runs, not at build time: a sanitized binary
  # never runs inside the build.
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTORCH_MGPU_SANITIZE=thread \
    -DTORCH_MGPU_BUILD_TESTS=ON -DTORCH_MGPU_BUILD_PYTHON=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST \
    -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
  local tests=(test_stress test_streams test_capture test_fusion)
  cmake --build build-tsan -j "$(nproc)" --target "${tests[@]}"
  # exitcode=66: a process that reported exits non-zero (at exit; with
  # halt_on_error=0 every report of a run is printed first).
  export TSAN_OPTIONS="suppressions=$ROOT/test/tsan.supp halt_on_error=0 second_deadlock_stack=1 history_size=4 exitcode=66 print_suppressions=1"
  # Each binary runs whole, its tests in one process: traces record, as
  # CTest runs them (running at the call is a choice by measured time, and
  # a trace made hot by one test would run the next test's ops at the call).
  export TORCH_MGPU_AT_CALL=off
  # Kernels with more ASLR bits than this TSAN runtime maps around refuse
  # to start it ("unexpected memory mapping"): run without randomization.
  local wrap=() probe
  probe=$(build-tsan/test_stress --gtest_list_tests 2>&1 || true)
  if grep -q "unexpected memory mapping" <<<"$probe"; then
    wrap=(setarch "$(uname -m)" -R)
    echo "tsan: this kernel's ASLR needs setarch -R"
  fi
  local log="$ROOT/build-tsan/tsan.log" failed=() t rc out
  : >"$log"
  for t in "${tests[@]}"; do
    out="$ROOT/build-tsan/tsan-$t.log"
    set +e
    ${wrap[@]+"${wrap[@]}"} "build-tsan/$t" >"$out" 2>&1
    rc=$?
    set -e
    cat "$out" >>"$log"
    grep -E "^\[ +(OK|FAILED|PASSED) +\]|^\[ stress" "$out" | sed "s/^/tsan: $t: /" || true
    # 66: TSAN reported (counted below); anything else non-zero, or a test
    # that failed, fails the command.
    if { [ "$rc" -ne 0 ] && [ "$rc" -ne 66 ]; } || grep -q "^\[  FAILED  \]" "$out" || ! grep -q "^\[  PASSED  \]" "$out"; then
      failed+=("$t (exit $rc)")
    fi
  done
  # Reports: PyTorch-internal ones (test/tsan.supp, "#@free_called_from:"
  # lines: a free that PyTorch's own uninstrumented code makes) are counted;
  # every other report is printed and fails the command.
  local counts reports internal suppressed
  counts=$(awk -v supp="$ROOT/test/tsan.supp" -v project="$ROOT/build-tsan/tsan-project.log" '
    BEGIN {
      while ((getline l < supp) > 0)
        if (l ~ /^#@free_called_from:/) { sub(/^#@free_called_from:[ \t]*/, "", l); libs[l] = 1 }
      printf "" > project
    }
    /^WARNING: ThreadSanitizer:/ { inrep = 1; first = 1; buf = ""; f0 = ""; f1 = ""; race = ($0 ~ /: data race/) }
    inrep { buf = buf $0 "\n" }
    inrep && first && /^ +#0 / { f0 = $0 }
    inrep && first && /^ +#1 / { f1 = $0 }
    inrep && /^$/ { first = 0 }
    inrep && /^SUMMARY: ThreadSanitizer:/ {
      inrep = 0; inside = 0
      if (race && f0 ~ /#0 (free|operator delete)/ && f0 ~ /libtsan/)
        for (lib in libs) if (index(f1, "(" lib "+0x") || index(f1, "/" lib "+0x")) inside = 1
      if (inside) internal++; else { reports++; printf "%s==================\n", buf >> project }
    }
    END { print reports + 0, internal + 0 }' "$log")
  read -r reports internal <<<"$counts"
  suppressed=$(awk '/^ThreadSanitizer: Matched [0-9]+ suppressions/ {s += $3} END {print s + 0}' "$log")
  [ "$reports" -eq 0 ] || cat "$ROOT/build-tsan/tsan-project.log"
  echo "tsan: $reports reports ($internal freed by PyTorch's uninstrumented code, $suppressed suppressed; log: build-tsan/tsan.log)"
  if [ "$reports" -ne 0 ] || [ "${#failed[@]}" -ne 0 ]; then
    [ "${#failed[@]}" -eq 0 ] || echo "tsan: failed: ${failed[*]}"
    exit 1
  fi
}

# Configures and builds the extension with CUDA against the torch of python
# $1, in build folder $2, the libraries going to $3. Shared by the compile-only
# check (no GPU here) and the GPU run, so that CI builds what a GPU machine runs.
cuda_build() {
  local py=$1 build=$2 out=$3 prefix site nvrtc suffix
  prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  nvrtc=$(ls "$site"/nvidia/cu*/lib/libnvrtc.so* "$site"/nvidia/cuda_nvrtc/lib/libnvrtc.so* 2>/dev/null | head -1 || true)
  suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DCUDA_TOOLKIT_ROOT_DIR="${CUDA_HOME:-/usr/local/cuda}" ${nvrtc:+-DCUDA_nvrtc_LIBRARY="$nvrtc"} \
    -DTORCH_MGPU_USE_CUDA=ON -DTORCH_MGPU_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$(command -v "$py")" \
    -DTORCH_MGPU_PY_SUFFIX="$suffix" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$out" >/dev/null
  cmake --build "$build" -j "$(nproc)"
  no_static_libstdcxx "$out/libtorch_mgpu.so"
}

# libstdc++'s own code (stream insertion, locales; mangled names, which every
# binutils reads alike) defined inside library $1 is a second libstdc++ beside
# the libstdc++.so.6 PyTorch loads: writing a number into a stream crashed
# there (cmake/SharedLibstdcxx.cmake).
no_static_libstdcxx() {
  local n
  n=$(nm -D --defined-only "$1" | grep -c -E ' (_ZNSo9_M_insert|_ZNSt6locale|_ZNSt7codecvt)' || true)
  echo "libstdc++ definitions inside $(basename "$1"): $n"
  [ "$n" -eq 0 ] || { echo "$1 holds a copy of libstdc++"; exit 1; }
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
  cuda_build "$venv/bin/python" build-cuda "$ROOT/build-cuda/lib"
  echo "CUDA compile check: built against torch 2.14.1 (CUDA 13)"
}

# On a machine with a GPU and a CUDA build of torch already installed (the
# lent GPU machines: python3 holds torch, nothing can be downloaded): builds
# the extension with CUDA against that torch, in place, runs the tests over
# the lanes' physical devices (CUDA stream lanes on every GPU, virtual devices
# over one GPU, cross-device copies, errors on a stream, random graphs,
# autograd, the seeds' workloads, replay as CUDA graphs), the device-interface
# tests and lanes on other ranks (a worker process on the same GPU:
# "rank1:cuda:0"), then the GPU benchmarks (benchmarks/RESULTS-gpu.md, written
# after each case). A lent machine's call is 10 minutes: on an H100 on
# 2026-11-28 the build took 3.5 and the files before test_remote 4.5
# (test_stream_sanitizer 100 s of them). So `gpu --quick` builds, runs the
# replay and GPU-tier tests, the benchmarks, then a few GPU files, and
# `gpu-tests` (TORCH_MGPU_GPU_BUILD=0: the build already there, a warm
# machine's next call) the files it left out. Each test file runs in a
# process of its own (a crash ends that file only; 300 s at most), with a
# native stack printed on a fatal signal (scripts/native_backtrace.c); logs
# go to build-gpu/logs. TORCH_MGPU_GPU_PYTHON picks another interpreter.
GPU_TESTS="test_tiers_gpu test_streams test_physical_devices test_parallel test_events test_memory test_accelerator
  test_faults test_autograd test_stream_sanitizer test_gpu_model test_lazy test_remote"
GPU_QUICK_TESTS="test_tiers_gpu test_streams test_physical_devices"
gpu_test_file() {
  local py=$1 f=$2 logs=$3 rc=0  # (set -e: a failing file must not end the run)
  LD_PRELOAD="$logs/native_backtrace.so" timeout 300 "$py" -m pytest -v -p no:cacheprovider -o faulthandler_timeout=120 -rfE "test/$f.py" \
    > "$logs/$f.log" 2>&1 || rc=$?
  echo "$f: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$logs/$f.log" | tail -1 || true) (exit $rc)"
  if [ $rc -ne 0 ]; then
    grep -E '^(FAILED|ERROR) ' "$logs/$f.log" | head -20 || true
    # -v names each test as it starts; faulthandler prints every thread's
    # stack of a test that runs past 120 s.
    [ $rc -ne 124 ] || echo "timed out in: $(grep -E '::test' "$logs/$f.log" | tail -1)"
    grep -A24 '=== native stack' "$logs/$f.log" | c++filt | head -30 || true
    return 1
  fi
}
# Checks the GPU, builds (unless TORCH_MGPU_GPU_BUILD=0), prints the lanes.
gpu_setup() {
  local py=$1 logs=$2
  export TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONUNBUFFERED=1
  "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    { echo "gpu: $py's torch sees no CUDA device"; exit 1; }
  "$py" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}): {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")'
  nvidia-smi -L 2>/dev/null || true
  echo "compiler: $(c++ --version | head -1)"
  [ "${TORCH_MGPU_GPU_BUILD:-1}" = 0 ] || cuda_build "$py" build-gpu "$ROOT/torch_mgpu"
  mkdir -p "$logs"
  cc -shared -fPIC -O1 -o "$logs/native_backtrace.so" "$ROOT/scripts/native_backtrace.c" || true
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  "$py" -c 'import torch_mgpu; torch_mgpu.configure(devices=["cuda:0"]); print("lanes:", torch_mgpu.lanes())'
}
gpu() {
  local py=${TORCH_MGPU_GPU_PYTHON:-python3} status=0 f logs="$ROOT/build-gpu/logs" quick=0 a
  for a in "$@"; do [ "$a" != --quick ] || quick=1; done
  gpu_setup "$py" "$logs"
  if [ $quick = 1 ]; then
    gpu_test_file "$py" test_tiers_gpu "$logs" || status=1
    "$py" benchmarks/gpu.py "$@" || status=1
    for f in $GPU_QUICK_TESTS; do
      [ "$f" = test_tiers_gpu ] || gpu_test_file "$py" "$f" "$logs" || status=1
    done
    echo "gpu --quick left out: $(gpu_left_out) (bash scripts/dev.sh gpu-tests)"
  else
    for f in $GPU_TESTS; do
      gpu_test_file "$py" "$f" "$logs" || status=1
    done
    "$py" benchmarks/gpu.py "$@" || status=1
  fi
  return $status
}
gpu_left_out() {
  local f out=()
  for f in $GPU_TESTS; do
    [[ " $GPU_QUICK_TESTS " == *" $f "* ]] || out+=("$f")
  done
  echo "${out[*]}"
}
gpu_tests() {
  local py=${TORCH_MGPU_GPU_PYTHON:-python3} status=0 f logs="$ROOT/build-gpu/logs"
  gpu_setup "$py" "$logs"
  for f in ${*:-$(gpu_left_out)}; do
    gpu_test_file "$py" "$f" "$logs" || status=1
  done
  return $status
}

cmd=${1:-test}
shift || true
# The lazy path's files again with tier 1 off (TORCH_MGPU_COMPILE=0, whose
# results are eager's bit for bit): the suite above runs the default, tier 1
# on, where a graph that syncs a third time may run compiled code.
tier0_tests() {
  TORCH_MGPU_COMPILE=0 "$PY" -m pytest -q test/test_lazy.py test/test_views.py test/test_autograd.py \
    test/test_random.py test/test_rng.py test/test_errors.py test/test_threads.py test/test_async.py \
    test/test_fusion.py test/test_parallel.py test/test_linalg.py test/test_memory.py test/test_difffuzz.py
}

case "$cmd" in
  setup) setup ;;
  demo) setup; "$PY" examples/demo.py "$@" ;;
  test) setup; cpp_tests; cpp_package; "$PY" -m pytest -q test "$@"; tier0_tests; "$PY" benchmarks/run.py --quick
        "$PY" benchmarks/gpu.py --device cpu --quick --no-compile --out benchmarks/out/RESULTS-gpu-dry-run.md ;;
  cpp-package) setup; cpp_tests; cpp_package ;;
  opinfo) setup; "$PY" test/opinfo_harness.py "$@" ;;
  bench) setup; "$PY" benchmarks/run.py "$@" ;;
  cuda-compile) cuda_compile ;;
  gpu) gpu "$@" ;;
  gpu-tests) gpu_tests "$@" ;;
  tsan) setup; tsan ;;
  fuzz) setup; "$PY" test/difffuzz.py --seconds "${1:-3600}" "${@:2}" ;;
  *) echo "usage: $0 {setup|demo|test|cpp-package|opinfo|bench|cuda-compile|gpu|gpu-tests|tsan|fuzz [SECONDS]}"; exit 2 ;;
esac
