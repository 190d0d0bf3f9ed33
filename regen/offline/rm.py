"""`regen rm CONFIG`: train a reward model on preference pairs (the DPO rows: prompt, chosen,
rejected). A scalar head on a causal LM (usually the SFT model), trained with the Bradley-Terry
loss -log sigmoid(r(chosen) - r(rejected) - margin) (Ouyang et al. 2022, eq. 1; the margin as in
Llama 2, Touvron et al. 2023, eq. 2). Held-out pair accuracy at step 0, every eval.every steps and
at the end; checkpoints and exact resume as `regen sft`; export/ is a sequence-classification
folder that AutoModelForSequenceClassification and the `reward_model` reward load.

Each pair is encoded by `exchange_ids`, the function the reward_model reward scores with, so the
model is scored at RL time exactly as it was trained.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from regen.config import RMConfig, dump_config
from regen.data import EpochSampler, load_pairs
from regen.errors import UserError
from regen.offline import close_offline
from regen.policies.lm import resolve_device
from regen.quality import gates
from regen.rewards.reward_model import exchange_ids, score_batches
from regen.runtime import checkpoint as ckpt
from regen.runtime.loggers import require as require_loggers
from regen.runtime.metrics import MetricsLogger
from regen.runtime.optim import lr_at, make_optimizer, sft_step
from regen.runtime.progress import StepProgress
from regen.runtime.rundir import mark_running, prepare, setup_torch
from regen.runtime.signals import GracefulStop


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(r_c - r_r - margin)."""
    return -F.logsigmoid(chosen - rejected - margin).mean()


class RewardModelFolder:
    """The trained model and its tokenizer, saved together (checkpoints, export/)."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    def save_pretrained(self, folder: Path) -> None:
        self.model.save_pretrained(folder, safe_serialization=True)
        self.tok.save_pretrained(folder)


def load_reward_model(model_cfg, task_cfg, seed: int):
    """(AutoModelForSequenceClassification with one output, tokenizer) from model.path or model.init."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging

    dtype = getattr(torch, model_cfg.dtype)
    if model_cfg.init is not None:
        from transformers import GPT2ForSequenceClassification

        from regen.tasks import LM_RECIPES as RECIPES

        if model_cfg.init not in RECIPES:
            raise UserError(f"model.init: unknown recipe '{model_cfg.init}' (known: {', '.join(RECIPES)})")
        lm, tok = RECIPES[model_cfg.init](seed, task_cfg.digits)
        lm.config.num_labels = 1
        torch.manual_seed(seed)
        return GPT2ForSequenceClassification(lm.config).to(dtype), tok
    folder = Path(model_cfg.path).expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(f"model.path: '{model_cfg.path}' is not a model folder (no config.json in it)")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "score.weight newly initialized": the point of a new head
    try:
        torch.manual_seed(seed)  # the new head's initialisation
        tok = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: cannot load '{model_cfg.path}' as a reward model: {str(e).splitlines()[0]}") \
            from None
    finally:
        logging.set_verbosity(verbosity)
    return model, tok


