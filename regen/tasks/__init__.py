"""Built-in tiny tasks and models for demos and tests (no downloads)."""

from __future__ import annotations


def _arith(seed: int, digits: int):
    from regen.tasks.arithmetic import build_model

    return build_model(seed, digits)


def _shapes_vlm(seed: int, digits: int):
    from regen.tasks.shapes_vqa import build_model

    return build_model(seed)


def _enhancer(seed: int, digits: int):
    from regen.tasks.shapes_paraphrase import build_model

    return build_model(seed)


def _calc(seed: int, digits: int):
    from regen.tasks.calc import build_model

    return build_model(seed)


def _shapes_qwen_vl(seed: int, digits: int):
    from regen.tasks.shapes_vqa import build_qwen_model

    return build_qwen_model(seed)


# model.init recipes of language models: name -> fn(seed, digits) -> (model, tokenizer or processor)
LM_RECIPES = {"arith-char-gpt2": _arith, "calc-char-gpt2": _calc, "shapes-vlm": _shapes_vlm,
              "shapes-qwen-vl": _shapes_qwen_vl, "shapes-enhancer": _enhancer}
