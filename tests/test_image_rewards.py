"""Image/video rewards: hand-checked values, the adherence classifier, and the reward forms."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from regen.config import RewardTerm
from regen.rewards import REGISTRY, CombinedReward, Sample, resolve
from regen.rewards import adherence as adh
from regen.rewards.image import (
    colour_target,
    groups,
    jpeg_compressibility,
    jpeg_incompressibility,
    motion_amount,
    pairwise_preferences,
    temporal_smoothness,
)
from regen.tasks import shapes

RED_LEFT = {"colour": "red", "shape": "circle", "position": "left"}
BLUE_TOP = {"colour": "blue", "shape": "square", "position": "top"}


def media(x, meta=None, prompt="p") -> Sample:
    return Sample(prompt, "", dict(meta or {}), media=x)


def solid(rgb, size=16) -> np.ndarray:
    return np.broadcast_to(np.asarray(rgb, np.uint8), (size, size, 3)).copy()


def moving_square(step: int, frames: int = 8) -> np.ndarray:
    """A 2x2 white square on black, moving `step` px right per frame from the left edge."""
    v = np.zeros((frames, 16, 16, 3), np.uint8)
    for t in range(frames):
        v[t, 7:9, step * t:2 + step * t] = 255
    return v


def drawn(metas: list[dict], seed: int) -> list[np.ndarray]:
    return list(shapes.to_uint8(shapes.draw(metas, generator=torch.Generator().manual_seed(seed))).numpy())


@pytest.fixture(scope="session")
def cache() -> Path:
    """The shipped classifiers (default settings) in the cache every run uses ($REGEN_CACHE, else
    ~/.cache/regen): the flow tests load them from there too, so a session trains each at most
    once (a second cache of their own cost 14 s). The cache logic itself is tested on tiny
    classifiers in tmp folders below."""
    root = adh.cache_dir().parent
    for kind in ("image", "video"):
        adh.load(kind, root=root)
    return root


# ---- JPEG --------------------------------------------------------------------------------

def pillow_kb(img: np.ndarray, quality: int) -> float:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=quality)
    return len(buf.getvalue()) / 1000


def test_jpeg_flat_compresses_better_than_noise():
    flat = solid((90, 90, 90), 64)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    sizes = jpeg_incompressibility([media(flat), media(noise)])
    assert sizes == [pillow_kb(flat, 95), pillow_kb(noise, 95)]
    assert sizes[1] > 5 * sizes[0]  # 64x64 of noise at q95 is several kB; a flat image well under 1
    comp = jpeg_compressibility([media(flat), media(noise)])
    assert comp == [-sizes[0], -sizes[1]] and comp[0] > comp[1]
    assert jpeg_incompressibility([media(noise)], quality=10)[0] == pillow_kb(noise, 10) < sizes[1]
    video = np.stack([flat, noise])  # video: mean over frames
    assert jpeg_incompressibility([media(video)]) == [pytest.approx((sizes[0] + sizes[1]) / 2)]


# ---- colour ------------------------------------------------------------------------------

def test_colour_target_by_hand():
    red = solid((255, 0, 0))
    assert colour_target([media(red)], target="red", region="image") == [1.0]
    # blue target: distance sqrt(255^2 + 255^2) of the maximum 255 * sqrt(3)
    assert colour_target([media(red)], target=[0, 0, 255], region="image") == [pytest.approx(1 - math.sqrt(2 / 3))]
    square = np.zeros((16, 16, 3), np.uint8)
    square[4:8, 4:8] = (255, 0, 0)  # 16 of 256 pixels
    assert colour_target([media(square)], target="red", region="shape") == [1.0]
    mean_r = 255 * 16 / 256
    assert colour_target([media(square)], target="red", region="image") == [
        pytest.approx(1 - (255 - mean_r) / (255 * math.sqrt(3)))]
    assert colour_target([media(np.zeros((16, 16, 3), np.uint8))], region="shape") == [0.0]  # no shape
    with pytest.raises(ValueError, match="region"):
        colour_target([media(red)], region="sky")


# ---- video -------------------------------------------------------------------------------

def test_smoothness_and_motion_by_hand():
    static = np.repeat(moving_square(0)[:1], 8, axis=0)
    moving = moving_square(2)
    flicker = np.zeros((8, 16, 16, 3), np.uint8)
    flicker[1::2] = 255
    samples = [media(static), media(moving), media(flicker)]
    # moving: per pair 4 pixels switch off and 4 on, in all channels: mean |diff| = 8/256 of 255
    assert temporal_smoothness(samples) == [1.0, pytest.approx(1 - 8 / 256), 0.0]
    # flicker: black frames have no shape, so no pair counts: it is not motion
    assert motion_amount(samples) == [0.0, pytest.approx(2.0), 0.0]
    assert motion_amount([media(moving_square(1))]) == [pytest.approx(1.0)]
    image = moving[0]
    assert temporal_smoothness([media(image)]) == [None] and motion_amount([media(image)]) == [None]


def test_missing_media_is_none_for_every_reward(cache):
    blank = [Sample("p", "", dict(RED_LEFT))]
    for name in ("jpeg_compressibility", "jpeg_incompressibility", "colour_target", "temporal_smoothness",
                 "motion_amount", "brightness"):
        assert list(REGISTRY[name](blank)) == [None], name
    for name in ("adherence", "adherence_accuracy"):
        assert REGISTRY[name](cache=str(cache))(blank) == [None], name


# ---- adherence ---------------------------------------------------------------------------

def test_classifier_accuracy_on_fresh_draws(cache):
    """Independent draws (another seed than training and than its own held-out check),
    through the whole uint8 path of the reward."""
    acc = REGISTRY["adherence_accuracy"](cache=str(cache))
    for kind, seed in (("image", 2024), ("video", 2025)):
        train, test = shapes.split(kind)
        metas = [(train + test)[i % len(train + test)] for i in range(240)]
        got = acc([media(x, m) for x, m in zip(drawn(metas, seed), metas)])
        assert sum(got) / len(got) > 0.95, kind
        info = json.loads(next(cache.glob(f"adherence/{kind}-*.json")).read_text())
        assert info["heldout_accuracy"]["all"] > 0.98 and info["version"] == adh.VERSION


def test_adherence_prefers_the_right_prompt_and_punishes_hacks(cache):
    score = REGISTRY["adherence"](cache=str(cache))
    img = drawn([RED_LEFT], seed=7)[0]
    right, wrong, flat, black = score([media(img, RED_LEFT), media(img, BLUE_TOP),
                                       media(solid((255, 0, 0)), RED_LEFT), media(solid((0, 0, 0)), RED_LEFT)])
    assert right > 0.9 and wrong < 0.2
    assert flat < 0.5 and black < 0.5  # the solid-red and black-image hacks RL finds
    acc = REGISTRY["adherence_accuracy"](cache=str(cache))
    assert acc([media(img, RED_LEFT), media(solid((255, 0, 0)), RED_LEFT), media(solid((0, 0, 0)), RED_LEFT)]) == [
        1.0, 0.0, 0.0]
    vmeta = {"colour": "green", "shape": "triangle", "direction": "up"}
    video = drawn([vmeta], seed=8)[0]
    moving, static, backwards = score([media(video, vmeta), media(np.repeat(video[:1], 8, 0), vmeta),
                                       media(video[::-1].copy(), vmeta)])
    assert moving > 0.9 and static < moving - 0.2 and backwards < moving - 0.2
    # not scorable: meta without the prompt's attributes, or media of another size
    assert score([media(img, {"colour": "red"}), media(solid((0, 0, 0), 32), RED_LEFT)]) == [None, None]


def test_adherence_reads_a_prompt_in_the_painters_words_when_meta_has_none(cache):
    """A joint run's painter is judged against its rewrite: no meta, the attributes from the text."""
    score = REGISTRY["adherence"](cache=str(cache))
    img = drawn([RED_LEFT], seed=7)[0]
    by_meta, by_text, other_text = score([media(img, RED_LEFT), media(img, prompt="a red circle at the left"),
                                          media(img, prompt="the blue square at top")])
    assert by_text == by_meta and other_text < 0.2
    # meta wins over the text; a text that is not one prompt in the painter's words is missing
    assert score([media(img, BLUE_TOP, prompt="a red circle at the left")]) == [pytest.approx(other_text, rel=1e-4)]
    assert score([media(img, prompt=p) for p in ("a red circle at the", "a red blue circle at the left",
                                                  "a crimson circle at the left", "")]) == [None] * 4
    vmeta = {"colour": "green", "shape": "triangle", "direction": "up"}
    video = drawn([vmeta], seed=8)[0]
    assert score([media(video, vmeta), media(video, prompt="a green triangle moving up")]) == [
        pytest.approx(score([media(video, vmeta)])[0], rel=1e-4)] * 2
    assert shapes.parse_prompt("a red circle moving up", "image") is None  # "up" is no position


