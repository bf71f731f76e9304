#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (run from the repository root; ~5 min).
# Builds sgl-kernel in place with the machine's CUDA torch and toolkit, then runs the GPU tests:
# the control op and bank copy against the CPU ops (CUDA-graph replay included), the CPU
# branch as copy + host function + copy, eager and captured in a CUDA graph, and (when sglang
# is importable) whole layer calls of the cache on CUDA against the CPU cache; then the control
# op's timing on the device; then the anchor-checkpoint e2e test on CUDA when sglang is set up.
# Prints everything; record the output in the issue note.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY - <<'PY'
import torch, sys
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())
sys.exit(0 if torch.cuda.is_available() else 1)
PY
[ $? -eq 0 ] || { echo "no CUDA torch here"; exit 1; }
# In place: sgl-kernel/python holds only sgl_kernel_fork (the CPU-only `sgl_kernel` alias lives in
# sgl-kernel/alias and is not built with CUDA torch), so upstream's sgl_kernel is not shadowed.
(cd sgl-kernel && SGL_KERNEL_BUILD_CUDA=1 $PY setup.py build_ext --inplace -j 16 2>&1 | tail -5)
export PYTHONPATH=$PWD/sgl-kernel/python:$PWD/python:${PYTHONPATH:-}
$PY -c "import sgl_kernel_fork, torch; print('sgl_kernel_fork', sgl_kernel_fork.__file__, 'cuda op', torch._C._dispatch_has_kernel_for_dispatch_key('sgl_kernel::expert_cache_control', 'CUDA'))"
$PY -c "import sgl_kernel, sgl_kernel_fork; print('upstream sgl_kernel beside it:', sgl_kernel.__file__)" 2>&1 | tail -1
$PY -c "import sgl_kernel_fork._C_cuda" || { echo "FAILED: sgl_kernel_fork._C_cuda did not build; every CUDA test would skip"; exit 1; }
$PY -m pytest -q -ra test/expert_cache/test_cuda_op.py test/expert_cache/test_cuda_cache.py test/expert_cache/test_cuda_sources.py 2>&1 | tail -25
$PY benchmark/expert_cache/bench_control.py --device cuda 2>&1 | tail -8
# Anchor checkpoints on CUDA (same code path as the CPU, CUDA kernels): the e2e test starts the
# tiny hybrid model through scripts/serve.sh, which runs on CUDA when nvidia-smi sees a GPU.
# Needs sglang importable by $PY (make setup on the GPU machine); skipped otherwise.
if $PY -c "import sglang.srt.mem_cache.anchor_checkpoints" 2>/dev/null; then
  timeout 420 $PY -m pytest -q -x -s test/e2e/test_anchor_checkpoints.py 2>&1 | grep -E "cached_off|anchor metrics|passed|failed|Error" | tail -15
else
  echo "anchor e2e skipped: sglang (patched) not importable by $PY; run make setup first"
fi
