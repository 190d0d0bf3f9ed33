import torch
from safetensors.torch import load_file

from regen.cli import main
from regen.data import Demo
from regen.offline.sft import IGNORE, encode_demos
from regen.tasks.arithmetic import build_tokenizer
from tests.conftest import read_jsonl

FAST = ["model.init=arith-char-gpt2", "log.progress=none", "log.tensorboard=false", "data.eval=null",
        "sft.global_batch_size=16"]


def test_only_completion_and_eos_are_trained():
    tok = build_tokenizer()
    ids, mask, labels, _ = encode_demos([Demo("1+2=", "3"), Demo("10+20=", "30")], tok, 32)
    eos = tok.eos_token_id
    # row 1 is the longest: "10+20=" (6) + "30" (2) + EOS = 9 tokens, so row 0 gets 3 pads.
    # row 0: "1+2=" (4 tokens) then "3", EOS; prompt positions are ignored, padding too
    assert labels[0].tolist() == [IGNORE] * 4 + [tok.convert_tokens_to_ids("3"), eos] + [IGNORE] * 3
    assert mask[0].tolist() == [1] * 6 + [0] * 3 and mask[1].tolist() == [1] * 9
    assert tok.decode(ids[1, :6].tolist()) == "10+20="


def test_sft_lowers_the_loss(tmp_path):
    assert main(["sft", *FAST, f"run.dir={tmp_path}", "sft.steps=60", "optim.lr=3e-3"]) == 0
    losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    # a fresh model over 14 tokens starts near ln(14) = 2.64 per token
    assert losses[0] > 2.0 and sum(losses[-10:]) / 10 < 0.75 * losses[0]


def test_sft_resume_is_exact(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["sft", *FAST, f"run.dir={a}", "sft.steps=8"]) == 0
    assert main(["sft", *FAST, f"run.dir={b}", "sft.steps=4"]) == 0
    assert main(["sft", *FAST, f"run.dir={b}", "sft.steps=8", "--resume"]) == 0
    wa, wb = load_file(str(a / "export/model.safetensors")), load_file(str(b / "export/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["step"] for r in read_jsonl(b / "metrics.jsonl")] == list(range(1, 9))
