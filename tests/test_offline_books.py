"""The guarantees of RL runs, held by the four trainers without sampling (regen/offline/books.py):
`regen sft` of a language and a flow model, DPO and `regen rm`. Non-finite steps skipped, rolled back
and never exported; resume refused when a setting changed (--force resumes); another trainer's run
directory refused and left untouched; a full disk (a real tmpfs) an alert and one error line; unread
keys refused."""

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from regen.cli import main
from regen.offline.books import OfflineRun
from tests.conftest import read_jsonl
from tests.test_guarantees import small_disk  # noqa: F401  (the 1 MiB tmpfs fixture)

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["log.progress=none", "log.tensorboard=false", "run.threads=1", "data.eval=null"]
STEPS = {"sft": "sft.steps", "flow_sft": "sft.steps", "dpo": "train.steps", "rm": "rm.steps"}


def pairs_file(run: Path) -> Path:
    """16 preference pairs beside the run directory (DPO scores all of its pairs under the reference first)."""
    f = run.parent / "pairs.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)}) + "\n"
                         for a in range(10, 26)))
    return f


def args(kind: str, base: Path, run: Path, *extra: str) -> list[str]:
    """The command line of one small run of trainer `kind` (base: the SFT'd GPT-2 for DPO and RM)."""
    own = {"sft": ["sft", "model.init=arith-char-gpt2", "sft.global_batch_size=8"],
           "flow_sft": ["sft", "model.init=shapes-unet", "data.train=builtin:shapes:train", "sft.global_batch_size=4"],
           "dpo": ["train", f"model.path={base}", "algorithm.name=dpo", "train.global_minibatch_size=8",
                   f"data.train={pairs_file(run)}"],
           "rm": ["rm", f"model.path={base}", "rm.global_batch_size=8", f"data.train={pairs_file(run)}"]}[kind]
    return [*own, f"run.dir={run}", *QUIET, *extra]


@pytest.fixture(params=["sft", "flow_sft", "dpo", "rm"])
def trainer(request, base_model):
    kind = request.param
    return lambda run, *extra: args(kind, base_model, run, *extra), kind


class weights_of(dict):
    """Every tensor of the safetensors files under a folder; equal when every tensor is."""

    def __init__(self, folder: Path):
        super().__init__({f"{f.relative_to(folder)}:{k}": v for f in sorted(folder.rglob("*.safetensors"))
                          for k, v in load_file(str(f)).items()})

    def __eq__(self, other) -> bool:
        return self.keys() == other.keys() and all(bool((self[k] == other[k]).all()) for k in self)

    def __ne__(self, other) -> bool:
        return not self == other


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_nonfinite_steps_roll_back_then_stop_and_nothing_is_exported(trainer, tmp_path, capsys):
    cmd, kind = trainer
    run = tmp_path / "run"
    # lr 1e6: the first step throws the weights far out, every later loss is non-finite
    assert main(cmd(run, f"{STEPS[kind]}=20", "optim.lr=1e6", "health.rollback_after_nonfinite=2",
                    "health.max_rollbacks=2")) == 2
    err = capsys.readouterr().err
    assert "still not finite after 2 rollbacks" in err and "nothing was exported" in err
    assert not (run / "export").exists()
    alerts = read_jsonl(run / "alerts.jsonl")
    kinds = [a["kind"] for a in alerts]
    assert kinds.count("rollback") == 2 and "nonfinite" in kinds
    assert [a["lr_scale"] for a in alerts if a["kind"] == "rollback"] == [0.5, 0.25]
    rows = read_jsonl(run / "metrics.jsonl")
    skipped = [r["step"] for r in rows if r["nonfinite_skipped"] == 1.0]
    assert skipped and rows[-1]["nonfinite_skipped"] == 1.0
    assert json.loads((run / "run.json").read_text())["status"] == "stopped"
    assert not (run / "run.lock").exists()


@pytest.fixture
def nan_at_steps_3_and_4(monkeypatch):
    """OfflineRun.optimizer_step handed a NaN loss (the loss the trainer computed, turned NaN) at its 3rd and 4th
    calls: the real fault a diverging step shows the books."""
    real, calls = OfflineRun.optimizer_step, []

    def step(self, loss, lr, grad_clip):
        calls.append(lr)
        return real(self, loss * float("nan") if len(calls) in (3, 4) else loss, lr, grad_clip)

    monkeypatch.setattr(OfflineRun, "optimizer_step", step)


