"""Which config keys each method reads: a key the chosen method does not read is refused.

Every method declares its keys in its registration (regen/config/registry.py; the built-in ones
in lm_methods.py and flow_methods.py), beside the keys that every method of its modality reads
(the modality's registration) and those every online method reads (ONLINE, here). A key the
user sets (in the YAML file or as an override) that the chosen method does not read is an
error naming the key and why, instead of a setting that is accepted and silently does nothing.
The same declarations prune the resolved config written to a run's config.yaml (so it shows
only what acted, and reloads cleanly) and label the `--help-config` table.

A declaration is a key (a dotted prefix: "critic" covers every critic.* key) and, for keys
read only in some settings, the condition, as the text shown to the user and a predicate.
"""

from __future__ import annotations

from collections.abc import Iterable

from regen.config.registry import METHODS, MODALITIES, Read, always, method, when


def torchrun(cfg) -> bool:
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
    *always("eval.metrics", "eval.gates"),
    *when("with eval.metrics set", lambda c: bool(c.eval.metrics), "eval.metric_samples"),
]
# Where a run's process group comes from: torchrun, or a Ray trainer group (regen/train/ray_trainers.py).
PROCESS_GROUP = [
    *when("under torchrun (distributed.mode torchrun or auto) or in a Ray trainer group (distributed.mode=ray with "
           "trainer_workers > 1)", lambda c: torchrun(c) or _trainer_group(c), "distributed.strategy",
           "distributed.backend", "distributed.timeout_s"),
    *when("with distributed.mode=ray", lambda c: c.distributed.mode == "ray", "distributed.ray_address",
           "distributed.trainer_workers", "distributed.max_restarts"),
    *when("with distributed.mode=ray and sync=collective (the weight group's broadcasts)",
           lambda c: c.distributed.mode == "ray" and c.distributed.sync == "collective", "distributed.timeout_s"),
    *when("with distributed.mode=ray and trainer_workers > 1", _trainer_group, "distributed.trainer_resources",
           "distributed.group_sampling"),
    *when("in a Ray trainer group with distributed.group_sampling=actors", _group_actors,
           "distributed.rollout_workers", "distributed.rollout_resources", "distributed.actor_threads",
           "distributed.sync", "distributed.sync_dtype", "distributed.sync_bucket_mb", "distributed.sync_changed_only",
           "distributed.max_staleness"),
]

# What every online RL method reads, whatever it trains.
ONLINE = [
    *always("run", "model", "data.columns", "data.on_bad_line", "tasks",
             "rollout.global_batch_size", "rollout.group_size", "train.steps",
             "train.ppo_epochs", "train.global_minibatch_size", "train.micro_batch_size", "train.grad_clip",
             "train.precision", "train.offload", "optim", "eval.every", "eval.num_prompts",
             "eval.samples_per_prompt", "checkpoint", "health", "mirror", "log", "algorithm.name",
             "algorithm.dynamic_sampling", "distributed.mode"),
    *when("with algorithm.dynamic_sampling=true", lambda c: c.algorithm.dynamic_sampling,
           "algorithm.max_sampling_rounds"),
    *when("without tasks (in a multi-task run each task stream has its own train, eval and reward)",
           lambda c: not c.tasks, "data.train", "data.eval", "reward"),
    *when("with tasks (a multi-task run)", lambda c: bool(c.tasks), "task_mix"),
    *QUALITY,
    *PROCESS_GROUP,
    *when("with distributed.mode single, auto or torchrun (the trainer's own process samples)",
           lambda c: c.distributed.mode != "ray", "distributed.colocate"),
    *when("with distributed.mode=ray and trainer_workers=1 (a trainer group samples and scores on its trainers)",
           _ray_actors, "distributed.rollout_workers", "distributed.reward_workers", "distributed.rollout_resources",
           "distributed.reward_resources", "distributed.max_staleness", "distributed.actor_threads",
           "distributed.sync", "distributed.sync_dtype", "distributed.sync_bucket_mb", "distributed.sync_changed_only"),
]

def arithmetic(cfg) -> bool:
    """The built-in arithmetic task is in use (its data, or its model recipe)."""
    if cfg.model is None:  # a joint run: its data
        return any(str(s).startswith(("builtin:arithmetic", "builtin:calc")) for s in (cfg.data.train, cfg.data.eval))
    specs = [cfg.data.train, cfg.data.eval] if not getattr(cfg, "tasks", None) else \
        [x for s in cfg.tasks.values() if s.task is None for x in (s.train, s.eval)]
    return cfg.model.init is not None or any(str(s).startswith(("builtin:arithmetic", "builtin:calc")) for s in specs)



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
    "data.chat_template": "it renders language-model prompts",
    "data.system_prompt": "it is part of data.chat_template",
    "task.demo_noise": "corrupted demonstrations are for `regen sft`; RL prompts carry the true answers",
    "task.known_synonyms": "it shapes the demonstrations of `regen sft`; RL prompts carry the true answers",
}


# A joint run (models:): the run's own keys; each model's are checked in regen/config/joint.py.
JOINT = [
    *always("run", "data.train", "data.eval", "data.columns", "data.on_bad_line", "reward", "models",
             "rollout.global_batch_size", "train.steps", "optim.warmup_steps", "optim.schedule", "eval.every",
             "eval.num_prompts", "eval.samples_per_prompt", "eval.temperature", "eval.greedy", "eval.batch_size",
             "eval.gates", "checkpoint", "health", "log", "distributed.mode"),
    *when("with the built-in arithmetic task (builtin:arithmetic data)", arithmetic, "task.digits", "task.test_size"),
    *PROCESS_GROUP,
]


def declared(cfg) -> list[Read]:
    """Every key the configured method reads, with its conditions."""
    if getattr(cfg, "models", None):
        return JOINT
    return _reads_of(method(cfg.algorithm.name))


def _reads_of(m) -> list[Read]:
    """What every online method reads, what every method of m's modality reads, m's own keys;
    an offline method declares all it reads itself."""
    return [*ONLINE, *MODALITIES[m.modality].reads, *m.reads] if m.online else list(m.reads)


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
        kind = MODALITIES[METHODS[name].modality].label if METHODS[name].online else "offline, no sampling"
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
    return [name for name, m in METHODS.items() if any(_covers(r.key, key) for r in _reads_of(m))]
