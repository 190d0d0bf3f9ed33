"""Joint runs (config `models:`): an enhancer language model feeds a painter flow model and one
image reward trains both. The advantage routing against hand-computed values, a killed run that
resumes bitwise equal, rollback of both models, frozen models and schedules, export of both,
and the config errors of a miswired pipeline."""

import json
import re
import subprocess
import sys
from html import escape
from pathlib import Path

import pytest
import torch

from regen.cli import main
from regen.config import RLConfig, load_config
from regen.modalities.joint import JointModality, rewrite_rewards
from regen.runtime.dist import Dist
from tests.conftest import NaNAt, export_weights, folder_weights, joint_args, read_jsonl, same_run, sigkill_after_checkpoint

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the routing of one reward


def test_rewrite_rewards_are_the_mean_of_each_rewrites_images_without_the_missing():
    r = torch.tensor([1.0, 0.0, 0.6, float("nan"), float("nan"), float("nan")])
    got = rewrite_rewards(r, 2)
    assert got[:2].tolist() == pytest.approx([0.5, 0.6]) and torch.isnan(got[2])


def one_prompt_step(enhancer_base, flow_base, tmp_path, rewrites: int, *extra, seed: int = 0):
    """The modality of a joint run and one sampled step of one user prompt: `rewrites` rewrites of
    it, 2 images each."""
    cfg = load_config(RLConfig, None, joint_args(enhancer_base, flow_base, tmp_path / "r")[1:]
                      + [f"rollout.global_batch_size={2 * rewrites}", f"models.enhancer.rollout.group_size={rewrites}",
                         *extra])
    m = JointModality(cfg, torch.device("cpu"), Dist())
    from regen.data import load_prompts

    items = load_prompts("builtin:shapes-paraphrase:train", cfg.task, "data.train")[:1]  # one user prompt
    return m, items, m.sample(m.inputs(items), 2 * rewrites, m.plan(torch.Generator().manual_seed(seed), 1))


def test_advantages_route_the_image_reward_to_both_models(enhancer_base, flow_base, tmp_path):
    m, items, batch = one_prompt_step(enhancer_base, flow_base, tmp_path, 3)
    assert len(batch.rewrites) == 3 and len(batch) == 6
    # images of rewrite 0: 1, 0; rewrite 1: .6, .2; rewrite 2: missing, .4
    rewards = torch.tensor([1.0, 0.0, 0.6, 0.2, float("nan"), 0.4])
    adv = m.advantages(rewards, batch, {})
    # painter, by hand (Flow-GRPO / GRPO group advantage, unbiased std, eps 1e-6), per rewrite's 2 images:
    # (1 - .5) / .70711 = .70711; (.6 - .4) / .28284 = .70711; rewrite 2 has one valid image: no group
    s = 0.5**0.5
    p = adv.parts["painter"]
    assert p.adv[:4].tolist() == pytest.approx([s, -s, s, -s], abs=1e-5)
    assert p.valid.tolist() == [True, True, True, True, False, False]
    # enhancer: rewrite rewards .5, .4, .4 (the missing image left out); mean .43333, std .057735
    e = adv.parts["enhancer"]
    want = [(0.5 - 1.3 / 3) / 0.0577350, (0.4 - 1.3 / 3) / 0.0577350, (0.4 - 1.3 / 3) / 0.0577350]
    first = e.adv if e.adv.dim() == 1 else e.adv[:, 0]
    assert first.tolist() == pytest.approx(want, abs=1e-4) and e.valid.all()
    assert adv.valid.all()  # each image's rewrite has an enhancer advantage: there is something to train
    assert adv.metrics["enhancer/zero_std_frac"] == 0.0 and adv.metrics["missing_frac"] == pytest.approx(1 / 6)


