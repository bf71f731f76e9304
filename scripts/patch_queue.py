#!/usr/bin/env python3
"""Apply our patch series to an installed upstream SGLang, check it, and edit it through git.

Upstream SGLang is a pinned dependency (``sglang==0.5.23``); this repository carries
(a) new modules under ``python/sglang/`` and (b) ``patches/NNNN-*.patch``, listed in order in
``patches/series``. Patches are in ``git format-patch`` form (mail header, message, diff) with
paths relative to ``site-packages`` (``a/sglang/srt/...``); ``patch -p1`` applies them to the
installed package (it skips the mail header) and ``git am`` imports them into a git repository
of the pristine wheel. See docs/patches.md for the workflow and the header format.

Commands:
  apply  --site-packages DIR   Apply the series to the sglang package installed in DIR (once;
                               a stamp records which series is applied) and link our modules
                               into it. If a different series was applied earlier, the caller
                               must reinstall pristine upstream first (``make setup`` does).
  status --site-packages DIR   Print ``current``, ``stale`` or ``pristine``.
  import --wheel WHEEL --dir DIR
                               Unpack ``sglang/`` from the wheel into DIR, commit it as the base
                               (tag ``upstream-<version>``) and ``git am`` the series onto it,
                               one commit per patch.
  export --dir DIR             ``git format-patch`` every commit after the base tag back into
                               ``patches/`` and rewrite ``patches/series``.
  rebase --wheel WHEEL --dir DIR
                               Upstream bump: commit the new wheel's tree as a new base (tag
                               ``upstream-<version>``) and ``git rebase`` the queue onto it.
  check  --wheel WHEEL         CI: every patch applies in order (``patch -p1``) to a pristine copy
                               of the wheel, and import + export reproduces ``patches/`` byte
                               for byte.

Patch names: a commit's ``Patch: NNNN-name`` trailer names its file (``NNNN-name.patch``);
every exported patch carries one, so every imported commit does. A commit without one (a new
patch) gets the number after the previous patch's and a name made from its subject, and export
adds the trailer to its file; ``Patch: NNNN`` picks the number only. Numbers must increase
along the series. Every commit needs an ``Upstream:`` trailer.

Only the standard library (and the ``git`` and ``patch`` programs) is used, so this runs
before the virtual environment is complete.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO / "patches"
OUR_PKG = REPO / "python" / "sglang"
STAMP = ".fork-patch-series"

# The queue repository (import/export/rebase).
TAG_PREFIX = "upstream-"
MARKER = "patch-queue.json"  # in DIR/.git: says import made this repository
BRANCH = "patches"
# Identity and date of the base commit; the patches' commits keep their own author and date.
BOT = ("patch_queue", "patch_queue@localhost")
BASE_DATE = "2000-01-01T00:00:00+0000"
# format-patch options that fix its output whatever git's configuration: re-exporting an
# unchanged queue is byte-identical.
FORMAT_PATCH = [
    "format-patch",
    "--stdout",
    "--zero-commit",
    "--no-signature",
    "--no-numbered",
    "--no-encode-email-headers",
    "--no-renames",
    "--diff-algorithm=myers",
    "--unified=3",
    "--abbrev=12",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    "--stat=72",
    "--no-binary",
]
NAME_RE = re.compile(r"^(\d{4})(?:-([a-z0-9][a-z0-9._-]*))?$")
SERIES_HEADER = (
    "# Applied in order to pristine sglang=={version} (see scripts/patch_queue.py).\n"
    "# Written by `scripts/patch_queue.py export` (make patches-export); see docs/patches.md.\n"
)


class QueueError(Exception):
    """A failure with a message for the developer (printed without a traceback)."""


class ImportStopped(QueueError):
    """``git am`` stopped at patch ``name`` during an import (``output``: what git said)."""

    def __init__(self, message: str, name: str, output: str) -> None:
        super().__init__(message)
        self.name, self.output = name, output


# --------------------------------------------------------------------------------------------
# The series


def series(patch_dir: Path = PATCH_DIR) -> list[Path]:
    """Patches in ``patches/series`` order; blank lines and ``#`` comments are ignored.

    Raises:
        QueueError: a listed patch is missing, or a ``.patch`` file is not listed.
    """
    names = []
    for line in (patch_dir / "series").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    missing = [n for n in names if not (patch_dir / n).is_file()]
    if missing:
        raise QueueError(f"patches/series lists missing files: {missing}")
    unlisted = sorted({p.name for p in patch_dir.glob("*.patch")} - set(names))
    if unlisted:
        raise QueueError(f"patches not listed in patches/series: {unlisted} (add them in order)")
    return [patch_dir / n for n in names]


def series_digest(patch_dir: Path = PATCH_DIR) -> str:
    h = hashlib.sha256()
    for p in series(patch_dir):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def wheel_version(wheel: Path) -> str:
    """``0.5.23`` from ``sglang-0.5.23-cp311-...whl``."""
    parts = wheel.name.split("-")
    if len(parts) < 3 or parts[0] != "sglang" or not wheel.name.endswith(".whl"):
        raise QueueError(f"{wheel} is not an sglang wheel (sglang-VERSION-...whl)")
    return parts[1]


def unpack_wheel(wheel: Path, dest: Path, only: set[str] | None = None) -> None:
    """Extract the ``sglang/`` package of ``wheel`` into ``dest`` (only the files in ``only``,
    paths like ``sglang/srt/...``, when given)."""
    if not wheel.is_file():
        raise QueueError(f"no wheel at {wheel} (make setup downloads it into .cache/wheels/)")
    with zipfile.ZipFile(wheel) as zf:
        members = [
            m for m in zf.namelist() if m.startswith("sglang/") and (only is None or m in only)
        ]
        zf.extractall(dest, members)


def touched_paths(patches: list[Path]) -> set[str]:
    """The files (``sglang/...``) that the patches change."""
    out = set()
    for p in patches:
        for m in re.finditer(r"^(?:---|\+\+\+) [ab]/(\S+)", p.read_text(encoding="utf-8"), re.M):
            out.add(m.group(1))
    return out


# --------------------------------------------------------------------------------------------
# apply / status (make setup) and the patch(1) half of check


def run_patch(patch: Path, root: Path, dry_run: bool = False) -> subprocess.CompletedProcess:
    cmd = [
        "patch",
        "-p1",
        "--forward",
        "--batch",
        "--no-backup-if-mismatch",
        "-d",
        str(root),
        "-i",
        str(patch),
    ]
    if dry_run:
        cmd.insert(1, "--dry-run")
    return subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace")


def apply_series(root: Path, patch_dir: Path = PATCH_DIR) -> None:
    """Apply every patch to the tree under ``root`` (the directory holding ``sglang/``).

    Each patch is dry-run first so a failing patch leaves the tree as the previous one left it.

    Raises:
        QueueError: naming the first patch that does not apply, with patch's output.
    """
    for p in series(patch_dir):
        res = run_patch(p, root, dry_run=True)
        if res.returncode != 0:
            raise QueueError(f"{p.name} does not apply to {root}:\n{res.stdout}{res.stderr}")
        res = run_patch(p, root)
        if res.returncode != 0:
            raise QueueError(f"{p.name} failed while applying:\n{res.stdout}{res.stderr}")
        print(f"applied {p.name}")


def link_modules(site: Path) -> int:
    """Symlink our new modules into the installed ``sglang`` package.

    A file or directory of ours that upstream lacks is linked as a whole; a directory that
    upstream also has is descended into. Stale links into this repository are removed.

    Returns:
        Number of links created.

    Raises:
        QueueError: a file of ours would shadow an upstream file (change upstream files with a
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
                raise QueueError(
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
        raise QueueError(
            "installed sglang carries an older patch series; reinstall pristine upstream first"
        )
    if st == "pristine":
        # Stamp first: a patch that fails part-way leaves a tree that reads as stale, not
        # pristine, so the next setup reinstalls upstream instead of patching twice.
        (site / "sglang" / STAMP).write_text("partial\n")
        apply_series(site)
        (site / "sglang" / STAMP).write_text(series_digest() + "\n")
    n = link_modules(site)
    print(f"patch series current ({len(series())} patches); {n} module links created")


# --------------------------------------------------------------------------------------------
# git


def git_env() -> dict:
    """The environment of our git calls: no global or system configuration (so that no
    user's format.*, diff.* or core.* setting changes what import and export write), and a
    fixed committer."""
    env = dict(os.environ)
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_COMMITTER_NAME=BOT[0],
        GIT_COMMITTER_EMAIL=BOT[1],
        LC_ALL="C",
    )
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(k, None)
    return env


def git(
    repo: Path, *args: str, check: bool = True, env: dict | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    res = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        encoding="utf-8",
        env={**git_env(), **(env or {})},
        input=input,
    )
    if check and res.returncode != 0:
        raise QueueError(f"git {' '.join(args)} failed in {repo}:\n{res.stdout}{res.stderr}")
    return res


def commit_tree(repo: Path, tree_root: Path, message: str, parent: str | None) -> str:
    """Commit the files under ``tree_root`` (not ``repo``'s work tree) as a commit with
    ``parent``, through a temporary index; returns the commit id."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(repo, "--work-tree", str(tree_root.resolve()), "add", "-A", "-f", ".", env=env)
        tree = git(repo, "write-tree", env=env).stdout.strip()
    base_env = {
        "GIT_AUTHOR_NAME": BOT[0],
        "GIT_AUTHOR_EMAIL": BOT[1],
        "GIT_AUTHOR_DATE": BASE_DATE,
        "GIT_COMMITTER_DATE": BASE_DATE,
    }
    args = ["commit-tree", tree, "-m", message] + (["-p", parent] if parent else [])
    return git(repo, *args, env=base_env).stdout.strip()


def base_tag(repo: Path) -> str:
    """The nearest ``upstream-*`` tag below HEAD: the pristine tree the queue sits on."""
    res = git(
        repo, "describe", "--tags", "--abbrev=0", f"--match={TAG_PREFIX}*", "HEAD", check=False
    )
    if res.returncode != 0:
        raise QueueError(
            f"{repo} has no {TAG_PREFIX}* tag below HEAD: not a queue made by "
            "`patch_queue.py import`"
        )
    return res.stdout.strip()


def in_progress(repo: Path) -> str | None:
    gitdir = Path(git(repo, "rev-parse", "--absolute-git-dir").stdout.strip())
    for name, what in (
        ("rebase-apply", "git am or rebase"),
        ("rebase-merge", "git rebase"),
        ("MERGE_HEAD", "merge"),
        ("CHERRY_PICK_HEAD", "cherry-pick"),
    ):
        if (gitdir / name).exists():
            return what
    return None


# --------------------------------------------------------------------------------------------
# Commit messages: subject, trailers, patch names


def parse_trailers(message: str) -> dict[str, str]:
    """The ``Key: value`` lines of the message's last paragraph (continuation lines, indented,
    joined with a space), when every line of it is one; else {}."""
    paras = [p for p in re.split(r"\n\s*\n", message.strip()) if p.strip()]
    if len(paras) < 2:
        return {}
    out: dict[str, str] = {}
    key = None
    for line in paras[-1].splitlines():
        m = re.match(r"^([A-Za-z][A-Za-z0-9-]*):\s*(.*)$", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2).strip()
        elif key is not None and line[:1].isspace():
            out[key] += " " + line.strip()
        else:
            return {}
    return out


def slug(subject: str) -> str:
    """A file name from a subject: lower case, words joined by ``-``, at most 50 characters."""
    s = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    if len(s) > 50:
        s = s[:51].rsplit("-", 1)[0]
    return s or "patch"


def plan_names(commits: list[tuple[str, str]]) -> list[str]:
    """Patch file names (without ``.patch``) for ``(sha, message)`` pairs in series order.

    A ``Patch: NNNN-name`` trailer names the file; ``Patch: NNNN`` gives the number, the name
    comes from the subject; without one the number is the previous patch's plus one (the first
    patch's is 0001) and must stay below the next given number.

    Raises:
        QueueError: a malformed ``Patch:`` trailer, a missing ``Upstream:`` trailer, numbers
            that do not increase, or no free number for a commit without one.
    """
    given: list[tuple[int | None, str | None]] = []
    for sha, msg in commits:
        subject = msg.split("\n", 1)[0].strip()
        trailers = parse_trailers(msg)
        if not trailers.get("Upstream"):
            raise QueueError(
                f"commit {sha[:12]} ({subject!r}) has no `Upstream:` trailer; end its message "
                "with a paragraph such as\n"
                '  Upstream: not filed (would become "<PR title>"); drop when <condition>\n'
                "or `Upstream: <PR URL>` (git commit --amend, or git rebase -i and reword)"
            )
        value = trailers.get("Patch")
        if value is None:
            given.append((None, None))
            continue
        value = value.removesuffix(".patch")
        m = NAME_RE.match(value)
        if not m:
            raise QueueError(
                f"commit {sha[:12]} ({subject!r}): `Patch: {value}` is not NNNN or NNNN-name "
                "(four digits, then lower-case letters, digits, '.', '_' or '-')"
            )
        given.append((int(m.group(1)), m.group(2)))
    names = []
    prev = 0
    for i, ((sha, msg), (num, name)) in enumerate(zip(commits, given)):
        subject = msg.split("\n", 1)[0].strip()
        if num is None:
            num = prev + 1
            nxt = next((n for n, _ in given[i + 1 :] if n is not None), None)
            if nxt is not None and num >= nxt:
                where = f"between {prev:04d} and {nxt:04d}" if prev else f"before {nxt:04d}"
                raise QueueError(
                    f"commit {sha[:12]} ({subject!r}) is a new patch {where}: no number is free "
                    "there. Give it a `Patch: NNNN-name` trailer and renumber the patches after "
                    "it to make room (their Patch: trailers)."
                )
        elif num <= prev:
            raise QueueError(
                f"commit {sha[:12]} ({subject!r}) is numbered {num:04d} after patch {prev:04d}: "
                "numbers must increase along the series (fix its `Patch:` trailer or the order)"
            )
        if num > 9999:
            raise QueueError(f"commit {sha[:12]}: patch number {num} has more than four digits")
        names.append(f"{num:04d}-{name or slug(subject)}")
        prev = num
    return names


def add_patch_trailer(text: str, name: str) -> str:
    """``text`` (format-patch output) with ``Patch: name`` appended to its message's trailers."""
    lines = text.split("\n")
    head_end = lines.index("")  # end of the mail header
    sep = lines.index("---", head_end)
    body = lines[head_end + 1 : sep]
    while body and body[-1] == "":
        body.pop()
    had_trailers = bool(parse_trailers("subject\n\n" + "\n".join(body)))
    body += ([] if had_trailers else [""]) + [f"Patch: {name}"]
    return "\n".join(lines[: head_end + 1] + body + lines[sep:])


