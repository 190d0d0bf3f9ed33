"""Images and videos of evaluation samples, embedded in the report as data URIs.

A sample row names its media by a path relative to the run directory: `"image": "a.png"` (or
holds a small image as a data URI: the prompt image of a vision-language model's sample),
`"video": "clip.gif"` (a .gif or an animated .png plays as is), a folder of frames, or a
list of frame paths (both turned into an animated GIF here). Paths that leave the run
directory are refused: a report must not pick up arbitrary files of the machine. Large
media are shrunk to thumbnails so a report stays small enough to mail.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

THUMB = 256  # longest side of an embedded image, in pixels
MAX_RAW_BYTES = 400_000  # an image up to this size (and THUMB pixels) is embedded unchanged
MAX_FRAMES = 120
FRAME_MS = 100  # frame duration when frames come as separate files
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp"}
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}


class MediaError(Exception):
    """Why a sample's media cannot be shown; the report prints it in place of the media."""


def _resolve(run_dir: Path, rel) -> Path:
    if not isinstance(rel, str) or not rel:
        raise MediaError(f"media path must be a non-empty string, got {rel!r}")
    path = (run_dir / rel).resolve()
    if not path.is_relative_to(run_dir.resolve()):
        raise MediaError(f"'{rel}' is outside the run directory: not embedded")
    if not path.exists():
        raise MediaError(f"'{rel}' is missing")
    return path


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _open(path: Path, rel: str):
    from PIL import Image

    try:
        im = Image.open(path)
        im.load()
        return im
    except Exception as e:  # Pillow raises many types (and DecompressionBombError) for bad files
        raise MediaError(f"'{rel}' is not a readable image ({type(e).__name__})") from None


def _thumb(im):
    im = im.convert("RGBA" if im.mode in ("RGBA", "LA", "P") else "RGB")
    im.thumbnail((THUMB, THUMB))
    return im


def image_uri(run_dir: Path, rel) -> str:
    """A data URI for an image; raises MediaError naming what is wrong."""
    if isinstance(rel, str) and rel.startswith("data:"):
        return _inline_image(rel)
    path = _resolve(run_dir, rel)
    if path.is_dir():
        raise MediaError(f"'{rel}' is a folder, not an image")
    im = _open(path, rel)
    with im:
        if im.format in MIME and max(im.size) <= THUMB and path.stat().st_size <= MAX_RAW_BYTES:
            return _data_uri(MIME[im.format], path.read_bytes())
        buf = io.BytesIO()
        _thumb(im).save(buf, "PNG")
    return _data_uri("image/png", buf.getvalue())


def _inline_image(uri: str) -> str:
    """A row's own data URI (a vision-language prompt's image): decoded and re-encoded as a PNG
    thumbnail, so nothing but a valid image reaches the page."""
    from PIL import Image

    head, _, body = uri.partition(",")
    try:
        if not head.startswith("data:image/") or ";base64" not in head:
            raise ValueError("not a base64 image data URI")
        im = Image.open(io.BytesIO(base64.b64decode(body, validate=True)))
        im.load()
    except Exception as e:  # noqa: BLE001  (binascii, PIL: any failure means the same)
        raise MediaError(f"inline image is not readable ({type(e).__name__})") from None
    up = max(1, 64 // max(im.size))  # a tiny image is enlarged (nearest) so it can be seen
    im = im.resize((im.size[0] * up, im.size[1] * up), Image.NEAREST) if up > 1 else im
    buf = io.BytesIO()
    _thumb(im).save(buf, "PNG")
    return _data_uri("image/png", buf.getvalue())


def video_uri(run_dir: Path, spec) -> str:
    """A data URI of an animated image for a .gif / animated .png, a folder of frames, or a
    list of frame paths; raises MediaError naming what is wrong."""
    if isinstance(spec, list):
        if not spec:
            raise MediaError("empty list of frames")
        return _frames_to_gif([(_resolve(run_dir, f), f) for f in spec[:MAX_FRAMES]])
    path = _resolve(run_dir, spec)
    if path.is_dir():
        frames = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not frames:
            raise MediaError(f"'{spec}' holds no frame images (.png, .jpg, .gif, .webp)")
        return _frames_to_gif([(p, f"{spec}/{p.name}") for p in frames[:MAX_FRAMES]])
    suffix = path.suffix.lower()
    if suffix not in (".gif", ".png", ".apng", ".webp"):
        raise MediaError(f"'{spec}': {suffix or 'no suffix'} is not a supported video (use .gif, an animated .png, "
                         "or a folder of frames)")
    im = _open(path, spec)
    with im:
        small = max(im.size) <= THUMB and path.stat().st_size <= MAX_RAW_BYTES * 8
        fmt = im.format
    if small and fmt in MIME:  # browsers animate GIF, APNG and WebP natively in <img>
        return _data_uri(MIME[fmt], path.read_bytes())
    return _frames_to_gif([(path, spec)])


def _frames_to_gif(paths: list[tuple[Path, str]]) -> str:
    from PIL import ImageSequence

    frames, durations = [], []
    for path, rel in paths:
        im = _open(path, rel)
        with im:
            for frame in ImageSequence.Iterator(im):  # a multi-frame file gives all its frames
                frames.append(_thumb(frame.copy()).convert("RGB"))
                durations.append(int(frame.info.get("duration") or FRAME_MS))
                if len(frames) >= MAX_FRAMES:
                    break
        if len(frames) >= MAX_FRAMES:
            break
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=durations, loop=0)
    return _data_uri("image/gif", buf.getvalue())
