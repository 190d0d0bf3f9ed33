"""The flow modality's models besides the trained network's forward passes: building the policy
to train (from the starting model or a checkpoint, with LoRA), and its frozen copies (NFT's
old policy, the weight EMA), which follow the weights and are saved in checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file

from regen.policies.flow import FlowPolicy
from regen.policies.flow_load import load_flow_policy
from regen.policies.flow_lora import add_lora, load_adapter, load_state
from regen.runtime import checkpoint as ckpt
from regen.runtime.dist import Dist


def build_policy(cfg, device: torch.device, model_dir: Path | None = None) -> FlowPolicy:
    """The policy to train: the starting model, or a checkpoint's model/ (resume, rollback);
    with model.lora, the starting model plus a fresh adapter or the checkpoint's."""
    lora = cfg.model.lora
    source = cfg.model if model_dir is None or lora is not None else ckpt.resumed_model(cfg.model, {"model_dir": model_dir})
    policy = load_flow_policy(source, cfg.run.seed, device)
    policy.set_guidance_embed(cfg.flow.guidance_embed)
    if lora is not None:
        add_lora(policy.unet, lora, cfg.run.seed, getattr(policy, "LORA_TARGETS", None))
        if model_dir is not None:
            load_adapter(policy.unet, model_dir)
    # RL trains the velocity model only; the prompt encoder stays as pretrained, as text
    # encoders do in Flow-GRPO / DiffusionNFT. A moving encoder would also move NFT's
    # "old" policy (the EMA UNet reads the same prompt vectors).
    policy.encoder.requires_grad_(False)
    return policy


def frozen_copy(net: torch.nn.Module, folder: Path | None, name: str, alerts) -> torch.nn.Module:
    """A frozen copy of `net` (NFT's old policy, the weight EMA), with the trained tensors saved
    as `name` in checkpoint `folder` when given; a checkpoint without them starts a new copy."""
    out = copy.deepcopy(net).eval().requires_grad_(False)
    if folder is not None:
        reload_copy(out, net, folder, name, alerts)
    return out


def reload_copy(out: torch.nn.Module, net: torch.nn.Module, folder: Path | None, name: str, alerts,
                d: Dist | None = None) -> None:
    """Set the copy `out` from checkpoint `folder`'s `name`, or, without it, to `net`'s weights
    (d: under FSDP2 both are sharded, and a saved file holds the full tensors)."""
    d = d or Dist()
    file = None if folder is None else folder / name
    if file is not None and file.is_file():
        state = load_file(str(file))
        if d.sharded:
            d.load_model_state(out, state)
        else:
            load_state(out, state, str(file))
        return
    if folder is not None and alerts is not None:
        alerts.fire(-1, "checkpoint_incomplete", f"{folder.name} holds no {name}: it starts from the current weights")
    out.load_state_dict(net.state_dict())


def trained_pairs(copy_net: torch.nn.Module, net: torch.nn.Module) -> tuple[list, list]:
    """The copy's and the network's parameters that training changes, in the same order."""
    names = {n for n, p in net.named_parameters() if p.requires_grad}
    return ([p for n, p in copy_net.named_parameters() if n in names], [p for n, p in net.named_parameters() if n in names])


def plain_copy(net: torch.nn.Module, weights: dict | None) -> torch.nn.Module:
    """`net` itself, or (weights gathered from FSDP2 shards) an unsharded module of its class with them."""
    if weights is None:
        return net
    # built on the meta device and given the gathered tensors themselves: no third full copy of the
    # weights on rank 0 beside the shards and the gathered state (the rehearsal's 0.6B flow model ran
    # out of memory there), and no random initialisation to throw away
    with torch.device("meta"):
        plain = type(net).from_config(net.config)
    plain.load_state_dict(weights, assign=True)
    if any(t.is_meta for t in [*plain.parameters(), *plain.buffers()]):  # a buffer the state dict lacks
        plain = type(net).from_config(net.config)
        plain.load_state_dict(weights)
    return plain
