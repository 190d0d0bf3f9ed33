"""Held-out evaluation settings (`eval:`): what is sampled, the quality metrics (regen/quality)
and the gates."""

from __future__ import annotations

import operator
import re
from typing import Any

from pydantic import Field, field_validator

from regen.config.base import Section

# eval.metrics (computed by regen/quality)
MEDIA = ("fid", "kid", "precision_recall", "ssim", "psnr", "temporal_ssim", "clip_score")
TEXT = ("bleu4", "chrf", "exact_match", "length")
KNOWN = MEDIA + TEXT
DISTRIBUTION = ("fid", "kid", "precision_recall")  # read eval.features
ALIGNED = ("ssim", "psnr")  # compare sample i with reference i
REFUSED = {"lpips": "LPIPS needs torchvision and its pretrained backbone weights, which regen cannot download; "
                    "use ssim/psnr, or fid/kid with eval.features clip:PATH"}


def check_names(names: list[str]) -> None:
    """ValueError for an unknown or refused metric name (config validation)."""
    for n in names:
        if n in REFUSED:
            raise ValueError(f"eval.metrics: '{n}' is not available: {REFUSED[n]}")
        if n not in KNOWN:
            raise ValueError(f"eval.metrics: unknown metric '{n}'; images/videos: {', '.join(MEDIA)}; "
                             f"text: {', '.join(TEXT)}")


# eval.gates (checked by regen/quality/gates.py)
OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
_FORM = re.compile(r"^\s*(<=|>=|<|>)\s*([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)\s*$")


def parse(metric: str, rule: str | float) -> tuple[str, float]:
    """('<=', 15.0) from '<= 15'; ValueError naming the gate otherwise."""
    m = _FORM.match(str(rule))
    if not m:
        raise ValueError(f"eval.gates.{metric}: '{rule}' is not a threshold; write it as '<= 15', '>= 0.3', '< 1' "
                         "or '> 0'")
    return m.group(1), float(m.group(2))


class EvalConfig(Section):
    every: int = Field(0, ge=0, description="Evaluate every N steps; 0 = only before the first and after the last.")
    num_prompts: int = Field(256, ge=1, description="Held-out prompts per evaluation (first N of data.eval).")
    samples_per_prompt: int = Field(1, ge=1, description="Completions sampled per held-out prompt.")
    temperature: float | None = Field(None, gt=0.0, description="Eval temperature; null = rollout.temperature.")
    greedy: bool = Field(False, description="Also report greedy (argmax) accuracy.")
    batch_size: int = Field(256, ge=1, description="Prompts per generation batch during eval.")
    metrics: list[str] = Field(
        default_factory=list, description="Quality metrics of the held-out samples, logged as eval/NAME beside the "
        "reward. Images/videos: fid, kid, precision_recall (eval/precision, eval/recall), ssim, psnr (against "
        "eval.reference), temporal_ssim (videos), clip_score (eval.clip_model). Text: bleu4, chrf, exact_match "
        "(against each row's 'reference', else 'answer'), length. See docs/evaluation.md.")
    reference: str | None = Field(
        None, description="What fid/kid/precision_recall/ssim/psnr compare with: 'shapes' (the built-in task's own "
        "drawings of the held-out prompts), 'base' (the starting model's samples: drift), a folder of images, or "
        "hf:NAME[:SPLIT] (an 'image' column). null = shapes for the built-in shapes prompts.")
    features: str = Field(
        "shapes", description="Feature space of fid/kid/precision_recall: 'shapes' (the built-in shapes classifier), "
        "'clip:PATH' (a local CLIPModel folder) or 'inception:PATH' (FID's Inception-v3 weights file; needs "
        "torch-fidelity). Nothing is downloaded.")
    clip_model: str | None = Field(None, description="Local CLIPModel folder (with tokenizer and image processor) for "
                                   "eval.metrics clip_score.")
    metric_samples: int | None = Field(
        None, ge=2, description="Compute eval.metrics on the first N held-out samples only (their cost); null = all "
        "num_prompts x samples_per_prompt. FID is biased upward at small N: compare runs at the same N.")
    gates: dict[str, str] = Field(
        default_factory=dict, description="Acceptance thresholds on eval metrics (names without 'eval/'), e.g. "
        "{fid: '<= 15', bleu4: '>= 0.3', reward: '> 0.5'}. Each evaluation logs eval/gate/NAME and eval/gates_passed, "
        "a failed gate raises an alert, and `regen export --require-gates` refuses a checkpoint whose evaluation "
        "failed.")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        check_names(v)
        if len(set(v)) != len(v):
            raise ValueError(f"eval.metrics: {v} names a metric twice")
        return v

    @field_validator("gates", mode="before")
    @classmethod
    def _gate_rules(cls, v: Any) -> Any:
        if isinstance(v, dict):
            v = {str(k): str(r) for k, r in v.items()}
            for k, r in v.items():
                parse(k, r)
        return v
