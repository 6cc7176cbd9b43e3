"""Fake (meta) kernels: shape and dtype checks, and the output allocation, without data."""

from ternop.meta.linear import check_linear_inputs, linear_fake

__all__ = ["check_linear_inputs", "linear_fake"]
