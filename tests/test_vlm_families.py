"""The Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; regen/policies/vlm_packed.py), each a
tiny model built from its real transformers classes (regen/tasks/tiny_vlms.py) and loaded through
from_pretrained: packed image inputs, several images or none per prompt, M-RoPE positions that
match the model's own, the first on-policy ratio exactly 1, SFT labels on the answer only, export
loadable by plain transformers, and short SFT / GRPO runs."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from regen.cli import main
from regen.envs import Environment, Step
from regen.tasks import tiny_vlms
from tests.conftest import ray_actors_train, read_jsonl, torchrun_train

FAMILIES = tiny_vlms.FAMILIES


def load_policy(folder: str):
    from regen.config import ModelConfig
    from regen.policies.lm import LMPolicy, load_model_and_tokenizer

    model, proc = load_model_and_tokenizer(ModelConfig(path=folder), None, 0)
    return LMPolicy(model, proc, torch.device("cpu"))


def image(h=16, w=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def mixed_prompts(family: str = "qwen2_5_vl"):
    """One image; two images of different sizes (different patch grids, or tile counts); for the
    Qwen-VL families, which read text-only prompts too, no image at all."""
    from regen.policies.vlm import VisionPrompt

    third = VisionPrompt("what shape is it ?", None) if family in tiny_vlms.QWEN else \
        VisionPrompt("what shape is it ?", image(8, 16, seed=3))
    return [VisionPrompt("what colour is the shape ?", image()),
            VisionPrompt("where is the shape ?", [image(seed=1), image(24 if family in tiny_vlms.QWEN else 8, 16, 2)]),
            third]


def banned_logp(policy, logits, tokens):
    logits = logits.float().index_fill(-1, policy.banned, float("-inf"))
    return F.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_rescoring_gives_the_samplers_logprobs_also_across_concatenated_batches(family, family_dirs):
    from regen.policies.lm import concat_rollouts

    policy = load_policy(family_dirs[family])
    g = torch.Generator().manual_seed(0)
    prompts = mixed_prompts(family)
    first = policy.sample(prompts[:2], 3, 1.0, 1.0, 6, g, with_logp=True)
    second = policy.sample(prompts[2:], 3, 1.0, 1.0, 6, g, with_logp=True)  # another prompt width / tile count
    ro = concat_rollouts([first, second], policy.pad_id)
    mask = ro.response_mask.bool()
    # the first on-policy update's ratio is exactly 1: rescoring (per row, and per group) gives the sampler's log-probs
    for group in (1, 3):
        logp, _ = policy.token_logprobs(ro, 1.0, group_size=group)
        assert (logp - ro.behaviour_logp)[mask].abs().max() < 1e-5
    assert not set(ro.response_ids[mask].tolist()) & set(policy.banned.tolist())  # no image token is ever sampled


@pytest.mark.parametrize("family", tiny_vlms.QWEN)
def test_qwen_vl_positions_are_the_ones_the_model_computes_itself(family, family_dirs):
    policy = load_policy(family_dirs[family])
    model = policy.model
    ro = policy.sample(mixed_prompts(family), 3, 1.0, 1.0, 6, torch.Generator().manual_seed(0), with_logp=True)
    assert ro.rope is not None and ro.rope.shape[:2] == (9, 3)
    assert len(ro.vision.kwargs()["image_grid_thw"]) == 3 * 3  # 3 images (1 + 2 + 0 per prompt) x 3 samples
    mask = ro.response_mask.bool()
    # the model computing its own M-RoPE positions over the whole sequence (from mm_token_type_ids, as
    # transformers' processor would give them) scores the sampled tokens as the sampler did
    ids, att, vision = ro.input_ids, ro.attention_mask, ro.vision.kwargs()
    types = (ids == model.config.image_token_id).int()
    own = model(input_ids=ids, attention_mask=att, mm_token_type_ids=types, **vision).logits
    P = ro.prompt_width
    own_logp = banned_logp(policy, own[:, P - 1 : -1], ro.response_ids)
    assert (own_logp - ro.behaviour_logp)[mask].abs().max() < 1e-5
    # ...and plain 1-D positions do not (what a sampler that ignored M-RoPE would score): the check can fail
    plain = model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0), **vision).logits
    plain_logp = banned_logp(policy, plain[:, P - 1 : -1], ro.response_ids)
    with_images = torch.tensor([True] * 6 + [False] * 3)
    assert (plain_logp - ro.behaviour_logp)[mask & with_images[:, None]].abs().max() > 1e-3
    # the image-less prompt's rows are plain text on all three axes
    assert torch.equal(ro.position_ids[6:, 0], ro.position_ids[6:, 2])


def test_gemma3_image_tokens_attend_both_ways_as_its_processor_marks_them(family_dirs):
    policy = load_policy(family_dirs["gemma3"])
    ro = policy.sample(mixed_prompts("gemma3")[:1], 2, 1.0, 1.0, 4, torch.Generator().manual_seed(0), with_logp=True)
    proc, P, mask = policy.processor, ro.prompt_width, ro.response_mask.bool()
    enc = proc(images=[[image()]], text=[f"{proc.image_token} what colour is the shape ?"], return_tensors="pt")
    assert enc["input_ids"].tolist()[0] == ro.input_ids[0, :P][ro.attention_mask[0, :P].bool()].tolist()
    assert enc["token_type_ids"].sum() == 4  # the processor marks the 4 soft tokens of the image
    ids = ro.input_ids
    tt = F.pad(enc["token_type_ids"], (P - enc["token_type_ids"].shape[1], ids.shape[1] - P)).expand(2, -1)
    kw = dict(input_ids=ids, attention_mask=ro.attention_mask, pixel_values=enc["pixel_values"].expand(2, -1, -1, -1))
    marked = banned_logp(policy, policy.model(**kw, token_type_ids=tt).logits[:, P - 1 : -1], ro.response_ids)
    unmarked = banned_logp(policy, policy.model(**kw).logits[:, P - 1 : -1], ro.response_ids)
    assert (marked - ro.behaviour_logp)[mask].abs().max() < 1e-5
    # causal-only attention inside the image is another model: 5e-5 apart here (random init), 100x the float noise
    assert (unmarked - ro.behaviour_logp)[mask].abs().max() > 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_plain_transformers_with_the_same_logits(family, family_dirs, tmp_path):
    from transformers import AutoModelForImageTextToText

    policy = load_policy(family_dirs[family])
    with torch.no_grad():  # move the weights, so the check is not passed by an untouched copy
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    policy.export(tmp_path / "export")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "export")
    assert type(model) is type(policy.model) and model.config.model_type == family
    enc, vision = policy.encode(mixed_prompts(family)[:1])
    if family in tiny_vlms.QWEN:  # with the family's own pieces: its image processor, one token per merged patch
        from transformers import AutoImageProcessor, AutoTokenizer

        tok, images = AutoTokenizer.from_pretrained(tmp_path / "export"), \
            AutoImageProcessor.from_pretrained(tmp_path / "export")
        plain = images(images=[image()], return_tensors="pt")
        n = int(plain["image_grid_thw"].prod()) // images.merge_size**2
        text = "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>what colour is the shape ?"
        plain["input_ids"] = tok([text], return_tensors="pt")["input_ids"]
        plain["mm_token_type_ids"] = (plain["input_ids"] == model.config.image_token_id).int()
    else:  # the family's processor, as saved
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(tmp_path / "export")
        marker = proc.image_token if family == "gemma3" else "<image>"
        plain = proc(images=[[image()]], text=[f"{marker} what colour is the shape ?"], return_tensors="pt")
        plain.pop("attention_mask")
    assert enc["input_ids"].tolist() == plain["input_ids"].tolist()  # regen encodes the prompt as transformers does
    got = model(**plain).logits
    want = policy.model(**plain).logits
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_trains_on_the_answer_only_never_on_the_user_turn_or_the_image_tokens(family, family_dirs):
    from regen.data import Demo
    from regen.offline.sft import IGNORE, encode_demos, forward_args

    policy = load_policy(family_dirs[family])
    proc, model, tok = policy.processor, policy.model, policy.tokenizer
    p = mixed_prompts(family)
    demos = [Demo(q.text, answer, {}, q.image) for q, answer in zip(p, ["red", "red circle", "circle"])]
    ids, mask, labels, vision = encode_demos(demos, proc, 512)
    for i, d in enumerate(demos):
        answer = tok(d.completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = int(mask[i].sum())
        assert labels[i, n - len(answer) : n].tolist() == answer  # the answer and its EOS...
        assert (labels[i, : n - len(answer)] == IGNORE).all()  # ...and nothing of the user turn or the images
    cfg = model.config
    image_id = cfg.image_token_id if getattr(cfg, "image_token_id", None) is not None else cfg.image_token_index
    assert (ids == image_id).sum() > 0
    # the SFT loss's gradient reaches the logits only where they predict an answer token
    logits = model(input_ids=ids, attention_mask=mask,
                   **forward_args(model, ids, mask, vision, torch.arange(3))).logits
    logits.retain_grad()
    F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE).backward()
    grad_at = logits.grad[:, :-1].abs().sum(-1) > 0  # position t predicts token t+1
    predicts_answer = labels[:, 1:] != IGNORE
    assert torch.equal(grad_at, predicts_answer)
    assert not (grad_at & (ids[:, 1:] == image_id)).any()


@pytest.mark.parametrize("method", ["dpo", "ppo"])
def test_dpo_scores_held_out_image_pairs_and_ppos_critic_is_the_vlm_backbone(method, family_dirs, vqa_rows, tmp_path):
    run = tmp_path / method
    common = [f"model.path={family_dirs['qwen2_5_vl']}", f"run.dir={run}", f"data.train={vqa_rows}", "train.steps=2",
              f"data.eval={vqa_rows}", "eval.num_prompts=8", "eval.every=0", "log.progress=none",
              "log.tensorboard=false", "run.threads=2", "rollout.max_new_tokens=2"]
    if method == "dpo":
        assert main(["train", *common, "algorithm.name=dpo", "train.global_minibatch_size=16"]) == 0
    else:
        assert main(["train", *common, "algorithm.name=ppo", "rollout.global_batch_size=8", "rollout.group_size=1",
                     "checkpoint.every=1", "reward=[{name: exact_match}]"]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    if method == "dpo":  # held-out pairs about their images, scored before and after
        assert sum("eval/preference_accuracy" in r for r in rows) == 2
        assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    else:  # the critic reads the images: a VLM backbone under a value head, saved beside the policy
        assert [r["step"] for r in rows if "critic/value_loss" in r] == [1, 2]
        critic = run / "checkpoints" / "step_00000002" / "critic"
        assert (critic / "value_head.safetensors").is_file()
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(critic)
        assert type(backbone).__name__ == "Qwen2_5_VLModel"

        def by_suffix(w, part):  # the same tensors, whatever prefix each save gave their names
            return {k[k.index(part):]: v for k, v in w.items() if part in k}

        start, saved = load_file(f"{family_dirs['qwen2_5_vl']}/model.safetensors"), load_file(str(critic / "model.safetensors"))
        vis0, vis1 = by_suffix(start, "visual."), by_suffix(saved, "visual.")
        assert vis0.keys() == vis1.keys() and all(torch.equal(vis0[k], vis1[k]) for k in vis0)  # frozen, as the policy's
        lm0, lm1 = by_suffix(start, "layers."), by_suffix(saved, "layers.")
        assert any(not torch.equal(lm0[k], lm1[k]) for k in lm1 if k in lm0)  # the critic's language side trained


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_runs_with_prompt_rows_and_with_the_chat_template(family, family_dirs, vqa_rows, tmp_path):
    base = family_dirs[family]
    chats = [False] if family == "llava" else [False, True]  # the tiny LLaVA's processor has no chat template
    for chat in chats:
        run = tmp_path / f"chat{int(chat)}"
        assert main(["sft", f"model.path={base}", f"run.dir={run}", f"data.train={vqa_rows}",
                     "data.eval=null", f"data.chat_template={str(chat).lower()}", "sft.steps=2",
                     "sft.global_batch_size=8", "log.progress=none", "log.tensorboard=false", "run.threads=2"]) == 0
        rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
        before, after = load_file(f"{base}/model.safetensors"), load_file(str(run / "export" / "model.safetensors"))
        assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_chat_rendered_demo_trains_on_the_assistant_turn_only_with_its_image_in_the_context(family_dirs):
    from regen.data import Demo
    from regen.data.chat import render_demos
    from regen.offline.sft import IGNORE, encode_demos

    policy = load_policy(family_dirs["qwen2_5_vl"])
    proc, tok = policy.processor, policy.tokenizer
    demo = Demo("what colour is the shape ?", "red", {}, [image(), image(seed=1)])
    [rendered] = render_demos([demo], proc, None, "data.train")
    ids, mask, labels, _ = encode_demos([rendered], proc, 512)
    image_id = policy.model.config.image_token_id
    trained = labels[0] != IGNORE
    answer = tok("red", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert labels[0][trained].tolist()[: len(answer)] == answer  # the answer and its end of turn...
    assert not (trained & (ids[0] == image_id)).any()  # ...never an image token
    assert int((ids[0] == image_id).sum()) == 2 * 4  # two 16x16 images, 4 merged patches each, as when sampling
    from regen.policies.vlm import VisionPrompt

    enc, _ = policy.encode([VisionPrompt(rendered.prompt, demo.image)])
    assert ids[0][: enc["input_ids"].shape[1]].tolist() == enc["input_ids"][0].tolist()  # the prompt as sampled


class WordEcho(Environment):
    """Answers each turn with shapes-vqa words, as many as the turn and seed say (rows get observations
    of different lengths), and ends after `turns` turns with reward 1."""

    def __init__(self, turns: int = 3):
        self.turns, self.k = turns, 0

    def reset(self, row, seed):
        self.seed = seed
        return None

    def step(self, turn):
        self.k += 1
        if self.k >= self.turns:
            return Step(None, reward=1.0, done=True)
        return Step(" ".join(["red", "left", "circle"][: 1 + (len(turn) + self.seed) % 3]), reward=0.0)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])  # sliding-window attention: refused
def test_multi_turn_episodes_read_the_image_and_rescore_to_the_samplers_logprobs(family, family_dirs):
    from regen.data import PromptItem
    from regen.policies.lm_episodes import EpisodeSampler

    policy = load_policy(family_dirs[family])
    s = EpisodeSampler(policy, lambda: WordEcho(3), max_turns=3, max_tokens=40, chat=False)
    rows = [PromptItem(p.text, {}, p.image) for p in mixed_prompts(family)]
    ro = s.sample(s.inputs(rows), 3, 1.0, 1.0, 4, torch.Generator().manual_seed(0), with_logp=True)
    m = ro.response_mask
    assert any(e["observations"] for e in ro.episodes)
    assert float(m.sum()) < float(ro.attention_mask[:, ro.prompt_width :].sum())  # observations are there, masked
    assert (ro.rope is not None) == (family in tiny_vlms.QWEN) and len(ro.vision) == 9
    for group in (1, 3):  # the plain forward, and each group's prompt (and images) once
        lp, _ = policy.token_logprobs(ro, 1.0, group_size=group)
        assert float(((lp.detach() - ro.behaviour_logp) * m).abs().max()) < 1e-5


def two_step_setup() -> list[str]:
    return ["data.train=builtin:shapes-vqa:train", "data.eval=null", "rollout.global_batch_size=16",
            "rollout.group_size=4", "rollout.max_new_tokens=3", "log.progress=none", "log.tensorboard=false",
            "optim.lr=1e-3", "reward=[{name: 'tests.reward_fixtures:answer_words'}]", "train.steps=2",
            "run.threads=1", "checkpoint.every=0"]


@pytest.mark.extended  # multi-process: the CI's second tier
@pytest.mark.parametrize("family", FAMILIES)
def test_torchrun_two_processes_train_the_same_model_as_one(family, family_dirs, tmp_path):
    base = family_dirs[family]
    setup = [*two_step_setup(), "train.global_minibatch_size=8", "train.ppo_epochs=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", f"model.path={base}", f"run.dir={one}", *setup, "distributed.mode=single"]) == 0
    out = torchrun_train(f"model.path={base}", f"run.dir={two}", *setup)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4, abs=1e-6)
    wa, wb = load_file(str(one / "export" / "model.safetensors")), load_file(str(two / "export" / "model.safetensors"))
    w0 = load_file(f"{base}/model.safetensors")
    diff = sum(((wa[k] - wb[k]) ** 2).sum() for k in wa) ** 0.5
    moved = sum(((wa[k] - w0[k]) ** 2).sum() for k in wa) ** 0.5
    assert moved > 1e-4 and diff < 1e-3 * moved, (float(diff), float(moved))


@pytest.mark.extended  # Ray actors: the CI's second tier
@pytest.mark.parametrize("family", FAMILIES)
def test_ray_rollout_actors_sample_what_one_process_does(family, family_dirs, tmp_path):
    base, setup = family_dirs[family], two_step_setup()
    one, spread = tmp_path / "one", tmp_path / "ray"
    assert main(["train", f"model.path={base}", f"run.dir={one}", *setup]) == 0
    assert ray_actors_train(f"model.path={base}", f"run.dir={spread}", *setup) == 0
    a, b = read_jsonl(one / "metrics.jsonl"), read_jsonl(spread / "metrics.jsonl")
    # the prompts' images travel to the actors: the same images, weights and uniforms, the same answers
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4, abs=1e-6)
    assert a[-1]["grad_norm"] > 0
