"""The flow-model families users bring (SD3, Wan, FLUX.1-dev, FLUX.1-schnell, Qwen-Image,
HunyuanVideo), each tiny from its real diffusers classes: FLUX's packing, time shift and guidance as
FluxPipeline has them, Qwen-Image's prompt template, shift and renormalised guidance as
QwenImagePipeline has them, HunyuanVideo's template crop and embedded guidance, rollouts
re-scored exactly, exports that the plain pipeline samples into regen's image, every method with
and without LoRA, torchrun and Ray equal to one process, a FLUX painter in a joint run; and the
supported-models table of docs/images-and-videos.md held to these tests."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from regen.cli import main
from regen.config import ModelConfig
from regen.policies.flow_load import load_flow_policy
from tests.conftest import FLOW_FAMILIES, joint_args, ray_actors_train, read_jsonl, torchrun_train

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
PROMPTS = ["a red circle at the left", "a blue square at the top"]
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
FROZEN = ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors")
PAINTER_MAIN = ("flux-dev", "qwen-image")  # the joint runs of the main tier; the others' in the extended
METHODS = ("flow_grpo", "flow_dppo", "nft", "awm", "dgpo")


def policy(folder):
    return load_flow_policy(ModelConfig(path=str(folder)), 0, CPU)


# ---------------------------------------------------------------- FLUX as FluxPipeline has it


def test_flux_packing_and_image_ids_are_the_pipelines():
    from diffusers import FluxPipeline

    from regen.policies.flow_flux import image_ids, pack, unpack

    x = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(0))
    packed = pack(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 8, 6)) and packed.shape == (2, 12, 16)
    assert torch.equal(unpack(packed, 8, 6), x)
    assert torch.equal(image_ids(8, 6, CPU, torch.float32), FluxPipeline._prepare_latent_image_ids(2, 4, 3, CPU,
                                                                                                    torch.float32))
    # by hand: patch (row 1, col 2) of a 2-channel 4x6 latent holds channel-major its 2x2 pixels
    y = torch.arange(48.0).view(1, 2, 4, 6)
    assert pack(y)[0, 1 * 3 + 2].tolist() == [16, 17, 22, 23, 40, 41, 46, 47]


def test_the_families_own_sigma_grids_by_hand(flow_family_dirs):
    """flow.shift null: FLUX-dev's resolution-dependent shift from its 16 packed tokens, schnell
    unshifted on linspace(1, 1/3, 3); SD3 and Wan the scheduler's own set_timesteps(3), shift 3."""
    s = np.array([1.0, 2 / 3, 1 / 3])
    mu = 0.5 + (1.15 - 0.5) * (16 - 256) / (4096 - 256)  # base_shift .. max_shift over 256 .. 4096 tokens
    dev = np.exp(mu) / (np.exp(mu) + 1 / s - 1)
    t = np.linspace(1.0, 3 * 0.001 / (1 + 2 * 0.001), 3)  # SD3-style: from sigma_max to the shifted sigma_min
    sd3 = 3 * t / (1 + 2 * t)
    mu = 0.5 + (0.9 - 0.5) * (16 - 256) / (8192 - 256)  # Qwen-Image: to 0.9 at 8192 tokens, then stretched so
    qwen = np.exp(mu) / (np.exp(mu) + 1 / s - 1)  # that the last sigma before 0 is shift_terminal = 0.02
    qwen = 1 - (1 - qwen) / ((1 - qwen[-1]) / (1 - 0.02))
    want = {"flux-dev": dev, "flux-schnell": s, "sd3": sd3, "wan": sd3, "qwen-image": qwen,
            "hunyuan-video": 7 * s / (1 + 6 * s)}  # HunyuanVideo: linspace(1, 0, n + 1)[:-1], its shift 7
    for fam, grid in want.items():
        got = policy(flow_family_dirs[fam]).sigmas(3, None)
        assert got.tolist() == pytest.approx([*grid, 0.0], abs=1e-6), fam
        assert policy(flow_family_dirs[fam]).sigmas(3, 2.0).tolist() == pytest.approx(
            [1.0, 2 * 2 / 3 / (1 + 2 / 3), 2 / 3 / (1 + 1 / 3), 0.0], abs=1e-6)  # a number: regen's shift


