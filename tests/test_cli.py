"""The command line as a user meets it: --help, and one clear line (no traceback) per mistake."""

import subprocess
import sys

import pytest

from regen.cli import main


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "regen", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("verb", ["train", "sft", "eval", "export", "rewards"])
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"regen {verb}" in out and "options:" in out


def test_help_config_lists_keys(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "rollout.group_size" in out and "Completions per prompt" in out


def test_print_config_resolves_overrides(capsys):
    assert main(["train", "model.path=m", "rollout.temperature=0.5", "--print-config"]) == 0
    assert "temperature: 0.5" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "model.path=m", "rollout.temprature=0.5"], "did you mean 'rollout.temperature'"),
        (["train", "model.path=m", "train.steps=many"], "train.steps"),
        (["train", "model.path=m", "rollout.global_batch_size=30"], "not divisible by rollout.group_size=8"),
        (["train", "model.path=./no/such/model", "data.eval=null"], "model.path: folder './no/such/model' not found"),
        (["train", "model.path=m", "data.train=missing.jsonl"], "data.train: prompt file 'missing.jsonl' not found"),
        (["sft", "model.init=arith-char-gpt2", "data.train=missing.jsonl"], "prompt file 'missing.jsonl' not found"),
        (["train", "no_such_config.yaml"], "config file 'no_such_config.yaml' not found"),
    ],
)
def test_user_errors_are_one_clear_line(tmp_path, args, message, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*args, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (["train", "model.path=m", "rollout.temprature=0.5"], "did you mean 'rollout.temperature'"),
    pytest.param(["train", "model.path=./no/such/model", "data.eval=null"], "model.path: folder './no/such/model' "
                 "not found", marks=pytest.mark.extended),  # a second `regen` subprocess (~8 s): the extended tier
])
def test_the_real_command_prints_one_line_and_exits_2(tmp_path, args, message):
    res = run(*args, f"run.dir={tmp_path / 'run'}", cwd=tmp_path)  # nothing else reaches stderr
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_malformed_prompt_line(tmp_path, base_model, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4\n')
    assert main(["train", f"model.path={base_model}", f"data.train={bad}", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "p.jsonl line 2: not valid JSON" in capsys.readouterr().err


def test_eval_and_export(base_model, tmp_path, capsys):
    import json

    assert main(["eval", "--model", str(base_model), "--num-prompts", "20", "--samples-per-prompt", "2",
                 "--reward", "format", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    m = out["metrics"]
    assert out["settings"]["num_prompts"] == 20 and 0.0 <= m["accuracy"] <= 1.0 and "reward" in m
    run = base_model.parent
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0
    assert (tmp_path / "exp" / "config.json").is_file() and (tmp_path / "exp" / "tokenizer.json").is_file()
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 2  # not empty: refuse


def test_rewards_lists_builtins(capsys):
    assert main(["rewards"]) == 0
    out = capsys.readouterr().out
    assert "exact_match" in out and "format" in out
