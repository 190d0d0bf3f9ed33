"""Prompt sets and demonstrations: JSONL files or built-in tasks, and a resumable sampler."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from regen.errors import DataError


@dataclass
class PromptItem:
    prompt: str
    meta: dict[str, Any] = field(default_factory=dict)  # passed to rewards (e.g. the reference answer)
    image: Any = None  # uint8 (H, W, 3) pixels of the row's 'image' (vision-language models; regen/data/images.py)


@dataclass
class Demo:
    prompt: str
    completion: str
    meta: dict[str, Any] = field(default_factory=dict)
    image: Any = None  # as PromptItem.image
    # data.chat_template: the conversation as the template writes it, (text, trained) pieces in order (trained: an
    # assistant turn and its end-of-turn marks); the sequence is their concatenation, tokenised piece by piece
    segments: list[tuple[str, bool]] | None = None


@dataclass
class PrefPair:
    prompt: str
    chosen: str
    rejected: str
    meta: dict[str, Any] = field(default_factory=dict)
    image: Any = None  # as PromptItem.image: the image(s) both responses answer about


# builtin:NAME:SPLIT -> what makes its prompts, demonstrations and preference pairs ("module:function" in
# regen/tasks/, which builds on the row types above): looked up when asked for, not imported here.
# prompts and pairs take (split, task), demos (task): `task` is the config's task section.
BUILTIN = {
    "arithmetic": {"prompts": "regen.tasks.arithmetic:builtin_prompts", "demos": "regen.tasks.arithmetic:builtin_demos",
                   "pairs": "regen.tasks.arithmetic:builtin_pairs"},
    # multiplication with a calculator tool (the tool-use demo); -notool: the same prompts, direct-answer demos
    "calc": {"prompts": "regen.tasks.calc:builtin_prompts", "demos": "regen.tasks.calc:builtin_demos"},
    "calc-notool": {"prompts": "regen.tasks.calc:builtin_prompts", "demos": "regen.tasks.calc:builtin_demos_notool"},
    "shapes": {"prompts": "regen.tasks.shapes:image_prompts"},  # image prompts, meta = the drawn attributes
    "moving-shapes": {"prompts": "regen.tasks.shapes:video_prompts"},
    "shapes-vqa": {"prompts": "regen.tasks.shapes_vqa:builtin_prompts",  # questions about drawn shapes, with images
                   "demos": "regen.tasks.shapes_vqa:builtin_demos", "pairs": "regen.tasks.shapes_vqa:builtin_pairs"},
    # the shapes prompts in words the painter does not know (joint runs)
    "shapes-paraphrase": {"prompts": "regen.tasks.shapes_paraphrase:builtin_prompts",
                          "demos": "regen.tasks.shapes_paraphrase:builtin_demos"},
}
# Splits beyond train / test: shapes-paraphrase:phrasings holds the training attribute combinations in
# the held-out phrasings (regen/tasks/shapes_paraphrase.py).
EXTRA_SPLITS = {"shapes-paraphrase": ("phrasings",)}


def _builtin(spec: str, kind: str):
    """The maker of `kind` ("prompts", "demos", "pairs") that builtin:NAME:SPLIT names, and the split."""
    import importlib

    tasks = tuple(n for n, made in BUILTIN.items() if kind in made)
    parts = spec.split(":")
    if len(parts) != 3 or parts[1] not in tasks or parts[2] not in ("train", "test", *EXTRA_SPLITS.get(parts[1], ())):
        known = ", ".join(f"builtin:{t}:{s}" for t in tasks for s in ("train", "test", *EXTRA_SPLITS.get(t, ())))
        raise DataError(f"unknown built-in data '{spec}' (known here: {known})")
    module, _, fn = BUILTIN[parts[1]][kind].partition(":")
    return getattr(importlib.import_module(module), fn), parts[2]


def read_jsonl(path: str, required: tuple[str, ...], where: str, skip_bad: bool = False) -> list[dict]:
    """Rows of a JSONL file. A malformed line is an error naming file and line, or, with
    skip_bad, is skipped and counted in a warning."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{where}: prompt file '{path}' not found")
    rows = []
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"{where}: cannot read '{path}': {e.strerror}") from None
    bad: list[str] = []
    for n, data in enumerate(raw.split(b"\n"), 1):
        if not data.strip():
            continue
        try:
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path} line {n}: not valid UTF-8 (corrupt bytes)") from None
            rows.append(_parse_row(line, path, n, required))
        except DataError as e:
            if not skip_bad:
                raise
            bad.append(str(e))
    if bad:
        print(f"warning: {where}: skipped {len(bad)} malformed line(s) of '{path}', first: {bad[0]}")
    if not rows:
        raise DataError(f"{where}: '{path}' holds no rows")
    return rows


