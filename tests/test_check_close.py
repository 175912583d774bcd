"""The equivalence check itself: it must fail when nothing was compared, or when an error is out of bounds."""

import math

import pytest

from tests.conftest import compare


@pytest.mark.parametrize("per_rank", [{}, [], [{}, {}], [{"w": 0.0}, {}]], ids=["empty", "no-ranks", "empty-ranks", "one-rank-empty"])
def test_an_empty_comparison_fails(per_rank):
    with pytest.raises(AssertionError, match="nothing was compared"):
        compare("test", "label", per_rank, 1e-5)


@pytest.mark.parametrize("error", [2e-5, math.nan, math.inf])
def test_an_error_above_the_bound_or_not_a_number_fails(error):
    with pytest.raises(AssertionError, match="relative error above"):
        compare("test", "label", [{"w": 0.0}, {"w": error}], 1e-5)


def test_errors_within_the_bound_pass():
    compare("test", "label", [{"w": 1e-6, "b": 0.0}, {"w": 9e-6}], 1e-5)
