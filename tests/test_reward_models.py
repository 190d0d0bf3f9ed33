"""Learned image rewards on a tiny random CLIP built here (regen/rewards/clip.py): each score
against the model's own forward pass with the same weights, in-process and served."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from regen.errors import UserError
from regen.rewards import Sample
from regen.rewards.base import resolve

PROMPTS = ["a red circle", "a blue square at the top", "green", "a yellow triangle"]


def _samples(video: bool = False) -> list[Sample]:
    rng = np.random.default_rng(0)
    shape = (3, 16, 16, 3) if video else (16, 16, 3)
    return [Sample(p, "", {}, True, rng.integers(0, 256, shape, dtype=np.uint8)) for p in PROMPTS]


def _forward(folder, images: list[np.ndarray], texts: list[str]):
    """(cos(image_i, text_i), normalised image embeddings) from CLIPModel's forward: logits_per_image
    is logit_scale.exp() * cos, image_embeds the normalised projections."""
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    inputs = proc(text=texts, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    scale = model.logit_scale.detach().exp()
    return out.logits_per_image.diagonal() / scale, out.image_embeds, float(scale)


def _build(name: str, **args):
    return resolve(name)(**args)


def test_clip_score_and_pickscore_are_the_models_scaled_cosine(tiny_clip):
    samples = _samples()
    cos, _, scale = _forward(tiny_clip, [s.media for s in samples], PROMPTS)
    got = _build("clip_score", model=str(tiny_clip), scale=2.5)(samples)
    assert got == pytest.approx((2.5 * cos).tolist(), rel=1e-5, abs=1e-6)
    pick = _build("pickscore", model=str(tiny_clip))(samples)
    assert pick == pytest.approx((scale * cos).tolist(), rel=1e-5, abs=1e-5)


def test_a_video_scores_the_mean_of_its_frames_and_no_media_is_missing(tiny_clip):
    videos = _samples(video=True)
    reward = _build("clip_score", model=str(tiny_clip))
    frames = [Sample(s.prompt, "", {}, True, f) for s in videos for f in s.media]
    per_frame = np.array(reward(frames), dtype=float).reshape(len(videos), -1)
    assert reward(videos) == pytest.approx(per_frame.mean(axis=1).tolist(), rel=1e-5)
    assert reward([Sample("text only", "12")]) == [None]


def test_aesthetic_is_the_mlp_head_on_the_normalised_embedding(tiny_clip, tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    w1, b1 = torch.randn(1, 8, generator=g), torch.randn(1, generator=g)
    head = tmp_path / "aesthetic.safetensors"  # LAION's naming: layers.0, a dropout at 1, layers.2
    save_file({"layers.0.weight": w0, "layers.0.bias": b0, "layers.2.weight": w1, "layers.2.bias": b1}, str(head))
    samples = _samples()
    _, emb, _ = _forward(tiny_clip, [s.media for s in samples], PROMPTS)
    want = (emb @ w0.T + b0) @ w1.T + b1  # no activation between the layers, as in LAION's MLP
    got = _build("aesthetic", model=str(tiny_clip), head=str(head))(samples)
    assert got == pytest.approx(want.squeeze(-1).tolist(), rel=1e-5, abs=1e-5)
    relu = _build("aesthetic", model=str(tiny_clip), head=str(head), activation="relu")(samples)
    assert relu == pytest.approx(((emb @ w0.T + b0).relu() @ w1.T + b1).squeeze(-1).tolist(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("args,message", [
    ({}, "clip_score: args.model is required"),
    ({"model": "/nowhere/clip"}, "'/nowhere/clip' does not exist (nothing is downloaded"),
])
def test_a_missing_model_is_one_clear_error(args, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        _build("clip_score", **args)


def test_a_head_that_does_not_fit_is_refused(tiny_clip, tmp_path):
    from safetensors.torch import save_file

    head = tmp_path / "h.safetensors"
    save_file({"layers.0.weight": torch.zeros(1, 7)}, str(head))
    with pytest.raises(UserError, match="takes 7 inputs, the CLIP model's embedding has 16"):
        _build("aesthetic", model=str(tiny_clip), head=str(head))
    with pytest.raises(UserError, match="does not exist"):
        _build("aesthetic", model=str(tiny_clip), head=str(tmp_path / "none.safetensors"))


@pytest.mark.extended  # a reward server in a subprocess (6 s): second CI tier, keeps scripts/test.sh short
def test_served_scores_equal_in_process(tiny_clip, monkeypatch):
    from tests.test_reward_service import TOKEN, Server, client

    monkeypatch.setenv("TEST_TOKEN_ENV", TOKEN)
    srv = Server("clip_score", "pickscore", extra=["--reward-args", f"{{model: {tiny_clip}, scale: 100}}",
                                                   "--reward-args", f"{{model: {tiny_clip}}}"]).start()
    try:
        samples = _samples()
        for name, args in (("clip_score", {"scale": 100}), ("pickscore", {})):
            local = _build(name, model=str(tiny_clip), **args)(samples)
            assert client(srv.url, reward=name)(samples) == pytest.approx(local, rel=1e-6, abs=1e-6)
    finally:
        srv.stop()
