"""Shared fixtures: a tiny SFT'd base model built once per session through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from regen.cli import main

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """A run with run.threads=N sets the whole process's thread count: put it back, so tests
    that compare an in-process run with a subprocess one (same thread count) do not depend on
    which test ran before."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    """A character-level GPT-2 after a short SFT (exported Hugging Face folder)."""
    run = tmp_path_factory.mktemp("sft")
    rc = main([
        "sft", "model.init=arith-char-gpt2", f"run.dir={run}", "sft.steps=300", "optim.lr=1e-3",
        "log.progress=none", "log.tensorboard=false", "eval.num_prompts=64",
    ])
    assert rc == 0
    return run / "export"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class NaNAt:
    """Wraps a loss: NaN on the given calls (1-based), the real loss otherwise."""

    def __init__(self, real, calls):
        self.real, self.calls, self.n = real, set(calls), 0

    def __call__(self, *a, **kw):
        self.n += 1
        loss, m = self.real(*a, **kw)
        return (loss * float("nan"), m) if self.n in self.calls else (loss, m)


@pytest.fixture(scope="session")
def flow_base(tmp_path_factory) -> str:
    """The built-in 16x16 shapes flow model after a short flow-matching pretraining (export folder)."""
    run = tmp_path_factory.mktemp("flow_sft")
    assert main(["sft", "model.init=shapes-unet", "data.train=builtin:shapes:train", "data.eval=null",
                 f"run.dir={run}", "sft.steps=40", "sft.global_batch_size=32", "optim.lr=2e-3",
                 "log.progress=none", "log.tensorboard=false", "run.threads=2"]) == 0
    return str(run / "export")


BRIGHT = "reward=[{name: brightness, args: {target: 0.6}}]"


def flow_rl(run, base, algo, *extra) -> int:
    """`regen train` of the shapes flow model: 2 prompts x 4 samples per step, 4 sampling steps."""
    return main(["train", f"model.path={base}", f"algorithm.name={algo}", f"run.dir={run}",
                 "data.train=builtin:shapes:train", "data.eval=builtin:shapes:test", "eval.num_prompts=2",
                 "eval.samples_per_prompt=2", "rollout.global_batch_size=8", "rollout.group_size=4",
                 "flow.steps=4", "flow.eval_steps=4", "log.progress=none", "log.tensorboard=false",
                 "optim.lr=1e-4", "run.threads=2", BRIGHT, *extra])


# --------------------------------------------------------------------------- every modality
# A guarantee of the loop holds for every modality: tests of one take `job` and run for a
# language model and a flow model alike.

LM_FAST = ["rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=4", "log.progress=none",
           "data.eval=null", "log.tensorboard=false", "optim.lr=1e-3"]
FLOW_FAST = ["data.train=builtin:shapes:train", "data.eval=null", "rollout.global_batch_size=8",
             "rollout.group_size=4", "flow.steps=3", "log.progress=none", "log.tensorboard=false", "optim.lr=1e-3",
             "run.threads=2", "algorithm.name=nft", BRIGHT]


VLM_FAST = ["data.train=builtin:shapes-vqa:train", "data.eval=null", "rollout.global_batch_size=16",
            "rollout.group_size=4", "rollout.max_new_tokens=2", "log.progress=none", "log.tensorboard=false",
            "optim.lr=1e-3", "run.threads=2", "reward=[{name: exact_match}]"]
# a tiny untrained Qwen2.5-VL (M-RoPE, packed images): a reward that varies between its samples, so updates happen
QWEN_FAST = [*VLM_FAST[:-1], "reward=[{name: 'tests.reward_fixtures:answer_words'}]"]
FAST_OF = {"lm": LM_FAST, "flow": FLOW_FAST, "vlm": VLM_FAST, "qwen": QWEN_FAST}
# the fixture of each kind's start model
BASE_OF = {"lm": "base_model", "flow": "flow_base", "vlm": "vlm_base", "qwen": "qwen_vlm_base"}


@pytest.fixture(scope="session")
def enhancer_base(tmp_path_factory) -> str:
    """The shapes-enhancer word-level GPT-2 after a short SFT on the painter's phrasing (export folder)."""
    run = tmp_path_factory.mktemp("enhancer_sft")
    assert main(["sft", "model.init=shapes-enhancer", "data.train=builtin:shapes-paraphrase:train", "data.eval=null",
                 f"run.dir={run}", "sft.steps=150", "sft.global_batch_size=32", "optim.lr=3e-3", "task.demo_noise=0.5",
                 "log.progress=none", "log.tensorboard=false", "run.threads=2"]) == 0
    return str(run / "export")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict:
    """One untrained tiny checkpoint folder per vision-language family (regen/tasks/tiny_vlms.py), over the
    shapes-vqa words."""
    from regen.tasks import shapes_vqa, tiny_vlms

    out = {}
    for fam in tiny_vlms.FAMILIES:
        folder = tmp_path_factory.mktemp(fam)
        tiny_vlms.save(fam, folder, shapes_vqa.words(), seed=0)
        out[fam] = str(folder)
    return out


