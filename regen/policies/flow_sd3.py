"""Stable Diffusion 3 as a regen flow policy: `SD3Transformer2DModel` (the MMDiT, Esser et al.
2024) is the velocity network over `AutoencoderKL` latents, conditioned on two CLIP text
encoders (`CLIPTextModelWithProjection`) and an optional T5 (`T5EncoderModel`).

Mirrors diffusers' `StableDiffusion3Pipeline` (pipelines/stable_diffusion_3/
pipeline_stable_diffusion_3.py): `encode_prompt` for the condition, `transformer(...)` with
timestep = 1000 sigma in its denoising loop, and `(latents / scaling_factor) + shift_factor`
before `vae.decode`. The trained part is the transformer; text encoders and VAE are frozen.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from regen.errors import UserError
from regen.policies.flow_latent import (
    LatentFlowPolicy,
    check_size,
    load_text_model,
    load_tokenizer,
    tiny_clip_tokenizer,
    tiny_t5_tokenizer,
)


class SD3TextEncoder(nn.Module):
    """prompts -> (encoder_hidden_states (B, L, D), pooled_projections (B, P)), as
    `StableDiffusion3Pipeline.encode_prompt` with one image per prompt and no clip_skip: each
    CLIP's penultimate hidden states (padded to tokenizer.model_max_length), concatenated on
    the feature axis and zero-padded to T5's width, then T5's states (max_sequence_length
    tokens; zeros of the transformer's joint_attention_dim when there is no T5) appended on
    the sequence axis; pooled = the two CLIP text_embeds concatenated."""

    def __init__(
        self,
        text_encoder,
        text_encoder_2,
        tokenizer,
        tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
        max_sequence_length: int = 256,
        joint_attention_dim: int = 4096,
    ):
        super().__init__()
        self.text_encoder, self.text_encoder_2, self.text_encoder_3 = text_encoder, text_encoder_2, text_encoder_3
        self.tokenizer, self.tokenizer_2, self.tokenizer_3 = tokenizer, tokenizer_2, tokenizer_3
        self.max_sequence_length, self.joint_attention_dim = max_sequence_length, joint_attention_dim

    @torch.no_grad()  # frozen: no graph through the text encoders
    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        states, pooled = [], []
        for enc, tok in ((self.text_encoder, self.tokenizer), (self.text_encoder_2, self.tokenizer_2)):
            # both CLIPs pad to the first tokenizer's length, as the pipeline's tokenizer_max_length
            ids = tok(
                prompts, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True, return_tensors="pt"
            ).input_ids
            out = enc(ids.to(enc.device), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out[0])
        clip = torch.cat(states, dim=-1)
        if self.text_encoder_3 is None:
            t5 = clip.new_zeros(len(prompts), self.max_sequence_length, self.joint_attention_dim)
        else:
            ids = self.tokenizer_3(
                prompts,
                padding="max_length",
                max_length=self.max_sequence_length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).input_ids
            t5 = self.text_encoder_3(ids.to(self.text_encoder_3.device))[0].to(clip.dtype)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)


class SD3FlowPolicy(LatentFlowPolicy):
    KIND, TRANSFORMER, VAE = "sd3", "SD3Transformer2DModel", "AutoencoderKL"
    PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    LAYOUT = (
        "an SD3 pipeline folder needs transformer/, vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/; "
        "text_encoder_3/ + tokenizer_3/ (T5) are optional"
    )

    @classmethod
    def complete(cls, meta: dict, transformer, vae, folder="") -> dict:
        """Pixel size (default: the transformer's sample_size x the VAE's scale, the pipeline's
        default), T5 length (default 256, the pipeline's) and the latent sample shape."""
        scale = 2 ** (len(vae.config.block_out_channels) - 1)  # the pipeline's vae_scale_factor
        size = transformer.config.sample_size * scale
        h, w = int(meta.get("height", size)), int(meta.get("width", size))
        for what, v in (("height", h), ("width", w)):
            check_size(what, v, scale * transformer.config.patch_size, folder)
        shape = [transformer.config.in_channels, h // scale, w // scale]
        return {
            **meta,
            "kind": cls.KIND,
            "height": h,
            "width": w,
            "max_sequence_length": int(meta.get("max_sequence_length", 256)),
            "sample_shape": shape,
        }

    @classmethod
    def load_encoder(cls, folder: Path, dtype, meta: dict, transformer) -> SD3TextEncoder:
        t5 = (folder / "text_encoder_3").is_dir()
        if t5 != (folder / "tokenizer_3").is_dir():
            raise UserError(f"model.path: '{folder}' has only one of text_encoder_3/ and tokenizer_3/ ({cls.LAYOUT})")
        return SD3TextEncoder(
            load_text_model(folder / "text_encoder", "CLIPTextModelWithProjection", dtype),
            load_text_model(folder / "text_encoder_2", "CLIPTextModelWithProjection", dtype),
            load_tokenizer(folder / "tokenizer"),
            load_tokenizer(folder / "tokenizer_2"),
            load_text_model(folder / "text_encoder_3", "T5EncoderModel", dtype) if t5 else None,
            load_tokenizer(folder / "tokenizer_3") if t5 else None,
            meta["max_sequence_length"],
            transformer.config.joint_attention_dim,
        )

    def pipeline(self):
        from diffusers import StableDiffusion3Pipeline

        e = self.encoder
        return StableDiffusion3Pipeline(
            self.unet,
            self.scheduler,
            self.vae,
            e.text_encoder,
            e.tokenizer,
            e.text_encoder_2,
            e.tokenizer_2,
            e.text_encoder_3,
            e.tokenizer_3,
        )

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, unet=None) -> torch.Tensor:
        """v = d x / d sigma = eps - x0 on latents (B, C, h, w); cond = (states, pooled)."""
        dt = self._dtype()
        states, pooled = cond
        return self._net(unet)(
            hidden_states=x.to(dt),
            timestep=(sigma * 1000).to(dt),
            encoder_hidden_states=states.to(dt),
            pooled_projections=pooled.to(dt),
        ).sample

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels (B, 3, H, W) in [-1, 1], the pipeline's unscaling then vae.decode."""
        c = self.vae.config
        z = x0.to(self.vae.dtype) / c.scaling_factor + (c.shift_factor or 0.0)
        return self.vae.decode(z).sample.float().clamp(-1, 1)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] -> latents, the inverse scaling (as SD3's img2img
        pipeline); the posterior mean, so the loss depends on the generator alone."""
        c = self.vae.config
        z = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.mode()
        return (z - (c.shift_factor or 0.0)) * c.scaling_factor


# The tiny shape: 16x16 pixels -> 4x8x8 latents, one MMDiT block, 8-token CLIPs of different
# widths so the padding to the joint width matters. Keys: pixels, VAE block channels (scale
# 2**(n-1)) and norm groups, latent channels, joint blocks, heads, head dim, CLIP (width,
# projection) x 2, text length, joint_attention_dim (= T5's width).
TINY = dict(size=16, vae=(8, 16), groups=4, latent=4, layers=1, heads=2, head_dim=8, clips=((8, 4), (16, 12)),
            text_len=8, joint=32)


def tiny_sd3(folder, seed: int = 0, t5: bool = True, size: int = 16) -> Path:
    """A complete SD3 folder with tiny random weights (TINY, with an optional 8-token T5), to try
    regen on and for tests. Tokenizers are built locally."""
    random_sd3(folder, seed, t5, **{**TINY, "size": size})
    return Path(folder)


def random_sd3(folder, seed: int, t5: bool, size: int, vae: tuple, groups: int, latent: int, layers: int, heads: int,
               head_dim: int, clips: tuple, text_len: int, joint: int) -> int:
    """Write an SD3 pipeline folder of the given shape with random weights (SD3's VAE scaling and
    shift factors, CLIP-L/G-like encoders, an optional T5); returns the transformer's parameter
    count. Used by tiny_sd3 and by bench/gpu_throughput.py for a medium-sized model."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tok, tok2 = tiny_clip_tokenizer(text_len), tiny_clip_tokenizer(text_len)

    def clip(hidden: int, proj: int):
        cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=text_len, projection_dim=proj,
                             bos_token_id=0, eos_token_id=1, pad_token_id=1)
        return CLIPTextModelWithProjection(cfg).eval()

    (w1, p1), (w2, p2) = clips
    enc, enc2 = clip(w1, p1), clip(w2, p2)  # SD3: CLIP-L 768 + CLIP-G 1280 wide, padded to T5's 4096
    tok3 = tiny_t5_tokenizer(text_len) if t5 else None
    enc3 = None
    if t5:
        cfg = T5Config(vocab_size=len(tok3), d_model=joint, d_kv=8, d_ff=joint, num_layers=1, num_heads=2,
                       relative_attention_num_buckets=8)
        enc3 = T5EncoderModel(cfg).eval()
    scale = 2 ** (len(vae) - 1)
    transformer = SD3Transformer2DModel(
        sample_size=size // scale, patch_size=2, in_channels=latent, out_channels=latent, num_layers=layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=joint,
        caption_projection_dim=heads * head_dim, pooled_projection_dim=p1 + p2, pos_embed_max_size=size // scale,
    )
    autoencoder = AutoencoderKL(  # SD3's scaling and shift factors
        block_out_channels=tuple(vae), down_block_types=("DownEncoderBlock2D",) * len(vae),
        up_block_types=("UpDecoderBlock2D",) * len(vae), latent_channels=latent, norm_num_groups=groups,
        sample_size=size, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
    )
    text = SD3TextEncoder(enc, enc2, tok, tok2, enc3, tok3, max_sequence_length=text_len, joint_attention_dim=joint)
    meta = {"height": size, "width": size, "max_sequence_length": text_len}
    policy = SD3FlowPolicy(transformer, text, autoencoder, FlowMatchEulerDiscreteScheduler(shift=3.0), meta,
                           torch.device("cpu"))
    policy.save_pretrained(Path(folder))
    return sum(p.numel() for p in transformer.parameters())
