"""math_equal: answers compared by mathematical equivalence (math-verify), with the answer found
where GSM8K and MATH-style completions put it, and a budget per check that a pathological
expression cannot exceed."""

from __future__ import annotations

import time

import pytest

from regen.rewards import Sample
from regen.rewards.base import resolve
from regen.rewards.math import final_answer

pytest.importorskip("math_verify")

# (reference answer, completion, equal?)
TABLE = [
    ("42", "She has 42 apples.", True),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "48 + 24 = 72\n#### 72", True),  # GSM8K's ####
    ("#### 72", "#### 71", False),
    ("\\frac{1}{2}", "The probability is \\boxed{0.5}.", True),
    ("1/3", "\\boxed{\\frac{2}{6}}", True),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", True),
    ("x^2+2x+1", "expanding, \\boxed{(x+1)^2}", True),
    ("1,000", "a total of 1000", True),
    ("10\\%", "\\boxed{0.1}", True),
    ("3", "3.0", True),
    ("2", "x = 3", False),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
    ("5", "I do not know", False),
    ("-4", "the roots sum to -4", True),
    ("-4", "the roots sum to 4", False),
]


@pytest.fixture(scope="module")
def math_equal():
    return resolve("math_equal")(timeout_s=5.0)


def test_equivalent_and_different_answers(math_equal):
    got = math_equal([Sample("q", c, {"answer": g}) for g, c, _ in TABLE])
    assert got == [float(eq) for _, _, eq in TABLE], [(g, c) for (g, c, eq), v in zip(TABLE, got) if v != float(eq)]


def test_where_the_final_answer_is_read():
    assert final_answer("7 * 6 = 42, minus 2 is 40\n#### 40") == "40"
    assert final_answer("first \\boxed{1}, then \\boxed{\\frac{a}{b^{2}}} end") == "\\frac{a}{b^{2}}"
    assert final_answer("3 apples and 4 pears: 7 fruit") == "7"
    assert final_answer("1,250 people") == "1250"
    assert final_answer("no digits") == "no digits"


def test_a_row_without_an_answer_is_missing(math_equal):
    assert math_equal([Sample("q", "12", {}), Sample("q", "12", {"answer": 12})]) == [None, 1.0]


@pytest.mark.extended  # waits out a real timeout (5 s): second CI tier, keeps scripts/test.sh short
def test_a_pathological_expression_times_out_and_the_next_check_runs():
    reward = resolve("math_equal")(timeout_s=1.0)
    t0 = time.perf_counter()
    got = reward([Sample("q", "\\boxed{9^{9^{9^{9}}}}", {"answer": "10"}), Sample("q", "\\boxed{4}", {"answer": "4"})])
    assert got == [None, 1.0] and reward.timeouts == 1  # missing, not zero; a fresh worker answers the next
    assert time.perf_counter() - t0 < 20  # the worker was killed, not waited for
    zero = resolve("math_equal")(timeout_s=1.0, on_timeout="zero")
    assert zero([Sample("q", "\\boxed{9^{9^{9^{9}}}}", {"answer": "10"})]) == [0.0]


def test_bad_arguments_are_refused():
    from regen.errors import ConfigError

    with pytest.raises(ConfigError, match="on_timeout 'never'"):
        resolve("math_equal")(on_timeout="never")
    with pytest.raises(ConfigError, match="timeout_s must be more than 0"):
        resolve("math_equal")(timeout_s=0)
