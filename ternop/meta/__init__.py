"""Fake (meta) kernels: shape and dtype checks, and the output allocation, without data."""

from ternop.meta.linear import check_linear_inputs, inputs_ok, linear_fake

__all__ = ["check_linear_inputs", "inputs_ok", "linear_fake"]
