"""Vision-language policies (regen/policies/vlm.py): images in prompt rows, image tokens never
sampled nor trained on, the image encoded once per group, the vision tower frozen by default,
export loadable by plain transformers, refusals by name (torchrun and Ray for every family:
test_vlm_families.py).
The loop's guarantees (resume, rollback, signals...) run for the VLM in test_guarantees.py."""

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from regen.cli import main
from regen.data import load_prompts
from regen.errors import DataError
from tests.conftest import VLM_FAST, read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_image_values_are_paths_base64_or_data_uris_and_bad_ones_are_named(tmp_path):
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (5, 7, 3), dtype=np.uint8) for _ in range(3)]
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png_bytes(imgs[0]))
    b64 = [base64.b64encode(png_bytes(x)).decode() for x in imgs[1:]]
    rows = [{"prompt": "q0", "image": "pics/a.png"},  # relative to the data file's folder
            {"prompt": "q1", "image": b64[0]}, {"prompt": "q2", "image": "data:image/png;base64," + b64[1]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_prompts(str(data), None, "data.train")
    for it, want in zip(items, imgs):
        assert it.image.dtype == np.uint8 and np.array_equal(it.image, want)
    assert items[0].meta["image"] == "pics/a.png"  # the row's own value is what rewards see as metadata

    for bad, says in [({"prompt": "q", "image": "pics/missing.png"}, "image file 'pics/missing.png' not found"),
                      ({"prompt": "q", "image": "bm90IGFuIGltYWdl"}, "'image' is not a readable image"),
                      ({"prompt": "q", "image": "!!!"}, "neither an existing file nor valid base64"),
                      ({"prompt": "q", "image": 5}, "'image' must be a path, base64 or a data URI")]:
        data.write_text(json.dumps(rows[0]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(DataError, match="row 2") as e:
            load_prompts(str(data), None, "data.train")
        assert says in str(e.value) and "rows.jsonl" in str(e.value)


@pytest.fixture(scope="module")
def policy(vlm_base):
    from regen.config import ModelConfig
    from regen.policies.lm import LMPolicy, load_model_and_tokenizer

    model, proc = load_model_and_tokenizer(ModelConfig(path=vlm_base), None, 0)
    return LMPolicy(model, proc, torch.device("cpu"))


def items(n: int = 3):
    from regen.tasks import shapes_vqa

    return shapes_vqa.prompts("test")[:n]


def test_image_tokens_are_never_sampled_and_never_in_the_loss(policy):
    image_id = policy.model.config.image_token_index

    def boost(module, args, out):  # the image token by far the likeliest: only the ban keeps it out
        out = out.clone()
        out[..., image_id] += 100.0
        return out

    hook = policy.model.get_output_embeddings().register_forward_hook(boost)
    try:
        g = torch.Generator().manual_seed(0)
        ro = policy.sample(policy.inputs(items()), 4, 1.0, 1.0, 3, g)
        assert not (ro.response_ids == image_id).any()
        logp, _ = policy.token_logprobs(ro, 1.0)
        assert torch.isfinite(logp[ro.response_mask.bool()]).all()
    finally:
        hook.remove()
    # the image's positions are all in the prompt (16 patches of a 16x16 image in 4x4 patches);
    # the loss mask is over response positions only
    prompt = ro.input_ids[:, : ro.prompt_width]
    assert ((prompt == image_id).sum(1) == 16).all()
    assert ro.response_mask.shape[1] == ro.input_ids.shape[1] - ro.prompt_width


def test_each_group_image_is_encoded_once_with_the_same_logprobs(policy):
    seen = []
    hook = policy.model.model.vision_tower.register_forward_hook(lambda m, args, out: seen.append(len(args[0])))
    try:
        g = torch.Generator().manual_seed(1)
        ro = policy.sample(policy.inputs(items(3)), 4, 1.0, 1.0, 2, g)
        assert seen == [3]  # sampling: one encoding per prompt, shared by its 4 samples
        seen.clear()
        per_row, _ = policy.token_logprobs(ro, 1.0, group_size=1)
        assert sum(seen) == 12
        seen.clear()
        per_group, _ = policy.token_logprobs(ro, 1.0, group_size=4)
        assert sum(seen) == 3
    finally:
        hook.remove()
    mask = ro.response_mask.bool()
    assert torch.allclose(per_row[mask], per_group[mask], atol=1e-5)


def vision_weights(folder) -> dict:
    w = load_file(str(Path(folder) / "model.safetensors"))
    return {k: v for k, v in w.items() if "vision_tower" in k}


def train_vlm(run, base, *extra) -> int:
    return main(["train", f"model.path={base}", f"run.dir={run}", *VLM_FAST, *extra])


def test_a_vlm_run_freezes_the_vision_tower_sees_images_and_exports_for_transformers(vlm_base, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run = tmp_path / "run"
    reward = "reward=[{name: 'tests.reward_fixtures:exact_if_image'}]"  # None (missing) without the image
    assert train_vlm(run, vlm_base, reward, "train.steps=2", "data.eval=builtin:shapes-vqa:test",
                     "eval.num_prompts=4", "eval.every=0") == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(r["reward/missing_frac"] == 0.0 for r in rows if "reward/missing_frac" in r)
    base, after = load_file(f"{vlm_base}/model.safetensors"), load_file(str(run / "export" / "model.safetensors"))
    vision = [k for k in base if "vision_tower" in k]
    assert vision and all(torch.equal(base[k], after[k]) for k in vision)
    assert any(not torch.equal(base[k], after[k]) for k in base if "language_model" in k)
    model = AutoModelForImageTextToText.from_pretrained(run / "export")
    proc = AutoProcessor.from_pretrained(run / "export")
    enc = proc(images=[items(1)[0].image], text=["<image> what colour is the shape ?"], return_tensors="pt")
    assert model(**enc).logits.shape[-1] == len(proc.tokenizer)
    # the held-out samples keep each prompt's image, and the report shows it
    sample = read_jsonl(run / "samples" / "step_00000002.jsonl")[0]
    assert sample["image"].startswith("data:image/png;base64,")
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").read_text().count('class="media image"') >= 4

    unfrozen = tmp_path / "unfrozen"
    assert train_vlm(unfrozen, vlm_base, "train.steps=2", "model.freeze_vision=false") == 0
    moved = load_file(str(unfrozen / "export" / "model.safetensors"))
    assert any(not torch.equal(base[k], moved[k]) for k in vision)


def test_what_the_image_path_cannot_do_is_refused_by_name(vlm_base, base_model, tmp_path, capsys):
    assert train_vlm(tmp_path / "a", vlm_base, "rollout.engine=vllm") == 2
    assert "regen does not pass images to vLLM yet" in capsys.readouterr().err
    assert train_vlm(tmp_path / "b", vlm_base, "data.train=builtin:arithmetic:train") == 2
    assert "the model reads images but prompt" in capsys.readouterr().err
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path / 'c'}", "data.eval=null",
                 "model.freeze_vision=true", "log.progress=none"]) == 2
    assert "model.freeze_vision is for vision-language models" in capsys.readouterr().err
    assert main(["train", f"model.path={vlm_base}", f"run.dir={tmp_path / 'd'}", "algorithm.name=dpo",
                 "data.train=builtin:arithmetic:train", "log.progress=none"]) == 2
    assert "the model reads images but the row of prompt" in capsys.readouterr().err  # pairs without images
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()  # refused at the start: no folder left


def test_a_hugging_face_image_column_becomes_the_prompt_image(tmp_path):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(1)
    imgs = [rng.integers(0, 256, (6, 4, 3), dtype=np.uint8) for _ in range(2)]
    ds = datasets.Dataset.from_dict({"question": ["q0", "q1"], "picture": [Image.fromarray(x) for x in imgs]})
    ds.cast_column("picture", datasets.Image()).save_to_disk(str(tmp_path / "ds"))
    items = load_prompts(f"hf:{tmp_path / 'ds'}", None, "data.train", columns={"prompt": "question", "image": "picture"})
    assert [it.prompt for it in items] == ["q0", "q1"]
    for it, want in zip(items, imgs):
        assert np.array_equal(it.image, want)
        assert it.meta["image"].startswith("data:image/png;base64,")  # JSON-safe for rewards and services


# a template that writes a content list's image as the processor's image token
VLM_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }}{% endif %}"
                "{% endfor %}{% endif %}{% endfor %}")


def test_a_chat_template_places_the_image_and_a_text_model_refuses_images(vlm_base, base_model, tmp_path, capsys):
    from transformers import AutoProcessor

    from regen.config import ModelConfig
    from regen.data.chat import render
    from regen.policies.lm_load import load_tokenizer

    folder = tmp_path / "chat-vlm"
    import shutil

    shutil.copytree(vlm_base, folder)
    proc = AutoProcessor.from_pretrained(folder)
    proc.chat_template = VLM_TEMPLATE
    proc.save_pretrained(folder)
    shown = render(items(2), load_tokenizer(ModelConfig(path=str(folder)), None), None, "data.train")
    assert [it.prompt for it in shown] == ["<image> what colour is the shape ?", "<image> what shape is it ?"]
    assert all(it.image is not None for it in shown)
    assert train_vlm(tmp_path / "run", folder, "train.steps=1", "data.chat_template=true") == 0
    # rows with images given to a model that reads none: refused, not silently dropped
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path / 'text'}", *VLM_FAST[:1], "data.eval=null",
                 "log.progress=none"]) == 2
    assert "carry an 'image' but model.path is a text-only model" in capsys.readouterr().err