@pytest.mark.parametrize("family", ["flux-dev", "flux-schnell"])
def test_flux_ode_sampler_is_flux_pipeline_with_its_guidance(family, flow_family_dirs):
    """Same seed, 3 steps, the family's own grid: regen's Euler sampler ends on FluxPipeline's
    latents, without and with true CFG (empty negative prompt); dev's embedded guidance value is
    read (another value gives other latents)."""
    from diffusers import FluxPipeline

    p, pipe = policy(flow_family_dirs[family]), FluxPipeline.from_pretrained(flow_family_dirs[family])
    dev = family == "flux-dev"
    assert (p.guidance_embed == 3.5) == dev and (p.guidance_embed is None) != dev

    def theirs(guidance=3.5, **kw):
        out = pipe(PROMPTS, num_inference_steps=3, height=16, width=16, generator=torch.Generator().manual_seed(5),
                   output_type="latent", max_sequence_length=8, guidance_scale=guidance, **kw).images
        return FluxPipeline._unpack_latents(out, 16, 16, 2)

    for cfg, kw in ((1.0, {}), (2.5, {"negative_prompt": ["", ""], "true_cfg_scale": 2.5})):
        ours = p.sample_ode(PROMPTS, 1, torch.Generator().manual_seed(5), steps=3, shift=None, guidance=cfg).x0
        torch.testing.assert_close(ours, theirs(**kw), rtol=1e-5, atol=1e-5)
    if dev:
        p.set_guidance_embed(1.5)
        other = p.sample_ode(PROMPTS, 1, torch.Generator().manual_seed(5), steps=3, shift=None).x0
        assert (other - theirs()).abs().max() > 1e-4
        torch.testing.assert_close(other, theirs(1.5), rtol=1e-5, atol=1e-5)


def test_qwenimage_sampler_is_the_pipeline_with_its_template_and_renormalised_guidance(flow_family_dirs):
    """The prompt's tokens are what remains of the template after the pipeline's 34; regen's
    sampler ends on QwenImagePipeline's latents without and with its true CFG, whose per-token
    renormalisation matters (plain CFG gives other latents)."""
    from diffusers import QwenImagePipeline

    from regen.policies.flow import FlowPolicy
    from regen.policies.flow_qwenimage import DROP, TEMPLATE

    folder = flow_family_dirs["qwen-image"]
    p, pipe = policy(folder), QwenImagePipeline.from_pretrained(folder)
    ids = p.encoder.tokenizer(TEMPLATE.format("a red circle")).input_ids
    assert p.encoder.tokenizer.convert_ids_to_tokens(ids[DROP:DROP + 3]) == ["a", "red", "circle"]

    def theirs(cfg):
        kw = {"negative_prompt": ["", ""]} if cfg > 1 else {}
        out = pipe(PROMPTS, num_inference_steps=3, height=16, width=16, generator=torch.Generator().manual_seed(5),
                   output_type="latent", true_cfg_scale=cfg, **kw).images
        return QwenImagePipeline._unpack_latents(out, 16, 16, 2)[:, :, 0]

    for cfg in (1.0, 2.5):
        ours = p.sample_ode(PROMPTS, 1, torch.Generator().manual_seed(5), steps=3, shift=None, guidance=cfg).x0
        torch.testing.assert_close(ours, theirs(cfg), rtol=1e-5, atol=1e-5)
    x, s = torch.randn(2, *p.sample_shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.3, 0.7])
    with torch.no_grad():
        c, u = p.encoder(PROMPTS), p.encoder(["", ""])
        assert (FlowPolicy.guided_velocity(p, x, s, c, u, 2.5) - p.guided_velocity(x, s, c, u, 2.5)).abs().max() > 1e-4


