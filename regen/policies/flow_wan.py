"""Wan 2.1 text-to-video as a regen flow policy: `WanTransformer3DModel` is the velocity network
over `AutoencoderKLWan` latents (B, C, F', H', W'), conditioned on a UMT5 text encoder
(`UMT5EncoderModel`; any T5 encoder class its config names loads).

Mirrors diffusers' `WanPipeline` (pipelines/wan/pipeline_wan.py): `_get_t5_prompt_embeds` for
the condition (prompt_clean, padded to max_sequence_length, states past each prompt's length
zeroed), `transformer(...)` with timestep = 1000 sigma, and `latents / (1 / latents_std) +
latents_mean` before `vae.decode`. Decoded videos are returned in regen's layout (B, F, 3, H,
W), not the VAE's (B, 3, F, H, W). The trained part is the transformer; the text encoder and
the VAE are frozen. Wan 2.2's two-expert and expand-timesteps pipelines are not supported.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from regen.errors import UserError
from regen.policies.flow_latent import LatentFlowPolicy, check_size, load_text_model, load_tokenizer, tiny_t5_tokenizer


class WanTextEncoder(nn.Module):
    """prompts -> encoder_hidden_states (B, max_sequence_length, D), as WanPipeline's
    `_get_t5_prompt_embeds` with one video per prompt."""

    def __init__(self, text_encoder, tokenizer, max_sequence_length: int = 512):
        super().__init__()
        self.text_encoder, self.tokenizer, self.max_sequence_length = text_encoder, tokenizer, max_sequence_length

    @torch.no_grad()  # frozen: no graph through the text encoder
    def forward(self, prompts: list[str]) -> torch.Tensor:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        t = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        dev = self.text_encoder.device
        states = self.text_encoder(t.input_ids.to(dev), t.attention_mask.to(dev)).last_hidden_state
        # the pipeline cuts each row to its length and pads it back with zeros: the padding
        # tokens' states never reach the transformer
        keep = torch.arange(states.shape[1], device=dev)[None, :] < t.attention_mask.to(dev).sum(1, keepdim=True)
        return torch.where(keep[..., None], states, torch.zeros((), dtype=states.dtype, device=dev))


class WanFlowPolicy(LatentFlowPolicy):
    KIND, TRANSFORMER, VAE = "wan", "WanTransformer3DModel", "AutoencoderKLWan"
    PARTS = ("transformer", "vae", "text_encoder", "tokenizer")
    LAYOUT = "a Wan pipeline folder needs transformer/, vae/, text_encoder/, tokenizer/"

    @classmethod
    def complete(cls, meta: dict, transformer, vae, folder="") -> dict:
        """Video size (default WanPipeline's 480 x 832, 81 frames), text length (default 512,
        the pipeline's) and the latent sample shape (C, (F - 1) / temporal + 1, H / s, W / s)."""
        c, patch = vae.config, transformer.config.patch_size
        h, w = int(meta.get("height", 480)), int(meta.get("width", 832))
        frames = int(meta.get("frames", 81))
        check_size("height", h, c.scale_factor_spatial * patch[1], folder)
        check_size("width", w, c.scale_factor_spatial * patch[2], folder)
        if frames < 1 or (frames - 1) % c.scale_factor_temporal:
            raise UserError(
                f"model.path: '{folder}' flow_policy.json frames={frames}: frames - 1 must be a multiple of "
                f"{c.scale_factor_temporal} (the VAE's temporal scale)"
            )
        shape = [
            transformer.config.in_channels,
            (frames - 1) // c.scale_factor_temporal + 1,
            h // c.scale_factor_spatial,
            w // c.scale_factor_spatial,
        ]
        return {
            **meta,
            "kind": cls.KIND,
            "height": h,
            "width": w,
            "frames": frames,
            "max_sequence_length": int(meta.get("max_sequence_length", 512)),
            "sample_shape": shape,
        }

    @classmethod
    def load_encoder(cls, folder: Path, dtype, meta: dict, transformer) -> WanTextEncoder:
        index = folder / "model_index.json"
        cfg = json.loads(index.read_text()) if index.is_file() else {}
        if (cfg.get("transformer_2") or [None])[0] is not None or cfg.get("expand_timesteps"):
            raise UserError(
                f"model.path: '{folder}' is a Wan 2.2 two-expert / expand-timesteps pipeline; regen trains "
                "single-transformer Wan pipelines"
            )
        return WanTextEncoder(
            load_text_model(folder / "text_encoder", "UMT5EncoderModel", dtype),
            load_tokenizer(folder / "tokenizer"),
            meta["max_sequence_length"],
        )

    def pipeline(self):
        from diffusers import WanPipeline

        return WanPipeline(self.encoder.tokenizer, self.encoder.text_encoder, self.vae, self.scheduler, self.unet)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, unet=None) -> torch.Tensor:
        """v = d x / d sigma = eps - x0 on latents (B, C, F', H', W'); cond (B, L, D)."""
        dt = self._dtype()
        return self._net(unet)(
            hidden_states=x.to(dt), timestep=(sigma * 1000).to(dt), encoder_hidden_states=cond.to(dt)
        ).sample

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.vae.config
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return mean, 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents -> videos (B, F, 3, H, W) in [-1, 1]: the pipeline's un-normalisation, then vae.decode."""
        z = x0.to(self.vae.dtype)
        mean, inv_std = self._stats(z)
        video = self.vae.decode(z / inv_std + mean).sample  # (B, 3, F, H, W)
        return video.float().clamp(-1, 1).transpose(1, 2)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Videos (B, F, 3, H, W) in [-1, 1] -> normalised latents (as Wan's image-to-video
        pipeline normalises its condition); the posterior mean, so the loss depends on the
        generator alone."""
        z = self.vae.encode(pixels.transpose(1, 2).to(self.vae.dtype)).latent_dist.mode()
        mean, inv_std = self._stats(z)
        return (z - mean) * inv_std


def tiny_wan(folder, seed: int = 0, size: int = 16, frames: int = 9) -> Path:
    """A complete Wan folder with tiny random weights (9 frames of 16x16 pixels -> 4x5x4x4
    latents, one transformer block, a VAE with 4x spatial and 2x temporal compression and its
    own latent statistics, an 8-token UMT5), to try regen on and for tests."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tok = tiny_t5_tokenizer(8)
    enc = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tok), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8
        )
    ).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=1,
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(  # 3 levels, one of them temporal: the scale factors must say so
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[-0.1, 0.2, 0.05, -0.3],
        latents_std=[1.5, 0.8, 2.0, 1.2],
        scale_factor_temporal=2,
        scale_factor_spatial=4,
    )
    policy = WanFlowPolicy(
        transformer,
        WanTextEncoder(enc, tok, 8),
        vae,
        FlowMatchEulerDiscreteScheduler(shift=3.0),
        {"height": size, "width": size, "frames": frames, "max_sequence_length": 8},
        torch.device("cpu"),
    )
    policy.save_pretrained(Path(folder))
    return Path(folder)
