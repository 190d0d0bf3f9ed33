"""LoRA (Hu et al. 2022) on a flow model's velocity network, through peft.

diffusers' UNet2DModel has no adapter API of its own, so the adapter is injected with
`peft.inject_adapter_in_model`, which works on any torch module (UNets, SD3, FLUX and Wan
transformers alike) and freezes everything but the LoRA matrices. Checkpoints then hold the
adapter alone (`lora.safetensors` + `lora.json`); the export folder holds the merged weights,
loadable without peft. The frozen reference of a KL term is the same network with its
adapters switched off: no second copy of the base.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from regen.errors import UserError

# Attention projections (SD3 / FLUX / Wan transformers, the UNet's mid-block attention) and the
# UNet's resnet convolutions and time-embedding projections; peft matches name suffixes and
# skips the ones a model lacks.
DEFAULT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "time_emb_proj"]
ADAPTER_FILE, ADAPTER_META = "lora.safetensors", "lora.json"


def add_lora(net: nn.Module, settings, seed: int, targets: list[str] | None = None) -> int:
    """Inject a fresh adapter (r, alpha, dropout, target_modules from model.lora; else `targets`,
    the model family's usual ones; else DEFAULT_TARGETS) into `net` in place; returns its
    parameter count. The random A matrices come from `seed` on a forked RNG, so the run's own
    random streams are untouched (B starts at 0: the model is unchanged)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise UserError("model.lora needs peft: pip install 'regen[lora]'") from None
    targets = settings.target_modules or targets or DEFAULT_TARGETS
    cfg = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=targets)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(cfg, net)
        except ValueError as e:  # no module matched
            raise UserError(f"model.lora.target_modules: {e}") from None
    return sum(p.numel() for n, p in net.named_parameters() if "lora_" in n)


def is_lora(net) -> bool:
    return any("lora_" in n for n, _ in net.named_parameters())


def trainable_state(net: nn.Module) -> dict[str, torch.Tensor]:
    """What training changes: the LoRA matrices when an adapter is in, else every weight."""
    sd = net.state_dict()
    return {k: v for k, v in sd.items() if "lora_" in k} if is_lora(net) else sd


def save_adapter(net: nn.Module, folder: Path, settings) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in trainable_state(net).items()}, str(folder / ADAPTER_FILE))
    (folder / ADAPTER_META).write_text(json.dumps(settings.model_dump(mode="json"), indent=1))


def load_adapter(net: nn.Module, folder: Path) -> None:
    """Put a saved adapter into `net` (which already has one injected with the same settings)."""
    file = folder / ADAPTER_FILE
    if not file.is_file():
        raise UserError(f"{folder}: no {ADAPTER_FILE} (a LoRA checkpoint holds the adapter only; was this run "
                        "trained without model.lora?)")
    load_state(net, load_file(str(file)), str(file))


def load_state(net: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load `trainable_state`-shaped tensors into `net`; a missing or extra tensor is an error
    naming the file (a checkpoint of another model or of other LoRA settings)."""
    want = set(trainable_state(net))
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise UserError(f"{where}: does not fit the model (missing {missing[:3]}, unexpected {extra[:3]}); "
                        "was it written with other model or model.lora settings?")
    net.load_state_dict(state, strict=False)


@contextlib.contextmanager
def adapters_off(net: nn.Module):
    """Run `net` as its base model (LoRA layers bypassed) inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in net.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield net
    finally:
        for m in layers:
            m.enable_adapters(True)


class BaseView:
    """Callable like the network, computing the base model's output (the KL reference of a
    LoRA run) with the shared weights."""

    def __init__(self, net: nn.Module):
        self.net = net

    def __call__(self, *args, **kwargs):
        with adapters_off(self.net):
            return self.net(*args, **kwargs)


def merged(net: nn.Module) -> nn.Module:
    """A plain copy of `net` with the adapter folded into the weights (W + alpha/r B A): same
    class and config, loadable with from_pretrained without peft."""
    from peft.tuners.lora import LoraLayer

    work = copy.deepcopy(net)
    for m in work.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    state = {k.replace(".base_layer", ""): v for k, v in work.state_dict().items() if "lora_" not in k}
    plain = type(net).from_config(net.config)
    plain.load_state_dict(state)
    return plain.to(next(net.parameters()).device)


@contextlib.contextmanager
def swapped(policy, net: nn.Module):
    """Use another velocity network (the weight EMA, a merged copy) in `policy` inside the block."""
    saved = policy.unet
    policy.unet = net
    try:
        yield policy
    finally:
        policy.unet = saved
