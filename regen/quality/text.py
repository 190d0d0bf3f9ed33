"""Text against reference answers, through sacrebleu: corpus BLEU-4 and chrF (both reported on
0..1, as deployment thresholds such as "BLEU-4 >= 0.3" are written), exact match and length."""

from __future__ import annotations


def bleu4(hyps: list[str], refs: list[str]) -> float:
    """Corpus BLEU with 4-grams, sacrebleu's default 13a tokenisation and exponential
    smoothing (Papineni et al. 2002; Post 2018), divided by 100."""
    from sacrebleu.metrics import BLEU

    return BLEU().corpus_score(hyps, [refs]).score / 100.0


def chrf(hyps: list[str], refs: list[str]) -> float:
    """Corpus chrF (character 6-grams, beta 2; Popovic 2015), divided by 100."""
    from sacrebleu.metrics import CHRF

    return CHRF().corpus_score(hyps, [refs]).score / 100.0


def exact_match(hyps: list[str], refs: list[str]) -> float:
    """Share of completions equal to their reference after stripping surrounding whitespace."""
    return sum(h.strip() == r.strip() for h, r in zip(hyps, refs)) / max(len(hyps), 1)
