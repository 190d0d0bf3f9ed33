"""What the diffusers latent flow policies (SD3, FLUX and Qwen-Image images in `flow_sd3`,
`flow_flux`, `flow_qwenimage`; Wan and HunyuanVideo videos in `flow_wan`, `flow_hunyuan`) share:
a diffusers transformer as the velocity network, frozen text encoders as the prompt conditioner,
a frozen VAE between latents and pixels, and a pipeline-shaped folder.

The sampling code (`sample_ode`, `rollout`, `step_logprobs`) is FlowPolicy's, unchanged: the
samplers only need v(x_sigma, sigma, cond) with regen's convention x_sigma = (1 - sigma) x0 +
sigma eps, v = eps - x0, which is what these transformers predict when given their timestep
(1000 sigma, or sigma for FLUX and Qwen-Image, which scale it themselves; diffusers'
FlowMatchEulerDiscreteScheduler: timesteps = sigmas * 1000). Each family's `sigmas` is the grid
its own scheduler gives its pipeline, so the plain pipeline samples an export into regen's image.

On disk a policy is a diffusers pipeline folder (model_index.json, transformer/, vae/,
text_encoder*/, tokenizer*/, scheduler/, written by the pipeline's own save_pretrained, so
diffusers loads it as is) plus `flow_policy.json`: kind, pixel size, text length, and the
latent sample shape. A pipeline folder without flow_policy.json loads with the pipeline's
default size; a flow_policy.json holding only {"kind": ..., "height": ..., "width": ...}
picks another.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from regen.config.model import PIPELINES, model_kind  # noqa: F401  (re-exported)
from regen.config.model import read_json as _json
from regen.errors import UserError
from regen.policies.flow import FlowPolicy

# LoRA targets of the dual-stream transformers (FLUX, Qwen-Image, HunyuanVideo): the joint
# attention's image- and text-stream projections, the layers the public LoRA recipes for these
# models (flow_grpo, DanceGRPO) adapt
JOINT_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): 2x2 latent patches as tokens, channel-major within a
    token (FluxPipeline / QwenImagePipeline `_pack_latents`)."""
    B, C, h, w = x.shape
    return x.view(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (h // 2) * (w // 2), C * 4)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, 4C) -> (B, C, h, w): the inverse of `pack` (the pipelines' `_unpack_latents`)."""
    B, _, c4 = x.shape
    return x.view(B, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, c4 // 4, h, w)


def policy_class(kind: str) -> type[FlowPolicy]:
    if kind == "flux":
        from regen.policies.flow_flux import FluxFlowPolicy

        return FluxFlowPolicy
    if kind == "hunyuan-video":
        from regen.policies.flow_hunyuan import HunyuanVideoFlowPolicy

        return HunyuanVideoFlowPolicy
    if kind == "qwen-image":
        from regen.policies.flow_qwenimage import QwenImageFlowPolicy

        return QwenImageFlowPolicy
    if kind == "sd3":
        from regen.policies.flow_sd3 import SD3FlowPolicy

        return SD3FlowPolicy
    if kind == "wan":
        from regen.policies.flow_wan import WanFlowPolicy

        return WanFlowPolicy
    return FlowPolicy


def resolution_mu(seq_len: int, cfg) -> float:
    """mu of the resolution-dependent shift (Esser et al. 2024, SD3 sec. 5.3.2; FLUX.1): linear
    in the image's token count from base_shift at base_image_seq_len to max_shift at
    max_image_seq_len; the shifted sigma is exp(mu) / (exp(mu) + 1 / sigma - 1)."""
    base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
    base, top = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
    return base + (top - base) * (seq_len - base_len) / (max_len - base_len)


def own_sigmas(scheduler, steps: int, seq_len: int, linspace: bool) -> torch.Tensor:
    """(steps + 1,) sigmas of a model's own FlowMatchEulerDiscreteScheduler, as its pipeline asks
    for them (every shift option the scheduler has: fixed, resolution-dependent from `seq_len`,
    shift_terminal): linspace=True as FluxPipeline (`sigmas=linspace(1, 1/steps, steps)`), False
    as StableDiffusion3Pipeline and WanPipeline (`set_timesteps(steps)`). Another scheduler
    class (Wan 2.1's UniPC) is a multistep solver regen does not reproduce: its flow_shift /
    shift in regen's grid."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    from regen.samplers.flow import sigma_schedule

    cfg = scheduler.config
    if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return sigma_schedule(steps, float(cfg.get("flow_shift") or cfg.get("shift") or 1.0))
    own = FlowMatchEulerDiscreteScheduler.from_config(cfg)  # a copy: set_timesteps keeps state
    mu = resolution_mu(seq_len, cfg) if cfg.get("use_dynamic_shifting") else None
    if linspace:
        own.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), mu=mu)
    else:
        own.set_timesteps(steps, mu=mu)
    return own.sigmas.float().cpu()


def load_text_model(folder: Path, default: str, dtype: torch.dtype):
    """A transformers text encoder saved with save_pretrained, as the class its config names
    (T5EncoderModel or UMT5EncoderModel, ...), else `default`."""
    import transformers

    arch = (_json(folder / "config.json").get("architectures") or [default])[0]
    return getattr(transformers, arch, getattr(transformers, default)).from_pretrained(str(folder), dtype=dtype)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def check_size(what: str, value: int, multiple: int, folder) -> None:
    if value <= 0 or value % multiple:
        raise UserError(
            f"model.path: '{folder}' flow_policy.json {what}={value} must be a positive multiple of {multiple} "
            f"(VAE scale x patch size)"
        )


class LatentFlowPolicy(FlowPolicy):
    """A FlowPolicy over VAE latents. `self.unet` is the diffusers transformer (the only
    trained part: `parameters()`), `self.encoder` the frozen prompt conditioner, `self.vae`
    the frozen VAE. Subclasses give the classes, the layout and five methods: complete (the
    meta: sizes and sample shape), load_encoder, pipeline, velocity, decode / encode."""

    KIND = TRANSFORMER = VAE = LAYOUT = ""  # the kind and the diffusers class names
    SCHEDULER = "FlowMatchEulerDiscreteScheduler"  # written when the source folder had none
    PARTS: tuple[str, ...] = ()  # required subfolders
    LINSPACE = False  # the pipeline passes sigmas=linspace(1, 1/n, n) to its scheduler (FLUX) or not
    DEFAULT_GUIDANCE = 3.5  # guidance-distilled models: FluxPipeline's guidance_scale, FLUX.1-dev's value

    def __init__(self, transformer, encoder, vae, scheduler, meta: dict, device: torch.device):
        meta = self.complete(meta, transformer, vae)
        # frozen as in Flow-GRPO / DiffusionNFT; eval() also keeps T5's dropout off, so the
        # condition is a function of the prompt alone (re-scoring must see what sampling saw)
        encoder.requires_grad_(False).eval()
        super().__init__(transformer, encoder, tuple(meta["sample_shape"]), device, self.KIND)
        self.vae = vae.to(device).eval().requires_grad_(False)
        self.scheduler = scheduler  # regen samples with its own samplers on the grid it gives (sigmas)
        self.meta = meta
        self.guidance_embed = meta.get("guidance_embed")  # guidance-distilled transformers only (FLUX.1-dev)

    # ---------------------------------------------------------------- guidance-distilled models

    @classmethod
    def guidance_meta(cls, meta: dict, transformer, folder) -> float | None:
        """The embedded guidance value of a transformer with `guidance_embeds` (flow_policy.json's,
        else the family's DEFAULT_GUIDANCE); None for the others."""
        has = bool(getattr(transformer.config, "guidance_embeds", False))
        g = meta.get("guidance_embed", cls.DEFAULT_GUIDANCE if has else None)
        if (g is not None) != has:
            raise UserError(f"model.path: '{folder}' flow_policy.json guidance_embed={g}, but its transformer "
                            f"{'has' if has else 'has no'} guidance embedding")
        return g

    def set_guidance_embed(self, value: float | None) -> None:
        """flow.guidance_embed: the value given to the transformer's guidance embedding (kept in
        flow_policy.json, so an export samples as it was trained)."""
        if value is not None and self.guidance_embed is None:
            super().set_guidance_embed(value)  # refused: no embedding
        if value is not None:
            self.guidance_embed = self.meta["guidance_embed"] = float(value)

    def guidance(self, batch: int, device) -> torch.Tensor | None:
        """The transformer's `guidance` input: (B,) float32 (it scales by 1000 itself), or None."""
        return None if self.guidance_embed is None else torch.full((batch,), self.guidance_embed, device=device)

    @classmethod
    def load(cls, folder, device: torch.device, dtype: torch.dtype = torch.float32) -> LatentFlowPolicy:
        import diffusers

        p = Path(folder).expanduser()
        missing = [s + "/" for s in cls.PARTS if not (p / s).is_dir()]
        if missing:
            raise UserError(f"model.path: '{folder}' has no {', '.join(missing)} ({cls.LAYOUT})")
        meta = _json(p / "flow_policy.json") if (p / "flow_policy.json").is_file() else {}
        transformer = getattr(diffusers, cls.TRANSFORMER).from_pretrained(str(p / "transformer"), torch_dtype=dtype)
        vae = getattr(diffusers, cls.VAE).from_pretrained(str(p / "vae"), torch_dtype=dtype)
        meta = cls.complete(meta, transformer, vae, p)
        sched = p / "scheduler" / "scheduler_config.json"
        name = _json(sched).get("_class_name", cls.SCHEDULER) if sched.is_file() else cls.SCHEDULER
        scheduler_cls = getattr(diffusers, name, getattr(diffusers, cls.SCHEDULER))
        scheduler = scheduler_cls.from_pretrained(str(sched.parent)) if sched.is_file() else scheduler_cls()
        return cls(transformer, cls.load_encoder(p, dtype, meta, transformer), vae, scheduler, meta, device)

    def save_pretrained(self, folder: Path) -> None:
        """The pipeline's own save_pretrained (a folder diffusers loads as is) + flow_policy.json."""
        folder = Path(folder)
        self.pipeline().save_pretrained(str(folder), safe_serialization=True)
        (folder / "flow_policy.json").write_text(json.dumps({**self.meta, "kind": self.kind}, indent=1))

    def export(self, folder: Path) -> None:  # the checkpoint form is already the diffusers form
        self.save_pretrained(folder)

    def parameters(self):
        return list(self.unet.parameters())

    def seq_len(self) -> int:
        """Image tokens the transformer sees (patches of the latent), from which a scheduler with
        `use_dynamic_shifting` computes its shift (FluxPipeline / StableDiffusion3Pipeline's
        image_seq_len)."""
        p = self.unet.config.patch_size
        ph, pw = (p, p) if isinstance(p, int) else tuple(p)[-2:]
        return (self.sample_shape[-2] // ph) * (self.sample_shape[-1] // pw)

    def sigmas(self, steps: int, shift: float | None) -> torch.Tensor:
        """flow.shift null: the grid the model's own scheduler gives its diffusers pipeline (see
        own_sigmas), so that an export sampled with the plain pipeline is what regen sampled."""
        if shift is not None:
            return super().sigmas(steps, shift)
        return own_sigmas(self.scheduler, steps, self.seq_len(), self.LINSPACE)

    def train(self, mode: bool = True) -> None:
        self.unet.train(mode)  # text encoders and VAE stay in eval mode: frozen

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        return x  # latents have no fixed range; decode clamps the pixels

    def _dtype(self) -> torch.dtype:
        # of the policy's own network: `unet=` may be a callable view (LoRA's base) without one
        return next(self.unet.parameters()).dtype

    def flow_matching_loss(
        self, x0: torch.Tensor, prompts: list[str], gen: torch.Generator, cond_dropout: float = 0.1,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x0 in pixel space, as regen's SFT loop draws it ((B, 3, H, W) images, (B, F, 3, H, W)
        videos, [-1, 1]): encoded with the frozen VAE, then FlowPolicy's rectified-flow loss on
        the latents, the space SD3 and Wan were trained in (rows: as FlowPolicy's)."""
        with torch.no_grad():
            z = self.encode(x0.to(self.device))
        return super().flow_matching_loss(z, prompts, gen, cond_dropout, rows=rows)


class PackedLatentPolicy(LatentFlowPolicy):
    """Families whose transformer reads 2x2 latent patches packed as tokens (FLUX, Qwen-Image):
    the sample is the unpacked (C, h, w) latent image, packed around each transformer call."""

    LINSPACE = True  # their pipelines: sigmas = linspace(1, 1/n, n), shifted by the scheduler
    LORA_TARGETS = JOINT_ATTENTION

    @classmethod
    def vae_scale(cls, vae) -> int:
        """The pipeline's vae_scale_factor."""
        raise NotImplementedError

    @classmethod
    def complete(cls, meta: dict, transformer, vae, folder="") -> dict:
        """Pixel size (default the pipelines': 128 x the VAE scale), text length (default 512),
        the embedded guidance (guidance-distilled transformers only) and the unpacked latent
        sample shape (in_channels / 4, H / scale, W / scale)."""
        scale = cls.vae_scale(vae)
        h, w = int(meta.get("height", 128 * scale)), int(meta.get("width", 128 * scale))
        for what, v in (("height", h), ("width", w)):
            check_size(what, v, scale * 2, folder)  # 2x2 packing of the latents
        return {**meta, "kind": cls.KIND, "height": h, "width": w,
                "max_sequence_length": int(meta.get("max_sequence_length", 512)),
                "guidance_embed": cls.guidance_meta(meta, transformer, folder),
                "sample_shape": [transformer.config.in_channels // 4, h // scale, w // scale]}

    def seq_len(self) -> int:
        _, h, w = self.sample_shape
        return (h // 2) * (w // 2)  # the packed tokens the resolution-dependent shift is computed from


# ---------------------------------------------------------------- tiny tokenizers, built locally

TINY_WORDS = [
    "a",
    "an",
    "at",
    "the",
    "of",
    "moving",
    "red",
    "green",
    "blue",
    "yellow",
    "white",
    "circle",
    "square",
    "triangle",
    "left",
    "right",
    "top",
    "bottom",
    "centre",
    "up",
    "down",
    "cat",
    "dog",
    "photo",
]


def tiny_clip_tokenizer(max_length: int):
    """A CLIP byte-pair tokenizer over lowercase letters with merges that make TINY_WORDS whole
    tokens, loaded from vocab.json + merges.txt as a real one is."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    merges: list[str] = []
    for w in TINY_WORDS:
        parts = [*w[:-1], w[-1] + "</w>"]
        cur = parts[0]
        for nxt in parts[1:]:
            if f"{cur} {nxt}" not in merges:
                merges.append(f"{cur} {nxt}")
            cur += nxt
            vocab.setdefault(cur, len(vocab))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "vocab.json").write_text(json.dumps(vocab))
        (Path(d) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        return CLIPTokenizer.from_pretrained(d, model_max_length=max_length)


def tiny_t5_tokenizer(max_length: int):
    """A T5 (unigram) tokenizer with T5's ids (pad 0, </s> 1 appended, unk 2): TINY_WORDS as
    whole pieces, single letters for the rest. Built from a vocabulary list: no sentencepiece."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in TINY_WORDS] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)
