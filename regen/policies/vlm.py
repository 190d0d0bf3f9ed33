"""Vision-language models: the parts of a language-model policy that differ when prompts hold images.

A VLM here is any local transformers folder loadable by AutoModelForImageTextToText with an
AutoProcessor (LLaVA-style models, whose processor returns one `pixel_values` entry per image):
the processor expands the image token of each prompt into the model's image-patch positions, and
the model's first forward replaces those positions by the projected vision features. Everything
else is the language-model path (regen/policies/lm.py): KV-cached sampling, recomputed log-probs,
the prompt run once per group (so the vision tower encodes each group's image once), export.

The image tokens are never sampled and never scored: their logits are set to -inf both when
sampling and when computing log-probs (the same distribution on both sides), so a completion can
not contain one, and the loss mask, which covers only completion tokens, never holds one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from regen.data.chat import is_processor  # noqa: F401  (re-exported)
from regen.data.packed_images import PACKED_FAMILIES, PackedProcessor
from regen.data.vision_inputs import VisionInputs
from regen.errors import DataError, UserError
from regen.policies.vlm_packed import base_model

# parameter-name pieces of the vision side (LLaVA: vision_tower; Qwen2-VL: visual; others: vision_model)
VISION_PARTS = ("vision_tower.", "visual.", "vision_model.")
# LoRA with no target_modules on a VLM: the language model's attention projections (a regex peft full-matches)
LANGUAGE_LORA_TARGETS = r".*(language_model|text_model).*\.(q_proj|k_proj|v_proj|o_proj)"  # Idefics3: text_model


@dataclass
class VisionPrompt:
    """One prompt of a vision-language model: its text and its image's pixels (uint8 H x W x 3),
    a list of images (several per prompt), or None (a prompt without image; Qwen-VL families only)."""

    text: str
    image: np.ndarray | list | None

    @property
    def images(self) -> list:
        return [] if self.image is None else list(self.image) if isinstance(self.image, list) else [self.image]


def is_vlm_folder(path: Path) -> bool:
    """A model folder whose config has a vision part (LLaVA, Qwen2-VL, ...)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in cfg


def model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def load_processor(path: str):
    """The processor of a local VLM folder (the Qwen-VL families: regen's image-only one,
    regen/data/packed_images.py); UserError naming what is missing."""
    from transformers import AutoProcessor

    packed = model_type(Path(path)) in PACKED_FAMILIES
    try:
        proc = PackedProcessor.from_pretrained(path) if packed else AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: '{path}' is a vision-language model but its processor does not load "
                        f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); save it "
                        "with processor.save_pretrained into the same folder") from None
    if not is_processor(proc):
        raise UserError(f"model.path: '{path}' has a vision config but no image processor (preprocessor_config.json)")
    return proc


def load_vlm(path: str, dtype):
    """(model, processor) of a local VLM folder; UserError naming what is missing."""
    from transformers import AutoModelForImageTextToText

    proc = load_processor(path)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model.path: cannot load the vision-language model '{path}': {first}") from None
    return model, proc


def image_token_ids(processor, config=None) -> list[int]:
    """Ids the sampler must never emit: the image placeholder and marker tokens of the processor
    (Gemma 3's processor names its image-start marker image_token; the model's own image token id
    comes from `config`)."""
    if processor is None:
        return []
    tok = processor.tokenizer
    names = {getattr(o, a, None) for o in (processor, tok) for a in ("image_token", "video_token", "boi_token",
                                                                      "eoi_token")} - {None}
    ids = {tok.convert_tokens_to_ids(t) for t in names if isinstance(t, str)}
    ids |= {getattr(config, a, None) for a in ("image_token_id", "image_token_index", "video_token_id")}
    ids.discard(None)
    return sorted(i for i in ids if i is not None and i != tok.unk_token_id)


