"""scripts/patch_queue.py on a tiny fake wheel and a series of two patches (no sglang needed).

Covers the round trip (import then export changes nothing, byte for byte), an edit made in the
queue showing up in the exported patch, a new commit's number and name, a patch that does not
apply being named by import and by check, a hand-edited patch failing check, the header that
export writes, ``apply`` with patch(1), and ``rebase`` onto a new wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "patch_queue.py"

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or shutil.which("patch") is None, reason="needs git and patch"
)

UPSTREAM = {
    "sglang/__init__.py": "",
    "sglang/srt/server.py": "".join(f"line {i}\n" for i in range(1, 31)),
    "sglang/srt/util.py": "def helper():\n    return 1\n",
}
AUTHOR = {
    "GIT_AUTHOR_NAME": "Dev",
    "GIT_AUTHOR_EMAIL": "dev@example.com",
    "GIT_AUTHOR_DATE": "2026-11-30T10:00:00+0000",
}


def make_wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"sglang-{path.name.split('-')[1]}.dist-info/METADATA", "Name: sglang\n")
    return path


def pq(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise AssertionError(f"patch_queue {' '.join(args)} failed:\n{res.stdout}{res.stderr}")
    return res


def git_env() -> dict:
    return {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_COMMITTER_NAME": "Dev",
        "GIT_COMMITTER_EMAIL": "dev@example.com",
        **AUTHOR,
    }


def git(repo: Path, *args: str, env: dict | None = None, input: str | None = None) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**git_env(), **(env or {})},
        input=input,
    ).stdout


def commit(repo: Path, message: str, *args: str) -> None:
    """Commit every tracked change in ``repo`` (``args``: e.g. ``--fixup=SHA``, no message)."""
    if args:
        git(repo, "commit", "-q", "-a", *args)
    else:
        git(repo, "commit", "-q", "-a", "-F", "-", input=message)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.fixture()
def world(tmp_path: Path):
    """A wheel, and patches/ holding two exported patches (0001, 0005) made through the queue."""
    wheel = make_wheel(tmp_path / "sglang-0.0.1-py3-none-any.whl", UPSTREAM)
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("")
    queue = tmp_path / "queue"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    edit(queue / "sglang/srt/server.py", "line 3\n", "line three\n")
    commit(
        queue,
        "Name line three in words\n\nWhat: line 3 reads three.\n\n"
        'Upstream: not filed (would become "Words"); drop when upstream says three\n'
        "Patch: 0001-line-three\n",
    )
    edit(queue / "sglang/srt/util.py", "return 1", "return 2")
    commit(
        queue,
        "Helper returns two\n\nWhy: two is better.\n\n"
        "Upstream: https://github.com/sgl-project/sglang/pull/1\nPatch: 0005\n",
    )
    pq("export", "--dir", str(queue), "--patches", str(patches))
    shutil.rmtree(queue)
    return tmp_path, wheel, patches


def snapshot(patches: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(patches.iterdir())}


def test_export_writes_format_patch_files_and_series(world):
    _, _, patches = world
    assert (patches / "series").read_text().splitlines()[-2:] == [
        "0001-line-three.patch",
        "0005-helper-returns-two.patch",
    ]
    text = (patches / "0001-line-three.patch").read_text()
    head, _, diff = text.partition("\n---\n")
    assert head.splitlines()[:4] == [
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001",
        "From: Dev <dev@example.com>",
        "Date: Mon, 30 Nov 2026 10:00:00 +0000",
        "Subject: [PATCH] Name line three in words",
    ]
    assert 'Upstream: not filed (would become "Words"); drop when upstream says three' in head
    assert "diff --git a/sglang/srt/server.py b/sglang/srt/server.py" in diff
    assert "+line three" in diff and not text.rstrip().endswith("2.39.5")  # no signature


def test_import_then_export_is_byte_identical(world):
    tmp, wheel, patches = world
    before = snapshot(patches)
    queue = tmp / "q"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    log = git(queue, "log", "--format=%s", "upstream-0.0.1..HEAD").splitlines()
    assert log == ["Helper returns two", "Name line three in words"]  # one commit per patch
    res = pq("export", "--dir", str(queue), "--patches", str(patches))
    assert "unchanged" in res.stdout
    assert snapshot(patches) == before
    pq("check", "--wheel", str(wheel), "--patches", str(patches))


def test_edit_in_queue_shows_up_in_exported_patch(world):
    tmp, wheel, patches = world
    queue = tmp / "q"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    first = git(queue, "rev-list", "--reverse", "upstream-0.0.1..HEAD").split()[0]
    edit(queue / "sglang/srt/server.py", "line 20\n", "line twenty\n")
    res = pq("export", "--dir", str(queue), "--patches", str(patches), check=False)
    assert res.returncode != 0 and "uncommitted changes" in res.stderr
    (queue / "sglang/srt/new_module.py").write_text("x = 1\n")  # never added: warned about
    commit(queue, "", f"--fixup={first}")
    git(
        queue,
        "rebase",
        "-q",
        "-i",
        "--autosquash",
        "upstream-0.0.1",
        env={"GIT_SEQUENCE_EDITOR": "true"},
    )
    res = pq("export", "--dir", str(queue), "--patches", str(patches))
    assert res.stdout.split() == ["updated", "0001-line-three.patch"]
    assert "untracked files" in res.stderr and "sglang/srt/new_module.py" in res.stderr
    text = (patches / "0001-line-three.patch").read_text()
    assert "+line three" in text and "+line twenty" in text
    assert "twenty" not in (patches / "0005-helper-returns-two.patch").read_text()
    pq("check", "--wheel", str(wheel), "--patches", str(patches))


def test_new_commit_gets_next_number_and_its_trailer(world):
    tmp, wheel, patches = world
    queue = tmp / "q"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    edit(queue / "sglang/srt/server.py", "line 30\n", "line 30\nline 31\n")
    commit(
        queue,
        "Add line 31 (the last)\n\nWhat: one more line.\n\n"
        'Upstream: not filed (would become "More"); drop when upstream has 31 lines\n',
    )
    pq("export", "--dir", str(queue), "--patches", str(patches))
    new = patches / "0006-add-line-31-the-last.patch"
    assert new.is_file()
    assert (patches / "series").read_text().splitlines()[-1] == new.name
    assert "\nPatch: 0006-add-line-31-the-last\n---\n" in new.read_text()
    # The trailer export added makes the next import + export reproduce the same bytes.
    pq("check", "--wheel", str(wheel), "--patches", str(patches))


def test_commit_without_upstream_trailer_is_refused(world):
    tmp, wheel, patches = world
    queue = tmp / "q"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    edit(queue / "sglang/srt/util.py", "return 2", "return 3")
    commit(queue, "Three\n\nNo status.\n")
    res = pq("export", "--dir", str(queue), "--patches", str(patches), check=False)
    assert res.returncode != 0 and "`Upstream:` trailer" in res.stderr


def test_patch_that_does_not_apply_is_named(world):
    tmp, _, patches = world
    # Upstream moved: the line patch 0005 changes is gone.
    other = make_wheel(
        tmp / "sglang-0.0.2-py3-none-any.whl",
        {**UPSTREAM, "sglang/srt/util.py": "def helper():\n    return 10\n"},
    )
    res = pq(
        "import",
        "--wheel",
        str(other),
        "--dir",
        str(tmp / "q"),
        "--patches",
        str(patches),
        check=False,
    )
    assert res.returncode != 0
    assert "import stopped at 0005-helper-returns-two.patch" in res.stderr
    assert "git am --continue" in res.stderr
    res = pq("check", "--wheel", str(other), "--patches", str(patches), check=False)
    assert res.returncode != 0
    assert "FAIL 0005-helper-returns-two.patch does not apply" in res.stderr
    assert "ok   0001-line-three.patch" in res.stdout


def test_hand_edited_patch_fails_check(world):
    _, wheel, patches = world
    p = patches / "0001-line-three.patch"
    # A message edited by hand round-trips (git am keeps it); a diff edited by hand does not
    # (here the index line's blob id no longer matches the new text).
    edit(p, "What: line 3 reads three.", "What: line 3 reads three (edited by hand).")
    pq("check", "--wheel", str(wheel), "--patches", str(patches))
    edit(p, "+line three\n", "+line 3rd\n")
    res = pq("check", "--wheel", str(wheel), "--patches", str(patches), check=False)
    assert res.returncode != 0
    assert "FAIL round trip" in res.stderr and "0001-line-three.patch" in res.stderr
    assert "make patches-import" in res.stderr


def test_unlisted_patch_fails_check(world):
    _, wheel, patches = world
    (patches / "0009-stray.patch").write_text("")
    res = pq("check", "--wheel", str(wheel), "--patches", str(patches), check=False)
    assert res.returncode != 0 and "not listed in patches/series" in res.stderr


def test_exported_patches_apply_with_patch_p1(world):
    tmp, wheel, patches = world
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    for name in ("0001-line-three.patch", "0005-helper-returns-two.patch"):
        subprocess.run(
            ["patch", "-p1", "--batch", "-d", str(site), "-i", str(patches / name)],
            check=True,
            capture_output=True,
        )
    assert "line three\n" in (site / "sglang/srt/server.py").read_text()
    assert "return 2" in (site / "sglang/srt/util.py").read_text()


def test_rebase_onto_new_wheel(world):
    tmp, wheel, patches = world
    queue = tmp / "q"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    # The new upstream adds a line at the top of server.py: the patches still apply, shifted.
    bumped = {**UPSTREAM, "sglang/srt/server.py": "header\n" + UPSTREAM["sglang/srt/server.py"]}
    new = make_wheel(tmp / "sglang-0.0.2-py3-none-any.whl", bumped)
    pq("rebase", "--wheel", str(new), "--dir", str(queue))
    assert git(queue, "describe", "--tags", "--abbrev=0", "HEAD").strip() == "upstream-0.0.2"
    pq("export", "--dir", str(queue), "--patches", str(patches))
    assert "sglang==0.0.2" in (patches / "series").read_text()
    assert "@@ -1,7 +1,7 @@" in (patches / "0001-line-three.patch").read_text()  # moved down
    pq("check", "--wheel", str(new), "--patches", str(patches))


def test_rebase_stops_at_conflicting_patch(world):
    tmp, wheel, patches = world
    queue = tmp / "q"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    bumped = {
        **UPSTREAM,
        "sglang/srt/server.py": UPSTREAM["sglang/srt/server.py"].replace("line 3\n", "line III\n"),
    }
    new = make_wheel(tmp / "sglang-0.0.2-py3-none-any.whl", bumped)
    res = pq("rebase", "--wheel", str(new), "--dir", str(queue), check=False)
    assert res.returncode != 0 and "git rebase --continue" in res.stderr
    assert "Name line three in words" in res.stderr + res.stdout  # the patch git stopped at
    res = pq("export", "--dir", str(queue), "--patches", str(patches), check=False)
    assert res.returncode != 0 and "in progress" in res.stderr


def test_new_commit_between_taken_numbers_needs_a_trailer(world):
    tmp, wheel, patches = world
    queue = tmp / "q"
    pq("import", "--wheel", str(wheel), "--dir", str(queue), "--patches", str(patches))
    edit(queue / "sglang/__init__.py", "", "x = 1\n")
    commit(queue, "Set x\n\nUpstream: not filed; drop when never\n")
    # Moved between 0001 and 0005, the new commit gets 0002.
    swap_2_3 = "sed -i -n '2{h;d};3{p;x;p;d};p'"  # pick order 1 2 3 -> 1 3 2
    git(queue, "rebase", "-q", "-i", "upstream-0.0.1", env={"GIT_SEQUENCE_EDITOR": swap_2_3})
    pq("export", "--dir", str(queue), "--patches", str(patches))
    assert (patches / "series").read_text().splitlines()[-3:] == [
        "0001-line-three.patch",
        "0002-set-x.patch",
        "0005-helper-returns-two.patch",
    ]
    # Moved before 0001 (and its trailer dropped), it has no number to take.
    git(queue, "reset", "-q", "--hard", "HEAD~2")  # back to 0001 alone
    edit(queue / "sglang/__init__.py", "", "y = 1\n")
    commit(queue, "Set y\n\nUpstream: not filed; drop when never\n")
    swap_1_2 = "sed -i -n '1{h;d};2{p;x;p;d};p'"  # pick order 1 2 -> 2 1
    git(queue, "rebase", "-q", "-i", "upstream-0.0.1", env={"GIT_SEQUENCE_EDITOR": swap_1_2})
    res = pq("export", "--dir", str(queue), "--patches", str(patches), check=False)
    assert res.returncode != 0
    assert "is a new patch before 0001: no number is free" in res.stderr


def test_patch_needing_fuzz_fails_check_round_trip(world):
    tmp, _, patches = world
    # A context line of patch 0001 changed upstream: patch(1) applies it with fuzz, git am not.
    other = make_wheel(
        tmp / "sglang-0.0.2-py3-none-any.whl",
        {
            **UPSTREAM,
            "sglang/srt/server.py": UPSTREAM["sglang/srt/server.py"].replace(
                "line 6\n", "line six\n"
            ),
        },
    )
    res = pq("check", "--wheel", str(other), "--patches", str(patches), check=False)
    assert res.returncode != 0
    assert "ok   0001-line-three.patch (applies with offset/fuzz" in res.stdout
    assert "FAIL round trip: git am stopped at 0001-line-three.patch" in res.stderr
