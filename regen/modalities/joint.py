"""A joint run's models as one modality (config `models:`, regen/config/joint.py): an enhancer
language model rewrites each prompt, a painter flow model draws each rewrite, one reward on the
images trains both. The loop (regen/train/loop.py) and the run's books (checkpoints, exact
resume, rollback, export, evaluation) see one modality; each stage is delegated to the two
models' own adapters, each with its own config, so every LM method and every flow method works
as it does alone.

Rows: a step holds G user prompts; the enhancer samples n_t rewrites of each (G * n_t rows), the
painter n_i images of each rewrite (G * n_t * n_i rows, the batch's rows: rewrite r's images are
rows r * n_i ... r * n_i + n_i - 1). Advantages (the routing of one reward to two models):

  painter   its method's advantage of the image rewards, each rewrite's n_i images a group
  enhancer  R_r = mean of rewrite r's image rewards (missing ones left out; none: missing), plus
            its method's own reward terms (DAPO's overlong penalty on the rewrite's length), and
            its method's advantage of R_r with each prompt's n_t rewrites a group

Every reward judges an image against the user's prompt, except the painter's with
`models.PAINTER.reward_against: rewrite`: its images are scored a second time against the prompt
the painter was given (the rewrite), and those scores make its advantage. Judged against the
user's prompt, a painter whose rewrite named other attributes is rewarded for drawing what the
user asked anyway, i.e. for ignoring its prompt (bench/README.md, joint.py).

Each model has its own parameter group in the run's optimizer (own lr, betas, eps, weight
decay; the run's schedule and warm-up scale every group alike), and is updated by its own
method with its own train settings, only at the steps it trains (frozen / train_at).

Data parallel (torchrun, a Ray trainer group; DDP): each rank takes whole user-prompt groups
(JointPlan.select keeps every model's randomness for its rows), and each model's update takes
its share of every minibatch like a single-model run, so N ranks train what one process trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from regen.config.joint import trains_at
from regen.data import PromptItem
from regen.modalities.base import Advantages, Modality


@dataclass
class JointPlan:
    """The randomness of a step for each model, drawn in dataflow order from the run's generator."""

    plans: dict  # name -> that model's plan of the whole batch
    n_last: int  # the painter's group size: images per rewrite

    def select(self, rows: torch.Tensor) -> JointPlan:
        """The share of the batch in `rows` (image rows of whole prompt groups)."""
        (first, a), (last, b) = self.plans.items()
        return JointPlan({first: a.select(torch.unique_consecutive(rows // self.n_last)), last: b.select(rows)},
                         self.n_last)

    def cpu(self) -> JointPlan:
        return JointPlan({k: p.cpu() for k, p in self.plans.items()}, self.n_last)


@dataclass
class JointBatch:
    parts: dict  # name -> that model's batch: the enhancer's LMRollout, the painter's FlowSample
    rewrites: list[str]  # (G * n_t,) the enhancer's text, the painter's prompts
    version: torch.Tensor | None = field(default=None)
    own_rewards: torch.Tensor | None = field(default=None)  # (B,) reward_against=rewrite: the painter's scores

    def __len__(self) -> int:
        return len(list(self.parts.values())[-1])

    def to(self, device) -> JointBatch:
        return JointBatch({k: v.to(device) for k, v in self.parts.items()}, self.rewrites, self.version)


class JointAdvantages(Advantages):
    """The painter's advantages and metrics, and each model's own. `valid` (what the loop reads: is
    there anything to train) marks an image row valid when either model has a valid row for it."""

    def __init__(self, parts: dict[str, Advantages], last: str, metrics: dict):
        a = parts[last]
        first = next(v for k, v in parts.items() if k != last)
        valid = a.valid | first.valid.repeat_interleave(len(a.valid) // max(len(first.valid), 1))
        super().__init__(a.adv, valid, a.mask, metrics)
        self.parts = parts


def rewrite_rewards(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """(B / n,) the mean of each rewrite's n image rewards, missing (NaN) ones left out; NaN when
    all of a rewrite's are missing (the enhancer's sample is then missing too, never zero)."""
    grouped = rewards.view(-1, n)
    finite = torch.isfinite(grouped)
    count = finite.sum(1)
    total = torch.where(finite, grouped, torch.zeros_like(grouped)).sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan))


class JointModality(Modality):
    PER_MODEL_LR = True  # the run's optim.lr trains neither model: enhancer/lr, painter/lr are logged
    kind = "joint"

    def __init__(self, cfg, device: torch.device, dist, state: dict | None = None, alerts=None):
        from regen.modalities import modality_class

        self.cfg, self.device, self.dist = cfg, device, dist
        self.configs = cfg.members  # name -> its RLConfig, in dataflow order
        self.names = list(self.configs)
        self.first, self.last = self.names
        self.specs = cfg.models
        self.m = {n: modality_class(c)(c, device, dist, _member_state(state, n), alerts)
                  for n, c in self.configs.items()}
        for n in self.names:
            if self.specs[n].get("frozen"):
                self.m[n].trained.requires_grad_(False)  # never trained: no gradients, no optimizer state
        self.gen_device = self.m[self.last].gen_device
        self.n_first = self.configs[self.first].rollout.group_size
        self.n_last = self.configs[self.last].rollout.group_size
        self.against_rewrite = self.specs[self.last].get("reward_against", "user") == "rewrite"
        self.step = 0
        self.opt = None

    def active(self, name: str, step: int | None = None) -> bool:
        return trains_at(self.specs[name], self.step if step is None else step)

    @property
    def trained(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({n: self.m[n].trained for n in self.names if not self.specs[n].get("frozen")})

    def optimizer(self, optim) -> torch.optim.Optimizer:
        """AdamW with one parameter group per trained model, each with its model's optim settings."""
        groups = []
        for n in self.names:
            if self.specs[n].get("frozen"):
                continue
            o = self.configs[n].optim
            groups.append({"params": [p for p in self.m[n].trained.parameters() if p.requires_grad], "lr": o.lr,
                           "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay, "model": n})
        try:
            self.opt = torch.optim.AdamW(groups, fused=True)
        except (RuntimeError, ValueError):
            self.opt = torch.optim.AdamW(groups)
        return self.opt

    def set_lr(self, lr: float) -> None:
        """The run's schedule (x the rollbacks' scale), relative to its optim.lr, times each model's optim.lr."""
        scale = lr / self.cfg.optim.lr
        for g in self.opt.param_groups:
            g["lr"] = self.configs[g["model"]].optim.lr * scale
            self.m[g["model"]].set_lr(g["lr"])

    def frozen(self) -> tuple[list, list]:
        opts, mods = [], []
        for n in self.names:
            o, m = self.m[n].frozen()
            opts, mods = opts + o, mods + m
        return opts, mods

    # ------------------------------------------------------------------ 1. sample

    def plan(self, gen: torch.Generator, step: int, again: bool = False) -> JointPlan:
        self.step = step
        return JointPlan({n: self.m[n].plan(gen, step, again) for n in self.names}, self.n_last)

    def inputs(self, items) -> list:
        return self.m[self.first].inputs(items)

    def sample(self, prompts: list, n: int, plan: JointPlan, behaviour: bool = False) -> JointBatch:
        text = self.m[self.first].sample(prompts, self.n_first, plan.plans[self.first], behaviour)
        rewrites = [c.strip() for c in text.completions]
        images = self.m[self.last].sample(rewrites, self.n_last, plan.plans[self.last], behaviour)
        return JointBatch({self.first: text, self.last: images}, rewrites)

    def concat(self, parts: list[JointBatch]) -> JointBatch:
        return JointBatch({n: self.m[n].concat([p.parts[n] for p in parts]) for n in self.names},
                          [r for p in parts for r in p.rewrites])

    def sync_state(self) -> dict[str, torch.Tensor]:
        return {f"{n}/{k}": v for n in self.names for k, v in self.m[n].sync_state().items()}

    def sampler_sleep(self) -> None:
        for n in self.names:
            self.m[n].sampler_sleep()

    def sampler_wake(self) -> None:
        for n in self.names:
            self.m[n].sampler_wake()

    def sync_local(self, step: int) -> dict[str, float]:
        return {f"{n}/{k}": v for n in self.names for k, v in self.m[n].sync_local(step).items()}

    # ------------------------------------------------------------------ 2. score

    @staticmethod
    def per_rewrite(items: list[PromptItem], rewrites: list[str], n: int) -> list[PromptItem]:
        """Each rewrite's user prompt item (n rewrites per item: the reward judges the image against
        what the user asked), with the rewrite in meta['rewrite']."""
        return [replace(items[r // n], meta={**items[r // n].meta, "rewrite": text}) for r, text in enumerate(rewrites)]

    def reward_samples(self, items, batch: JointBatch):
        """Each image against its user's prompt; with reward_against=rewrite the same images again
        (rows B..2B-1) against the painter's own prompt, with the user's in meta['user_prompt']."""
        user = self.m[self.last].reward_samples(self.per_rewrite(items, batch.rewrites, self.n_first),
                                                batch.parts[self.last])
        if not self.against_rewrite:
            return user
        return user + [replace(s, prompt=batch.rewrites[i // self.n_last], meta={"user_prompt": s.prompt})
                       for i, s in enumerate(user)]

    def shape_rewards(self, rewards: torch.Tensor, parts: dict, batch: JointBatch) -> tuple[torch.Tensor, dict]:
        """The run's rewards are the user-judged ones; the painter's own (reward_against=rewrite) wait
        on the batch for its advantage."""
        if not self.against_rewrite:
            return rewards, parts
        b = len(batch)
        batch.own_rewards = rewards[b:]
        return rewards[:b], {k: v[:b] for k, v in parts.items()}

    def fixed_terms(self, batch: JointBatch) -> dict:
        return {n: self.m[n].fixed_terms(batch.parts[n]) for n in self.names if self.active(n)}

    # ------------------------------------------------------------------ 3. advantage

    def advantages(self, rewards: torch.Tensor, batch: JointBatch, fixed: dict) -> JointAdvantages:
        own = rewards if batch.own_rewards is None else batch.own_rewards
        text, _ = self.m[self.first].shape_rewards(rewrite_rewards(rewards, self.n_last), {}, batch.parts[self.first])
        parts = {self.last: self.m[self.last].advantages(own, batch.parts[self.last], fixed.get(self.last, {})),
                 self.first: self.m[self.first].advantages(text, batch.parts[self.first], fixed.get(self.first, {}))}
        metrics = dict(parts[self.last].metrics)  # reward/missing_frac etc. of the images
        for n, a in parts.items():
            metrics |= {f"{n}/{k}": v for k, v in a.metrics.items()}
        if batch.own_rewards is not None:
            # the run's alerts watch the user-judged rewards; a rewrite the reward cannot read (not
            # in the painter's words) is missing only in the painter's own (painter/missing_frac)
            metrics["missing_frac"] = float((~torch.isfinite(rewards)).float().mean())
        return JointAdvantages(parts, self.last, metrics)

    # ------------------------------------------------------------------ 4. update

    def update(self, opt, batch: JointBatch, adv: JointAdvantages, fixed: dict, gen: torch.Generator, step: int,
               prec=None, d=None) -> dict[str, float]:
        from regen.modalities.update import update

        out: dict[str, float] = {}
        for n in self.names:
            if self.active(n, step) and bool(adv.parts[n].valid.any()):
                got = update(self.m[n], opt, batch.parts[n], adv.parts[n], fixed.get(n, {}), self.configs[n], gen,
                             step, prec, d)
                out |= {f"{n}/{k}": v for k, v in got.items()}
            out[f"{n}/trained"] = float(self.active(n, step))
            out[f"{n}/lr"] = next((g["lr"] for g in opt.param_groups if g["model"] == n), 0.0)
        losses = [out[f"{n}/loss"] for n in self.names if f"{n}/loss" in out]
        out["loss"] = sum(losses) if losses else math.nan
        # what the health monitor watches, over both models: a non-finite step of either (rollback
        # restores both), the larger KL to its reference
        out["nonfinite_skipped"] = sum(out.get(f"{n}/nonfinite_skipped", 0.0) for n in self.names)
        kls = [out[f"{n}/kl"] for n in self.names if f"{n}/kl" in out]
        if kls:
            out["kl"] = max(kls)
        return out

    def after_update(self, step: int) -> None:
        for n in self.names:
            if self.active(n, step):
                self.m[n].after_update(step)

    def batch_metrics(self, batch: JointBatch) -> dict[str, float]:
        out = {f"{n}/{k}": v for n in self.names for k, v in self.m[n].batch_metrics(batch.parts[n]).items()}
        out[f"{self.first}/rewrite_words"] = sum(len(r.split()) for r in batch.rewrites) / max(len(batch.rewrites), 1)
        if batch.own_rewards is not None:  # reward_against=rewrite: the painter's scores against its prompt
            own = batch.own_rewards
            finite = own[torch.isfinite(own)]
            out[f"{self.last}/reward_own"] = float(finite.mean()) if len(finite) else math.nan
            out[f"{self.last}/missing_frac"] = 1.0 - len(finite) / max(len(own), 1)
        return out

    # ------------------------------------------------------------------ books

    def save(self, folder: Path, gathered) -> None:
        for n in self.names:
            self.m[n].save(folder / n, None)

    def restore(self, folder: Path | None) -> None:
        for n in self.names:
            self.m[n].restore(None if folder is None else folder / n)

    def export(self, folder: Path, gathered) -> None:
        for n in self.names:
            self.m[n].export(folder / n, None)

    def evaluate(self, items, reward, run_dir: Path, step: int, quality=None, task: str | None = None
                 ) -> dict[str, float]:
        """The pipeline on held-out prompts: the enhancer's greedy rewrite of each, the painter's
        ODE samples of the rewrites, scored against the user's prompts (eval/*), and the rewrites
        kept beside the images (samples/, the report)."""
        from regen.modalities.flow_eval import evaluate_flow

        e = self.cfg.eval
        items = items[: e.num_prompts]
        lm = self.m[self.first]
        enh = self.configs[self.first].rollout
        gen = torch.Generator(device=lm.gen_device).manual_seed(self.cfg.run.seed)
        rewrites = []
        for start in range(0, len(items), e.batch_size):
            chunk = items[start : start + e.batch_size]
            ro = lm.policy.sample(lm.inputs(chunk), 1, enh.temperature, enh.top_p, enh.max_new_tokens, gen, greedy=True)
            rewrites += [c.strip() for c in ro.completions]
        out = evaluate_flow(self.m[self.last], self.per_rewrite(items, rewrites, 1), reward, run_dir, step, quality, task,
                            conditions=rewrites)
        out["eval/rewrite_words"] = sum(len(r.split()) for r in rewrites) / max(len(rewrites), 1)
        return out

    def close(self) -> None:
        for n in self.names:
            self.m[n].close()


def _member_state(state: dict | None, name: str) -> dict | None:
    """A model's view of a joint checkpoint: its own folder (checkpoint/NAME/model, ...)."""
    if state is None:
        return None
    return {**state, "folder": state["folder"] / name, "model_dir": state["folder"] / name / "model"}
