"""Loading a language model (or vision-language model) for regen: from a local folder, a hub id,
or a built-in recipe; the device; LoRA adapters."""

from __future__ import annotations

from pathlib import Path

import torch

from regen.errors import UserError
from regen.policies.vlm import LANGUAGE_LORA_TARGETS, is_processor, is_vlm_folder, load_processor, load_vlm


def max_positions(model) -> int:
    """The longest sequence the model accepts (GPT-2 names it n_positions; a VLM's is its text config's)."""
    cfg = getattr(model.config, "text_config", None) or model.config
    return getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 4096


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device=cuda but no CUDA device is available")
    return torch.device(name)


def _looks_local(path: str) -> bool:
    """A path that cannot be a hub id ('org/name'), or whose first folder exists here."""
    p = Path(path).expanduser()
    return path.startswith((".", "/", "~")) or path.count("/") != 1 or p.parent.exists()


def load_model_and_tokenizer(model_cfg, task_cfg, seed: int):
    """From model.path (a local folder, or a hub id where a network exists) or a built-in recipe.
    A vision-language model comes with its processor in place of the tokenizer (regen/policies/vlm.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, model_cfg.dtype)
    if model_cfg.init is not None:
        from regen.tasks import LM_RECIPES as RECIPES

        if model_cfg.init not in RECIPES:
            raise UserError(f"model.init: unknown recipe '{model_cfg.init}' (known: {', '.join(RECIPES)})")
        model, tok = RECIPES[model_cfg.init](seed, task_cfg.digits)
        model = model.to(dtype)
    else:
        path = model_cfg.path
        p = Path(path).expanduser()
        if p.exists() and not (p / "config.json").is_file():
            raise UserError(f"model.path: '{path}' is not a model folder (no config.json in it)")
        if not p.exists() and _looks_local(path):
            raise UserError(f"model.path: folder '{path}' not found")
        if p.exists() and is_vlm_folder(p):
            return _checked(*load_vlm(str(p), dtype))
        try:
            tok = AutoTokenizer.from_pretrained(str(p) if p.exists() else path)
            model = AutoModelForCausalLM.from_pretrained(str(p) if p.exists() else path, dtype=dtype)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"model.path: cannot load '{path}': {first}") from None
    return _checked(model, tok)


def _checked(model, tok):
    text = tok.tokenizer if is_processor(tok) else tok
    if text.eos_token_id is None:
        raise UserError("model.path: the tokenizer has no EOS token; completions could never end")
    if text.pad_token_id is None:
        text.pad_token = text.eos_token  # common for causal LMs; padding is always masked out
    return model, tok


def apply_lora(model, lora_cfg, adapter_dir: Path | None = None):
    """Wrap a causal LM with a LoRA adapter (peft): a fresh one, or the one saved in adapter_dir."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise UserError("model.lora needs peft: pip install 'regen[lora]'") from None
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    # GPT-2's Conv1D stores its weight transposed: peft needs fan_in_fan_out for it (and would
    # otherwise set it itself, with a warning on every run)
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    targets = lora_cfg.target_modules
    if targets is None and hasattr(model.config, "vision_config"):  # a VLM: the language side only
        targets = LANGUAGE_LORA_TARGETS
    cfg = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                     target_modules=targets, task_type="CAUSAL_LM", fan_in_fan_out=conv1d)
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        raise UserError(f"model.lora: {e}") from None


def load_tokenizer(model_cfg, task_cfg):
    """The tokenizer of model.path (a vision-language model's processor), or of a built-in recipe,
    without loading the weights."""
    if model_cfg.init in ("shapes-vlm", "shapes-qwen-vl"):
        from regen.tasks.shapes_vqa import build_processor

        return build_processor(qwen=model_cfg.init == "shapes-qwen-vl")
    if model_cfg.init is not None:
        from regen.tasks.arithmetic import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    p = Path(model_cfg.path).expanduser()
    try:
        if p.exists() and is_vlm_folder(p):
            return load_processor(str(p))
        return AutoTokenizer.from_pretrained(str(p) if p.exists() else model_cfg.path)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: cannot load the tokenizer of '{model_cfg.path}': {str(e).splitlines()[0]}") \
            from None
