"""Offline preference optimisation (DPO / IPO): `regen train` with `algorithm.name: dpo`.

No sampling and no reward: each step takes preference pairs (prompt, chosen, rejected),
scores both responses under the policy and under the frozen starting model, and applies
`dpo_loss`. The reference log-probs never change, so they are computed once, before the
first step, and kept (no reference model stays in memory during training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regen.algorithms import dpo_loss
from regen.config import RLConfig
from regen.data import Demo, EpochSampler, load_pairs, load_prompts
from regen.data.vision_inputs import VisionInputs
from regen.modalities.lm_eval import fmt_eval, run_eval
from regen.offline.books import Model, OfflineRun
from regen.offline.sft import IGNORE, encode_demos, forward_args
from regen.policies.lm import LMPolicy, apply_lora, configure_prompts, load_model_and_tokenizer, max_positions, resolve_device
from regen.policies.vlm import check_trainable
from regen.quality import Quality, gates
from regen.runtime import checkpoint as ckpt
from regen.runtime.loggers import require as require_loggers
from regen.runtime.rundir import setup_torch


def sequence_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                      vision: VisionInputs | None = None) -> torch.Tensor:
    """(N,) sum of log-probs of the labelled (response + EOS) tokens of each row; vision: the rows'
    images (a vision-language model), with the positions its sampler would give them."""
    logits = model(input_ids=ids, attention_mask=mask, **forward_args(model, ids, mask, vision, None)).logits
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    valid = target != IGNORE
    logp = F.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * valid).sum(-1)


def rows_of(enc: tuple, idx) -> tuple:
    """Rows idx of an encoding (ids, mask, labels, images or None)."""
    ids, mask, labels, vision = enc
    return ids[idx], mask[idx], labels[idx], None if vision is None else vision.select(idx)


@torch.no_grad()
def _all_logprobs(model, enc, batch: int = 256) -> torch.Tensor:
    n = len(enc[0])
    return torch.cat([sequence_logprobs(model, *rows_of(enc, torch.arange(i, min(i + batch, n))))
                      for i in range(0, n, batch)])


def _encode(pairs, tok, max_len, which: str, device, chat: bool = False):
    # chat: pairs rendered by the template (data.chat_template), which wrote the special tokens and the end of turn
    demos = [Demo(p.prompt, getattr(p, which), p.meta, p.image,
                  segments=[(p.prompt, False), (getattr(p, which), True)] if chat else None) for p in pairs]
    ids, mask, labels, vision = encode_demos(demos, tok, max_len)
    return ids.to(device), mask.to(device), labels.to(device), None if vision is None else vision.to(device)


def preference_accuracy(model, enc_c, enc_r) -> float:
    """Fraction of pairs whose chosen response is more likely than the rejected one."""
    model.eval()
    return float((_all_logprobs(model, enc_c) > _all_logprobs(model, enc_r)).float().mean())


def train_dpo(cfg: RLConfig, resume: bool = False, force: bool = False) -> dict:
    a, t = cfg.algorithm, cfg.train
    device = resolve_device(cfg.run.device)
    require_loggers(cfg.log)  # W&B / MLflow installed when turned on
    skip, chat = cfg.data.on_bad_line == "skip", cfg.data.chat_template
    pairs = load_pairs(cfg.data.train, cfg.task, "data.train", skip, cfg.data.columns, chat)
    held_pairs = load_pairs(cfg.data.eval, cfg.task, "data.eval", skip, cfg.data.columns, chat) if cfg.data.eval else []
    eval_items = load_prompts(cfg.data.eval, cfg.task, "data.eval", skip, cfg.data.columns, chat) \
        if cfg.data.eval else []
    quality = Quality(cfg.eval, "lm", cfg.run.seed)  # a wrong metric setting stops before the run dir
    setup_torch(cfg.run.threads, cfg.run.seed)
    start, tok = load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)
    check_trainable(start, cfg.model)  # model.freeze_vision: refused on a text model
    if chat:  # the pairs as the model's own template writes them, before the run directory is touched
        from regen.data.chat import render, render_pairs

        pairs, held_pairs = (render_pairs(p, tok, cfg.data.system_prompt, w)
                             for p, w in ((pairs, "data.train"), (held_pairs, "data.eval")))
        eval_items = render(eval_items, tok, cfg.data.system_prompt, "data.eval")
    with OfflineRun.starting(cfg, "dpo", device, (t.global_minibatch_size, "train.global_minibatch_size"), resume,
                             force) as run:
        state = run.state
        start = start.to(device).eval()
        max_len = max_positions(start)
        enc_c = _encode(pairs, tok, max_len, "chosen", device, chat)
        enc_r = _encode(pairs, tok, max_len, "rejected", device, chat)
        ref_c, ref_r = _all_logprobs(start, enc_c), _all_logprobs(start, enc_r)  # cached once
        if cfg.model.lora is not None:  # adapter on the starting weights (saved adapter when resuming)
            start = apply_lora(start, cfg.model.lora, None if state is None else state["model_dir"])
        elif state is not None:
            start, tok = load_model_and_tokenizer(ckpt.resumed_model(cfg.model, state), cfg.task, cfg.run.seed)
        policy = LMPolicy(start, tok, device)
        configure_prompts(policy, cfg)
        policy.model.eval()  # dropout off, as in RL
        held = [_encode(held_pairs, tok, max_len, w, device, chat) for w in ("chosen", "rejected")] \
            if held_pairs else None

        def reload(folder):
            if cfg.model.lora is not None:  # the starting weights with the checkpoint's adapter (or a fresh one)
                return apply_lora(load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)[0], cfg.model.lora, folder)
            source = cfg.model if folder is None else cfg.model.model_copy(update={"path": str(folder), "init": None})
            return load_model_and_tokenizer(source, cfg.task, cfg.run.seed)[0]

        run.begin(Model(policy.model, policy.save_pretrained, reload, policy.export), cfg.optim,
                  EpochSampler(len(pairs), cfg.run.seed))

    def evaluate(step: int) -> dict[str, float]:
        out = run_eval(policy, eval_items, cfg, None, run.run_dir, step, quality) if eval_items else {}
        if held is not None:
            out["eval/preference_accuracy"] = preference_accuracy(policy.model, *held)
        return out | gates.check(cfg.eval.gates, out)

    def step_fn(step: int):
        idx = torch.tensor(run.data.take(t.global_minibatch_size), device=device)
        part, share = run.mine(idx)  # this rank's pairs and their fraction of the batch
        pc = sequence_logprobs(policy.model, *rows_of(enc_c, part))
        pr = sequence_logprobs(policy.model, *rows_of(enc_r, part))
        loss, m = dpo_loss(pc, pr, ref_c[part], ref_r[part], a.dpo_beta, a.dpo_label_smoothing, a.dpo_loss)
        return loss * share, {k: v * share for k, v in m.items() if k != "loss"}, len(idx)

    return run.train("dpo", t.steps, t.grad_clip, step_fn, evaluate, cfg.eval.every, eval_before=True,
                     show=lambda m: f"loss {m['loss']:.3f}  acc {m['rewards/accuracy']:.2f}", unit="pairs",
                     said=lambda before, after: None if after else f"held-out before training: {fmt_eval(before)}")
