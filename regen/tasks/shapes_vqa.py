"""Questions about drawn shapes, for vision-language models: "what colour is the shape ?" asked
of a 16x16 drawing from regen/tasks/shapes.py, answered with one word.

Three questions (colour: 4 answers, shape: 3, position: 5) about the image task's shape
combinations. The held-out split asks about the 12 held-out combinations (every word still
appears in training) in drawings made with another seed, so the held-out accuracy measures
reading new images, not recall. Like the arithmetic task, a fraction of the SFT demonstrations
answer wrongly (uniform over the other answers of that question): the SFT model spreads its
probability, and RL with an exact-answer reward has something to sharpen.

The base model is a real transformers LLaVA (LlavaForConditionalGeneration: a CLIP vision tower,
a projector and a Llama language model) from a tiny random-init config, with a word-level
tokenizer and a LlavaProcessor, saved and loaded through save_pretrained / from_pretrained.
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch

from regen.data import Demo, PrefPair, PromptItem
from regen.data.images import png_data_uri
from regen.tasks import shapes

QUESTIONS = {
    "colour": "what colour is the shape ?",
    "shape": "what shape is it ?",
    "position": "where is the shape ?",
}
ANSWERS = {"colour": tuple(shapes.COLOURS), "shape": shapes.SHAPES, "position": tuple(shapes.POSITIONS)}
IMAGE_TOKEN = "<image>"
SPECIALS = ["<pad>", "<eos>", "<unk>", IMAGE_TOKEN]
DRAWINGS = {"train": 24, "test": 12}  # drawings per combination
SPLIT_SEED = 5678


@lru_cache(maxsize=2)
def _items(split_name: str) -> tuple:
    """(attributes, uint8 image (16, 16, 3), its PNG data URI) per drawing of the split's combinations."""
    train, test = shapes.split("image")
    metas = [m for m in (train if split_name == "train" else test) for _ in range(DRAWINGS[split_name])]
    g = torch.Generator().manual_seed(SPLIT_SEED + (split_name == "test"))
    pixels = shapes.to_uint8(shapes.draw(metas, g)).numpy()
    return tuple((m, img, png_data_uri(img)) for m, img in zip(metas, pixels))


def prompts(split_name: str) -> list[PromptItem]:
    return [PromptItem(text, {"answer": meta[q], "question": q, "image": uri}, img)
            for meta, img, uri in _items(split_name) for q, text in QUESTIONS.items()]


def demonstrations(noise: float) -> list[Demo]:
    """One demonstration per training prompt; a fraction `noise` answers with another word of
    the same question's answers."""
    rng = random.Random(SPLIT_SEED + 2)
    demos = []
    for it in prompts("train"):
        q, answer = it.meta["question"], it.meta["answer"]
        if rng.random() < noise:
            answer = rng.choice([a for a in ANSWERS[q] if a != answer])
        demos.append(Demo(it.prompt, answer, dict(it.meta), it.image))
    return demos


def words() -> list[str]:
    return sorted({w for text in QUESTIONS.values() for w in text.split()} | {a for v in ANSWERS.values() for a in v})


def builtin_pairs(split_name: str, task) -> list[PrefPair]:
    """One pair per prompt of the split: chosen = the true answer, rejected = another answer to the
    same question (a seeded choice)."""
    rng = random.Random(SPLIT_SEED + 3 + (split_name == "test"))
    return [PrefPair(it.prompt, it.meta["answer"],
                     rng.choice([a for a in ANSWERS[it.meta["question"]] if a != it.meta["answer"]]), dict(it.meta),
                     it.image) for it in prompts(split_name)]


def build_processor(qwen: bool = False):
    """A LlavaProcessor: CLIP-style image processing of 16x16 RGB and a word-level tokenizer; qwen:
    the Qwen-VL families' tokenizer and image processor (regen/tasks/tiny_vlms.py) instead."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if qwen:
        from regen.data.packed_images import PackedProcessor
        from regen.tasks import tiny_vlms

        return PackedProcessor(tiny_vlms.qwen_tokenizer(words()), tiny_vlms.image_processor(shapes.RES))
    words_ = words()
    vocab = {t: i for i, t in enumerate(SPECIALS + words_)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()  # joins words with single spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  extra_special_tokens={"image_token": IMAGE_TOKEN})
    images = CLIPImageProcessorPil(size={"shortest_edge": shapes.RES}, crop_size={"height": shapes.RES,
                                   "width": shapes.RES}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=4, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token=IMAGE_TOKEN)


def build_model(seed: int, digits: int = 0):
    """A ~0.2M-parameter LLaVA (1-layer CLIP vision tower on 4x4 patches, 2-layer Llama of width
    64) from random init, and its processor. `digits` is unused (the recipe signature)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    proc = build_processor()
    tok = proc.tokenizer
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=shapes.RES, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config), proc


def build_qwen_model(seed: int, digits: int = 0):
    """A tiny Qwen2.5-VL (1-block vision tower on 4x4 patches merged 2x2, 2-layer language model of
    width 64; regen/tasks/tiny_vlms.py) from random init, and its processor."""
    from regen.data.packed_images import PackedProcessor
    from regen.tasks import tiny_vlms

    model, tok, images = tiny_vlms.build("qwen2_5_vl", words(), seed)
    return model, PackedProcessor(tok, images)


# builtin:shapes-vqa (regen/data BUILTIN)
def builtin_prompts(split_name: str, task) -> list[PromptItem]:
    return prompts(split_name)


def builtin_demos(task) -> list[Demo]:
    return demonstrations(task.demo_noise)
