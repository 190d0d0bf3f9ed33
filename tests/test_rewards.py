import math
import sys
import textwrap

import pytest

from regen.config import RewardTerm
from regen.errors import ConfigError
from regen.rewards import CombinedReward, Sample, resolve
from regen.rewards.builtin import exact_match, format_reward


def s(completion, answer="12", finished=True):
    return Sample("5+7=", completion, {"answer": answer}, finished)


def test_exact_match():
    assert exact_match([s("12"), s(" 12 "), s("13"), s("")]) == [1.0, 1.0, 0.0, 0.0]
    assert exact_match([Sample("p", "12", {})]) == [None]  # no reference: missing, not zero


def test_format_requires_digits_and_eos():
    out = format_reward([s("12"), s("1a"), s("12", finished=False), s("")])
    assert out == [1.0, 0.0, 0.0, 0.0]
    assert format_reward([s("12", finished=False)], require_eos=False) == [1.0]


def test_combined_weights_and_parts():
    comb = CombinedReward.from_config([RewardTerm(name="exact_match", weight=2.0), RewardTerm(name="format", weight=0.5)])
    total, parts = comb([s("12"), s("1x"), s("13", finished=False)])
    assert total == [2.5, 0.0, 0.0]
    assert parts == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0]}


def test_missing_part_makes_total_missing():
    comb = CombinedReward.from_config([RewardTerm(name="exact_match"), RewardTerm(name="format")])
    total, parts = comb([Sample("p", "12", {})])
    assert math.isnan(total[0]) and math.isnan(parts["exact_match"][0]) and parts["format"] == [1.0]


def test_user_function_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length(samples, scale=1.0):
            return [scale * len(x.completion) for x in samples]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    comb = CombinedReward.from_config([RewardTerm(name="my_rewards:length", args={"scale": 0.5})])
    assert comb([s("1234")])[0] == [2.0]
    sys.modules.pop("my_rewards", None)


def test_unknown_names_are_clear():
    with pytest.raises(ConfigError, match="did you mean 'exact_match'"):
        resolve("exact_mach", where="reward.0.name")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod'"):
        resolve("no_such_mod:f")
    with pytest.raises(ConfigError, match="has no callable 'nope'"):
        resolve("math:nope")


def test_wrong_count_or_type_is_an_error():
    comb = CombinedReward([("bad", lambda xs: [1.0], 1.0, {})])
    with pytest.raises(RuntimeError, match="returned 1 scores for 2 samples"):
        comb([s("1"), s("2")])
    comb = CombinedReward([("bad", lambda xs: ["high"], 1.0, {})])
    with pytest.raises(RuntimeError, match="non-numeric score 'high'"):
        comb([s("1")])
