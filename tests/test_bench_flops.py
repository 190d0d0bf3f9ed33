"""The FLOP count behind grpo_vs_trl.py's MFU (bench/_lm_compute.py), against numbers worked by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _lm_compute import even_fraction, model_shape, step_flops  # noqa: E402

# 100 matmul parameters, 2 layers of width 4: a position with context c costs 2*100 + 4*2*4*c = 200 + 32c
SHAPE = {"matmul_params": 100, "layers": 2, "width": 4}


def test_step_flops_by_hand():
    # 8 completions, prompts of 4 tokens (mean context 2: 264 each), completions of 2 (context 4 + 1: 360 each)
    forward = 8 * 4 * 264 + 8 * 2 * 360  # 8448 + 5760
    assert step_flops(SHAPE, 8, 4, 2, reference=False) == pytest.approx(4 * forward)  # sample + 3 (update)
    assert step_flops(SHAPE, 8, 4, 2, reference=True) == pytest.approx(5 * forward)
    shared = 8 / 4 * 4 * 264 + 8 * 2 * 360  # each group of 4 runs its prompt once
    assert step_flops(SHAPE, 8, 4, 2, reference=False, group=4) == pytest.approx(4 * shared)


def test_model_shape_counts_every_matmul(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=10).save_pretrained(tmp_path)
    # per block: qkv 8x24, out 8x8, MLP 8x32 and 32x8 = 192 + 64 + 512; two blocks; head 8x10
    assert model_shape(str(tmp_path)) == {"matmul_params": 2 * 768 + 80, "layers": 2, "width": 8}


def test_even_fraction():
    assert even_fraction("w2 w3 w10 x4") == 0.5  # w2, w10 even; w3 odd; x4 not a word of the vocabulary
    assert even_fraction("") == 0.0