def _parse_row(line: str, path: str, n: int, required: tuple[str, ...]) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {n}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
    for key in required:
        if not isinstance(row.get(key), str):
            example = json.dumps({k: "..." for k in required})
            raise DataError(f"{path} line {n}: field '{key}' missing or not a string (each row here needs "
                            f"{', '.join(repr(k) for k in required)}: {example}, plus any fields of your own)")
    return row


def read_rows(spec: str, required: tuple[str, ...], where: str, skip_bad: bool = False,
              columns: dict[str, str] | None = None) -> list[dict]:
    """Rows of a JSONL file, or of a Hugging Face dataset for 'hf:NAME_OR_PATH[:SPLIT]'."""
    if spec.startswith("hf:"):
        from regen.data.hf import read_hf

        return read_hf(spec, required, where, columns)
    return read_jsonl(spec, required, where, skip_bad)


def load_prompts(spec: str, task, where: str, skip_bad: bool = False,
                 columns: dict[str, str] | None = None, chat: bool = False) -> list[PromptItem]:
    """`spec` is a JSONL path (rows with 'prompt'; other fields become meta), 'hf:DATASET[:SPLIT]'
    or 'builtin:arithmetic:SPLIT'. chat: rows may hold 'messages' instead of 'prompt' (rendered
    later by regen.data.chat.render)."""
    if spec.startswith("builtin:"):
        make, split = _builtin(spec, "prompts")
        return make(split, task)
    rows = read_rows(spec, () if chat else ("prompt",), where, skip_bad, columns)
    return _with_images([PromptItem(prompt=r.pop("prompt", None), meta=r) for r in rows], spec, where)


def _with_images(items: list, spec: str, where: str) -> list:
    """Rows with an 'image' field get its pixels decoded now (regen/data/images.py): a missing or
    corrupt image stops the run before it starts."""
    if any("image" in it.meta for it in items):
        from regen.data.images import attach_images

        attach_images(items, f"{where} '{spec}'", None if spec.startswith("hf:") else Path(spec).parent)
    return items


def load_demos(spec: str, task, where: str, skip_bad: bool = False,
               columns: dict[str, str] | None = None, chat: bool = False) -> list[Demo]:
    """Demonstrations: JSONL rows with 'prompt' and 'completion', or the noisy built-in ones. chat: rows may hold
    'messages' (a conversation ending in an assistant turn) instead (rendered by regen.data.chat.render_demos)."""
    if spec.startswith("builtin:"):
        make, split = _builtin(spec, "demos")
        if split != "train":
            raise DataError(f"{where}: demonstrations come from the train split, not '{spec}'")
        return make(task)
    rows = read_rows(spec, () if chat else ("prompt", "completion"), where, skip_bad, columns)
    return _with_images([Demo(prompt=r.pop("prompt", None), completion=r.pop("completion", None), meta=r)
                         for r in rows], spec, where)


class EpochSampler:
    """Draws items without replacement, reshuffling each epoch; its position is two ints.

    The permutation of epoch e is a pure function of (seed, e), so a resumed run only needs
    (epoch, cursor) to continue with exactly the same data order.
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            step = min(k - len(out), self.n - self.cursor)
            out.extend(self._perm[self.cursor : self.cursor + step])
            self.cursor += step
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict) -> None:
        if "epoch" not in state:
            raise DataError("the checkpoint's data position is a multi-task run's (tasks:): resume it with its tasks")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation(self.epoch)


def load_pairs(spec: str, task, where: str, skip_bad: bool = False,
               columns: dict[str, str] | None = None, chat: bool = False) -> list[PrefPair]:
    """Preference pairs: rows with 'prompt', 'chosen', 'rejected' (JSONL or 'hf:DATASET[:SPLIT]'),
    or the built-in arithmetic pairs (chosen = the true sum, rejected = a wrong one). chat: 'messages'
    (the conversation the two responses answer) may stand for 'prompt' (regen.data.chat.render_pairs).
    An 'image' field (one or a list) is decoded as a prompt row's is, for a vision-language model."""
    if spec.startswith("builtin:"):
        make, split = _builtin(spec, "pairs")
        return make(split, task)
    rows = read_rows(spec, ("chosen", "rejected") if chat else ("prompt", "chosen", "rejected"), where, skip_bad,
                     columns)
    return _with_images([PrefPair(r.pop("prompt", None), r.pop("chosen"), r.pop("rejected"), r) for r in rows], spec,
                        where)