def test_cache_is_reused(cache):
    adh._MEMO.clear()  # as in a new process
    trained, loaded = adh.STATS["trained"], adh.STATS["loaded"]
    t0 = time.perf_counter()
    adh.load("image", root=cache)
    assert time.perf_counter() - t0 < 2.0
    assert adh.STATS["trained"] == trained and adh.STATS["loaded"] == loaded + 1
    assert sorted(p.suffix for p in (cache / "adherence").glob("image-*")) == [".json", ".safetensors"]


@pytest.mark.parametrize("broken", ["safetensors", "json"])
def test_corrupt_cache_is_retrained(tmp_path, broken):
    adh.load("image", steps=3, root=tmp_path)  # a tiny classifier: only the cache logic is tested
    adh._MEMO.clear()
    (path,) = (tmp_path / "adherence").glob(f"image-*.{broken}")
    path.write_bytes(b"\x00garbage")
    trained = adh.STATS["trained"]
    with pytest.warns(UserWarning, match="unreadable"):
        adh.load("image", steps=3, root=tmp_path)
    assert adh.STATS["trained"] == trained + 1
    adh._MEMO.clear()
    adh.load("image", steps=3, root=tmp_path)  # the rewritten cache is good
    assert adh.STATS["trained"] == trained + 1


def test_training_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    adh.train("video", steps=1, batch=16)
    assert torch.equal(torch.random.get_rng_state(), state)


