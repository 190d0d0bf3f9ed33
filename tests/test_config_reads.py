"""A config key is read by the chosen method, or refused (regen/config/reads.py).

1. The sweep: for every method and every key of the config tree, setting the key (to its
   default value) is either refused with an error that names it, or the key is one the
   method declares it reads. No key is accepted and silently ignored.
2. The proof that declared keys act: every method / modality key (algorithm.*, flow.*,
   critic.*, and the sampling, evaluation and task keys of a modality) that a method reads
   changes its run when set to another value: two steps of training with and without it
   differ in their metrics or trained weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from regen.cli import main
from regen.config import RLConfig, describe, load_config
from regen.config import reads as R
from regen.config.flow_methods import ODE, SDE
from regen.config.registry import METHODS, MODALITIES
from regen.errors import ConfigError
from tests.conftest import BRIGHT, export_weights, make_tiny_clip, read_jsonl

MODEL = {"lm": "model.init=arith-char-gpt2", "flow": "model.init=shapes-unet"}
KEYS = [k for k, _, _ in describe(RLConfig)]


def _value(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


def _inside_an_unset_section(tree: dict, key: str) -> bool:
    parts = key.split(".")
    for part in parts[:-1]:
        tree = tree.get(part) if isinstance(tree, dict) else None
        if tree is None:
            return True
    return False


@pytest.mark.parametrize("method", list(METHODS))
def test_every_key_is_read_by_the_method_or_refused_by_name(method):
    base = [MODEL[METHODS[method].modality], f"algorithm.name={method}"]
    if METHODS[method].modality == "flow":
        base.append("data.train=builtin:shapes:train")
    cfg = load_config(RLConfig, None, base)
    tree = cfg.model_dump(mode="json")
    read_keys = {r.key for r in R.declared(cfg) if not r.when or r.test(cfg)}
    accepted, refused = [], []
    for key in KEYS:
        if _inside_an_unset_section(tree, key):  # model.lora.r with model.lora null: the section is swept
            continue
        value = yaml.safe_dump(_value(tree, key), default_flow_style=True).strip().removesuffix("...").strip()
        try:
            load_config(RLConfig, None, [*base, f"{key}={value}"])
            accepted.append(key)
        except ConfigError as e:
            assert f" {key}" in str(e), str(e)  # the error names the key (or a key inside it)
            refused.append(key)
    assert refused, "some keys must be refused for every method"
    for key in accepted:  # whatever is accepted is declared as read (and test 2 shows it acts)
        assert any(key == r or key.startswith(r + ".") for r in read_keys), f"{method} accepts {key} silently"



def test_ray_keys_follow_the_placement_a_trainer_group_or_actors():
    """A Ray trainer group (trainer_workers > 1) trains like torchrun ranks: it reads the
    process-group keys and refuses the rollout / reward actor keys, which only act with one trainer."""
    group = [MODEL["lm"], "distributed.mode=ray", "distributed.trainer_workers=2"]
    for key in ("distributed.strategy=fsdp", "distributed.timeout_s=60", "distributed.trainer_resources={num_cpus: 2}"):
        load_config(RLConfig, None, [*group, key])
    for key in ("distributed.rollout_workers=4", "distributed.max_staleness=1", "distributed.actor_threads=2"):
        with pytest.raises(ConfigError, match=key.split("=")[0] + " is read only .*with distributed.mode=ray and "
                           "trainer_workers=1"):
            load_config(RLConfig, None, [*group, key])
    # a group whose rank 0 drives rollout actors reads the rollout keys, still not the staleness bound
    actors = [*group, "distributed.group_sampling=actors"]
    load_config(RLConfig, None, [*actors, "distributed.rollout_workers=4", "distributed.actor_threads=2"])
    with pytest.raises(ConfigError, match="rollout_workers is read only in a Ray trainer group with "
                       "distributed.group_sampling=actors or with distributed.mode=ray and trainer_workers=1"):
        load_config(RLConfig, None, [*group, "distributed.rollout_workers=4"])
    load_config(RLConfig, None, [*actors, "distributed.max_staleness=1"])
    with pytest.raises(ConfigError, match="group_sampling is read only with distributed.mode=ray and trainer_workers > 1"):
        load_config(RLConfig, None, [MODEL["lm"], "distributed.mode=ray", "distributed.group_sampling=actors"])
    one = [MODEL["lm"], "distributed.mode=ray"]
    load_config(RLConfig, None, [*one, "distributed.rollout_workers=4"])
    for key in ("distributed.strategy=fsdp", "distributed.trainer_resources={num_cpus: 2}"):
        with pytest.raises(ConfigError, match=key.split("=")[0]):
            load_config(RLConfig, None, [*one, key])

# --------------------------------------------------------------------------- 2. declared keys act

IN_SCOPE = ("algorithm.", "flow.", "critic.", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens",
            "eval.temperature", "eval.greedy", "task.", "train.gradient_checkpointing", "eval.metrics", "eval.gates",
            "eval.metric_samples", "eval.reference", "eval.features", "eval.clip_model", "rollout.stop_tokens")
# Keys that by design compute the same result (they trade memory or speed), each checked otherwise.
SAME_BY_DESIGN = {
    "train.gradient_checkpointing": "recomputes activations in the backward pass: same gradients, less memory",
    "algorithm.name": "chooses the method itself",
}
ENDS_EVEN = "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]"
# minibatches of one group over 2 epochs at a large lr: some tokens of negative samples gain probability
DRIFT = ("rollout.global_batch_size=16", "train.global_minibatch_size=4", "train.ppo_epochs=2", "optim.lr=0.05")
# answers of 3-6 tokens: each length its own penalty
OVERLONG = ("rollout.max_new_tokens=6", "algorithm.overlong={max_len: 6, cache_len: 4}")
EXACT = "reward=[{name: exact_match}]"  # the weak base is mostly wrong: many groups without signal
TIED = "reward=[{name: 'tests.reward_fixtures:bright_or_not'}]"  # ties within groups (dynamic sampling)
LM_EVAL = ["data.eval=builtin:arithmetic:test", "eval.num_prompts=8"]
FLOW_EVAL = ["data.eval=builtin:shapes:test", "eval.num_prompts=2"]
GOOD = "reward=[{name: binary, args: {of: brightness, threshold: 0.0, args: {target: 0.6}}}]"  # every label 1
JUDGED = "reward=[{name: pairwise, args: {of: 'tests.test_dgpo:brightness_judge'}}]"

# (method, settings the key needs to be read, key=value)
CASES = [
    ("grpo", ("task.test_size=20",), "task.digits=1"), ("grpo", (), "task.test_size=100"),
    ("grpo", (), "rollout.temperature=0.7"), ("grpo", (), "rollout.top_p=0.8"), ("grpo", (), "rollout.max_new_tokens=3"),
    ("grpo", LM_EVAL, "eval.temperature=0.5"), ("grpo", LM_EVAL, "eval.greedy=true"),
    ("grpo", ("train.ppo_epochs=2",), "algorithm.clip_low=0.001"),
    ("grpo", ("train.ppo_epochs=2",), "algorithm.clip_high=0.001"),
    ("grpo", (), "algorithm.entropy_coef=0.1"), ("grpo", (), "algorithm.kl_coef=0.5"),
    ("grpo", ("algorithm.kl_coef=0.5",), "algorithm.kl_estimator=k2"),
    ("grpo", ("algorithm.advantage=reinforce_pp", "algorithm.kl_coef=0.5"), "algorithm.kl_placement=reward"),
    ("grpo", (), "algorithm.loss_agg=seq-mean-token-sum"), ("grpo", (), "algorithm.overlong={max_len: 4, cache_len: 2}"),
    ("grpo", OVERLONG, "algorithm.overlong.max_len=5"), ("grpo", OVERLONG, "algorithm.overlong.cache_len=2"),
    ("grpo", OVERLONG, "algorithm.overlong.factor=0.5"),
    ("grpo", (), "algorithm.advantage=rloo"), ("grpo", (), "algorithm.std_normalize=none"),
    ("grpo", (), "algorithm.std_normalize=batch"),
    # four groups: two could by chance have the same mean, and then the baseline changes nothing after whitening
    ("grpo", ("algorithm.advantage=reinforce_pp", "rollout.global_batch_size=16"), "algorithm.reinforce_baseline=true"),
    ("grpo", DRIFT, "algorithm.dual_clip=1.001"),
    ("grpo", (EXACT,), "algorithm.dynamic_sampling=true"),
    ("grpo", (EXACT, "algorithm.dynamic_sampling=true"), "algorithm.max_sampling_rounds=0"),
    ("ppo", (), "algorithm.gamma=0.5"), ("ppo", (), "algorithm.lam=0.5"), ("ppo", (), "algorithm.whiten_advantages=false"),
    ("ppo", (), "critic.lr=0.01"), ("ppo", ("train.ppo_epochs=2", "critic.lr=0.01"), "critic.value_clip=0.0001"),
    ("ppo", (), "critic.warmup_steps=1"), ("ppo", (), "critic.path=CRITIC"),
    ("ppo", (), "algorithm.loss_agg=seq-mean-token-sum"),  # the policy's loss (grpo's, above) and the critic's
    ("gspo", ("train.ppo_epochs=2", "optim.lr=0.01"), "algorithm.clip_low=0.01"),
    # from 4e-4 to 1: a positive sample whose ratio the second epoch finds in (1.0004, 2) now counts (at a larger lr
    # every ratio leaves that range and both clip)
    ("gspo", ("train.ppo_epochs=2",), "algorithm.clip_high=1.0"),
    ("gspo", (), "algorithm.entropy_coef=0.1"), ("gspo", (), "algorithm.kl_coef=0.5"),
    ("gspo", ("algorithm.kl_coef=0.5",), "algorithm.kl_estimator=k2"),
    ("gspo", ("algorithm.kl_coef=0.5",), "algorithm.loss_agg=seq-mean-token-sum"),
    ("dpo", (), "algorithm.dpo_beta=0.5"), ("dpo", (), "algorithm.dpo_label_smoothing=0.2"),
    ("dpo", (), "algorithm.dpo_loss=ipo"),
    ("flow_grpo", (), "flow.steps=3"), ("flow_grpo", FLOW_EVAL, "flow.eval_steps=3"), ("flow_grpo", (), "flow.shift=3.0"),
    ("flow_grpo", (), "flow.guidance=2.0"), ("nft", ("model.path=FLUXDEV",), "flow.guidance_embed=2.0"),
    ("flow_grpo", (), "flow.weight_ema=0.5"), ("flow_grpo", (), "flow.adv_clip=0.5"),
    ("flow_grpo", (), "algorithm.std_normalize=none"), ("flow_grpo", (), "algorithm.std_normalize=batch"),
    ("flow_grpo", ("train.ppo_epochs=2",), "algorithm.clip_low=0.000001"),
    ("flow_grpo", ("train.ppo_epochs=2",), "algorithm.clip_high=0.000001"),
    ("flow_grpo", (), "algorithm.kl_coef=0.5"), ("flow_grpo", (), "flow.sampler=cps"),
    ("flow_grpo", (), "flow.noise_level=0.3"), ("flow_grpo", (), "flow.sde_window=1"),
    ("flow_grpo", ("flow.sde_window=1", "flow.steps=3"), "flow.window_policy=random"),
    ("flow_grpo", ("flow.sde_window=1",), "flow.window_start=1"),
    ("flow_grpo", ("flow.sde_window=1", "flow.window_policy=moving"), "flow.window_shift_every=1"),
    ("flow_grpo", (TIED,), "algorithm.dynamic_sampling=true"),
    ("flow_grpo", (TIED, "algorithm.dynamic_sampling=true"), "algorithm.max_sampling_rounds=0"),
    ("flow_dppo", ("train.ppo_epochs=2", "optim.lr=1e-5"), "flow.dppo_tau=0.000000001"),
    ("nft", (), "flow.nft_beta=0.5"), ("nft", (), "algorithm.kl_coef=1.0"), ("nft", (), "flow.ema_rate=0.5"),
    ("nft", ("flow.ema_rate=0.5",), "flow.ema_max=0.0001"),
    ("awm", (), "flow.awm_weight=t"), ("awm", (), "algorithm.kl_coef=0.5"),
    ("awm", ("algorithm.kl_coef=0.5",), "flow.ema_rate=0.5"),
    ("awm", ("algorithm.kl_coef=0.5", "flow.ema_rate=0.5"), "flow.ema_max=0.0001"),
    ("nft", (), "flow.solver=heun"), ("nft", (), "flow.trust_region=0.000001"),
    ("nft", (GOOD,), "algorithm.reward_type=binary"), ("dgpo", (JUDGED,), "algorithm.reward_type=pairwise"),
    ("dgpo", (), "flow.dgpo_beta=1.0"), ("dgpo", (), "flow.dgpo_ref=base"), ("dgpo", (), "algorithm.kl_coef=0.5"),
    ("dgpo", ("train.ppo_epochs=2", "optim.lr=1e-3"), "algorithm.clip_low=0.000001"),
    ("dgpo", ("train.ppo_epochs=2", "optim.lr=1e-3", "algorithm.clip_low=0.5"), "algorithm.clip_high=0.000001"),
    ("dgpo", (), "flow.ema_rate=0.5"), ("dgpo", ("flow.ema_rate=0.5",), "flow.ema_max=0.0001"),
    ("grpo", (), "rollout.stop_tokens=['1']"),
    ("grpo", LM_EVAL, "eval.metrics=[bleu4]"), ("grpo", (*LM_EVAL, "eval.metrics=[chrf]"), "eval.metric_samples=2"),
    ("grpo", LM_EVAL, "eval.gates={accuracy: '>= 0.5'}"),
    ("flow_grpo", FLOW_EVAL, "eval.metrics=[psnr]"), ("flow_grpo", FLOW_EVAL, "eval.gates={reward: '> 0'}"),
    ("flow_grpo", (*FLOW_EVAL, "eval.metrics=[psnr]", "eval.samples_per_prompt=2"), "eval.metric_samples=2"),
    ("flow_grpo", (*FLOW_EVAL, "eval.metrics=[psnr]"), "eval.reference=base"),
    ("flow_grpo", (*FLOW_EVAL, "eval.metrics=[fid]"), "eval.features=clip:CLIP"),
    ("flow_grpo", (*FLOW_EVAL, "eval.metrics=[clip_score]", "eval.clip_model=CLIP"), "eval.clip_model=CLIP2"),
]


def _group(method: str, key: str):
    """Whose reading of `key` a case with `method` shows: the modality's (a key every method of it
    reads the same way, through one code path) or the method's own."""
    modality = METHODS[method].modality
    shared = MODALITIES[modality].reads
    if method in ("flow_grpo", "flow_dppo") and any(key == r.key for r in SDE):
        return "sde"
    if method in ("nft", "awm", "dgpo") and any(key == r.key for r in ODE):
        return "ode"  # one rollout path for the three
    if any(key == r.key or key.startswith(r.key + ".") for r in [*shared, *R.ONLINE]) and \
            key not in LOSS_KEYS:
        return modality
    if method == "ppo" and key in LOSS_KEYS and key != "algorithm.loss_agg":
        return "grpo"  # PPO's policy loss is grpo_loss on per-token advantages (POLICY_LOSSES)
    return method