def test_a_passing_nonfinite_streak_rolls_back_to_the_last_checkpoint(trainer, tmp_path, nan_at_steps_3_and_4):
    """Steps 3 and 4 non-finite (the loss the trainer computed, turned NaN): both skipped, then a rollback to
    step 2's checkpoint at half the learning rate; the run finishes and exports finite weights."""
    cmd, kind = trainer
    run = tmp_path / "run"
    assert main(cmd(run, f"{STEPS[kind]}=6", "optim.lr=1e-4", "checkpoint.every=2", "checkpoint.keep_last=3",
                    "health.rollback_after_nonfinite=2")) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    steps = [r for r in rows if "nonfinite_skipped" in r]
    assert [r["nonfinite_skipped"] for r in steps] == [0, 0, 1, 1, 0, 0]
    assert [r["lr"] for r in steps] == [1e-4] * 4 + [5e-5] * 2
    rollback = [a for a in read_jsonl(run / "alerts.jsonl") if a["kind"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 4 and "step_00000002" in rollback[0]["message"]
    # rolled back before step 4's checkpoint: it holds step 2's weights again
    ckpts = run / "checkpoints"
    assert weights_of(ckpts / "step_00000004" / "model") == weights_of(ckpts / "step_00000002" / "model")
    assert weights_of(ckpts / "step_00000006" / "model") != weights_of(ckpts / "step_00000004" / "model")
    exported = weights_of(run / "export")
    assert exported and all(bool(v.isfinite().all()) for v in exported.values())


def test_resume_refuses_a_changed_setting_and_force_resumes(trainer, tmp_path, capsys):
    cmd, kind = trainer
    run = tmp_path / "run"
    assert main(cmd(run, f"{STEPS[kind]}=2", "optim.lr=1e-4")) == 0
    before = tree_digest(run)
    capsys.readouterr()
    assert main(cmd(run, f"{STEPS[kind]}=3", "optim.lr=2e-4")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.lr: 0.0001 -> 0.0002" in err[0] and "--force" in err[0]
    assert tree_digest(run) == before  # refused before anything was written
    assert main(cmd(run, f"{STEPS[kind]}=3", "optim.lr=2e-4", "--force")) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["lr"] == 2e-4


def test_a_run_directory_held_by_a_live_process_is_refused_and_left_as_it_was(trainer, tmp_path, capsys):
    """A second trainer on a run directory whose run.lock a live process holds (a real second process)."""
    cmd, kind = trainer
    run = tmp_path / "run"
    assert main(cmd(run, f"{STEPS[kind]}=1")) == 0
    before = tree_digest(run)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from regen.runtime.rundir import lock; lock(Path(sys.argv[1])); print('held', "
                               "flush=True); time.sleep(600)", str(run)], cwd=Path(__file__).resolve().parents[1],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert main(cmd(run, f"{STEPS[kind]}=2")) == 2
        assert f"in use by process {holder.pid}" in capsys.readouterr().err
        assert {k: v for k, v in tree_digest(run).items() if k != "run.lock"} == \
            {k: v for k, v in before.items() if k != "run.lock"}
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.parametrize("first,second", [("grpo", "sft"), ("sft", "grpo"), ("sft", "dpo"), ("sft", "rm"),
                                          ("rm", "sft")])
def test_another_trainers_run_directory_is_refused_and_left_as_it_was(first, second, base_model, tmp_path, capsys):
    run = tmp_path / "run"

    def cmd(kind: str, steps: int) -> list[str]:
        if kind == "grpo":
            return ["train", f"model.path={base_model}", f"run.dir={run}", *QUIET, f"train.steps={steps}",
                    "rollout.global_batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=4"]
        return args(kind, base_model, run, f"{STEPS[kind]}={steps}")

    assert main(cmd(first, 1)) == 0
    before = tree_digest(run)
    capsys.readouterr()
    assert main(cmd(second, 2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a run of" in err[0] and "choose another run.dir" in err[0], err
    assert tree_digest(run) == before


def test_a_full_disk_is_an_alert_then_one_error_line(trainer, small_disk, capsys):  # noqa: F811
    cmd, kind = trainer
    run = small_disk / "run"
    assert main(cmd(run, f"{STEPS[kind]}=2", "checkpoint.every=1")) == 2
    err = capsys.readouterr().err
    assert "the final checkpoint could not be written" in err and "Traceback" not in err
    failed = [a for a in read_jsonl(run / "alerts.jsonl") if a["kind"] == "checkpoint_failed"]
    assert [a["step"] for a in failed] == [1, 2]  # the periodic one too: training went on after it
    assert not list((run / "checkpoints").iterdir())  # no half-written folder left behind


@pytest.mark.parametrize("model,key", [("model.init=arith-char-gpt2", "rollout.group_size=4"),
                                       ("model.init=arith-char-gpt2", "rollout.engine=vllm"),
                                       ("model.init=shapes-unet", "rollout.temperature=0.5")])
def test_sft_refuses_keys_it_does_not_read(model, key, tmp_path, capsys):
    assert main(["sft", model, f"run.dir={tmp_path / 'run'}", key]) == 2
    err = capsys.readouterr().err
    assert f"{key.split('=')[0]} is not read by `regen sft`" in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ real signals to a real process


@pytest.mark.extended  # two subprocess runs per trainer (a SIGKILL and a SIGTERM): second CI tier
def test_sigkill_and_sigterm_then_resume_give_the_uninterrupted_weights(trainer, tmp_path):
    """One uninterrupted run; one SIGKILLed at step 3 and one SIGTERMed at step 3 (each a real process), both
    rerun with the same command: all three export the same weights, bit for bit."""
    cmd, kind = trainer
    steps = [f"{STEPS[kind]}=6", "checkpoint.every=1", "optim.lr=1e-3"]
    assert main(cmd(tmp_path / "ref", *steps)) == 0
    for sig in (signal.SIGKILL, signal.SIGTERM):
        run = tmp_path / sig.name
        proc = subprocess.Popen([sys.executable, "-m", "regen", *cmd(run, *steps)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            rows = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
            if len([r for r in rows if '"loss"' in r]) >= 3:
                break
            time.sleep(0.02)
        proc.send_signal(sig)
        out = proc.communicate(timeout=120)[0]
        if sig == signal.SIGTERM:
            assert proc.returncode == 0 and "run the same command to resume" in out, out
            assert json.loads((run / "run.json").read_text())["status"] == "stopped"
        else:
            assert proc.returncode == -signal.SIGKILL, out
        assert not (run / "export").exists()
        assert main(cmd(run, *steps)) == 0
        assert weights_of(run / "export") == weights_of(tmp_path / "ref" / "export"), sig.name


@pytest.mark.parametrize("verb,model,keys", [
    ("sft", "model.init=arith-char-gpt2", ["distributed.mode=single", "distributed.backend=gloo"]),
    ("sft", "model.init=shapes-unet", ["distributed.mode=single", "distributed.timeout_s=60"]),
    ("rm", "model.init=arith-char-gpt2", ["distributed.mode=single", "distributed.timeout_s=60"])])
def test_process_group_keys_outside_torchrun_are_refused(verb, model, keys, tmp_path, capsys):
    assert main([verb, model, f"run.dir={tmp_path / 'run'}", *keys]) == 2
    key = keys[-1].split("=")[0]
    assert key in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_lora_dpo_run_rolls_back_its_adapter(base_model, tmp_path, nan_at_steps_3_and_4):
    """DPO with model.lora: a rollback reloads the adapter of the last healthy checkpoint onto the starting weights
    (the checkpoint holds the adapter only)."""
    run = tmp_path / "run"
    assert main(args("dpo", base_model, run, "train.steps=6", "optim.lr=1e-3", "checkpoint.every=2",
                     "checkpoint.keep_last=3", "health.rollback_after_nonfinite=2", "model.lora={r: 4, alpha: 8}")) == 0
    ckpts = run / "checkpoints"
    assert (ckpts / "step_00000002" / "model" / "adapter_model.safetensors").is_file()
    assert weights_of(ckpts / "step_00000004" / "model") == weights_of(ckpts / "step_00000002" / "model")
    assert weights_of(ckpts / "step_00000006" / "model") != weights_of(ckpts / "step_00000004" / "model")
