#!/usr/bin/env bash
# From a fresh JetPack 6 board to orin-llm serving as a systemd service.
#
#   1. apt packages (Python venv and headers, compilers, CMake; CUDA if missing)
#   2. a venv at PREFIX/venv (default /opt/orin-llm/venv, outside any home folder
#      so the hardened service can read it)
#   3. llama-cpp-python built for the board (scripts/install-llama-cpp.sh: CUDA, sm_87)
#   4. orin-llm itself, from this checkout, into the venv
#   5. orin-llm doctor for the profile (stops on a fail unless --force)
#   6. orin-llm install: the hardened unit, boot-time tuning, start, wait for /health
#
# Every step checks first and does nothing when already done, so running it
# again is safe. --dry-run prints the plan and changes nothing.
#
# Usage: sudo scripts/setup-orin.sh [--profile P] [--prefix DIR] [--user NAME]
#                                   [--port N] [--force] [--dry-run]
# Environment: ORIN_LLM_SYSROOT (root for board detection; tests point it at a
# fake tree), PYTHON (interpreter for the venv, default python3),
# CUDA_PACKAGE (apt package providing nvcc, default nvidia-cuda-dev).
set -euo pipefail

SRC="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="${ORIN_LLM_SYSROOT:-}"
PYTHON="${PYTHON:-python3}"
CUDA_PACKAGE="${CUDA_PACKAGE:-nvidia-cuda-dev}"
PREFIX="$ROOT/opt/orin-llm"
PROFILE=demo
INSTALL_ARGS=()
FORCE=0
DRY_RUN=0
PACKAGES=(python3-venv python3-dev python3-pip build-essential cmake git)

while [ $# -gt 0 ]; do
  case "$1" in
    --profile) PROFILE="$2"; shift 2 ;;
    --prefix) PREFIX="$2"; shift 2 ;;
    --user|--port) INSTALL_ARGS+=("$1" "$2"); shift 2 ;;
    --force) FORCE=1; INSTALL_ARGS+=(--force); shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) echo "setup-orin: unknown argument: $1" >&2; exit 2 ;;
  esac
done

VENV="$PREFIX/venv"
ORIN="$VENV/bin/orin-llm"

say() { echo "setup-orin: $*"; }

# Run a step's command, or only show it under --dry-run.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    say "  would run: $*"
  else
    say "  run: $*"
    "$@"
  fi
}

check_board() {
  local release="$ROOT/etc/nv_tegra_release"
  if [ ! -f "$release" ]; then
    say "WARNING: no $release: not a Jetson; continuing (CPU build)"
    JETSON=0
    return
  fi
  JETSON=1
  local l4t
  l4t="$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1.\2/p' "$release" | head -n1)"
  case "$l4t" in
    36.*) say "board: Jetson, L4T $l4t (JetPack 6)" ;;
    *) say "WARNING: L4T ${l4t:-unknown} is not JetPack 6 (L4T 36); continuing" ;;
  esac
}

missing_packages() {
  local pkg
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || echo "$pkg"
  done
  if [ "$JETSON" = 1 ] && [ ! -x "$ROOT/usr/local/cuda/bin/nvcc" ]; then
    echo "$CUDA_PACKAGE"
  fi
}

step_packages() {
  say "[1/6] apt packages"
  local missing; missing="$(missing_packages | tr '\n' ' ')"
  if [ -z "${missing// /}" ]; then
    say "  ok: ${PACKAGES[*]} installed"
    return
  fi
  run apt-get update
  # shellcheck disable=SC2086  # one word per package
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
}

step_venv() {
  say "[2/6] venv $VENV"
  if [ -x "$VENV/bin/python" ]; then
    say "  ok: exists"
    return
  fi
  run "$PYTHON" -m venv "$VENV"
  run "$VENV/bin/python" -m pip install -q --upgrade pip wheel
}

