"""The Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): their M-RoPE positions.

Their prompts' token ids and packed image inputs come from regen/data/packed_images.py.

Positions are three-dimensional (M-RoPE, Qwen2-VL paper, Sec. 2.1): a text token has the same
position on the time, height and width axes; an image's tokens share the text position where the
image starts on the time axis and count rows and columns of the patch grid on the other two; the
text after an image resumes at the largest position so far + 1. So a response token's position is
its plain text index plus a per-row offset (delta = largest prompt position + 1 - prompt length),
which is what the sampler and the log-prob recomputation both use (regen/policies/lm_rollout.py).
The model's own fallback when no positions are passed (plain 0..L-1 without the image layout, or
offsets kept on the model object from its last prompt) is never relied on: every forward gets
explicit positions, so the first on-policy ratio is exactly 1.
"""

from __future__ import annotations

import torch

from regen.data.packed_images import PACKED_FAMILIES


def is_packed(model) -> bool:
    """A model of the Qwen-VL families (M-RoPE positions, packed image inputs)."""
    return getattr(base_model(model).config, "model_type", None) in PACKED_FAMILIES


def base_model(model):
    model = getattr(model, "module", model)  # DDP
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft


def rope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: dict) -> torch.Tensor:
    """M-RoPE positions (B, 3, L) of token sequences whose image tokens stand where `vision`'s images go
    (padding, left or right, gets 0): the family's own get_rope_index, the function its forward uses."""
    inner = base_model(model).model
    image_id = base_model(model).config.image_token_id
    types = (input_ids == image_id).int()  # 1 marks an image token, 0 text (no videos here)
    grid = vision.get("image_grid_thw")
    if grid is None:  # no image in these rows: text positions on all three axes
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
        return pos[:, None, :].expand(-1, 3, -1).clone()
    pos, _ = inner.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid,
                                  attention_mask=attention_mask)
    return pos.permute(1, 0, 2).contiguous()


def model_positions(pos: torch.Tensor) -> torch.Tensor:
    """Positions as the forward takes them: (B, L) for plain RoPE, (3, B, L) for M-RoPE (stored (B, 3, L))."""
    return pos.permute(1, 0, 2) if pos.dim() == 3 else pos
