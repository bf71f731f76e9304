#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (run from anywhere in the repository).
#
#   bash scripts/gpu_checks.sh            # preflight, then every step below
#   bash scripts/gpu_checks.sh --dry-run  # preflight only: every missing piece, then the plan
#   GPU_CHECKS_STEPS="tests bench" bash scripts/gpu_checks.sh   # a rerun of some steps
#
# That machine (/work/.library/device/KINDS.md) has python3 with CUDA torch, Triton, nvcc,
# pytest and hypothesis, and no package registry: sglang==0.5.23 and the few packages our
# modules and upstream's imported parts need travel as wheels in .gpu-wheels/ (`make gpu-wheels`
# here; name .gpu-wheels in the device call's carry). Upstream's CUDA kernel wheel (~1.5 GB)
# cannot travel, so no server runs there: the checks are our ops, our cache and upstream's
# Triton fused MoE, with sglang/test/bare_fused_moe.py standing in for the glue ops of that
# wheel (listed in the summary).
#
# Preflight collects every missing piece (no GPU, torch without CUDA, no nvcc, missing or
# mismatched wheels, no patch(1) or C++ compiler) and stops with the list. Then, each step under
# its own timeout and all of them under GPU_CHECKS_BUDGET seconds (default 540, so one call of
# the device tool's 600 s holds it; a step that would not fit is skipped, saying so):
#   install  the wheels into $GPU_SITE (/tmp/site) with pip --no-index --no-deps   (fatal)
#   apply    our patch series and module links onto it (scripts/patch_queue.py)     (fatal)
#   build    sgl_kernel_fork in place with its CUDA sources, for this GPU's arch    (fatal)
#   tests    a probe that C++ exceptions raise (a CPU op's, a CUDA op's) beside upstream's
#            imports, then one pytest process per file (a native crash loses that file only and is rerun under
#            gdb, where there is one, for its backtrace; GPU_CHECKS_TESTS names other files):
#            test_cuda_op.py (control op, bank copy, CPU branch eager and in a CUDA graph),
#            test_cuda_cache.py (whole layer calls on CUDA against the CPU cache, eager and in
#            one CUDA graph; no-slot fallback), test_cuda_sources.py, the Triton slot path on
#            real bf16 (test_triton_slot_path.py), banks pinned while a pack is read
#            (test_cuda_pack_pin.py), anchor-checkpoint states emitted by upstream's Triton GDN
#            chunk kernel and the conv rows against a pass ending there (patch 0048,
#            test_gdn_emit_triton.py); a skipped test counts as a failure here
#   control  benchmark/expert_cache/bench_control.py --device cuda
#   step     benchmark/expert_cache/bench_gpu_step.py (Qwen3.6-35B-A3B shapes, eager + graph)
#   prefill  benchmark/expert_cache/bench_prefill_stream.py --device cuda (the prefill double
#            buffer: outputs against the CPU cache, transfer_bound_ratio; exits 1 on any mismatch)
# Estimated (not yet run there): ~1.5 min build, ~2 min tests (the GDN emit file: seconds after
# Triton's first compile of the chain, well under a minute), ~3 min benchmarks, ~1.5 min
# prefill (a 6.4 GB pool filled and pinned; past the default budget it is skipped, saying so).
# Writes $OUT/summary.txt (a line per step and the benchmarks' last lines) and $OUT/log.txt
# (everything), $OUT being the device tool's output folder, else .gpu-checks/. Exit 0 when
# every step passed, 1 when one failed, 2 when preflight found a missing piece. Each later GPU
# path adds its check here.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$REPO/.gpu-wheels}
SITE=${GPU_SITE:-/tmp/site}
OUTDIR=${OUT:-$REPO/.gpu-checks}
BUDGET=${GPU_CHECKS_BUDGET:-540}
STEPS=${GPU_CHECKS_STEPS:-install apply build tests control step prefill}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$OUTDIR"
SUMMARY=$OUTDIR/summary.txt
LOG=$OUTDIR/log.txt
: >"$SUMMARY"
: >"$LOG"
START=$SECONDS
say() { echo "$*" | tee -a "$SUMMARY" "$LOG"; }

