"""Feature extractors for distribution metrics (FID, KID, precision/recall): uint8 media in,
one feature vector per sample out, loaded once per run.

  shapes          the built-in shapes adherence classifier's penultimate layer (96 values, scaled
                  to unit RMS on true drawings; the demo and tests: no download, trained and
                  cached on first use)
  clip:PATH       a local transformers CLIPModel folder: its projected image embedding (videos:
                  the mean over frames)
  inception:PATH  Inception-v3 of FID's reference implementation (torch-fidelity's
                  pt_inception-2015-12-05 weights file at PATH), pool features (2048); the
                  number papers report
Nothing is downloaded: a path that does not exist is one error naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from regen.errors import UserError

KINDS = ("shapes", "clip:PATH", "inception:PATH")


def _batches(media: np.ndarray, size: int = 256):
    for i in range(0, len(media), size):
        yield torch.from_numpy(np.ascontiguousarray(media[i: i + size]))


class ShapesFeatures:
    """Penultimate activations of the shapes adherence classifier (regen/rewards/adherence.py)."""

    name = "shapes"

    def __init__(self, kind: str):
        from regen.rewards import adherence

        self.kind = kind
        model, _ = adherence.load(kind)
        self.body = model[:-1].eval()  # up to the last ReLU: 96 values that tell colour, shape and place apart
        # scaled to unit RMS on true drawings, as Inception's pool features roughly are: KID's kernel
        # (x.y / d + 1)^3 is cubed, and at the raw scale (~10 per value) it drowned in its own noise
        draws = adherence._draw(kind, 512, torch.Generator().manual_seed(2024))[0]
        with torch.no_grad():
            self.scale = float(self.body(((draws.clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1).pow(2).mean().sqrt())

    @torch.no_grad()
    def __call__(self, media: np.ndarray) -> torch.Tensor:
        from regen.rewards.adherence import _media_shape

        want = _media_shape(self.kind)
        if tuple(media.shape[1:]) != want:
            raise UserError(f"eval.features=shapes reads the shapes task's {self.kind}s of shape {want}; "
                            f"these are {tuple(media.shape[1:])}: set eval.features to clip:PATH or inception:PATH")
        out = [self.body(x.float().div(127.5).sub(1).movedim(-1, -3)) for x in _batches(media)]
        return torch.cat(out).double() / self.scale


class ClipFeatures:
    """CLIP image embeddings from a local folder (CLIPModel + its processor)."""

    def __init__(self, path: str, device: str = "cpu"):
        from regen.rewards.clip_model import load_clip

        self.name = f"clip:{path}"
        self.model, self.processor = load_clip(path, device, "eval.features")

    def __call__(self, media: np.ndarray) -> torch.Tensor:
        from regen.rewards.clip_model import image_embeddings

        frames = media.reshape(-1, *media.shape[-3:]) if media.ndim == 5 else media
        feats = image_embeddings(self.model, self.processor, frames)
        if media.ndim == 5:  # a video: the mean of its frames' embeddings
            feats = feats.view(media.shape[0], media.shape[1], -1).mean(1)
        return feats.double()


class InceptionFeatures:
    """FID's Inception-v3 (torchmetrics' port of the TF graph) from a local weights file."""

    def __init__(self, path: str, device: str = "cpu"):
        self.name, self.device = f"inception:{path}", device
        file = _local(path, "inception")
        try:
            from torchmetrics.image.fid import NoTrainInceptionV3
        except ImportError:
            raise UserError("eval.features inception:PATH needs torch-fidelity (pip install torch-fidelity)") from None
        try:
            self.net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"],
                                          feature_extractor_weights_path=str(file)).to(device)
        except (ModuleNotFoundError, RuntimeError, OSError) as e:
            raise UserError(f"eval.features inception:{path}: cannot load ({str(e).splitlines()[0]}); "
                            "it needs torch-fidelity and its pt_inception-2015-12-05 weights file") from None

    @torch.no_grad()
    def __call__(self, media: np.ndarray) -> torch.Tensor:
        frames = media.reshape(-1, *media.shape[-3:]) if media.ndim == 5 else media
        out = [self.net(x.movedim(-1, -3).to(self.device)).float().cpu() for x in _batches(frames, 64)]
        feats = torch.cat(out)
        if media.ndim == 5:
            feats = feats.view(media.shape[0], media.shape[1], -1).mean(1)
        return feats.double()


def _local(path: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"eval.features {what}:{path}: '{p}' does not exist (nothing is downloaded: give a local "
                        f"{'CLIPModel folder' if what == 'clip' else 'Inception weights file'})")
    return p


def check_spec(spec: str) -> None:
    """UserError now for a malformed spec or a path that does not exist (before a run starts)."""
    if spec == "shapes":
        return
    for prefix, what in (("clip:", "clip"), ("inception:", "inception")):
        if spec.startswith(prefix):
            if not spec[len(prefix):]:
                raise UserError(f"eval.features '{spec}': give the path after '{prefix}'")
            _local(spec[len(prefix):], what)
            return
    raise UserError(f"eval.features '{spec}': must be one of {', '.join(KINDS)}")


def load_features(spec: str, kind: str, device: str = "cpu"):
    """The extractor that eval.features names; kind is 'image' or 'video' (for the shapes classifier)."""
    check_spec(spec)
    if spec == "shapes":
        return ShapesFeatures(kind)
    cls, path = (ClipFeatures, spec[5:]) if spec.startswith("clip:") else (InceptionFeatures, spec[10:])
    return cls(path, device)
