"""The git commit a benchmark result is stamped with."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """HEAD of this checkout, or $TERNOP_BENCH_COMMIT where a copy's git metadata is stale or missing."""
    if os.environ.get("TERNOP_BENCH_COMMIT"):
        return os.environ["TERNOP_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"
