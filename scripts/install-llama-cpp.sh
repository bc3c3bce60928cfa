#!/usr/bin/env bash
# Install llama-cpp-python built the right way for this machine.
#
#   jetson : Jetson (L4T) board -> CUDA build for sm_87 with the flash-attention
#            kernels for every KV quant type (GGML_CUDA_FA_ALL_QUANTS), using
#            /usr/local/cuda/bin/nvcc explicitly: without CUDACXX the build
#            silently comes out CPU-only.
#   cuda   : nvcc and an NVIDIA driver present -> CUDA build for the local GPU.
#   cpu    : anything else -> CPU build (pip reuses its cached wheel).
#
# Usage: scripts/install-llama-cpp.sh [--python PY] [--mode auto|jetson|cuda|cpu] [--dry-run]
# Environment: LLAMA_CPP_PYTHON_VERSION (default below), ORIN_LLM_BUILD (same as
# --mode), ORIN_LLM_SYSROOT (root for board detection; tests point it at a fake tree).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
MODE="${ORIN_LLM_BUILD:-auto}"
PYTHON="${PYTHON:-python3}"
ROOT="${ORIN_LLM_SYSROOT:-}"
DRY_RUN=0

while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --mode) MODE="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
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

if [ "$MODE" = auto ]; then
  if is_jetson; then MODE=jetson
  elif find_nvcc >/dev/null && has_nvidia_driver; then MODE=cuda
  else MODE=cpu
  fi
fi

PIP_ARGS=(install "llama-cpp-python==$VERSION")
case "$MODE" in
  jetson)
    NVCC="$ROOT/usr/local/cuda/bin/nvcc"
    export CUDACXX="$NVCC"
    export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87 -DGGML_CUDA_FA_ALL_QUANTS=ON -DGGML_NATIVE=OFF"
    export FORCE_CMAKE=1
    # a cached CPU wheel of the same version must not be reused
    PIP_ARGS+=(--no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python)
    WANT_GPU=1 ;;
  cuda)
    NVCC="$(find_nvcc)"
    export CUDACXX="$NVCC"
    ARCH="native"
    if command -v nvidia-smi >/dev/null 2>&1; then
      CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
      [ -n "$CAP" ] && ARCH="$CAP"
    fi
    export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DGGML_CUDA_FA_ALL_QUANTS=ON"
    export FORCE_CMAKE=1
    PIP_ARGS+=(--no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python)
    WANT_GPU=1 ;;
  cpu)
    PIP_ARGS+=(--no-binary llama-cpp-python)
    WANT_GPU=0 ;;
  *) echo "install-llama-cpp: unknown mode '$MODE' (auto, jetson, cuda, cpu)" >&2; exit 2 ;;
esac

echo "install-llama-cpp: mode=$MODE version=$VERSION"
[ -n "${CUDACXX:-}" ] && echo "install-llama-cpp: CUDACXX=$CUDACXX"
[ -n "${CMAKE_ARGS:-}" ] && echo "install-llama-cpp: CMAKE_ARGS=$CMAKE_ARGS"
echo "install-llama-cpp: $PYTHON -m pip ${PIP_ARGS[*]}"
[ "$DRY_RUN" = 1 ] && exit 0

installed_ok() {
  "$PYTHON" - "$VERSION" "$WANT_GPU" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
want, want_gpu = sys.argv[1], sys.argv[2] == "1"
if version("llama-cpp-python") != want:
    sys.exit(1)
import llama_cpp
sys.exit(0 if bool(llama_cpp.llama_supports_gpu_offload()) == want_gpu else 1)
PY
}

if installed_ok; then
  echo "install-llama-cpp: llama-cpp-python $VERSION ($MODE) already installed"
  exit 0
fi

CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" "$PYTHON" -m pip "${PIP_ARGS[@]}"
# --no-deps above skips numpy & co. on GPU rebuilds; make sure they are there
"$PYTHON" -m pip install -q "llama-cpp-python==$VERSION"

if ! installed_ok; then
  echo "install-llama-cpp: the installed build does not match mode '$MODE'" >&2
  "$PYTHON" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())' >&2 || true
  exit 1
fi
"$PYTHON" -c 'import llama_cpp; print("install-llama-cpp: gpu_offload=%s" % llama_cpp.llama_supports_gpu_offload())'
