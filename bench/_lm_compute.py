"""What bench/grpo_vs_trl.py trains on in each --config (make_task), the compute-bound
configuration's model, prompts and reward, and the FLOP count and matmul probe both
configurations use for model FLOPs utilisation (MFU).

The task: a random-init GPT-2 (the real transformers class; 8 layers x 512 wide, 8 heads) over a
word-level vocabulary of 4096 words "w0".."w4095", prompts of 64 random words shared by each
group, and a dense reward a random-init model scores unevenly: the fraction of the
completion's words whose number is even. Its logits are near uniform, so EOS (1 of 4099 tokens)
ends few completions early and nearly every completion runs to --max-len tokens; the benchmark
reports the mean length each trainer generated. The throughput needs no trained base: nothing
here learns anything, and both trainers do the same arithmetic per step.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

VOCAB, PROMPT_WORDS, N_PROMPTS = 4096, 64, 512


def even_fraction(text: str) -> float:
    """Fraction of `text`'s words that are an even-numbered word (0 for no words)."""
    words = text.split()
    return sum(w[:1] == "w" and w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / len(words) if words else 0.0


def even_words(samples) -> list[float]:
    """regen's reward (reward name `_lm_compute:even_words`; bench/ is on sys.path when the
    benchmark runs as a script)."""
    return [even_fraction(s.completion) for s in samples]


def build(workdir: Path, layers: int, width: int, seed: int) -> tuple[str, str]:
    """(model folder, prompts JSONL): the model saved with save_pretrained, as a user's would be."""
    from regen.tasks.tiny_models import tiny_gpt2, wordlevel_tokenizer

    tok = wordlevel_tokenizer([f"w{i}" for i in range(VOCAB)], per_character=False)
    model = tiny_gpt2(tok, seed, n_positions=256, n_embd=width, n_layer=layers, n_head=8)
    folder = workdir / "compute-base"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    rng = random.Random(seed)
    data = workdir / "compute-prompts.jsonl"
    with data.open("w") as f:
        for _ in range(N_PROMPTS):
            f.write(json.dumps({"prompt": " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(PROMPT_WORDS))}) + "\n")
    return str(folder), str(data)


def build_base(workdir: Path, steps: int, threads: int, seed: int) -> str:
    from regen.config import SFTConfig, load_config
    from regen.offline.sft import sft

    cfg = load_config(SFTConfig, None, [
        "model.init=arith-char-gpt2", f"run.dir={workdir / 'sft'}", f"sft.steps={steps}", "run.overwrite=true",
        "log.progress=none", "log.tensorboard=false", f"run.threads={threads}", f"run.seed={seed}",
    ])
    return sft(cfg)["export"]


def make_task(a, work: Path) -> dict:
    """What both trainers train on in --config: base model folder, prompts, the reward's name,
    regen's overrides for them, and the figures MFU needs (model shape, mean prompt tokens)."""
    from transformers import AutoTokenizer

    from regen.config import TaskConfig
    from regen.data import load_prompts

    if a.config == "tiny":
        base = a.base
        if base is None:
            t0 = time.perf_counter()
            base = build_base(work, a.sft_steps, a.threads, a.seed)
            print(f"built SFT base ({a.sft_steps} steps) in {time.perf_counter() - t0:.0f} s")
        task = {"base": base, "data": "builtin:arithmetic:train", "reward": "exact_match", "reward_key": "exact_match",
                "regen": []}
    else:
        base, data = build(work, a.layers, a.width, a.seed)
        task = {"base": base, "data": data, "reward": "even_words", "reward_key": "_lm_compute:even_words",
                "regen": [f"data.train={data}", "reward=[{name: '_lm_compute:even_words'}]"]}
    tok = AutoTokenizer.from_pretrained(task["base"])
    prompts = [it.prompt for it in load_prompts(task["data"], TaskConfig(), "data.train")]
    task["prompt_len"] = sum(len(tok(p)["input_ids"]) for p in prompts) / len(prompts)
    task["shape"] = model_shape(task["base"])
    return task


def matmul_peak(threads: int, n: int = 1024, seconds: float = 2.0) -> float:
    """This machine's fp32 matmul FLOP/s at `threads` threads: the best of repeated n x n
    products for about `seconds` (the roof MFU is measured against)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def model_shape(folder: str) -> dict:
    """Matmul parameters per token (every linear layer and the LM head; embeddings are lookups)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    d, L, V = c.n_embd, c.n_layer, c.vocab_size
    inner = c.n_inner or 4 * d
    # per block: qkv (d x 3d), attention out (d x d), MLP (d x inner, inner x d)
    return {"matmul_params": L * (3 * d * d + d * d + 2 * d * inner) + d * V, "layers": L, "width": d}


def step_flops(shape: dict, batch: int, prompt_len: float, completion_len: float, reference: bool,
               group: int = 1) -> float:
    """Model FLOPs of one RL step: a forward to sample, one more with the reference model when
    there is one, and forward + backward (3 forwards) to update. A forward costs, per token
    position, 2 FLOPs per matmul parameter plus causal attention (QK^T and AV: 2 x 2 x width x
    context per layer; a prompt position's mean context is half the prompt, a completion
    position's the prompt plus half the completion). group = 1 counts every completion as its own
    sequence (prompt + completion): the model FLOPs of the work, the same for both trainers, so
    MFU ratios are throughput ratios (Chowdhery et al. 2022, PaLM, appendix B: MFU counts the
    model's FLOPs, not the implementation's). group = n counts each prompt once per group of n:
    about what a trainer that shares the prompt's work executes."""
    P, C, L, d = prompt_len, completion_len, shape["layers"], shape["width"]

    def position(context: float) -> float:
        return 2 * shape["matmul_params"] + 4 * L * d * context

    forward = batch / group * P * position(P / 2) + batch * C * position(P + C / 2)
    return (1 + (1 if reference else 0) + 3) * forward
