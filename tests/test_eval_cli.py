"""`regen eval` on a run directory, a checkpoint (LoRA too) and an exported model, through the
real command line. Expectations are computed from the samples themselves (exact match, the
reward formula of the config) or taken from the training loop's own held-out eval."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from regen.cli import main
from tests.conftest import read_jsonl

# two weighted terms, one with args: the eval must take all three from the run's config.yaml
REWARDS = ("reward=[{name: exact_match, weight: 2.0}, "
           "{name: format, weight: 0.5, args: {pattern: '[0-9]+', require_eos: false}}]")


def exact(row: dict) -> float:
    return float(row["completion"].strip() == str(row["answer"]).strip())


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def rl_run(base_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("evalrun") / "run"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "train.steps=2", "checkpoint.every=1",
                 "rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=5", "run.seed=3",
                 "eval.num_prompts=24", "eval.samples_per_prompt=2", "log.progress=none", "log.tensorboard=false",
                 REWARDS]) == 0
    return run


def test_eval_of_a_run_uses_its_config_and_reproduces_the_training_eval(rl_run, capsys):
    assert main(["eval", str(rl_run), "--show", "3"]) == 0
    out = capsys.readouterr().out
    path = rl_run / "eval" / "eval_step_00000002.json"  # the newest checkpoint, named after it
    assert f"wrote {path}" in out
    assert re.search(r"^metric\s+value$", out, re.M) and re.search(r"^accuracy\s+\d\.\d{4}$", out, re.M)
    assert "samples (first 3 of 48)" in out and len(re.findall(r"^  reward ", out, re.M)) == 3

    result = json.loads(path.read_text())
    s, m, rows = result["settings"], result["metrics"], result["samples"]
    assert (s["num_prompts"], s["samples_per_prompt"], s["seed"], s["max_new_tokens"]) == (24, 2, 3, 5)
    assert s["checkpoint"] == "step_00000002" and s["data"] == "builtin:arithmetic:test"
    assert len(rows) == 48
    assert m["accuracy"] == pytest.approx(mean(exact(r) for r in rows))
    for r in rows:  # weights and args of the config's terms, recomputed by hand
        fmt = float(re.fullmatch(r"[0-9]+", r["completion"]) is not None)
        assert r["reward"] == pytest.approx(2.0 * exact(r) + 0.5 * fmt), r
    assert m["reward"] == pytest.approx(mean(r["reward"] for r in rows))
    # same weights, seed and settings as the training loop's final held-out eval: same numbers
    final = [row for row in read_jsonl(rl_run / "metrics.jsonl") if "eval/accuracy" in row][-1]
    assert final["step"] == 2
    assert m["accuracy"] == pytest.approx(final["eval/accuracy"]) and m["reward"] == pytest.approx(final["eval/reward"])


def test_flags_override_the_config(rl_run, tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(rl_run / "checkpoints" / "step_00000001"), "--reward", "format",
                 "--num-prompts", "5", "--samples-per-prompt", "3", "--seed", "11", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["rewards"] == [{"name": "format", "weight": 1.0, "args": {}}]
    assert (result["settings"]["num_prompts"], result["settings"]["samples_per_prompt"]) == (5, 3)
    assert result["settings"]["checkpoint"] == "step_00000001" and len(result["samples"]) == 15
    for r in result["samples"]:  # format's defaults: digits only, and the model ended it itself
        assert r["reward"] == float(re.fullmatch(r"\d+", r["completion"]) is not None and r["finished"])
    assert not (rl_run / "eval" / "eval_step_00000001.json").exists()  # --out given: only there


def test_eval_of_an_exported_model_prints_only(base_model, capsys):
    assert main(["eval", str(base_model), "--num-prompts", "10", "--samples-per-prompt", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["model"] == str(base_model) and result["settings"]["temperature"] == 1.0
    assert len(result["samples"]) == 20 and "reward" not in result["metrics"]  # no reward configured
    assert result["metrics"]["accuracy"] == pytest.approx(mean(exact(r) for r in result["samples"]))
    assert not (base_model / "eval").exists() and not (base_model.parent / "eval").exists()


def test_eval_of_a_lora_checkpoint_merges_the_adapter(base_model, tmp_path, capsys):
    pytest.importorskip("peft")
    run = tmp_path / "lora"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "train.steps=3", "model.lora={r: 4, alpha: 8}",
                 "log.progress=none", "data.eval=null", "log.tensorboard=false", "rollout.global_batch_size=16",
                 "rollout.group_size=4", "rollout.max_new_tokens=4", "optim.lr=1e-2",
                 "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]"]) == 0
    capsys.readouterr()  # the training summary
    flags = ["--data", "builtin:arithmetic:test", "--num-prompts", "16", "--samples-per-prompt", "2",
             "--max-new-tokens", "4", "--json"]
    assert main(["eval", str(run / "checkpoints" / "step_00000003"), *flags]) == 0
    merged_here = json.loads(capsys.readouterr().out)
    assert (run / "eval" / "eval_step_00000003.json").is_file()
    assert main(["eval", str(run / "export"), *flags, "--reward", "format"]) == 0  # merged by training
    by_training = json.loads(capsys.readouterr().out)
    assert main(["eval", str(base_model), *flags]) == 0  # the base without the adapter
    base = json.loads(capsys.readouterr().out)
    texts = [[r["completion"] for r in res["samples"]] for res in (merged_here, by_training, base)]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_bad_sources_are_one_line_errors(rl_run, base_model, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "bare_run").mkdir()
    shutil.copy(rl_run / "config.yaml", tmp_path / "bare_run" / "config.yaml")
    broken = tmp_path / "broken" / "checkpoints" / "step_00000002"
    shutil.copytree(rl_run / "checkpoints" / "step_00000002", broken)
    (broken / "model" / "model.safetensors").write_bytes(b"not the weights")
    cases = [
        ([str(tmp_path / "nope" / "run")], "not found"),
        ([str(tmp_path / "empty")], "is not a run directory, checkpoint or model folder"),
        ([str(tmp_path / "file.txt")], "is a file"),
        ([], "give a run directory, checkpoint or model folder"),
        ([str(tmp_path / "bare_run")], "has no valid checkpoint and no export/"),
        ([str(broken)], "does not match its checksum"),
        ([str(rl_run), "--config", str(tmp_path / "missing.yaml")], "--config"),
        ([str(base_model), "--num-prompts", "0"], "--num-prompts must be at least 1"),
        ([str(base_model), "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
    ]
    for args, message in cases:
        assert main(["eval", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (args, err)
