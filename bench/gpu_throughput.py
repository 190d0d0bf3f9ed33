"""GPU throughput: GRPO tokens/s on a 0.5B-class causal LM and flow-RL images/s on a 0.6B MMDiT, with peak memory.

Three parts, each regen's own training loop (`regen.train.train`, the function `python -m regen train`
calls) run in this process on a config built from dotted overrides as on the command line, so that
the peak memory the loop reached can be read afterwards:

- `lm`: GRPO (regen's defaults: token-mean loss, clip 0.2, no KL, one optimizer step per batch) on a
  randomly initialised Qwen2 of Qwen2.5-0.5B's shape (Qwen/Qwen2.5-0.5B config.json: vocab 151936,
  width 896, MLP 4864, 24 layers, 14 heads, 2 KV heads, tied embeddings; 494M parameters), saved
  with `save_pretrained` into a temporary folder together with a character-level tokenizer built
  here (the arithmetic task's characters, padded with filler tokens up to the model's vocabulary so
  that every sampled id decodes). Prompts `builtin:arithmetic:train`, reward `exact_match` (about 0
  for a random model: the loop still samples, scores and takes full optimizer steps; the speed is
  what is measured). Default: 64 completions per step (8 prompts x group 8), 128 new tokens
  (a random model over 151936 ids almost never samples EOS, so nearly every completion is 128
  tokens long). tokens/s = generated tokens (`response_length/mean` x batch, EOS included) / sum of
  `time/step_s`; "sample only" divides the same tokens by `time/sample_s` (generation alone).
- `lm_generate`: the baseline of `lm`'s sampling, measured in the same run: transformers' own `generate()` on the
  same saved model and batch (8 arithmetic prompts x 8, temperature 1, no top-k, exactly the same number of new
  tokens), median of 4 calls after a warm-up; the LM rows add their "sample only" as a multiple of it.
- `lm_colocate`: the same run with `distributed.colocate=true`: AdamW's moments parked in CPU memory while
  sampling, and each phase's own peak (`memory/sample_peak_mb`, `memory/update_peak_mb`, logged by regen)
  printed after the row. Against `lm`: the sampling phase's peak should drop by about the moments
  (8 bytes per parameter, 4 GB at 494M), at the cost of the two transfers in each step's time.
- `lm_vllm`: colocated with `rollout.engine=vllm` (`rollout.vllm_memory=0.3`): the in-process vLLM engine
  sleeps (level 1) for each update and wakes to take the new weights. Skipped with a line when vLLM is
  not installed. Exercises regen/policies/lm_vllm.py, which no CPU test can.
- `lm_vllm_ray`: `distributed.mode=ray` with the vLLM engine on one rollout actor that shares the GPU
  (`rollout_resources` num_gpus 0.4), weights synced in bf16 buckets after every update; its row adds the
  median `sync/s` and `sync/mb`. Skipped with a line when vLLM or Ray is not installed.
- `nft_flux`: DiffusionNFT on a randomly initialised FLUX.1-dev-style model (regen's `FluxFlowPolicy`:
  diffusers `FluxTransformer2DModel` at FLUX.1's real width, 24 heads of 128, guidance embedding 3.5, 2 double
  + 4 single blocks: 1.31B of the real 11.9B, `--flux-depth 19,38` for all of it) on 512x512 images (16-channel
  64x64 latents packed into 1024 tokens), 512 T5 tokens; the resolution-dependent shift of FLUX's scheduler.
- `nft_qwen`: DiffusionNFT on a randomly initialised Qwen-Image-style model (regen's `QwenImageFlowPolicy`:
  diffusers `QwenImageTransformer2DModel` at Qwen-Image's real width, 24 heads of 128, text width 3584, 4 of its
  60 blocks: 1.40B of 20.4B, `--qwen-depth 60` for all of it) on 512x512 images (1024 packed tokens), a one-layer
  random Qwen2.5-VL text encoder; its scheduler's shift and shift_terminal.
- `nft`, `flow_grpo`: DiffusionNFT and Flow-GRPO on a randomly initialised SD3-style flow model
  (regen's `SD3FlowPolicy`: diffusers `SD3Transformer2DModel`, 16 joint blocks x width 1024, 16 heads
  of 64, 2x2 patches; 596M trained parameters, against SD3-medium's 24 x 1536, 2B) over 16-channel
  32x32 latents of a small random `AutoencoderKL` (scale 8: 256x256 images), conditioned by two
  small CLIP text encoders (77 tokens) and 77 zero "T5" tokens (no T5 model), written as a complete
  regen SD3 folder. 32 images per step (4 prompts x group 8, prompts from a JSONL file written
  here), 10 sampling steps (Flow-GRPO: SDE on every step, re-scored in the update with
  train.micro_batch_size=8 since its graph spans all 10 steps), reward `jpeg_compressibility`,
  no guidance. images/s = images / sum of `time/step_s`; "sample only" counts `time/sample_s` (the 10
  sampling steps and the VAE decode).

Parameters in --dtype (model.dtype; default bfloat16 on CUDA, float32 on CPU): bfloat16 means pure bf16
weights and AdamW state, no fp32 master copy. Mixed precision instead: `--dtype float32 --set
train.precision=bf16` (autocast), where regen has that setting. `--tiny` swaps in a 2-layer width-64
Qwen2 (vocab 512), a one-block width-16 SD3 at 16x16 pixels, 3 steps, 16 completions x 16 tokens and
8 images per step, one CPU thread: a smoke test of the whole path, not a figure.

Every figure leaves out the first --warmup steps (default 2: CUDA kernels and allocator warm-up)
and covers only the loop's steps: model building, loading, the final checkpoint and export are
not counted (the whole call is shown too). Peak memory: `torch.cuda.max_memory_allocated()` over
the part (reset before each); on CPU the process's peak RSS so far (it never goes down, so only
the first part's is its own). Per step the loop prints a line with an ETA; after each part the
benchmark prints its row and rewrites --out, so a run cut short still leaves figures. Each part
stops after its current step once --part-limit seconds (default 150) have passed since it began.

Run from the repository root with the project's virtualenv:

    python bench/gpu_throughput.py --only lm_generate,lm,lm_colocate,lm_vllm,lm_vllm_ray --out /tmp/gpu_lm.json  # GPU: LM
    python bench/gpu_throughput.py --only flow --out /tmp/gpu_flow.json                   # GPU: the flow parts
    python bench/gpu_throughput.py --only nft_flux,nft_qwen --flow-batch 16 --out /tmp/gpu_flux.json  # GPU: FLUX,
                                                                          # Qwen-Image sized
    python bench/gpu_throughput.py --only lm --steps 20 --lm-batch 128    # one part, other sizes
    python bench/gpu_throughput.py --tiny --out /tmp/gt.json              # CPU smoke test, ~10 s on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from regen.policies.flow_flux import TINY as TINY_FLUX  # noqa: E402
from regen.policies.flow_flux import random_flux  # noqa: E402
from regen.policies.flow_qwenimage import TINY as TINY_QWEN  # noqa: E402
from regen.policies.flow_qwenimage import random_qwenimage  # noqa: E402
from regen.policies.flow_sd3 import TINY as TINY_SD3  # noqa: E402
from regen.policies.flow_sd3 import random_sd3  # noqa: E402

# Qwen/Qwen2.5-0.5B config.json (rope_theta 1e6 as there); the model is built from it with random weights
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
TINY_LM = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
# SD3-style flow model, in the keys of regen.policies.flow_sd3.TINY (no T5: its tokens are zeros)
SD3_MEDIUM = dict(
    size=256,
    vae=(32, 64, 128, 128),
    groups=8,
    latent=16,
    layers=16,
    heads=16,
    head_dim=64,
    clips=((64, 64), (128, 128)),
    text_len=77,
    joint=512,
)
# FLUX.1's transformer at its real width (black-forest-labs/FLUX.1-dev transformer/config.json: 24 heads of 128,
# rotary axes (16, 56, 56), 64 packed channels, T5 width 4096, CLIP pooled 768, guidance embedding) cut from
# 19 double + 38 single blocks (11.9B) to 2 + 4 (1.31B; --flux-depth 19,38 for the whole), 512x512 images
# (64x64 latents, 1024 packed tokens), small random text encoders (CLIP 77 tokens, T5 one layer, 512 tokens)
FLUX_DEV = dict(size=512, vae=(32, 64, 128, 128), groups=8, latent=16, layers=2, single_layers=4, heads=24,
                head_dim=128, rope=(16, 56, 56), clip=768, t5=4096, text_len=77, t5_len=512)
# Qwen-Image's transformer at its real width (Qwen/Qwen-Image transformer/config.json: 24 heads of 128, rotary axes
# (16, 56, 56), 64 packed channels, text width 3584 = Qwen2.5-VL-7B's) cut from 60 blocks (20.4B) to 4 (1.40B;
# --qwen-depth 60 for all of it), 512x512 images (VAE scale 8: 1024 packed tokens), a one-layer random Qwen2.5-VL
# of width 3584 as the text encoder
QWEN_IMAGE = dict(size=512, vae=(32, 1, 2, 4, 4), latent=16, layers=4, heads=24, head_dim=128, rope=(16, 56, 56),
                  text_width=3584, text_layers=1)
PARTS = ("lm_generate", "lm", "lm_colocate", "lm_vllm", "lm_vllm_ray", "nft", "flow_grpo", "nft_flux", "nft_qwen")
# the language-model parts: the same GRPO run, alone, colocated (distributed.colocate: AdamW state parked in CPU
# memory while sampling, each phase's peak logged), and colocated with an in-process vLLM engine put to sleep
# for every update (skipped with a line where vLLM is not installed)
LM_PARTS = {
    "lm_generate": [],
    "lm": [],
    "lm_colocate": ["distributed.colocate=true"],
    "lm_vllm": ["distributed.colocate=true", "rollout.engine=vllm", "rollout.vllm_memory=0.3"],
    # vLLM on one Ray rollout actor sharing the GPU (0.4 of it for Ray's books, 0.3 of its memory for
    # vLLM's), the trainer in this process; bf16 sync in 256 MB buckets: sync/s and sync/mb in its row
    "lm_vllm_ray": [
        "distributed.mode=ray",
        "distributed.rollout_workers=1",
        "distributed.reward_workers=1",
        "distributed.rollout_resources={num_gpus: 0.4, num_cpus: 1}",
        "rollout.engine=vllm",
        "rollout.vllm_memory=0.3",
        "distributed.sync_dtype=bfloat16",
    ],
}
COLOURS, SHAPES, POSITIONS = (
    ("red", "green", "blue", "yellow", "white"),
    ("circle", "square", "triangle"),
    ("left", "right", "top", "bottom", "centre"),
)


# ------------------------------------------------------------------ models, built locally


def char_tokenizer(vocab_size: int):
    """regen's arithmetic tokenizer (one token per character, <pad> <eos> <unk>), its vocabulary padded with
    filler tokens <tN> up to the model's vocab_size so that any id a random model samples decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from regen.tasks.arithmetic import CHARS
    from regen.tasks.tiny_models import SPECIALS

    words = SPECIALS + CHARS
    words += [f"<t{i}>" for i in range(len(words), vocab_size)]
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_lm(folder: Path, shape: dict, dtype: str, seed: int) -> int:
    """A random-init Qwen2ForCausalLM of `shape` and its tokenizer, saved to folder; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = char_tokenizer(shape["vocab_size"])
    config = Qwen2Config(**shape, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return n


def generate_baseline(folder: Path, batch: int, new_tokens: int, device: str, reps: int = 4) -> dict:
    """The baseline of regen's sampling: transformers' own `generate()` on the same saved model and batch (8
    arithmetic prompts x 8, sampled at temperature 1 with no top-k, exactly `new_tokens` new tokens each),
    timed over `reps` calls after one warm-up call. generated tokens / seconds per call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from regen.tasks.arithmetic import prompts as arithmetic_prompts

    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").to(device).eval()
    prompts = [item.prompt for item in arithmetic_prompts("train", 2, 20)[: batch // 8]]
    enc = tok([x for x in prompts for _ in range(8)], return_tensors="pt", padding=True).to(device)
    kw = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tok.pad_token_id,
    )
    seconds = []
    with torch.no_grad():
        for i in range(reps + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(**enc, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call warms kernels and the allocator
                seconds.append(time.perf_counter() - t0)
    tokens = (out.shape[1] - enc["input_ids"].shape[1]) * batch
    del model
    return {"tokens_per_call": tokens, "call_s": seconds, "per_s": tokens / statistics.median(seconds)}


def write_prompts(path: Path) -> Path:
    """75 prompts in the words the tiny CLIP tokenizer makes whole tokens of, one JSON object per line."""
    rows = [{"prompt": f"a {c} {s} at the {p}"} for c in COLOURS for s in SHAPES for p in POSITIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------ running and measuring


def environment(device: str) -> dict:
    import diffusers
    import transformers

    git = ["git", "describe", "--always", "--dirty"]
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "diffusers": diffusers.__version__,
        "device": device,
        "git": subprocess.run(git, check=False, cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "cpus": os.cpu_count(),
    }
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    return env


def peak_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def run_part(name: str, overrides: list[str], run_dir: Path, device: str, limit_s: float) -> tuple[dict, list[dict]]:
    """regen.train.train on the overrides; (call facts, metrics.jsonl rows). Past limit_s a SIGINT asks the loop
    to finish its step and stop (regen's graceful stop)."""
    from regen.config import RLConfig, load_config
    from regen.train import train

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timer = threading.Timer(limit_s, lambda: os.kill(os.getpid(), signal.SIGINT)) if limit_s > 0 else None
    facts: dict = {"error": None, "stopped_early": False}
    t0 = time.perf_counter()
    if timer is not None:
        timer.start()
    try:
        summary = train(load_config(RLConfig, None, overrides))
        facts["stopped_early"] = bool(summary.get("stopped_early"))
    except KeyboardInterrupt:  # the time limit struck outside the step loop (loading, final save)
        facts["error"], facts["stopped_early"] = f"time limit of {limit_s:.0f} s reached outside the step loop", True
    except Exception as e:  # one part failing (a bad override, out of memory) must not cost the others
        traceback.print_exc()
        facts["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    finally:
        if timer is not None:
            timer.cancel()
        if device == "cuda":
            torch.cuda.synchronize()
    facts["call_s"] = time.perf_counter() - t0
    facts["peak_gib"] = peak_gib(device)
    if device == "cuda":
        facts["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    return facts, [r for r in rows if "time/step_s" in r]


def figures(rows: list[dict], warmup: int, per_step) -> dict:
    """Throughput over the steps after `warmup` (all steps when there are no more): units / sum of time/step_s,
    units / sum of time/sample_s, median step ms, sampling's share of the step time."""
    kept = [r for r in rows if r["step"] > warmup] or rows
    if not kept:
        return {"measured_steps": 0}
    units = sum(per_step(r) for r in kept)
    step_s = sum(r["time/step_s"] for r in kept)
    sample_s = sum(r["time/sample_s"] for r in kept)
    return {
        "measured_steps": len(kept),
        "first_measured_step": kept[0]["step"],
        "units": units,
        "per_s": units / step_s,
        "sample_per_s": units / sample_s,
        "sample_share": sample_s / step_s,
        "median_step_ms": 1000 * statistics.median(r["time/step_s"] for r in kept),
        "step_ms": [round(1000 * r["time/step_s"], 1) for r in rows],
        # distributed.colocate: each phase's own peak (CUDA allocator; CPU: peak resident set), max over the steps
        **{
            f"{ph}_peak_mib": max(r[f"memory/{ph}_peak_mb"] for r in kept)
            for ph in ("sample", "update")
            if all(f"memory/{ph}_peak_mb" in r for r in kept)
        },
        # Ray rollout actors: what each weight sync cost (seconds to pack and put, MB sent)
        **{
            f"sync_{k}_median": statistics.median(r[f"sync/{k}"] for r in kept)
            for k in ("s", "mb")
            if all(f"sync/{k}" in r for r in kept)
        },
    }


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


HEADER = (
    f"{'part':<10} {'model':<24} {'params':>8} {'batch':>10} {'steps':>6} {'throughput':>16} "
    f"{'sample only':>16} {'sample %':>8} {'med step ms':>11} {'peak GiB':>8} {'call s':>7}"
)


def baseline(results: list[dict]) -> float | None:
    """lm_generate's tok/s when that part ran."""
    return next((r["generate"]["per_s"] for r in results if "generate" in r), None)


def row_line(r: dict, baseline: float | None = None) -> str:
    """One part's row; `baseline`: lm_generate's tok/s, against which the LM parts' sampling is put."""
    if "generate" in r:
        g = r["generate"]
        return (
            f"{r['part']:<10} {r['model']:<24} {fmt_params(r['params']):>8} {r['batch']:>10} {len(g['call_s']):>6} "
            f"{'':>16} {g['per_s']:>10.1f} tok/s  (transformers generate(), the baseline)"
        )
    if r.get("skipped"):
        return f"{r['part']:<10} skipped: {r['error']}"
    f = r["figures"]
    phases = (
        f" | phase peaks MiB: sample {f['sample_peak_mib']:.0f}, update {f['update_peak_mib']:.0f}"
        if "sample_peak_mib" in f
        else ""
    )
    if not f.get("measured_steps"):
        return f"{r['part']:<10} {r['model']:<24} {fmt_params(r['params']):>8} {r['batch']:>10} no steps: {r['error']}"
    unit = r["unit"]
    return (
        f"{r['part']:<10} {r['model']:<24} {fmt_params(r['params']):>8} {r['batch']:>10} {f['measured_steps']:>6} "
        f"{f['per_s']:>10.1f} {unit:<5} {f['sample_per_s']:>10.1f} {unit:<5} {100 * f['sample_share']:>7.0f}% "
        f"{f['median_step_ms']:>11.1f} {r['peak_gib']:>8.2f} {r['call_s']:>7.1f}{phases}"
        + (f" | sample only = {f['sample_per_s'] / baseline:.2f}x generate()" if baseline and unit == "tok/s" else "")
    )


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models and batches, 3 steps: a CPU smoke test")
    p.add_argument("--steps", type=int, help="train.steps of every part (default 10; 3 with --tiny)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures (default 2)")
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu", help="run.device (default: cuda when available)"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="model.dtype, the parameter dtype of both models (default bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--only", help="comma-separated subset of: " + ",".join(PARTS) + " ('flow' = nft,flow_grpo)")
    p.add_argument("--flux-depth", default="2,4", help="nft_flux: double,single blocks (default 2,4; FLUX.1: 19,38)")
    p.add_argument("--qwen-depth", type=int, default=4, help="nft_qwen: transformer blocks (default 4; Qwen-Image: 60)")
    p.add_argument("--lm-batch", type=int, help="completions per LM step, 8 per prompt (default 64; 16 with --tiny)")
    p.add_argument("--max-new-tokens", type=int, help="rollout.max_new_tokens of the LM (default 128; 16 with --tiny)")
    p.add_argument("--flow-batch", type=int, help="images per flow step, 8 per prompt (default 32; 8 with --tiny)")
    p.add_argument("--flow-micro", type=int, default=8, help="flow_grpo's train.micro_batch_size (default 8)")
    p.add_argument(
        "--part-limit",
        type=float,
        default=150.0,
        help="seconds after which a part stops at the end of its current step (default 150; 0 = none)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra regen override for every part (repeatable), e.g. train.precision=bf16 where it exists",
    )
    p.add_argument(
        "--threads", type=int, help="run.threads, torch's CPU threads (default: 1 with --tiny, else 0 = torch's own choice)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write settings, environment and figures as JSON here (rewritten after each part)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (models, run folders) afterwards")
    a = p.parse_args()
    asked = [y for x in (a.only or ",".join(PARTS)).split(",") for y in (("nft", "flow_grpo") if x == "flow" else (x,))]
    parts = [x for x in PARTS if x in asked]
    if unknown := set(asked) - set(PARTS):
        p.error(f"unknown part(s) {sorted(unknown)}; choose from {list(PARTS)} or 'flow'")
    if a.device == "cuda" and not cuda:
        p.error("--device cuda but torch sees no CUDA device")
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    steps = a.steps or (3 if a.tiny else 10)
    lm_batch, new_tokens = a.lm_batch or (16 if a.tiny else 64), a.max_new_tokens or (16 if a.tiny else 128)
    flow_batch = a.flow_batch or (8 if a.tiny else 32)
    # one thread for the smoke test: on a small machine shared with other work, two threads fighting for the
    # cores made its tiny steps 40x slower
    threads = a.threads if a.threads is not None else (1 if a.tiny else 0)
    for what, b in (("--lm-batch", lm_batch), ("--flow-batch", flow_batch)):
        if b % 8:
            p.error(f"{what} {b}: must be a multiple of the group size 8")
    lm_shape, sd3 = (TINY_LM, TINY_SD3) if a.tiny else (QWEN25_05B, SD3_MEDIUM)
    try:
        double, single = (int(x) for x in a.flux_depth.split(","))
    except ValueError:
        p.error(f"--flux-depth {a.flux_depth!r}: two block counts, double,single (e.g. 19,38)")
    flux = TINY_FLUX if a.tiny else {**FLUX_DEV, "layers": double, "single_layers": single}
    qwen = TINY_QWEN if a.tiny else {**QWEN_IMAGE, "layers": a.qwen_depth}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()  # "text_encoder_3=None ... cannot be saved" at every save: no T5 here

    env = environment(a.device)
    settings = {
        "tiny": a.tiny,
        "steps": steps,
        "warmup": a.warmup,
        "dtype": dtype,
        "parts": parts,
        "lm_batch": lm_batch,
        "max_new_tokens": new_tokens,
        "flow_batch": flow_batch,
        "flow_micro": a.flow_micro,
        "seed": a.seed,
        "threads": threads,
        "part_limit_s": a.part_limit,
        "extra_overrides": a.set,
        "lm_shape": lm_shape,
        "flow_shape": sd3,
        "flux_shape": flux,
        "qwen_image_shape": qwen,
    }
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    print(
        f"settings: steps={steps} (first {a.warmup} left out) dtype={dtype} parts={','.join(parts)} "
        f"part limit {a.part_limit:.0f} s",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="regen-gpu-throughput-"))
    print(f"work folder: {work}{' (kept)' if a.keep else ' (removed at the end; --keep keeps it)'}", flush=True)
    common = [
        f"run.device={a.device}",
        f"model.dtype={dtype}",
        f"run.seed={a.seed}",
        f"run.threads={threads}",
        f"train.steps={steps}",
        "data.eval=null",
        "run.overwrite=true",
        "checkpoint.every=0",
        "log.progress=lines",
        "log.every=1",
        "log.tensorboard=false",
        "rollout.group_size=8",
    ]
    results: list[dict] = []

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps({"settings": settings, "environment": env, "parts": results}, indent=1))

    try:
        lm_parts = [x for x in parts if x in LM_PARTS]
        if lm_parts:
            t0 = time.perf_counter()
            n = build_lm(work / "lm", lm_shape, dtype, a.seed)
            build_s = time.perf_counter() - t0
            label = "Qwen2 random (tiny)" if a.tiny else "Qwen2.5-0.5B shape, rand"
        for part in lm_parts:
            if part == "lm_generate":
                print(
                    f"\n== lm_generate: transformers generate() on the same model, {lm_batch} x {new_tokens} "
                    "new tokens, median of 4 calls after one warm-up (the baseline of the lm parts' sample only)",
                    flush=True,
                )
                gc.collect()
                g = generate_baseline(work / "lm", lm_batch, new_tokens, a.device)
                results.append(
                    {
                        "part": part,
                        "model": label,
                        "params": n,
                        "batch": f"{lm_batch}x{new_tokens}",
                        "unit": "tok/s",
                        "generate": g,
                    }
                )
                print(f"lm_generate {g['per_s']:.1f} tok/s (calls: {', '.join(f'{x:.2f}' for x in g['call_s'])} s)", flush=True)
                save()
                continue
            missing = [m for m in ("vllm", "ray")[: 1 + (part == "lm_vllm_ray")] if importlib.util.find_spec(m) is None]
            if part.startswith("lm_vllm") and missing:
                print(
                    f"\n== {part}: skipped, {' and '.join(missing)} not installed (pip install in this environment)", flush=True
                )
                results.append({"part": part, "error": f"{', '.join(missing)} not installed", "skipped": True})
                save()
                continue
            print(
                f"\n== {part}: GRPO, {label}, {fmt_params(n)} params (built and saved in {build_s:.1f} s); "
                f"{steps} steps x {lm_batch} completions x {new_tokens} new tokens; stops by {a.part_limit:.0f} s",
                flush=True,
            )
            overrides = [
                *common,
                f"model.path={work / 'lm'}",
                f"run.dir={work / ('run-' + part)}",
                "algorithm.name=grpo",
                "data.train=builtin:arithmetic:train",
                f"rollout.global_batch_size={lm_batch}",
                f"rollout.max_new_tokens={new_tokens}",
                "reward=[{name: exact_match}]",
                *LM_PARTS[part],
                *a.set,
            ]
            facts, rows = run_part(part, overrides, work / ("run-" + part), a.device, a.part_limit)
            fig = figures(rows, a.warmup, lambda r: r["response_length/mean"] * lm_batch)
            results.append(
                {
                    "part": part,
                    "model": label,
                    "params": n,
                    "batch": f"{lm_batch}x{new_tokens}",
                    "unit": "tok/s",
                    "overrides": overrides,
                    **facts,
                    "figures": fig,
                }
            )
            print(HEADER + "\n" + row_line(results[-1], baseline(results)), flush=True)
            save()
        flow_parts = [x for x in parts if x not in LM_PARTS]
        prompts = write_prompts(work / "prompts.jsonl")
        built: dict[str, tuple] = {}  # model folder -> (parameters, seconds to build, label)
        for algo in flow_parts:
            name = {"nft_flux": "flux", "nft_qwen": "qwen-image"}.get(algo, "sd3")
            if name not in built:
                t0 = time.perf_counter()
                if name == "qwen-image":
                    n = random_qwenimage(work / name, a.seed, **qwen)
                    label = f"Qwen-Image-style {qwen['layers']}x{qwen['heads'] * qwen['head_dim']} {qwen['size']}px"
                elif name == "flux":
                    n = random_flux(work / name, a.seed, True, **flux)
                    label = f"FLUX-dev-style {flux['layers']}+{flux['single_layers']}x{flux['heads'] * flux['head_dim']} " \
                            f"{flux['size']}px"
                else:
                    n = random_sd3(work / name, a.seed, False, **sd3)
                    label = f"SD3-style {sd3['layers']}x{sd3['heads'] * sd3['head_dim']} {sd3['size']}px"
                built[name] = (n, time.perf_counter() - t0, label)
            n, build_s, label = built[name]
            print(
                f"\n== {algo}: {label}, {fmt_params(n)} transformer params (built and saved in {build_s:.1f} s); "
                f"{steps} steps x {flow_batch} images x 10 sampling steps; stops by {a.part_limit:.0f} s",
                flush=True,
            )
            run_dir = work / f"run-{algo}"
            overrides = [
                *common,
                f"model.path={work / name}",
                f"run.dir={run_dir}",
                f"algorithm.name={algo.split('_')[0] if algo.startswith('nft_') else algo}",
                f"data.train={prompts}",
                f"rollout.global_batch_size={flow_batch}",
                "flow.steps=10",
                "reward=[{name: jpeg_compressibility}]",
            ]
            if algo == "flow_grpo" and a.flow_micro < flow_batch:
                overrides.append(f"train.micro_batch_size={a.flow_micro}")
            overrides += a.set
            facts, rows = run_part(algo, overrides, run_dir, a.device, a.part_limit)
            fig = figures(rows, a.warmup, lambda r: flow_batch)
            results.append(
                {
                    "part": algo,
                    "model": label,
                    "params": n,
                    "batch": str(flow_batch),
                    "unit": "img/s",
                    "overrides": overrides,
                    **facts,
                    "figures": fig,
                }
            )
            print(HEADER + "\n" + row_line(results[-1]), flush=True)
            save()
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n{env.get('gpu', platform.processor() or 'cpu')}, torch {env['torch']} (CUDA {env['cuda']}), dtype {dtype}, "
        f"git {env['git']}"
    )
    print(
        "throughput: per second of the loop's steps after the first",
        a.warmup,
        "(sample only: sampling phase alone);",
        "peak: " + ("torch.cuda.max_memory_allocated per part" if a.device == "cuda" else "process peak RSS so far"),
    )
    print(HEADER)
    for r in results:
        print(row_line(r, baseline(results)))
        if not r.get("skipped") and (r.get("error") or r.get("stopped_early")):
            notes = ["stopped at --part-limit"] * r["stopped_early"] + [r["error"]] * bool(r["error"])
            print(f"    {r['part']}: {'; '.join(notes)}")
    if a.out:
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