def test_a_painter_judged_against_its_rewrite_gets_its_own_scores(enhancer_base, flow_base, tmp_path):
    """reward_against=rewrite: the images are scored twice; the painter's advantage from the scores
    against its rewrite, the enhancer's (and the run's rewards) from those against the user's prompt."""
    m, items, batch = one_prompt_step(enhancer_base, flow_base, tmp_path, 3, "models.painter.reward_against=rewrite")
    samples = m.reward_samples(items, batch)
    assert len(samples) == 12 and [s.prompt for s in samples[:6]] == [items[0].prompt] * 6
    assert samples[0].meta["colour"] == items[0].meta["colour"]  # judged against what the user asked
    assert [s.prompt for s in samples[6:]] == [r for r in batch.rewrites for _ in range(2)]
    assert all(s.meta == {"user_prompt": items[0].prompt} for s in samples[6:])
    assert all((a.media == b.media).all() for a, b in zip(samples[:6], samples[6:]))
    # user-judged: rewrite 0: .2, .2; rewrite 1: .9, .1; rewrite 2: .4, .6. Own: 1, 0; missing, missing; .3, .5
    nan = float("nan")
    user, own = [0.2, 0.2, 0.9, 0.1, 0.4, 0.6], [1.0, 0.0, nan, nan, 0.3, 0.5]
    rewards, parts = m.shape_rewards(torch.tensor(user + own), {"adherence": user + own}, batch)
    assert rewards.tolist() == pytest.approx(user) and parts["adherence"] == user
    adv = m.advantages(rewards, batch, {})
    s = 0.5**0.5  # painter, by hand from its own scores: (1 - .5) / .70711; (.3 - .4) / .14142
    p = adv.parts["painter"]
    assert p.valid.tolist() == [True, True, False, False, True, True]
    assert p.adv[[0, 1, 4, 5]].tolist() == pytest.approx([s, -s, -s, s], abs=1e-5)
    # enhancer from the user-judged means .2, .5, .5: mean .4, std .17321
    e = adv.parts["enhancer"]
    first = e.adv if e.adv.dim() == 1 else e.adv[:, 0]
    assert first.tolist() == pytest.approx([-0.2 / 0.173205, 0.1 / 0.173205, 0.1 / 0.173205], abs=1e-4)
    assert adv.valid.all()  # rewrite 1's images: the painter has nothing, the enhancer has its rewrite
    assert adv.metrics["missing_frac"] == 0.0 and adv.metrics["painter/missing_frac"] == pytest.approx(1 / 3)
    logged = m.batch_metrics(batch)
    assert logged["painter/reward_own"] == pytest.approx(0.45) and logged["painter/missing_frac"] == pytest.approx(1 / 3)


def test_the_enhancers_own_reward_terms_apply_to_its_rewrite_rewards(enhancer_base, flow_base, tmp_path):
    """models.enhancer.algorithm.overlong (DAPO's soft overlong punishment, eq. 13) acts on R_r."""
    m, _, batch = one_prompt_step(enhancer_base, flow_base, tmp_path, 4,
                                  "models.enhancer.algorithm.overlong={max_len: 7, cache_len: 4, factor: 0.5}", seed=3)
    mask = batch.parts["enhancer"].response_mask
    assert mask.shape[0] == 4 and bool(mask[:, :7].all())  # the tiny base never ends early: cut them here
    for row, n in enumerate((7, 5, 3, 6)):  # lengths of the rewrites (a penalty equal for all would cancel)
        mask[row, n:] = 0
    lengths = [7, 5, 3, 6]
    rewards = torch.tensor([0.2, 0.4, 0.9, 0.1, 0.4, 0.6, 0.3, 0.3])
    # by hand: penalty 0 up to 3 tokens, then (3 - |y|) / 4 * 0.5, -0.5 beyond 7
    want = [r + (0.0 if n <= 3 else -0.5 if n > 7 else (3 - n) / 4 * 0.5)
            for r, n in zip([0.3, 0.5, 0.5, 0.3], lengths)]
    mean, std = sum(want) / 4, (sum((w - sum(want) / 4) ** 2 for w in want) / 3) ** 0.5
    e = m.advantages(rewards, batch, {}).parts["enhancer"]
    first = e.adv if e.adv.dim() == 1 else e.adv[:, 0]
    assert first.tolist() == pytest.approx([(w - mean) / (std + 1e-6) for w in want], abs=1e-4)


