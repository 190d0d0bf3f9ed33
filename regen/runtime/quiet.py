"""Library output that is noise next to regen's own progress bar, turned off in every process
that trains (the CLI, a Ray trainer actor)."""

from __future__ import annotations


def quiet_libraries() -> None:
    """Our own progress bar is the one to watch; transformers' save/load bars only add noise."""
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # peft asks transformers for a deprecated attribute on every LoRA load and merge: the notice
    # is for peft's authors, not for our users
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
