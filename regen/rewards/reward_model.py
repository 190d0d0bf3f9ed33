"""`reward_model`: a learned text reward, the scalar head of a local
AutoModelForSequenceClassification folder with one output (what `regen rm` exports; public
reward models such as Skywork-Reward or ArmoRM-style heads load the same way).

The text scored is the RM's own view of the exchange: with its tokenizer's chat template (when
it has one and chat_template is not false) the conversation (Sample.meta["messages"], or the
prompt as one user turn) plus the completion as the assistant turn; otherwise prompt +
completion as one string. Sequences longer than max_length lose tokens from the start (the
prompt side): the score is read at the last token, which the completion ends on, so the end is
what must survive; each truncation is counted in reward/<name>/truncated. Batches are formed by
token count (batch_tokens, after sorting by length) so one long sample does not pad a whole
batch. normalize: the scores minus the running mean over the scores seen so far, divided by
the running std (Welford), with the running figures logged as reward/<name>/running_mean and
running_std.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from regen.errors import ConfigError
from regen.rewards.base import Sample, register

if TYPE_CHECKING:
    import torch


def exchange_ids(tok, prompt: str, completion: str, messages: list | None, chat: bool,
                 max_length: int) -> tuple[list[int], bool]:
    """(token ids a reward model scores, whether they were truncated): the conversation plus the
    completion as the assistant turn through the tokenizer's chat template when `chat`, else
    prompt + completion; longer than max_length loses tokens from the start. `regen rm` trains
    on exactly what this gives, so a trained model is scored as it was trained."""
    if chat:
        msgs = messages or [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template([*msgs, {"role": "assistant", "content": completion}], tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(prompt + completion)["input_ids"]
    return (ids[-max_length:], True) if len(ids) > max_length else (ids, False)


def score_batches(model, pad_id: int, ids: list[list[int]], batch_tokens: int, device) -> torch.Tensor:
    """The scalar head's score of each sequence (N,), batched by padded token count after sorting
    by length (right padding; a causal model's last real token does not see the padding)."""
    import torch

    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = torch.empty(len(ids), device=device)
    i = 0
    while i < len(order):
        j = i + 1  # grow the batch while its padded size fits
        while j < len(order) and len(ids[order[j]]) * (j + 1 - i) <= batch_tokens:
            j += 1
        rows = order[i:j]
        width = len(ids[rows[-1]])
        batch = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, k in enumerate(rows):
            batch[r, : len(ids[k])] = torch.tensor(ids[k])
            mask[r, : len(ids[k])] = 1
        logits = model(input_ids=batch.to(device), attention_mask=mask.to(device)).logits
        out[torch.tensor(rows, device=device)] = logits[:, 0].float()
        i = j
    return out


@register("reward_model", version="1", factory=True)
class RewardModel:
    """Score of a learned reward model (a local AutoModelForSequenceClassification folder with one output).

    args: path (required: a local folder, or a hub id where a network exists), device ('cpu'),
    dtype ('float32'), max_length (1024 tokens; longer loses tokens from the start), batch_tokens
    (16384 padded tokens per forward), chat_template ('auto': the RM tokenizer's template when it
    has one; true; false), normalize (False: running mean/std). An empty completion is scored too.
    """

    def __init__(self, path: str = "", device: str = "cpu", dtype: str = "float32", max_length: int = 1024,
                 batch_tokens: int = 16384, chat_template: str | bool = "auto", normalize: bool = False):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging

        if not path:
            raise ConfigError("reward_model: args.path is required (a local sequence-classification model folder)")
        from regen.policies.lm_load import _looks_local

        folder = Path(path).expanduser()
        hub = not folder.exists() and not _looks_local(path)  # 'org/name', where a network or a hub cache exists
        if not hub and not (folder / "config.json").is_file():
            raise ConfigError(f"reward_model: args.path '{folder}' is not a model folder (no config.json in it)")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"reward_model: args.dtype '{dtype}': float32, bfloat16 or float16")
        if max_length < 2 or batch_tokens < max_length:
            raise ConfigError(f"reward_model: args.max_length ({max_length}) must be >= 2 and batch_tokens "
                              f"({batch_tokens}) at least max_length")
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()
        try:
            source = path if hub else str(folder)
            self.tok = AutoTokenizer.from_pretrained(source)
            self.model = AutoModelForSequenceClassification.from_pretrained(source, dtype=getattr(torch, dtype))
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward_model: cannot load '{folder}': {str(e).splitlines()[0]}") from None
        finally:
            logging.set_verbosity(verbosity)
        if self.model.config.num_labels != 1:
            raise ConfigError(f"reward_model: '{folder}' has {self.model.config.num_labels} outputs; a reward model "
                              "has one (num_labels=1)")
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token or self.tok.unk_token
        self.model.config.pad_token_id = self.tok.pad_token_id  # where the head reads each row's last token
        self.model.to(device).eval()
        self.device, self.max_length, self.batch_tokens = device, int(max_length), int(batch_tokens)
        has = bool(getattr(self.tok, "chat_template", None))
        if chat_template is True and not has:
            raise ConfigError(f"reward_model: args.chat_template=true but '{folder}' has no chat template")
        self.chat = has if chat_template == "auto" else bool(chat_template)
        self.normalize = normalize
        self.n, self.mean, self.m2, self.truncated, self.last_raw = 0, 0.0, 0.0, 0, math.nan
        self.reward_version = f"1({folder.name})"

    def encode(self, s: Sample) -> list[int]:
        """The token ids the model scores for one sample (see the module doc)."""
        ids, cut = exchange_ids(self.tok, s.prompt, s.completion, s.meta.get("messages"), self.chat, self.max_length)
        self.truncated += cut
        return ids

    def raw(self, samples: list[Sample]) -> list[float]:
        """The head's score of each sample, batched by padded token count."""
        import torch

        with torch.no_grad():
            scores = score_batches(self.model, self.tok.pad_token_id, [self.encode(s) for s in samples],
                                   self.batch_tokens, self.device)
        return scores.tolist()

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        scores = self.raw(samples)
        self.last_raw = sum(scores) / len(scores) if scores else math.nan
        if not self.normalize:
            return scores
        for x in scores:  # Welford: the running figures include this batch
            self.n += 1
            d = x - self.mean
            self.mean += d / self.n
            self.m2 += d * (x - self.mean)
        std = math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 1.0
        return [(x - self.mean) / (std if std > 0 else 1.0) for x in scores]

    def stats(self) -> dict[str, float]:
        out = {"raw_mean": self.last_raw, "truncated": float(self.truncated)}
        if self.normalize:
            out |= {"running_mean": self.mean,
                    "running_std": math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else math.nan}
        return out
