"""Images in prompt rows, for vision-language models.

A row's `image` field is one image, or a list of them (several images in one prompt; the first is
the one rewards see as Sample.media), each one of:
  - a file path (PNG, JPEG, ...), absolute or relative to the data file's folder (then to the
    current directory);
  - base64 of an image file, bare or as a data URI ("data:image/png;base64,...");
  - a PIL image (a Hugging Face dataset's Image column; `data.columns` maps another name).

Every image is decoded when the data is loaded, so a missing file or a corrupt image stops
the run before it starts, naming the file and row. The decoded pixels (uint8, H x W x 3) ride on
the prompt item; the row's own `image` value stays in its meta (what a reward service receives
as metadata), and the pixels reach rewards as Sample.media.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

import numpy as np

from regen.errors import DataError

THUMB = 96  # px: the longest side of the copy kept in samples/*.jsonl for the report


def decode_image(value, base: Path | None, where: str) -> np.ndarray:
    """uint8 (H, W, 3) pixels of one `image` value; DataError naming `where` otherwise."""
    from PIL import Image, UnidentifiedImageError

    if hasattr(value, "convert") and hasattr(value, "size"):  # already a PIL image (datasets' Image feature)
        return np.asarray(value.convert("RGB"), dtype=np.uint8)
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):  # an undecoded Image column
        raw = bytes(value["bytes"])
    elif isinstance(value, str) and value:
        raw = _bytes_of(value, base, where)
    else:
        raise DataError(f"{where}: 'image' must be a path, base64 or a data URI, got {type(value).__name__}")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: 'image' is not a readable image ({type(e).__name__})") from None


def _bytes_of(value: str, base: Path | None, where: str) -> bytes:
    if value.startswith("data:"):
        head, _, body = value.partition(",")
        if ";base64" not in head:
            raise DataError(f"{where}: 'image' data URI is not base64 ('{head[:40]}')")
        return _b64(body, where)
    p = Path(value).expanduser()
    candidates = [p] if p.is_absolute() else [base / p] if base is not None else []
    candidates.append(p)
    for c in candidates:
        if c.is_file():
            return c.read_bytes()
    if "." not in value:  # base64's alphabet has no '.'; a file name almost always does
        return _b64(value, where)
    raise DataError(f"{where}: image file '{value}' not found" + (f" (looked in {base} and here)" if base else ""))


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise DataError(f"{where}: 'image' is neither an existing file nor valid base64") from None


def attach_images(items: list, rows_where: str, base: Path | None) -> None:
    """Decode each item's meta['image'] (if the item has one: one value or a list) into item.image."""
    for i, it in enumerate(items):
        if "image" not in it.meta:
            continue
        value, where = it.meta["image"], f"{rows_where} row {i + 1}"
        if isinstance(value, list):
            if not value:
                raise DataError(f"{where}: 'image' is an empty list")
            it.image = [decode_image(v, base, f"{where} image {j + 1}") for j, v in enumerate(value)]
            it.meta["image"] = [v if isinstance(v, str) else png_data_uri(px) for v, px in zip(value, it.image)]
            continue
        it.image = decode_image(value, base, where)
        if not isinstance(value, str):  # a PIL image is not JSON: keep a PNG data URI instead
            it.meta["image"] = png_data_uri(it.image)


def first_image(image):
    """What a reward sees as a sample's media: the prompt's image, the first of several, or None."""
    return image[0] if isinstance(image, list) else image


def png_data_uri(pixels: np.ndarray, longest: int | None = None) -> str:
    """A PNG data URI of uint8 (H, W, 3) pixels, shrunk so its longest side is at most `longest`."""
    from PIL import Image

    img = Image.fromarray(pixels)
    if longest is not None and max(img.size) > longest:
        img.thumbnail((longest, longest))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
