"""HunyuanVideo text-to-video as a regen flow policy: `HunyuanVideoTransformer3DModel` (dual- then
single-stream blocks over 3-D patches; Tencent 2024) is the velocity network over
`AutoencoderKLHunyuanVideo` latents (B, C, F', H', W'), conditioned on a Llama's hidden states
and a CLIP text model's pooled output. Guidance-distilled: the transformer embeds a guidance value.

Mirrors diffusers' `HunyuanVideoPipeline` (pipelines/hunyuan_video/pipeline_hunyuan_video.py):
- the condition: each prompt in the pipeline's chat template (a system turn listing what to
  describe, the prompt as the user turn), padded to max_sequence_length + the template's 95 tokens
  (`crop_start`), the Llama's third-to-last hidden states (`num_hidden_layers_to_skip` = 2) with
  those 95 tokens cropped, and their attention mask; CLIP's pooler_output over 77 tokens;
- the transformer gets timestep = 1000 sigma and guidance = 1000 x the embedded value
  (flow.guidance_embed, default 6.0, the pipeline's guidance_scale);
- classifier-free guidance as the pipeline's `true_cfg_scale` (empty negative prompt), the halves
  in one batched forward (both texts already have one padded length);
- the grid: linspace(1, 1/n, n) shifted by its scheduler (HunyuanVideo's: shift 7);
- decoding: `latents / scaling_factor`, then vae.decode, returned as (B, F, 3, H, W).

The trained part is the transformer; the text encoders and the VAE are frozen.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from regen.errors import UserError
from regen.policies.flow_latent import JOINT_ATTENTION, LatentFlowPolicy, check_size, load_text_model, load_tokenizer

# HunyuanVideoPipeline's DEFAULT_PROMPT_TEMPLATE, and the number of its tokens before the prompt
TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)
CROP = 95
SKIP = 2  # num_hidden_layers_to_skip: the Llama's third-to-last hidden states
CLIP_LEN = 77


class HunyuanTextEncoder(nn.Module):
    """prompts -> (encoder_hidden_states (B, L, D), mask (B, L), pooled_projections (B, P)), as
    HunyuanVideoPipeline.encode_prompt with one video per prompt (L = max_sequence_length)."""

    def __init__(self, text_encoder, tokenizer, text_encoder_2, tokenizer_2, max_sequence_length: int = 256):
        super().__init__()
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.max_sequence_length = max_sequence_length

    @torch.no_grad()  # frozen: no graph through the text encoders
    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.tokenizer([TEMPLATE.format(p) for p in prompts], max_length=self.max_sequence_length + CROP,
                           padding="max_length", truncation=True, return_tensors="pt", return_attention_mask=True)
        dev = self.text_encoder.device
        mask = t.attention_mask.to(dev)
        states = self.text_encoder(input_ids=t.input_ids.to(dev), attention_mask=mask,
                                   output_hidden_states=True).hidden_states[-(SKIP + 1)]
        ids = self.tokenizer_2(prompts, padding="max_length", max_length=CLIP_LEN, truncation=True,
                               return_tensors="pt").input_ids
        pooled = self.text_encoder_2(ids.to(self.text_encoder_2.device), output_hidden_states=False).pooler_output
        return states[:, CROP:], mask[:, CROP:], pooled.to(states.dtype)


class HunyuanVideoFlowPolicy(LatentFlowPolicy):
    KIND, TRANSFORMER, VAE = "hunyuan-video", "HunyuanVideoTransformer3DModel", "AutoencoderKLHunyuanVideo"
    PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    LAYOUT = "a HunyuanVideo pipeline folder needs transformer/, vae/, text_encoder/ (Llama), text_encoder_2/ " \
             "(CLIP), tokenizer/, tokenizer_2/"
    LINSPACE = True  # HunyuanVideoPipeline: sigmas = linspace(1, 0, n + 1)[:-1], shifted by its scheduler
    DEFAULT_GUIDANCE = 6.0  # HunyuanVideoPipeline's guidance_scale
    LORA_TARGETS = JOINT_ATTENTION

    @classmethod
    def complete(cls, meta: dict, transformer, vae, folder="") -> dict:
        """Video size (default HunyuanVideoPipeline's 720 x 1280, 129 frames), text length
        (default 256, the pipeline's), embedded guidance (default 6.0) and the latent sample
        shape (C, (F - 1) / temporal + 1, H / s, W / s)."""
        c, patch = vae.config, transformer.config.patch_size
        h, w = int(meta.get("height", 720)), int(meta.get("width", 1280))
        frames = int(meta.get("frames", 129))
        for what, v in (("height", h), ("width", w)):
            check_size(what, v, c.spatial_compression_ratio * patch, folder)
        if frames < 1 or (frames - 1) % c.temporal_compression_ratio:
            raise UserError(f"model.path: '{folder}' flow_policy.json frames={frames}: frames - 1 must be a multiple "
                            f"of {c.temporal_compression_ratio} (the VAE's temporal compression)")
        shape = [transformer.config.in_channels, (frames - 1) // c.temporal_compression_ratio + 1,
                 h // c.spatial_compression_ratio, w // c.spatial_compression_ratio]
        return {**meta, "kind": cls.KIND, "height": h, "width": w, "frames": frames,
                "max_sequence_length": int(meta.get("max_sequence_length", 256)),
                "guidance_embed": cls.guidance_meta(meta, transformer, folder), "sample_shape": shape}

    @classmethod
    def load_encoder(cls, folder: Path, dtype, meta: dict, transformer) -> HunyuanTextEncoder:
        return HunyuanTextEncoder(
            load_text_model(folder / "text_encoder", "LlamaModel", dtype), load_tokenizer(folder / "tokenizer"),
            load_text_model(folder / "text_encoder_2", "CLIPTextModel", dtype), load_tokenizer(folder / "tokenizer_2"),
            meta["max_sequence_length"],
        )

    def seq_len(self) -> int:
        p, pt = self.unet.config.patch_size, self.unet.config.patch_size_t
        _, f, h, w = self.sample_shape
        return (f // pt) * (h // p) * (w // p)

    def pipeline(self):
        from diffusers import HunyuanVideoPipeline

        e = self.encoder
        return HunyuanVideoPipeline(e.text_encoder, e.tokenizer, self.unet, self.vae, self.scheduler,
                                    e.text_encoder_2, e.tokenizer_2)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, unet=None) -> torch.Tensor:
        """v = d x / d sigma = eps - x0 on latents (B, C, F', H', W'); cond = (states, mask, pooled)."""
        dt = self._dtype()
        states, mask, pooled = cond
        g = self.guidance(x.shape[0], x.device)
        return self._net(unet)(
            hidden_states=x.to(dt),
            timestep=(sigma * 1000).to(dt),  # HunyuanVideo takes the scheduler's 0..1000 timesteps
            encoder_hidden_states=states.to(dt),
            encoder_attention_mask=mask.to(dt),
            pooled_projections=pooled.to(dt),
            guidance=None if g is None else (g * 1000.0).to(dt),  # as the pipeline: 1000 x guidance_scale
        ).sample

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents -> videos (B, F, 3, H, W) in [-1, 1]: the pipeline's unscaling, then vae.decode."""
        video = self.vae.decode(x0.to(self.vae.dtype) / self.vae.config.scaling_factor).sample  # (B, 3, F, H, W)
        return video.float().clamp(-1, 1).transpose(1, 2)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Videos (B, F, 3, H, W) in [-1, 1] -> scaled latents; the posterior mean, so the loss
        depends on the generator alone."""
        z = self.vae.encode(pixels.transpose(1, 2).to(self.vae.dtype)).latent_dist.mode()
        return z * self.vae.config.scaling_factor


SPECIALS = ["<pad>", "<|eot_id|>", "<unk>", "<|start_header_id|>", "<|end_header_id|>"]
TEMPLATE_WORDS = ["Describe", "the", "video", "by", "detailing", "following", "aspects", "1", "2", "3", "4", "5", "The",
                  "main", "content", "and", "theme", "of", "color", "shape", "size", "texture", "quantity", "text",
                  "spatial", "relationships", "objects", "Actions", "events", "behaviors", "temporal", "physical",
                  "movement", "changes", "background", "environment", "light", "style", "atmosphere", "camera",
                  "angles", "movements", "transitions", "used", "in", ",", ".", ":"]


def tiny_hunyuan(folder, seed: int = 0, size: int = 16, frames: int = 9) -> Path:
    """A complete HunyuanVideo folder with tiny random weights, to try regen on and for tests: 9
    frames of 16x16 pixels -> 4x3x4x4 latents (VAE: 4x spatial, 4x temporal), 2x2 patches, one
    dual- and one single-stream block, a 3-layer Llama over a word-level tokenizer that splits the
    pipeline's template into exactly its 95 tokens, a CLIP, 16 text tokens."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    from regen.policies.flow_latent import TINY_WORDS, tiny_clip_tokenizer
    from regen.tasks.tiny_vlms import word_tokenizer

    torch.manual_seed(seed)
    tok = word_tokenizer(sorted(set(TINY_WORDS) | set(TEMPLATE_WORDS)), SPECIALS, "<|eot_id|>", {}, "", apart=",.:")
    llama = LlamaModel(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=tok.pad_token_id)).eval()
    tok2 = tiny_clip_tokenizer(CLIP_LEN)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok2), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=CLIP_LEN, bos_token_id=0,
                                        eos_token_id=1, pad_token_id=1)).eval()
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 8), layers_per_block=1,
        norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=4, temporal_compression_ratio=4)
    policy = HunyuanVideoFlowPolicy(
        transformer, HunyuanTextEncoder(llama, tok, clip, tok2, 16), vae, FlowMatchEulerDiscreteScheduler(shift=7.0),
        {"height": size, "width": size, "frames": frames, "max_sequence_length": 16}, torch.device("cpu"))
    policy.save_pretrained(Path(folder))
    return Path(folder)
