"""Fake (meta) kernels: shape and dtype checks, and the output allocation, without data."""

from ternop.meta.linear import check_linear_inputs, inputs_ok, linear_fake
from ternop.meta.linear_q8 import check_q8_inputs, linear_q8_fake, q8_inputs_ok

__all__ = ["check_linear_inputs", "check_q8_inputs", "inputs_ok", "linear_fake", "linear_q8_fake", "q8_inputs_ok"]
