"""Generation-quality metrics (regen/quality): each formula against a case worked out by hand
or against the reference tool's own CLI, then the metrics, gates and report inside real runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from regen.cli import main
from regen.config import RLConfig, load_config
from regen.errors import ConfigError, UserError
from regen.quality import gates
from regen.quality.distribution import fid, kid, precision_recall
from regen.quality.pixels import psnr, ssim, temporal_ssim
from regen.quality.text import bleu4, chrf, exact_match
from tests.conftest import read_jsonl

# --------------------------------------------------------------------------- distribution metrics


def _cross(a: float, b: float, shift=(0.0, 0.0)) -> torch.Tensor:
    """Four points (+-a, 0), (0, +-b) moved by `shift`: mean = shift and, exactly, the unbiased
    covariance diag(2a^2/3, 2b^2/3) (sum of squares 2a^2 over N - 1 = 3)."""
    pts = torch.tensor([[a, 0.0], [-a, 0.0], [0.0, b], [0.0, -b]], dtype=torch.float64)
    return pts + torch.tensor(shift, dtype=torch.float64)


def test_fid_matches_the_closed_form_for_diagonal_gaussians():
    # Heusel et al. 2017: |mu1 - mu2|^2 + Tr(S1 + S2 - 2 (S1 S2)^1/2); for diagonal S the trace term is
    # sum_i (sqrt(s1_i) - sqrt(s2_i))^2, here (2/3) ((a - c)^2 + (b - d)^2)
    real, fake = _cross(1.0, 2.0), _cross(3.0, 0.5, shift=(1.0, -2.0))
    want = (1 + 4) + (2 / 3) * ((1 - 3) ** 2 + (2 - 0.5) ** 2)
    assert fid(fake, real) == pytest.approx(want, rel=1e-9)


def test_fid_of_a_set_with_itself_is_zero_and_grows_with_a_shift():
    x = torch.randn(400, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert fid(x, x) < 1e-8
    shifts = [0.1, 0.5, 2.0]
    got = [fid(x + s, x) for s in shifts]
    # equal covariances: only the mean term is left, |shift|^2 in each of 8 dimensions
    assert got == pytest.approx([8 * s * s for s in shifts], rel=1e-6)
    assert got == sorted(got)


def _mmd2_unbiased(x: torch.Tensor, y: torch.Tensor) -> float:
    """Binkowski et al. 2018, eq. 4, written out term by term, kernel (x.y / d + 1)^3."""
    d = x.shape[1]

    def k(a, b):
        return (float(a @ b) / d + 1) ** 3

    m, n = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    xy = sum(k(x[i], y[j]) for i in range(m) for j in range(n)) / (m * n)
    return xx + yy - 2 * xy


def test_kid_is_the_unbiased_mmd_with_the_cubic_kernel():
    real = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-1.0, 0.5]], dtype=torch.float64)
    fake = torch.tensor([[2.0, 1.0], [0.5, 0.5], [0.0, -1.0], [1.5, 2.0]], dtype=torch.float64)
    mean, std = kid(fake, real, subsets=3, subset_size=4)  # every subset is the whole set
    assert mean == pytest.approx(_mmd2_unbiased(real, fake), rel=1e-9)
    assert std == pytest.approx(0.0, abs=1e-9)


def test_kid_is_zero_in_expectation_for_one_distribution_at_any_size():
    g = torch.Generator().manual_seed(1)
    draws = [kid(torch.randn(12, 4, generator=g, dtype=torch.float64),
                 torch.randn(12, 4, generator=g, dtype=torch.float64), subsets=1) for _ in range(300)]
    values = np.array([m for m, _ in draws])
    se = values.std() / math.sqrt(len(values))
    assert abs(values.mean()) < 3 * se  # unbiased: the biased (V-statistic) estimate would sit far above 0


def test_kid_leaves_the_global_random_stream_alone():
    x = torch.randn(30, 3, dtype=torch.float64)
    torch.manual_seed(5)
    kid(x, x + 1)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


def test_precision_and_recall_on_a_line_worked_by_hand():
    # reference 0, 1, 2, 10 with k = 1: radii 1, 1, 1, 8 (10's nearest neighbour is 2)
    real = torch.tensor([[0.0], [1.0], [2.0], [10.0]])
    # 5 lies in 10's ball (distance 5 <= 8); -3 lies in none; 1.5 lies in 1's ball
    fake = torch.tensor([[5.0], [-3.0], [1.5], [12.0]])
    p, r = precision_recall(fake, real, k=1)
    assert p == pytest.approx(3 / 4)  # 5, 1.5 and 12 (|12 - 10| = 2 <= 8)
    # generated radii (k = 1): 5 -> 3.5 (to 1.5), -3 -> 4.5, 1.5 -> 3.5, 12 -> 7
    # reference inside them: 0 (|0 - 1.5| <= 3.5), 1, 2, 10 (|10 - 12| <= 7): all four
    assert r == pytest.approx(1.0)
    p, r = precision_recall(real + 100, real, k=1)
    assert (p, r) == (0.0, 0.0)


# --------------------------------------------------------------------------- pixels


def _const(value: int, n: int = 2, size: int = 12, frames: int | None = None) -> np.ndarray:
    shape = (n, size, size, 3) if frames is None else (n, frames, size, size, 3)
    return np.full(shape, value, dtype=np.uint8)


def test_psnr_against_its_definition():
    a, b = _const(0), _const(10)
    assert psnr(a, b) == pytest.approx(10 * math.log10(255 ** 2 / 100), rel=1e-7)  # MSE = 10^2 (float32 log)


def test_ssim_of_flat_images_is_the_luminance_term():
    # Wang et al. 2004 eq. 13: with no variance and no covariance the contrast-structure factor is
    # C2 / C2 = 1, leaving (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1), C1 = (0.01 * 255)^2
    c1 = (0.01 * 255) ** 2
    want = (2 * 50 * 100 + c1) / (50 ** 2 + 100 ** 2 + c1)
    assert ssim(_const(50), _const(100)) == pytest.approx(want, rel=1e-5)
    assert ssim(_const(50), _const(50)) == pytest.approx(1.0, rel=1e-6)


def test_temporal_consistency_of_still_and_flickering_videos():
    still = _const(80, frames=4)
    assert temporal_ssim(still) == pytest.approx(1.0, rel=1e-6)
    flicker = _const(50, frames=4)
    flicker[:, 1::2] = 100
    c1 = (0.01 * 255) ** 2
    assert temporal_ssim(flicker) == pytest.approx((2 * 50 * 100 + c1) / (50 ** 2 + 100 ** 2 + c1), rel=1e-5)


# --------------------------------------------------------------------------- text

HYPS = ["the cat sat on the mat", "a quick brown fox jumps", "42", "hello world again and again",
        "it is raining today in the city", "no overlap here"]
REFS = ["the cat is on the mat", "the quick brown fox jumps over", "42", "hello world again",
        "it rained today in the old city", "something else entirely"]


def _cli(tmp_path: Path, metric: str) -> float:
    (tmp_path / "hyp.txt").write_text("\n".join(HYPS) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(REFS) + "\n")
    out = subprocess.run([sys.executable, "-m", "sacrebleu", str(tmp_path / "ref.txt"), "-i", str(tmp_path / "hyp.txt"),
                          "-m", metric, "-b", "-w", "6"], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def test_bleu_and_chrf_match_sacrebleus_own_command_line(tmp_path):
    assert bleu4(HYPS, REFS) * 100 == pytest.approx(_cli(tmp_path, "bleu"), abs=1e-5)
    assert chrf(HYPS, REFS) * 100 == pytest.approx(_cli(tmp_path, "chrf"), abs=1e-5)
    assert exact_match(HYPS, REFS) == pytest.approx(1 / 6)
    assert exact_match([" 42 "], ["42"]) == 1.0


# --------------------------------------------------------------------------- gates and config


def test_gates_pass_fail_and_a_missing_metric_fails():
    rules = {"fid": "<= 15", "bleu4": ">= 0.3", "recall": "> 0.5"}
    got = gates.check(rules, {"eval/fid": 14.9, "eval/bleu4": 0.3})
    assert got == {"eval/gate/fid": 1.0, "eval/gate/bleu4": 1.0, "eval/gate/recall": 0.0, "eval/gates_passed": 0.0}
    assert gates.check({"fid": "<= 15"}, {"eval/fid": 15.01})["eval/gates_passed"] == 0.0
    assert gates.check({"fid": "<15"}, {"eval/fid": 1e1})["eval/gates_passed"] == 1.0
    assert gates.failed(rules, got) == ["recall not computed (gate > 0.5)"]
    assert gates.check({}, {"eval/fid": 1.0}) == {}


@pytest.mark.parametrize("setting,names", [
    ("eval.gates={fid: 'about 15'}", ["eval.gates.fid", "'about 15'", "<= 15"]),
    ("eval.metrics=[fid, fdi]", ["eval.metrics", "unknown metric 'fdi'", "bleu4"]),
    ("eval.metrics=[lpips]", ["eval.metrics", "'lpips' is not available", "torchvision"]),
    ("eval.metrics=[fid, fid]", ["names a metric twice"]),
])
def test_a_bad_metric_or_gate_is_refused_by_name(setting, names):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, ["model.init=arith-char-gpt2", setting])
    for text in names:
        assert text in str(err.value)


FLOW = ["train", "data.train=builtin:shapes:train", "data.eval=builtin:shapes:test", "rollout.global_batch_size=4",
        "rollout.group_size=2", "flow.steps=2", "flow.eval_steps=4", "log.progress=none", "log.tensorboard=false",
        "run.threads=2", "reward=[{name: brightness, args: {target: 0.6}}]", "algorithm.name=flow_grpo"]


@pytest.mark.parametrize("setting,message", [
    ("eval.metrics=[bleu4]", "bleu4 measure text; this run trains an image/video flow model"),
    ("eval.features=clip:/nowhere/clip", "'/nowhere/clip' does not exist (nothing is downloaded"),
    ("eval.features='inception:'", "give the path after 'inception:'"),
    ("eval.reference=/nowhere/refs", "'/nowhere/refs' is not a folder"),
])
def test_a_wrong_metric_setting_stops_the_run_before_its_directory_exists(flow_base, tmp_path, capsys, setting,
                                                                          message):
    run = tmp_path / "run"
    extra = [] if "metrics" in setting else ["eval.metrics=[fid]"]
    rc = main([*FLOW, f"model.path={flow_base}", f"run.dir={run}", "train.steps=1", setting, *extra])
    assert rc != 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") <= 2, err  # one clear line, no traceback
    assert not run.exists()


def test_shapes_settings_with_other_prompts_are_refused_before_the_run(flow_base, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    run = tmp_path / "run"
    base = [*FLOW, f"model.path={flow_base}", f"run.dir={run}", f"data.eval={prompts}", "eval.metrics=[fid]"]
    assert main(base) != 0
    assert "need eval.reference" in capsys.readouterr().err and not run.exists()
    assert main([*base, f"eval.reference={tmp_path}"]) != 0  # (a folder with no images is refused first)
    capsys.readouterr()
    (tmp_path / "imgs").mkdir()
    from PIL import Image

    for i in range(2):
        Image.new("RGB", (16, 16), (i * 100, 0, 0)).save(tmp_path / "imgs" / f"{i}.png")
    assert main([*base, f"eval.reference={tmp_path / 'imgs'}"]) != 0
    assert "eval.features=shapes is the built-in shapes classifier" in capsys.readouterr().err and not run.exists()


def test_clip_score_is_the_cosine_of_the_models_own_embeddings(tiny_clip):
    from transformers import CLIPModel, CLIPProcessor

    from regen.rewards.clip_model import clip_score, load_clip

    media = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    prompts = ["a red circle", "a blue square at the top", "green"]
    got = clip_score(*load_clip(tiny_clip), media, prompts)
    model, proc = CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip)
    inputs = proc(text=prompts, images=list(media), return_tensors="pt", padding=True)
    with torch.no_grad():  # the forward's logits are logit_scale * cos(image_i, text_j)
        logits = model(**inputs).logits_per_image
    cos = logits.diagonal() / model.logit_scale.exp().detach()
    assert got == pytest.approx(float((100 * cos.clamp(min=0)).mean()), rel=1e-5)


# --------------------------------------------------------------------------- in a run


@pytest.fixture(scope="module")
def gated_run(flow_base, tmp_path_factory) -> Path:
    """Two Flow-GRPO steps evaluated with every image metric and two gates, one of which fails."""
    run = tmp_path_factory.mktemp("quality") / "run"
    assert main([*FLOW, f"model.path={flow_base}", f"run.dir={run}", "train.steps=2", "eval.num_prompts=6",
                 "eval.samples_per_prompt=2", "eval.metrics=[fid, kid, precision_recall, ssim, psnr]",
                 "eval.gates={fid: '<= 1e9', adherence_accuracy: '>= 1.01'}", "checkpoint.every=1"]) == 0
    return run


def test_metrics_and_gates_are_logged_at_each_evaluation_and_alerted(gated_run):
    rows = [r for r in read_jsonl(gated_run / "metrics.jsonl") if "eval/fid" in r]
    assert [r["step"] for r in rows] == [0, 2]
    for r in rows:
        assert r["eval/fid"] > 0 and 0 <= r["eval/precision"] <= 1 and 0 <= r["eval/recall"] <= 1
        assert 0 < r["eval/ssim"] < 1 and r["eval/psnr"] > 0 and r["eval/quality_s"] > 0
        assert (r["eval/gate/fid"], r["eval/gate/adherence_accuracy"], r["eval/gates_passed"]) == (1.0, 0.0, 0.0)
    alerts = [a for a in read_jsonl(gated_run / "alerts.jsonl") if a["kind"] == "eval_gate_failed"]
    assert [a["step"] for a in alerts] == [0, 2] and "adherence_accuracy" in alerts[0]["message"]
    assert "fid" not in alerts[0]["message"]


def test_offline_eval_of_a_flow_checkpoint_reproduces_the_runs_metrics(gated_run, capsys):
    out = gated_run / "eval" / "offline.json"
    assert main(["eval", str(gated_run), "--out", str(out)]) == 0
    got = json.loads(out.read_text())["metrics"]
    logged = next(r for r in read_jsonl(gated_run / "metrics.jsonl") if r["step"] == 2 and "eval/fid" in r)
    for name in ("fid", "kid", "precision", "recall", "ssim", "psnr", "adherence_accuracy", "gates_passed"):
        assert got[name] == pytest.approx(logged[f"eval/{name}"], rel=1e-9, abs=1e-12), name
    assert got["reward"] == pytest.approx(logged["eval/reward"], rel=1e-9)
    from PIL import Image

    with Image.open(out.with_suffix(".png")) as grid:  # 12 samples, 8 to a row, each 16 px x 4 + a gap
        assert grid.size == (8 * 17 * 4, 2 * 17 * 4)
    # the flags replace the config's metrics; LM-only flags are refused by name
    capsys.readouterr()
    assert main(["eval", str(gated_run), "--metrics", "fid", "--json"]) == 0
    assert "fid" in json.loads(capsys.readouterr().out)["metrics"]
    assert main(["eval", str(gated_run), "--temperature", "0.5"]) != 0
    assert "--temperature" in capsys.readouterr().err


def test_export_requires_the_gates_when_asked(gated_run, tmp_path, capsys):
    assert main(["export", str(gated_run), "--out", str(tmp_path / "a"), "--require-gates"]) != 0
    err = capsys.readouterr().err
    assert "step 2 failed its gates: adherence_accuracy" in err and "(gate >= 1.01)" in err
    assert not (tmp_path / "a").exists()
    assert main(["export", str(gated_run), "--out", str(tmp_path / "b")]) == 0  # without the flag: as before


def test_export_names_the_newest_checkpoint_that_passed(gated_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(gated_run, run)
    rows = read_jsonl(run / "metrics.jsonl")
    for r in rows:  # as if the evaluation at step 1 had passed
        if r["step"] == 1:
            r |= {"eval/gates_passed": 1.0, "eval/gate/fid": 1.0, "eval/gate/adherence_accuracy": 1.0}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["export", str(run), "--out", str(tmp_path / "x"), "--require-gates"]) != 0
    assert "newest checkpoint whose evaluation passed is step_00000001" in capsys.readouterr().err
    assert main(["export", str(run / "checkpoints" / "step_00000001"), "--out", str(tmp_path / "y"),
                 "--require-gates"]) == 0


def test_the_report_puts_quality_beside_the_reward(gated_run, tmp_path):
    import re

    out = tmp_path / "r.html"
    assert main(["report", str(gated_run), "--out", str(out)]) == 0
    ids = list(dict.fromkeys(re.findall(r'data-chart="([^"]+)"', out.read_text())))
    assert ids[:4] == ["reward", "eval-eval/reward", "eval-eval/fid", "eval-eval/kid"], ids[:6]


def test_drift_from_the_base_model_starts_at_zero_and_survives_a_resume(flow_base, tmp_path):
    run = tmp_path / "run"
    args = [*FLOW, f"model.path={flow_base}", f"run.dir={run}", "eval.num_prompts=4", "eval.samples_per_prompt=2",
            "eval.metrics=[fid, psnr]", "eval.reference=base", "optim.lr=1e-2", "eval.every=1", "checkpoint.every=1"]
    assert main([*args, "train.steps=1"]) == 0
    assert (run / "eval" / "base_reference.npz").is_file()
    assert main([*args, "train.steps=2", "--resume"]) == 0
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "eval/fid" in r}
    assert rows[0]["eval/fid"] == pytest.approx(0.0, abs=1e-6) and rows[0]["eval/psnr"] == 100.0  # itself
    assert rows[2]["eval/fid"] > 0 and rows[2]["eval/psnr"] < 100.0  # the trained model drifted
    alerts = read_jsonl(run / "alerts.jsonl") if (run / "alerts.jsonl").exists() else []
    assert not any(a["kind"] == "eval_reference_missing" for a in alerts)


def test_text_metrics_of_a_language_model_agree_with_sacrebleu(base_model, tmp_path):
    out = tmp_path / "e.json"
    assert main(["eval", str(base_model), "--num-prompts", "24", "--samples-per-prompt", "2", "--out", str(out),
                 "--metrics", "bleu4,chrf,exact_match,length"]) == 0
    res = json.loads(out.read_text())
    hyps = [s["completion"] for s in res["samples"]]
    refs = [str(s["answer"]) for s in res["samples"]]
    from sacrebleu.metrics import BLEU, CHRF

    m = res["metrics"]
    assert m["bleu4"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score / 100, rel=1e-9)
    assert m["chrf"] == pytest.approx(CHRF().corpus_score(hyps, [refs]).score / 100, rel=1e-9)
    assert m["exact_match"] == pytest.approx(m["accuracy"])  # the arithmetic answers: both exact match
    assert m["length"] == pytest.approx(sum(map(len, hyps)) / len(hyps))


def test_text_metrics_need_a_reference_field(base_model, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    assert main(["eval", str(base_model), "--data", str(data), "--metrics", "bleu4"]) != 0
    assert "needs a 'reference' (or 'answer') field" in capsys.readouterr().err


def test_a_quality_object_refuses_text_metrics_for_images():
    from regen.config import EvalConfig
    from regen.quality import Quality

    with pytest.raises(UserError, match="measure images or videos; this run trains a language model"):
        Quality(EvalConfig(metrics=["fid"]), "lm")