def test_a_run_whose_painter_is_judged_against_its_rewrite(enhancer_base, flow_base, tmp_path):
    """End to end with the real adherence reward: it reads the rewrite's attributes from its words,
    so the painter's own scores are another set than the user-judged ones."""
    run = tmp_path / "own"
    assert main(joint_args(enhancer_base, flow_base, run, "reward=[{name: adherence}]", "train.steps=2",
                           "models.painter.reward_against=rewrite")) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(0.0 <= r["painter/missing_frac"] <= 1.0 for r in rows)
    own = [r["painter/reward_own"] for r in rows if r["painter/missing_frac"] < 1.0]
    assert own and all(0.0 < v < 1.0 for v in own)
    assert any(r["painter/reward_own"] != r["reward/mean"] for r in rows)


# ---------------------------------------------------------------- books of both models


def test_joint_run_exports_both_models_loadable_as_they_are(enhancer_base, flow_base, tmp_path, capsys):
    run = tmp_path / "j"
    assert main(joint_args(enhancer_base, flow_base, run, "data.eval=builtin:shapes-paraphrase:test",
                           "eval.every=4", "eval.num_prompts=3", "checkpoint.every=2", "log.progress=lines",
                           "log.every=4", "models.enhancer.algorithm.kl_coef=0.1")) == 0
    assert "[enhancer:grpo+painter:nft] step 4/4" in capsys.readouterr().err  # each model's method, not the root's
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "export" / "enhancer")  # plain transformers
    from regen.policies.flow import FlowPolicy

    FlowPolicy.load(run / "export" / "painter", torch.device("cpu"))
    import diffusers

    unet = run / "export" / "painter" / "unet"  # plain diffusers, with the class its config names
    kind = getattr(diffusers, json.loads((unet / "config.json").read_text())["_class_name"])
    _, info = kind.from_pretrained(unet, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0  # `regen export` writes what export/ holds
    assert folder_weights(tmp_path / "out").keys() == folder_weights(run / "export").keys()
    assert all(torch.equal(a, b) for a, b in zip(folder_weights(tmp_path / "out").values(),
                                                 folder_weights(run / "export").values()))
    rows = read_jsonl(run / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert all(r["enhancer/trained"] == 1.0 and r["painter/trained"] == 1.0 for r in steps)
    # each model its own learning rate; the run's optim.lr (which trains neither) is not logged as "lr"
    assert all(r["enhancer/lr"] == r["painter/lr"] == 1e-3 and "lr" not in r and "painter/grad_norm" in r for r in steps)
    # the enhancer's KL to its SFT policy (the example's kl_coef): none before its first update, then some;
    # the run's kl (what the health monitor watches) is the larger of the models'
    assert steps[0]["enhancer/kl"] == 0.0 and steps[-1]["enhancer/kl"] > 0 and steps[-1]["kl"] == steps[-1]["enhancer/kl"]
    kept = read_jsonl(run / "samples" / "step_00000004.jsonl")
    assert all(r["prompt"].endswith("->") and "rewrite" in r and (run / r["image"]).is_file() for r in kept)
    for step in (2, 4):
        folder = run / "checkpoints" / f"step_{step:08d}"
        assert (folder / "enhancer" / "model").is_dir() and (folder / "painter" / "model").is_dir()
    assert main(["report", str(run)]) == 0  # the rewrite above each image; the learning rate of each model
    html = (run / "report.html").read_text()
    assert f'<span class="lbl">rewrite</span>{escape(kept[0]["rewrite"])}' in html
    lr_chart = re.search(r'data-chart="lr".*?</figure>', html, re.S).group(0)
    assert 'data-label="enhancer/lr" data-n="4"' in lr_chart and 'data-label="painter/lr" data-n="4"' in lr_chart
    # regen eval of the run and of its checkpoint: the pipeline, as the run's own evaluation at that step
    # (loaded from the checkpoint's files, not the run's memory), and on other prompts with --data
    logged = next(r for r in rows if r["step"] == 4 and "eval/reward" in r)
    samples_before = sorted(p.relative_to(run) for p in (run / "samples").rglob("*"))
    for source in (run, run / "checkpoints" / "step_00000004"):
        out = tmp_path / f"{source.name}.json"
        assert main(["eval", str(source), "--out", str(out), "--show", "1"]) == 0
        assert "rewrite" in capsys.readouterr().out
        got = json.loads(out.read_text())
        assert got["settings"]["checkpoint"] == "step_00000004"
        for k in ("reward", "adherence_accuracy", "rewrite_words"):
            assert got["metrics"][k] == pytest.approx(logged[f"eval/{k}"], abs=1e-6), k
        assert [r["rewrite"] for r in got["samples"]] == [r["rewrite"] for r in kept]
    assert main(["eval", str(run), "--data", "builtin:shapes-paraphrase:phrasings", "--num-prompts", "2",
                 "--samples-per-prompt", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["settings"]["num_prompts"] == 2 and 0.0 <= got["metrics"]["reward"] <= 1.0
    assert (run / "eval" / "eval_step_00000004.json").is_file()
    assert sorted(p.relative_to(run) for p in (run / "samples").rglob("*")) == samples_before  # the run's stay its own
    assert main(["eval", str(run), "--temperature", "0.5"]) == 2  # an LM flag the pipeline does not read
    assert "--temperature not read for a joint run" in capsys.readouterr().err


def test_frozen_and_scheduled_models(enhancer_base, flow_base, tmp_path):
    """painter frozen for the run: its weights stay as loaded; enhancer trained from step 3 only."""
    run = tmp_path / "f"
    assert main(joint_args(enhancer_base, flow_base, run, "models.painter.frozen=true",
                           "models.enhancer.train_at=[[3, null]]", "checkpoint.every=2")) == 0
    before = {k.split(":", 1)[1]: v for k, v in export_weights(Path(flow_base).parent).items() if "export/unet" in k}
    after = {k.split(":", 1)[1]: v for k, v in export_weights(run).items() if "export/painter/unet" in k}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["enhancer/trained"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    assert all(r["painter/trained"] == 0.0 for r in rows)
    from safetensors.torch import load_file

    start = load_file(str(Path(enhancer_base) / "model.safetensors"))
    at2 = load_file(str(run / "checkpoints" / "step_00000002" / "enhancer" / "model" / "model.safetensors"))
    end = load_file(str(run / "export" / "enhancer" / "model.safetensors"))
    assert all(torch.equal(start[k], at2[k]) for k in start)  # not trained in stage 1
    assert any(not torch.equal(start[k], end[k]) for k in start)  # trained in stage 2


def test_rollback_restores_both_models(enhancer_base, flow_base, tmp_path, monkeypatch):
    from regen.modalities.flow import FlowModality

    nan = NaNAt(FlowModality.micro_loss, {3, 4})  # the painter's one micro-batch of steps 3 and 4
    monkeypatch.setattr(FlowModality, "micro_loss", lambda self, mini, pos: nan(self, mini, pos))
    restored = []
    real = JointModality.restore
    monkeypatch.setattr(JointModality, "restore", lambda self, folder: (restored.append(folder), real(self, folder)))
    run = tmp_path / "rb"
    assert main(joint_args(enhancer_base, flow_base, run, "checkpoint.every=2", "health.rollback_after_nonfinite=2",
                           "checkpoint.keep_last=3")) == 0
    alerts = [a for a in read_jsonl(run / "alerts.jsonl") if a["kind"] == "rollback"]
    assert len(alerts) == 1 and alerts[0]["step"] == 4 and "step_00000002" in alerts[0]["message"]
    assert restored == [run / "checkpoints" / "step_00000002"]
    # after the rollback both models hold the step-2 weights: the step-4 checkpoint written right after is
    # those weights (the painter's steps 3-4 were skipped, the enhancer's were undone)
    from safetensors.torch import load_file

    for name in ("enhancer/model/model.safetensors", "painter/model/unet/diffusion_pytorch_model.safetensors"):
        a = load_file(str(run / "checkpoints" / "step_00000002" / name))
        b = load_file(str(run / "checkpoints" / "step_00000004" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.extended  # three joint runs in subprocesses (13 s): second CI tier, keeps scripts/test.sh short
def test_a_killed_joint_run_resumes_bitwise_equal(enhancer_base, flow_base, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "killed"
    args = lambda r: joint_args(enhancer_base, flow_base, r, "train.steps=8", "checkpoint.every=1")  # noqa: E731
    assert main(args(ref)) == 0
    proc = subprocess.Popen([sys.executable, "-m", "regen", *args(run)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    sigkill_after_checkpoint(proc, run, 3, timeout_s=120, poll_s=0.005)
    done = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "manifest.json").exists())
    assert done and done[-1] < "step_00000008", done  # killed mid-run: steps are left to resume
    assert main(args(run)) == 0  # the same command resumes from the newest complete checkpoint
    same_run(ref, run)


# ---------------------------------------------------------------- miswired configs


@pytest.mark.parametrize("extra, message", [
    (["models.enhancer.feeds=paintr"], "models.enhancer.feeds: unknown model 'paintr' (models: enhancer, painter)"),
    (["models.painter.feeds=enhancer"], "models.enhancer.feeds: a cycle (enhancer -> painter -> enhancer)"),
    (["models.enhancer.feeds=null", "models.painter.feeds=enhancer"],
     "models.painter.feeds: painter makes images, and enhancer is a language model, which reads text prompts"),
    (["models.enhancer.feeds=null"], "models: the pipeline supported is two models"),
    (["models.enhancer.algorithm.clip_lo=0.1"], "models.enhancer: unknown key 'algorithm.clip_lo'"),
    (["models.enhancer.flow.steps=3"], "models.enhancer: flow.steps is not read by algorithm.name=grpo"),
    (["models.painter.model.path=ENHANCER"], "models.painter: algorithm.name=nft trains flow-matching image/video "
     "models; model"),
    (["models.enhancer.frozen=true", "models.painter.frozen=true"], "every model is frozen"),
    (["models.enhancer.frozen=true", "models.enhancer.train_at=[[1, 2]]"], "frozen: true and train_at contradict"),
    (["models.enhancer.train.steps=3"], "models.enhancer.train.steps: set it once for the run"),
    (["models.enhancer.algorithm.dynamic_sampling=true"], "models.enhancer.algorithm.dynamic_sampling: not supported "
     "in a joint run"),
    (["models.painter.reward_against=rewrites"], "models.painter.reward_against: 'user' or 'rewrite', got 'rewrites'"),
    (["models.enhancer.reward_against=rewrite"], "models.enhancer.reward_against: enhancer draws from the user's "
     "prompts, so it is always judged against them"),
    (["models.painter.reward_against=rewrite", "models.painter.frozen=true"],
     "models.painter.reward_against: read only when painter trains, and it is frozen"),
    (["models.enhancer.data={train: x}"], "models.enhancer.data: not a key of a model"),
    (["algorithm.name=nft"], "algorithm.name is not read in a joint run (models:): give it inside each models.NAME"),
    (["model.path=x"], "model.path is not read in a joint run"),
    (["distributed.mode=ray"], "rollout and reward actors for joint runs are not supported yet"),
    (["distributed.mode=torchrun", "distributed.strategy=fsdp"], "a joint run is data parallel with DDP only"),
])
def test_a_miswired_joint_config_is_one_error_naming_the_field(enhancer_base, flow_base, tmp_path, capsys, extra,
                                                               message):
    extra = [e.replace("ENHANCER", enhancer_base) for e in extra]
    assert main(joint_args(enhancer_base, flow_base, tmp_path / "bad", *extra)) != 0
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