def torchrun_train(*args: str):
    """`regen train ARGS distributed.mode=torchrun` on two real ranks (one thread each); the
    finished process (its returncode and stderr)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "regen", "train",
           *args, "distributed.mode=torchrun"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])})


def ray_actors_train(*args: str) -> int:
    """`regen train ARGS` with 2 Ray rollout actors and a reward actor; Ray shut down afterwards."""
    ray = pytest.importorskip("ray")
    try:
        return main(["train", *args, "distributed.mode=ray", "distributed.rollout_workers=2",
                     "distributed.reward_workers=1"])
    finally:
        ray.shutdown()


# The flow-model families of docs/images-and-videos.md#supported-models, each built tiny from its real
# diffusers classes
FLOW_FAMILIES = ("sd3", "wan", "flux-dev", "flux-schnell", "qwen-image", "hunyuan-video")


def tiny_flow(family: str, folder) -> Path:
    from regen.policies.flow_flux import tiny_flux
    from regen.policies.flow_hunyuan import tiny_hunyuan
    from regen.policies.flow_qwenimage import tiny_qwenimage
    from regen.policies.flow_sd3 import tiny_sd3
    from regen.policies.flow_wan import tiny_wan

    if family.startswith("flux"):
        return tiny_flux(folder, dev=family == "flux-dev")
    return {"sd3": tiny_sd3, "wan": tiny_wan, "qwen-image": tiny_qwenimage, "hunyuan-video": tiny_hunyuan}[family](folder)


@pytest.fixture(scope="session")
def flow_family_dirs(tmp_path_factory) -> dict:
    """One untrained tiny pipeline folder per flow-model family (FLOW_FAMILIES)."""
    return {fam: str(tiny_flow(fam, tmp_path_factory.mktemp(fam))) for fam in FLOW_FAMILIES}


@pytest.fixture(scope="session")
def flow_prompts(tmp_path_factory) -> str:
    """Eight prompts in the tiny tokenizers' words."""
    words = ["a red circle at the left", "a blue square at the top", "a green triangle", "a cat",
             "a yellow circle at the bottom", "a white square", "a photo of a dog", "the red triangle at the right"]
    path = tmp_path_factory.mktemp("flow_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    return str(path)


@pytest.fixture(scope="session")
def qwen_vlm_base(family_dirs) -> str:
    return family_dirs["qwen2_5_vl"]


@pytest.fixture(scope="session")
def vqa_rows(tmp_path_factory) -> str:
    """48 shapes-vqa training questions as a JSONL file of rows with an image (a PNG data URI) that serve
    every trainer: prompt + completion (SFT), chosen + rejected (DPO), answer (RL rewards)."""
    from regen.tasks import shapes_vqa

    pairs = shapes_vqa.builtin_pairs("train", None)[::72]
    path = tmp_path_factory.mktemp("vqa") / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.prompt, "completion": p.chosen, "chosen": p.chosen,
                                        "rejected": p.rejected, "answer": p.meta["answer"], "image": p.meta["image"]})
                            + "\n" for p in pairs))
    return str(path)


@pytest.fixture(scope="session")
def vlm_base(tmp_path_factory) -> str:
    """The shapes-vqa LLaVA (regen/tasks/shapes_vqa.py) after a short SFT: a folder with its processor."""
    run = tmp_path_factory.mktemp("vlm_sft")
    assert main(["sft", "model.init=shapes-vlm", "data.train=builtin:shapes-vqa:train", "data.eval=null",
                 f"run.dir={run}", "sft.steps=80", "sft.global_batch_size=32", "optim.lr=2e-3", "log.progress=none",
                 "log.tensorboard=false", "run.threads=2"]) == 0
    return str(run / "export")


def joint_args(enhancer, painter, run, *extra) -> list[str]:
    """2 user prompts x 2 rewrites x 2 images per step, 3 ODE steps: a few tenths of a second a step."""
    return ["train", f"run.dir={run}", "data.train=builtin:shapes-paraphrase:train", "data.eval=null",
            "rollout.global_batch_size=8", "reward=[{name: brightness, args: {target: 0.6}}]", "train.steps=4",
            "log.progress=none", "log.tensorboard=false", "run.threads=2",
            f"models.enhancer={{model: {{path: {enhancer}}}, algorithm: {{name: grpo}}, rollout: {{group_size: 2, "
            "max_new_tokens: 7}, optim: {lr: 1.0e-3}, feeds: painter}",
            f"models.painter={{model: {{path: {painter}}}, algorithm: {{name: nft}}, rollout: {{group_size: 2}}, "
            "flow: {steps: 3, eval_steps: 3}, optim: {lr: 1.0e-3}}", *extra]


