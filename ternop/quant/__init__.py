"""Making ternary weights: whole checkpoints (:mod:`.convert`), calibration (:mod:`.calibrate`), distillation (:mod:`.distill`).

Rounding one weight lives in :mod:`ternop.quantize` and the choice of layers in
:mod:`ternop.selection`, beside the op, because ``import ternop`` exports them.
"""
