"""benchmarks/stamp.py: a result names the commit whose code ran, and says when the tree differs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(repo: Path, *args: str) -> str:
    return subprocess.run(list(args), cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(BENCH / "stamp.py", tmp_path / "benchmarks" / "stamp.py")
    (tmp_path / "kernel.cu").write_text("// v1\n")
    (tmp_path / "benchmarks" / "results" / "old.json").write_text("{}\n")
    for args in (("init", "-q"), ("add", "-A"),
                 ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")):
        _run(tmp_path, "git", *args)
    monkeypatch.delenv("TERNOP_BENCH_COMMIT", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "benchmarks"))
    sys.modules.pop("stamp", None)
    yield tmp_path
    sys.modules.pop("stamp", None)


def test_stamp_is_head_on_a_clean_tree_and_marks_changed_code(repo, monkeypatch):
    import stamp

    head = _run(repo, "git", "rev-parse", "HEAD")
    short = _run(repo, "git", "rev-parse", "--short", "HEAD")
    assert stamp.git_commit() == head
    assert stamp.git_commit(short=True) == short
    # A result written or rewritten by the run, and untracked files, leave the stamp alone.
    (repo / "benchmarks" / "results" / "old.json").write_text('{"new": 1}\n')
    (repo / "benchmarks" / "results" / "new.json").write_text("{}\n")
    (repo / "scratch.txt").write_text("x\n")
    assert stamp.git_commit() == head
    # Changed code is not HEAD's code.
    (repo / "kernel.cu").write_text("// v2\n")
    assert stamp.git_commit() == f"{head}-dirty"
    # Run as a script (ab_trees.sh names its files after it): the short form, marked the same way.
    script = subprocess.run([sys.executable, str(repo / "benchmarks" / "stamp.py")], cwd=repo, check=True,
                            capture_output=True, text=True)
    assert script.stdout.strip() == f"{short}-dirty"
    # Named by hand where the copy's metadata cannot say.
    monkeypatch.setenv("TERNOP_BENCH_COMMIT", "abc1234")
    assert stamp.git_commit() == "abc1234"