def test_hunyuan_video_sampler_is_the_pipeline_with_its_template_crop_and_embedded_guidance(flow_family_dirs):
    """The template's 95 tokens are cropped, the prompt's remain; regen's sampler ends on
    HunyuanVideoPipeline's latents with its embedded guidance 6 (another value: other latents)
    and with true CFG on top."""
    from diffusers import HunyuanVideoPipeline

    from regen.policies.flow_hunyuan import CROP, TEMPLATE

    folder = flow_family_dirs["hunyuan-video"]
    p, pipe = policy(folder), HunyuanVideoPipeline.from_pretrained(folder)
    ids = p.encoder.tokenizer(TEMPLATE.format("a red circle")).input_ids
    assert p.encoder.tokenizer.convert_ids_to_tokens(ids[CROP:CROP + 3]) == ["a", "red", "circle"]
    assert p.guidance_embed == 6.0

    def theirs(guidance=6.0, cfg=1.0):
        kw = {"negative_prompt": ["", ""], "true_cfg_scale": cfg} if cfg > 1 else {}
        return pipe(PROMPTS, num_inference_steps=3, height=16, width=16, num_frames=9, max_sequence_length=16,
                    generator=torch.Generator().manual_seed(5), output_type="latent", guidance_scale=guidance,
                    **kw).frames

    for cfg in (1.0, 2.5):
        ours = p.sample_ode(PROMPTS, 1, torch.Generator().manual_seed(5), steps=3, shift=None, guidance=cfg).x0
        torch.testing.assert_close(ours, theirs(cfg=cfg), rtol=1e-5, atol=1e-5)
    p.set_guidance_embed(2.0)
    other = p.sample_ode(PROMPTS, 1, torch.Generator().manual_seed(5), steps=3, shift=None).x0
    assert (other - theirs()).abs().max() > 1e-4
    torch.testing.assert_close(other, theirs(2.0), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- every family


@pytest.mark.parametrize("family", FLOW_FAMILIES)
def test_rollouts_are_rescored_to_the_samplers_logprobs(family, flow_family_dirs):
    """Ratio exactly 1 on the first on-policy update: the SDE steps' log-probs recomputed from the
    stored trajectory equal the sampler's, with CFG on, for both stochastic samplers."""
    p = policy(flow_family_dirs[family])
    sde = torch.tensor([True, True, False])
    for sampler in ("sde", "cps"):
        batch = p.rollout(PROMPTS, 2, torch.Generator().manual_seed(0), 3, sde, 0.7, sampler, shift=None, guidance=2.0)
        assert (batch.log_probs[:, :2] != 0).all() and (batch.log_probs[:, 2] == 0).all()
        logp, _, _ = p.step_logprobs(batch, 0.7, sampler, guidance=2.0)
        assert torch.equal(logp.cpu(), batch.log_probs), (family, sampler)


def pipeline_pixels(family, folder, seed):
    """The plain diffusers pipeline of the export folder, 3 steps, CFG off: pixels in [0, 1]."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder))
    assert type(pipe).__name__ == {"sd3": "StableDiffusion3Pipeline", "wan": "WanPipeline", "qwen-image":
                                   "QwenImagePipeline", "hunyuan-video": "HunyuanVideoPipeline"}.get(family, "FluxPipeline")
    meta = json.loads((Path(folder) / "flow_policy.json").read_text())
    kw = {"guidance_scale": meta.get("guidance_embed") or 1.0, "height": 16, "width": 16, "num_inference_steps": 3,
          "max_sequence_length": meta["max_sequence_length"], "generator": torch.Generator().manual_seed(seed),
          "output_type": "pt"}
    if family == "qwen-image":  # CFG is its true_cfg_scale (default 4 with a negative prompt); no embedding
        kw.update(true_cfg_scale=1.0, guidance_scale=None)
    if family in ("wan", "hunyuan-video"):
        return pipe(PROMPTS, num_frames=9, **kw).frames  # (B, F, 3, H, W)
    return pipe(PROMPTS, **kw).images


@pytest.mark.parametrize("family", FLOW_FAMILIES)
def test_export_sampled_by_the_plain_pipeline_is_regens_image(family, flow_family_dirs, flow_prompts, tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"model.path={flow_family_dirs[family]}", f"run.dir={run}", *JOB, *METHOD["nft"]]) == 0
    export = run / "export"
    moved = load_file(str(export / TRANSFORMER))
    start = load_file(str(Path(flow_family_dirs[family]) / TRANSFORMER))
    assert any(not torch.equal(moved[k], start[k]) for k in start)  # a trained model, not the start
    p = policy(export)
    with torch.no_grad():
        ours = (p.decode(p.sample_ode(PROMPTS, 1, torch.Generator().manual_seed(3), 3, None, 1.0).x0) + 1) / 2
    theirs = pipeline_pixels(family, export, 3)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-5)


def test_the_reward_service_scores_the_families_images_and_videos_as_in_process(flow_family_dirs, flow_prompts,
                                                                                tmp_path, monkeypatch):
    """A real `regen serve-reward` process scores FLUX's images and HunyuanVideo's frames: each step's
    rewards equal the in-process reward's on the same samples (same seed)."""
    from tests.test_reward_service import TOKEN, Server

    monkeypatch.setenv("TEST_TOKEN_ENV", TOKEN)
    srv = Server("brightness").start()
    try:
        for fam in ("flux-dev", "hunyuan-video"):
            rows = {}
            for where, reward in (("local", "reward=[{name: brightness}]"),
                                  ("remote", f"reward=[{{name: remote, args: {{url: '{srv.url}', auth_env: "
                                             "TEST_TOKEN_ENV, reward: brightness}}]")):
                run = tmp_path / f"{fam}-{where}"
                assert main(["train", f"model.path={flow_family_dirs[fam]}", f"run.dir={run}",
                             f"data.train={flow_prompts}", *JOB, *METHOD["nft"], reward]) == 0
                rows[where] = [r["reward/mean"] for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
            assert len(rows["local"]) == 2 and rows["remote"] == pytest.approx(rows["local"], abs=1e-9), fam
    finally:
        assert TOKEN not in srv.stop()


# ---------------------------------------------------------------- the table


def table() -> dict[tuple[str, str], str]:
    """{(family id, column): 'yes' | 'no'} from docs/images-and-videos.md's supported-models table."""
    lines = (ROOT / "docs" / "images-and-videos.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| family (`id`)"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    cells = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        row = [c.strip() for c in ln.strip("|").split("|")]
        family = re.search(r"\(`([\w-]+)`\)", row[0]).group(1)
        cells.update({(family, col): val for col, val in zip(head[1:], row[1:])})
    return cells


JOB = ["data.eval=null", "rollout.global_batch_size=4", "rollout.group_size=2", "flow.steps=3", "train.steps=2",
       "optim.lr=1e-3", "log.progress=none", "log.tensorboard=false", "run.threads=2", "checkpoint.every=0",
       "reward=[{name: jpeg_compressibility}]"]
METHOD = {m: [f"algorithm.name={m}"] for m in METHODS}
METHOD["flow_grpo"] += ["algorithm.kl_coef=0.1"]  # with its reference: the base, or the adapter switched off
# the columns a 2-step job stands behind: {column: {case: arguments}}
JOBS = {**{m: {m: METHOD[m]} for m in METHODS},
        "lora": {m: [*METHOD[m], "model.lora={r: 2, alpha: 4}"] for m in METHODS},
        "ema": {"nft": [*METHOD["nft"], "flow.weight_ema=0.5"]},
        "checkpointing": {"flow_grpo": [*METHOD["flow_grpo"], "train.gradient_checkpointing=true"]}}
# the columns other tests stand behind, parametrized over the families they cover (torchrun, ray
# and painter are defined below)
ELSEWHERE = {"ratio 1": test_rollouts_are_rescored_to_the_samplers_logprobs,
             "export": test_export_sampled_by_the_plain_pipeline_is_regens_image}
REFUSED = {"ltx-video": "LTX-Video pipeline (LTXPipeline)", "cogvideox": "CogVideoX pipeline (CogVideoXPipeline)"}
NOT_BUILT = {"ltx-video": "LTXPipeline", "cogvideox": "CogVideoXPipeline"}


def families_of(test) -> set[str]:
    """The families a test function is parametrized over (its first parameter, `family`)."""
    marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize" and m.args[0].startswith("family")]
    values = [v.values if hasattr(v, "values") else v for v in marks[0].args[1]] if marks else []
    return {v[0] if isinstance(v, tuple) else v for v in values}


def job_cells():
    return [pytest.param(f, c, case, id=f"{f}-{c}-{case}") for (f, c), v in sorted(table().items())
            if v == "yes" and c in JOBS for case in JOBS[c]]


@pytest.mark.parametrize("family,column,case", job_cells())
def test_each_supported_cell_trains_two_steps(family, column, case, flow_family_dirs, flow_prompts, tmp_path):
    base, run = flow_family_dirs[family], tmp_path / "run"
    assert main(["train", f"model.path={base}", f"run.dir={run}", f"data.train={flow_prompts}", *JOB,
                 *JOBS[column][case]]) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    start, end = load_file(str(Path(base) / TRANSFORMER)), load_file(str(run / "export" / TRANSFORMER))
    assert set(start) == set(end) and any(not torch.equal(start[k], end[k]) for k in start)  # LoRA: merged
    for part in FROZEN:  # text encoders and VAE stay as they were
        a, b = load_file(str(Path(base) / part)), load_file(str(run / "export" / part))
        assert all(torch.equal(a[k], b[k]) for k in a), part


@pytest.mark.parametrize("family", sorted({f for (f, _), v in table().items() if v == "no"}))
def test_each_unsupported_family_is_refused_by_name(family, flow_prompts, tmp_path, capsys):
    folder = tmp_path / family
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": NOT_BUILT[family]}))
    assert main(["train", f"model.path={folder}", f"run.dir={tmp_path / 'run'}", f"data.train={flow_prompts}",
                 *JOB, *METHOD["nft"]]) == 2
    assert REFUSED[family] in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run directory


def test_guidance_embed_is_refused_for_models_without_the_embedding(flow_family_dirs, flow_prompts, tmp_path, capsys):
    for fam in ("flux-schnell", "sd3"):
        assert main(["train", f"model.path={flow_family_dirs[fam]}", f"run.dir={tmp_path / 'run'}",
                     f"data.train={flow_prompts}", *JOB, *METHOD["nft"], "flow.guidance_embed=2.0"]) == 2
        err = capsys.readouterr().err
        assert "flow.guidance_embed is read only with a guidance-distilled model" in err, err
        assert not (tmp_path / "run").exists()


def test_guidance_embed_trains_and_is_kept_in_the_export(flow_family_dirs, flow_prompts, tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"model.path={flow_family_dirs['flux-dev']}", f"run.dir={run}", f"data.train={flow_prompts}",
                 *JOB, *METHOD["nft"], "flow.guidance_embed=2.0"]) == 0
    assert json.loads((run / "export" / "flow_policy.json").read_text())["guidance_embed"] == 2.0
    assert policy(run / "export").guidance_embed == 2.0


# ---------------------------------------------------------------- distributed and joint


def dist_setup(prompts) -> list[str]:
    return [f"data.train={prompts}", "data.eval=null", "rollout.global_batch_size=8", "rollout.group_size=2",
            "train.global_minibatch_size=4", "train.ppo_epochs=2", "flow.steps=3", "train.steps=2", "optim.lr=1e-3",
            "log.progress=none", "log.tensorboard=false", "run.threads=1", "checkpoint.every=0",
            "algorithm.name=flow_grpo", "algorithm.kl_coef=0.1",
            # the mean colour, smooth in the pixels: JPEG size jumps when a pixel's rounding flips, and
            # FSDP2's reduce-scatter sums in another order than one process (flux-dev: 1.4e-4 apart)
            "reward=[{name: colour_target, args: {target: red, region: image}}]"]


def assert_same_training(a_dir, b_dir, base):
    a, b = read_jsonl(a_dir / "metrics.jsonl"), read_jsonl(b_dir / "metrics.jsonl")
    for key in ("reward/mean", "loss"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-4, abs=1e-6), key
    wa, wb = load_file(str(a_dir / "export" / TRANSFORMER)), load_file(str(b_dir / "export" / TRANSFORMER))
    w0 = load_file(str(Path(base) / TRANSFORMER))
    diff = sum(((wa[k] - wb[k]) ** 2).sum() for k in wa) ** 0.5
    moved = sum(((wa[k] - w0[k]) ** 2).sum() for k in wa) ** 0.5
    assert moved > 1e-4 and diff < 1e-3 * moved, (float(diff), float(moved))


@pytest.mark.parametrize("family", ["flux-dev", "qwen-image", "hunyuan-video"])
def test_lora_adapts_both_streams_of_the_joint_attention(family, flow_family_dirs):
    """The dual-stream families' default LoRA targets: the image stream's q, k, v, out and the text
    stream's add_q/k/v_proj and to_add_out (FLUX's single blocks: their q, k, v)."""
    from regen.config import ModelConfig as M
    from regen.policies.flow_lora import add_lora

    p = policy(flow_family_dirs[family])
    add_lora(p.unet, M(path="x", lora={"r": 2}).lora, 0, p.LORA_TARGETS)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in p.unet.named_parameters() if ".lora_A." in n}
    kinds = {n.split(".")[-1] if not n.endswith("to_out.0") else "to_out.0" for n in adapted}
    assert kinds == {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}
    if family == "flux-dev":
        assert {"single_transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_q_proj"} <= adapted


def test_fsdp_units_are_every_list_of_blocks(flow_family_dirs):
    """FSDP2 shards each block of every block list at the shallowest depth: FLUX's double- and
    single-stream blocks, Qwen-Image's blocks, a UNet's down and up blocks (not the first list only)."""
    from regen.policies.flow import FlowPolicy
    from regen.runtime.dist import _blocks

    flux, qwen = policy(flow_family_dirs["flux-dev"]).unet, policy(flow_family_dirs["qwen-image"]).unet
    assert [type(b).__name__ for b in _blocks(flux)] == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert [type(b).__name__ for b in _blocks(qwen)] == ["QwenImageTransformerBlock"]
    unet = FlowPolicy.builtin(False, 0, CPU).unet
    assert _blocks(unet) == [*unet.down_blocks, *unet.up_blocks]


@pytest.mark.extended  # multi-process: the CI's second tier
@pytest.mark.parametrize("family,strategy", [*[(f, "ddp") for f in FLOW_FAMILIES], ("flux-dev", "fsdp"),
                                             ("qwen-image", "fsdp")])
def test_torchrun_two_ranks_train_what_one_process_trains(family, strategy, flow_family_dirs, flow_prompts, tmp_path):
    base, setup = flow_family_dirs[family], dist_setup(flow_prompts)
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", f"model.path={base}", f"run.dir={one}", *setup, "distributed.mode=single"]) == 0
    out = torchrun_train(f"model.path={base}", f"run.dir={two}", *setup, f"distributed.strategy={strategy}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_training(two, one, base)


@pytest.mark.extended  # Ray actors: the CI's second tier
@pytest.mark.parametrize("family", FLOW_FAMILIES)
def test_ray_rollout_actors_sample_what_one_process_does(family, flow_family_dirs, flow_prompts, tmp_path):
    base, setup = flow_family_dirs[family], dist_setup(flow_prompts)
    one, spread = tmp_path / "one", tmp_path / "ray"
    assert main(["train", f"model.path={base}", f"run.dir={one}", *setup]) == 0
    assert ray_actors_train(f"model.path={base}", f"run.dir={spread}", *setup) == 0
    assert_same_training(spread, one, base)


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in PAINTER_MAIN else [pytest.mark.extended])
                                    for f in FLOW_FAMILIES])