def _encode(pairs, tok, chat: bool, max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    c = [exchange_ids(tok, p.prompt, p.chosen, p.meta.get("messages"), chat, max_length)[0] for p in pairs]
    r = [exchange_ids(tok, p.prompt, p.rejected, p.meta.get("messages"), chat, max_length)[0] for p in pairs]
    return c, r


def train_rm(cfg: RMConfig, resume: bool = False) -> dict:
    s = cfg.rm
    device = resolve_device(cfg.run.device)
    require_loggers(cfg.log)
    skip = cfg.data.on_bad_line == "skip"
    pairs = load_pairs(cfg.data.train, cfg.task, "data.train", skip, cfg.data.columns)
    held = load_pairs(cfg.data.eval, cfg.task, "data.eval", skip, cfg.data.columns) if cfg.data.eval else []
    if not pairs:
        raise UserError(f"data.train: no pairs in '{cfg.data.train}'")
    run_dir, resume = prepare(cfg.run.dir, cfg.run.overwrite, resume)
    setup_torch(cfg.run.threads, cfg.run.seed)
    state = ckpt.load_latest(run_dir) if resume else None
    model, tok = load_reward_model(ckpt.resumed_model(cfg.model, state), cfg.task, cfg.run.seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    model.config.pad_token_id = tok.pad_token_id
    model.to(device).train()
    chat = bool(getattr(tok, "chat_template", None))  # as the reward_model reward decides ('auto')
    enc_c, enc_r = _encode(pairs, tok, chat, s.max_length)
    held_c, held_r = _encode(held, tok, chat, s.max_length)
    folder = RewardModelFolder(model, tok)
    opt = make_optimizer(model, cfg.optim)
    data = EpochSampler(len(pairs), cfg.run.seed)
    start_step = ckpt.restore(state, run_dir, opt, data) if state else 0
    dump_config(cfg, run_dir / "config.yaml")
    mark_running(run_dir)
    log = MetricsLogger(run_dir, cfg.log, config=cfg, resume=state is not None)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = max(s.max_length, 16384)

    def scores(ids: list[list[int]]) -> torch.Tensor:
        return score_batches(model, tok.pad_token_id, ids, tokens, device)

    def evaluate(step: int) -> dict[str, float]:
        if not held:
            return {}
        model.eval()
        with torch.no_grad():
            diff = scores(held_c) - scores(held_r)
        model.train()
        out = {"eval/pair_accuracy": float((diff > 0).float().mean()), "eval/margin": float(diff.mean()),
               "eval/loss": float(-F.logsigmoid(diff - s.margin).mean())}
        return out | gates.check(cfg.eval.gates, out)

    before = evaluate(0) if start_step == 0 else {}
    if before:
        log.log(0, before)
    with StepProgress(s.steps, start_step, cfg.log.progress, cfg.log.every, "rm", cfg.log.every_s) as bar, \
            GracefulStop(bar.print) as stop:
        if before:
            bar.print(f"held-out pair accuracy before training: {before['eval/pair_accuracy']:.3f}")
        step = start_step
        for step in range(start_step + 1, s.steps + 1):
            t0 = time.perf_counter()
            idx = data.take(s.global_batch_size)
            rc, rr = scores([enc_c[i] for i in idx]), scores([enc_r[i] for i in idx])
            loss = bradley_terry_loss(rc, rr, s.margin)
            lr = lr_at(step, cfg.optim, s.steps)
            gn = sft_step(opt, loss, params, lr, s.grad_clip)
            dt = time.perf_counter() - t0
            diff = (rc - rr).detach()
            metrics = {"loss": loss.item(), "accuracy": float((diff > 0).float().mean()), "margin": float(diff.mean()),
                       "grad_norm": float(gn), "lr": lr, "time/step_s": dt,
                       "throughput/pairs_per_s": len(idx) / dt}
            if cfg.eval.every and step % cfg.eval.every == 0 and step != s.steps:
                metrics.update(evaluate(step))
            log.log(step, metrics)
            bar.update(step, f"loss {metrics['loss']:.3f}  acc {metrics['accuracy']:.2f}")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != s.steps:
                ckpt.save_offline(run_dir, step, folder, opt, data, cfg.checkpoint.keep_last)
            if stop.requested:
                break
        last = ckpt.save_offline(run_dir, step, folder, opt, data, cfg.checkpoint.keep_last)
        after = evaluate(step) if step == s.steps else {}
        if after:
            log.log(step, after)
            bar.print(f"held-out pair accuracy: {before.get('eval/pair_accuracy', float('nan')):.3f} -> "
                      f"{after['eval/pair_accuracy']:.3f} ({len(held)} pairs)")
    return close_offline(run_dir, log, step, s.steps, last, folder.save_pretrained,
                         {"eval_before": before, "eval_after": after})
