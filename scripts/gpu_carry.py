#!/usr/bin/env python3
"""The wheel set carried to the lent GPU machine, and the size of what travels there.

    python3 scripts/gpu_carry.py download [--dest .gpu-wheels]   # make gpu-wheels runs both
    python3 scripts/gpu_carry.py size [--dest .gpu-wheels]

The lent machine (``/work/.library/device/KINDS.md``) has Python 3.12, CUDA torch, Triton,
nvcc, pytest and hypothesis, and no package registry: ``sglang==0.5.23`` and the packages of
``requirements/gpu-carry.txt`` travel as cp312 wheels in ``--dest`` (git-ignored), named in
the device call's ``carry``, and ``scripts/gpu_checks.sh`` installs them there with
``pip install --no-index --no-deps --target /tmp/site``.

``download`` fetches exactly that set (the sglang wheel from ``.cache/wheels/`` when a cp312
one is there), removes any other wheel from ``--dest`` (two versions of one package stop the
install) and writes ``--dest/MANIFEST``, one wheel file name per line, which the GPU script
checks before it starts. ``size`` adds the wheels to the working tree that travels with every
call (tracked and untracked, not ignored, files) and fails above the 64 MiB the device tool
carries. Only the standard library and pip are used.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEST = REPO / ".gpu-wheels"
PINS = REPO / "requirements" / "gpu-carry.txt"
SGLANG = "sglang==0.5.23"
PYTHON_VERSION = "3.12"  # the lent machine's python3
LIMIT_MIB = 64  # the device tool's limit on what travels: working tree + carried paths
MANIFEST = "MANIFEST"
MIB = 1 << 20


def pins(path: Path = PINS) -> list[str]:
    """The ``name==version`` lines of ``requirements/gpu-carry.txt``."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9._+-]+", line):
                raise SystemExit(f"{path}: {line!r} is not an exact pin (name==version)")
            out.append(line)
    return out


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_key(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name."""
    name, version = filename.split("-")[:2]
    return norm(name), version


def download(dest: Path) -> list[str]:
    """Fetch the set into ``dest``, drop other wheels, write the manifest; return its names."""
    dest.mkdir(parents=True, exist_ok=True)
    tag = "cp" + PYTHON_VERSION.replace(".", "")
    for cached in sorted((REPO / ".cache" / "wheels").glob(f"sglang-0.5.23-{tag}-*.whl")):
        if not (dest / cached.name).exists():
            shutil.copy2(cached, dest / cached.name)
    wanted = [SGLANG] + pins()
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "any"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(dest)]
    for p in platforms:
        cmd += ["--platform", p]
    res = subprocess.run(cmd + wanted)
    if res.returncode != 0:
        raise SystemExit(
            f"pip download failed (exit {res.returncode}) for {' '.join(wanted)}: this needs "
            "the package registry; on a machine without one, copy the wheels into "
            f"{dest} by hand"
        )
    keys = {(norm(w.split("==")[0]), w.split("==")[1]) for w in wanted}
    kept = []
    for whl in sorted(dest.glob("*.whl")):
        if wheel_key(whl.name) in keys:
            kept.append(whl.name)
        else:
            whl.unlink()
            print(f"removed {whl.name} (not in the carried set)")
    missing = keys - {wheel_key(k) for k in kept}
    if missing:
        raise SystemExit(f"no {tag} wheel was downloaded for: {sorted(missing)}")
    (dest / MANIFEST).write_text("\n".join(kept) + "\n")
    return kept


def tree_files(repo: Path = REPO) -> list[Path]:
    """The working tree that travels with a device call: tracked and untracked files that git
    does not ignore."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    return [repo / p for p in out.decode().split("\0") if p]


def size_of(paths) -> int:
    return sum(p.lstat().st_size for p in paths if p.is_file() or p.is_symlink())


def report(dest: Path, repo: Path = REPO, limit_mib: float = LIMIT_MIB) -> int:
    """Print the sizes; return 0 under the limit, 1 over it or without a manifest."""
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    files = tree_files(repo)
    w, t = size_of(wheels), size_of(files)
    print(f"carried wheels: {w / MIB:.1f} MiB in {len(wheels)} wheels ({dest})")
    print(f"working tree:   {t / MIB:.1f} MiB in {len(files)} files")
    print(f"total:          {(w + t) / MIB:.1f} MiB of the {limit_mib:g} MiB a device call carries")
    if not (dest / MANIFEST).is_file():
        print(f"no {dest / MANIFEST}: run `make gpu-wheels`", file=sys.stderr)
        return 1
    if w + t > limit_mib * MIB:
        print(
            f"over the limit by {(w + t) / MIB - limit_mib:.1f} MiB: carry fewer wheels "
            "(requirements/gpu-carry.txt) or ignore large untracked files",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["download", "size"])
    ap.add_argument("--dest", type=Path, default=DEST)
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    a = ap.parse_args(argv)
    if a.command == "download":
        kept = download(a.dest)
        print(f"{len(kept)} wheels in {a.dest} ({MANIFEST} written)")
        return 0
    return report(a.dest, limit_mib=a.limit_mib)


if __name__ == "__main__":
    sys.exit(main())