# --------------------------------------------------------------------------------------------
# import / export / rebase


def prepare_dir(dest: Path, force: bool) -> None:
    if dest.exists() and any(dest.iterdir()):
        made_by_us = (dest / ".git" / MARKER).is_file()
        if not force or not made_by_us:
            raise QueueError(
                f"{dest} exists and is not empty; remove it or pick another --dir"
                + (
                    " (or pass --force to replace this queue, losing its unexported commits)"
                    if made_by_us
                    else ""
                )
            )
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def import_queue(
    wheel: Path,
    dest: Path,
    patch_dir: Path = PATCH_DIR,
    *,
    force: bool = False,
    quiet: bool = False,
    only: set[str] | None = None,
) -> None:
    """Pristine ``sglang/`` of ``wheel`` as the base commit of a new repository at ``dest``,
    tagged ``upstream-<version>``, and one commit per patch of the series (``git am``).
    ``only``: unpack just these files (``check`` needs only what the series touches).

    Raises:
        QueueError: naming the patch ``git am`` stopped at; the repository is left with the
            patches before it applied and ``git am`` waiting.
    """
    version = wheel_version(wheel)
    patches = series(patch_dir)
    dest = dest.resolve()
    prepare_dir(dest, force)
    git(dest, "init", "-q")
    (dest / ".git" / MARKER).write_text(
        json.dumps({"wheel": wheel.name, "version": version}) + "\n"
    )
    git(dest, "symbolic-ref", "HEAD", f"refs/heads/{BRANCH}")
    unpack_wheel(wheel, dest, only)
    base = commit_tree(dest, dest, f"sglang {version} (pristine, from {wheel.name})", None)
    git(dest, "update-ref", f"refs/heads/{BRANCH}", base)
    git(dest, "tag", f"{TAG_PREFIX}{version}", base)
    git(dest, "reset", "-q", base)  # the index, from the commit; the files are already there
    if not patches:
        return
    res = git(
        dest,
        "am",
        "--committer-date-is-author-date",
        "--quiet",
        *[str(p.resolve()) for p in patches],
        check=False,
    )
    if res.returncode != 0:
        nxt = dest / ".git" / "rebase-apply" / "next"
        i = int(nxt.read_text()) - 1 if nxt.is_file() else None
        name = patches[i].name if i is not None and i < len(patches) else "a patch"
        raise ImportStopped(
            f"import stopped at {name}: it does not apply to sglang {version} with the patches "
            f"before it applied.\n{res.stdout}{res.stderr}\n"
            f"{dest} holds upstream and the patches before it as commits, and git am waits on "
            f"{name}. To go on:\n"
            f"  cd {dest}\n"
            "  git apply --reject .git/rebase-apply/patch   # applies what fits, writes *.rej\n"
            "  # edit the files to do what the .rej hunks did, delete the .rej files, git add them\n"
            "  git am --continue        # or: git am --skip, to drop the patch\n"
            "then `make patches-export` writes the series back into patches/.",
            name,
            res.stdout + res.stderr,
        )
    if not quiet:
        print(
            f"imported {len(patches)} patches onto {TAG_PREFIX}{version} in {dest} "
            f"(branch {BRANCH}); edit and commit there, then `make patches-export`"
        )


