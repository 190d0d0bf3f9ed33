"""The diffusers latent flow policies (SD3 images, Wan videos) on tiny random folders: they load
through regen's config path, compute what diffusers' own pipelines compute (condition,
velocity, decoding, the ODE sampler), re-score their SDE rollouts exactly, save and load
without loss, fail clearly on incomplete folders, and train end to end with regen's RL loop."""

import json
import shutil

import pytest
import torch

from regen.config import RLConfig
from regen.config.load import load_config
from regen.errors import UserError
from regen.policies.flow_load import is_flow_model, load_flow_policy
from regen.policies.flow_sd3 import SD3FlowPolicy, tiny_sd3
from regen.policies.flow_wan import WanFlowPolicy, tiny_wan

CPU = torch.device("cpu")
PROMPTS = ["a red circle at the left", "a blue square at the top"]
# the tiny folders' shapes, from their configs (not from the code under test)
LATENT = {"sd3": (4, 8, 8), "wan": (4, 5, 4, 4)}  # SD3: 16 px / 2; Wan: 9 frames -> (9-1)/2+1, 16 px / 4
PIXELS = {"sd3": (3, 16, 16), "wan": (9, 3, 16, 16)}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def model_cfg(folder, *extra):
    return load_config(RLConfig, None, [f"model.path={folder}", "algorithm.name=nft", *extra]).model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusers")
    return {
        "sd3": tiny_sd3(root / "sd3", seed=0),
        "sd3-no-t5": tiny_sd3(root / "sd3_no_t5", seed=1, t5=False),
        "wan": tiny_wan(root / "wan", seed=0),
    }


def policy_of(folders, kind):
    return load_flow_policy(model_cfg(folders[kind]), 0, CPU)


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_tiny_folder_loads_through_the_config_and_samples(folders, kind):
    from diffusers import DiffusionPipeline

    from regen.data import PromptItem
    from regen.modalities.flow import to_samples

    folder = folders[kind]
    assert is_flow_model(model_cfg(folder))
    policy = load_flow_policy(model_cfg(folder), 0, CPU)
    assert type(policy) is {"sd3": SD3FlowPolicy, "wan": WanFlowPolicy}[kind] and policy.sample_shape == LATENT[kind]
    assert {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"} <= {p.name for p in folder.iterdir()}
    out = policy.sample_ode(PROMPTS, 2, torch.Generator().manual_seed(0), steps=3)
    assert out.x0.shape == (4, *LATENT[kind]) and out.prompts[1] == PROMPTS[0]
    pix = policy.decode(out.x0)
    assert pix.shape == (4, *PIXELS[kind]) and pix.min() >= -1 and pix.max() <= 1
    media = to_samples(policy, out, [PromptItem(p) for p in PROMPTS], 2)[3].media  # what a reward reads
    assert media.dtype.name == "uint8" and media.shape == (*PIXELS[kind][:-3], 16, 16, 3)
    # the folder is a diffusers pipeline folder as well
    pipe = DiffusionPipeline.from_pretrained(str(folder))
    assert type(pipe).__name__ == {"sd3": "StableDiffusion3Pipeline", "wan": "WanPipeline"}[kind]


@pytest.mark.parametrize("kind", ["sd3", "sd3-no-t5"])
def test_sd3_velocity_is_the_transformer_on_the_pipelines_condition(folders, kind):
    from diffusers import StableDiffusion3Pipeline

    policy = policy_of(folders, kind)
    no_t5 = {"text_encoder_3": None, "tokenizer_3": None} if kind == "sd3-no-t5" else {}  # as diffusers' docs
    pipe = StableDiffusion3Pipeline.from_pretrained(str(folders[kind]), **no_t5)  # its own copy of every weight
    states, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=8)
    # 8 CLIP tokens + 8 T5 tokens (zeros without T5), 32 wide; the CLIPs (8 + 16 wide) padded to 32
    assert states.shape == (2, 16, 32) and pooled.shape == (2, 4 + 12)
    assert not states[:, :8, 24:].any() and states[:, 8:].any() == (kind == "sd3")
    cond = policy.encoder(PROMPTS)
    torch.testing.assert_close(cond[0], states, rtol=0, atol=1e-6)
    torch.testing.assert_close(cond[1], pooled, rtol=0, atol=1e-6)
    x, sigma = torch.randn(2, *LATENT["sd3"], generator=torch.Generator().manual_seed(0)), torch.tensor([0.25, 0.8])
    with torch.no_grad():
        want = pipe.transformer(
            hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=states, pooled_projections=pooled
        ).sample
        got = policy.velocity(x, sigma, cond)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_wan_velocity_is_the_transformer_on_the_pipelines_condition(folders):
    from diffusers import WanPipeline

    policy = policy_of(folders, "wan")
    pipe = WanPipeline.from_pretrained(str(folders["wan"]))
    prompts = [*PROMPTS, ""]
    states, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=8)
    assert states.shape == (3, 8, 16) and not states[2, 1:].any()  # "" is "</s>" alone: the rest zeroed
    cond = policy.encoder(prompts)
    torch.testing.assert_close(cond, states, rtol=0, atol=1e-6)
    x, sigma = torch.randn(3, *LATENT["wan"], generator=torch.Generator().manual_seed(0)), torch.tensor([0.1, 0.5, 1.0])
    with torch.no_grad():
        want = pipe.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=states).sample
        got = policy.velocity(x, sigma, cond)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_decode_and_encode_are_the_vae_with_the_pipelines_scaling(folders):
    from diffusers import AutoencoderKL, AutoencoderKLWan

    g = torch.Generator().manual_seed(3)
    sd3 = policy_of(folders, "sd3")
    vae = AutoencoderKL.from_pretrained(str(folders["sd3"] / "vae"))
    z = torch.randn(2, *LATENT["sd3"], generator=g)
    with torch.no_grad():  # SD3's VAE: scaling_factor 1.5305, shift_factor 0.0609 (tiny_sd3's config)
        torch.testing.assert_close(sd3.decode(z), vae.decode(z / 1.5305 + 0.0609).sample.clamp(-1, 1))
        px = torch.rand(2, 3, 16, 16, generator=g) * 2 - 1
        torch.testing.assert_close(sd3.encode(px), (vae.encode(px).latent_dist.mean - 0.0609) * 1.5305)
    wan = policy_of(folders, "wan")
    vae = AutoencoderKLWan.from_pretrained(str(folders["wan"] / "vae"))
    mean = torch.tensor([-0.1, 0.2, 0.05, -0.3]).view(1, 4, 1, 1, 1)  # tiny_wan's latents_mean / latents_std
    std = torch.tensor([1.5, 0.8, 2.0, 1.2]).view(1, 4, 1, 1, 1)
    z = torch.randn(2, *LATENT["wan"], generator=g)
    with torch.no_grad():
        video = vae.decode(z * std + mean).sample  # (B, 3, F, H, W)
        torch.testing.assert_close(wan.decode(z), video.clamp(-1, 1).permute(0, 2, 1, 3, 4), rtol=1e-5, atol=1e-5)
        px = torch.rand(2, 9, 3, 16, 16, generator=g) * 2 - 1
        want = (vae.encode(px.permute(0, 2, 1, 3, 4)).latent_dist.mean - mean) / std
        torch.testing.assert_close(wan.encode(px), want, rtol=1e-5, atol=1e-5)


