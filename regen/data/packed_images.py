"""The Qwen-VL families' prompts as token ids and packed image inputs (PackedProcessor).

Their image processor cuts each image (at its own resolution, resized to a multiple of
patch x merge pixels) into patches and packs every image's patches into one `pixel_values`
tensor, with `image_grid_thw` (time, height, width in patches) per image. In the text, each image
is one `<|image_pad|>` token that becomes t*h*w / merge^2 tokens, where the model scatters the
merged patch features. The processing here is images only, done with the checkpoint's own
tokenizer and image processor rather than transformers' Qwen processor class, because that class
will not even build without torchvision (it insists on a video processor); the expansion rule is
the processor's own (one image token per merged patch). Positions: regen/policies/vlm_packed.py.
"""

from __future__ import annotations

from regen.data.vision_inputs import VisionInputs
from regen.errors import DataError, UserError

PACKED_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


class PackedProcessor:
    """Tokenizer + image processor of a Qwen-VL checkpoint, with the processor interface regen uses."""

    reads_no_image = True  # a prompt may hold no image (or several): its row simply has no image inputs

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.vision_start = "<|vision_start|>"
        self.merge = int(image_processor.merge_size)
        if tokenizer.convert_tokens_to_ids(self.image_token) in (None, tokenizer.unk_token_id):
            raise UserError(f"model.path: the tokenizer has no '{self.image_token}' token (a Qwen-VL checkpoint's "
                            "image placeholder)")

    @classmethod
    def from_pretrained(cls, path: str) -> PackedProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path))

    @property
    def chat_template(self):
        return self.tokenizer.chat_template

    def apply_chat_template(self, *args, **kwargs):  # the tokenizer's template places the image markers
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def save_pretrained(self, folder) -> None:
        self.tokenizer.save_pretrained(folder)
        self.image_processor.save_pretrained(folder)

    def image_marker(self) -> str:
        """What a prompt without the image token gets in front, per image (the chat template's own markup)."""
        return f"{self.vision_start}{self.image_token}<|vision_end|>"

    def encode(self, texts: list[str], images: list[list], add_special_tokens: bool) -> tuple[dict, VisionInputs]:
        """Left-padded input_ids / attention_mask and per-row image inputs (pixel_values, image_grid_thw)."""
        flat = [im for row in images for im in row]
        counts_img = [len(row) for row in images]
        if flat:
            try:
                out = self.image_processor(images=flat, return_tensors="pt")
            except ValueError as e:
                raise DataError(f"the image processor refused a prompt's image: {e}") from None
            grid = out["image_grid_thw"]
            tokens = (grid.prod(-1) // self.merge**2).tolist()
            patches = grid.prod(-1).tolist()
        else:
            grid, tokens, patches = None, [], []
        expanded, k = [], 0
        for text, n in zip(texts, counts_img):
            pieces = text.split(self.image_token)
            if len(pieces) - 1 != n:
                raise DataError(f"a prompt places {len(pieces) - 1} image token(s) for {n} image(s): "
                                f"'{text[:60]}'")
            body = pieces[0]
            for j, rest in enumerate(pieces[1:]):
                body += self.image_token * tokens[k + j] + rest
            k += n
            expanded.append(body)
        enc = self.tokenizer(expanded, padding=True, padding_side="left", return_tensors="pt",
                             add_special_tokens=add_special_tokens)
        text = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if not flat:
            return text, VisionInputs([{} for _ in texts])
        per_row_patches = [sum(patches[a:a + n]) for a, n in zip(_starts(counts_img), counts_img)]
        vision = VisionInputs.split(len(texts), {"pixel_values": out["pixel_values"], "image_grid_thw": grid},
                                    {"pixel_values": per_row_patches, "image_grid_thw": counts_img})
        return text, vision


def _starts(counts: list[int]) -> list[int]:
    starts, s = [], 0
    for c in counts:
        starts.append(s)
        s += c
    return starts