def format_queue(src: Path) -> tuple[str, list[tuple[str, str]]]:
    """The queue in ``src`` as patch files: (upstream version, [(file name, text)])."""
    src = src.resolve()
    what = in_progress(src)
    if what:
        raise QueueError(f"a {what} is in progress in {src}; finish it (or abort it) first")
    dirty = git(src, "status", "--porcelain", "--untracked-files=no").stdout
    if dirty.strip():
        raise QueueError(
            f"{src} has uncommitted changes; commit them into their patch first "
            f"(git commit --fixup=<commit> and git rebase -i --autosquash {TAG_PREFIX}..., or "
            f"a new commit for a new patch):\n{dirty}"
        )
    untracked = [
        line[3:]
        for line in git(src, "status", "--porcelain", "--untracked-files=all").stdout.splitlines()
        if line.startswith("?? ") and "__pycache__/" not in line and not line.endswith(".pyc")
    ]
    if untracked:
        print(
            f"warning: untracked files in {src} are not exported (git add and commit the ones "
            f"a patch needs): {', '.join(untracked)}",
            file=sys.stderr,
        )
    tag = base_tag(src)
    version = tag[len(TAG_PREFIX) :]
    if git(src, "rev-list", "--merges", f"{tag}..HEAD").stdout.strip():
        raise QueueError(
            f"{src}: the queue above {tag} has merge commits; keep it linear (git rebase)"
        )
    shas = git(src, "rev-list", "--reverse", f"{tag}..HEAD").stdout.split()
    commits = [(s, git(src, "log", "-1", "--format=%B", s).stdout) for s in shas]
    names = plan_names(commits)
    out = []
    for (sha, msg), name in zip(commits, names):
        text = git(src, *FORMAT_PATCH, "-1", sha).stdout
        if "\ndiff --git " not in text:
            raise QueueError(
                f"commit {sha[:12]} ({msg.splitlines()[0]!r}) changes nothing; drop it "
                f"(git rebase -i {tag})"
            )
        if parse_trailers(msg).get("Patch") is None:
            text = add_patch_trailer(text, name)
        out.append((f"{name}.patch", text))
    return version, out


