"""Running a model's repeated blocks one at a time, from what one pass of the model gave them.

Calibration (``ternop.quant.calibrate``) needs the input of each linear layer once the layers
before it are ternary. Running the whole model up to that layer for every group of layers costs
a pass per group, which grows with the square of the depth. Transformers are a list of blocks
called one after another, each with the hidden state of the block before and with arguments
(masks, position embeddings) that do not depend on the weights. ``BlockReplay`` records, in one
pass a batch, what every block is called with, then keeps each batch's hidden state at the
current block: a layer's input costs part of one block's run, and moving on costs one block's.

It is used only where it is exact: every group of layers lies in one list of blocks, in block
order, and replaying a recorded batch through all the blocks gives bit for bit what the pass
gave. Elsewhere the caller runs the whole model as before.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn


class _Stop(Exception):
    pass


def _hidden(out):
    """A block's output hidden state: the tensor itself or the first item of a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


def real_tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A layer input's rows of real tokens: x [batch, seq, K] at the attention mask's ones, or x
    itself where it is already [tokens, K]."""
    return x[mask.bool()] if x.dim() == 3 else x


def capture_inputs(module: nn.Module, runs) -> list[torch.Tensor]:
    """``module``'s input in each of ``runs`` (pairs of an attention mask and a function that runs
    the model, or a block, on that batch), without gradients: [tokens, K] fp32, real tokens only.
    Each run stops where the module is first called; a run that never calls it gives nothing."""
    out = []
    box = {}

    def hook(mod, args):
        out.append(real_tokens(args[0].detach(), box["m"]).float())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for mask, run in runs:
                box["m"] = mask
                try:
                    run()
                except _Stop:
                    pass
    finally:
        handle.remove()
    return out


def run_batches(model: nn.Module, batches, handles: list, before, step=None) -> None:
    """One pass of ``model`` a batch without gradients, ``before(index, batch)`` ahead of each and
    ``step()`` (if given) after it; the hooks in ``handles`` are removed at the end, even on error."""
    try:
        with torch.no_grad():
            for b, batch in enumerate(batches):
                before(b, batch)
                model(**batch)
                if step is not None:
                    step()
    finally:
        for h in handles:
            h.remove()


def find_blocks(model: nn.Module, firsts: list[nn.Module]) -> tuple[nn.ModuleList, list[int]] | None:
    """The outermost ``nn.ModuleList`` of two or more blocks whose blocks hold every module in
    ``firsts`` (in execution order), with the block index of each, non-decreasing; None if none."""
    for _, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        block_of = {id(m): i for i, block in enumerate(mod) for m in block.modules()}
        where = [block_of.get(id(m)) for m in firsts]
        if all(w is not None for w in where) and where == sorted(where):
            return mod, where
    return None


class BlockReplay:
    """Each batch's hidden state at block ``current``, and the recorded rest of each block's call.

    ``build`` records one pass a batch and checks the replay against it; ``capture`` runs the
    current block up to a module and returns that module's input; ``advance`` runs the current
    block whole (with its weights as they are now) and moves to the next.
    """

    def __init__(self, blocks: nn.ModuleList, hidden, calls, masks):
        self.blocks, self.hidden, self.calls, self.masks = blocks, hidden, calls, masks
        self.current = 0

    @classmethod
    def build(cls, model: nn.Module, blocks: nn.ModuleList, batches, step=None) -> BlockReplay | None:
        """Records every block's call in one pass of ``model`` a batch (``step()``, if given, is
        called after each); None where the blocks do not take their hidden state as the first
        positional argument, or where replaying the first batch through every block does not give
        the last block's output exactly."""
        n = len(blocks)
        calls = [[None] * n for _ in batches]  # [batch][block] -> (args after the hidden state, kwargs)
        hidden, last = [], []
        box = {}
        handles = []

        def pre(mod, args, kwargs, i):
            if not args or calls[box["b"]][i] is not None:
                return
            if i == 0:
                hidden.append(args[0].detach().clone())
            kwargs = dict(kwargs)
            # A cache filled by the recorded pass must not be filled again by the replay.
            if "past_key_values" in kwargs:
                kwargs["past_key_values"] = None
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            calls[box["b"]][i] = (args[1:], kwargs)

        def post(mod, args, out):
            if box["b"] == 0 and not last:
                last.append(_hidden(out).detach().clone())

        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(lambda m, a, k, i=i: pre(m, a, k, i), with_kwargs=True))
        handles.append(blocks[n - 1].register_forward_hook(post))
        run_batches(model, batches, handles, lambda b, batch: box.update(b=b), step)
        if len(hidden) != len(batches) or not last or any(c is None for row in calls for c in row):
            return None
        replay = cls(blocks, hidden, calls, [batch["attention_mask"] for batch in batches])
        h = hidden[0]
        with torch.no_grad():
            for i in range(n):
                h = replay._run(i, 0, h)
        return replay if h.shape == last[0].shape and torch.equal(h, last[0]) else None

    def _run(self, i: int, b: int, h: torch.Tensor):
        args, kwargs = self.calls[b][i]
        return _hidden(self.blocks[i](h, *args, **kwargs))

    def capture(self, module: nn.Module) -> list[torch.Tensor]:
        """``module``'s input (it must lie in the current block) for each batch that reaches it:
        [tokens, K] fp32, real tokens only, as ``calibrate._capture`` gives it from a whole pass."""
        runs = [(self.masks[b], partial(self._run, self.current, b, h)) for b, h in enumerate(self.hidden)]
        return capture_inputs(module, runs)

    def advance(self) -> None:
        """Runs the current block on every batch and makes the next block current."""
        with torch.no_grad():
            self.hidden = [self._run(self.current, b, h) for b, h in enumerate(self.hidden)]
        self.current += 1
