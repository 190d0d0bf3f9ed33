"""Shared fixtures: a tiny SFT'd base model built once per session through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from regen.cli import main

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    """A character-level GPT-2 after a short SFT (exported Hugging Face folder)."""
    run = tmp_path_factory.mktemp("sft")
    rc = main([
        "sft", "model.init=arith-char-gpt2", f"run.dir={run}", "sft.steps=300", "optim.lr=1e-3",
        "log.progress=none", "log.tensorboard=false", "eval.num_prompts=64",
    ])
    assert rc == 0
    return run / "export"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