def write_series(patch_dir: Path, version: str, files: list[tuple[str, str]]) -> list[str]:
    """Write the patch files and ``series`` into ``patch_dir``, removing ``*.patch`` files that
    are no longer in the queue. Returns one line per change."""
    patch_dir.mkdir(parents=True, exist_ok=True)
    report = []
    keep = {n for n, _ in files}
    for old in sorted(patch_dir.glob("*.patch")):
        if old.name not in keep:
            old.unlink()
            report.append(f"removed   {old.name}")
    for name, text in files:
        p = patch_dir / name
        old = p.read_text(encoding="utf-8") if p.is_file() else None
        if old != text:
            p.write_text(text, encoding="utf-8")
            report.append(f"{'updated' if old is not None else 'new':9} {name}")
    text = SERIES_HEADER.format(version=version) + "".join(f"{n}\n" for n, _ in files)
    s = patch_dir / "series"
    if not s.is_file() or s.read_text(encoding="utf-8") != text:
        s.write_text(text, encoding="utf-8")
        report.append("updated   series")
    return report


def export_queue(src: Path, patch_dir: Path = PATCH_DIR) -> list[str]:
    version, files = format_queue(src)
    return write_series(patch_dir, version, files)


def rebase_queue(wheel: Path, repo: Path) -> None:
    """Commit the new wheel's ``sglang/`` as a child of the current base, tag it, and rebase
    the queue onto it (git stops at each patch that conflicts)."""
    version = wheel_version(wheel)
    repo = repo.resolve()
    what = in_progress(repo)
    if what:
        raise QueueError(f"a {what} is in progress in {repo}; finish it (or abort it) first")
    if git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise QueueError(f"{repo} has uncommitted changes; commit or drop them first")
    old = base_tag(repo)
    new = f"{TAG_PREFIX}{version}"
    if git(repo, "rev-parse", "-q", "--verify", f"refs/tags/{new}", check=False).returncode == 0:
        raise QueueError(f"{repo} already has the tag {new}")
    with tempfile.TemporaryDirectory() as tmp:
        unpack_wheel(wheel, Path(tmp))
        base = commit_tree(repo, Path(tmp), f"sglang {version} (pristine, from {wheel.name})", old)
    git(repo, "tag", new, base)
    res = git(repo, "rebase", "--onto", new, old, check=False)
    if res.returncode != 0:
        raise QueueError(
            f"rebase onto {new} stopped at a patch that does not apply:\n{res.stdout}{res.stderr}\n"
            f"To go on: cd {repo}; fix the conflicted files (git status lists them), git add "
            "them, git rebase --continue (git rebase --skip drops the patch); repeat until the "
            "rebase ends, then `make patches-export` (and bump the pinned version: "
            "scripts/setup.sh, Makefile)."
        )
    print(f"rebased the queue from {old} onto {new} in {repo}; now `make patches-export`")


