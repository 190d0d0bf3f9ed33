"""A local CLIP model (transformers CLIPModel + CLIPProcessor folder): image embeddings for the
clip:PATH feature space and CLIP-score. torchmetrics' CLIPScore accepts only hub names, so the
score is computed here from its definition."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from regen.errors import UserError

_MEMO: dict[str, tuple] = {}  # folder -> (model, processor): one load per process


def load_clip(path: str | Path, device: str = "cpu", where: str = "eval.clip_model"):
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UserError(f"{where}: '{folder}' does not exist (nothing is downloaded: give a local CLIPModel folder "
                        "with its tokenizer and image processor)")
    key = f"{folder.resolve()}@{device}"
    if key not in _MEMO:
        from transformers import CLIPModel, CLIPProcessor
        from transformers.utils import logging

        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # "requires torchvision, falling back to PIL": the same pixels
        try:
            model = CLIPModel.from_pretrained(str(folder)).to(device).eval()
            processor = CLIPProcessor.from_pretrained(str(folder))
        except (OSError, ValueError, TypeError) as e:
            raise UserError(f"{where} '{folder}': not a CLIP model folder with tokenizer and image processor "
                            f"({str(e).splitlines()[0]})") from None
        finally:
            logging.set_verbosity(verbosity)
        _MEMO[key] = (model, processor)
    return _MEMO[key]


@torch.no_grad()
def image_embeddings(model, processor, frames: np.ndarray, batch: int = 64) -> torch.Tensor:
    """(N, D) projected embeddings of uint8 frames (N, H, W, C)."""
    out = []
    for i in range(0, len(frames), batch):
        pix = processor(images=list(frames[i: i + batch]), return_tensors="pt")["pixel_values"]
        feats = model.get_image_features(pixel_values=pix.to(model.device))
        out.append(getattr(feats, "pooler_output", feats).float().cpu())
    return torch.cat(out)


@torch.no_grad()
def text_embeddings(model, processor, texts: list[str], batch: int = 256) -> torch.Tensor:
    out = []
    for i in range(0, len(texts), batch):
        tok = processor(text=texts[i: i + batch], return_tensors="pt", padding=True, truncation=True)
        feats = model.get_text_features(input_ids=tok["input_ids"].to(model.device),
                                        attention_mask=tok["attention_mask"].to(model.device))
        out.append(getattr(feats, "pooler_output", feats).float().cpu())
    return torch.cat(out)


def clip_score(model, processor, media: np.ndarray, prompts: list[str]) -> float:
    """CLIP-score (Hessel et al. 2021, eq. 1, with w = 100 as torchmetrics reports it): the mean
    over samples of 100 * max(cos(E_image, E_text), 0); a video scores the mean over its frames."""
    frames = media if media.ndim == 4 else media.reshape(-1, *media.shape[-3:])
    per = 1 if media.ndim == 4 else media.shape[1]
    img = image_embeddings(model, processor, frames)
    txt = text_embeddings(model, processor, prompts).repeat_interleave(per, dim=0)
    cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
    return float((100 * cos.clamp(min=0)).mean())
