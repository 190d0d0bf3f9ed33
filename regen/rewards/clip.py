"""Learned image rewards on a local CLIP model: prompt similarity (`clip_score`), a PickScore-style
preference score (`pickscore`), and an aesthetic predictor (`aesthetic`: CLIP image embedding
into an MLP head from a safetensors file).

Nothing is downloaded: `model` is a local transformers CLIPModel folder (with its tokenizer and
image processor). To use public weights, fetch them once on a machine with a network, e.g.

    huggingface-cli download openai/clip-vit-large-patch14 --local-dir /models/clip-l14
    huggingface-cli download yuvalkirstain/PickScore_v1 --local-dir /models/pickscore
    # processor of PickScore: laion/CLIP-ViT-H-14-laion2B-s32B-b79K (copy its tokenizer and
    # preprocessor files into /models/pickscore)

and for `aesthetic` convert the LAION improved aesthetic predictor's MLP (sac+logos+ava1-l14-
linearMSE.pth, on CLIP ViT-L/14) to safetensors once:
`safetensors.torch.save_file(torch.load(PTH), "aesthetic.safetensors")`.

Images and videos (every frame, scores averaged) are scored in batches on `device`; a sample
without media is missing (None).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from regen.errors import ConfigError
from regen.rewards.base import Sample, register


def _media(samples: list[Sample]) -> tuple[list[int], np.ndarray, list[int]]:
    """(indices of the samples with media, all their frames (N, H, W, C) uint8, frames per sample)."""
    idx, frames, counts = [], [], []
    for i, s in enumerate(samples):
        m = getattr(s, "media", None)
        if m is None:
            continue
        a = np.asarray(m)
        a = a[None] if a.ndim == 3 else a
        if a.ndim != 4 or a.shape[-1] not in (1, 3, 4):
            continue
        if a.dtype != np.uint8:  # floats in [0, 1]
            a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
        idx.append(i)
        frames.extend(a[..., :3] if a.shape[-1] != 1 else np.repeat(a, 3, axis=-1))
        counts.append(len(a))
    return idx, np.stack(frames) if frames else np.zeros((0, 1, 1, 3), np.uint8), counts


def _per_sample(values, idx: list[int], counts: list[int], n: int) -> list[float | None]:
    out: list[float | None] = [None] * n
    for i, parts in zip(idx, values.split(counts)):
        out[i] = float(parts.mean())
    return out


class _Clip:
    name = "clip"

    def __init__(self, model: str, device: str = "cpu", batch_size: int = 64):
        from regen.rewards.clip_model import load_clip

        if not model:
            raise ConfigError(f"{self.name}: args.model is required (a local CLIPModel folder)")
        self.model, self.processor = load_clip(model, device, f"{self.name}: args.model")
        self.batch_size = batch_size
        # the score changes with the weights: the folder's name and config are part of the version
        self.reward_version = f"1({Path(model).name})"

    def _embed(self, samples: list[Sample], text: bool):
        import torch

        from regen.rewards.clip_model import image_embeddings, text_embeddings

        idx, frames, counts = _media(samples)
        img = image_embeddings(self.model, self.processor, frames, self.batch_size) if idx else None
        txt = None
        if text and idx:
            txt = text_embeddings(self.model, self.processor, [samples[i].prompt for i in idx])
            txt = txt.repeat_interleave(torch.tensor(counts), dim=0)
        return idx, counts, img, txt


@register("clip_score", version="1", factory=True)
class ClipScore(_Clip):
    """Image-prompt similarity: `scale` x cos(CLIP image embedding, CLIP text embedding of the prompt).

    args: model (a local CLIPModel folder, required), scale (1.0; 100 gives the CLIP-score of
    torchmetrics / eval.metrics), device ('cpu'), batch_size (64). Videos: mean over frames.
    """

    name = "clip_score"

    def __init__(self, model: str = "", scale: float = 1.0, device: str = "cpu", batch_size: int = 64):
        super().__init__(model, device, batch_size)
        self.scale = float(scale)

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        import torch

        idx, counts, img, txt = self._embed(samples, text=True)
        if not idx:
            return [None] * len(samples)
        cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
        return _per_sample(self.scale * cos, idx, counts, len(samples))


@register("pickscore", version="1", factory=True)
class PickScore(_Clip):
    """PickScore-style preference (Kirstain et al. 2023): the CLIP model's learned logit scale x cos(image, prompt).

    args: model (a local CLIPModel folder such as PickScore_v1, required), device ('cpu'),
    batch_size (64). Higher is preferred; differences between two images of one prompt are
    the preference logits the model was trained on.
    """

    name = "pickscore"

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        import torch

        idx, counts, img, txt = self._embed(samples, text=True)
        if not idx:
            return [None] * len(samples)
        scale = float(self.model.logit_scale.detach().exp())
        cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
        return _per_sample(scale * cos, idx, counts, len(samples))


def load_head(path: str | Path, activation: str = "none"):
    """An MLP head from safetensors: every 'PREFIX.N.weight' / 'PREFIX.N.bias' pair a Linear
    layer, in the order of N (the LAION aesthetic predictor's 'layers.0', 'layers.2', ...). LAION's
    MLP has no activation between its layers (dropout only, off at inference): activation 'none';
    'relu' or 'gelu' for heads trained with one."""
    import torch
    from safetensors.torch import load_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"aesthetic: args.head '{file}' does not exist (a safetensors file of Linear layers)")
    try:
        state = load_file(str(file))
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise ConfigError(f"aesthetic: args.head '{file}' is not a readable safetensors file ({e})") from None
    layers: dict[int, dict] = {}
    for key, t in state.items():
        m = re.fullmatch(r"(?:.*\.)?(\d+)\.(weight|bias)", key)
        if m is None:
            raise ConfigError(f"aesthetic: args.head '{file}': tensor '{key}' is not 'PREFIX.N.weight' or '.bias'")
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    act = {"none": None, "relu": torch.nn.ReLU, "gelu": torch.nn.GELU}
    if activation not in act:
        raise ConfigError(f"aesthetic: args.activation '{activation}': one of {', '.join(act)}")
    mods: list = []
    for n, k in enumerate(sorted(layers)):
        w = layers[k].get("weight")
        if w is None or w.dim() != 2:
            raise ConfigError(f"aesthetic: args.head '{file}': layer {k} has no 2-D weight")
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias="bias" in layers[k])
        with torch.no_grad():
            lin.weight.copy_(w)
            if "bias" in layers[k]:
                lin.bias.copy_(layers[k]["bias"])
        if n and act[activation] is not None:
            mods.append(act[activation]())
        mods.append(lin)
    head = torch.nn.Sequential(*mods).eval()
    if head[-1].out_features != 1:
        raise ConfigError(f"aesthetic: args.head '{file}' ends in {head[-1].out_features} outputs; a score needs 1")
    return head


@register("aesthetic", version="1", factory=True)
class Aesthetic(_Clip):
    """Aesthetic score: an MLP head (safetensors) on the L2-normalised CLIP image embedding, as the LAION predictor.

    args: model (a local CLIPModel folder, required: the one the head was trained on, ViT-L/14
    for LAION's), head (safetensors file of Linear layers, required), activation ('none' as in
    LAION's MLP; 'relu', 'gelu'), normalize (True: L2-normalise the embedding first), device,
    batch_size. Videos: mean over frames. No prompt is read.
    """

    name = "aesthetic"

    def __init__(self, model: str = "", head: str = "", activation: str = "none", normalize: bool = True,
                 device: str = "cpu", batch_size: int = 64):
        super().__init__(model, device, batch_size)
        if not head:
            raise ConfigError("aesthetic: args.head is required (safetensors file of the MLP head)")
        self.head = load_head(head, activation).to(device)
        dim = self.head[0].in_features
        proj = self.model.config.projection_dim
        if dim != proj:
            raise ConfigError(f"aesthetic: args.head takes {dim} inputs, the CLIP model's embedding has {proj}")
        self.normalize = normalize
        self.reward_version = f"1({Path(model).name},{Path(head).name})"

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        import torch

        idx, counts, img, _ = self._embed(samples, text=False)
        if not idx:
            return [None] * len(samples)
        if self.normalize:
            img = torch.nn.functional.normalize(img, dim=-1)
        with torch.no_grad():
            scores = self.head(img.to(next(self.head.parameters()).device)).squeeze(-1).float().cpu()
        return _per_sample(scores, idx, counts, len(samples))
