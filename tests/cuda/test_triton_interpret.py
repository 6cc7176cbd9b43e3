"""The Triton kernels on CPU under TRITON_INTERPRET=1 (CI has no GPU). Takes a few seconds.

The check runs in a subprocess: the variable must be set before triton is imported, and
it must not leak into the rest of the suite.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _triton_version() -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = version("triton").split(".")[:2]
    return int(major), int(minor)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is not None and _triton_version() < (3, 9),
    reason="needs triton >= 3.9: the 3.6 interpreter cannot index range() by a runtime bound here",
)
def test_triton_kernels_interpreted_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("triton_interpret_check.py"))],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"interpreter check failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count(" ok") == 24 and "FAIL" not in proc.stdout, proc.stdout
