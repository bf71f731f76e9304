#!/usr/bin/env python3
"""Apply our patch series and modules to an installed upstream SGLang, or check the series.

Upstream SGLang is a pinned dependency (``sglang==0.5.23``); this repository carries
(a) new modules under ``python/sglang/`` and (b) ``patches/NNNN-*.patch``, listed in order in
``patches/series``. Patches are unified diffs whose paths are relative to ``site-packages``
(``a/sglang/srt/...``), applied with ``patch -p1``.

Commands:
  apply  --site-packages DIR   Apply the series to the sglang package installed in DIR (once;
                               a stamp records which series is applied) and link our modules
                               into it. If a different series was applied earlier, the caller
                               must reinstall pristine upstream first (``make setup`` does).
  check  --wheel WHEEL         Apply every patch in order to a pristine copy unpacked from the
                               pinned wheel, in a temporary directory; name the first patch
                               that does not apply.
  status --site-packages DIR   Print ``current``, ``stale`` or ``pristine``.

Only the standard library is used so this runs before the virtual environment is complete.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO / "patches"
OUR_PKG = REPO / "python" / "sglang"
STAMP = ".fork-patch-series"


def series() -> list[Path]:
    """Patches in ``patches/series`` order; blank lines and ``#`` comments are ignored.

    Raises:
        SystemExit: a listed patch is missing, or a ``.patch`` file is not listed.
    """
    names = []
    for line in (PATCH_DIR / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    missing = [n for n in names if not (PATCH_DIR / n).is_file()]
    if missing:
        sys.exit(f"patches/series lists missing files: {missing}")
    unlisted = sorted({p.name for p in PATCH_DIR.glob("*.patch")} - set(names))
    if unlisted:
        sys.exit(f"patches not listed in patches/series: {unlisted} (add them in order)")
    return [PATCH_DIR / n for n in names]


def series_digest() -> str:
    h = hashlib.sha256()
    for p in series():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def run_patch(patch: Path, root: Path, dry_run: bool = False) -> subprocess.CompletedProcess:
    cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(root), "-i", str(patch)]
    if dry_run:
        cmd.insert(1, "--dry-run")
    return subprocess.run(cmd, capture_output=True, text=True)


def apply_series(root: Path) -> None:
    """Apply every patch to the tree under ``root`` (the directory holding ``sglang/``).

    Each patch is dry-run first so a failing patch leaves the tree as the previous one left it.

    Raises:
        SystemExit: naming the first patch that does not apply, with patch's output.
    """
    for p in series():
        res = run_patch(p, root, dry_run=True)
        if res.returncode != 0:
            sys.exit(f"{p.name} does not apply to {root}:\n{res.stdout}{res.stderr}")
        res = run_patch(p, root)
        if res.returncode != 0:
            sys.exit(f"{p.name} failed while applying:\n{res.stdout}{res.stderr}")
        print(f"applied {p.name}")


def link_modules(site: Path) -> int:
    """Symlink our new modules into the installed ``sglang`` package.

    A file or directory of ours that upstream lacks is linked as a whole; a directory that
    upstream also has is descended into. Stale links into this repository are removed.

    Returns:
        Number of links created.

    Raises:
        SystemExit: a file of ours would shadow an upstream file (change upstream files with a
            patch instead).
    """
    dst_root = site / "sglang"
    made = 0
    # Remove links of ours whose target is gone (a module was renamed or deleted).
    for dirpath, dirnames, filenames in os.walk(dst_root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink() and str(os.readlink(p)).startswith(str(OUR_PKG)) and not p.exists():
                p.unlink()

    def walk(src: Path, dst: Path) -> None:
        nonlocal made
        for entry in sorted(src.iterdir()):
            if entry.name == "__pycache__" or entry.name.endswith(".pyc"):
                continue
            target = dst / entry.name
            if target.is_symlink():
                if Path(os.readlink(target)) == entry:
                    continue
                target.unlink()
            if not target.exists():
                target.symlink_to(entry, target_is_directory=entry.is_dir())
                made += 1
            elif entry.is_dir() and target.is_dir():
                walk(entry, target)
            else:
                sys.exit(
                    f"python/sglang/{entry.relative_to(OUR_PKG)} would replace an upstream file; "
                    "change upstream files with a patch in patches/ instead"
                )

    walk(OUR_PKG, dst_root)
    return made


def status(site: Path) -> str:
    stamp = site / "sglang" / STAMP
    if not stamp.exists():
        return "pristine"
    return "current" if stamp.read_text().strip() == series_digest() else "stale"


def cmd_apply(site: Path) -> None:
    st = status(site)
    if st == "stale":
        sys.exit("installed sglang carries an older patch series; reinstall pristine upstream first")
    if st == "pristine":
        # Stamp first: a patch that fails part-way leaves a tree that reads as stale, not
        # pristine, so the next setup reinstalls upstream instead of patching twice.
        (site / "sglang" / STAMP).write_text("partial\n")
        apply_series(site)
        (site / "sglang" / STAMP).write_text(series_digest() + "\n")
    n = link_modules(site)
    print(f"patch series current ({len(series())} patches); {n} module links created")


def cmd_check(wheel: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith("sglang/")]
            zf.extractall(tmp, members)
        for p in series():
            res = run_patch(p, Path(tmp))
            if res.returncode != 0:
                sys.exit(f"FAIL {p.name} does not apply after the patches before it:\n{res.stdout}{res.stderr}")
            if "offset" in res.stdout or "fuzz" in res.stdout:
                print(f"ok   {p.name} (applies with offset/fuzz; refresh it)\n{res.stdout}")
            else:
                print(f"ok   {p.name}")
    print(f"check-patches: {len(series())} patches apply cleanly to {wheel.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("apply", "status"):
        sp = sub.add_parser(name)
        sp.add_argument("--site-packages", type=Path, required=True)
    sp = sub.add_parser("check")
    sp.add_argument("--wheel", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "apply":
        cmd_apply(args.site_packages)
    elif args.cmd == "status":
        print(status(args.site_packages))
    else:
        cmd_check(args.wheel)


if __name__ == "__main__":
    main()
