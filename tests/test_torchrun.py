"""torchrun data parallelism on CPU (gloo, 2 processes): the same weights as one process with
the same global batch, for DDP and FSDP2; checkpoints interchangeable with a single process."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import regen.modalities.lm
from regen.cli import main
from tests.conftest import BRIGHT, NaNAt, read_jsonl
from tests.test_train_e2e import ENDS_EVEN, FAST

pytestmark = pytest.mark.extended  # multi-process: the CI's second tier (pyproject.toml markers)

# 4 prompts x 4 samples per step, minibatches of 8 (2 per rank) and 2 epochs: shuffled minibatches,
# a KL reference and several optimizer steps per batch all cross the rank boundary
SETUP = [*FAST, ENDS_EVEN, "train.global_minibatch_size=8", "train.ppo_epochs=2", "algorithm.kl_coef=0.05",
         "optim.lr=1e-3", "run.threads=1"]


ROOT = Path(__file__).resolve().parents[1]


def torchrun(run, base, *extra, nproc=2, entry=("-m", "regen")):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry,
           "train", f"model.path={base}", f"run.dir={run}", *SETUP, "distributed.mode=torchrun", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def single(run, base, *extra):
    return main(["train", f"model.path={base}", f"run.dir={run}", *SETUP, "distributed.mode=single", *extra])


def assert_same_weights(a, b, start):
    """The two runs' weights agree to float tolerance, measured against how far training moved
    them: ||wa - wb|| < 1e-3 ||wb - w0||. (An elementwise bound would be wrong here: GPT-2's key
    biases get a gradient that is zero up to rounding -- softmax ignores a constant shift -- and
    Adam turns that rounding noise into full-size steps in either process.)"""
    wa, wb, w0 = _weights(a), _weights(b), _weights(start)
    assert wa.keys() == wb.keys() and wa
    diff = sum(((wa[k] - wb[k]) ** 2).sum() for k in wa) ** 0.5
    moved = sum(((wb[k] - w0[k]) ** 2).sum() for k in wa) ** 0.5
    assert moved > 1e-3 and diff < 1e-3 * moved, (float(diff), float(moved))


def _weights(folder) -> dict:
    """Every tensor of every safetensors file under `folder` (a flow model keeps its UNet and prompt encoder
    apart), keyed by file and name."""
    return {f"{f.relative_to(folder)}:{k}": v for f in sorted(folder.rglob("*.safetensors"))
            for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def one_process(base_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    assert single(run, base_model, "train.steps=3") == 0
    return run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_the_same_weights_as_one(strategy, base_model, one_process, tmp_path):
    run = tmp_path / strategy
    colocate = ["distributed.colocate=true"] if strategy == "ddp" else []  # refused with fsdp (test below)
    out = torchrun(run, base_model, "train.steps=3", f"distributed.strategy={strategy}", "checkpoint.every=2", *colocate)
    assert out.returncode == 0, out.stderr[-3000:]
    # rank 0 alone wrote the run directory: one metrics row per step, the same rewards as one process
    rows, ref = read_jsonl(run / "metrics.jsonl"), read_jsonl(one_process / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(("memory/update_peak_mb" in r) == bool(colocate) for r in rows)  # colocated ranks measure phases
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]
    assert [r["response_length/mean"] for r in rows] == [r["response_length/mean"] for r in ref]
    for key in ("loss", "kl", "grad_norm", "entropy"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-4, abs=1e-6), key
    assert ref[-1]["kl"] > 0 and ref[-1]["grad_norm"] > 0  # the weights really moved
    assert_same_weights(run / "export", one_process / "export", base_model)
    # the checkpoint is a single-process one (FSDP2 shards gathered): one process resumes it
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    if strategy == "fsdp":  # one process continues from the FSDP2 run's step-2 checkpoint
        shutil.rmtree(run / "checkpoints" / "step_00000003")
        shutil.rmtree(run / "export")
        assert single(run, base_model, "train.steps=3") == 0
        assert_same_weights(run / "export", one_process / "export", base_model)


def test_batches_that_do_not_split_over_the_ranks_are_refused(base_model, tmp_path):
    # 3 prompts per step over 2 processes: refused before the run directory is touched
    out = torchrun(tmp_path / "r", base_model, "rollout.global_batch_size=12", "train.global_minibatch_size=12")
    assert out.returncode != 0
    assert "3 prompts per step cannot be split evenly under torchrun with 2 processes" in out.stderr
    assert not (tmp_path / "r").exists()


def test_colocate_with_fsdp_is_refused_before_anything_is_written(base_model, tmp_path):
    out = torchrun(tmp_path / "r", base_model, "distributed.strategy=fsdp", "distributed.colocate=true")
    assert out.returncode != 0
    assert "distributed.colocate with distributed.strategy=fsdp: not supported yet" in out.stderr
    assert not (tmp_path / "r").exists()


def test_torchrun_mode_outside_torchrun_is_a_clear_error(base_model, tmp_path, capsys):
    assert single(tmp_path / "r", base_model, "distributed.mode=torchrun") == 2
    assert "start the job with torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["fsdp"])  # DDP's path is the policy's (test above); FSDP2 shards the critic too
def test_ppo_critic_is_data_parallel_too(strategy, base_model, tmp_path):
    ppo = ["algorithm.name=ppo", "critic.lr=1e-3", "train.steps=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert single(one, base_model, *ppo) == 0
    out = torchrun(two, base_model, *ppo, f"distributed.strategy={strategy}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows, ref = read_jsonl(two / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]
    for key in ("loss", "critic/value_loss", "critic/grad_norm", "critic/explained_var"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-4, abs=1e-6), key
    assert_same_weights(two / "export", one / "export", base_model)
    c2, c1 = (load_file(str(p / "checkpoints" / "step_00000002" / "critic" / "model.safetensors")) for p in (two, one))
    assert c1.keys() == c2.keys()
    diff = sum(((c1[k] - c2[k]) ** 2).sum() for k in c1) ** 0.5
    assert diff < 1e-4 * sum((c1[k] ** 2).sum() for k in c1) ** 0.5


@pytest.mark.parametrize("strategy", ["fsdp"])  # restoring sharded weights and optimizer state: the harder case
def test_rollback_under_torchrun_matches_one_process(strategy, base_model, tmp_path, monkeypatch):
    # every loss of steps 3 and 4 is NaN (4 minibatches a step): two unhealthy steps roll back to step 2
    nan_calls = range(9, 17)
    health = ["train.steps=6", "checkpoint.every=2", "health.rollback_after_nonfinite=2"]
    losses = regen.modalities.lm.POLICY_LOSSES
    monkeypatch.setitem(losses, "grpo", NaNAt(losses["grpo"], set(nan_calls)))
    one, two = tmp_path / "one", tmp_path / "two"
    assert single(one, base_model, *health) == 0
    out = torchrun(two, base_model, *health, f"distributed.strategy={strategy}",
                   entry=[str(ROOT / "tests" / "nan_entry.py"), ",".join(map(str, nan_calls))])
    assert out.returncode == 0, out.stderr[-3000:]
    kinds = lambda run: [(a["step"], a["kind"]) for a in read_jsonl(run / "alerts.jsonl")]  # noqa: E731
    assert kinds(two) == kinds(one) == [(3, "nonfinite"), (4, "nonfinite"), (4, "rollback")]
    rows, ref = read_jsonl(two / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref] and rows[-1]["lr"] < rows[0]["lr"]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]
    assert_same_weights(two / "export", one / "export", base_model)


# the DDP / FSDP2 code is shared by the methods: each strategy once (FSDP2 with NFT, whose frozen
# copies are sharded beside the network; the KL reference is sharded the same way for language models)
def flow_args(flow_base, algo: str) -> list[str]:
    """4 prompts x 4 images a step, minibatches of 8 over 2 epochs; flow_grpo with its KL reference,
    nft with its EMA old policy (both sharded alike under FSDP2) and a weight EMA."""
    return [f"model.path={flow_base}", f"algorithm.name={algo}", "data.train=builtin:shapes:train", "data.eval=null",
            "rollout.global_batch_size=16", "rollout.group_size=4", "train.global_minibatch_size=8",
            "train.ppo_epochs=2", "flow.steps=4", "log.progress=none", "log.tensorboard=false", "optim.lr=1e-3",
            "run.threads=1", "train.steps=3", BRIGHT,
            *(["algorithm.kl_coef=0.01"] if algo == "flow_grpo" else ["flow.weight_ema=0.5", "flow.ema_rate=0.2"])]


def assert_same_flow_training(two, one, flow_base):
    """Run `two` logged what `one` logged (to float noise) and its UNet is within 1e-3 of how far
    training moved the weights (see assert_same_weights)."""
    rows, ref = read_jsonl(two / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    for key in ("reward/mean", "loss", "grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-4, abs=1e-6), key
    unet = "unet/diffusion_pytorch_model.safetensors"
    w2, w1, w0 = (load_file(str(p / unet)) for p in (two / "export", one / "export", Path(flow_base)))
    diff = sum(((w2[k] - w1[k]) ** 2).sum() for k in w1) ** 0.5
    moved = sum(((w1[k] - w0[k]) ** 2).sum() for k in w1) ** 0.5
    assert moved > 1e-3 and diff < 1e-3 * moved, (float(diff), float(moved))


@pytest.mark.parametrize("algo,strategy", [("flow_grpo", "ddp"), ("nft", "fsdp")])
def test_flow_models_train_the_same_weights_on_two_processes(algo, strategy, flow_base, tmp_path):
    args = flow_args(flow_base, algo)
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *args, f"run.dir={one}", "distributed.mode=single"]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "regen", "train",
           *args, f"run.dir={two}", "distributed.mode=torchrun", f"distributed.strategy={strategy}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_flow_training(two, one, flow_base)


def test_torchrun_with_mode_single_is_refused(base_model, tmp_path):
    # two one-process runs would write the same run directory
    out = torchrun(tmp_path / "r", base_model, "distributed.mode=single")
    assert out.returncode != 0 and "started by torchrun with 2 processes but distributed.mode=single" in out.stderr
    assert not (tmp_path / "r").exists()


HANG = """
import sys, time
import torch, torch.distributed as tdist
from regen.runtime import dist as rdist
d = rdist.start("torchrun", "ddp", "gloo", torch.device("cpu"), float(sys.argv[1]))
if d.rank == 1:  # a rank that hangs: never joins the collectives
    time.sleep(15)
    sys.exit(0)
for name, group in (("side", d.side_group), ("main", None)):
    t0 = time.monotonic()
    try:
        tdist.all_reduce(torch.ones(1), group=group)
        print(name, "returned")
    except Exception:
        print(name, "failed after", round(time.monotonic() - t0, 1))
"""


def test_distributed_timeout_s_bounds_the_wait_for_a_hung_rank(tmp_path):
    """distributed.timeout_s reaches both process groups: a collective that a hung rank never joins
    fails after about that long, not after the former hard-coded 30 minutes."""
    entry = tmp_path / "hang.py"
    entry.write_text(HANG)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(entry), "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    waits = {line.split()[0]: float(line.split()[-1]) for line in done.stdout.splitlines() if " failed after " in line}
    assert set(waits) == {"side", "main"}, done.stdout + done.stderr[-2000:]
    assert all(2.5 <= w < 10 for w in waits.values()), waits
