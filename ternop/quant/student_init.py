"""Where a distillation's student starts: the codes and scales of its ternary layers at step 0.

``initial_values`` rounds or calibrates the base model's own weights (``ternop distill --init``);
``checkpoint_init`` reads them, with the trained biases and norms, from a ternary checkpoint of the
same base, such as an earlier run's output (``ternop distill --init-from``), so that a long
distillation can be a chain of shorter runs; ``scales_lr`` keeps such a start's scales by default.
"""

from __future__ import annotations

import torch
from torch import nn

from ternop.selection import select_linears


LR_SCALE = 1e-4
"""The block scales' learning rate when a run is given none and starts from its own init."""


def scales_lr(lr_scale: float | None, init_from) -> float:
    """The block scales' learning rate: ``lr_scale`` when given, else LR_SCALE, or 0 (scales kept as
    the checkpoint has them) for a run that starts ``init_from`` an earlier run's output.

    Why 0 there: that start has the earlier run's codes but a fresh optimizer, so the scales' Adam
    moments begin at zero while their gradients (round(w/s) - w/s, summed) are near zero on codes
    that sit exactly on their grid points; Adam scales those small gradients up to full-size steps.
    Measured on all-MiniLM-L6-v2 continuing a 5,122-step run (docs/QUALITY.md, rounds 8 and 9): with
    the scales learning at 2e-5 the cosine to the teacher fell from 0.90 to 0.78 over 5,000 steps on
    an H200, and to 0.874 in 300 steps on a CPU, where with the scales kept it held at 0.90-0.903.
    """
    if lr_scale is not None:
        return lr_scale
    return 0.0 if init_from else LR_SCALE


def initial_values(student, tokenizer, texts, init: str, skip, calib_tokens: int, progress: bool,
                   scales: str = "block"):  # fmt: skip
    """name -> (values int8 [N, K], scale fp32 [N, K/128], or [N, 1] for row scales) for the selected linears."""
    from ternop.quant.calibrate import calibrate_model
    from ternop.quantize import quantize_to_values

    if init == "calibrated":
        if scales != "block":
            raise ValueError("--scales row starts from --init optimal or absmean (calibration fits a scale per block)")
        res = calibrate_model(student, tokenizer, texts, skip, max_tokens=calib_tokens, progress=progress)
        return {name: (v, s.float()) for name, (v, s) in res.items()}
    out = {}
    for name, layer in select_linears(student, skip)[0].items():
        v, s = quantize_to_values(layer.weight.detach(), init, scales)
        out[name] = (v, s.float()[:, :1] if scales == "row" else s.float())
    return out


def checkpoint_init(student: nn.Module, ckpt, targets: dict[str, nn.Linear], scales: str = "block",
                    flag: str = "--init-from") -> tuple[dict, dict[str, torch.Tensor]]:  # fmt: skip
    """The start that a ternary v1 checkpoint of the student's base gives (``--init-from``; errors name ``flag``).

    Returns (name -> (values int8 [N, K], scale fp32 [N, K/128], or [N, 1] for row scales) for
    the selected linears ``targets``; student tensor name -> tensor for every other tensor of the
    checkpoint, e.g. its trained biases and norms). Raises ValueError, naming the layer, when the
    folder is not a ternary checkpoint, when its ternary layers are not exactly ``targets``, when a
    shape differs, or when ``scales="row"`` and a layer's blocks of one row have different scales.
    """
    from ternop.checkpoint import PACKED_SUFFIX, SCALE_SUFFIX, iter_tensors, load_ternary_layers, read_quant_config
    from ternop.activations import weight_values
    from ternop.format import validate
    from ternop.hf.names import match_names

    where = f"{flag} {str(ckpt)!r}"
    if read_quant_config(ckpt) is None:
        raise ValueError(f"{where}: not a ternary checkpoint (its config has no quantization_config)")
    layers = load_ternary_layers(ckpt)
    names = match_names(student, targets, layers)  # checkpoint prefix -> student module name
    missing = sorted(set(targets) - set(names.values()))
    extra = sorted(set(layers) - set(names))
    if missing or extra:
        raise ValueError(
            f"{where}: its ternary layers are not the ones this run trains: "
            + "; ".join(x for x in (f"dense or absent there: {missing[:5]}" if missing else "",
                                    f"ternary there but not selected here: {extra[:5]}" if extra else "") if x)
            + " (the same --skip as the run that wrote it selects the same layers)"
        )  # fmt: skip
    init = {}
    for prefix, name in names.items():
        packed, scale = layers[prefix]
        validate(packed, scale, prefix)
        values = weight_values(packed)
        if tuple(values.shape) != tuple(targets[name].weight.shape):
            raise ValueError(f"{where}: {prefix} is {list(values.shape)}, the model's {name} is "
                             f"{list(targets[name].weight.shape)}")  # fmt: skip
        s = scale.float()
        if scales == "row":
            if not bool((s == s[:, :1]).all()):
                raise ValueError(f"{where}: {prefix} has more than one scale in a row; --scales row needs one")
            s = s[:, :1]
        init[name] = (values, s)
    own = student.state_dict()
    ternary = {p + suffix for p in layers for suffix in (PACKED_SUFFIX, SCALE_SUFFIX)}
    rest = {key: t for key, t in iter_tensors(ckpt) if key not in ternary}
    tensors = {}
    for key, name in match_names(student, own, rest).items():
        t = rest[key]
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"{where}: {key} is {list(t.shape)}, the model's {name} is {list(own[name].shape)}")
        tensors[name] = t.to(own[name].dtype)
    return init, tensors
