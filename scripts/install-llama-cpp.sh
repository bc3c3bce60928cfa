#!/usr/bin/env bash
# Install llama-cpp-python built the right way for this machine.
#
#   jetson : Jetson (L4T) board -> CUDA build for sm_87 with the flash-attention
#            kernels for every K/V type pair (GGML_CUDA_FA_QUANTS=all), the CPU
#            side for the Cortex-A78AE (armv8.2-a+dotprod+fp16), using
#            /usr/local/cuda/bin/nvcc explicitly: without CUDACXX the build
#            silently comes out CPU-only.
#   cuda   : nvcc and an NVIDIA driver present -> CUDA build for the local GPU.
#   cpu    : anything else -> CPU build.
#
# On x86-64 the CPU backend is built for this CPU (-march=native) with AMX
# switched off (-mno-amx-tile/-int8/-bf16): llama.cpp's AMX kernels crash on
# the first quantized decode on Sapphire Rapids and later
# (ggml_backend_amx_mul_mat). The built wheel is kept in a cache folder named
# after the version, the build options and the CPU, so a rebuild happens only
# when one of them changes (pip's own cache keys an sdist build by its URL
# alone and would hand back a wheel built with other options). After installing, one short
# generation of a quantized model runs in a subprocess; a crash there fails
# the install with the cause.
#
# Every mode also builds ggml's RPC backend (-DGGML_RPC=ON): `orin-llm
# rpc-worker` and `orin-llm serve --rpc` spread one model across boards with it.
# It is on by default because it only adds a backend that has no devices until
# servers are added (a run without --rpc is unchanged) and so `make test` runs
# the loopback RPC tests on every machine; --no-rpc (ORIN_LLM_RPC=0) leaves it out.
#
# Usage: scripts/install-llama-cpp.sh [--python PY] [--mode auto|jetson|cuda|cpu] [--no-rpc] [--dry-run]
# Environment: LLAMA_CPP_PYTHON_VERSION (default below), ORIN_LLM_BUILD (same as
# --mode), ORIN_LLM_RPC (1 by default; 0 is --no-rpc), ORIN_LLM_SYSROOT (root for
# board and CPU detection; tests point it at a fake tree), ORIN_LLM_ARCH (instead
# of `uname -m`), ORIN_LLM_WHEEL_CACHE (default ~/.cache/orin-llm/wheels).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
MODE="${ORIN_LLM_BUILD:-auto}"
PYTHON="${PYTHON:-python3}"
ROOT="${ORIN_LLM_SYSROOT:-}"
ARCH_NAME="${ORIN_LLM_ARCH:-$(uname -m)}"
WHEEL_CACHE="${ORIN_LLM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orin-llm/wheels}"
RPC="${ORIN_LLM_RPC:-1}"
DRY_RUN=0

while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --mode) MODE="$2"; shift 2 ;;
    --no-rpc) RPC=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "install-llama-cpp: unknown argument: $1" >&2; exit 2 ;;
  esac
done

is_jetson() {
  [ -f "$ROOT/etc/nv_tegra_release" ] && return 0
  [ -r "$ROOT/proc/device-tree/compatible" ] && tr '\0' '\n' < "$ROOT/proc/device-tree/compatible" | grep -q '^nvidia,tegra' && return 0
  return 1
}

find_nvcc() {
  if [ -x "$ROOT/usr/local/cuda/bin/nvcc" ]; then echo "$ROOT/usr/local/cuda/bin/nvcc"; return 0; fi
  command -v nvcc 2>/dev/null && return 0
  return 1
}

has_nvidia_driver() {
  [ -r "$ROOT/proc/driver/nvidia/version" ] && return 0
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && return 0
  return 1
}

