"""FLUX.1 as a regen flow policy: `FluxTransformer2DModel` (MMDiT double-stream blocks, then
single-stream blocks; Black Forest Labs 2024) is the velocity network over `AutoencoderKL`
latents, conditioned on a T5 encoder's states and a CLIP text model's pooled output.

Mirrors diffusers' `FluxPipeline` (pipelines/flux/pipeline_flux.py):
- the condition: `_get_clip_prompt_embeds` (pooler_output of the CLIP padded to its tokenizer's
  length) and `_get_t5_prompt_embeds` (T5 states, max_sequence_length tokens), text ids zero;
- the latents: (C, h, w) noise drawn unpacked, then packed into 2x2 patches (`_pack_latents`:
  (B, C, h, w) -> (B, h/2 * w/2, 4C)) with image ids (0, row, col) as rotary positions. regen
  keeps x in the unpacked layout (so rewards, decoding and the samplers see a plain latent
  image) and packs only around the transformer call: packing is a permutation, so the Gaussian
  log-probs of the SDE steps are the same in either layout;
- the transformer gets timestep = sigma (it multiplies by 1000 itself) and, for guidance-
  distilled ("dev") checkpoints, `guidance` = the embedded guidance value (also x1000 inside).
  "schnell" checkpoints have no guidance embedding. Classifier-free guidance (the pipeline's
  `true_cfg_scale` with an empty negative prompt) is flow.guidance, as for every model;
- decoding: `latents / scaling_factor + shift_factor`, then vae.decode.

The trained part is the transformer; text encoders and VAE are frozen.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from regen.policies.flow_latent import (  # noqa: F401  (pack, unpack: re-exported)
    PackedLatentPolicy,
    load_text_model,
    load_tokenizer,
    pack,
    tiny_clip_tokenizer,
    tiny_t5_tokenizer,
    unpack,
)


class FluxTextEncoder(nn.Module):
    """prompts -> (encoder_hidden_states (B, L, D) from T5, pooled_projections (B, P) from CLIP),
    as `FluxPipeline.encode_prompt` with prompt_2 = prompt and one image per prompt."""

    def __init__(self, text_encoder, tokenizer, text_encoder_2, tokenizer_2, max_sequence_length: int = 512):
        super().__init__()
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.max_sequence_length = max_sequence_length

    @torch.no_grad()  # frozen: no graph through the text encoders
    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        pooled = self.text_encoder(ids.to(self.text_encoder.device), output_hidden_states=False).pooler_output
        ids = self.tokenizer_2(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               return_tensors="pt").input_ids
        states = self.text_encoder_2(ids.to(self.text_encoder_2.device), output_hidden_states=False)[0]
        return states, pooled.to(states.dtype)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """(h/2 * w/2, 3) rotary positions of the packed tokens: (0, row, col), FluxPipeline's
    `_prepare_latent_image_ids`."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class FluxFlowPolicy(PackedLatentPolicy):
    KIND, TRANSFORMER, VAE = "flux", "FluxTransformer2DModel", "AutoencoderKL"
    PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    LAYOUT = "a FLUX pipeline folder needs transformer/, vae/, text_encoder/ (CLIP), text_encoder_2/ (T5), " \
             "tokenizer/, tokenizer_2/"

    @classmethod
    def vae_scale(cls, vae) -> int:
        return 2 ** (len(vae.config.block_out_channels) - 1)

    @classmethod
    def load_encoder(cls, folder: Path, dtype, meta: dict, transformer) -> FluxTextEncoder:
        return FluxTextEncoder(
            load_text_model(folder / "text_encoder", "CLIPTextModel", dtype), load_tokenizer(folder / "tokenizer"),
            load_text_model(folder / "text_encoder_2", "T5EncoderModel", dtype), load_tokenizer(folder / "tokenizer_2"),
            meta["max_sequence_length"],
        )

    def pipeline(self):
        from diffusers import FluxPipeline

        e = self.encoder
        return FluxPipeline(self.scheduler, self.vae, e.text_encoder, e.tokenizer, e.text_encoder_2, e.tokenizer_2,
                            self.unet)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, unet=None) -> torch.Tensor:
        """v = d x / d sigma = eps - x0 on unpacked latents (B, C, h, w); cond = (states, pooled)."""
        dt = self._dtype()
        states, pooled = cond
        B, _, h, w = x.shape
        out = self._net(unet)(
            hidden_states=pack(x.to(dt)),
            timestep=sigma.to(dt),  # FLUX scales by 1000 itself (the pipeline passes t / 1000)
            guidance=self.guidance(B, x.device),
            pooled_projections=pooled.to(dt),
            encoder_hidden_states=states.to(dt),
            txt_ids=torch.zeros(states.shape[1], 3, device=x.device, dtype=dt),
            img_ids=image_ids(h, w, x.device, dt),
        ).sample
        return unpack(out, h, w)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels (B, 3, H, W) in [-1, 1], the pipeline's unscaling then vae.decode."""
        c = self.vae.config
        z = x0.to(self.vae.dtype) / c.scaling_factor + (c.shift_factor or 0.0)
        return self.vae.decode(z).sample.float().clamp(-1, 1)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] -> latents, the inverse scaling (as FluxImg2ImgPipeline);
        the posterior mean, so the loss depends on the generator alone."""
        c = self.vae.config
        z = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.mode()
        return (z - (c.shift_factor or 0.0)) * c.scaling_factor


def flux_scheduler(dev: bool):
    """The scheduler of FLUX.1-dev (resolution-dependent exponential shift, mu from 0.5 at 256
    tokens to 1.15 at 4096) or of FLUX.1-schnell (no shift), as their model cards' folders hold."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if dev:
        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)
    return FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)