step_llama() {
  say "[3/6] llama-cpp-python built for this board"
  local want_gpu="$JETSON"
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$want_gpu" <<'PY' 2>/dev/null; then
import ctypes, os, sys
import llama_cpp
if sys.argv[1] == "0":
    sys.exit(0)
# a GPU device in ggml's registry (llama_supports_gpu_offload() is true for any
# build with the RPC backend, so it cannot tell a CPU-only build)
lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
g = ctypes.CDLL(next(os.path.join(lib, n) for n in ("libggml.so.0", "libggml.so") if os.path.exists(os.path.join(lib, n))))
g.ggml_backend_dev_count.restype = ctypes.c_size_t
g.ggml_backend_dev_get.argtypes, g.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
g.ggml_backend_dev_type.argtypes, g.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
sys.exit(0 if any(g.ggml_backend_dev_type(g.ggml_backend_dev_get(i)) in (1, 2) for i in range(g.ggml_backend_dev_count())) else 1)
PY
    say "  ok: installed$([ "$want_gpu" = 1 ] && echo ' with GPU offload')"
    return
  fi
  if [ "$DRY_RUN" = 1 ]; then
    PYTHON="$VENV/bin/python" bash "$SRC/scripts/install-llama-cpp.sh" --dry-run | sed 's/^/setup-orin:   /'
  else
    PYTHON="$VENV/bin/python" bash "$SRC/scripts/install-llama-cpp.sh"
  fi
}

step_orin() {
  say "[4/6] orin-llm from $SRC"
  local want; want="$(sed -n 's/^version = "\(.*\)"/\1/p' "$SRC/pyproject.toml" | head -n1)"
  if [ -x "$ORIN" ] && [ "$("$ORIN" --version 2>/dev/null)" = "orin-llm $want" ]; then
    say "  ok: orin-llm $want installed"
    return
  fi
  run "$VENV/bin/python" -m pip install -q "$SRC"
}

# The profile's model.hf (owner/repo:file), read from its YAML: a file given by path
# or a built-in profile of this source tree; empty when it names no hub model.
profile_hf() {
  local file="$PROFILE"
  [ -f "$file" ] || file="$SRC/profiles/$PROFILE.yaml"
  [ -f "$file" ] || return 0
  sed -n 's/^[[:space:]]*hf:[[:space:]]*["'"'"']\{0,1\}\([^"'"'"' #]*\).*/\1/p' "$file" | head -n1
}

step_doctor() {
  say "[5/6] orin-llm doctor --profile $PROFILE"
  if [ "$PROFILE" = demo ]; then  # install reads the demo model's metadata
    run "$ORIN" model demo --size small --quant q4_k_m
  fi
  local hf; hf="$(profile_hf)"
  if [ -n "$hf" ]; then  # a hub model: doctor and install read the pulled file
    run "$ORIN" model pull "$hf"
  fi
  if [ "$DRY_RUN" = 1 ]; then
    run "$ORIN" doctor --profile "$PROFILE"
    return
  fi
  say "  run: $ORIN doctor --profile $PROFILE"
  if ! "$ORIN" doctor --profile "$PROFILE"; then
    if [ "$FORCE" = 1 ]; then
      say "  doctor found problems; going on (--force)"
    else
      say "doctor found problems: fix them (the report says how) or rerun with --force" >&2
      exit 1
    fi
  fi
}

step_install() {
  say "[6/6] orin-llm install"
  run "$ORIN" install --profile "$PROFILE" "${INSTALL_ARGS[@]}"
}

if [ "$DRY_RUN" = 0 ] && [ "$(id -u)" != 0 ]; then
  echo "setup-orin: installs packages and a system service: run it with sudo (or --dry-run)" >&2
  exit 2
fi
check_board
step_packages
step_venv
step_llama
step_orin
step_doctor
step_install
if [ "$DRY_RUN" = 1 ]; then
  say "dry run: nothing was changed"
else
  say "done: orin-llm status shows the service; docs/install.md explains it"
fi
