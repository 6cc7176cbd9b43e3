"""The JIT build's cache folder follows the kernel sources, headers included (no GPU needed)."""

from __future__ import annotations

import shutil

from ternop.cuda import cuda_ext


def test_cache_dir_changes_with_any_source_file(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_ext.ENV_CACHE, str(tmp_path / "cache"))
    before = cuda_ext.cache_dir((9, 0))
    assert before.parent == tmp_path / "cache"
    assert before.name.endswith("-sm90-" + cuda_ext.sources_digest())

    csrc = tmp_path / "csrc"
    shutil.copytree(cuda_ext.CSRC, csrc)
    assert cuda_ext.sources_digest(csrc) == cuda_ext.sources_digest()
    header = csrc / "ternary_common.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    assert cuda_ext.sources_digest(csrc) != cuda_ext.sources_digest()
    monkeypatch.setattr(cuda_ext, "CSRC", csrc)  # the folder the build compiles
    assert cuda_ext.cache_dir((9, 0)) != before


def test_hopper_builds_for_sm90a_and_other_gpus_for_their_own_arch():
    """wgmma needs the architecture-specific sm_90a target; nothing else changes its build."""
    assert cuda_ext.arch_list_for((9, 0)) == "9.0a"
    assert cuda_ext.arch_list_for((8, 0)) == "8.0"
    assert cuda_ext.arch_list_for((10, 0)) == "10.0"
