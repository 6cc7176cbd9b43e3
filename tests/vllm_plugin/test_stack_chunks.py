"""The frame-stack chunk allocator: CPython's cost at a chunk edge, and the allocator removing it.

Each check runs in a fresh interpreter, so that the allocator it installs (process-wide, by
design) never reaches the test session, and the stack depths are those of a small script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ternop.vllm_plugin import stack_chunks

REPO = Path(__file__).resolve().parents[2]

# Calls a function with a large frame (`leaf`, 40 locals) at every depth from 0 to 500 in a
# loop: at the depths where `leaf`'s frame no longer fits in the current chunk, each call maps a
# new chunk, touches it and unmaps it on return. The frame of `at_depth` is smaller than
# `leaf`'s, so no chunk edge is stepped over without such a depth.
_SCAN = textwrap.dedent(
    """
    import json, resource, sys, time
    sys.path.insert(0, {repo!r})
    from ternop.vllm_plugin import stack_chunks

    ARGS = ", ".join(f"a{{i}}=0" for i in range(40))
    exec(f"def leaf({{ARGS}}):\\n    return a0")
    CALLS = 2000

    def spin():
        for _ in range(CALLS):
            leaf()

    def at_depth(k):
        if k:
            return at_depth(k - 1)
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        spin()
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0

    def worst():
        return max(at_depth(k) for k in range(500))

    before = worst()
    installed = stack_chunks.keep_stack_chunks()
    again = stack_chunks.keep_stack_chunks()
    after = worst()
    print(json.dumps({{"calls": CALLS, "before": before, "after": after, "installed": installed,
                      "again": again, "stats": stack_chunks.stats()}}))
    """
)


def _run(code: str, tmp_path: Path, enable: str | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, its allocator cached under tmp_path, with
    TERNOP_KEEP_STACK_CHUNKS set to ``enable`` (unset for None)."""
    env = {k: v for k, v in os.environ.items() if k != stack_chunks.ENV_ENABLE}
    env[stack_chunks.ENV_CACHE] = str(tmp_path / "cache")
    if enable is not None:
        env[stack_chunks.ENV_ENABLE] = enable
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(not stack_chunks.applies()[0], reason=stack_chunks.applies()[1] or "applies")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults with RUSAGE_THREAD (Linux)")
def test_chunk_edge_faults_on_every_call_until_the_allocator_keeps_the_chunk(tmp_path):
    done = _run(_SCAN.format(repo=str(REPO)), tmp_path)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    # Without the allocator some depth maps and faults in a chunk on (nearly) every call.
    assert r["before"] >= r["calls"] * 0.9, r
    assert r["installed"] is True and r["again"] is False, r
    # With it, the same loop at every depth keeps one chunk: a handful of faults at most.
    assert r["after"] < 50, r
    assert r["stats"]["reused"] >= r["calls"], r


def test_a_compiler_that_cannot_run_is_named_in_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv(stack_chunks.ENV_CACHE, str(tmp_path / "cache"))
    real = stack_chunks.sysconfig.get_config_var
    monkeypatch.setattr(stack_chunks.sysconfig, "get_config_var",
                        lambda name: str(tmp_path / "no-such-cc") if name == "CC" else real(name))  # fmt: skip
    with pytest.raises(RuntimeError, match="no-such-cc"):
        stack_chunks._build()
    assert not list((tmp_path / "cache").rglob("*.so")), "a failed build leaves no library behind"


def test_env_switch_and_applies(monkeypatch):
    for value, expected in (("1", True), ("yes", True), ("", True), ("0", False), ("off", False)):
        monkeypatch.setenv(stack_chunks.ENV_ENABLE, value)
        assert stack_chunks.enabled_by_env() is expected
    monkeypatch.delenv(stack_chunks.ENV_ENABLE)
    assert stack_chunks.enabled_by_env() is True  # on unless switched off
    ok, why = stack_chunks.applies()
    assert ok == (sys.version_info >= (3, 11) and sys.implementation.name == "cpython"
                  and not stack_chunks.sysconfig.get_config_var("Py_GIL_DISABLED")), why  # fmt: skip


_REGISTER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {repo!r})
    from ternop.vllm_plugin import register, stack_chunks
    register()
    print(json.dumps({{"stats": stack_chunks.stats()}}))
    """
)


@pytest.mark.vllm
@pytest.mark.skipif(not stack_chunks.applies()[0], reason=stack_chunks.applies()[1] or "applies")
@pytest.mark.parametrize("value", [None, "0"])
def test_plugin_registration_installs_the_allocator_unless_switched_off(tmp_path, value):
    pytest.importorskip("vllm")
    done = _run(_REGISTER.format(repo=str(REPO)), tmp_path, enable=value)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])["stats"]
    if value is None:  # on by default
        assert stats is not None, "register() did not install the allocator"
    else:
        assert stats is None, stats
