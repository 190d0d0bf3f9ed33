from pathlib import Path

import pytest

from regen.config import RLConfig, SFTConfig, describe, load_config, parse_overrides, redact
from regen.errors import ConfigError

BASE = ["model.path=some/folder"]


def test_defaults_and_overrides_are_typed():
    cfg = load_config(RLConfig, None, BASE + ["rollout.temperature=0.7", "train.steps=12", "optim.betas=[0.9,0.95]"])
    assert cfg.rollout.temperature == 0.7 and cfg.train.steps == 12 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.prompts_per_step == 32 // 8


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: m}\nrollout: {group_size: 4, global_batch_size: 16}\n")
    cfg = load_config(RLConfig, str(f), ["rollout.group_size=8"])
    assert cfg.rollout.group_size == 8 and cfg.rollout.global_batch_size == 16 and cfg.model.path == "m"


def test_typo_names_closest_key():
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, BASE + ["rollout.temprature=0.5"])
    assert "unknown key 'rollout.temprature'" in str(e.value)
    assert "did you mean 'rollout.temperature'" in str(e.value)


def test_typo_in_section_name():
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(RLConfig, None, BASE + ["rollot.temperature=0.5"])


def test_wrong_type_names_field_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, BASE + ["rollout.group_size=eight"])
    assert "rollout.group_size" in str(e.value) and "'eight'" in str(e.value)


def test_batch_not_divisible_by_group():
    with pytest.raises(ConfigError, match=r"global_batch_size=30 is not divisible by rollout.group_size=8"):
        load_config(RLConfig, None, BASE + ["rollout.global_batch_size=30"])


def test_minibatch_must_divide_batch():
    with pytest.raises(ConfigError, match="global_minibatch_size=24 must divide"):
        load_config(RLConfig, None, BASE + ["train.global_minibatch_size=24"])


def test_group_of_one_rejected():
    with pytest.raises(ConfigError, match="at least 2"):
        load_config(RLConfig, None, BASE + ["rollout.group_size=1", "rollout.global_batch_size=8",
                                            "train.global_minibatch_size=8"])


def test_model_needs_exactly_one_source():
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        load_config(RLConfig, None, ["model.path=a", "model.init=arith-char-gpt2"])
    with pytest.raises(ConfigError, match="model: required"):
        load_config(RLConfig, None, [])


def test_range_checks():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        load_config(RLConfig, None, BASE + ["rollout.temperature=0"])
    with pytest.raises(ConfigError, match="algorithm.kl_estimator"):
        load_config(RLConfig, None, BASE + ["algorithm.kl_estimator=k4"])


def test_list_override_by_index():
    cfg = load_config(RLConfig, None, BASE + ["reward.0.weight=2.5"])
    assert cfg.reward[0].weight == 2.5
    with pytest.raises(ConfigError, match="index 3 out of range"):
        load_config(RLConfig, None, BASE + ["reward.3.weight=1"])


def test_bad_override_syntax_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not of the form"):
        parse_overrides(["rollout.temperature"])
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  path: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml' line \d+: not valid YAML"):
        load_config(RLConfig, str(f))
    with pytest.raises(ConfigError, match="not found"):
        load_config(RLConfig, str(tmp_path / "missing.yaml"))


def test_redact_hides_secret_values():
    out = redact({"reward": [{"args": {"api_token": "abc123", "url": "http://x"}}], "password": "p"})
    assert "abc123" not in str(out) and out["reward"][0]["args"]["url"] == "http://x"
    assert out["password"] == "<redacted>"


def test_every_leaf_is_described():
    for kind in (RLConfig, SFTConfig):
        rows = describe(kind)
        keys = {k for k, _, _ in rows}
        assert {"rollout.group_size", "optim.lr", "train.steps" if kind is RLConfig else "sft.steps"} <= keys
        assert all(desc for _, _, desc in rows), [k for k, _, d in rows if not d]


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].glob("examples/*.yaml")),
                         ids=lambda p: p.name)
def test_every_example_config_loads_with_every_key_read(path):
    """What users copy must load as written: a typo or a key its method ignores would be refused."""
    import yaml

    from regen.config import RMConfig

    tree = yaml.safe_load(path.read_text())
    kind = SFTConfig if "sft" in tree else RMConfig if "rm" in tree else RLConfig
    load_config(kind, str(path))
