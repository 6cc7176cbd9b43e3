"""The JIT build: its cache folder follows the kernel sources, headers included, and it links the C++ runtime
that the process already runs (no GPU needed)."""

from __future__ import annotations

import shutil

import pytest
import torch

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


def _compiler_script(tmp_path, runtime: str):
    """A compiler that answers ``-print-file-name=libstdc++.so`` with ``runtime`` and links libstdc++
    statically, as a GCC that ships only libstdc++.a does."""
    script = tmp_path / "cxx"
    script.write_text(f'#!/bin/sh\n[ "$1" = "-print-file-name=libstdc++.so" ] && echo {runtime} && exit 0\n'
                      'exec g++ -static-libstdc++ "$@"\n')  # fmt: skip
    script.chmod(0o755)
    return [str(script)]


def test_loaded_libstdcxx_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 08:01 1 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /opt/lib/libstdc++.so.6.0.33\n"
                    "7f04-7f05 rw-p 00000000 00:00 0\n")  # fmt: skip
    assert cuda_ext.loaded_libstdcxx(maps) == "/opt/lib/libstdc++.so.6.0.33"
    maps.write_text("7f00-7f01 r--p 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert cuda_ext.loaded_libstdcxx(maps) is None
    assert cuda_ext.loaded_libstdcxx(tmp_path / "missing") is None


def test_runtime_link_flags_name_the_loaded_runtime_only_for_a_static_only_compiler(tmp_path):
    shared = _compiler_script(tmp_path, "/usr/lib/libstdc++.so")
    assert cuda_ext.runtime_link_flags(shared, "/lib/libstdc++.so.6") == ([], "")
    static = _compiler_script(tmp_path, "libstdc++.so")  # a bare name: no shared runtime found
    assert cuda_ext.runtime_link_flags(static, "/lib/libstdc++.so.6") == (["/lib/libstdc++.so.6"], "")
    flags, refused = cuda_ext.runtime_link_flags(static, None)
    assert flags == [] and "no shared libstdc++" in refused and "CXX" in refused


_PROBE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor probe_fail(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(k == 0, "probe: k must be 0; got ", k);
  return x;
}
TORCH_LIBRARY(ternop_runtime_probe, m) { m.def("fail(Tensor x, int k) -> Tensor"); }
TORCH_LIBRARY_IMPL(ternop_runtime_probe, CPU, m) { m.impl("fail", &probe_fail); }
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or cuda_ext.loaded_libstdcxx() is None,
                    reason="needs g++ and a loaded libstdc++")  # fmt: skip
def test_an_op_built_by_a_static_only_compiler_raises_its_error_intact(tmp_path, monkeypatch):
    """With a static libstdc++ in the extension, a TORCH_CHECK's message loses its number on this CPU (on an H200
    machine whose compiler ships only libstdc++.a it crashed the process); linked with the flags of
    ``runtime_link_flags`` it raises RuntimeError, whole."""
    from torch.utils.cpp_extension import load_inline

    compiler = _compiler_script(tmp_path, "libstdc++.so")
    monkeypatch.setenv("CXX", compiler[0])
    flags, refused = cuda_ext.runtime_link_flags(cuda_ext._compiler(), cuda_ext.loaded_libstdcxx())
    assert flags and not refused
    (tmp_path / "build").mkdir()
    load_inline(name="ternop_runtime_probe", cpp_sources=[_PROBE], is_python_module=False, extra_ldflags=flags,
                build_directory=str(tmp_path / "build"), verbose=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="probe: k must be 0; got 3"):
        torch.ops.ternop_runtime_probe.fail(torch.ones(2), 3)
