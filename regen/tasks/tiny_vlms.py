"""Tiny vision-language models of the Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), built from
their real transformers classes with a few layers, a word-level tokenizer holding the families'
special tokens, a Qwen-style chat template and the families' own image processor (PIL backend).

They exist for tests and the shapes-VQA demo: saved with save_pretrained and loaded back through
from_pretrained, they take the same path as a hub checkpoint of the family (packed pixel_values
with image_grid_thw, M-RoPE positions; regen/policies/vlm_packed.py).
"""

from __future__ import annotations

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SPECIALS = ["<pad>", "<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
# the families' chat layout: <|im_start|>role\n ... <|im_end|>\n, an image as <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE = 4, 2  # 4x4-pixel patches merged 2x2: a 16x16 image is 16 patches, 4 language tokens


def qwen_tokenizer(words: list[str]):
    """SPECIALS + words (+ the chat roles and a newline) as a word-level fast tokenizer with the
    families' chat template; <|im_end|> ends a turn (the EOS an instruct checkpoint declares)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = [w for w in ("system", "user", "assistant", "\n") if w not in words]
    vocab = {t: i for i, t in enumerate(SPECIALS + list(words) + extra)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # words apart at spaces; a special token and a newline are tokens of their own
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
                                                pre_tokenizers.Split(Regex(r"<\|[a-z_]+\|>|\n"), behavior="isolated")])
    tk.decoder = decoders.WordPiece()  # joins words with single spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                  extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:2] + SPECIALS[3:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def image_processor(res: int = 16):
    """The families' image processor (PIL backend: no torchvision needed) on res x res images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    min_pixels=(res // 2) ** 2, max_pixels=(2 * res) ** 2,
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3)


def build(family: str, words: list[str], seed: int, hidden: int = 64, layers: int = 2):
    """(model, tokenizer, image processor) of a tiny `family` model from random init (torch.manual_seed(seed))."""
    import torch
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"unknown family '{family}' (one of {', '.join(FAMILIES)})")
    tok = qwen_tokenizer(words)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    heads = 4
    half = hidden // heads // 2  # M-RoPE splits each head's rotary half over (time, height, width)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    vision = dict(depth=1, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=hidden, mlp_ratio=2)
        config, cls = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids), tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, window_size=2 * PATCH * MERGE,
                      fullatt_block_indexes=[0])
        config, cls = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids), \
            tf.Qwen2_5_VLForConditionalGeneration
    else:
        text["head_dim"] = hidden // heads
        rope["mrope_interleaved"] = True
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
        config, cls = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids), tf.Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    return cls(config), tok, image_processor()


def save(family: str, folder, words: list[str], seed: int = 0) -> None:
    """A tiny `family` checkpoint folder: model, tokenizer with its chat template, image processor."""
    model, tok, images = build(family, words, seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    images.save_pretrained(folder)