# keys that reach each language-model loss function: every method shows them itself
LOSS_KEYS = ("algorithm.clip_low", "algorithm.clip_high", "algorithm.entropy_coef", "algorithm.kl_coef",
             "algorithm.kl_estimator", "algorithm.loss_agg", "algorithm.dual_clip")


def test_the_cases_cover_every_key_each_method_reads():
    covered = {(_group(m, case.split("=")[0]), case.split("=")[0]) for m, _, case in CASES}
    missing = []
    for key in KEYS:
        if not key.startswith(IN_SCOPE) or key in SAME_BY_DESIGN:
            continue
        for method in R.readers(key):
            if (_group(method, key), key) not in covered:
                missing.append(f"{method}: {key}")
    assert not missing, missing


@pytest.fixture(scope="module")
def critic_folder(base_model, tmp_path_factory) -> Path:
    """Another starting point for PPO's critic: the base model with perturbed weights."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("critic")
    model = AutoModelForCausalLM.from_pretrained(base_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def _fingerprint(run: Path) -> tuple:
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}  # noqa: E731
    return [strip(r) for r in read_jsonl(run / "metrics.jsonl")], export_weights(run)


def _differs(a: tuple, b: tuple) -> bool:
    if json.dumps(a[0], sort_keys=True) != json.dumps(b[0], sort_keys=True):
        return True
    return a[1].keys() != b[1].keys() or any(not torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.fixture(scope="module")
def two_steps(base_model, flow_base, critic_folder, tiny_clip, tmp_path_factory):
    """run(method, settings) -> the fingerprint of two training steps, cached per settings."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("reads")
    pairs = root / "pairs.jsonl"  # a small preference set: DPO scores all of it under the reference first
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}) + "\n"
                             for a, b in zip(range(10, 42), range(50, 82))))

    def run(method: str, settings: tuple) -> tuple:
        if (method, settings) in cache:
            return cache[(method, settings)]
        folder = root / f"r{len(cache)}"
        common = ["train", f"run.dir={folder}", f"algorithm.name={method}", "train.steps=2", "log.progress=none",
                  "log.tensorboard=false", "checkpoint.every=0", "run.threads=2"]
        if method == "dpo":
            extra = [f"model.path={base_model}", "train.global_minibatch_size=8", "optim.lr=1e-3", f"data.train={pairs}"]
        elif METHODS[method].modality == "lm":  # a reward the weak base gets right in some samples of a group, not all
            extra = [f"model.path={base_model}", "rollout.global_batch_size=8", "rollout.group_size=4",
                     "rollout.max_new_tokens=4", "optim.lr=1e-3", ENDS_EVEN]
        else:
            extra = [f"model.path={flow_base}", "data.train=builtin:shapes:train", "rollout.global_batch_size=4",
                     "rollout.group_size=2", "flow.steps=2", "flow.eval_steps=2", "optim.lr=1e-3", BRIGHT]
        if not any(s.startswith("data.eval") for s in settings):
            extra.append("data.eval=null")
        clip2 = make_tiny_clip(root / "clip2", seed=1) if not (root / "clip2").exists() else root / "clip2"
        flux = root / "flux_dev"  # a tiny FLUX.1-dev-style folder: its transformer embeds the guidance
        if any("FLUXDEV" in s for s in settings) and not flux.exists():
            from regen.policies.flow_flux import tiny_flux

            tiny_flux(flux, dev=True)
        settings_ = [s.replace("CRITIC", str(critic_folder)).replace("CLIP2", str(clip2)).replace("CLIP", str(tiny_clip))
                     .replace("FLUXDEV", str(flux)) for s in settings]
        assert main([*common, *extra, *settings_]) == 0, settings_
        cache[(method, settings)] = _fingerprint(folder)
        return cache[(method, settings)]

    return run


