"""The greedy-token comparison of the generation tests: it allows only a swap of a near-tie, and nothing after it."""

from __future__ import annotations

import pytest

from tests.vllm_plugin._generate import NEAR_TIE, assert_greedy_tokens

# transformers' (token, runner-up, gap) for two steps of one prompt
STEPS = [[(5, 7, 0.5), (9, 4, NEAR_TIE / 2)]]


def test_equal_tokens_pass():
    assert_greedy_tokens([[5, 9]], STEPS)


def test_a_near_tie_may_swap_and_ends_the_comparison():
    assert_greedy_tokens([[5, 4]], STEPS)
    # a swap at the first step: what follows it is conditioned on another prefix and not compared
    assert_greedy_tokens([[7, 123]], [[(5, 7, NEAR_TIE / 2), (9, 4, 0.5)]])


@pytest.mark.parametrize("got, why", [
    ([[7, 9]], "a swap where transformers' choice led by 0.5"),
    ([[5, 3]], "a token that was not the runner-up"),
])
def test_other_differences_fail(got, why):
    with pytest.raises(AssertionError, match="prompt 0 step"):
        assert_greedy_tokens(got, STEPS)


def test_lengths_must_agree():
    with pytest.raises(AssertionError):
        assert_greedy_tokens([[5]], STEPS)
    with pytest.raises(AssertionError):
        assert_greedy_tokens([[5, 9], [1, 2]], STEPS)