class Job:
    """`regen train` of a tiny language model (GRPO on arithmetic), flow model (NFT on shapes),
    vision-language model (GRPO on questions about shapes images: "vlm" a LLaVA, "qwen" a
    Qwen2.5-VL) or a joint run (an enhancer LM
    feeding the shapes painter, `joint_args`; its base is the pair)."""

    def __init__(self, kind: str, base):
        self.kind, self.base = kind, base if kind == "joint" else str(base)

    def args(self, run, *extra) -> list[str]:
        if self.kind == "joint":
            return joint_args(*self.base, run, *extra)
        return ["train", f"model.path={self.base}", f"run.dir={run}", *FAST_OF[self.kind], *extra]

    def __repr__(self) -> str:
        return self.kind


def export_weights(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a run's export/ (language model or flow model), keyed by file and name."""
    return folder_weights(run / "export", root=run)


def folder_weights(folder: Path, root: Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files under `folder`, keyed by file (relative to `root`,
    default `folder`) and name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        out.update({f"{f.relative_to(root or folder)}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def same_run(a: Path, b: Path) -> None:
    """Two runs trained the same weights and logged the same metrics (timings aside)."""
    wa, wb = export_weights(a), export_weights(b)
    assert wa.keys() == wb.keys() and wa
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]  # noqa: E731
    assert strip(read_jsonl(a / "metrics.jsonl")) == strip(read_jsonl(b / "metrics.jsonl"))


def make_job(kind: str, request) -> Job:
    if kind == "joint":
        return Job(kind, (request.getfixturevalue("enhancer_base"), request.getfixturevalue("flow_base")))
    return Job(kind, request.getfixturevalue(BASE_OF[kind]))


@pytest.fixture(params=["lm", "flow", "vlm"])
def job(request) -> Job:
    return make_job(request.param, request)


def nan_at_steps(monkeypatch, steps) -> None:
    """In this process, the loss is NaN at these RL steps (tests/faults.py)."""
    import regen.modalities.update as upd
    from tests.faults import nan_update

    monkeypatch.setattr(upd, "update", nan_update(upd.update, steps))


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Trackers write only under tmp_path and never reach a network."""
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    # MLflow 3 refuses its file store unless asked (the full package brings sqlite instead)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file://{tmp_path / 'mlruns'}"


def make_tiny_clip(folder: Path, seed: int = 0) -> Path:
    """A random CLIPModel (2 layers, width 32, 32 px) with a character-level CLIP tokenizer and an
    image processor, saved as a normal local folder: what eval.clip_model / clip:PATH read."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.utils import logging

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'":
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")  # no merges: one token per character
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    layers = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    cfg = CLIPConfig(text_config={**layers, "vocab_size": len(vocab), "max_position_embeddings": 77,
                                  "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
                     vision_config={**layers, "image_size": 32, "patch_size": 8}, projection_dim=16)
    torch.manual_seed(seed)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        CLIPModel(cfg).save_pretrained(folder)
        image = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        CLIPProcessor(image_processor=image, tokenizer=tok).save_pretrained(folder)
    finally:
        logging.set_verbosity(verbosity)
    return folder


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    return make_tiny_clip(tmp_path_factory.mktemp("clip") / "clip")


def sigkill_after_checkpoint(proc, run: Path, step: int, timeout_s: float = 300.0, poll_s: float = 0.01) -> None:
    """SIGKILL `proc` at the named moment: as soon as the step-`step` checkpoint of `run` is complete
    (its manifest, written last, exists), or when it exits or the time runs out."""
    import signal
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if (run / "checkpoints" / f"step_{step:08d}" / "manifest.json").exists():
            break
        time.sleep(poll_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the process ended before the moment it was to be killed at"


STAND_IN_VLLM = Path(__file__).parent / "stand_in_vllm"


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch) -> Path:
    """tests/stand_in_vllm first on the path (of this process and of Ray actors started after):
    `import vllm` finds the stand-in; returns the folder where its engines log what they did."""
    import os
    import sys

    log = tmp_path / "vllm_log"
    log.mkdir()
    monkeypatch.syspath_prepend(str(STAND_IN_VLLM))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STAND_IN_VLLM), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("STAND_IN_VLLM_LOG", str(log))
    yield log
    for name in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        del sys.modules[name]  # later tests see no vLLM again


def vllm_engines(log: Path) -> dict[str, tuple[list[str], dict]]:
    """Each stand-in engine (by process id): the calls it logged, and its weights after its last load."""
    return {p.stem: (p.read_text().splitlines(), torch.load(p.with_suffix(".pt")) if p.with_suffix(".pt").exists()
                     else {}) for p in sorted(log.glob("*.log"))}


@pytest.fixture
def service(request):
    """A real `regen serve-reward` process: parametrise with ([rewards], [extra flags]), indirect=True.
    At the end its log must not hold the token."""
    from tests.test_reward_service import TOKEN, Server

    srv = Server(*request.param[0], extra=request.param[1] if len(request.param) > 1 else ()).start()
    yield srv
    assert TOKEN not in srv.stop()
