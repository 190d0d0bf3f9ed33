"""Generation-quality metrics of held-out samples (eval.metrics), beside the reward.

A rising reward can hide a model that lost fidelity or diversity (reward hacking); these
measure the samples themselves against references:

  images, videos  fid, kid (FID/KID against eval.reference in eval.features space),
                  precision_recall (logged as precision and recall), ssim, psnr (against the
                  aligned reference), temporal_ssim (videos, reference-free), clip_score
                  (with eval.clip_model)
  text            bleu4, chrf, exact_match (against each row's 'reference', else 'answer'),
                  length (characters)

`Quality` is built once per run: the feature extractor and the reference features are
loaded or computed once and reused at every evaluation.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from regen.config.eval import (  # noqa: F401  (the names are config's: eval.metrics is checked on load)
    ALIGNED,
    DISTRIBUTION,
    KNOWN,
    MEDIA,
    REFUSED,
    TEXT,
    check_names,
)
from regen.errors import UserError


def uses_reference(names: list[str]) -> bool:
    return any(n in DISTRIBUTION + ALIGNED for n in names)


class Quality:
    """eval.metrics for one run (or one `regen eval`): call it on the held-out samples."""

    def __init__(self, e, modality: str, seed: int = 0, device: str = "cpu"):
        self.names, self.e, self.seed, self.device = list(e.metrics), e, seed, device
        wrong = [n for n in self.names if n in (TEXT if modality == "flow" else MEDIA)]
        if wrong:
            kind = "text" if modality == "flow" else "images or videos"
            raise UserError(f"eval.metrics: {', '.join(wrong)} measure {kind}; this run trains "
                            f"{'an image/video flow model' if modality == 'flow' else 'a language model'}")
        if "clip_score" in self.names and not e.clip_model:
            raise UserError("eval.metrics: clip_score needs eval.clip_model, a local CLIPModel folder")
        # eval.reference=base: where a run keeps its starting model's samples (set by Run.start; None
        # keeps them in memory only, as the offline trainers, whose text metrics never read them)
        self.base_file: Path | None = None
        self.write_base = True  # under torchrun only rank 0 writes it; every rank reads it on resume
        self._features = None
        self._ref_media: np.ndarray | None = None
        self._ref_feats: torch.Tensor | None = None
        self.missing_base = False  # eval.reference=base, resumed without the saved base samples
        if any(n in DISTRIBUTION for n in self.names):
            from regen.quality.features import check_spec

            check_spec(e.features)
        if "clip_score" in self.names:
            from regen.rewards.clip_model import load_clip

            load_clip(e.clip_model, device)  # a wrong path stops the run before it trains
        if uses_reference(self.names) and e.reference not in (None, "shapes", "base"):
            # a folder or dataset: read now, so a wrong path stops the run before it trains
            from regen.quality.reference import folder_reference, hf_reference

            load = hf_reference if str(e.reference).startswith("hf:") else folder_reference
            self._ref_media = load(e.reference)

    def check_items(self, items) -> None:
        """UserError now, before any step, for settings the held-out rows cannot serve: the shapes
        features or references with prompts that are not the built-in shapes task's."""
        shapes = bool(items) and all("colour" in it.meta for it in items)
        needs = [n for n in self.names if n in DISTRIBUTION + ALIGNED]
        if needs and not shapes and self.e.reference in (None, "shapes"):
            raise UserError(f"eval.metrics {', '.join(needs)} need eval.reference (base, a folder of images or "
                            "hf:NAME[:SPLIT]): 'shapes' draws only the built-in shapes prompts")
        if any(n in DISTRIBUTION for n in self.names) and not shapes and self.e.features == "shapes":
            raise UserError("eval.features=shapes is the built-in shapes classifier, for the shapes task's images; "
                            "set eval.features to clip:PATH or inception:PATH for these prompts")

    def __bool__(self) -> bool:
        return bool(self.names)

    # ------------------------------------------------------------------ media

    def _feats(self, media: np.ndarray) -> torch.Tensor:
        if self._features is None:
            from regen.quality.features import load_features

            self._features = load_features(self.e.features, "video" if media.ndim == 5 else "image", self.device)
        return self._features(media)

    def _reference(self, media: np.ndarray, metas: list[dict], step: int) -> np.ndarray | None:
        """The reference media (None: 'base' not available yet, see below)."""
        ref = self.e.reference or ("shapes" if all("colour" in m for m in metas) else None)
        if ref is None:
            raise UserError(f"eval.metrics {', '.join(n for n in self.names if n in DISTRIBUTION + ALIGNED)} need "
                            "eval.reference: shapes, base, a folder of images or hf:NAME[:SPLIT]")
        if self._ref_media is not None:
            return self._ref_media
        if ref == "shapes":
            from regen.quality.reference import shapes_reference

            self._ref_media = shapes_reference(metas, self.seed + 104729)
        elif ref == "base":
            self._ref_media = self._base(media, step)
        return self._ref_media

    def _base(self, media: np.ndarray, step: int) -> np.ndarray | None:
        """The starting model's samples: those of the evaluation at step 0 (the run has not
        trained yet), kept in RUN/eval/base_reference.npz so a resumed run measures drift
        from the same set."""
        f = self.base_file
        if f is not None and f.is_file():
            return np.load(f)["media"]
        if step != 0:
            return None
        if f is not None and self.write_base:
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_name(f".tmp-{f.name}")
            with open(tmp, "wb") as fh:
                np.savez_compressed(fh, media=media)
            tmp.replace(f)
        return media.copy()

    def set_base(self, media: np.ndarray) -> None:
        """`regen eval --reference base`: the starting model's samples, sampled by the caller."""
        self._ref_media = media

    def _media_metrics(self, samples, step: int) -> dict[str, float]:
        media = np.stack([np.asarray(s.media) for s in samples])
        out: dict[str, float] = {}
        if "temporal_ssim" in self.names:
            from regen.quality.pixels import temporal_ssim

            if media.ndim != 5:
                raise UserError("eval.metrics: temporal_ssim measures videos; these samples are images")
            out["temporal_ssim"] = temporal_ssim(media)
        if "clip_score" in self.names:
            out["clip_score"] = self._clip_score(media, [s.prompt for s in samples])
        if not uses_reference(self.names):
            return out
        ref = self._reference(media, [s.meta for s in samples], step)
        self.missing_base = ref is None
        if ref is None:
            return out  # 'base' on a run resumed without its base_reference.npz: Run raises an alert
        if ref.shape[1:] != media.shape[1:]:
            raise UserError(f"eval.reference: reference media are {ref.shape[1:]}, the samples {media.shape[1:]}")
        if any(n in ALIGNED for n in self.names):
            from regen.quality.pixels import psnr, ssim

            if len(ref) < len(media):
                raise UserError(f"eval.metrics ssim/psnr compare each sample with the reference at its index: "
                                f"{len(media)} samples, {len(ref)} references")
            if "ssim" in self.names:
                out["ssim"] = ssim(media, ref[: len(media)])
            if "psnr" in self.names:
                out["psnr"] = psnr(media, ref[: len(media)])
        if any(n in DISTRIBUTION for n in self.names):
            from regen.quality.distribution import fid, kid, precision_recall

            if self._ref_feats is None or len(self._ref_feats) != len(ref):
                self._ref_feats = self._feats(ref)
            fake, real = self._feats(media), self._ref_feats
            try:
                if "fid" in self.names:
                    out["fid"] = fid(fake, real)
                if "kid" in self.names:
                    out["kid"], out["kid_std"] = kid(fake, real, seed=self.seed)
                if "precision_recall" in self.names:
                    out["precision"], out["recall"] = precision_recall(fake, real)
            except ValueError as err:
                raise UserError(f"eval.metrics: {err}: raise eval.num_prompts or eval.samples_per_prompt") from None
        return out

    def _clip_score(self, media: np.ndarray, prompts: list[str]) -> float:
        from regen.rewards.clip_model import clip_score, load_clip

        return clip_score(*load_clip(self.e.clip_model, self.device), media, prompts)

    # ------------------------------------------------------------------ text

    @staticmethod
    def _text_metrics(names: list[str], samples) -> dict[str, float]:
        from regen.quality import text

        out: dict[str, float] = {}
        if "length" in names:
            out["length"] = sum(len(s.completion) for s in samples) / max(len(samples), 1)
        wanted = [n for n in names if n in ("bleu4", "chrf", "exact_match")]
        if not wanted:
            return out
        refs = [s.meta.get("reference", s.meta.get("answer")) for s in samples]
        if any(r is None for r in refs):
            raise UserError(f"eval.metrics {', '.join(wanted)}: every held-out row needs a 'reference' (or 'answer') "
                            "field to compare the completion with (data.eval)")
        hyps, refs = [s.completion for s in samples], [str(r) for r in refs]
        for n in wanted:
            out[n] = getattr(text, n)(hyps, refs)
        return out

    # ------------------------------------------------------------------ entry

    def __call__(self, samples, step: int = 0) -> dict[str, float]:
        """The metrics (names without 'eval/') of the first eval.metric_samples samples, and
        time/quality_s, the seconds they took."""
        if not self.names or not samples:
            return {}
        t0 = time.perf_counter()
        samples = samples[: self.e.metric_samples] if self.e.metric_samples else samples
        if samples[0].media is not None:
            out = self._media_metrics(samples, step)
        else:
            out = self._text_metrics(self.names, samples)
        out = {k: (v if math.isfinite(v) else math.nan) for k, v in out.items()}
        return {**out, "quality_s": time.perf_counter() - t0}