# --------------------------------------------------------------------------------------------
# check


def cmd_check(wheel: Path, patch_dir: Path = PATCH_DIR) -> None:
    """Every patch applies in order with ``patch -p1`` (what ``make setup`` runs), and the
    series is exactly what import + export make of it.

    Raises:
        QueueError: naming the first patch that does not apply, or the files that do not
            round-trip.
    """
    patches = series(patch_dir)
    only = touched_paths(patches)  # the output depends on these files alone
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "site"
        unpack_wheel(wheel, tree, only)
        for p in patches:
            res = run_patch(p, tree)
            if res.returncode != 0:
                raise QueueError(
                    f"FAIL {p.name} does not apply after the patches before it:\n{res.stdout}{res.stderr}"
                )
            if "offset" in res.stdout or "fuzz" in res.stdout:
                print(f"ok   {p.name} (applies with offset/fuzz; refresh it)\n{res.stdout}")
            else:
                print(f"ok   {p.name}")
        queue, out = Path(tmp) / "queue", Path(tmp) / "out"
        try:
            import_queue(wheel, queue, patch_dir, quiet=True, only=only)
            version, files = format_queue(queue)
        except ImportStopped as e:
            raise QueueError(
                f"FAIL round trip: git am stopped at {e.name} (patch -p1 applied it, git am "
                f"needs exact context):\n{e.output}\nRefresh it: `make patches-import` stops "
                "there and says how to go on; then `make patches-export`."
            ) from None
        except QueueError as e:
            raise QueueError(f"FAIL round trip: {e}") from None
        write_series(out, version, files)
        differ = []
        for p in [patch_dir / "series"] + patches:
            mine = p.read_text(encoding="utf-8")
            theirs = (out / p.name).read_text(encoding="utf-8") if (out / p.name).is_file() else ""
            if mine != theirs:
                diff = difflib.unified_diff(
                    mine.splitlines(True),
                    theirs.splitlines(True),
                    f"patches/{p.name}",
                    f"exported/{p.name}",
                    n=1,
                )
                differ.append((p.name, "".join(list(diff)[:40])))
        extra = sorted({n for n, _ in files} - {p.name for p in patches})
        if differ or extra:
            raise QueueError(
                "FAIL round trip: patches/ is not what `patch_queue.py export` writes after "
                f"`import` ({', '.join([n for n, _ in differ] + extra)}): a patch was edited by "
                "hand. Run `make patches-import`, make the change there as a commit, then "
                "`make patches-export`, and commit patches/.\n" + "\n".join(d for _, d in differ)
            )
    print(
        f"check-patches: {len(patches)} patches apply cleanly to {wheel.name} and round-trip "
        "through import/export"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("apply", "status"):
        sp = sub.add_parser(name)
        sp.add_argument("--site-packages", type=Path, required=True)
    # command: (takes --wheel, takes --dir, takes --patches)
    for name, wheel, queue, patches in (
        ("check", True, False, True),
        ("import", True, True, True),
        ("export", False, True, True),
        ("rebase", True, True, False),
    ):
        sp = sub.add_parser(name)
        if wheel:
            sp.add_argument("--wheel", type=Path, required=True)
        if queue:
            sp.add_argument("--dir", type=Path, required=True)
        if patches:
            sp.add_argument("--patches", type=Path, default=PATCH_DIR)
        if name == "import":
            sp.add_argument(
                "--force", action="store_true", help="replace a queue that import made earlier"
            )
    args = ap.parse_args()
    try:
        if args.cmd == "apply":
            cmd_apply(args.site_packages)
        elif args.cmd == "status":
            print(status(args.site_packages))
        elif args.cmd == "check":
            cmd_check(args.wheel, args.patches)
        elif args.cmd == "import":
            import_queue(args.wheel, args.dir, args.patches, force=args.force)
        elif args.cmd == "export":
            report = export_queue(args.dir, args.patches)
            print("\n".join(report) if report else f"{args.patches}: unchanged")
        else:
            rebase_queue(args.wheel, args.dir)
    except QueueError as e:
        sys.exit(str(e))


if __name__ == "__main__":
    main()
