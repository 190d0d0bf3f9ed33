"""bench/flow_methods.py --reuse: runs of an earlier --out JSON count as if run here, matched by base
folder and seed, so one invocation can summarise runs made in several (no training runs here: every
run is reused)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def base_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "flow_policy.json").write_text(json.dumps({"sample_shape": [3, 16, 16]}))  # an image model
    return path


def run(name: str, base: int, seed: int, rewards: list[float], adherence: list[float], seconds: list[float]) -> dict:
    """A run record as flow_methods.py writes it, with evaluations at steps 0, 10, 20, ..."""
    steps = [10 * i for i in range(len(rewards))]
    return {
        "name": name, "label": {"flow_grpo": "Flow-GRPO", "nft": "DiffusionNFT"}[name], "base": base, "seed": seed,
        "config": f"examples/shapes_{name}.yaml", "run_dir": f"/old/{name}-{base}-{seed}", "call_s": 1.0,
        "load_before": 0.5, "lr": 1e-4, "train_steps": steps[-1], "global_batch_size": 64, "group_size": 8,
        "threads": 2, "eval_prompts": 12, "eval_samples_per_prompt": 32, "eval_count": 384, "steps": steps,
        "seconds": seconds, "images": [64 * s for s in steps], "reward": rewards, "adherence": adherence,
        "reward_at_0": rewards[0], "adherence_at_0": adherence[0], "final_reward": rewards[-1],
        "final_adherence": adherence[-1], "train_s": seconds[-1], "train_images": 64 * steps[-1],
        "median_step_ms": 1000.0,
    }


def out_json(path: Path, bases: list[Path], runs: list[dict]) -> str:
    path.write_text(json.dumps({"settings": {"bases": [str(b) for b in bases]}, "runs": runs}))
    return str(path)


def main(argv: list[str], monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("flow_methods", None)
    import flow_methods

    monkeypatch.setattr(flow_methods, "regen", lambda *a, **k: pytest.fail(f"a run was started: {a}"))
    monkeypatch.setattr(sys, "argv", ["flow_methods.py", *argv])
    flow_methods.main()


def test_reused_runs_give_targets_and_speedups_by_base_folder_and_seed(tmp_path, monkeypatch):
    b0, b1 = base_folder(tmp_path / "b0"), base_folder(tmp_path / "b1")
    # Flow-GRPO came from an invocation whose only base was b1 (its index 0 there), NFT from one with both
    grpo_b1 = out_json(tmp_path / "grpo_b1.json", [b1], [
        run("flow_grpo", 0, 0, [0.14, 0.15, 0.17], [0.90, 0.90, 0.92], [0, 100, 200]),
        run("flow_grpo", 0, 1, [0.14, 0.16, 0.19], [0.90, 0.91, 0.93], [0, 110, 220]),
        run("nft", 0, 0, [0.14, 0.99, 0.99], [0.90, 0.99, 0.99], [0, 1, 2]),  # not taken: --reuse names flow_grpo
    ])
    grpo_b0 = out_json(tmp_path / "grpo_b0.json", [b0], [
        run("flow_grpo", 0, 0, [0.13, 0.15, 0.16], [0.89, 0.90, 0.90], [0, 90, 180]),
        run("flow_grpo", 0, 1, [0.13, 0.15, 0.16], [0.89, 0.90, 0.90], [0, 95, 190]),
    ])
    nft = out_json(tmp_path / "nft.json", [b0, b1], [
        # base 0 target 0.16: reached at step 10 (0.165, 0.17), 20 s
        run("nft", 0, 0, [0.13, 0.165, 0.17, 0.18], [0.89, 0.90, 0.91, 0.92], [0, 20, 40, 60]),
        # adherence below step 0 at step 10: reached at 20 instead, 50 s
        run("nft", 0, 1, [0.13, 0.17, 0.17, 0.17], [0.89, 0.85, 0.90, 0.90], [0, 25, 50, 75]),
        # base 1 target 0.18 (mean of 0.17 and 0.19): reached at 10, 30 s
        run("nft", 1, 0, [0.14, 0.185, 0.185, 0.185], [0.90, 0.91, 0.92, 0.92], [0, 30, 60, 90]),
        # never two in a row: not reached, and it ends below the target (not held)
        run("nft", 1, 1, [0.14, 0.185, 0.17, 0.185, 0.17], [0.90, 0.91, 0.92, 0.92, 0.93], [0, 30, 60, 90, 120]),
    ])
    out = tmp_path / "all.json"
    main(["--base", str(b0), "--base", str(b1), "--seeds", "2", "--only", "flow_grpo,nft",
          "--reuse", f"flow_grpo={grpo_b1}", "--reuse", f"flow_grpo={grpo_b0}", "--reuse", f"nft={nft}",
          "--png", str(tmp_path / "fig.png"), "--out", str(out)], monkeypatch)
    d = json.loads(out.read_text())
    assert d["settings"]["targets"] == {"0": pytest.approx(0.16), "1": pytest.approx(0.18)}
    runs = {(r["name"], r["base"], r["seed"]): r for r in d["runs"]}
    assert len(runs) == 8 and runs["nft", 1, 0]["run_dir"] == "/old/nft-1-0"  # base index of this invocation
    assert [runs["nft", b, s]["target_step"] for b, s in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [10, 20, 10, None]
    assert [runs["nft", b, s]["held"] for b, s in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [True, True, True, False]
    # the reference: Flow-GRPO's mean whole run over both bases, (200 + 220 + 180 + 190) / 4 = 197.5 s
    assert runs["nft", 0, 0]["speedup_time"] == pytest.approx(197.5 / 20)
    s = d["summary"]["nft"]
    assert (s["reached"], s["held"], s["speedup_time"]) == (3, 3, None)  # not every run reached it: no mean speed-up
    assert d["settings"]["reused"] == [f"flow_grpo={grpo_b1}", f"flow_grpo={grpo_b0}", f"nft={nft}"]


def test_reuse_of_a_file_that_is_not_an_out_json_is_refused(tmp_path, monkeypatch, capsys):
    b0 = base_folder(tmp_path / "b0")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(SystemExit):
        main(["--base", str(b0), "--only", "flow_grpo", "--reuse", f"flow_grpo={bad}"], monkeypatch)
    assert f"--reuse flow_grpo={bad}: not a flow_methods.py --out JSON (KeyError: 'settings')" in capsys.readouterr().err


def test_reuse_of_a_method_that_is_not_run_is_refused(tmp_path, monkeypatch, capsys):
    b0 = base_folder(tmp_path / "b0")
    grpo = out_json(tmp_path / "grpo.json", [b0], [run("flow_grpo", 0, 0, [0.1, 0.2], [0.9, 0.9], [0, 1])])
    with pytest.raises(SystemExit):
        main(["--base", str(b0), "--only", "nft", "--target", "0.2", "--reuse", f"flow_grpo={grpo}"], monkeypatch)
    assert "--reuse flow_grpo: not among the methods run here (nft); add it to --only" in capsys.readouterr().err
