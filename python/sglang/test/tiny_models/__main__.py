"""CLI: ``python -m sglang.test.tiny_models --arch qwen3_next --out DIR [--seed N] [--force]
[--quant fp8|nvfp4|ct-fp8|ct-fp8-block|ct-fp8-tensor]``; ``--shape qwen3-30b-a3b`` builds a released model's layer sizes (its arch)."""

import argparse
import sys
import time

from .builder import ARCHS, DEFAULT_ARCH, DEFAULT_SEED, SHAPES, build, param_count
from .quantize import QUANTS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang.test.tiny_models",
        description="Write a deterministic tiny random-weight model (no downloads).",
    )
    parser.add_argument("--arch", choices=ARCHS, default=None, help=f"default {DEFAULT_ARCH}")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default=None,
        help="a released model's layer sizes at 4 layers (sets --arch to its architecture)",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument(
        "--quant",
        choices=QUANTS,
        default=None,
        help="write a released quantized layout (fp8: block FP8 as Qwen's -FP8 releases, or "
        "DeepSeek-V3's for --arch deepseek_v3; nvfp4: "
        "ModelOpt NVFP4 as NVIDIA's -FP4 releases; for --arch qwen3_5_moe ModelOpt "
        "MIXED_PRECISION as nvidia/Qwen3.6-35B-A3B-NVFP4; ct-fp8 / ct-fp8-block: "
        "compressed-tensors FP8 as llm-compressor's FP8-Dynamic / FP8_BLOCK releases, for "
        "qwen3_moe and glm4_moe; ct-fp8-tensor: its static per-tensor FP8, for qwen3_moe)",
    )
    parser.add_argument(
        "--no-tokenizer-cache",
        action="store_true",
        help="retrain the tokenizer instead of using the cached one",
    )
    args = parser.parse_args(argv)
    if args.shape is not None:
        shape_arch = SHAPES[args.shape][0]
        if args.arch not in (None, shape_arch):
            parser.error(f"--shape {args.shape} is a {shape_arch} model, not --arch {args.arch}")
        args.arch = shape_arch
    args.arch = args.arch or DEFAULT_ARCH
    t0 = time.perf_counter()
    try:
        out = build(
            args.arch,
            args.out,
            seed=args.seed,
            force=args.force,
            use_tokenizer_cache=not args.no_tokenizer_cache,
            quant=args.quant,
            shape=args.shape,
        )
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.arch}{' ' + args.quant if args.quant else ''}{' ' + args.shape if args.shape else ''} "
        f"({param_count(args.arch, args.shape) / 1e6:.1f}M params, seed {args.seed}) "
        f"to {out} in {time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
