"""Supervised fine-tuning on prompt/completion demonstrations (cross-entropy on the
completion and its EOS only) or, with data.chat_template, on conversations rendered by the
model's own chat template (cross-entropy on the assistant turns only; regen/data/chat.py). For
the built-in task it trains the RL base from random init on imperfect demonstrations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regen.config import SFTConfig
from regen.data import Demo, EpochSampler, load_demos, load_prompts
from regen.data.vision_inputs import VisionInputs
from regen.errors import DataError
from regen.modalities.lm_eval import run_eval
from regen.offline.books import Model, OfflineRun
from regen.policies.lm import LMPolicy, configure_prompts, load_model_and_tokenizer, max_positions, resolve_device
from regen.policies.vlm import VisionPrompt, check_trainable, encode, image_args, is_processor
from regen.policies.vlm_packed import is_packed, model_positions, rope_positions
from regen.quality import Quality, gates
from regen.runtime import checkpoint as ckpt
from regen.runtime.loggers import require as require_loggers
from regen.runtime.rundir import setup_torch

IGNORE = -100


def encode_demos(demos: list[Demo], tok, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 VisionInputs | None]:
    """Right-padded (N, L) input ids, attention mask, labels that are IGNORE on the prompt, and the
    rows' image inputs (None for text). `tok` may be a vision-language model's processor: the
    prompts' image tokens are then expanded to the model's image positions, in the same call that
    processes their images. A chat-rendered demonstration (Demo.segments) is its pieces tokenised
    in order without adding special tokens (the template wrote them), labelled on its assistant
    turns only; the others are prompt + completion + EOS."""
    vision = None
    if any(d.segments is not None for d in demos):
        rows, pieces = zip(*[_segments(d.segments, tok, _image_of(d, tok)) for d in demos])
        vision = VisionInputs(list(pieces)) if is_processor(tok) else None
        tok = tok.tokenizer if is_processor(tok) else tok
    else:
        if is_processor(tok):  # one batched call; each row's left padding dropped again
            text, vision = encode(tok, [VisionPrompt(d.prompt, _image_of(d, tok)) for d in demos], True, "cpu")
            p_ids = [ids[m.bool()].tolist() for ids, m in zip(text["input_ids"], text["attention_mask"])]
            tok = tok.tokenizer
        else:
            p_ids = tok([d.prompt for d in demos], add_special_tokens=True)["input_ids"]
        c_ids = tok([d.completion for d in demos], add_special_tokens=False)["input_ids"]
        rows = [(p + c + [tok.eos_token_id], [IGNORE] * len(p) + c + [tok.eos_token_id]) for p, c in zip(p_ids, c_ids)]
    L = max(len(seq) for seq, _ in rows)
    if L > max_len:
        raise DataError(f"data.train: a demonstration is {L} tokens long, more than the model's {max_len} positions")
    ids = torch.full((len(rows), L), tok.pad_token_id)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    labels = torch.full((len(rows), L), IGNORE)
    for i, (seq, lab) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, : len(seq)] = torch.tensor(lab)
    return ids, mask, labels, vision


def _segments(pieces: list[tuple[str, bool]], tok, image=None) -> tuple[tuple[list[int], list[int]], dict]:
    """((ids, labels), image inputs) of a chat-rendered demonstration: labels are the ids on its
    trained pieces. With a VLM's processor, a piece holding image markers is encoded with its images
    (each marker expanded to the image's tokens, as when sampling)."""
    ids, labels, images_in = [], [], []
    images = VisionPrompt("", image).images
    for text, trained in pieces:
        k = text.count(tok.image_token) if is_processor(tok) else 0
        if k:
            enc, vision = encode(tok, [VisionPrompt(text, images[:k])], False, "cpu")
            t, images = enc["input_ids"][0].tolist(), images[k:]
            images_in.append(vision.rows[0])
        else:
            t = (tok.tokenizer if is_processor(tok) else tok)(text, add_special_tokens=False)["input_ids"]
        ids += t
        labels += t if trained else [IGNORE] * len(t)
    return (ids, labels), VisionInputs(images_in).kwargs() if images_in else {}


def _image_of(d: Demo, tok):
    if d.image is None and is_processor(tok) and not getattr(tok, "reads_no_image", False):
        raise DataError(f"data.train: the model reads images but the row of prompt '{d.prompt[:60]}' has no 'image'")
    return d.image


def forward_args(model, ids: torch.Tensor, mask: torch.Tensor, vision: VisionInputs | None, rows) -> dict:
    """Keyword arguments of the forward over these (right-padded) rows: their images, and for an
    M-RoPE model (the Qwen-VL families) the positions the sampler gives the same tokens."""
    if vision is None or not is_packed(model):
        return image_args(model, ids, vision, rows)  # Gemma 3: with token_type_ids
    images = vision.kwargs(rows)
    return {**images, "position_ids": model_positions(rope_positions(model, ids, mask, images))}


def sft(cfg: SFTConfig, resume: bool = False, force: bool = False) -> dict:
    device = resolve_device(cfg.run.device)
    require_loggers(cfg.log)  # W&B / MLflow installed when turned on
    skip_bad, chat = cfg.data.on_bad_line == "skip", cfg.data.chat_template
    demos = load_demos(cfg.data.train, cfg.task, "data.train", skip_bad, cfg.data.columns, chat)
    eval_items = load_prompts(cfg.data.eval, cfg.task, "data.eval", skip_bad, cfg.data.columns, chat) \
        if cfg.data.eval else []
    if chat:  # rendered with the model's own template before the run directory is touched
        from regen.data.chat import render, render_demos
        from regen.policies.lm_load import load_tokenizer

        tok = load_tokenizer(cfg.model, cfg.task)
        demos = render_demos(demos, tok, cfg.data.system_prompt, "data.train")
        eval_items = render(eval_items, tok, cfg.data.system_prompt, "data.eval")
    quality = Quality(cfg.eval, "lm", cfg.run.seed)  # a wrong metric setting stops before the run dir
    with OfflineRun.starting(cfg, "sft", device, (cfg.sft.global_batch_size, "sft.global_batch_size"), resume,
                             force) as run:
        setup_torch(cfg.run.threads, cfg.run.seed)
        model, tok = load_model_and_tokenizer(ckpt.resumed_model(cfg.model, run.state), cfg.task, cfg.run.seed)
        check_trainable(model, cfg.model)  # model.freeze_vision
        policy = LMPolicy(model, tok, device)
        configure_prompts(policy, cfg)  # rollout.stop_tokens in its held-out evaluation
        ids, mask, labels, vision = encode_demos(demos, tok, max_positions(model))
        ids, mask, labels, vision = ids.to(device), mask.to(device), labels.to(device), \
            None if vision is None else vision.to(device)

        def reload(folder):
            source = cfg.model if folder is None else cfg.model.model_copy(update={"path": str(folder), "init": None})
            return load_model_and_tokenizer(source, cfg.task, cfg.run.seed)[0]

        run.begin(Model(policy.model, policy.save_pretrained, reload), cfg.optim, EpochSampler(len(demos), cfg.run.seed))
    s = cfg.sft

    def evaluate(step: int) -> dict[str, float]:
        policy.model.eval()
        out = run_eval(policy, eval_items, cfg, None, run.run_dir, step, quality)
        policy.model.train()
        return out | gates.check(cfg.eval.gates, out)

    def step_fn(step: int):
        idx = torch.tensor(run.data.take(s.global_batch_size), device=device)
        part, _ = run.mine(idx)  # this rank's rows (all of them in one process)
        width = int(mask[part].sum(1).max())  # trim the rows to the longest (right padding)
        b_ids, b_mask, b_lab = ids[part, :width], mask[part, :width], labels[part, :width]
        logits = policy.model(input_ids=b_ids, attention_mask=b_mask,
                              **forward_args(policy.model, b_ids, b_mask, vision, part)).logits
        # position t predicts token t+1; the mean over the completion tokens of the whole batch (of every rank)
        tokens = (labels[idx, 1:] != IGNORE).sum().clamp(min=1)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), b_lab[:, 1:].flatten(), ignore_index=IGNORE,
                               reduction="sum") / tokens
        return loss, {}, len(idx)

    policy.model.train()
    summary = run.train("sft", s.steps, s.grad_clip, step_fn, evaluate if eval_items else None, cfg.eval.every,
                        show=lambda m: f"loss {m['loss']:.3f}")
    policy.model.eval()
    return summary
