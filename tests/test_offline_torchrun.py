"""`regen sft` (a language model and a flow model), DPO and `regen rm` under `torchrun --nproc_per_node 2`
(gloo, CPU) train the weights one process trains: each rank takes its share of every batch, the losses are
shares of the batch's, and the gradients are summed over the ranks (regen/offline/books.py). Real processes, a
real process group."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from regen.cli import main
from tests.conftest import read_jsonl
from tests.test_offline_books import pairs_file
from tests.test_torchrun import ROOT, assert_same_weights

pytestmark = pytest.mark.extended  # multi-process: the CI's second tier

QUIET = ["log.progress=none", "log.tensorboard=false", "run.threads=1", "data.eval=null", "optim.lr=1e-3"]


@pytest.fixture(scope="module")
def no_dropout(base_model, tmp_path_factory):
    """The SFT'd GPT-2 with its dropout off: with dropout on, a rank draws masks for its rows only, so two
    processes draw other masks than one (the same distribution, not the same numbers)."""
    folder = tmp_path_factory.mktemp("nodrop") / "model"
    shutil.copytree(base_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def command(kind: str, model, run) -> list[str]:
    if kind == "flow_sft":  # the built-in shapes model from its seeded initialisation
        return ["sft", "model.init=shapes-unet", "data.train=builtin:shapes:train", "sft.steps=6",
                "sft.global_batch_size=8", "checkpoint.every=1", "checkpoint.keep_last=6", f"run.dir={run}", *QUIET]
    own = {"sft": ["sft", "sft.steps=6", "sft.global_batch_size=8"],
           "dpo": ["train", "algorithm.name=dpo", "train.steps=6", "train.global_minibatch_size=8",
                   f"data.train={pairs_file(run)}"],
           "rm": ["rm", "rm.steps=6", "rm.global_batch_size=8", f"data.train={pairs_file(run)}", "checkpoint.every=1",
                  "checkpoint.keep_last=6"]}[kind]
    return [*own, f"model.path={model}", f"run.dir={run}", *QUIET]


def torchrun2(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "regen", *args, "distributed.mode=torchrun"], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("kind,strategy", [("sft", "ddp"), ("sft", "fsdp"), ("dpo", "ddp"), ("dpo", "fsdp"),
                                           ("rm", "ddp"), ("rm", "fsdp"), ("flow_sft", "ddp")])
def test_two_processes_train_what_one_trains(kind, strategy, no_dropout, tmp_path):
    """DDP: the gradients summed in one all-reduce; FSDP2: parameters, gradients and optimizer state sharded, the
    checkpoints and export/ gathered into the single-process form."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    assert main(command(kind, no_dropout, one / "run")) == 0
    out = torchrun2([*command(kind, no_dropout, two / "run"), f"distributed.strategy={strategy}"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("model exported to") == 1  # rank 0 speaks for the run
    rows, ref = read_jsonl(two / "run" / "metrics.jsonl"), read_jsonl(one / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, 7))  # one metrics file, rank 0's
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-4, abs=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-3, abs=1e-6)
    export = two / "run" / "export"
    if kind in ("rm", "flow_sft"):  # a new head / a fresh model: movement measured from the one-process run's step 1
        assert_same_weights(export, one / "run" / "export", one / "run" / "checkpoints" / "step_00000001" / "model")
    else:
        assert_same_weights(export, one / "run" / "export", no_dropout)


def test_an_fsdp_checkpoint_resumes_in_one_process_as_if_never_sharded(no_dropout, tmp_path):
    """3 steps sharded over 2 processes, then 3 more in one process from its checkpoint: the weights of 6 steps
    in one process (the gathered optimizer state and the data position carried over)."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(command("sft", no_dropout, one)) == 0
    out = torchrun2([*command("sft", no_dropout, two), "sft.steps=3", "distributed.strategy=fsdp"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert main([*command("sft", no_dropout, two), "--resume"]) == 0
    assert_same_weights(two / "export", one / "export", no_dropout)
    rows = read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))


def test_fsdp_is_refused_where_it_does_not_shard(no_dropout, tmp_path):
    out = torchrun2([*command("flow_sft", None, tmp_path / "a"), "distributed.strategy=fsdp"], timeout=300)
    assert out.returncode != 0 and "regen sft of a flow model is data parallel with ddp only" in out.stderr
    lora = [*command("dpo", no_dropout, tmp_path / "b"), "model.lora={r: 4}", "distributed.strategy=fsdp"]
    out = torchrun2(lora, timeout=300)
    assert out.returncode != 0 and "a LoRA adapter or a vision-language model trains data parallel" in out.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_uneven_split_is_refused_before_the_run_directory(no_dropout, tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "regen", "sft", f"model.path={no_dropout}", f"run.dir={tmp_path / 'run'}", *QUIET,
                          "sft.global_batch_size=9"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode != 0
    assert "sft.global_batch_size=9 cannot be split evenly over 2 processes" in out.stderr
    assert not (tmp_path / "run").exists()
