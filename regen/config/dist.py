"""Config of where the work runs (`distributed`): one process, torchrun data parallel, or Ray
actors for rollout and reward. The rest of the YAML is the same in every mode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from regen.config.base import Section


# The process group's settings, read by `regen train` (torchrun, a Ray trainer group) and the trainers without
# sampling (torchrun): `where` says when they act.
def _strategy(where: str, more: str = ""):
    return Field("ddp", description=f"{where}: 'ddp' replicates the model and all-reduces gradients; 'fsdp' shards "
                 "parameters, gradients and optimizer state (FSDP2 fully_shard) for models too big to replicate; "
                 "checkpoints and export/ are gathered into the single-process form." + more)


def _backend(where: str):
    return Field("auto", description=f"{where}: process-group backend; 'auto' = nccl on CUDA, gloo on CPU.")


def _timeout(where: str):
    return Field(1800.0, ge=1.0, description=f"{where}: seconds a collective waits for every rank before the run "
                 "fails (a rank that died or hangs). Long enough for rank 0's held-out evaluations and checkpoint "
                 "writes, which the other ranks wait out; shorter makes a lost node fail the job sooner.")


class DistributedConfig(Section):
    mode: Literal["auto", "single", "torchrun", "ray"] = Field(
        "auto", description="'single': one process. 'torchrun': data parallel over the processes torchrun started "
        "(sampling, scoring and the update split by groups). 'ray': the trainer here, rollout and reward workers as "
        "Ray actors; or, with trainer_workers > 1, a group of trainer actors that train like torchrun ranks. "
        "'auto': torchrun when started by torchrun, else single."
    )
    strategy: Literal["ddp", "fsdp"] = _strategy("torchrun and a Ray trainer group")
    backend: Literal["auto", "nccl", "gloo"] = _backend("torchrun and a Ray trainer group")
    timeout_s: float = _timeout("torchrun, a Ray trainer group and distributed.sync=collective")
    colocate: bool = Field(
        False, description="single and torchrun: sampling and training share each process's device, handing "
        "memory to each other between phases. Before sampling the optimizer state and the frozen copies go to CPU "
        "memory (as train.offload); before the update a vLLM engine (rollout.engine=vllm) sleeps (KV cache dropped, "
        "weights to CPU memory) and it wakes to take the new weights; each step logs memory/sample_peak_mb and "
        "memory/update_peak_mb (CUDA allocator peak on GPU, peak resident set on CPU; update = scoring, the fixed "
        "terms and the update). Costs the transfers each step; on a CPU-only run only the measuring acts."
    )
    ray_address: str | None = Field(
        None, description="ray: address of a running Ray cluster ('auto' = the one this node joined with "
        "`ray start`); null starts a private Ray on this machine."
    )
    trainer_workers: int = Field(
        1, ge=1, description="ray: trainer actors. 1: the trainer is the process you started, with rollout and "
        "reward actors. N > 1: N actors form one process group (distributed.strategy ddp or fsdp) placed by a Ray "
        "placement group, each scoring and training its share like a torchrun rank and sampling it too (or, with "
        "group_sampling=actors, rank 0's rollout actors sample; no reward actors); the process you started only "
        "places them, follows the run and restarts the group from the last checkpoint when an actor dies (up to "
        "max_restarts times)."
    )
    group_sampling: Literal["ranks", "actors"] = Field(
        "ranks", description="ray with trainer_workers > 1: who samples. 'ranks': each trainer actor samples its "
        "share like a torchrun rank. 'actors': rollout_workers rollout actors sample (for example vLLM engines on "
        "GPUs of their own); rank 0 drives them and hands every rank the batch, the group's weights (gathered "
        "under FSDP2) are synced to them after each update, and max_staleness acts, as with one trainer; rewards "
        "are still scored on the ranks."
    )
    trainer_resources: dict[str, float] = Field(
        default_factory=lambda: {"num_cpus": 1.0}, description="ray: resources of one trainer actor when "
        "trainer_workers > 1 (num_cpus, num_gpus, custom node labels); one GPU per actor on GPU clusters."
    )
    rollout_workers: int = Field(2, ge=1, description="ray: rollout actors; each samples a share of the groups.")
    reward_workers: int = Field(1, ge=1, description="ray: reward actors; each scores a share of the samples.")
    rollout_resources: dict[str, float] = Field(
        default_factory=lambda: {"num_cpus": 1.0}, description="ray: resources of one rollout actor "
        "(num_cpus, num_gpus, or custom resources such as a node label)."
    )
    reward_resources: dict[str, float] = Field(
        default_factory=lambda: {"num_cpus": 1.0}, description="ray: resources of one reward actor."
    )
    max_staleness: int = Field(
        0, ge=0, description="ray: most weight versions a rollout may lag behind the trainer. 0: every batch is "
        "sampled with the current weights. 1: the next batch is sampled while the trainer updates (one step "
        "off-policy); a batch staler than the bound is thrown away and sampled again. Flow models: 0 only."
    )
    max_restarts: int = Field(
        3, ge=0, description="ray: replacements of dead rollout / reward actors allowed per step before the run "
        "stops; with trainer_workers > 1, restarts of the trainer group (after an actor died) per run."
    )
    actor_threads: int = Field(1, ge=1, description="ray: torch threads of each actor on CPU.")
    sync: Literal["object_store", "collective"] = Field(
        "object_store", description="ray: how the weights reach the rollout actors after each update. "
        "'object_store': each bucket is put in Ray's object store once and every actor reads it (nothing to set up; "
        "on one node the actors read shared memory). 'collective': the trainer and its rollout actors form a "
        "process group of their own (NCCL when both are on GPUs, else gloo) and each bucket is broadcast straight "
        "into the actors' models, as verl and OpenRLHF sync their rollout engines: the path for GPU clusters. A "
        "sync that loses an actor replaces it and sends again over a new group; a replaced actor takes the "
        "current weights through the object store, then joins the group."
    )
    sync_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="ray: dtype of the weights sent to the rollout actors after each update. float32: "
        "exactly the trainer's (a Ray run samples what one process samples). bfloat16: half the bytes; the actors "
        "sample with the weights rounded to bf16 (the loss still uses the trainer's own log-probs)."
    )
    sync_changed_only: bool = Field(
        True, description="ray: send only the tensors whose value (after the cast to sync_dtype) differs from what "
        "the last sync sent: frozen parts (a VLM's vision tower, a frozen joint member) and, in bf16, weights an update "
        "moved less than bf16's resolution travel once. Exact (actors end with the weights a full sync gives); costs "
        "a copy of the synced weights, in sync_dtype, in the trainer's CPU memory. false: every tensor every sync."
    )
    sync_bucket_mb: float = Field(
        512.0, gt=0, description="ray: most MB of weights in one object-store object; an actor loads one bucket at "
        "a time, so it holds at most this much beside its model while it takes new weights."
    )


class OfflineDistributedConfig(Section):
    """distributed of `regen sft` and `regen rm`: one process, or data parallel under torchrun."""

    mode: Literal["auto", "single", "torchrun"] = Field(
        "auto", description="'single': one process. 'torchrun': data parallel over the processes torchrun started: "
        "each holds the whole model, takes its share of every batch, and the gradients are summed over the "
        "processes, so N processes train what one trains. 'auto': torchrun when started by torchrun, else single."
    )
    strategy: Literal["ddp", "fsdp"] = _strategy(
        "torchrun", " Here fsdp is for language and reward models without LoRA; a flow model's SFT and "
        "vision-language models are data parallel with ddp only.")
    backend: Literal["auto", "nccl", "gloo"] = _backend("torchrun")
    timeout_s: float = _timeout("torchrun")


def offline_unread(mode: str, given) -> list[str]:
    """Messages for the distributed.* keys a trainer without sampling would not read: the process group's
    settings outside torchrun."""
    out = []
    keys = ("distributed.mode", "distributed.strategy", "distributed.backend", "distributed.timeout_s")
    for key in sorted(k for k in given if k in keys):
        if key != "distributed.mode" and mode == "single":
            out.append(f"{key} is read only under torchrun (distributed.mode torchrun or auto)")
    return out
