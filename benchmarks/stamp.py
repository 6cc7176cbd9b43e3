"""The git commit a benchmark result is stamped with."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Results a run writes into the tree do not make the code it ran differ from its commit.
_RESULTS = "benchmarks/results/"


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
    return out.stdout.rstrip("\n") if out.returncode == 0 else ""


def git_commit(short: bool = False) -> str:
    """HEAD of this checkout (abbreviated when ``short``), with "-dirty" when tracked files (results
    aside) differ from it, or $TERNOP_BENCH_COMMIT where a copy's git metadata is stale or missing.

    The suffix keeps a run of uncommitted code, or of a copy whose git metadata lags its files,
    from passing as a run of HEAD."""
    if os.environ.get("TERNOP_BENCH_COMMIT"):
        return os.environ["TERNOP_BENCH_COMMIT"]
    try:
        head = _git("rev-parse", *(["--short"] if short else []), "HEAD")
        if not head:
            return "unknown"
        changed = _git("status", "--porcelain", "--untracked-files=no").splitlines()
        dirty = [line for line in changed if not line[3:].startswith(_RESULTS)]
        return f"{head}-dirty" if dirty else head
    except OSError:
        return "unknown"


if __name__ == "__main__":  # the short stamp, for shell scripts that name files after it (ab_trees.sh)
    print(git_commit(short=True))