def test_sd3_ode_sampler_is_diffusers_pipeline(folders):
    """Same initial latents, same grid (3 steps, shift 3 as the folder's scheduler), guidance
    3: regen's Euler sampler and StableDiffusion3Pipeline end on the same latents."""
    from diffusers import StableDiffusion3Pipeline

    policy = policy_of(folders, "sd3")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(folders["sd3"]))
    out = policy.sample_ode(PROMPTS, 1, torch.Generator().manual_seed(5), steps=3, shift=3.0, guidance=3.0)
    x1 = torch.randn(2, *LATENT["sd3"], generator=torch.Generator().manual_seed(5))  # sample_ode's first draw
    want = pipe(
        PROMPTS,
        num_inference_steps=3,
        sigmas=[1.0, 2 / 3, 1 / 3],
        guidance_scale=3.0,
        height=16,
        width=16,
        latents=x1,
        output_type="latent",
        max_sequence_length=8,
    ).images
    torch.testing.assert_close(out.x0, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,sampler", [("sd3", "sde"), ("sd3", "cps"), ("wan", "sde")])
def test_rollout_rescored_exactly_and_zero_noise_is_the_ode(folders, kind, sampler):
    policy = policy_of(folders, kind)
    sde = torch.tensor([True, True, False])
    batch = policy.rollout(PROMPTS, 2, torch.Generator().manual_seed(0), 3, sde, 0.7, sampler, guidance=2.0)
    assert batch.states.shape == (4, 4, *LATENT[kind])
    assert (batch.log_probs[:, :2] != 0).all() and (batch.log_probs[:, 2] == 0).all()
    logp, means, stds = policy.step_logprobs(batch, 0.7, sampler, guidance=2.0)
    assert torch.equal(logp.cpu(), batch.log_probs)  # the first on-policy ratio is exactly 1
    assert means[2] is None and stds[0] > 0
    zero = policy.rollout(
        PROMPTS, 2, torch.Generator().manual_seed(1), 3, torch.ones(3, dtype=torch.bool), 0.0, sampler, guidance=2.0
    )
    ode = policy.sample_ode(PROMPTS, 2, torch.Generator().manual_seed(1), steps=3, guidance=2.0)
    assert torch.equal(zero.x0, ode.x0)


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_guidance_combines_two_separate_calls(folders, kind):
    policy = policy_of(folders, kind)
    policy.train(True)  # trains the transformer only: the frozen text encoders keep their dropout off
    x, s = torch.randn(2, *LATENT[kind], generator=torch.Generator().manual_seed(0)), torch.tensor([0.3, 0.7])
    c, u = policy.encoder(PROMPTS), policy.encoder(["", ""])
    assert all(torch.equal(a, b) for a, b in zip(c, policy.encoder(PROMPTS)))
    with torch.no_grad():
        vc, vu = policy.velocity(x, s, c), policy.velocity(x, s, u)
        assert (vc - vu).abs().max() > 1e-4  # the prompt matters, so the check below is not vacuous
        torch.testing.assert_close(policy.guided_velocity(x, s, c, u, 4.0), vu + 4.0 * (vc - vu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_save_load_round_trip(folders, tmp_path, kind):
    policy = policy_of(folders, kind)
    with torch.no_grad():  # trained-looking weights: a save that wrote the originals would fail below
        for p in policy.unet.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    policy.save_pretrained(tmp_path / "m")
    back = load_flow_policy(model_cfg(tmp_path / "m"), 0, CPU)
    assert back.sample_shape == policy.sample_shape and back.meta == policy.meta
    x, s = torch.randn(2, *LATENT[kind], generator=torch.Generator().manual_seed(0)), torch.tensor([0.4, 0.9])
    with torch.no_grad():
        v = policy.velocity(x, s, policy.encoder(PROMPTS))
        torch.testing.assert_close(back.velocity(x, s, back.encoder(PROMPTS)), v, rtol=0, atol=0)
        torch.testing.assert_close(back.decode(x), policy.decode(x), rtol=0, atol=0)
        orig = policy_of(folders, kind)
        assert not torch.allclose(orig.velocity(x, s, orig.encoder(PROMPTS)), v)


def test_incomplete_and_foreign_folders_are_clear_errors(folders, tmp_path):
    bad = tmp_path / "no_vae"
    shutil.copytree(folders["sd3"], bad)
    shutil.rmtree(bad / "vae")
    with pytest.raises(UserError, match=r"'.*no_vae' has no vae/ \(an SD3 pipeline folder needs transformer/, vae/"):
        load_flow_policy(model_cfg(bad), 0, CPU)
    wan = tmp_path / "wan"
    shutil.copytree(folders["wan"], wan)
    shutil.rmtree(wan / "tokenizer")
    with pytest.raises(UserError, match="has no tokenizer/ .a Wan pipeline folder"):
        load_flow_policy(model_cfg(wan), 0, CPU)
    (wan / "flow_policy.json").write_text(json.dumps({"kind": "wan", "frames": 8}))
    shutil.copytree(folders["wan"] / "tokenizer", wan / "tokenizer")
    with pytest.raises(UserError, match="frames=8: frames - 1 must be a multiple of 2"):
        load_flow_policy(model_cfg(wan), 0, CPU)
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(UserError, match=r"has no transformer/, vae/, .* \(a FLUX pipeline folder needs"):
        load_flow_policy(model_cfg(flux), 0, CPU)
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(UserError, match="diffusers StableDiffusionXLPipeline folder; regen does not train it"):
        is_flow_model(model_cfg(flux))


def test_plain_pipeline_folder_loads_with_the_pipelines_default_size(folders, tmp_path):
    for kind, shape in (("sd3", (4, 8, 8)), ("wan", (4, 41, 120, 208))):  # Wan: 81 frames of 480 x 832
        plain = tmp_path / kind
        shutil.copytree(folders[kind], plain)
        (plain / "flow_policy.json").unlink()
        assert is_flow_model(model_cfg(plain))  # by model_index.json's pipeline class
        assert load_flow_policy(model_cfg(plain), 0, CPU).sample_shape == shape


def test_sft_encodes_pixels_and_trains_the_transformer_only(folders, tmp_path):
    """`regen sft` draws 16x16 shapes in pixel space; the SD3 policy encodes them with its VAE."""
    from safetensors.torch import load_file

    from regen.cli import main

    assert (
        main(
            [
                "sft",
                f"model.path={folders['sd3']}",
                "data.train=builtin:shapes:train",
                "data.eval=null",
                f"run.dir={tmp_path}",
                "sft.steps=2",
                "sft.global_batch_size=4",
                "log.progress=none",
                "log.tensorboard=false",
                "run.threads=2",
            ]
        )
        == 0
    )
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r)
    for part, moved in (
        ("transformer/diffusion_pytorch_model.safetensors", True),
        ("vae/diffusion_pytorch_model.safetensors", False),
        ("text_encoder_3/model.safetensors", False),
    ):
        a, b = load_file(str(folders["sd3"] / part)), load_file(str(tmp_path / "export" / part))
        assert any(not torch.equal(a[k], b[k]) for k in a) == moved, part


def rl_config(folder, run, algo, prompts, *extra):
    return load_config(
        RLConfig,
        None,
        [
            f"model.path={folder}",
            f"algorithm.name={algo}",
            f"run.dir={run}",
            f"data.train={prompts}",
            f"data.eval={prompts}",
            "eval.num_prompts=1",
            "eval.samples_per_prompt=2",
            "rollout.global_batch_size=4",
            "rollout.group_size=2",
            "flow.steps=3",
            "flow.eval_steps=3",
            "train.steps=2",
            "optim.lr=1e-3",
            "log.progress=none",
            "log.tensorboard=false",
            "run.threads=2",
            "reward=[{name: jpeg_compressibility}]",
            *extra,
        ],
    )


@pytest.mark.parametrize("kind,algo", [("sd3", "flow_grpo"), ("sd3", "nft"), ("wan", "nft")])
def test_rl_end_to_end(folders, tmp_path, kind, algo):
    from safetensors.torch import load_file

    from regen.train import train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [*PROMPTS, "a green triangle", "a cat"]))
    run = tmp_path / "run"
    summary = train(rl_config(folders[kind], run, algo, prompts))
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["reward/mean"] == r["reward/mean"] for r in rows)  # finite rewards
    if algo == "flow_grpo":
        assert rows[0]["ratio_mean"] == 1.0 and rows[0]["sde_steps"] == 3.0
    media = read_jsonl(run / "samples" / "step_00000002.jsonl")
    assert len(media) == 2 and (run / media[0]["image" if kind == "sd3" else "video"]).is_file()
    ckpt = run / "checkpoints" / "step_00000002" / "model"
    assert summary["checkpoint"] and json.loads((ckpt / "flow_policy.json").read_text())["kind"] == kind
    name = "transformer/diffusion_pytorch_model.safetensors"
    start, saved = load_file(str(folders[kind] / name)), load_file(str(ckpt / name))
    assert any(not torch.equal(start[k], saved[k]) for k in start)  # RL moved the transformer
    for part in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        a, b = load_file(str(folders[kind] / part)), load_file(str(ckpt / part))
        assert all(torch.equal(a[k], b[k]) for k in a), part  # frozen parts unchanged
    exported = load_flow_policy(model_cfg(run / "export"), 0, CPU)
    assert all(torch.equal(v, saved[k]) for k, v in exported.unet.state_dict().items())


