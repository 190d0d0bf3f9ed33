"""Held-out evaluation settings (`eval:`): what is sampled, the quality metrics (regen/quality)
and the gates."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from regen.config.base import Section


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
        from regen.quality import check_names

        check_names(v)
        if len(set(v)) != len(v):
            raise ValueError(f"eval.metrics: {v} names a metric twice")
        return v

    @field_validator("gates", mode="before")
    @classmethod
    def _gate_rules(cls, v: Any) -> Any:
        from regen.quality.gates import parse

        if isinstance(v, dict):
            v = {str(k): str(r) for k, r in v.items()}
            for k, r in v.items():
                parse(k, r)
        return v