def test_a_joint_run_trains_the_family_as_the_painter(family, enhancer_base, flow_family_dirs, tmp_path):
    """An enhancer language model rewrites the prompts the painter draws; 2 steps move both."""
    run = tmp_path / "run"
    assert main(joint_args(enhancer_base, flow_family_dirs[family], run, "train.steps=2")) == 0
    painter = load_file(str(run / "export" / "painter" / TRANSFORMER))
    start = load_file(str(Path(flow_family_dirs[family]) / TRANSFORMER))
    assert any(not torch.equal(painter[k], start[k]) for k in start)
    enh_start, enh = (load_file(str(Path(d) / "model.safetensors")) for d in (enhancer_base, run / "export" / "enhancer"))
    assert any(not torch.equal(enh[k], enh_start[k]) for k in enh_start)


ELSEWHERE.update({"torchrun": test_torchrun_two_ranks_train_what_one_process_trains,
                  "ray": test_ray_rollout_actors_sample_what_one_process_does,
                  "painter": test_a_joint_run_trains_the_family_as_the_painter})


def test_the_table_matches_the_tests_and_the_refusals():
    cells = table()
    built = {f for (f, _), v in cells.items() if v == "yes"}
    assert built == set(FLOW_FAMILIES)  # every family the tests build has a row, and only those say yes
    jobs = {(f, c) for f, c, _ in (p.values for p in job_cells())}
    for (family, col), val in cells.items():
        assert val in ("yes", "no"), (family, col, val)
        if val == "no":
            assert family in REFUSED and all(cells[(family, c)] == "no" for _, c in cells if _ == family)
        elif col in JOBS:
            assert (family, col) in jobs, f"{family} x {col}: no job runs it"
        else:
            assert family in families_of(ELSEWHERE[col]), f"{family} x {col}: {ELSEWHERE[col].__name__} skips it"