def encode(processor, prompts: list[VisionPrompt], add_special_tokens: bool, device) -> tuple[dict, VisionInputs]:
    """(text inputs: input_ids / attention_mask, left-padded; image inputs per row). A prompt
    without the image token gets one in front per image."""
    if isinstance(processor, PackedProcessor):
        mark = processor.image_marker()
        texts = [p.text if processor.image_token in p.text else mark * len(p.images) + p.text for p in prompts]
        text, vision = processor.encode(texts, [p.images for p in prompts], add_special_tokens)
        return {k: v.to(device) for k, v in text.items()}, vision.to(device)
    img_tok = processor.image_token
    counts = [len(p.images) for p in prompts]
    if 0 in counts:
        raise DataError(f"prompt '{prompts[counts.index(0)].text[:60]}' has no image, and this model reads prompts "
                        "with images only (prompts without one: the Qwen-VL families)")
    texts = [p.text if img_tok in p.text else " ".join([img_tok] * n + [p.text]) for p, n in zip(prompts, counts)]
    try:
        enc = processor(images=[p.images for p in prompts], text=texts, padding=True, padding_side="left",
                        return_tensors="pt", add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise DataError(f"the processor refused a prompt's image: {e}") from None
    text = {k: enc[k].to(device) for k in ("input_ids", "attention_mask")}
    # token_type_ids (Gemma 3) mark image tokens: rebuilt from the ids wherever they are needed (image_args)
    tensors = {k: v.to(device) for k, v in enc.items()
               if k not in text and k not in ("token_type_ids", "mm_token_type_ids") and torch.is_tensor(v)}
    rows = {}
    for k, v in tensors.items():  # one entry per image (LLaVA, Gemma 3), or per prompt (Idefics3: its tiles)
        if v.shape[0] == sum(counts):
            rows[k] = counts
        elif v.shape[0] == len(prompts):
            rows[k] = [1] * len(prompts)
        else:
            raise UserError(f"model.path: the processor's '{k}' is packed across images ({tuple(v.shape)} for "
                            f"{len(prompts)} prompts); regen reads packed inputs only for the "
                            f"{', '.join(PACKED_FAMILIES)} families")
    return text, VisionInputs.split(len(prompts), tensors, rows)


# families whose image tokens attend to each other both ways, marked by token_type_ids (Gemma 3 tech report, Sec. 2)
BLOCK_ATTENTION = ("gemma3",)


def image_args(model, input_ids: torch.Tensor, vision: VisionInputs | None, rows=None) -> dict:
    """A forward's image keyword arguments over `input_ids` (rows `rows` of a batch, all for None):
    those rows' image tensors and, for Gemma 3, token_type_ids marking the image tokens (1) from
    the ids themselves; {} for text or rows without images."""
    images = {} if vision is None else vision.kwargs(rows)
    if not images:
        return {}
    cfg = base_model(model).config
    if cfg.model_type not in BLOCK_ATTENTION:
        return images
    image_id = getattr(cfg, "image_token_id", None)
    image_id = cfg.image_token_index if image_id is None else image_id
    return {**images, "token_type_ids": (input_ids == image_id).long()}


def check_trainable(model, model_cfg) -> None:
    """model.freeze_vision on the model just loaded: acts on a VLM, refused on a text model."""
    if hasattr(model.config, "vision_config"):
        freeze_vision(model, model_cfg.freeze_vision, lora=model_cfg.lora is not None)
    elif model_cfg.freeze_vision is not None:
        raise UserError("model.freeze_vision is for vision-language models; this model reads no images")


def freeze_vision(model, freeze: bool | None, lora: bool) -> None:
    """model.freeze_vision: keep the vision tower fixed (default for a VLM); None = default."""
    names = {n for n, _ in model.named_parameters() if any(part in n for part in VISION_PARTS)}
    if not names:
        raise UserError("model.freeze_vision: no vision-tower parameters found in this model (looked for "
                        + ", ".join(p.rstrip(".") for p in VISION_PARTS) + ")")
    if lora:
        if freeze is False:
            raise UserError("model.freeze_vision=false with model.lora: LoRA trains adapters only; name vision-tower "
                            "modules in model.lora.target_modules to adapt the vision side")
        return
    if freeze is None or freeze:
        for n, p in model.named_parameters():
            if n in names:
                p.requires_grad_(False)
