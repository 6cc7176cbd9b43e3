"""The ``ternop`` console script: messages instead of tracebacks, no lost or half-written data, --help, --version."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ternop
from ternop.cli import COMMANDS, build_parser, main
from tests.models import minilm_dir, tiny_bert

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("bert") / "src")


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ternop {ternop.__version__}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_cli_help_shows_every_default(command):
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    text = " ".join(sub.format_help().split())
    for action in sub._actions:
        if not action.option_strings or action.default in (None, False, [], "==SUPPRESS=="):
            continue
        shown = " ".join(sub._get_formatter()._expand_help(action).split())
        assert "default" in shown and shown in text, f"{command} {action.option_strings[0]}: {shown!r}"


def test_quantize_cli(bert_dir, tmp_path, capsys):
    argv = ["quantize", str(bert_dir), str(tmp_path / "q"), "--method", "absmean", "--skip", "attention", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "quantized 4 linear layers, left 8 dense" in out
    assert "dense: encoder.layer.0.attention.self.query (matches skip pattern 'attention')" in out
    assert main(["quantize", str(tmp_path / "missing"), str(tmp_path / "x"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "ternop quantize: error: model folder" in err and "does not exist" in err and "Traceback" not in err
    assert main(["quantize", str(bert_dir), str(tmp_path / "c"), "--method", "calibrated", "--quiet"]) == 2
    assert "--calib" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", str(bert_dir), str(tmp_path / "y"), "--method", "nonsense"])


def test_quantize_row_scales(bert_dir, tmp_path, capsys):
    from ternop.checkpoint.reader import load_ternary_layers

    dst = tmp_path / "row"
    assert main(["quantize", str(bert_dir), str(dst), "--scales", "row", "--activations", "int8", "--quiet"]) == 0
    capsys.readouterr()
    scales = [scale for _, scale in load_ternary_layers(dst).values()]
    assert scales and all(bool((s == s[:, :1]).all()) for s in scales)
    assert main(["quantize", str(bert_dir), str(tmp_path / "c"), "--scales", "row", "--method", "calibrated",
                 "--calib", "x.txt", "--quiet"]) == 2  # fmt: skip
    assert "--scales row takes --method optimal or absmean, not calibrated" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_quantize_skip_before_the_positionals_and_unmatched_patterns(bert_dir, tmp_path, capsys):
    dst = tmp_path / "q"
    assert main(["quantize", "--skip", "attention", "--skip", "intermediate", str(bert_dir), str(dst), "--quiet"]) == 0
    assert "quantized 2 linear layers" in capsys.readouterr().out
    assert main(["quantize", str(bert_dir), str(tmp_path / "typo"), "--skip", "atention", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "skip pattern 'atention' matches no linear layer" in err and not (tmp_path / "typo").exists()


def test_quantize_output_folder_has_mkdir_permissions(bert_dir, tmp_path):
    old = os.umask(0o022)
    try:
        assert main(["quantize", str(bert_dir), str(tmp_path / "q"), "--method", "absmean", "--quiet"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "q").stat().st_mode & 0o777 == 0o755


# The child restores Python's Ctrl-C handler: a shell that starts a job in the background
# (CI scripts often do) hands it SIGINT ignored, and Python then keeps ignoring it.
_SLOW_QUANTIZE = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from ternop.quant import convert
from ternop.quantize import quantize_weight

def slow(src, calib, skip, calib_tokens, progress):
    def quantizer(name, weight):
        time.sleep(0.3)
        return quantize_weight(weight, "absmean")
    return quantizer

convert.METHODS["slow"] = slow
from ternop.cli import main
sys.exit(main(["quantize", sys.argv[1], sys.argv[2], "--method", "slow", "--quiet"]))
"""


@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_quantize_interrupted_leaves_nothing_behind(bert_dir, tmp_path, sig, code, word):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_QUANTIZE, str(bert_dir), str(out / "q")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(out.glob(".q.partial-*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # inside the writer
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert f"ternop quantize: {word}" in stderr and "Traceback" not in stderr
    assert list(out.iterdir()) == []  # neither the partial folder nor DST


def test_serve_and_validate_on_a_missing_folder_are_messages(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["serve", missing, "--print-command"]) == 2
    err = capsys.readouterr().err
    assert "ternop serve: error: model folder" in err and "does not exist" in err and "Traceback" not in err
    assert main(["validate", missing]) == 2
    captured = capsys.readouterr()
    assert "does not exist" in captured.err and "not a ternary checkpoint" not in captured.err + captured.out


def test_python_and_cli_reports_agree_on_what_stays_dense(tmp_path):
    """quantize_module on the loaded model and quantize_checkpoint on its folder list the same dense layers."""
    from ternop.hf import load_model
    from ternop.quant.convert import quantize_checkpoint

    model = load_model(minilm_dir())
    in_memory = ternop.quantize_module(model, skip=["attention.output"])
    on_disk = quantize_checkpoint(minilm_dir(), tmp_path / "q", method="absmean", skip=["attention.output"],
                                  progress=False)  # fmt: skip
    assert in_memory.skipped == on_disk.skipped and len(in_memory.skipped) == 7  # 6 attention outputs + pooler
    assert sorted(in_memory.quantized) == sorted(on_disk.quantized) and in_memory.dense_bytes == on_disk.dense_bytes
    assert str(in_memory).splitlines()[0] == in_memory.summary()
    assert "dense:   pooler.dense (outside the transformer blocks)" in str(in_memory)


def test_readme_whole_model_snippet_runs(capsys):
    readme = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "quantize_module(model" in b)
    assert block.startswith("import ternop\n")
    exec(compile(block.replace("path/to/model", str(minilm_dir())), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "quantized 12 linear layers" in out and "ternary: encoder.layer.0.intermediate.dense" in out


def test_docs_state_one_demo_duration():
    from ternop.cli import demo

    said = {
        "README.md": (REPO / "README.md").read_text(),
        "docs/SERVING.md": (REPO / "docs" / "SERVING.md").read_text(),
        "ternop/cli/demo.py": demo.__doc__,
    }
    found = {k: re.findall(r"(?:takes|took) about (\w+ minutes) on (\w+) (?:CPU )?cores", v) for k, v in said.items()}
    assert all(len(v) == 1 for v in found.values()), found
    assert len({tuple(v[0]) for v in found.values()}) == 1, found


def test_docs_llm_snippets_guard_the_main_module():
    """vLLM starts worker processes that re-import the main module: a snippet that builds LLM(...) needs the guard."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            if "LLM(" in block:
                assert 'if __name__ == "__main__":' in block, f"{doc.name}: {block[:80]!r}"
