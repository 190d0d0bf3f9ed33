"""Supervised fine-tuning on prompt/completion demonstrations (cross-entropy on the
completion and its EOS only). For the built-in task it trains the RL base from random init
on imperfect demonstrations."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from regen.config import SFTConfig, dump_config
from regen.data import Demo, EpochSampler, load_demos, load_prompts
from regen.errors import DataError
from regen.modalities.lm_eval import run_eval
from regen.offline import close_offline
from regen.policies.lm import LMPolicy, configure_prompts, load_model_and_tokenizer, max_positions, resolve_device
from regen.policies.vlm import VisionPrompt, check_trainable, encode, is_processor, select_vision
from regen.quality import Quality, gates
from regen.runtime import checkpoint as ckpt
from regen.runtime.loggers import require as require_loggers
from regen.runtime.metrics import MetricsLogger
from regen.runtime.optim import lr_at, make_optimizer, sft_step
from regen.runtime.progress import StepProgress
from regen.runtime.rundir import mark_running, prepare, setup_torch
from regen.runtime.signals import GracefulStop

IGNORE = -100


def encode_demos(demos: list[Demo], tok, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (N, L) input ids, attention mask, and labels that are IGNORE on the prompt.
    `tok` may be a vision-language model's processor: the prompts' image tokens are then expanded
    to the model's image positions (their pixels: `demo_vision`)."""
    if is_processor(tok):  # one batched call; each row's left padding dropped again
        text, _ = encode(tok, [VisionPrompt(d.prompt, _image_of(d)) for d in demos], True, "cpu")
        p_ids = [ids[m.bool()].tolist() for ids, m in zip(text["input_ids"], text["attention_mask"])]
        tok = tok.tokenizer
    else:
        p_ids = tok([d.prompt for d in demos], add_special_tokens=True)["input_ids"]
    c_ids = tok([d.completion for d in demos], add_special_tokens=False)["input_ids"]
    rows = [(p, c + [tok.eos_token_id]) for p, c in zip(p_ids, c_ids)]
    L = max(len(p) + len(c) for p, c in rows)
    if L > max_len:
        raise DataError(f"data.train: a demonstration is {L} tokens long, more than the model's {max_len} positions")
    ids = torch.full((len(rows), L), tok.pad_token_id)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    labels = torch.full((len(rows), L), IGNORE)
    for i, (p, c) in enumerate(rows):
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(c)
    return ids, mask, labels


def _image_of(d: Demo):
    if d.image is None:
        raise DataError(f"data.train: the model reads images but demonstration '{d.prompt[:60]}' has no 'image'")
    return d.image


def demo_vision(demos: list[Demo], tok, device) -> dict:
    """The demonstrations' image inputs (pixel_values) of a VLM's processor; {} for text."""
    if not is_processor(tok):
        return {}
    return encode(tok, [VisionPrompt(d.prompt, _image_of(d)) for d in demos], True, device)[1]


def sft(cfg: SFTConfig, resume: bool = False) -> dict:
    device = resolve_device(cfg.run.device)
    require_loggers(cfg.log)  # W&B / MLflow installed when turned on
    demos = load_demos(cfg.data.train, cfg.task, "data.train", cfg.data.on_bad_line == "skip", cfg.data.columns)
    skip_bad = cfg.data.on_bad_line == "skip"
    eval_items = load_prompts(cfg.data.eval, cfg.task, "data.eval", skip_bad, cfg.data.columns) if cfg.data.eval else []
    quality = Quality(cfg.eval, "lm", cfg.run.seed)  # a wrong metric setting stops before the run dir
    run_dir, resume = prepare(cfg.run.dir, cfg.run.overwrite, resume)
    setup_torch(cfg.run.threads, cfg.run.seed)
    state = ckpt.load_latest(run_dir) if resume else None
    model, tok = load_model_and_tokenizer(ckpt.resumed_model(cfg.model, state), cfg.task, cfg.run.seed)
    check_trainable(model, cfg.model)  # model.freeze_vision
    policy = LMPolicy(model, tok, device)
    configure_prompts(policy, cfg)  # rollout.stop_tokens in its held-out evaluation
    max_len = max_positions(model)
    ids, mask, labels = (t.to(device) for t in encode_demos(demos, tok, max_len))
    vision = demo_vision(demos, tok, device)
    opt = make_optimizer(policy.model, cfg.optim)
    data = EpochSampler(len(demos), cfg.run.seed)
    start_step = ckpt.restore(state, run_dir, opt, data) if state else 0
    dump_config(cfg, run_dir / "config.yaml")
    mark_running(run_dir)  # run.json, for `regen status`
    log = MetricsLogger(run_dir, cfg.log, config=cfg, resume=state is not None)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    s = cfg.sft

    def evaluate(step: int) -> dict[str, float]:
        policy.model.eval()
        out = run_eval(policy, eval_items, cfg, None, run_dir, step, quality)
        return out | gates.check(cfg.eval.gates, out)

    def save(step: int):
        return ckpt.save_offline(run_dir, step, policy, opt, data, cfg.checkpoint.keep_last)

    policy.model.train()
    with StepProgress(s.steps, start_step, cfg.log.progress, cfg.log.every, "sft", cfg.log.every_s) as bar, \
            GracefulStop(bar.print) as stop:
        t_start = time.perf_counter()
        step = start_step
        for step in range(start_step + 1, s.steps + 1):
            t0 = time.perf_counter()
            idx = torch.tensor(data.take(s.global_batch_size), device=device)
            width = int(mask[idx].sum(1).max())  # trim the batch to its longest row
            b_ids, b_mask, b_lab = ids[idx, :width], mask[idx, :width], labels[idx, :width]
            logits = policy.model(input_ids=b_ids, attention_mask=b_mask, **select_vision(vision, idx)).logits
            # position t predicts token t+1; mean over completion tokens of the batch
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), b_lab[:, 1:].flatten(), ignore_index=IGNORE
            )
            lr = lr_at(step, cfg.optim, s.steps)
            gn = sft_step(opt, loss, params, lr, s.grad_clip)
            dt = time.perf_counter() - t0
            metrics = {"loss": loss.item(), "grad_norm": float(gn), "lr": lr, "time/step_s": dt,
                       "throughput/samples_per_s": s.global_batch_size / dt}
            if eval_items and cfg.eval.every and step % cfg.eval.every == 0 and step != s.steps:
                metrics.update(evaluate(step))
                policy.model.train()
            log.log(step, metrics)
            rate = s.global_batch_size * (step - start_step) / (time.perf_counter() - t_start)
            bar.update(step, f"loss {metrics['loss']:.3f}  {rate:.0f} samples/s")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != s.steps:
                save(step)
            if stop.requested:  # SIGINT / SIGTERM: this step is done; checkpoint and exit
                break
        last = save(step)
        policy.model.eval()
        after = evaluate(step) if eval_items and step == s.steps else {}
        if after:
            log.log(step, after)
    return close_offline(run_dir, log, step, s.steps, last, policy.save_pretrained, {"eval_after": after})

