"""Calibration block by block (ternop.quant.replay): the same checkpoint as whole passes, in a
number of model passes that does not grow with the depth, and whole passes where replay is not exact."""

from __future__ import annotations

import pytest
import torch

from ternop.quant import calibrate, replay


@pytest.fixture(scope="module", params=["bert", "qwen3", "gemma3"])
def tiny_fp(request, tmp_path_factory):
    """Gemma3 calls its sliding and full attention blocks with different masks and rotary tables."""
    from tests.models import tiny_bert_wide, tiny_gemma3, tiny_qwen3

    dst = tmp_path_factory.mktemp(request.param) / "fp"
    build = {"bert": lambda: tiny_bert_wide(dst, seed=2), "qwen3": lambda: tiny_qwen3(dst, layers=3, seed=2),
             "gemma3": lambda: tiny_gemma3(dst, layers=3, seed=2)}  # fmt: skip
    return build[request.param]()


def _texts():
    from tests.models import word_salad

    return word_salad(40, 10, seed=3)


def _count_passes(model):
    passes = []
    return passes, model.register_forward_pre_hook(lambda mod, args: passes.append(1))


def test_block_by_block_gives_what_whole_passes_give(tiny_fp, monkeypatch):
    from ternop.hf import load_model, load_tokenizer

    tok = load_tokenizer(tiny_fp)
    kwargs = dict(max_tokens=1024, seq_len=32, batch_size=8, progress=False)  # 4 or 5 batches

    by_blocks = load_model(tiny_fp)
    passes, handle = _count_passes(by_blocks)
    got = calibrate.calibrate_model(by_blocks, tok, _texts(), **kwargs)
    handle.remove()

    monkeypatch.setattr(calibrate, "find_blocks", lambda model, firsts: None)
    whole = load_model(tiny_fp)
    whole_passes, handle = _count_passes(whole)
    want = calibrate.calibrate_model(whole, tok, _texts(), **kwargs)
    handle.remove()

    assert list(got) == list(want) and len(got) >= 12
    for name in want:
        assert torch.equal(got[name][0], want[name][0]), name
        assert torch.equal(got[name][1], want[name][1]), name
    batches = len(calibrate._batches(tok, _texts(), 32, 1024, 8))
    # One pass to order the layers, one for the fp inputs, one to record the blocks' calls; whole
    # passes stop at each group instead, one group after another (8 or more groups).
    assert len(passes) == 1 + 2 * batches
    assert len(whole_passes) >= 1 + batches + 8 * batches


class _Block(torch.nn.Module):
    def __init__(self, counted: bool):
        super().__init__()
        self.up, self.down = torch.nn.Linear(128, 256), torch.nn.Linear(256, 128)
        self.counted, self.calls = counted, 0

    def forward(self, h, scale=None):
        self.calls += 1  # state of its own: a second call of the same inputs differs where counted
        out = h + self.down(torch.relu(self.up(h))) * (1.0 if scale is None else scale)
        return out * self.calls if self.counted else out


class _Stack(torch.nn.Module):
    """Blocks called with an argument recorded with the call (a scale), with the hidden state by
    keyword, or counting their own calls."""

    def __init__(self, by_keyword: bool = False, counted: bool = False, head: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(counted) for _ in range(3)])
        self.head = torch.nn.Linear(128, 128) if head else None
        self.by_keyword = by_keyword

    def forward(self, input_ids, attention_mask):
        h = input_ids
        for i, block in enumerate(self.blocks):
            scale = torch.tensor(0.5 + i)
            h = block(h=h, scale=scale) if self.by_keyword else block(h, scale=scale)
        return self.head(h) if self.head is not None else h


def _stack_batches():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randn(2, 3, 128, generator=g), "attention_mask": torch.ones(2, 3)} for _ in range(2)]


def test_find_blocks_needs_every_group_inside_one_list_in_order():
    stack = _Stack()
    ups = [b.up for b in stack.blocks]
    found = replay.find_blocks(stack, ups + [stack.blocks[2].down])
    assert found is not None and found[0] is stack.blocks and found[1] == [0, 1, 2, 2]
    assert replay.find_blocks(stack, [ups[1], ups[0]]) is None  # not in block order
    with_head = _Stack(head=True)
    assert replay.find_blocks(with_head, [with_head.blocks[0].up, with_head.head]) is None


@pytest.mark.parametrize("kind", ["by_keyword", "counted"])
def test_replay_refuses_models_it_cannot_repeat_exactly(kind):
    stack = _Stack(**{kind: True})
    assert replay.BlockReplay.build(stack, stack.blocks, _stack_batches()) is None


def test_replay_captures_and_advances_like_the_model():
    stack = _Stack()
    batches = _stack_batches()
    rep = replay.BlockReplay.build(stack, stack.blocks, batches)
    assert rep is not None
    for i, block in enumerate(stack.blocks):
        assert rep.current == i
        got = rep.capture(block.down)
        want = calibrate._capture(stack, block.down, batches)
        assert len(got) == len(want) == 2
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        with torch.no_grad():  # what calibration does between captures: change the block's weights
            block.up.weight.mul_(0.5)
        rep.advance()
    with torch.no_grad():
        out = [stack(**b).reshape(-1, 128) for b in batches]
    for h, want in zip(rep.hidden, out):
        assert torch.equal(h.reshape(-1, 128), want)


def test_a_layer_the_block_does_not_reach_gives_no_input():
    """As a whole pass that never calls a layer (an expert no token was routed to) captures nothing."""
    stack = _Stack()
    batches = _stack_batches()
    rep = replay.BlockReplay.build(stack, stack.blocks, batches)
    assert rep.capture(stack.blocks[1].up) == [] == calibrate._capture(stack, torch.nn.Linear(128, 128), batches)
    assert rep.current == 0 and len(rep.capture(stack.blocks[0].up)) == 2
