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

from pathlib import Path

import torch
import torch.nn.functional as F

from regen.config import RMConfig
from regen.data import EpochSampler, load_pairs
from regen.errors import UserError
from regen.offline.books import Model, OfflineRun
from regen.policies.lm import resolve_device
from regen.quality import gates
from regen.rewards.reward_model import exchange_ids, score_batches
from regen.runtime import checkpoint as ckpt
from regen.runtime.loggers import require as require_loggers
from regen.runtime.rundir import setup_torch


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(r_c - r_r - margin)."""
    return -F.logsigmoid(chosen - rejected - margin).mean()


class RewardModelFolder:
    """The trained model and its tokenizer, saved together (checkpoints, export/)."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        """state_dict: the gathered weights of a sharded (FSDP2) model."""
        self.model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
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


def train_rm(cfg: RMConfig, resume: bool = False, force: bool = False) -> dict:
    s = cfg.rm
    device = resolve_device(cfg.run.device)
    require_loggers(cfg.log)
    skip = cfg.data.on_bad_line == "skip"
    pairs = load_pairs(cfg.data.train, cfg.task, "data.train", skip, cfg.data.columns)
    held = load_pairs(cfg.data.eval, cfg.task, "data.eval", skip, cfg.data.columns) if cfg.data.eval else []
    if not pairs:
        raise UserError(f"data.train: no pairs in '{cfg.data.train}'")
    with OfflineRun.starting(cfg, "rm", device, (s.global_batch_size, "rm.global_batch_size"), resume, force) as run:
        setup_torch(cfg.run.threads, cfg.run.seed)
        model, tok = load_reward_model(ckpt.resumed_model(cfg.model, run.state), cfg.task, cfg.run.seed)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        model.config.pad_token_id = tok.pad_token_id
        model.to(device).train()
        chat = bool(getattr(tok, "chat_template", None))  # as the reward_model reward decides ('auto')
        enc_c, enc_r = _encode(pairs, tok, chat, s.max_length)
        held_c, held_r = _encode(held, tok, chat, s.max_length)

        def reload(folder):
            source = cfg.model if folder is None else cfg.model.model_copy(update={"path": str(folder), "init": None})
            return load_reward_model(source, cfg.task, cfg.run.seed)[0]

        run.begin(Model(model, RewardModelFolder(model, tok).save_pretrained, reload), cfg.optim,
                  EpochSampler(len(pairs), cfg.run.seed))
    tokens = max(s.max_length, 16384)

    def scores(ids: list[list[int]]) -> torch.Tensor:
        return score_batches(model, tok.pad_token_id, ids, tokens, device)

    def evaluate(step: int) -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            diff = scores(held_c) - scores(held_r)
        model.train()
        out = {"eval/pair_accuracy": float((diff > 0).float().mean()), "eval/margin": float(diff.mean()),
               "eval/loss": float(-F.logsigmoid(diff - s.margin).mean())}
        return out | gates.check(cfg.eval.gates, out)

    def step_fn(step: int):
        idx = run.data.take(s.global_batch_size)
        part, share = run.mine(torch.tensor(idx))  # this rank's pairs and their fraction of the batch
        rc, rr = scores([enc_c[i] for i in part.tolist()]), scores([enc_r[i] for i in part.tolist()])
        diff = (rc - rr).detach()
        return (bradley_terry_loss(rc, rr, s.margin) * share,
                {"accuracy": (diff > 0).float().mean() * share, "margin": diff.mean() * share}, len(idx))

    def said(before: dict, after: dict | None) -> str | None:
        if after is None:
            return f"held-out pair accuracy before training: {before['eval/pair_accuracy']:.3f}"
        return (f"held-out pair accuracy: {before.get('eval/pair_accuracy', float('nan')):.3f} -> "
                f"{after['eval/pair_accuracy']:.3f} ({len(held)} pairs)")

    return run.train("rm", s.steps, s.grad_clip, step_fn, evaluate if held else None, cfg.eval.every, eval_before=True,
                     show=lambda m: f"loss {m['loss']:.3f}  acc {m['accuracy']:.2f}", unit="pairs", said=said)