def test_lora_on_sd3_trains_the_adapter_and_exports_a_merged_pipeline(folders, tmp_path):
    """LoRA on the transformer's attention projections: the checkpoint holds the adapter only,
    export/ is a full pipeline folder whose adapted weights are W + (alpha / r) B A."""
    from safetensors.torch import load_file

    from regen.train import train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    run = tmp_path / "run"
    train(rl_config(folders["sd3"], run, "flow_grpo", prompts, "model.lora={r: 2, alpha: 4}", "algorithm.kl_coef=0.1"))
    model = run / "checkpoints" / "step_00000002" / "model"
    assert sorted(p.name for p in model.iterdir()) == ["lora.json", "lora.safetensors"]
    adapter = load_file(str(model / "lora.safetensors"))
    name = "transformer/diffusion_pytorch_model.safetensors"
    base, export = load_file(str(folders["sd3"] / name)), load_file(str(run / "export" / name))
    layer = next(k.split(".lora_A")[0] for k in adapter if k.endswith("attn.to_q.lora_A.default.weight"))
    a, b = adapter[f"{layer}.lora_A.default.weight"], adapter[f"{layer}.lora_B.default.weight"]
    assert b.abs().sum() > 0
    torch.testing.assert_close(export[f"{layer}.weight"], base[f"{layer}.weight"] + 2.0 * b @ a, rtol=0, atol=1e-6)
    adapted = {k.split(".lora_")[0] for k in adapter}
    assert all(torch.equal(export[k], base[k]) for k in base if k.rsplit(".", 1)[0] not in adapted)
    kl = [r["kl"] for r in read_jsonl(run / "metrics.jsonl") if "kl" in r]
    assert kl[0] == 0.0 and kl[1] > 0  # the reference is the transformer with its adapter off
