"""Where an LM run's work happens (`distributed.*`, `rollout.engine`): the checks of what is
supported, the run directory prepared by torchrun's rank 0, DDP / FSDP2 around the policy,
and the reward and rollout source each placement uses. Session.start calls these."""

from __future__ import annotations

from pathlib import Path

from regen.config import RLConfig
from regen.errors import UserError
from regen.policies.lm import LMPolicy
from regen.rewards.sharded import ShardedReward
from regen.rollout import LocalRollouts
from regen.runtime import dist as rdist
from regen.runtime.rundir import prepare


def check_split(cfg: RLConfig, d: rdist.Dist) -> None:
    """Under torchrun the groups of a step and the rows of a minibatch must split evenly."""
    G, mb, W = cfg.prompts_per_step, cfg.train.global_minibatch_size, d.world
    where = f"under torchrun with {W} processes"
    if G % W:
        raise UserError(f"rollout.global_batch_size / group_size = {G} prompts per step cannot be split evenly "
                        f"{where}: make it a multiple of {W}")
    if mb % W:
        raise UserError(f"train.global_minibatch_size={mb} cannot be split evenly {where}")


def which_loop(cfg: RLConfig) -> str:
    """'flow', 'dpo' or 'lm': the loop that trains this model with this algorithm, or a clear error."""
    from regen.flow_sft import is_flow_model

    flow_algo, flow_model = cfg.algorithm.name in ("flow_grpo", "flow_dppo", "nft", "awm"), is_flow_model(cfg.model)
    model = cfg.model.path or cfg.model.init
    if flow_algo and not flow_model:
        raise UserError(f"algorithm.name={cfg.algorithm.name} trains flow-matching image/video models; model "
                        f"'{model}' is a language model (use grpo, ppo, gspo or dpo)")
    if flow_model and not flow_algo:
        raise UserError(f"model '{model}' is a flow-matching model: use algorithm.name flow_grpo, flow_dppo, nft "
                        f"or awm, not {cfg.algorithm.name}")
    mode = cfg.distributed.mode
    spread = mode in ("torchrun", "ray") or (mode == "auto" and rdist.launched_by_torchrun())
    if mode == "ray" and flow_model and cfg.distributed.max_staleness > 0:
        raise UserError("distributed.max_staleness > 0: language models only for now; flow models on Ray sample "
                        "with the current weights (max_staleness=0)")
    if spread and cfg.algorithm.name == "dpo":
        raise UserError(f"distributed.mode={mode}: DPO trains in one process")
    return "flow" if flow_model else "dpo" if cfg.algorithm.name == "dpo" else "lm"


class SilentLog:
    """The metrics logger of torchrun ranks other than 0 (rank 0 writes metrics.jsonl)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def check_placement(cfg: RLConfig, d: rdist.Dist) -> None:
    """Refuse combinations that are not supported, before anything is written."""
    t = cfg.train
    if t.gradient_checkpointing:
        raise UserError("train.gradient_checkpointing: flow models only for now; a language model's update "
                        "shares each prompt's KV cache across its group, which checkpointing turns off")
    if cfg.distributed.mode == "ray" and cfg.rollout.engine == "vllm":
        raise UserError("rollout.engine=vllm with distributed.mode=ray: not supported yet; use vllm in one process "
                        "(colocated) or the hf engine on Ray rollout actors")
    if d.on and cfg.rollout.engine == "vllm":
        raise UserError("rollout.engine=vllm under torchrun: not supported yet; run vllm in one process")
    if not d.on:
        return
    check_split(cfg, d)
    if d.sharded and cfg.model.lora is not None:
        raise UserError("distributed.strategy=fsdp with model.lora: a LoRA adapter is small enough to replicate; "
                        "use distributed.strategy=ddp")
    if d.sharded and t.precision == "fp16":
        raise UserError("distributed.strategy=fsdp with train.precision=fp16: loss scaling of sharded gradients "
                        "is not supported; use bf16")
    if d.sharded and t.offload:
        raise UserError("distributed.strategy=fsdp with train.offload: FSDP2 already spreads the optimizer state "
                        "over the ranks; turn offload off")


def placement(cfg: RLConfig, d: rdist.Dist, policy: LMPolicy, reward, data, prompts, start_step: int):
    """(reward, rollout source) for the run's placement: in this process, split over torchrun
    ranks, or on Ray actors; with rollout.engine=vllm a vLLM engine samples in this process."""
    if cfg.distributed.mode == "ray":
        from regen.ray_rollout import RayReward, RayRollouts

        return RayReward(cfg), RayRollouts(policy, data, prompts, cfg, start_step)
    engine = policy
    if cfg.rollout.engine == "vllm":
        from regen.vllm_engine import VLLMEngine

        engine = VLLMEngine(cfg, policy)
    return (ShardedReward(reward, d) if d.on else reward), LocalRollouts(engine, data, prompts, cfg, d)


def prepare_on_rank0(cfg: RLConfig, resume: bool, d: rdist.Dist) -> tuple[Path, bool]:
    """Rank 0 creates or checks the run directory; the others learn the outcome (or its error)."""
    outcome: tuple = (None, resume, None)
    if d.main:
        try:
            outcome = (*prepare(cfg.run.dir, cfg.run.overwrite, resume), None)
        except UserError as e:
            outcome = (None, resume, str(e))
    run_dir, resume, error = d.broadcast_object(outcome)
    if error is not None:
        raise UserError(error)
    return Path(run_dir), resume


def data_parallel(policy: LMPolicy, d: rdist.Dist) -> None:
    """Under torchrun: DDP around the trained model, or the model (and reference) sharded by FSDP2."""
    if not d.on:
        return
    policy.forward_model = d.wrap(policy.model)  # DDP's wrapper, or the model itself sharded in place
    if d.sharded:
        if policy.ref is not None:
            d.wrap(policy.ref, trainable=False)
        policy.all_done = lambda done: d.all_true(bool(done.all()))  # same forwards on every rank