# The first case of each method runs in the main tier; the other cases (about two minutes of 2-step runs
# on 2 cores) in the extended tier, which CI runs too.
_FIRST = {m: c for m, _, c in reversed(CASES)}
_PARAMS = [pytest.param(m, n, c, id=f"{m}:{c}", marks=() if _FIRST[m] == c else pytest.mark.extended)
           for m, n, c in CASES]


@pytest.mark.parametrize("method,needs,case", _PARAMS)
def test_each_key_a_method_reads_changes_its_run(two_steps, method, needs, case):
    assert _differs(two_steps(method, tuple(needs)), two_steps(method, (*needs, case))), \
        f"{method}: {case} was accepted but changed nothing"


def test_gradient_checkpointing_recomputes_the_same_gradients(flow_base, tmp_path):
    """The one key that by design changes no number: it only turns diffusers' checkpointing on."""
    from regen.modalities.flow import build_policy

    cfg = load_config(RLConfig, None, [f"model.path={flow_base}", "algorithm.name=nft",
                                       "data.train=builtin:shapes:train", "train.gradient_checkpointing=true"])
    from regen.modalities.flow import FlowModality
    from regen.runtime.dist import Dist

    m = FlowModality(cfg, torch.device("cpu"), Dist())
    assert m.policy.unet.is_gradient_checkpointing
    assert not build_policy(cfg, torch.device("cpu")).unet.is_gradient_checkpointing


