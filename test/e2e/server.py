"""Start and stop the real `python -m sglang.launch_server` for end-to-end tests and benchmarks.

The server runs from the repository's .venv with the same flags as `make serve` (CPU flags when no
GPU is present), on a free loopback port, with its log in a file shown when startup fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / ".models"
DEFAULT_MODELS = {
    "qwen3_next": "qwen3-next-tiny",
    "qwen3_moe": "qwen3-moe-tiny",
    "glm4_moe": "glm4-moe-tiny",
    "qwen3_moe_fp8": "qwen3-moe-fp8-tiny",
    "qwen3_5_moe": "qwen3.5-moe-tiny",
    "qwen3_moe_nvfp4": "qwen3-moe-nvfp4-tiny",
    "qwen3_5_moe_nvfp4": "qwen3.5-moe-nvfp4-tiny",
    "mixtral": "mixtral-tiny",
    "olmoe": "olmoe-tiny",
    "deepseek_v3": "deepseek-v3-tiny",
    "deepseek_v3_fp8": "deepseek-v3-fp8-tiny",
    "qwen3_moe_ct_fp8": "qwen3-moe-ct-fp8-tiny",
    "glm4_moe_ct_fp8": "glm4-moe-ct-fp8-tiny",
    "qwen3_moe_ct_fp8_block": "qwen3-moe-ct-fp8-block-tiny",
    "qwen3_moe_ct_fp8_tensor": "qwen3-moe-ct-fp8-tensor-tiny",
    "gpt_oss": "gpt-oss-tiny",
    "gemma4": "gemma4-moe-tiny",
    "llama4": "llama4-moe-tiny",
}
# Quantized tiny models: (architecture, --quant) of the builder.
QUANTIZED = {
    "qwen3_moe_fp8": ("qwen3_moe", "fp8"),
    "qwen3_moe_nvfp4": ("qwen3_moe", "nvfp4"),
    "qwen3_5_moe_nvfp4": ("qwen3_5_moe", "nvfp4"),
    "deepseek_v3_fp8": ("deepseek_v3", "fp8"),
    "qwen3_moe_ct_fp8": ("qwen3_moe", "ct-fp8"),
    "glm4_moe_ct_fp8": ("glm4_moe", "ct-fp8"),
    "qwen3_moe_ct_fp8_block": ("qwen3_moe", "ct-fp8-block"),
    "qwen3_moe_ct_fp8_tensor": ("qwen3_moe", "ct-fp8-tensor"),
}


def ensure_model(arch: str = "qwen3_next") -> Path:
    """Build the embedded tiny model for ``arch`` (a key of ``DEFAULT_MODELS``) into
    ``.models/`` once; return its folder."""
    out = MODELS / DEFAULT_MODELS[arch]
    if not (out / "config.json").exists():
        base, quant = QUANTIZED.get(arch, (arch, None))
        cmd = [sys.executable, "-m", "sglang.test.tiny_models", "--arch", base, "--out", str(out)]
        subprocess.run(cmd + (["--quant", quant] if quant else []), check=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(model: Path, port: int, extra: list[str] | None = None) -> list[str]:
    """Command line of `make serve` (scripts/serve.sh, the one place the flags live).

    With ``--enable-expert-cache`` and no ``--expert-cache-rebalance-reserve`` in ``extra``,
    the reserve is set to 0: the default (5% of the host's memory, read from ``MemAvailable``)
    would let the free memory of this shared test machine move the slot and KV counts the
    tests assert; the pressure tests set a reserve and a simulated device themselves
    (``test_elastic_load.py``)."""
    extra = list(extra or [])
    if "--enable-expert-cache" in extra and not any(
        a.startswith("--expert-cache-rebalance-reserve") for a in extra
    ):
        extra += ["--expert-cache-rebalance-reserve", "0"]
    return ["bash", str(REPO / "scripts" / "serve.sh"), str(model), str(port), *extra]


@dataclass
class Server:
    """A running server; ``url`` is its base address, ``log`` its output file."""

    proc: subprocess.Popen
    url: str
    log: Path
    model: Path
    args: list[str] = field(default_factory=list)

    def stop(self, graceful: bool = False) -> None:
        """Stop the server and every process it started (its process group), and wait until
        they are gone (so the next server does not start beside a dying one).

        By default the group is killed at once: tests and benchmarks need no drain, and
        upstream's graceful path (SIGTERM: drain, then a 5 s wait before its crash
        diagnostics when a child went first) costs ~5 s per server. ``graceful`` sends SIGTERM
        to the launcher alone and waits up to 30 s for its own shutdown (then kills)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if graceful and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        psutil.wait_procs(children, timeout=30)

    def alive(self) -> bool:
        return (
            self.proc.poll() is None
            and requests.get(self.url + "/health", timeout=30).status_code == 200
        )

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_server(
    model: Path, extra: list[str] | None = None, timeout_s: float = 600, env: dict | None = None
) -> Server:
    """Launch the server and wait until it answers /health_generate.

    ``extra`` are more launch_server flags; ``env`` more environment variables.

    Raises:
        RuntimeError: the process exited or did not become ready within ``timeout_s`` seconds;
            the message carries the end of its log.
    """
    port = free_port()
    args = server_args(model, port, extra)
    log = Path(tempfile.mkstemp(prefix=f"sglang-{port}-", suffix=".log")[1])
    proc = subprocess.Popen(
        args,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    srv = Server(proc, f"http://127.0.0.1:{port}", log, model, args)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log_tail()}")
        try:
            if requests.get(srv.url + "/health_generate", timeout=60).status_code == 200:
                return srv
        except requests.RequestException:
            pass
        time.sleep(1)
    srv.stop()
    raise RuntimeError(f"server not ready after {timeout_s:.0f}s:\n{srv.log_tail()}")
