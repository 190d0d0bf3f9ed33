"""Qwen-Image as a regen flow policy: `QwenImageTransformer2DModel` (an MMDiT with 3-D rotary
positions over image and text tokens; Qwen team 2025) is the velocity network over the latents of
`AutoencoderKLQwenImage` (a Wan-style causal 3-D VAE run on single frames), conditioned on a
Qwen2.5-VL language model's last hidden states.

Mirrors diffusers' `QwenImagePipeline` (pipelines/qwenimage/pipeline_qwenimage.py):
- the condition: each prompt wrapped in the pipeline's chat template (a system turn asking to
  describe the image, the prompt as the user turn), the text encoder's last hidden states, the
  template's first 34 tokens dropped (`prompt_template_encode_start_idx`), each row cut to its
  own length and the batch zero-padded with a mask (`encoder_hidden_states_mask`);
- the latents: (C, h, w) noise drawn as the pipeline draws its (1, C, h, w) frame, packed into
  2x2 patches around each transformer call (as FLUX; `img_shapes` gives the rotary grid);
- the transformer gets timestep = sigma (it scales by 1000 itself);
- classifier-free guidance as the pipeline's `true_cfg_scale`: v = v_u + s (v_c - v_u), then each
  packed token rescaled to the norm of its conditional prediction (QwenImagePipeline's guidance
  renormalisation), the two halves in one batched forward (their texts padded to one length);
- the scheduler's resolution-dependent shift with its shift_terminal (flow.shift null);
- decoding: `latents / (1 / latents_std) + latents_mean`, then vae.decode of the single frame.

The trained part is the transformer; the text encoder and the VAE are frozen.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from regen.policies.flow_latent import PackedLatentPolicy, load_tokenizer, pack, unpack

# QwenImagePipeline's prompt template and the number of its tokens before the prompt
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
DROP = 34
TOKENIZER_MAX = 1024  # the pipeline's tokenizer_max_length


class QwenImageTextEncoder(nn.Module):
    """prompts -> (encoder_hidden_states (B, L, D), mask (B, L)), as QwenImagePipeline.encode_prompt
    with one image per prompt: L = the longest prompt's tokens after the template, at most
    max_sequence_length."""

    def __init__(self, text_encoder, tokenizer, max_sequence_length: int = 512):
        super().__init__()
        self.text_encoder, self.tokenizer, self.max_sequence_length = text_encoder, tokenizer, max_sequence_length

    @torch.no_grad()  # frozen: no graph through the text encoder
    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tokenizer([TEMPLATE.format(p) for p in prompts], max_length=TOKENIZER_MAX + DROP, padding=True,
                           truncation=True, return_tensors="pt")
        dev = self.text_encoder.device
        mask = t.attention_mask.to(dev)
        states = self.text_encoder(input_ids=t.input_ids.to(dev), attention_mask=mask,
                                   output_hidden_states=True).hidden_states[-1]
        rows = [s[m.bool()][DROP:] for s, m in zip(states, mask)]  # each row's own tokens, template dropped
        width = max(r.shape[0] for r in rows)
        out = torch.stack([F.pad(r, (0, 0, 0, width - r.shape[0])) for r in rows])[:, : self.max_sequence_length]
        keep = torch.stack([torch.arange(width, device=dev) < r.shape[0] for r in rows])[:, : self.max_sequence_length]
        return out, keep.long()


def pad_text(cond, width: int):
    states, mask = cond
    extra = width - states.shape[1]
    return F.pad(states, (0, 0, 0, extra)), F.pad(mask, (0, extra))


class QwenImageFlowPolicy(PackedLatentPolicy):
    KIND, TRANSFORMER, VAE = "qwen-image", "QwenImageTransformer2DModel", "AutoencoderKLQwenImage"
    PARTS = ("transformer", "vae", "text_encoder", "tokenizer")
    LAYOUT = "a Qwen-Image pipeline folder needs transformer/, vae/, text_encoder/ (Qwen2.5-VL), tokenizer/"
    UNUSED_PARAMETERS = True  # the last block's text-stream MLP and modulation never reach the image output

    @classmethod
    def vae_scale(cls, vae) -> int:
        return 2 ** len(vae.config.temperal_downsample)

    @classmethod
    def load_encoder(cls, folder: Path, dtype, meta: dict, transformer) -> QwenImageTextEncoder:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(str(folder / "text_encoder"), dtype=dtype)
        return QwenImageTextEncoder(model, load_tokenizer(folder / "tokenizer"), meta["max_sequence_length"])

    def pipeline(self):
        from diffusers import QwenImagePipeline

        return QwenImagePipeline(self.scheduler, self.vae, self.encoder.text_encoder, self.encoder.tokenizer, self.unet)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, unet=None) -> torch.Tensor:
        """v = d x / d sigma = eps - x0 on unpacked latents (B, C, h, w); cond = (states, mask)."""
        dt = self._dtype()
        states, mask = cond
        B, _, h, w = x.shape
        out = self._net(unet)(
            hidden_states=pack(x.to(dt)),
            timestep=sigma.to(dt),  # scaled by 1000 inside (the pipeline passes t / 1000)
            guidance=self.guidance(B, x.device),
            encoder_hidden_states=states.to(dt),
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * B,
        ).sample
        return unpack(out, h, w)

    def guided_velocity(self, x, sigma, cond, null, scale: float, unet=None) -> torch.Tensor:
        """QwenImagePipeline's true CFG: v_u + scale (v_c - v_u), each packed token rescaled to the
        norm of its conditional prediction; both halves in one forward."""
        if scale == 1.0:
            return self.velocity(x, sigma, cond, unet)
        v = self.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), self._cat_cond(cond, null), unet)
        vc, vu = (pack(t) for t in v.chunk(2))
        comb = vu + scale * (vc - vu)
        comb = comb * (vc.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        return unpack(comb, *x.shape[-2:])

    @staticmethod
    def _cat_cond(cond, null):
        """The conditional and the empty prompts' texts padded to one length (masked) and stacked."""
        width = max(cond[0].shape[1], null[0].shape[1])
        (cs, cm), (ns, nm) = pad_text(cond, width), pad_text(null, width)
        return torch.cat([cs, ns]), torch.cat([cm, nm])

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.vae.config
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return mean, 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels (B, 3, H, W) in [-1, 1]: the pipeline's un-normalisation, then the
        VAE's decoding of one frame."""
        z = x0.to(self.vae.dtype)[:, :, None]
        mean, inv_std = self._stats(z)
        return self.vae.decode(z / inv_std + mean).sample[:, :, 0].float().clamp(-1, 1)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] -> normalised latents (as QwenImageImg2ImgPipeline); the
        posterior mean, so the loss depends on the generator alone."""
        z = self.vae.encode(pixels.to(self.vae.dtype)[:, :, None]).latent_dist.mode()
        mean, inv_std = self._stats(z)
        return ((z - mean) * inv_std)[:, :, 0]


def qwenimage_scheduler():
    """Qwen-Image's scheduler (Qwen/Qwen-Image scheduler/scheduler_config.json): exponential
    resolution-dependent shift, mu from 0.5 at 256 tokens to 0.9 at 8192, stretched to end at 0.02."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def random_qwenimage(folder, seed: int, size: int, vae: tuple, latent: int, layers: int, heads: int, head_dim: int,
                     rope: tuple, text_width: int, text_layers: int) -> int:
    """Write a Qwen-Image pipeline folder of the given shape with random weights: the transformer,
    a Qwen-Image VAE (vae = (base width, *multipliers), scale 2 ** (len(multipliers) - 1)), a Qwen2.5-VL text
    encoder of text_width over a word-level tokenizer that splits the pipeline's template into
    exactly its 34 tokens (so the prompt's own tokens are what remain after them), Qwen-Image's
    scheduler. Returns the transformer's parameter count. Used by tiny_qwenimage and by
    bench/gpu_throughput.py."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    from regen.policies.flow_latent import TINY_WORDS
    from regen.tasks import tiny_vlms

    template = ["Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity", "text",
                "spatial", "relationships", "of", "objects", "and", "background", ",", ":"]
    enc, tok, _ = tiny_vlms.build("qwen2_5_vl", sorted(set(TINY_WORDS) | set(template)), seed, hidden=text_width,
                                  layers=text_layers, apart=",:")
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * latent, out_channels=latent, num_layers=layers, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=text_width, axes_dims_rope=tuple(rope))
    levels = len(vae) - 2  # downsampling stages: the first spatial only, the others also in time (as Qwen-Image's)
    autoencoder = AutoencoderKLQwenImage(  # spatial scale 2 ** levels; its own latent statistics
        base_dim=vae[0], z_dim=latent, dim_mult=list(vae[1:]), num_res_blocks=1,
        temperal_downsample=[False] + [True] * (levels - 1),
        latents_mean=[(-1) ** i * 0.1 * (i % 4) for i in range(latent)],
        latents_std=[1.0 + 0.25 * (i % 5) for i in range(latent)])
    policy = QwenImageFlowPolicy(transformer, QwenImageTextEncoder(enc.eval(), tok, 512), autoencoder,
                                 qwenimage_scheduler(), {"height": size, "width": size}, torch.device("cpu"))
    policy.save_pretrained(Path(folder))
    return sum(p.numel() for p in transformer.parameters())


# The tiny shape: 16x16 pixels -> 4x8x8 latents (VAE scale 2) -> 16 packed tokens, one transformer
# block, head dim 8 split (2, 2, 4) over the rotary axes, a two-layer width-32 Qwen2.5-VL.
TINY = dict(size=16, vae=(8, 1, 1), latent=4, layers=1, heads=2, head_dim=8, rope=(2, 2, 4), text_width=32,
            text_layers=2)


def tiny_qwenimage(folder, seed: int = 0, size: int = 16) -> Path:
    """A complete Qwen-Image folder with tiny random weights (TINY), to try regen on and for tests."""
    random_qwenimage(folder, seed, **{**TINY, "size": size})
    return Path(folder)