# The CPU backend's options.
# x86-64: -march=native (every SIMD extension and the tuning of this CPU) with
# the AMX extensions switched off explicitly: GCC and Clang let an explicit
# -mno-amx-* win over -march, so __AMX_INT8__ stays undefined and ggml compiles
# no AMX kernels (they crash on the first quantized decode on Sapphire Rapids
# and later). A compiler that does not know -mno-amx-int8 cannot emit AMX code
# either. (Switching each GGML_* option on from /proc/cpuinfo with
# GGML_NATIVE=OFF also avoids AMX, but loses -mtune and the rest of -march:
# Q4_K_M decoding measured 7-12 % slower on an AMD EPYC, docs/performance.md.)
# arm64: the Orin's Cortex-A78AE (ARMv8.2-A with dot product and fp16).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cpu_options() {
  case "$ARCH_NAME" in
    x86_64|amd64)
      CPU_CMAKE="-DGGML_NATIVE=ON"
      # shellcheck disable=SC2086
      if echo | "${CC:-cc}" $NO_AMX -x c -E - >/dev/null 2>&1; then CPU_CFLAGS="$NO_AMX"; else CPU_CFLAGS=""; fi
      # a native build is this CPU's: its identity goes into the build key
      CPU_ID="$(grep -m1 -e '^model name' "$ROOT/proc/cpuinfo" 2>/dev/null; grep -m1 '^flags' "$ROOT/proc/cpuinfo" 2>/dev/null || true)" ;;
    aarch64|arm64)
      CPU_CMAKE="-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16"; CPU_CFLAGS=""; CPU_ID="" ;;
    *)
      CPU_CMAKE="-DGGML_NATIVE=OFF"; CPU_CFLAGS=""; CPU_ID="" ;;
  esac
}

if [ "$MODE" = auto ]; then
  if is_jetson; then MODE=jetson
  elif find_nvcc >/dev/null && has_nvidia_driver; then MODE=cuda
  else MODE=cpu
  fi
fi

[ "$MODE" = jetson ] && ARCH_NAME=aarch64
cpu_options
case "$MODE" in
  jetson)
    export CUDACXX="$ROOT/usr/local/cuda/bin/nvcc"
    CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87 -DGGML_CUDA_FA_QUANTS=all $CPU_CMAKE"
    WANT_GPU=1 ;;
  cuda)
    CUDACXX="$(find_nvcc)"
    export CUDACXX
    ARCH="native"
    if command -v nvidia-smi >/dev/null 2>&1; then
      CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
      [ -n "$CAP" ] && ARCH="$CAP"
    fi
    CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DGGML_CUDA_FA_QUANTS=all $CPU_CMAKE"
    WANT_GPU=1 ;;
  cpu)
    CMAKE_ARGS="$CPU_CMAKE"
    WANT_GPU=0 ;;
  *) echo "install-llama-cpp: unknown mode '$MODE' (auto, jetson, cuda, cpu)" >&2; exit 2 ;;
esac
case "$RPC" in
  1) CMAKE_ARGS="$CMAKE_ARGS -DGGML_RPC=ON" ;;
  0) ;;
  *) echo "install-llama-cpp: ORIN_LLM_RPC must be 0 or 1, not '$RPC'" >&2; exit 2 ;;
esac
export CMAKE_ARGS FORCE_CMAKE=1
# CMake takes its initial C/C++ flags from CFLAGS/CXXFLAGS
export CFLAGS="${CPU_CFLAGS}${CFLAGS:+ $CFLAGS}" CXXFLAGS="${CPU_CFLAGS}${CXXFLAGS:+ $CXXFLAGS}"

