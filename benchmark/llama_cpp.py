"""llama.cpp as the CPU baseline of benchmark/cpu_decode.py: built once, a GGUF per model, and
``llama-bench`` figures.

* Source: the llama.cpp vendored in the ``llama-cpp-python==0.3.36`` sdist (``pip download``,
  the project's only registry client), unpacked into ``.cache/llama-cpp/src``.
* Build: ``cmake -G Ninja -DGGML_NATIVE=ON`` (the machine's own ISA: AVX-512 BF16 here), only
  the ``llama-bench`` target, into ``.cache/llama-cpp/build``; kept across runs.
* GGUF: the vendored ``convert_hf_to_gguf.py --outtype bf16``, next to the model
  (``<model>.bf16.gguf``). The tiny models' tokenizer is not one of the released ones whose
  pre-tokenizer hash the converter knows; it is Qwen-style, so the converter is told ``qwen2``
  (``llama-bench`` feeds random tokens, so the tokenizer does not change a figure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"
REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / ".cache" / "llama-cpp"
SRC = ROOT / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
BUILD = ROOT / "build"
BENCH = BUILD / "bin" / "llama-bench"

_CONVERT = """
import sys
sys.path.insert(0, {src!r})
sys.path.insert(1, {gguf_py!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "bf16", "--outfile", {out!r}]
convert_hf_to_gguf.main()
"""


def _run(cmd: list[str], log: Path, **kw) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}); end of {log}:\n{tail}")


def ensure_built() -> Path:
    """``llama-bench``'s path, after downloading and building it when missing (minutes)."""
    if BENCH.exists():
        return BENCH
    ROOT.mkdir(parents=True, exist_ok=True)
    log = ROOT / "build.log"
    if not SRC.exists():
        sdist = ROOT / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.exists():
            _run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
                + ["-d", str(ROOT), f"llama-cpp-python=={VERSION}"],
                log,
            )
        (ROOT / "src").mkdir(exist_ok=True)
        _run(["tar", "xzf", str(sdist), "-C", str(ROOT / "src")], log)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    flags += ["-DBUILD_SHARED_LIBS=OFF"]
    _run(["cmake", "-S", str(SRC), "-B", str(BUILD), "-G", "Ninja", *flags], log)
    _run(["ninja", "-C", str(BUILD), f"-j{os.cpu_count() or 1}", "llama-bench"], log)
    return BENCH


def ensure_gguf(model: Path) -> Path:
    """The bf16 GGUF of the HF model folder ``model`` (converted once, next to it)."""
    out = model.with_name(model.name + ".bf16.gguf")
    if out.exists():
        return out
    tmp = out.with_suffix(".tmp")
    code = _CONVERT.format(
        src=str(SRC), gguf_py=str(SRC / "gguf-py"), model=str(model), out=str(tmp)
    )
    _run([sys.executable, "-c", code], ROOT / "convert.log", cwd=str(SRC))
    os.replace(tmp, out)
    return out


def bench(gguf: Path, threads: int, prompt: int, gen: int, repeats: int = 2) -> dict:
    """``llama-bench -t threads -p prompt -n gen -r repeats``: {"prefill": tok/s, "decode":
    tok/s} (averages over the repeats; a size of 0 skips that test)."""
    cmd = [str(BENCH), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen)]
    cmd += ["-r", str(repeats), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({r.returncode}):\n{r.stderr[-3000:]}")
    out = {}
    for row in json.loads(r.stdout):
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            out["prefill"] = float(row["avg_ts"])
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            out["decode"] = float(row["avg_ts"])
    return out
