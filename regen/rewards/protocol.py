"""The reward-service wire protocol (HTTP + JSON), shared by server and client.

    POST /v1/score    {"reward": NAME?, "samples": [SAMPLE, ...]}
                   -> {"scorer": {"name", "version", "kind"}, "results": [RESULT, ...]}
    GET  /v1/info     rewards served (name, kind, version) and limits
    GET  /healthz     {"status": "ok"} (no auth)

    SAMPLE = {"id": str, "prompt": str, "text": str | null,
              "media": {"type": "png" | "gif", "data": base64} | null,
              "metadata": object, "finished": bool}
    RESULT = {"id": str, "score": float | null, "label": int | null, "error": str | null}

Results come back in request order, one per sample. A sample that cannot be scored (bad
media, missing field) gets `score: null` and an `error`; the rest of the batch is scored.
`label` is set for binary rewards (1 good, 0 bad). Auth: `Authorization: Bearer TOKEN`.
Errors: 401 bad/missing token (checked before the body is read), 413 body, batch or decoded
pixels too large (the message names the limit), 422 malformed request (the message names the
field), 429 saturated (honour Retry-After), 500 scorer crashed (the body holds an error id;
the exception is in the service's log). A non-finite or non-numeric score is that sample's error.
"""

from __future__ import annotations

import base64
import io
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Media(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["png", "gif"]
    data: str = Field(description="Base64 of the PNG (image) or GIF (video) file.")


class SampleIn(BaseModel):
    # strict: JSON types as they are ("finished": "yes" is an error, not true)
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    prompt: str = ""
    text: str | None = None
    media: Media | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    finished: bool = True


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: str | None = Field(None, description="Which served reward; default: the first one.")
    # Samples are validated one by one by the server, so one malformed sample gets an error
    # of its own instead of failing the whole batch.
    samples: list[dict[str, Any]]


class Result(BaseModel):
    id: str
    score: float | None = None
    label: int | None = None
    error: str | None = None


class Scorer(BaseModel):
    name: str
    version: str
    kind: str


class ScoreResponse(BaseModel):
    scorer: Scorer
    results: list[Result]


def encode_media(array) -> dict:
    """uint8 array (H, W, C) -> PNG, (F, H, W, C) -> GIF; as the protocol's media object."""
    import numpy as np
    from PIL import Image

    a = np.asarray(array)
    if a.dtype != np.uint8:
        raise ValueError(f"media must be uint8, got {a.dtype}")
    buf = io.BytesIO()
    if a.ndim == 3:
        Image.fromarray(a.squeeze(-1) if a.shape[-1] == 1 else a).save(buf, format="PNG")
        kind = "png"
    elif a.ndim == 4:
        frames = [Image.fromarray(f) for f in a]
        frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
        kind = "gif"
    else:
        raise ValueError(f"media must be (H, W, C) or (F, H, W, C), got shape {a.shape}")
    return {"type": kind, "data": base64.b64encode(buf.getvalue()).decode("ascii")}


def media_pixels(media: Media, cap: int) -> int:
    """The pixels the media decodes to (frames x height x width), read from the file's headers
    without decoding any image data (Pillow's frame count skips over the frames' data); a size
    already past `cap` is not counted further. ValueError names what is wrong with the data."""
    from PIL import Image, UnidentifiedImageError

    try:
        raw = base64.b64decode(media.data, validate=True)
    except ValueError:
        raise ValueError("media.data is not valid base64") from None
    try:
        img = Image.open(io.BytesIO(raw))  # reads the header only
        w, h = img.size
        if media.type != "gif" or w * h > cap:
            return w * h
        return getattr(img, "n_frames", 1) * w * h
    except Image.DecompressionBombError:  # Pillow's own guard: far beyond any cap of ours; the header says how far
        size = _header_pixels(raw)
        return size if size is not None and size > cap else cap + 1
    except (UnidentifiedImageError, OSError, SyntaxError):
        raise ValueError(f"media.data is not a readable {media.type.upper()}") from None


def _header_pixels(raw: bytes) -> int | None:
    """Width x height from a PNG's IHDR chunk or a GIF's logical screen, without Pillow (which
    refuses to open an image that large); None for anything else."""
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR" and len(raw) >= 24:
        w, h = struct.unpack(">II", raw[16:24])
        return w * h
    if raw[:6] in (b"GIF87a", b"GIF89a") and len(raw) >= 10:
        w, h = struct.unpack("<HH", raw[6:10])
        return w * h
    return None


def decode_media(media: Media):
    """The protocol's media object -> uint8 array; ValueError naming what is wrong."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        raw = base64.b64decode(media.data, validate=True)
    except ValueError:
        raise ValueError("media.data is not valid base64") from None
    try:
        img = Image.open(io.BytesIO(raw))
        if (img.format or "").lower() != media.type:
            raise ValueError(f"media.type is '{media.type}' but the data is {img.format or 'unknown'}")
        if media.type == "png":
            return np.asarray(img.convert("RGB") if img.mode not in ("RGB", "L") else img)
        frames = []
        for i in range(getattr(img, "n_frames", 1)):
            img.seek(i)
            frames.append(np.asarray(img.convert("RGB")))
        return np.stack(frames)
    except (UnidentifiedImageError, OSError, EOFError):
        raise ValueError(f"media.data is not a readable {media.type.upper()}") from None
