"""Which config keys each method reads: a key the chosen method does not read is refused.

Every method declares its keys here, beside the keys that every online method or every method
of its modality reads. A key the user sets (in the YAML file or as an override) that the
chosen method does not read is an error naming the key and why, instead of a setting that is
accepted and silently does nothing. The same declarations prune the resolved config written
to a run's config.yaml (so it shows only what acted, and reloads cleanly) and label the
`--help-config` table.

A declaration is a key (a dotted prefix: "critic" covers every critic.* key) and, for keys
read only in some settings, the condition, as the text shown to the user and a predicate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from regen.config.methods import METHODS


@dataclass(frozen=True)
class Read:
    key: str
    when: str = ""  # "" = always; else the setting it needs, as shown to the user
    test: Callable | None = None  # cfg -> bool, with `when`


def _always(*keys: str) -> list[Read]:
    return [Read(k) for k in keys]


def _when(text: str, test: Callable, *keys: str) -> list[Read]:
    return [Read(k, text, test) for k in keys]


def _torchrun(cfg) -> bool:
    return cfg.distributed.mode in ("auto", "torchrun")


def _trainer_group(cfg) -> bool:
    """distributed.mode=ray with trainer_workers > 1: trainer actors that train like torchrun ranks."""
    return cfg.distributed.mode == "ray" and cfg.distributed.trainer_workers > 1


def _group_actors(cfg) -> bool:
    """A Ray trainer group whose samples come from rollout actors (rank 0 drives them)."""
    return _trainer_group(cfg) and cfg.distributed.group_sampling == "actors"


def _ray_actors(cfg) -> bool:
    """distributed.mode=ray with one trainer (the process started) and rollout / reward actors."""
    return cfg.distributed.mode == "ray" and cfg.distributed.trainer_workers == 1


# Held-out quality metrics and gates (regen/quality): every method that evaluates reads them.
QUALITY = [
    *_always("eval.metrics", "eval.gates"),
    *_when("with eval.metrics set", lambda c: bool(c.eval.metrics), "eval.metric_samples"),
]
MEDIA_QUALITY = [  # what the image / video metrics compare with
    *_when("with eval.metrics fid, kid, precision_recall, ssim or psnr",
           lambda c: any(n in ("fid", "kid", "precision_recall", "ssim", "psnr") for n in c.eval.metrics),
           "eval.reference"),
    *_when("with eval.metrics fid, kid or precision_recall",
           lambda c: any(n in ("fid", "kid", "precision_recall") for n in c.eval.metrics), "eval.features"),
    *_when("with eval.metrics clip_score", lambda c: "clip_score" in c.eval.metrics, "eval.clip_model"),
]

# Where a run's process group comes from: torchrun, or a Ray trainer group (regen/placement/ray_trainers.py).
PROCESS_GROUP = [
    *_when("under torchrun (distributed.mode torchrun or auto) or in a Ray trainer group (distributed.mode=ray with "
           "trainer_workers > 1)", lambda c: _torchrun(c) or _trainer_group(c), "distributed.strategy",
           "distributed.backend", "distributed.timeout_s"),
    *_when("with distributed.mode=ray", lambda c: c.distributed.mode == "ray", "distributed.ray_address",
           "distributed.trainer_workers", "distributed.max_restarts"),
    *_when("with distributed.mode=ray and trainer_workers > 1", _trainer_group, "distributed.trainer_resources",
           "distributed.group_sampling"),
    *_when("in a Ray trainer group with distributed.group_sampling=actors", _group_actors,
           "distributed.rollout_workers", "distributed.rollout_resources", "distributed.actor_threads",
           "distributed.sync_dtype", "distributed.sync_bucket_mb", "distributed.sync_changed_only",
           "distributed.max_staleness"),
]

# What every online RL method reads, whatever it trains.
ONLINE = [
    *_always("run", "model", "data.columns", "data.on_bad_line", "tasks",
             "rollout.global_batch_size", "rollout.group_size", "train.steps",
             "train.ppo_epochs", "train.global_minibatch_size", "train.micro_batch_size", "train.grad_clip",
             "train.precision", "train.offload", "optim", "eval.every", "eval.num_prompts",
             "eval.samples_per_prompt", "checkpoint", "health", "mirror", "log", "algorithm.name",
             "algorithm.dynamic_sampling", "distributed.mode"),
    *_when("with algorithm.dynamic_sampling=true", lambda c: c.algorithm.dynamic_sampling,
           "algorithm.max_sampling_rounds"),
    *_when("without tasks (in a multi-task run each task stream has its own train, eval and reward)",
           lambda c: not c.tasks, "data.train", "data.eval", "reward"),
    *_when("with tasks (a multi-task run)", lambda c: bool(c.tasks), "task_mix"),
    *QUALITY,
    *PROCESS_GROUP,
    *_when("with distributed.mode single, auto or torchrun (the trainer's own process samples)",
           lambda c: c.distributed.mode != "ray", "distributed.colocate"),
    *_when("with distributed.mode=ray and trainer_workers=1 (a trainer group samples and scores on its trainers)",
           _ray_actors, "distributed.rollout_workers", "distributed.reward_workers", "distributed.rollout_resources",
           "distributed.reward_resources", "distributed.max_staleness", "distributed.actor_threads",
           "distributed.sync_dtype", "distributed.sync_bucket_mb", "distributed.sync_changed_only"),
]

# What every method of a modality reads.
def _arithmetic(cfg) -> bool:
    """The built-in arithmetic task is in use (its data, or its model recipe)."""
    if cfg.model is None:  # a joint run: its data
        return any(str(s).startswith("builtin:arithmetic") for s in (cfg.data.train, cfg.data.eval))
    specs = [cfg.data.train, cfg.data.eval] if not getattr(cfg, "tasks", None) else \
        [x for s in cfg.tasks.values() if s.task is None for x in (s.train, s.eval)]
    return cfg.model.init is not None or any(str(s).startswith("builtin:arithmetic") for s in specs)


LM = [
    *_when("with the built-in arithmetic task (builtin:arithmetic data or model.init)", _arithmetic, "task.digits",
           "task.test_size"),
    *_always("data.chat_template", "rollout.stop_tokens"),
    *_when("with data.chat_template=true", lambda c: c.data.chat_template, "data.system_prompt"),
    *_always("rollout.temperature", "rollout.top_p", "rollout.max_new_tokens", "rollout.engine",
             "eval.temperature", "eval.greedy", "eval.batch_size", "algorithm.clip_low", "algorithm.clip_high",
             "algorithm.entropy_coef", "algorithm.kl_coef", "algorithm.overlong", "algorithm.advantage"),
    *_when("with rollout.engine=vllm", lambda c: c.rollout.engine == "vllm", "rollout.vllm_memory",
           "rollout.vllm_tensor_parallel"),
    *_when("with algorithm.kl_coef > 0", lambda c: c.algorithm.kl_coef > 0, "algorithm.kl_placement"),
    *_when("with algorithm.kl_coef > 0 and kl_placement=loss",
           lambda c: c.algorithm.kl_coef > 0 and c.algorithm.kl_placement == "loss", "algorithm.kl_estimator"),
    *_when("with algorithm.advantage=grpo", lambda c: c.algorithm.advantage == "grpo", "algorithm.std_normalize"),
    *_when("with algorithm.advantage=reinforce_pp", lambda c: c.algorithm.advantage == "reinforce_pp",
           "algorithm.reinforce_baseline"),
]
FLOW = [*_always("flow.steps", "flow.eval_steps", "flow.shift", "flow.guidance", "flow.weight_ema", "flow.adv_clip",
                 "algorithm.std_normalize", "train.gradient_checkpointing", "flow.sampler"),
        *MEDIA_QUALITY]
SDE = [  # the methods trained on stochastic (SDE) sampling steps
    *_always("flow.noise_level", "flow.sde_window"),
    *_when("with flow.sde_window set", lambda c: c.flow.sde_window is not None, "flow.window_policy",
           "flow.window_start"),
    *_when("with flow.window_policy=moving", lambda c: c.flow.sde_window is not None
           and c.flow.window_policy == "moving", "flow.window_shift_every"),
]

ODE = _always("flow.solver")  # the methods trained on clean ODE samples: their rollouts' solver

# Each method: the keys it reads beyond those above.
OWN: dict[str, list[Read]] = {
    "grpo": _always("algorithm.dual_clip", "algorithm.loss_agg"),
    "ppo": _always("algorithm.dual_clip", "algorithm.loss_agg", "algorithm.gamma", "algorithm.lam",
                   "algorithm.whiten_advantages", "critic"),
    # GSPO's policy term is one ratio per sequence: the aggregation reaches only its KL and entropy terms
    "gspo": _when("with algorithm.kl_coef > 0 or entropy_coef > 0",
                  lambda c: c.algorithm.kl_coef > 0 or c.algorithm.entropy_coef > 0, "algorithm.loss_agg"),
    "dpo": [*_when("with the built-in arithmetic task (builtin:arithmetic data or model.init)", _arithmetic,
                   "task.digits", "task.test_size"),
            *_always("run", "model", "data.train", "data.eval", "data.columns", "data.on_bad_line", "algorithm.name",
                     "rollout.stop_tokens", "algorithm.dpo_beta", "algorithm.dpo_label_smoothing",
                     "algorithm.dpo_loss", "train.steps", "train.global_minibatch_size", "train.grad_clip", "optim",
                     "eval.every", "eval.num_prompts", "eval.samples_per_prompt", "eval.temperature", "eval.greedy",
                     "eval.batch_size", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens", "checkpoint",
                     "log", "health.rollback_after_nonfinite", "health.rollback_lr_factor", "health.max_rollbacks",
                     "health.stall_alert_s", "health.webhook_url", "distributed.mode", "mirror"),
            *_when("under torchrun (distributed.mode torchrun or auto)", _torchrun, "distributed.backend",
                   "distributed.timeout_s"),
            *QUALITY],
    "flow_grpo": [*SDE, *_always("algorithm.clip_low", "algorithm.clip_high", "algorithm.kl_coef")],
    "flow_dppo": [*SDE, *_always("flow.dppo_tau")],
    "nft": [*ODE, *_always("flow.nft_beta", "flow.ema_rate", "flow.ema_max", "algorithm.reward_type", "algorithm.kl_coef")],
    "awm": [*ODE, *_always("flow.awm_weight", "algorithm.kl_coef"),
            *_when("with algorithm.kl_coef > 0 (the EMA anchor)", lambda c: c.algorithm.kl_coef > 0, "flow.ema_rate",
                   "flow.ema_max")],
    "dgpo": [*ODE, *_always("flow.dgpo_beta", "flow.dgpo_ref", "algorithm.kl_coef", "algorithm.clip_low",
                            "algorithm.reward_type"),
             *_when("with algorithm.clip_low set", lambda c: c.algorithm.clip_low is not None, "algorithm.clip_high"),
             *_when("with flow.dgpo_ref=ema or algorithm.clip_low set (the EMA old policy)",
                    lambda c: c.flow.dgpo_ref == "ema" or c.algorithm.clip_low is not None, "flow.ema_rate",
                    "flow.ema_max")],
}

# Why a key is not read where that is not obvious from who reads it.
WHY = {
    "train.gradient_checkpointing": "a language model's update shares each prompt's KV cache across its group, "
                                    "which checkpointing turns off",
    "algorithm.dual_clip": "dual-clip bounds a token-level ratio; GSPO clips one ratio per sequence",
    "algorithm.kl_estimator": "flow_grpo's KL is the exact Gaussian KL of each SDE step, awm's a velocity distance",
    "algorithm.advantage": "flow methods use Flow-GRPO's group advantage (algorithm.std_normalize, flow.adv_clip)",
    "flow.noise_level": "the ODE methods sample without noise",
    "flow.solver": "flow_grpo / flow_dppo take Euler steps between their stochastic ones",
    "algorithm.reward_type": "policy-gradient methods normalise any reward within its group",
    "eval.reference": "a language model's text metrics compare with each held-out row's 'reference' (or 'answer')",
    "eval.features": "it is the feature space of the image / video metrics fid, kid and precision_recall",
    "eval.clip_model": "it is the CLIP model of the image / video metric clip_score",
    "data.chat_template": "it renders language-model prompts (DPO's pairs are scored as written)",
    "data.system_prompt": "it is part of data.chat_template",
    "task.demo_noise": "corrupted demonstrations are for `regen sft`; RL prompts carry the true answers",
    "task.known_synonyms": "it shapes the demonstrations of `regen sft`; RL prompts carry the true answers",
}


# A joint run (models:): the run's own keys; each model's are checked in regen/config/joint.py.
JOINT = [
    *_always("run", "data.train", "data.eval", "data.columns", "data.on_bad_line", "reward", "models",
             "rollout.global_batch_size", "train.steps", "optim.warmup_steps", "optim.schedule", "eval.every",
             "eval.num_prompts", "eval.samples_per_prompt", "eval.temperature", "eval.greedy", "eval.batch_size",
             "eval.gates", "checkpoint", "health", "log", "distributed.mode"),
    *_when("with the built-in arithmetic task (builtin:arithmetic data)", _arithmetic, "task.digits", "task.test_size"),
    *PROCESS_GROUP,
]


def declared(cfg) -> list[Read]:
    """Every key the configured method reads, with its conditions."""
    if getattr(cfg, "models", None):
        return JOINT
    name = cfg.algorithm.name
    if name == "dpo":
        return OWN["dpo"]
    return [*ONLINE, *(LM if METHODS[name] == "lm" else FLOW), *OWN[name]]


def _covers(read: str, key: str) -> bool:
    return key == read or key.startswith(read + ".")


def unread(cfg, given: Iterable[str]) -> list[str]:
    """One message per key in `given` (dotted keys the user set) that the method does not read."""
    reads = declared(cfg)
    out = []
    for key in sorted(set(given)):
        matches = [r for r in reads if _covers(r.key, key) or _covers(key, r.key)]
        if any(not r.when or r.test(cfg) for r in matches):
            continue
        name = cfg.algorithm.name
        if getattr(cfg, "models", None):
            out.append(f"{key} is not read in a joint run (models:)" + (
                f": give it inside each models.NAME ({key.split('.')[0]} is a model's own section)"
                if key.split(".")[0] in ("model", "algorithm", "rollout", "flow", "optim", "train", "critic") else ""))
            continue
        if matches:
            whens = " or ".join(dict.fromkeys(r.when for r in matches if r.when))  # every setting that reads it
            out.append(f"{key} is read only {whens} (algorithm.name={name})")
            continue
        who = readers(key)
        kind = "offline, no sampling" if name == "dpo" else ("language models" if METHODS[name] == "lm"
                                                              else "flow-matching models")
        why = WHY.get(key)
        out.append(f"{key} is not read by algorithm.name={name} ({kind})" + (f": {why}" if why else "")
                   + (f"; read by {', '.join(who)}" if who else ""))
    return out


def prune(tree: dict, cfg, prefix: str = "") -> dict:
    """The config tree with only the keys the method reads under the current settings."""
    reads = [r for r in declared(cfg) if not r.when or r.test(cfg)]
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if any(_covers(r.key, key) for r in reads):
            out[k] = v
        elif isinstance(v, dict) and any(_covers(key, r.key) for r in reads):
            out[k] = prune(v, cfg, key + ".")
    return out


def readers(key: str) -> list[str]:
    """The methods that can read `key` (in some setting): the `--help-config` column."""
    out = []
    for name, modality in METHODS.items():
        reads = OWN["dpo"] if name == "dpo" else [*ONLINE, *(LM if modality == "lm" else FLOW), *OWN[name]]
        if any(_covers(r.key, key) for r in reads):
            out.append(name)
    return out
