"""The flow-matching policy (built-in diffusers UNet + prompt encoder), its folder format, and
`regen sft` as flow-matching pretraining on the built-in shapes."""

import json

import pytest
import torch
from safetensors.torch import load_file

from regen.cli import main
from regen.policies.flow import FlowPolicy
from regen.tasks import shapes
from tests.conftest import read_jsonl

CPU = torch.device("cpu")


def test_shapes_data_split_and_drawing():
    train, test = shapes.split("image")
    assert len(train) == 48 and len(test) == 12 and not {shapes.prompt_text(m) for m in train} & {
        shapes.prompt_text(m) for m in test}
    for key in ("colour", "shape", "position"):  # every word of a held-out prompt was drawn in training
        assert {m[key] for m in test} <= {m[key] for m in train}
    x = shapes.draw([{"colour": "red", "shape": "square", "position": "left"}], torch.Generator().manual_seed(0))
    assert x.shape == (1, 3, 16, 16)
    on = (x[0] > -1).any(0)
    ys, xs = on.nonzero(as_tuple=True)
    assert xs.float().mean() < 7 and 6 <= ys.float().mean() <= 10  # at the left, vertically centred
    assert x[0, 0][on].min() > 0.8 and x[0, 1][on].max() < -0.8  # red: R high, G low
    v = shapes.draw([{"colour": "blue", "shape": "circle", "direction": "right"}], torch.Generator().manual_seed(0))
    cx = [(v[0, f, 2] > 0).nonzero()[:, 1].float().mean().item() for f in range(shapes.FRAMES)]
    assert v.shape == (1, 8, 3, 16, 16) and all(b > a for a, b in zip(cx, cx[1:]))  # moves right


@pytest.mark.parametrize("video", [False, True])
def test_policy_round_trip_and_sampling(tmp_path, video):
    policy = FlowPolicy.builtin(video, seed=0, device=CPU)
    policy.save_pretrained(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "flow_policy.json").read_text())
    assert meta["sample_shape"] == list(policy.sample_shape)
    back = FlowPolicy.load(tmp_path / "m", CPU)
    x = torch.randn(2, *policy.sample_shape)
    sigma, cond = torch.tensor([0.3, 0.9]), policy.encoder(["a red circle at the left", ""])
    torch.testing.assert_close(back.velocity(x, sigma, back.encoder(["a red circle at the left", ""])),
                               policy.velocity(x, sigma, cond), rtol=0, atol=0)
    out = policy.sample_ode(["a red circle at the left", "a blue square at the top"], 3,
                            torch.Generator().manual_seed(1), steps=4)
    assert out.x0.shape == (6, *policy.sample_shape) and out.prompts[2] == "a red circle at the left"
    again = policy.sample_ode(["a red circle at the left", "a blue square at the top"], 3,
                              torch.Generator().manual_seed(1), steps=4)
    assert torch.equal(out.x0, again.x0)
    # guidance 1 is the conditional field alone; another scale changes the samples
    g1 = policy.sample_ode(["a red circle at the left"], 1, torch.Generator().manual_seed(2), steps=3, guidance=1.0)
    g3 = policy.sample_ode(["a red circle at the left"], 1, torch.Generator().manual_seed(2), steps=3, guidance=3.0)
    assert not torch.equal(g1.x0, g3.x0)


def test_cfg_combines_conditional_and_unconditional_velocities():
    policy = FlowPolicy.builtin(False, seed=0, device=CPU)
    x, s = torch.randn(1, 3, 16, 16), torch.tensor([0.5])
    c, u = policy.encoder(["a red circle at the left"]), policy.encoder([""])
    vc, vu = policy.velocity(x, s, c), policy.velocity(x, s, u)
    torch.testing.assert_close(policy.guided_velocity(x, s, c, u, 4.0), vu + 4.0 * (vc - vu), rtol=1e-5, atol=1e-5)


def test_bad_model_folder(tmp_path):
    from regen.errors import UserError

    with pytest.raises(UserError, match="not a regen flow model folder"):
        FlowPolicy.load(tmp_path, CPU)


def test_flow_sft_learns_saves_samples_and_resumes_exactly(tmp_path):
    common = ["sft", "model.init=shapes-unet", "data.train=builtin:shapes:train", "data.eval=builtin:shapes:test",
              "sft.global_batch_size=16", "optim.lr=1e-3", "eval.num_prompts=2", "eval.samples_per_prompt=2",
              "log.progress=none", "log.tensorboard=false", "run.threads=2"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*common, f"run.dir={a}", "sft.steps=16", "eval.every=8", "checkpoint.every=8"]) == 0
    rows = read_jsonl(a / "metrics.jsonl")
    loss = [r["loss"] for r in rows if "loss" in r]
    assert sum(loss[-4:]) < sum(loss[:4])  # flow-matching loss falls
    samples = read_jsonl(a / "samples" / "step_00000016.jsonl")
    assert len(samples) == 4 and samples[0]["prompt"] == shapes.prompt_text(shapes.split("image")[1][0])
    assert (a / samples[0]["image"]).is_file()
    assert (a / "export" / "flow_policy.json").is_file()
    # exact resume: 8 steps, then 8 more from the checkpoint == 16 straight
    assert main([*common, f"run.dir={b}", "sft.steps=8", "eval.every=8"]) == 0
    assert main([*common, f"run.dir={b}", "sft.steps=16", "eval.every=8", "--resume"]) == 0
    wa = load_file(str(a / "export" / "unet" / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(b / "export" / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_flow_sft_rejects_text_data(tmp_path, capsys):
    assert main(["sft", "model.init=shapes-unet", f"run.dir={tmp_path}", "log.progress=none"]) == 2
    assert "builtin:shapes:train" in capsys.readouterr().err