# The build's identity: version, mode and options. pip's own wheel cache keys an
# sdist build by its URL alone and would hand back a wheel built with other options.
BUILD_KEY="$(printf '%s|%s|%s|%s|%s' "$VERSION" "$MODE" "$CMAKE_ARGS" "$CFLAGS" "$CPU_ID" | sha256sum | cut -c1-16)"
WHEEL_DIR="$WHEEL_CACHE/llama_cpp_python-$VERSION-$MODE-$BUILD_KEY"
PIP_WHEEL=(wheel --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$WHEEL_DIR" "llama-cpp-python==$VERSION")

echo "install-llama-cpp: mode=$MODE version=$VERSION arch=$ARCH_NAME"
[ -n "${CUDACXX:-}" ] && echo "install-llama-cpp: CUDACXX=$CUDACXX"
echo "install-llama-cpp: CMAKE_ARGS=$CMAKE_ARGS"
echo "install-llama-cpp: CFLAGS=$CFLAGS"
echo "install-llama-cpp: build $BUILD_KEY, wheel cache $WHEEL_DIR"
echo "install-llama-cpp: $PYTHON -m pip ${PIP_WHEEL[*]}"
[ "$DRY_RUN" = 1 ] && exit 0

# Where the installed build's key is recorded (inside the environment).
KEY_FILE="$("$PYTHON" -c 'import sys; print(sys.prefix)')/.orin-llm-llama-build"

# Whether the build sees a local GPU: a GPU or integrated-GPU device in ggml's
# registry. (llama_supports_gpu_offload() is true for every build with the RPC
# backend, since workers can be added at run time, so it cannot tell.)
LOCAL_GPU_PY='import ctypes, os, llama_cpp
lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
g = ctypes.CDLL(next(os.path.join(lib, n) for n in ("libggml.so.0", "libggml.so") if os.path.exists(os.path.join(lib, n))))
g.ggml_backend_dev_count.restype = ctypes.c_size_t
g.ggml_backend_dev_get.argtypes, g.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
g.ggml_backend_dev_type.argtypes, g.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
local_gpu = any(g.ggml_backend_dev_type(g.ggml_backend_dev_get(i)) in (1, 2) for i in range(g.ggml_backend_dev_count()))'

installed_ok() {
  [ -f "$KEY_FILE" ] && [ "$(cat "$KEY_FILE")" = "$BUILD_KEY" ] || return 1
  "$PYTHON" - "$VERSION" "$WANT_GPU" 2>/dev/null <<PY
import sys
from importlib.metadata import version
want, want_gpu = sys.argv[1], sys.argv[2] == "1"
if version("llama-cpp-python") != want:
    sys.exit(1)
$LOCAL_GPU_PY
sys.exit(0 if local_gpu == want_gpu else 1)
PY
}

# One short generation of a quantized model in its own process: a build whose
# kernels crash on this CPU fails here, with the cause, not later in a test.
smoke_test() {
  local rc=0 out
  out="$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m orin.model.smoke 2>&1)" || rc=$?
  if [ "$rc" = 0 ]; then
    echo "install-llama-cpp: $out"
    return 0
  fi
  if [ "$rc" -gt 128 ]; then
    echo "install-llama-cpp: the llama.cpp build crashed on its first quantized decode (signal $((rc - 128)): $(kill -l $((rc - 128)) 2>/dev/null || echo '?')); on an Intel CPU with AMX see docs/troubleshooting.md (cpu-kernels)" >&2
  else
    echo "install-llama-cpp: the llama.cpp build failed its smoke test: $(printf '%s\n' "$out" | tail -n1)" >&2
  fi
  return 1
}

if installed_ok; then
  echo "install-llama-cpp: llama-cpp-python $VERSION ($MODE, build $BUILD_KEY) already installed"
else
  if ! ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEEL_DIR"
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" "$PYTHON" -m pip "${PIP_WHEEL[@]}"
  fi
  WHEEL="$(ls "$WHEEL_DIR"/llama_cpp_python-*.whl | head -n1)"
  "$PYTHON" -m pip install -q --force-reinstall --no-deps "$WHEEL"
  # --no-deps above skips numpy & co.; the project's model writer needs gguf
  "$PYTHON" -m pip install -q "$WHEEL" "$(grep -m1 -o '"gguf[>=<][^"]*"' "$REPO/pyproject.toml" | tr -d '"')"
  if ! "$PYTHON" -c 'import llama_cpp' 2>/dev/null; then
    echo "install-llama-cpp: llama_cpp does not import after installing $WHEEL" >&2
    exit 1
  fi
  printf '%s\n' "$BUILD_KEY" > "$KEY_FILE"
  if ! installed_ok; then
    echo "install-llama-cpp: the installed build does not match mode '$MODE'" >&2
    "$PYTHON" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())' >&2 || true
    rm -f "$KEY_FILE"
    exit 1
  fi
fi
if ! smoke_test; then
  rm -f "$KEY_FILE"
  exit 1
fi
"$PYTHON" -c "$LOCAL_GPU_PY"'
print("install-llama-cpp: gpu_offload=%s" % local_gpu); print("install-llama-cpp: " + llama_cpp.llama_print_system_info().decode().strip())'
