"""`regen report`: evaluation samples saved by real runs, and the HTML built from real and
synthetic run directories (in progress, broken, image and video runs). Expected values are
computed here from the files, not taken from the report code."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image

from regen.cli import main
from regen.errors import UserError
from regen.report import load_runs, make_report
from regen.report.load import load_run
from regen.report.media import MediaError, video_uri
from regen.report.plots import x_axes
from regen.report.svg import MAX_POINTS, nice_ticks
from tests.conftest import read_jsonl

PATTERN = ".*[02468]"
REWARD = ("reward=[{name: format, args: {pattern: '" + PATTERN + "', require_eos: false}}, "
          "{name: exact_match, weight: 0.5}]")
COMMON = ["model.init=arith-char-gpt2", "rollout.global_batch_size=16", "rollout.group_size=4",
          "rollout.max_new_tokens=5", "log.progress=none", "log.tensorboard=false", "eval.every=2",
          "eval.num_prompts=20", "checkpoint.every=2", "checkpoint.keep_last=5", "optim.lr=1e-3", REWARD]
# no "kl": these runs train without a KL term (kl_coef 0), and a chart of zeros is left out
RL_CHARTS = {"reward", "components", "clip", "entropy", "length", "throughput", "fractions", "loss", "lr",
             "eval-eval/accuracy", "eval-eval/length", "eval-eval/reward", "time-split"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """Two short real GRPO runs from a fresh tiny model (seconds each)."""
    root = tmp_path_factory.mktemp("report-runs")
    a, b = root / "a", root / "b"
    assert main(["train", *COMMON, f"run.dir={a}", "train.steps=6"]) == 0
    assert main(["train", *COMMON, f"run.dir={b}", "train.steps=8", "run.seed=1", "rollout.temperature=0.7"]) == 0
    return a, b


# ----------------------------------------------------------------- synthetic run directories


def write_jsonl(path: Path, rows: list, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def rl_rows(steps: int, first: int = 1, eval_every: int = 5) -> list[dict]:
    rows = [{"step": 0, "eval/accuracy": 0.1}] if first == 1 else []
    for s in range(first, steps + 1):
        row = {"step": s, "reward/mean": 0.1 + 0.03 * s + 0.05 * (s % 3), "reward/std": 0.2, "reward/format": 0.5,
               "kl": 0.001 * s, "clip_frac": 0.01, "entropy": 2.0 - 0.01 * s, "loss": 0.1,
               "response_length/mean": 4.0, "response_length/max": 8.0, "throughput/samples_per_s": 100.0,
               "time/sample_s": 0.5, "time/score_s": 0.1, "time/update_s": 0.3, "time/step_s": 1.0 + 0.1 * s}
        if s % eval_every == 0:
            row["eval/accuracy"] = 0.1 + 0.01 * s
        rows.append(row)
    return rows


def synthetic_run(path: Path, rows: list[dict] | None = None, *, total: int = 20, gbs: int = 16, tail: str = "",
                  config: bool = True, alerts: list[dict] | None = None, checkpoints: dict[int, bool] | None = None,
                  samples: dict[int, list[dict]] | None = None, info: dict | None = None) -> Path:
    write_jsonl(path / "metrics.jsonl", rl_rows(total) if rows is None else rows, tail)
    if config:
        cfg = {"run": {"dir": str(path)}, "model": {"path": "/models/base"},
               "algorithm": {"name": "grpo", "advantage": "grpo"},
               "rollout": {"global_batch_size": gbs, "group_size": 4}, "train": {"steps": total},
               "reward": [{"name": "remote", "weight": 1.0, "args": {"url": "http://x", "api_key": "hunter2"}}]}
        (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    if alerts is not None:
        write_jsonl(path / "alerts.jsonl", alerts)
    for step, healthy in (checkpoints or {}).items():
        folder = path / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(json.dumps({"step": step, "healthy": healthy}))
        (folder / "blob").write_bytes(b"\0" * 1000)
        (folder / "manifest.json").write_text("{}")
    for step, rows_ in (samples or {}).items():
        write_jsonl(path / "samples" / f"step_{step:08d}.jsonl", rows_)
    if info is not None:
        (path / "run.json").write_text(json.dumps(info))
    return path


def png(path: Path, color, size=(32, 24)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def image_run(path: Path) -> Path:
    """An image-generation run: 3 good thumbnails, one missing file, one path outside the run."""
    for i, c in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        png(path / "media" / f"s{i}.png", c)
    png(path.parent / "outside.png", (9, 9, 9))
    rows = [{"prompt": f"a {c} square", "image": f"media/s{i}.png", "reward": 0.25 * i}
            for i, c in enumerate(["red", "green", "blue"])]
    rows += [{"prompt": "lost", "image": "media/missing.png", "reward": None},
             {"prompt": "escape", "image": "../outside.png", "reward": 1.0}]
    return synthetic_run(path, rl_rows(10), total=10, samples={0: rows, 10: rows})


def video_run(path: Path) -> Path:
    """A video run: an animated GIF, a folder of PNG frames, a list of frames, an .mp4."""
    frames = [Image.new("RGB", (20, 20), (40 * i, 0, 0)) for i in range(3)]
    (path / "media").mkdir(parents=True)
    frames[0].save(path / "media" / "clip.gif", save_all=True, append_images=frames[1:], duration=80, loop=0)
    for i in range(4):
        png(path / "media" / "frames" / f"{i:03d}.png", (0, 50 * i, 0), (20, 20))
    (path / "media" / "clip.mp4").write_bytes(b"not really a video")
    rows = [{"prompt": "gif", "video": "media/clip.gif", "reward": 0.5},
            {"prompt": "folder", "video": "media/frames", "reward": 0.6},
            {"prompt": "list", "video": ["media/frames/000.png", "media/frames/003.png"], "reward": 0.7},
            {"prompt": "mp4", "video": "media/clip.mp4", "reward": 0.8}]
    return synthetic_run(path, rl_rows(10), total=10, samples={0: rows, 10: rows})


def report_html(paths, tmp_path: Path, name: str = "report.html") -> str:
    return make_report(paths, tmp_path / name).read_text()


def figures(html: str, mode: str = "step", other: bool = False) -> list[str]:
    """Charts drawn on one x axis: the main ones, or (other=True) the folded 'other metrics'."""
    main_part, _, other_part = html.partition('<section id="other">')
    return re.findall(rf'<figure class="plot ax-{mode}" data-chart="([^"]+)"', other_part if other else main_part)


def fact(html: str, key: str) -> str:
    m = re.search(rf'<td data-fact="{re.escape(key)}">(.*?)</td>', html)
    assert m, f"fact {key} not in the report"
    return re.sub("<[^>]+>", "", m.group(1))


# ----------------------------------------------------------------- samples written by training


def test_train_saves_eval_samples(trained):
    run, _ = trained
    files = sorted(p.name for p in (run / "samples").iterdir())
    assert files == [f"step_{s:08d}.jsonl" for s in (0, 2, 4, 6)]  # before, every 2 steps, after
    for f in files:
        rows = read_jsonl(run / "samples" / f)
        assert len(rows) == 16  # first 16 of the 20 evaluated
        for row in rows:
            assert set(row) == {"prompt", "completion", "reward", "answer", "correct", "finished"}
            exact = row["completion"].strip() == row["answer"]
            expected = float(bool(re.fullmatch(PATTERN, row["completion"]))) + 0.5 * exact
            assert row["reward"] == pytest.approx(expected)
            assert row["correct"] is exact
    # the prompts are the first held-out prompts, the same at every evaluation
    prompts = [[r["prompt"] for r in read_jsonl(run / "samples" / f)] for f in files]
    assert all(p == prompts[0] for p in prompts)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["pid"] == os.getpid() and info["ended"] >= info["started"]


def test_sft_saves_eval_samples_without_reward(tmp_path):
    run = tmp_path / "sft"
    assert main(["sft", "model.init=arith-char-gpt2", f"run.dir={run}", "sft.steps=4", "sft.global_batch_size=8",
                 "eval.every=2", "eval.num_prompts=6", "log.progress=none", "log.tensorboard=false"]) == 0
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_00000002.jsonl", "step_00000004.jsonl"]
    rows = read_jsonl(run / "samples" / "step_00000004.jsonl")
    assert len(rows) == 6 and all(r["reward"] is None and "answer" in r for r in rows)
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    html = report_html([run], tmp_path)
    assert "loss" in figures(html) and "reward" not in figures(html)  # SFT logs no reward
    assert fact(html, "algorithm") == "sft" and fact(html, "steps") == "4 / 4"
    assert fact(html, "samples") == "32"  # 4 steps x 8 demonstrations


# ----------------------------------------------------------------- one real run


def test_report_of_a_real_run(trained, tmp_path):
    run, _ = trained
    assert main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()  # default output: inside the run
    rows = read_jsonl(run / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert float(fact(html, "reward_last10")) == pytest.approx(sum(rewards[-10:]) / len(rewards[-10:]), rel=1e-3)
    assert float(fact(html, "reward_last")) == pytest.approx(rewards[-1], rel=1e-3)
    acc = [r["eval/reward"] for r in rows if "eval/reward" in r]
    first, last = (float(x) for x in fact(html, "eval/reward").split("→"))
    assert (first, last) == (pytest.approx(acc[0], rel=1e-3), pytest.approx(acc[-1], rel=1e-3))
    assert fact(html, "steps") == "6 / 6" and fact(html, "samples") == str(6 * 16)
    assert fact(html, "state").startswith("finished")
    assert fact(html, "model") == "arith-char-gpt2"
    for mode in ("step", "samples", "time"):
        assert set(figures(html, mode)) == RL_CHARTS, mode
        assert set(figures(html, mode, other=True)) == {  # logged by the loss, shown folded
            "other-approx_kl", "other-grad_norm", "other-nonfinite_skipped", "other-pg_loss", "other-ratio_mean"}
    # the reward chart's line has a point per step; eval charts one per evaluation
    assert re.search(r'data-label="reward/mean" data-n="6"', html)
    assert re.search(r'data-label="eval/reward" data-n="4"', html)
    n_ckpt = len(list((run / "checkpoints").iterdir()))
    assert html.count('<tr class="checkpoint">') == n_ckpt == 3
    # gallery: first vs last side by side (16 + 16) and each of the 4 eval steps (4 x 16)
    assert html.count('<div class="sample"') == 32 + 64
    assert html.count('class="plot lengths"') == 1
    first_completion = read_jsonl(run / "samples" / "step_00000000.jsonl")[0]["completion"]
    assert re.search(r"<div class=\"completion\"><span class=\"lbl\">completion</span>" + re.escape(
        first_completion.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")), html)
    # self-contained: nothing to fetch, no script
    assert not re.search(r'(?:src|href)\s*=\s*"(?!data:)', html) and "<script" not in html and "@import" not in html
    assert "Notes" not in html  # nothing was wrong with this run


def test_overlay_of_two_runs_and_x_axes(trained, tmp_path):
    a, b = trained
    html = report_html([a, b], tmp_path)
    for mode in ("step", "samples", "time"):
        assert f'id="x-{mode}"' in html and f'<label for="x-{mode}">' in html
        reward = re.search(rf'<figure class="plot ax-{mode}" data-chart="reward">.*?</figure>', html).group(0)
        assert re.findall(r'data-label="([ab]) reward/mean" data-n="(\d+)"', reward) == [("a", "6"), ("b", "8")]
    assert html.count('<div class="card">') == 2
    # x axes computed independently: samples = step x global batch; wall-clock = cumulative step time
    runs = load_runs([a, b])
    axes = {ax.mode: ax for ax in x_axes(runs)[0]}
    for run_dir, samples_map, time_map in zip((a, b), axes["samples"].maps, axes["time"].maps):
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert samples_map == {r["step"]: r["step"] * 16 for r in rows}
        total = 0.0
        for r in rows:
            total += r.get("time/step_s", 0.0)
            unit = {"wall-clock (s)": 1, "wall-clock (min)": 60, "wall-clock (h)": 3600}[axes["time"].label]
            assert time_map[r["step"]] == pytest.approx(total / unit)


# ----------------------------------------------------------------- synthetic edge cases


def test_in_progress_run_with_truncated_last_line(tmp_path):
    run = synthetic_run(tmp_path / "live", rl_rows(12), total=100, tail='{"step": 13, "reward/me',
                        checkpoints={10: True}, info={"pid": os.getpid(), "hostname": os.uname().nodename,
                                                      "started": time.time(), "status": "running"})
    html = report_html([run], tmp_path)
    assert "metrics.jsonl: the last line (line 14) is incomplete" in html
    assert fact(html, "steps") == "12 / 100"
    assert fact(html, "state").startswith("in progress: pid")
    assert html.count('<tr class="checkpoint">') == 1


def test_run_with_only_metrics(tmp_path):
    rows = [{"step": s, "reward/mean": 0.1 * s, "loss": 1.0 / s} for s in range(1, 6)]
    run = synthetic_run(tmp_path / "bare", rows, config=False)
    html = report_html([run], tmp_path)
    assert set(figures(html)) == {"reward", "loss"}  # no kl, entropy, eval...: those charts are left out
    assert figures(html, "samples") == [] and 'id="x-samples"' not in html
    for note in ("config.yaml missing", "No alerts.jsonl in this run", "No checkpoints yet", "No samples/ in this run",
                 "batch size unknown (no config.yaml)", "no time/step_s logged"):
        assert note in html, note
    assert fact(html, "steps") == "5 / ?"


def test_unparseable_rows_are_noted_not_fatal(tmp_path):
    run = tmp_path / "bad"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\nnot json\n[1, 2]\n{"no_step": 1}\n'
                                       '{"step": 2, "reward/mean": "high"}\n{"step": 3, "reward/mean": 0.7}\n')
    r = load_run(run)
    assert r.series("reward/mean") == [(1, 0.5), (3, 0.7)]  # the string value is not a number
    html = report_html([run], tmp_path)
    assert "metrics.jsonl: lines 2, 3 not a JSON object: skipped" in html
    assert "metrics.jsonl line 4: no integer &#x27;step&#x27;: skipped" in html


def test_alerts_timeline_and_table(tmp_path):
    alerts = [{"time": time.time(), "step": 4, "kind": "reward_missing", "message": "30% <missing>"},
              {"time": time.time(), "step": 9, "kind": "rollback", "message": "rolled back"},
              {"time": time.time(), "step": -1, "kind": "checkpoint_skipped", "message": "corrupt"}]
    run = synthetic_run(tmp_path / "alerts", alerts=alerts, checkpoints={5: True, 10: False})
    html = report_html([run], tmp_path)
    assert html.count('<tr class="alert">') == 3 and "30% &lt;missing&gt;" in html
    timeline = re.search(r'<figure class="plot ax-step" data-chart="alerts">.*?</figure>', html).group(0)
    assert timeline.count('class="alert-marker"') == 3
    reward = re.search(r'<figure class="plot ax-step" data-chart="reward">.*?</figure>', html).group(0)
    assert reward.count('class="marker"') == 2  # the start-up alert (step -1) has no step on the curve
    assert '<td><span class="bad">no</span></td>' in html and fact(html, "alerts") == "3"


def test_image_run_embeds_thumbnails_and_notes_problems(tmp_path):
    run = image_run(tmp_path / "img")
    html = report_html([run], tmp_path)
    srcs = re.findall(r'<img class="media image" src="data:image/png;base64,([^"]+)"', html)
    # 3 good images x (first/last comparison 2 + 2 eval steps) = 12, each a decodable 32x24 PNG
    assert len(srcs) == 12
    assert Image.open(io.BytesIO(base64.b64decode(srcs[0]))).size == (32, 24)
    assert "image &#x27;media/missing.png&#x27; is missing" in html
    assert "&#x27;../outside.png&#x27; is outside the run directory" in html
    assert "outside.png" not in "".join(srcs)


def test_video_run_embeds_animations(tmp_path):
    run = video_run(tmp_path / "vid")
    html = report_html([run], tmp_path)
    assert len(re.findall(r'<img class="media video" src="data:image/gif;base64,', html)) == 3 * 4
    assert ".mp4 is not a supported video" in html
    frames = Image.open(io.BytesIO(base64.b64decode(video_uri(run, "media/frames").split(",", 1)[1])))
    assert frames.format == "GIF" and frames.n_frames == 4  # the folder of frames became one animation
    with pytest.raises(MediaError, match="is missing"):
        video_uri(run, "media/nothing.gif")


def test_secrets_and_markup_never_reach_the_page(tmp_path):
    samples = {0: [{"prompt": "<b>hi</b>", "completion": "<script>alert(1)</script>", "reward": 1.0}]}
    run = synthetic_run(tmp_path / "sec", samples=samples)
    html = report_html([run], tmp_path)
    assert "hunter2" not in html and "&lt;redacted&gt;" in html
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_many_steps_are_thinned(tmp_path):
    rows = [{"step": s, "reward/mean": (s * 7919 % 1000) / 1000} for s in range(1, 5001)]
    html = report_html([synthetic_run(tmp_path / "long", rows, total=5000)], tmp_path)
    path = re.search(r'data-label="reward/mean" data-n="5000" d="([^"]+)"', html).group(1)
    assert len(re.findall(r"[ML]", path)) <= MAX_POINTS


def test_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for target, words in ((tmp_path / "nope", "does not exist"), (tmp_path / "empty", "has no metrics.jsonl")):
        assert main(["report", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and str(target) in err
    with pytest.raises(UserError, match="not a directory"):
        load_run(Path(__file__))


def test_help_explains_the_verbs(capsys):
    for verb, words in (("report", ["self-contained", "wall-clock", "checkpoints", "-o FILE"]),
                        ("status", ["reward trend", "alive", "checkpoint"])):
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert all(w in out for w in words), (verb, out)


def test_nice_ticks():
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(3, 97) == [25, 50, 75]


def test_a_flat_series_gets_distinct_tick_labels_the_timeline_sits_in_the_grid_and_lora_is_named(tmp_path):
    rows = rl_rows(12)
    for r in rows:  # a learning rate constant but for rounding, and a KL term that is off
        r.update(lr=1e-3 + 1e-13 * r["step"], kl=0.0)
    run = synthetic_run(tmp_path / "flat", rows, alerts=[{"time": time.time(), "step": 4, "kind": "nonfinite",
                                                          "message": "skipped"}])
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["lora"] = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": None}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    html = report_html([run], tmp_path)
    lr = re.search(r'<figure class="plot ax-step" data-chart="lr">.*?</figure>', html).group(0)
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', lr)
    assert labels and len(labels) == len(set(labels)), labels  # each y tick once
    assert "kl" not in figures(html)  # a KL of 0 at every step: no chart of nothing
    grid = re.search(r'<div class="plots timelines">(.*?)</div>\s*</section>', html, re.S)
    assert grid and 'data-chart="alerts"' in grid.group(1)  # same grid, same width, same font size as the charts
    assert fact(html, "lora") == "r 8, alpha 16.0"
