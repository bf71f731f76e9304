#!/usr/bin/env bash
# Idempotent setup: .venv/ with pinned upstream SGLang, our patch series and modules applied,
# and our operator package (sgl-kernel/) built and installed.
# Run through `make setup`. Re-running does only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
SGLANG_VERSION=0.5.23
VENV=${VENV:-$REPO/.venv}
PY=$VENV/bin/python
export PIP_CONSTRAINT=$REPO/requirements/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK=1
PIP="$PY -m pip -q"
CACHE=$REPO/.cache
mkdir -p "$CACHE"

has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if [ ! -x "$PY" ]; then
  echo "== creating $VENV"
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi

# 1. Dependencies (skipped when the requirement files are unchanged since the last install).
if has_cuda; then REQ=(requirements/cuda.txt requirements/test.txt); unset PIP_CONSTRAINT; else REQ=(requirements/constraints.txt requirements/cpu.txt requirements/test.txt); fi
req_hash=$(cat "${REQ[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.req-stamp" 2>/dev/null)" != "$req_hash" ]; then
  echo "== installing dependencies (${REQ[*]})"
  if has_cuda; then
    $PIP install -r requirements/cuda.txt -r requirements/test.txt
  else
    $PIP install torch==2.13.0
    $PIP install -r requirements/cpu.txt -r requirements/test.txt
  fi
  echo "$req_hash" > "$VENV/.req-stamp"
fi

# 2. Pristine upstream wheel (kept in .cache for check-patches), installed without its CUDA pins.
WHEEL=$(ls "$CACHE"/wheels/sglang-$SGLANG_VERSION-*.whl 2>/dev/null | head -1 || true)
if [ -z "$WHEEL" ]; then
  echo "== downloading sglang==$SGLANG_VERSION"
  $PY -m pip download -q --no-deps -d "$CACHE/wheels" "sglang==$SGLANG_VERSION"
  WHEEL=$(ls "$CACHE"/wheels/sglang-$SGLANG_VERSION-*.whl | head -1)
fi
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
installed=$($PY -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true)
state=$($PY scripts/patch_queue.py status --site-packages "$SITE" 2>/dev/null || echo missing)
if [ "$installed" != "$SGLANG_VERSION" ] || [ "$state" = stale ] || [ ! -d "$SITE/sglang" ]; then
  echo "== installing pristine sglang==$SGLANG_VERSION (--no-deps)"
  rm -rf "$SITE/sglang"  # drops patched files, the series stamp and our module links
  $PIP install --force-reinstall --no-deps "$WHEEL"
fi

# 3. Patch series and our modules.
$PY scripts/patch_queue.py apply --site-packages "$SITE"

# Content hash of our kernel sources: a change rebuilds the installed ops.
kernel_hash=$(find sgl-kernel -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' | sort | xargs cat | sha256sum | cut -c1-16)

# 4. sgl-kernel/: the fork's operator package `sgl_kernel_fork` (CPU ops; on a CUDA machine also
#    its CUDA sources, compiled with nvcc). On a CPU-only machine the install adds the alias
#    `sgl_kernel`, the name upstream imports for its CPU ops; on a CUDA machine upstream's
#    sglang-kernel keeps that name and both packages load side by side (sgl-kernel/setup.py).
if has_cuda; then
  export SGL_KERNEL_FORK_ALIAS=0 SGL_KERNEL_BUILD_CUDA=1
else
  export SGL_KERNEL_FORK_ALIAS=1
fi
if $PY - <<'PYEOF'
import os, sys
try:
    import torch, sgl_kernel_fork  # noqa: F401
    ok = hasattr(torch.ops.sgl_kernel, "expert_cache_control")
    if os.environ["SGL_KERNEL_FORK_ALIAS"] == "1":
        import sgl_kernel
        ok = ok and sgl_kernel.ops is sgl_kernel_fork.ops  # the alias, not another sgl_kernel
    else:
        ok = ok and torch._C._dispatch_has_kernel_for_dispatch_key(
            "sgl_kernel::expert_cache_control", "CUDA")
except Exception:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
then
  if [ "$(cat "$VENV/.sgl-kernel-stamp" 2>/dev/null)" != "$kernel_hash" ]; then
    rebuild=1
  else
    rebuild=0
  fi
else
  rebuild=1
fi
if [ "$rebuild" = 1 ]; then
  # setuptools packs everything under build/lib.*: files of an earlier layout or of the other
  # machine kind (the CPU-only alias) must not ride along.
  rm -rf sgl-kernel/build/lib.* sgl-kernel/build/bdist.* sgl-kernel/python/*.egg-info
  echo "== building sgl-kernel/ (sgl_kernel_fork$(has_cuda && echo ': CPU ops + CUDA sources' || echo ' + its sgl_kernel alias: CPU ops'))"
  MAX_JOBS=${MAX_JOBS:-$(has_cuda && echo 8 || echo 2)} $PIP install --no-build-isolation --no-deps ./sgl-kernel
  echo "$kernel_hash" > "$VENV/.sgl-kernel-stamp"
fi
echo "== setup done: $PY"
