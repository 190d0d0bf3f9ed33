"""Tiny vision-language models of the current families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3,
SmolVLM's Idefics3, and LLaVA), built from their real transformers classes with a few layers, a word-level
tokenizer holding each family's special tokens and a chat template in its layout, and the
family's own image processor (PIL backend: no torchvision needed).

They exist for tests and the shapes-VQA demo: saved with save_pretrained and loaded back through
from_pretrained, they take the same path as a hub checkpoint of the family (Qwen-VL: packed
pixel_values with image_grid_thw, regen/data/packed_images.py, and M-RoPE positions,
regen/policies/vlm_packed.py; Gemma 3: bidirectional attention inside each image; Idefics3: each
image cut into tiles, per-row padded; LLaVA: the shapes-vqa model, regen/tasks/shapes_vqa.py).
"""

from __future__ import annotations

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FAMILIES = ("llava", *QWEN, "gemma3", "idefics3")
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


def word_tokenizer(words: list[str], specials: list[str], eos: str, named: dict, template: str, apart: str = ""):
    """specials + words (+ chat roles and a newline) as a word-level fast tokenizer: words apart at
    spaces, each special token and a newline a token of its own (and each character of `apart`,
    e.g. punctuation). specials[0] pads; `named`: the family's named special tokens (image_token,
    ...); `template`: its chat template."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = [w for w in ("system", "user", "assistant", "model", "User:", "Assistant:", "\n") if w not in words]
    vocab = {t: i for i, t in enumerate(specials + list(words) + extra)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    isolated = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + "|\n" + \
        "".join("|" + re.escape(c) for c in apart)
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
                                                pre_tokenizers.Split(Regex(isolated), behavior="isolated")])
    tk.decoder = decoders.WordPiece()  # joins words with single spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=specials[0], eos_token=eos, unk_token="<unk>",
                                  extra_special_tokens=named)
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in (specials[0], eos, "<unk>")]})
    tok.chat_template = template
    return tok


def qwen_tokenizer(words: list[str], apart: str = ""):
    """The Qwen-VL families' tokens and chat layout; <|im_end|> ends a turn (an instruct checkpoint's EOS)."""
    return word_tokenizer(words, SPECIALS, "<|im_end|>", {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
                          CHAT_TEMPLATE, apart)


def image_processor(res: int = 16):
    """The families' image processor (PIL backend: no torchvision needed) on res x res images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    min_pixels=(res // 2) ** 2, max_pixels=(2 * res) ** 2,
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3)


def build(family: str, words: list[str], seed: int, hidden: int = 64, layers: int = 2, apart: str = ""):
    """(model, tokenizer, image processor) of a tiny Qwen-VL `family` model from random init (torch.manual_seed(seed));
    apart: characters the tokenizer keeps as tokens of their own."""
    import torch
    import transformers as tf

    if family not in QWEN:
        raise ValueError(f"unknown family '{family}' (one of {', '.join(QWEN)})")
    tok = qwen_tokenizer(words, apart)
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


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def build_gemma3(words: list[str], seed: int, res: int = 16):
    """(model, processor): a 2-layer Gemma 3 language model (sliding + full attention) under a
    1-layer SigLIP tower on 4x4 patches, 4 soft tokens per image."""
    import torch
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = word_tokenizer(words, GEMMA_SPECIALS, "<eos>", {"image_token": "<image_soft_token>",
                         "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}, GEMMA_TEMPLATE)
    tok.bos_token = "<bos>"
    images = Gemma3ImageProcessorPil(size={"height": res, "width": res}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    proc = tf.Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=GEMMA_TEMPLATE, image_seq_length=4)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=res, patch_size=PATCH)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_index", "<image_soft_token>"),
           ("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>"))}
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, **ids)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")]
    return model, proc


IDEFICS_SPECIALS = ["<pad>", "<|begin_of_text|>", "<end_of_utterance>", "<unk>", "<fake_token_around_image>", "<image>",
                    "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
# SmolVLM's layout: User:<image> question<end_of_utterance>\nAssistant:
IDEFICS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %} {{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %} {{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def build_idefics3(words: list[str], seed: int, tile: int = 16):
    """(model, processor): SmolVLM (v1)'s Idefics3 with a 2-layer Llama and a 1-layer vision tower;
    an image is resized to a longest side of 2 tiles and cut into tiles, plus a global tile."""
    import torch
    import transformers as tf
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = word_tokenizer(words, IDEFICS_SPECIALS, "<end_of_utterance>", {}, IDEFICS_TEMPLATE)
    tok.bos_token = "<|begin_of_text|>"
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile},
                                       image_mean=[0.5] * 3, image_std=[0.5] * 3, do_image_splitting=True)
    proc = tf.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=(tile // PATCH) ** 2 // 4,
                                chat_template=IDEFICS_TEMPLATE)
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=tile,
                  patch_size=PATCH)
    config = tf.Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                               image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return tf.Idefics3ForConditionalGeneration(config), proc


def save(family: str, folder, words: list[str], seed: int = 0) -> None:
    """A tiny `family` checkpoint folder: model, tokenizer with its chat template, image processor."""
    if family in QWEN:
        model, tok, images = build(family, words, seed)
        tok.save_pretrained(folder)
        images.save_pretrained(folder)
    elif family == "llava":  # the shapes-vqa LLaVA (its own word list: the shapes questions and answers)
        from regen.tasks.shapes_vqa import build_model

        model, proc = build_model(seed)
        proc.save_pretrained(folder)
    else:
        model, proc = (build_gemma3 if family == "gemma3" else build_idefics3)(words, seed)
        proc.save_pretrained(folder)
    model.save_pretrained(folder)
