"""Import rules of docs/ARCHITECTURE.md, checked on the source: layers, no cycles, no private reach-ins, lean import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ternop"

LEAN_IMPORT = """
import sys
import torch
import ternop
assert hasattr(torch.ops.ternop, "linear"), "import ternop must register the op"
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "triton", "transformers", "sentence_transformers"))
assert not heavy, f"import ternop pulled in {heavy}"
assert not torch.cuda.is_initialized(), "import ternop initialised CUDA"
print("lean")
"""

# Which folders a folder may import (the op core is every module at the top of ternop/, meta/ and cuda/).
ALLOWED = {
    "core": {"core"},
    "checkpoint": {"checkpoint", "format"},
    "hf": {"hf", "core", "checkpoint"},
    "quant": {"quant", "core", "checkpoint", "hf"},
    "vllm_plugin": {"vllm_plugin", "core", "checkpoint"},
    "cli": {"cli", "core", "checkpoint", "hf", "quant", "vllm_plugin"},
}
# Third-party packages only some folders may import.
THIRD_PARTY = {"vllm": {"vllm_plugin", "cli"}, "transformers": {"hf"}, "sentence_transformers": {"hf"}}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _area(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED and parts[1] != "core":
        return parts[1]
    return "core"


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported ternop module or third-party top name, line) for every import, at any depth of the file."""
    out = []
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in modules else base, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {name for name, _ in _imports(p, modules) if name in modules and name != m} for m, p in modules.items()}


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


def test_writing_a_checkpoint_does_not_depend_on_the_op():
    """What the checkpoint writer imports, transitively, holds no op and no nn.Module layer.

    (``import ternop`` itself registers the op: that is the package's contract, cheap and CPU-only.)
    """
    graph = _graph()
    seen, todo = set(), ["ternop.checkpoint", "ternop.checkpoint.writer"]
    while todo:
        m = todo.pop()
        if m not in seen and m != "ternop":
            seen.add(m)
            todo += graph[m]
    assert not seen & {"ternop.ops", "ternop.modules", "ternop.backends", "ternop.cpu"}, sorted(seen)


def test_import_rules_between_folders():
    modules = _modules()
    bad = []
    for module, path in modules.items():
        area = _area(module)
        for name, line in _imports(path, modules):
            top = name.split(".")[0]
            if name in modules:
                target = "format" if name == "ternop.format" and area == "checkpoint" else _area(name)
                if name == "ternop":
                    continue  # the package itself: importing any ternop module runs it anyway
                if target not in ALLOWED[area]:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({area}) imports {name} ({target})")
            elif top in THIRD_PARTY and area not in THIRD_PARTY[top]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({area}) imports {top}")
    assert not bad, "imports against docs/ARCHITECTURE.md:\n" + "\n".join(bad)


def test_import_rules_checker_sees_a_violation(tmp_path, monkeypatch):
    """The rule above can fail: a checkpoint module importing the HF bridge is caught."""
    fake = ROOT / "checkpoint" / "reader.py"
    modules = _modules()
    src = fake.read_text() + "\nfrom ternop.hf import load_model\n"
    path = tmp_path / "ternop" / "checkpoint" / "reader.py"
    path.parent.mkdir(parents=True)
    path.write_text(src)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "ternop")
    names = [n for n, _ in _imports(path, modules)]
    assert "ternop.hf" in names and "hf" not in ALLOWED[_area("ternop.checkpoint.reader")]


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_names_across_folders():
    """``from X import _name`` and ``X._name`` only within X's own folder."""
    modules = _modules()
    bad = []
    for module, path in modules.items():
        folder = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ternop"):
                for a in node.names:
                    target = f"{node.module}.{a.name}"
                    if target in modules:
                        aliases[a.asname or a.name] = target
                    elif a.name.startswith("_") and not a.name.startswith("__") and node.module.rpartition(".")[0] != folder \
                            and node.module != folder:
                        bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                target = aliases[node.value.id]
                if target.rpartition(".")[0] != folder and target != folder:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} uses {target}.{node.attr}")
    assert not bad, "private names used across folders:\n" + "\n".join(bad)


def test_one_table_of_safetensors_dtypes():
    holders = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if '"BF16"' in p.read_text())
    assert holders == ["checkpoint/safetensors_io.py"], holders


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size_has_a_reason(path):
    lines = path.read_text().count("\n")
    if lines > MAX_LINES:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "Why it is long:" in doc, f"{path.name} has {lines} lines; say 'Why it is long:' in its docstring"
