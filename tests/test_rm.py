"""Learned text rewards: the reward_model reward against the model's own forward pass, `regen rm`
(Bradley-Terry by hand, beats chance, exact resume, loadable export), served equal to
in-process, and the reward-hacking alert."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from regen.cli import main
from regen.offline.rm import bradley_terry_loss
from regen.rewards import Sample
from regen.rewards.base import resolve
from regen.runtime.hacking import at_peak, held_out_fall
from tests.conftest import export_weights, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RM = ["log.progress=none", "log.tensorboard=false", "run.threads=2", "optim.lr=1e-3", "rm.global_batch_size=32"]


def test_bradley_terry_loss_by_hand():
    # mean of -log sigmoid(2 - 1 - 0.5) and -log sigmoid(0 - 1 - 0.5) = (0.474077 + 1.701413) / 2
    got = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), margin=0.5)
    assert float(got) == pytest.approx(1.0877451310814295, rel=1e-6)


@pytest.fixture(scope="module")
def trained_rm(base_model, tmp_path_factory) -> Path:
    """The SFT model with a scalar head, 80 steps on the built-in pairs (true sum vs a random one)."""
    run = tmp_path_factory.mktemp("rm") / "run"
    assert main(["rm", f"model.path={base_model}", f"run.dir={run}", "rm.steps=80", "eval.every=40",
                 "eval.gates={pair_accuracy: '>= 0.6'}", *RM]) == 0
    return run


def test_a_reward_model_trained_on_pairs_beats_chance_on_held_out_pairs(trained_rm):
    rows = [r for r in read_jsonl(trained_rm / "metrics.jsonl") if "eval/pair_accuracy" in r]
    assert [r["step"] for r in rows] == [0, 40, 80]
    # 500 held-out pairs: chance is 0.5 (+- 0.022 for one std); the base head is random
    assert rows[-1]["eval/pair_accuracy"] > 0.65 and rows[-1]["eval/pair_accuracy"] > rows[0]["eval/pair_accuracy"]
    assert rows[-1]["eval/gates_passed"] == 1.0


def test_the_export_is_a_sequence_classification_folder_the_reward_scores_with(trained_rm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = trained_rm / "export"
    model, tok = AutoModelForSequenceClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    samples = [Sample("12+30=", c) for c in ("42", "43", "7", "")] + [Sample("5+5=", "10")]
    reward = resolve("reward_model")(path=str(folder))
    with torch.no_grad():  # each sequence alone, unpadded: the model's own forward
        want = [float(model(input_ids=torch.tensor([tok(s.prompt + s.completion)["input_ids"]])).logits[0, 0])
                for s in samples]
    assert reward(samples) == pytest.approx(want, rel=1e-5, abs=1e-5)
    # batches of one (batch_tokens = max_length) score as one big batch does: padding never reaches a score
    tiny = resolve("reward_model")(path=str(folder), max_length=8, batch_tokens=8)
    assert tiny(samples) == pytest.approx(reward(samples), rel=1e-5, abs=1e-5)
    assert tiny.stats()["truncated"] == 0.0


def test_long_sequences_keep_their_end(trained_rm):
    from transformers import AutoTokenizer

    folder = trained_rm / "export"
    tok = AutoTokenizer.from_pretrained(folder)
    reward = resolve("reward_model")(path=str(folder), max_length=4, batch_tokens=64)
    s = Sample("12+30=", "42")
    assert reward.encode(s) == tok("12+30=42")["input_ids"][-4:]
    reward([s, Sample("1+1=", "2")])  # 8 and 6 tokens: both cut
    assert reward.stats()["truncated"] >= 2


def test_normalisation_uses_the_running_mean_and_std(trained_rm):
    folder = str(trained_rm / "export")
    raw = resolve("reward_model")(path=folder)
    norm = resolve("reward_model")(path=folder, normalize=True)
    a = [Sample("12+30=", c) for c in ("42", "43", "1")]
    b = [Sample("5+5=", c) for c in ("10", "11")]
    xa, xb = raw(a), raw(b)
    seen = xa + xb
    mean = sum(seen) / len(seen)
    std = math.sqrt(sum((x - mean) ** 2 for x in seen) / (len(seen) - 1))
    norm(a)
    assert norm(b) == pytest.approx([(x - mean) / std for x in xb], rel=1e-5)
    assert norm.stats()["running_mean"] == pytest.approx(mean, rel=1e-6)


def test_a_chat_template_reward_model_scores_the_rendered_exchange(trained_rm, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "rm"
    shutil.copytree(trained_rm / "export", folder)
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    conf["chat_template"] = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))
    tok = AutoTokenizer.from_pretrained(folder)
    reward = resolve("reward_model")(path=str(folder))
    s = Sample("rendered by the policy's template", "42", {"messages": [{"role": "user", "content": "12+30"}]})
    assert reward.encode(s) == tok("12+30=42=", add_special_tokens=False)["input_ids"]
    plain = resolve("reward_model")(path=str(folder), chat_template=False)
    assert plain.encode(Sample("12+30=", "42")) == tok("12+30=42")["input_ids"]


def test_a_missing_or_wrong_model_is_one_clear_error(base_model, tmp_path):
    from regen.errors import UserError

    with pytest.raises(UserError, match="args.path is required"):
        resolve("reward_model")()
    with pytest.raises(UserError, match="is not a model folder"):
        resolve("reward_model")(path=str(tmp_path))


@pytest.mark.extended  # a reward server in a subprocess (6 s): second CI tier, keeps scripts/test.sh short
def test_served_scores_equal_in_process(trained_rm, monkeypatch):
    from tests.test_reward_service import TOKEN, Server, client

    monkeypatch.setenv("TEST_TOKEN_ENV", TOKEN)
    folder = trained_rm / "export"
    srv = Server(extra=["--reward-model", str(folder)]).start()
    try:
        samples = [Sample(f"{a}+{b}=", str(a + b + d)) for a, b, d in ((12, 30, 0), (5, 5, 1), (70, 29, -3))]
        local = resolve("reward_model")(path=str(folder))(samples)
        assert client(srv.url, reward="reward_model")(samples) == pytest.approx(local, rel=1e-6, abs=1e-6)
    finally:
        srv.stop()


def test_rm_resumes_exactly(base_model, tmp_path):
    common = [f"model.path={base_model}", "rm.steps=4", "rm.global_batch_size=8", "eval.every=0",
              "data.eval=null", *RM[:3], "optim.lr=1e-3"]
    assert main(["rm", *common, f"run.dir={tmp_path / 'a'}"]) == 0
    assert main(["rm", *common, f"run.dir={tmp_path / 'b'}", "rm.steps=2", "checkpoint.every=2"]) == 0
    assert main(["rm", *common, f"run.dir={tmp_path / 'b'}", "--resume"]) == 0
    a, b = export_weights(tmp_path / "a"), export_weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda r: [(x["step"], x["loss"]) for x in read_jsonl(r / "metrics.jsonl") if "loss" in x]  # noqa: E731
    assert rows(tmp_path / "a") == rows(tmp_path / "b")


def test_hacking_is_a_reward_that_rises_while_the_truth_falls():
    evals = [{"step": 0, "eval/reward": 1.0, "eval/accuracy": 0.30},
             {"step": 25, "eval/reward": 2.0, "eval/accuracy": 0.44},
             {"step": 50, "eval/reward": 2.5, "eval/accuracy": 0.40}]
    assert held_out_fall(evals, "accuracy", 0.05) is None  # fell 0.04 <= 0.05
    assert not at_peak(evals, "accuracy") and at_peak(evals[:2], "accuracy")
    evals.append({"step": 75, "eval/reward": 2.6, "eval/accuracy": 0.30})
    fall = held_out_fall(evals, "accuracy", 0.05)
    assert fall.kind == "reward_hacking" and fall.peak == 25
    assert "since step 25" in fall.message and "0.44 -> 0.3" in fall.message
    # the truth fell but so did the reward: the policy got worse, it is not exploiting the reward
    fall = held_out_fall([*evals[:2], {"step": 50, "eval/reward": 1.5, "eval/accuracy": 0.2}], "accuracy", 0.05)
    assert fall.kind == "heldout_fall" and fall.peak == 25 and "0.44 -> 0.2" in fall.message
    # equal bests: the later one, whose checkpoint retention keeps (at_peak flags every best)
    tie = [{"step": 0, "eval/reward": 1.0, "eval/accuracy": 0.5}, {"step": 10, "eval/reward": 1.1, "eval/accuracy": 0.5}]
    assert at_peak(tie, "accuracy") and at_peak(tie[:1], "accuracy")
    assert held_out_fall([*tie, {"step": 20, "eval/reward": 0.9, "eval/accuracy": 0.3}], "accuracy", 0.05).peak == 10


def test_pairs_from_samples(tmp_path):
    result = {"samples": [{"prompt": "1+1=", "completion": "2", "answer": "2"},
                          {"prompt": "1+1=", "completion": "3", "answer": "2"},
                          {"prompt": "1+1=", "completion": "3", "answer": "2"},
                          {"prompt": "2+2=", "completion": " 4", "answer": "4"}]}
    (tmp_path / "e.json").write_text(json.dumps(result))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "pairs_from_samples.py"), str(tmp_path / "e.json"),
                    str(tmp_path / "p.jsonl")], check=True, capture_output=True)
    assert read_jsonl(tmp_path / "p.jsonl") == [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "answer": "2"}]


def test_the_rm_demo_says_what_it_does_first():
    done = subprocess.run(["bash", "scripts/demo_rm.sh", "--plan"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "reward model" in done.stdout and "load average here is now" in done.stdout


def test_a_misspelt_hacking_metric_is_alerted(base_model, tmp_path):
    run = tmp_path / "r"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "train.steps=1", "rollout.global_batch_size=8",
                 "rollout.group_size=4", "eval.num_prompts=8", "health.hacking_metric=acuracy", "log.progress=none",
                 "log.tensorboard=false"]) == 0
    alerts = [a for a in read_jsonl(run / "alerts.jsonl") if a["kind"] == "hacking_metric_missing"]
    assert alerts and "'acuracy' is not an eval metric" in alerts[0]["message"] and "accuracy" in alerts[0]["message"]