def random_flux(folder, seed: int, dev: bool, size: int, vae: tuple, groups: int, latent: int, layers: int,
                single_layers: int, heads: int, head_dim: int, rope: tuple, clip: int, t5: int, text_len: int,
                t5_len: int | None = None) -> int:
    """Write a FLUX pipeline folder of the given shape with random weights (FLUX's VAE scaling
    and shift factors, a CLIP text model, a T5 encoder; dev: a guidance embedding); returns the
    transformer's parameter count (t5_len: T5's tokens, default text_len, CLIP's). Used by tiny_flux
    and by bench/gpu_throughput.py."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    t5_len = t5_len or text_len
    tok, tok2 = tiny_clip_tokenizer(text_len), tiny_t5_tokenizer(t5_len)
    enc = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=clip, intermediate_size=2 * clip, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=text_len, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    enc2 = T5EncoderModel(T5Config(vocab_size=len(tok2), d_model=t5, d_kv=8, d_ff=t5, num_layers=1, num_heads=2,
                                   relative_attention_num_buckets=8)).eval()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent, num_layers=layers, num_single_layers=single_layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=t5, pooled_projection_dim=clip,
        guidance_embeds=dev, axes_dims_rope=tuple(rope),
    )
    autoencoder = AutoencoderKL(  # FLUX's scaling and shift factors
        block_out_channels=tuple(vae), down_block_types=("DownEncoderBlock2D",) * len(vae),
        up_block_types=("UpDecoderBlock2D",) * len(vae), latent_channels=latent, norm_num_groups=groups,
        sample_size=size, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )
    meta = {"height": size, "width": size, "max_sequence_length": t5_len}
    policy = FluxFlowPolicy(transformer, FluxTextEncoder(enc, tok, enc2, tok2, t5_len), autoencoder,
                            flux_scheduler(dev), meta, torch.device("cpu"))
    policy.save_pretrained(Path(folder))
    return sum(p.numel() for p in transformer.parameters())


# The tiny shape: 16x16 pixels -> 4x8x8 latents -> 16 packed tokens of 16 channels, one double
# and one single block, head dim 8 split (2, 2, 4) over the rotary axes, an 8-token CLIP and T5.
TINY = dict(size=16, vae=(8, 16), groups=4, latent=4, layers=1, single_layers=1, heads=2, head_dim=8, rope=(2, 2, 4),
            clip=16, t5=32, text_len=8)


def tiny_flux(folder, seed: int = 0, dev: bool = True, size: int = 16) -> Path:
    """A complete FLUX folder with tiny random weights (TINY): dev-style (guidance embedding,
    resolution-dependent shift) or schnell-style (neither). Tokenizers are built locally."""
    random_flux(folder, seed, dev, **{**TINY, "size": size})
    return Path(folder)
