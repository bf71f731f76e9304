#!/usr/bin/env bash
# Start the real `python -m sglang.launch_server` on a model folder (default: the embedded tiny
# Qwen3-Next), on CPU when no GPU is present and on CUDA otherwise. Extra arguments are passed
# to launch_server, e.g. `make serve ARGS="--log-level debug"`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-.models/qwen3-next-tiny}; PORT=${2:-30000}; shift $(( $# > 2 ? 2 : $# ))
PY=${PYTHON:-.venv/bin/python}
# The served model id is the model folder's name (clients show it and send it back), not its
# path; a --served-model-name in the extra arguments comes later and wins.
ARGS=(--model-path "$MODEL" --served-model-name "$(basename "$MODEL")" --host 127.0.0.1
      --port "$PORT" --tool-call-parser qwen --reasoning-parser qwen3 --enable-cache-report)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  :
else
  export SGLANG_USE_CPU_ENGINE=1
  # torch's OpenMP workers sleep between ops instead of spinning: on a CPU machine they share
  # the cores with the CPU executor's pinned pool, which ran the Qwen3-30B-A3B slice's MoE in
  # 6.8 instead of 9.3 ms per decode step so (issue 18). An OMP_WAIT_POLICY set by the caller
  # wins; set to empty it is unset (libgomp's default, spin then sleep).
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY-PASSIVE}
  [ -n "$OMP_WAIT_POLICY" ] || unset OMP_WAIT_POLICY
  # Host memory is shared with everything else on a CPU machine: size the pools explicitly
  # (upstream's default takes ~70% of free RAM). 512K KV tokens fit two full-context requests;
  # 256 recurrent-state slots cover running requests plus cached prefixes of hybrid models.
  # --sleep-on-idle: the idle scheduler waits on its sockets instead of spinning a core.
  ARGS+=(--device cpu --attention-backend torch_native --disable-overlap-schedule
         --max-total-tokens 524288 --max-mamba-cache-size 256 --sleep-on-idle)
fi
cat <<MSG
Starting SGLang on http://127.0.0.1:$PORT  (model: $MODEL)
Try, once http://127.0.0.1:$PORT/health answers 200 (Ctrl-C stops the server):
  curl -s http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model":"default","messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'
Agent clients configured for this server: python -m sglang.launch_agent openclaw|opencode|claude
MSG
exec "$PY" -m sglang.launch_server "${ARGS[@]}" "$@"