# ------------------------------------------------------------------------------- preflight
problems=()
say "gpu_checks $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  problems+=("no GPU: nvidia-smi is not on PATH (run this on the lent GPU machine)")
elif ! gpus=$(nvidia-smi -L 2>&1) || ! grep -q '^GPU ' <<<"$gpus"; then
  problems+=("no GPU: nvidia-smi -L lists none ($(head -1 <<<"$gpus"))")
else
  say "gpu: $(head -1 <<<"$gpus")"
fi

probe=$("$PY" -c '
import sys
print("python=%d.%d" % sys.version_info[:2])
try:
    import torch
except Exception as e:
    print("torch=missing (%s)" % e); sys.exit()
print("torch=" + torch.__version__)
print("torch_cuda=%s" % torch.version.cuda)
ok = torch.version.cuda is not None and torch.cuda.is_available()
print("cuda_available=%d" % ok)
if ok:
    print("gpu_name=" + torch.cuda.get_device_name())
    print("capability=%d.%d" % torch.cuda.get_device_capability())
for m in ("triton", "pytest", "hypothesis"):
    try:
        print("%s=%s" % (m, __import__(m).__version__))
    except Exception:
        print("%s=missing" % m)
try:
    from torch.utils.cpp_extension import is_ninja_available
    print("ninja=%s" % ("found" if is_ninja_available() else "missing"))
except Exception as e:
    print("ninja=missing (%s)" % e)
' 2>&1)
val() { sed -n "s/^$1=//p" <<<"$probe" | head -1; }
pyver=$(val python)
if [ -z "$pyver" ]; then
  problems+=("no python at PYTHON=$PY: $(head -1 <<<"$probe")")
elif [[ "$(val torch)" == missing* || -z "$(val torch)" ]]; then
  problems+=("no torch in $PY ($(val torch)): use the machine's python3 that holds PyTorch")
elif [ "$(val torch_cuda)" = None ]; then
  problems+=("torch $(val torch) in $PY has no CUDA build (torch.version.cuda is None): use the lent machine's CUDA torch")
elif [ "$(val cuda_available)" != 1 ]; then
  problems+=("torch $(val torch) (CUDA $(val torch_cuda)) sees no GPU: torch.cuda.is_available() is False")
fi
for m in triton pytest hypothesis ninja; do
  [ -n "$(val torch_cuda)" ] && [[ "$(val $m)" == missing* ]] && problems+=("no $m for $PY ($(val $m))")
done

if [ -n "${CUDA_HOME:-${CUDA_PATH:-}}" ]; then  # as torch.utils.cpp_extension finds the toolkit
  NVCC=${CUDA_HOME:-$CUDA_PATH}/bin/nvcc
else
  NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
fi
if [ ! -x "$NVCC" ]; then
  problems+=("no nvcc at $NVCC: the CUDA toolkit is needed to build sgl_kernel_fork._C_cuda (set CUDA_HOME to it)")
fi
for tool in patch c++; do
  command -v $tool >/dev/null 2>&1 || problems+=("no $tool on PATH (the patch series / the C++ build needs it)")
done

if [ ! -f "$WHEELS/MANIFEST" ]; then
  problems+=("missing wheels: no $WHEELS/MANIFEST; run \`make gpu-wheels\` on the development machine and name .gpu-wheels in the device call's carry")
else
  missing=()
  while read -r whl; do
    [ -z "$whl" ] || [ -f "$WHEELS/$whl" ] || missing+=("$whl")
  done <"$WHEELS/MANIFEST"
  [ ${#missing[@]} -eq 0 ] || problems+=("missing wheels in $WHEELS: ${missing[*]} (run \`make gpu-wheels\` and carry .gpu-wheels)")
  sg=$(grep '^sglang-0\.5\.23-' "$WHEELS/MANIFEST" | head -1)
  if [ -z "$sg" ]; then
    problems+=("missing wheels: $WHEELS/MANIFEST names no sglang-0.5.23 wheel (run \`make gpu-wheels\`)")
  elif [ -n "$pyver" ] && [[ "$sg" != *"-cp${pyver/./}-"* ]]; then
    problems+=("wheels for another python: $sg, but $PY is $pyver (scripts/gpu_carry.py PYTHON_VERSION)")
  fi
fi

if [ ${#problems[@]} -gt 0 ]; then
  say "gpu_checks: cannot run, ${#problems[@]} missing piece(s):"
  for p in "${problems[@]}"; do say "  - $p"; done
  exit 2
fi
say "machine: $(val gpu_name) (sm $(val capability)), python $pyver, torch $(val torch), triton $(val triton), $("$NVCC" --version | tail -2 | head -1), $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg 2>/dev/null)"
if [ $DRY = 1 ]; then
  say "dry run: every piece is here; the steps would be: $STEPS (budget ${BUDGET}s)"
  exit 0
fi

# ------------------------------------------------------------------------------------ steps
failed=0
want() { [[ " $STEPS " == *" $1 "* ]]; }
# step NAME TIMEOUT CMD...: run CMD under min(TIMEOUT, what the budget leaves), log it, record it.
step() {
  local name=$1 limit=$2 left rc t0 n0
  shift 2
  left=$((BUDGET - (SECONDS - START) - 5))
  if [ $left -lt 20 ]; then
    say "SKIP  $name: the ${BUDGET}s budget is spent (rerun with GPU_CHECKS_STEPS=\"$name ...\")"
    failed=1
    return 1
  fi
  [ "$limit" -gt $left ] && limit=$left
  echo "== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  n0=$(wc -l <"$LOG")
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  LAST=$(tail -1 "$LOG")  # the command's last line (a benchmark's name=value line)
  if [ $rc -eq 0 ]; then
    say "PASS  $name $((SECONDS - t0))s"
  else
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && rc="timeout after ${limit}s" || rc="exit $rc"
    local out
    out=$(tail -n +$((n0 + 1)) "$LOG" | tail -25 | sed 's/^/      /')
    say "FAIL  $name $((SECONDS - t0))s ($rc); its last lines:"
    echo "$out" | tee -a "$SUMMARY"
    failed=1
    return 1
  fi
}
fatal() { say "stopping: $1 failed, the later steps need it"; exit 1; }

export PYTHONPATH=$REPO/sgl-kernel/python:$SITE:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if want install; then
  if [ "$("$PY" scripts/patch_queue.py status --site-packages "$SITE" 2>/dev/null)" = current ]; then
    say "PASS  install (already in $SITE, series current)"
  else
    step install 150 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" $(sed "s|^|$WHEELS/|" "$WHEELS/MANIFEST") || fatal install
  fi
fi
if want apply; then
  step apply 60 "$PY" scripts/patch_queue.py apply --site-packages "$SITE" || fatal apply
fi
if want build; then
  cap=$(val capability)
  (cd sgl-kernel && rm -rf python/*.egg-info) 2>/dev/null
  step build 300 env -C sgl-kernel SGL_KERNEL_BUILD_CUDA=1 SGL_KERNEL_FORK_ALIAS=0 \
    MAX_JOBS="$(nproc)" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$cap}" \
    CUDA_HOME="$(dirname "$(dirname "$NVCC")")" "$PY" setup.py build_ext --inplace || fatal build
  step cuda-op 30 "$PY" -c "
import torch, sgl_kernel_fork, sgl_kernel_fork._C_cuda
assert torch._C._dispatch_has_kernel_for_dispatch_key('sgl_kernel::expert_cache_control', 'CUDA')
print('sgl_kernel_fork', sgl_kernel_fork.__file__)" || fatal "the CUDA op check (every CUDA test would skip)"
fi
standins=$("$PY" -c "from sglang.test.bare_fused_moe import install_cuda_standins as i; print('; '.join(i()) or 'none')" 2>&1 | tail -1)
say "stand-ins for upstream's CUDA kernel wheel: $standins"
if want tests; then
  # Whether a C++ exception survives in a process with upstream imported beside the stand-ins
  # (the first GPU run segfaulted where test_cuda_op expects one): from the CPU ops' library,
  # then from the CUDA one. Not fatal; a crash here points at the environment, not at a test.
  step throw-probe 60 "$PY" -X faulthandler -c "
import torch, sgl_kernel_fork
from sglang.test.bare_fused_moe import install_cuda_standins
install_cuda_standins()
from sglang.srt.layers.moe.expert_cache import control
for what, call in (
    ('cpu op', lambda: torch.ops.sgl_kernel.expert_pool_set_threads(-1)),
    ('cuda op', lambda: control.expert_cache_control(
        torch.ones(1, 1, dtype=torch.int32, device='cuda'), 0, 4097,
        control.ExpertCacheTables.allocate(1, 4097, 8, 'cuda'),
        control.FillList.allocate(4, 'cuda'), 1.0, 0)),
):
    try:
        call()
    except RuntimeError as e:
        print(what, 'raised:', str(e).splitlines()[0])
    else:
        raise SystemExit(what + ' did not raise')
"
  # One pytest process per file: a crash (a segfault in a native op) loses that file only, and
  # is rerun under gdb where the machine has it, for the native backtrace (in the summary).
  TESTS=${GPU_CHECKS_TESTS:-test/expert_cache/test_cuda_op.py test/expert_cache/test_cuda_pack_pin.py
    test/expert_cache/test_cuda_sources.py test/expert_cache/test_cuda_cache.py
    test/expert_cache/test_triton_slot_path.py test/sgl_kernel/test_gdn_emit_triton.py}
  deselect=test/expert_cache/test_triton_slot_path.py::test_slot_experts_through_triton_fused_moe_add_up_with_the_cpu_branch
  tests_t0=$SECONDS
  for f in $TESTS; do
    left=$((300 - (SECONDS - tests_t0)))
    name=tests:$(basename "$f" .py)
    if [ $left -lt 20 ]; then
      say "SKIP  $name: the tests step's 300s are spent"
      failed=1
      continue
    fi
    junit=$OUTDIR/junit-$(basename "$f" .py).xml
    rm -f "$junit"
    n_before=$(wc -l <"$LOG")
    step "$name" $((left < 150 ? left : 150)) "$PY" -X faulthandler -m pytest -q -rfEs \
      -p no:cacheprovider --junitxml="$junit" "$f" --deselect "$deselect"
    crashed=0
    tail -n +$((n_before + 1)) "$LOG" | grep -q "Fatal Python error" && crashed=1
    if [ $crashed = 1 ] && command -v gdb >/dev/null; then
      say "      $name crashed: rerunning it under gdb for the native backtrace (log.txt)"
      timeout --kill-after=5 120 gdb -q -batch -ex "set pagination off" \
        -ex "set debuginfod enabled off" -ex "set print frame-arguments none" -ex run -ex "bt 30" \
        -ex "info registers rip" --args "$PY" -m pytest -q -x -p no:faulthandler \
        -p no:cacheprovider "$f" --deselect "$deselect" >"$OUTDIR/gdb-$(basename "$f" .py).txt" 2>&1
      grep -E '^#[0-9]+ ' "$OUTDIR/gdb-$(basename "$f" .py).txt" | head -25 | sed 's/^/      /' |
        tee -a "$SUMMARY" >>"$LOG"
    elif [ $crashed = 1 ]; then
      say "      $name crashed; no gdb on this machine for a native backtrace"
    fi
    counts=$(grep -o '<testsuite [^>]*>' "$junit" 2>/dev/null | grep -o '\(tests\|failures\|errors\|skipped\)="[0-9]*"' | tr '\n' ' ')
    if [ -z "$counts" ]; then
      say "FAIL  $name: pytest wrote no report ($junit)"
      failed=1
    else
      say "      $name: $counts"
      if grep -q 'skipped="[1-9]' <<<"$counts"; then
        say "FAIL  $name: a GPU test skipped on the GPU machine (the reasons: log.txt, -rs)"
        failed=1
      fi
    fi
  done
fi
if want control; then
  step control 120 "$PY" benchmark/expert_cache/bench_control.py --device cuda &&
    say "      $LAST"
fi
if want step; then
  step step 300 "$PY" benchmark/expert_cache/bench_gpu_step.py --device cuda --warmup 4 --steps 16 &&
    say "      $LAST"
  grep -E '^(# (device|routing|B_P|stand-ins)|c[0-9]+ )' "$LOG" | sed 's/^/      /' >>"$SUMMARY"
fi
if want prefill; then
  # Qwen3.6-35B-A3B-like layers (256 experts of 2048 x 512, 6.3 MB each), 4 of them: a 6.4 GB
  # pool; without the kernel wheel, chunks above 32 tokens take the align stand-in's sort path.
  step prefill 180 "$PY" benchmark/expert_cache/bench_prefill_stream.py --device cuda \
    --layers 4 --experts 256 --top-k 8 --hidden 2048 --intermediate 512 --reps 3 \
    --lengths 32,1024,8192 &&
    say "      $LAST"
fi
say "done in $((SECONDS - START))s: $([ $failed = 0 ] && echo 'every step passed' || echo 'FAILED steps above')"
exit $failed
