"""JIT build and load of the CUDA C++ kernels (the ``ternop::linear_cuda*`` ops of ``cpp_ops.py``).

The extension is optional: without CUDA, nvcc or a working compiler, ``load()`` returns
the reason and the registry skips the C++ backends (``cuda_gemv``, ``cuda_mma``,
``cuda_mma_a8``, ``cuda_mma_a8_fused``, ``cuda_mma_tiles``, ``cuda_wgmma``, ``cuda_wgmma_a8``, ``cuda_dequant``). The build
runs once per process at most, on the first CUDA call that could use it; its output is cached under
``$TERNOP_CUDA_CACHE`` (default ``~/.cache/ternop/cuda``), one folder per torch/CUDA/arch and per
content of ``csrc/`` (headers included). So another ternop version, or an edited kernel, never
builds on top of an older build's objects, whether or not ninja's dependency files would have
caught the change (torch can turn nvcc's off with TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES=1).
``TERNOP_NO_CUDA_EXT=1`` turns it off.

On a compute-capability 9.0 GPU (H100, H200) the build targets ``sm_90a``, the
architecture-specific target that Hopper's ``wgmma`` needs (``ternary_wgmma.cu``); ``wgmma_built()``
says whether the loaded build has it. A ``TORCH_CUDA_ARCH_LIST`` set by the user is kept as given,
and without ``9.0a`` in it the ``cuda_wgmma`` and ``cuda_wgmma_a8`` backends stay off.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from pathlib import Path

import torch

from ternop.cuda.cpp_ops import OPS, has_kernel

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    CSRC / "linear_cuda.cpp",
    CSRC / "ternary_gemv.cu",
    CSRC / "ternary_mma.cu",
    CSRC / "ternary_mma_a8.cu",
    CSRC / "ternary_dequant.cu",
    CSRC / "ternary_mma_tiles.cu",
    CSRC / "ternary_wgmma.cu",
    CSRC / "ternary_wgmma_a8.cu",
    CSRC / "ternary_wgmma_a8_ss.cu",
)
ENV_CACHE = "TERNOP_CUDA_CACHE"
ENV_DISABLE = "TERNOP_NO_CUDA_EXT"

_state: dict[str, object] = {}


def sources_digest(csrc: Path | None = None) -> str:
    """12 hex digits of SHA-256 over every file in ``csrc`` (default: the kernel sources), names and
    bytes, in name order."""
    h = hashlib.sha256()
    for path in sorted(p for p in (csrc or CSRC).iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def cache_dir(capability: tuple[int, int]) -> Path:
    root = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "ternop" / "cuda")
    tag = f"torch{torch.__version__.replace('+', '_')}-cuda{torch.version.cuda}-sm{capability[0]}{capability[1]}"
    return root / f"{tag}-{sources_digest()}"


def arch_list_for(capability: tuple[int, int]) -> str:
    """The TORCH_CUDA_ARCH_LIST of a build for this GPU only: "9.0a" on Hopper (wgmma), else "X.Y"."""
    major, minor = capability
    return f"{major}.{minor}a" if (major, minor) == (9, 0) else f"{major}.{minor}"


def _compiler() -> list[str]:
    """The C++ compiler torch's extension builder runs: ``$CXX``, else ``c++``."""
    return shlex.split(os.environ.get("CXX") or "c++")


def loaded_libstdcxx(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the libstdc++ this process has loaded (torch's), or None."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (which may hold spaces)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libstdc++.so"):
            return fields[5]
    return None


def runtime_link_flags(compiler: list[str], loaded: str | None) -> tuple[list[str], str]:
    """Link flags that give the extension the process's own C++ runtime -> (flags, reason it cannot).

    A compiler that has no shared libstdc++ (``-print-file-name=libstdc++.so`` finds none) links a
    static copy into the extension. Two copies of libstdc++ in one process do not share iostreams'
    locale: the first error an op raised (a TORCH_CHECK message built with ``<<``) crashed the
    process with a segmentation fault instead of raising RuntimeError. Naming the loaded
    ``libstdc++.so`` on the link line resolves the runtime's symbols there, before the static
    archive is searched. Without one loaded, the build is refused with the reason."""
    try:
        found = subprocess.run([*compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return [], ""  # the build itself will say what is wrong with the compiler
    if os.path.isabs(found):
        return [], ""  # the compiler links the shared runtime itself
    if loaded is None:
        return [], (f"{' '.join(compiler)} has no shared libstdc++ and this process has none loaded: a static copy "
                    "in the extension would crash on an op's first error; set CXX to a compiler that links "
                    "libstdc++ dynamically")  # fmt: skip
    return [loaded], ""


def _build() -> tuple[bool, str]:
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return False, f"disabled by {ENV_DISABLE}"
    if all(has_kernel(op) for op in OPS):
        return True, ""  # already registered (an earlier load in this process)
    if torch.version.cuda is None or not torch.cuda.is_available():
        return False, "torch has no CUDA device"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return False, "nvcc not found (CUDA_HOME is unset)"
    capability = torch.cuda.get_device_capability()
    build_dir = cache_dir(capability)
    ldflags, refused = runtime_link_flags(_compiler(), loaded_libstdcxx())
    if refused:
        return False, refused
    build_dir.mkdir(parents=True, exist_ok=True)
    # Build for this GPU only: one cubin, and a short compile. The variable is restored
    # afterwards so that other extensions built in this process are not affected.
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    arch_list = saved or arch_list_for(capability)
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    _state["wgmma"] = "9.0a" in arch_list.replace(";", " ").split()
    try:
        cpp_extension.load(
            name="ternop_cuda_ext",
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17"],
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # any compiler or loader failure makes the backend unavailable
        return False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
    missing = [op for op in OPS if not has_kernel(op)]
    if missing:
        return False, f"the library loaded but registered no CUDA kernel for ternop::{', ternop::'.join(missing)}"
    return True, ""


def wgmma_built() -> bool:
    """Whether the loaded build targets sm_90a, so that ``linear_cuda_wgmma`` runs its kernel."""
    return bool(load()[0] and _state.get("wgmma", False))


def load() -> tuple[bool, str]:
    """Builds (once) and loads the extension. Returns (ok, reason)."""
    if "result" not in _state:
        _state["result"] = _build()
    return _state["result"]  # type: ignore[return-value]