# ---- reward forms ------------------------------------------------------------------------

def test_binary_wraps_any_scalar():
    greys = [media(solid((v, v, v))) for v in (51, 204)] + [Sample("p", "")]  # brightness 0.2, 0.8, missing
    fn = resolve("binary")(of="brightness", threshold=0.5)
    assert fn.reward_kind == "binary" and fn.reward_version == "1(brightness=1)"
    assert fn(greys) == [0.0, 1.0, None]
    assert resolve("binary")(of="brightness", threshold=0.5, below=True)(greys) == [1.0, 0.0, None]
    comb = CombinedReward.from_config([RewardTerm(name="binary", args={
        "of": "colour_target", "threshold": 0.99, "args": {"target": [204, 204, 204], "region": "image"}})])
    assert comb(greys)[0][:2] == [0.0, 1.0] and math.isnan(comb(greys)[0][2])


def test_pairwise_preferences_map_as_specified():
    assert pairwise_preferences([3, 1, 2, None, 1.0], [1, 3, 2, 0, math.nan]) == [1.0, 0.0, 0.5, None, None]
    assert pairwise_preferences([1.0, 1.0], [1.05, 1.2], tie=0.1) == [0.5, 0.0]
    with pytest.raises(ValueError):
        pairwise_preferences([1.0], [1.0, 2.0])


def test_pairwise_win_rates_by_hand():
    def grey(level, prompt):  # brightness = level / 255
        return media(solid((level, level, level)), prompt=prompt)

    batch = [grey(0, "a"), grey(102, "a"), grey(102, "a"), grey(255, "a"),  # group 1
             grey(50, "b"), Sample("b", ""),  # group 2: one scored sample, no opponent
             grey(10, "a"), grey(20, "a")]  # group 3: same prompt as group 1, not adjacent
    assert groups(batch) == [range(0, 4), range(4, 6), range(6, 8)]
    got = resolve("pairwise")(of="brightness")(batch)
    # lowest loses all 3; the two equal ones beat one, tie one, lose one: (1 + 0.5 + 0) / 3
    assert got == [0.0, 0.5, 0.5, 1.0, None, None, 0.0, 1.0]


def test_registered_with_kinds_and_versions():
    kinds = {"jpeg_compressibility": "scalar", "jpeg_incompressibility": "scalar", "colour_target": "scalar",
             "temporal_smoothness": "scalar", "motion_amount": "scalar", "adherence": "scalar",
             "adherence_accuracy": "binary", "binary": "binary", "pairwise": "scalar"}
    for name, kind in kinds.items():
        assert REGISTRY[name].reward_kind == kind and REGISTRY[name].reward_version, name
    assert REGISTRY["adherence"](steps=3).reward_version == f"{adh.VERSION}-s3-seed0"  # no training until scored