# --------------------------------------------------------------------------- configs of older runs


def _older(tree: dict) -> dict:
    """A config tree as the regen before one key per concept wrote it: every key, flow's own names."""
    old = json.loads(json.dumps(tree))
    old["flow"].update({"clip_range": 0.001, "kl_coef": 0.0, "global_std": False, "awm_kl_coef": 0.0})
    old["algorithm"]["std_normalize"] = True
    return old


@pytest.mark.parametrize("method", ["grpo", "gspo", "flow_grpo", "nft"])
def test_a_checkpoint_of_an_older_regen_resumes_without_force(method):
    from regen.train.run import changed_settings

    cfg = load_config(RLConfig, None, [MODEL[METHODS[method].modality], f"algorithm.name={method}"])
    older = _older(cfg.model_dump(mode="json"))
    if METHODS[method].modality == "flow":  # the language-model keys held their defaults, unused
        older["algorithm"].update(clip_low=0.2, clip_high=0.2, kl_coef=0.0)
    if method == "gspo":  # an older gspo run clipped at 0.2, today's default is 3e-4 / 4e-4: a real change
        older["algorithm"].update(clip_low=0.2, clip_high=0.2)
        assert changed_settings(cfg, older) == ["algorithm.clip_high: 0.2 -> 0.0004",
                                                "algorithm.clip_low: 0.2 -> 0.0003"]
        return
    assert changed_settings(cfg, older) == []
    older["flow"]["clip_range"] = 0.01  # a value that differs is still caught, under its new name
    expect = ["algorithm.clip_high: 0.01 -> 0.001", "algorithm.clip_low: 0.01 -> 0.001"]
    assert changed_settings(cfg, older) == (expect if method == "flow_grpo" else [])


def test_eval_reads_the_config_of_an_older_run(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "train.steps=1", "log.progress=none",
                 "log.tensorboard=false", "rollout.global_batch_size=8", "rollout.group_size=4",
                 "rollout.max_new_tokens=4", "data.eval=builtin:arithmetic:test"]) == 0
    cfg = load_config(RLConfig, str(run / "config.yaml"))
    (run / "config.yaml").write_text(yaml.safe_dump(_older(cfg.model_dump(mode="json"))))
    assert main(["eval", str(run), "--num-prompts", "4", "--samples-per-prompt", "1"]) == 0
    assert "accuracy" in capsys.readouterr().out
