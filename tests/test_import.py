import subprocess
import sys

LEAN_IMPORT = """
import sys
import torch
import ternop
assert hasattr(torch.ops.ternop, "linear"), "import ternop must register the op"
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "triton", "transformers"))
assert not heavy, f"import ternop pulled in {heavy}"
assert not torch.cuda.is_initialized(), "import ternop initialised CUDA"
print("lean")
"""


def test_import_is_lean():
    out = subprocess.run([sys.executable, "-c", LEAN_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lean"


def test_cli_help_is_lean():
    code = (
        "import sys; from ternop import cli; "
        "cli.build_parser(); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'triton', 'transformers')); "
        "assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
