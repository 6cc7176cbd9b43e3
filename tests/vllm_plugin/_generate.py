"""Helpers for the generation tests: greedy tokens and per-position log-probabilities, from vLLM and from transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ternop.vllm_plugin import linear_methods
from tests.vllm_plugin._llm import engine_args, released_on_exit

MAX_TOKENS = 8
NEAR_TIE = 0.05
"""A greedy step whose best two logits are closer than this is a near-tie. With int8 activations a last-bit
float difference between two devices can round one activation to the next int8 value, and that can swap two
near-tied tokens: on an H200 the BitNet test model chose transformers' runner-up (on the CPU) at a gap of 0.013."""


def prompt_ids(path: str | Path) -> list[list[int]]:
    """The test prompts as token ids, BOS first (the same ids go to vLLM and to transformers)."""
    from transformers import AutoTokenizer

    from tests.models import PROMPTS

    tok = AutoTokenizer.from_pretrained(str(path))
    return [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in PROMPTS]


def with_activation_bits(path: str | Path, dst: str | Path, bits: int) -> Path:
    """A copy of the checkpoint ``path`` whose quantization_config says ``activation_bits: bits``."""
    dst = Path(dst)
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["activation_bits"] = bits
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def vllm_generate(path, prompts, *, eager: bool, logprobs: bool = False, **kwargs):
    """vLLM in fp32: (greedy tokens per prompt, per-worker layer methods, and with ``logprobs`` a list per
    prompt of [len(prompt) - 1, vocab] log-probabilities of each next prompt token's position)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    with released_on_exit():
        llm = LLM(model=str(path), dtype="float32", max_model_len=128, enforce_eager=eager, seed=0,
                  max_logprobs=vocab if logprobs else 20, **engine_args(**kwargs))  # fmt: skip
        try:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                    prompt_logprobs=vocab if logprobs else None)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            methods = llm.apply_model(linear_methods)
        finally:
            del llm
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if not logprobs:
        return tokens, methods, None
    tables = []
    for o in outs:
        rows = o.prompt_logprobs[1:]  # position 0 has none
        table = torch.full((len(rows), vocab), float("nan"), dtype=torch.float64)
        for i, row in enumerate(rows):
            for token, lp in row.items():
                table[i, token] = lp.logprob
        tables.append(table)
    return tokens, methods, tables


def hf_generate(model, prompts) -> list[list[int]]:
    """transformers' greedy choice, MAX_TOKENS steps per prompt, EOS not special (as vLLM's ignore_eos)."""
    return [[token for token, _, _ in steps] for steps in hf_greedy_steps(model, prompts)]


@torch.no_grad()
def hf_greedy_steps(model, prompts) -> list[list[tuple[int, int, float]]]:
    """Per prompt, per greedy step (as hf_generate): (transformers' token, its runner-up, the logit gap)."""
    out = []
    with torch.compiler.set_stance("force_eager"):
        for p in prompts:
            ids, steps = list(p), []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1].double()
                best = int(logits.argmax())
                second = int(logits.index_fill(0, torch.tensor([best]), float("-inf")).argmax())
                steps.append((best, second, float(logits[best] - logits[second])))
                ids.append(best)
            out.append(steps)
    return out


def assert_greedy_tokens(got: list[list[int]], steps: list[list[tuple[int, int, float]]], near_tie: float = NEAR_TIE):
    """vLLM's greedy tokens equal transformers', or first differ at a near-tie (gap < near_tie) where vLLM took
    the runner-up; after that step the two sequences follow different prefixes and are not compared."""
    assert len(got) == len(steps)
    for i, (tokens, ref) in enumerate(zip(got, steps)):
        assert len(tokens) == len(ref), (i, tokens)
        for t, (token, (best, second, gap)) in enumerate(zip(tokens, ref)):
            if token != best:
                assert token == second and gap < near_tie, (
                    f"prompt {i} step {t}: vLLM chose {token}, transformers {best} (runner-up {second}, "
                    f"{gap:.3g} behind); vLLM {tokens}, transformers {[s[0] for s in ref]}")
                break


@torch.no_grad()
def hf_logprobs(model, prompts) -> list[torch.Tensor]:
    """log-softmax of transformers' logits at each prompt position but the last: [len(p) - 1, vocab] float64."""
    with torch.compiler.set_stance("force_eager"):
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].to(torch.float64), dim=-1) for p in prompts]


def assert_2x_rule(got: list[torch.Tensor], oracle: list[torch.Tensor], same_dtype: list[torch.Tensor],
                   eps: float = 1e-6) -> None:  # fmt: skip
    """The 2x rule on log-probabilities: max error of ``got`` against the fp64 ``oracle`` is at most twice that
    of transformers in the same dtype (``same_dtype``), plus ``eps``."""
    err = max(float((g - o).abs().max()) for g, o in zip(got, oracle))
    ref = max(float((s - o).abs().max()) for s, o in zip(same_dtype, oracle))
    assert all(not bool(g.isnan().any()) for g in got), "vLLM returned fewer log-probabilities than the vocabulary"
    assert err <= 2 * ref + eps, f"vLLM log-prob error {err:.3g} > 2 x transformers' fp32 error {ref:.3g} + {eps:g}"
