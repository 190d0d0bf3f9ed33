"""The combinations of model, method and placement that are refused, before anything is
written: which loop trains this model with this method, and what torchrun, FSDP2, Ray and
vLLM support."""

from __future__ import annotations

from regen.config import RLConfig
from regen.config.registry import METHODS
from regen.errors import UserError
from regen.runtime import dist as rdist


def check_split(cfg: RLConfig, d: rdist.Dist) -> None:
    """Under torchrun (or in a Ray trainer group) the groups of a step and the rows of a minibatch
    must split evenly over the ranks."""
    G, mb, W = cfg.prompts_per_step, cfg.train.global_minibatch_size, d.world
    where = f"over {W} trainer processes" if cfg.distributed.mode == "ray" else f"under torchrun with {W} processes"
    if G % W:
        raise UserError(f"rollout.global_batch_size / group_size = {G} prompts per step cannot be split evenly "
                        f"{where}: make it a multiple of {W}")
    if mb % W:
        raise UserError(f"train.global_minibatch_size={mb} cannot be split evenly {where}")


def which_loop(cfg: RLConfig) -> str:
    """'online' or 'dpo': how this model is trained with this algorithm, or a clear error when
    the model and the method's modality do not go together."""
    from regen.policies.flow_load import is_flow_model

    if cfg.models:  # a joint run: each model with its method, in one process
        for name, member in cfg.members.items():
            try:
                which_loop(member)
            except UserError as e:
                raise UserError(f"models.{name}: {e}") from None
        d = cfg.distributed
        if d.mode == "ray" and d.trainer_workers == 1:
            raise UserError("distributed.mode=ray with models: a joint run trains in one process, under torchrun or "
                            "in a Ray trainer group (distributed.trainer_workers > 1); rollout and reward actors for "
                            "joint runs are not supported yet")
        spread = d.mode in ("torchrun", "ray") or (d.mode == "auto" and rdist.launched_by_torchrun())
        if spread and d.strategy == "fsdp":
            raise UserError("distributed.strategy=fsdp with models: a joint run is data parallel with DDP only "
                            "(each model replicated); use distributed.strategy=ddp")
        return "online"
    flow_algo, flow_model = cfg.modality == "flow", is_flow_model(cfg.model)
    model = cfg.model.path or cfg.model.init
    if flow_algo and not flow_model:
        raise UserError(f"algorithm.name={cfg.algorithm.name} trains flow-matching image/video models; model "
                        f"'{model}' is a language model (use {_of('lm')})")
    if flow_model and not flow_algo:
        raise UserError(f"model '{model}' is a flow-matching model: use algorithm.name {_of('flow')}, not "
                        f"{cfg.algorithm.name}")
    offline = not METHODS[cfg.algorithm.name].online
    if offline and cfg.distributed.mode == "ray":
        raise UserError(f"distributed.mode=ray: {cfg.algorithm.name} runs in one process or under torchrun "
                        "(distributed.mode single, torchrun or auto)")
    return cfg.algorithm.name if offline else "online"


def _of(modality: str) -> str:
    """'grpo, ppo, gspo or dpo': the methods of a modality, for a message."""
    names = [n for n, m in METHODS.items() if m.modality == modality]
    return ", ".join(names[:-1]) + " or " + names[-1]


def check_placement(cfg: RLConfig, d: rdist.Dist) -> None:
    """Refuse combinations that are not supported, before anything is written."""
    t = cfg.train
    if cfg.rollout.engine == "vllm":
        check_vllm(cfg, d)
    if not d.on:
        return
    check_split(cfg, d)
    for name, member in cfg.members.items() if cfg.models else ():  # each model's minibatches split too
        try:
            check_split(member, d)
        except UserError as e:
            raise UserError(f"models.{name}: {e}") from None
    if d.sharded and cfg.model.lora is not None:
        raise UserError("distributed.strategy=fsdp with model.lora: a LoRA adapter is small enough to replicate; "
                        "use distributed.strategy=ddp")
    if d.sharded and t.precision == "fp16":
        raise UserError("distributed.strategy=fsdp with train.precision=fp16: loss scaling of sharded gradients "
                        "is not supported; use bf16")
    if d.sharded and cfg.distributed.colocate:
        raise UserError("distributed.colocate with distributed.strategy=fsdp: not supported yet (parking sharded "
                        "optimizer state is not built); use strategy=ddp, or colocate without torchrun")
    if d.sharded and t.offload:
        raise UserError("distributed.strategy=fsdp with train.offload: FSDP2 already spreads the optimizer state "
                        "over the ranks; turn offload off")


def check_vllm(cfg: RLConfig, d: rdist.Dist) -> None:
    """Where a vLLM engine can sample: in one process, or on each Ray rollout actor."""
    dc, tp = cfg.distributed, cfg.rollout.vllm_tensor_parallel
    actors = dc.mode == "ray" and (dc.trainer_workers == 1 or dc.group_sampling == "actors")
    if (d.on or dc.trainer_workers > 1) and not actors:  # the driver of a trainer group checks too
        where = "on the ranks of a Ray trainer group" if dc.mode == "ray" else "under torchrun"
        raise UserError(f"rollout.engine=vllm {where}: not supported yet; run vllm in one process, or on Ray "
                        "rollout actors (distributed.mode=ray with trainer_workers=1, or a trainer group with "
                        "group_sampling=actors)")
    if not actors:
        return
    if dc.max_staleness > 0:
        raise UserError(f"rollout.engine=vllm on Ray rollout actors with distributed.max_staleness={dc.max_staleness}: "
                        "a late batch needs the sampling weights' log-probs, and vLLM's come from its own kernels, not "
                        "the trained model's (not built); use max_staleness: 0")
    gpus = dc.rollout_resources.get("num_gpus", 0)
    if tp > 1 and gpus < tp:
        raise UserError(f"rollout.vllm_tensor_parallel={tp}: each Ray rollout actor's engine needs {tp} GPUs, but "
                        f"distributed.rollout_resources.num_gpus is {gpus:g}; set it to {tp}")
