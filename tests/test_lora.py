"""LoRA through peft: only the adapter trains, the reference is the base with the adapter off."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytest.importorskip("peft")

from regen.cli import main  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402

LORA = ["model.lora={r: 4, alpha: 8}", "log.progress=none", "data.eval=null", "log.tensorboard=false",
        "rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=4", "optim.lr=1e-2",
        # a reward with variance inside groups even for the weak test base: ends in an even digit
        "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]"]


def test_lora_trains_adapter_only_and_exports_a_merged_model(base_model, tmp_path):
    run = tmp_path / "lora"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "train.steps=3", "algorithm.kl_coef=0.1",
                 *LORA]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0.0  # reference = base with the adapter disabled
    ckpt_model = run / "checkpoints" / "step_00000003" / "model"
    assert (ckpt_model / "adapter_config.json").is_file()
    adapter = load_file(str(ckpt_model / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)  # the checkpoint holds only the adapter
    merged = AutoModelForCausalLM.from_pretrained(run / "export")
    base = AutoModelForCausalLM.from_pretrained(base_model)
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(("attn" in k or "mlp" in k) for k in changed)  # only adapted layers moved
    assert json.loads((run / "checkpoints" / "step_00000003" / "state.json").read_text())["step"] == 3
    # `regen export` of the LoRA checkpoint merges it into its base: the same weights as export/
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "exp").state_dict()
    assert all(torch.allclose(again[k], v, atol=1e-6) for k, v in merged.state_dict().items())


def test_lora_resume_is_exact(base_model, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["train", f"model.path={base_model}", *LORA, "algorithm.kl_coef=0.05"]
    assert main([*common, f"run.dir={a}", "train.steps=4"]) == 0
    assert main([*common, f"run.dir={b}", "train.steps=2"]) == 0
    assert main([*common, f"run.dir={b}", "train.steps=4"]) == 0
    wa, wb = load_file(str(a / "export/model.safetensors")), load_file(str(b / "export/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dpo_with_lora(base_model, tmp_path):
    run = tmp_path / "dpo"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "algorithm.name=dpo", "train.steps=5",
                 "train.global_minibatch_size=16", "model.lora={r: 4, alpha: 8}", "log.progress=none",
                 "data.eval=null", "log.tensorboard=false", "optim.lr=1e-2"]) == 0
    assert AutoModelForCausalLM.from_pretrained(run / "export") is not None
