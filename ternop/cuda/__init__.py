"""CUDA backends of ``ternop::linear``: Triton GEMV/GEMM and a CUDA C++ small-M kernel.

``ternop.ops`` imports this package on the first CUDA call, never at ``import ternop``.
Importing it only registers the backends; triton is imported and the C++ extension is
built lazily, the first time a backend is asked whether it can run a call.
"""

from ternop.cuda import cpp_ops as _cpp_ops  # noqa: F401  (schemas of the C++ ops)
from ternop.cuda.registry import register_all as _register_all

_register_all()
