"""distributed.mode=ray on a private local Ray: 2 rollout actors, 1 reward actor and the trainer."""

import os
import shutil
import threading
import time

import pytest
import torch

from regen.cli import main
from tests.conftest import BRIGHT, read_jsonl

pytestmark = pytest.mark.extended  # multi-process: the CI's second tier (pyproject.toml markers)

ray = pytest.importorskip("ray")

# the learnable reward of test_train_e2e.test_grpo_raises_a_learnable_reward: first character not "1"
LEARN = ["log.progress=none", "data.eval=null", "rollout.global_batch_size=32", "rollout.group_size=8",
         "rollout.max_new_tokens=4", "train.steps=30", "optim.lr=3e-4", "run.threads=1",
         "reward=[{name: format, args: {pattern: '[02-9].*', require_eos: false}}]"]
RAY = ["distributed.mode=ray", "distributed.rollout_workers=2", "distributed.reward_workers=1"]


@pytest.fixture(scope="module", autouse=True)
def private_ray():
    ray.shutdown()  # a Ray an earlier module left up (a failed test) is sized for that module's actors
    yield
    ray.shutdown()


def kill_when(run, rows: int, name: str, killed: list):
    """Kill actor `name` once the run has logged `rows` steps (from a thread: mid-run)."""
    def watch():
        deadline = time.time() + 300
        while time.time() < deadline:
            path = run / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= rows:
                ray.kill(ray.get_actor(name, namespace="regen"))
                killed.append(name)
                return
            time.sleep(0.05)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def kill_and_wait(actor, method: str) -> None:
    """ray.kill is asynchronous: a call made right after it can still run on the live actor (it
    did on a loaded CI machine), so call `method` until a call fails: the next one meets a dead actor."""
    ray.kill(actor, no_restart=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            ray.get(getattr(actor, method).remote())
            time.sleep(0.05)
        except ray.exceptions.RayActorError:
            return
    raise AssertionError(f"the actor still answered {method}() 60 s after ray.kill")


def test_disaggregated_run_learns_and_survives_a_killed_rollout_actor(base_model, tmp_path):
    single, spread = tmp_path / "single", tmp_path / "ray"
    assert main(["train", f"model.path={base_model}", f"run.dir={single}", *LEARN]) == 0
    killed: list = []
    watchers = [kill_when(spread, 5, "regen-rollout-0-g0", killed), kill_when(spread, 12, "regen-reward-0-g0", killed)]
    # weights in buckets of 0.2 MB (about 9 per sync): the replaced actor loads them all too
    assert main(["train", f"model.path={base_model}", f"run.dir={spread}", *LEARN, *RAY,
                 "distributed.sync_bucket_mb=0.2"]) == 0
    for w in watchers:
        w.join(1)
    assert killed == ["regen-rollout-0-g0", "regen-reward-0-g0"]
    rows, ref = read_jsonl(spread / "metrics.jsonl"), read_jsonl(single / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[-1]["rollout/worker_restarts"] >= 1 and rows[-1]["reward/worker_restarts"] >= 1  # replaced...
    assert rows[0]["sync/buckets"] >= 5 and all(r["sync/mb"] == rows[0]["sync/mb"] for r in rows)
    # ...and its share sampled again with the same weights and uniforms: every step's batch is the one
    # a single process samples (a lost or doubled group would change the rewards from that step on)
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]
    assert [r["response_length/mean"] for r in rows] == [r["response_length/mean"] for r in ref]
    assert all(r["rollout/staleness"] == 0 for r in rows)  # max_staleness=0: always the newest weights
    first, last = sum(r["reward/mean"] for r in rows[:5]) / 5, sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.3, (first, last)  # it learns the task


def test_a_reward_actor_that_died_between_calls_is_replaced_for_the_version_check(base_model, tmp_path):
    """The loop asks the reward actors for their versions after scoring; one killed in between is
    replaced and asked again (it had failed the run)."""
    from regen.config import RLConfig, load_config
    from regen.placement.ray import RayReward

    cfg = load_config(RLConfig, None, [f"model.path={base_model}", f"run.dir={tmp_path}", *LEARN, *RAY])
    reward = RayReward(cfg)
    try:
        before = reward.versions()
        actor = reward.workers.actors[0]
        kill_and_wait(actor, "versions")
        assert reward.versions() == before and reward.workers.restarts == 1
    finally:
        reward.close()


def test_a_run_that_fails_in_its_loop_stops_its_actors(base_model, tmp_path, monkeypatch):
    """Its actors are named: left behind, they kept the next run in the same process from starting."""
    import regen.modalities.update as upd

    def broken(*a, **k):
        raise RuntimeError("a bug in the update")

    monkeypatch.setattr(upd, "update", broken)
    with pytest.raises(RuntimeError, match="a bug in the update"):
        main(["train", f"model.path={base_model}", f"run.dir={tmp_path / 'a'}", *LEARN, *RAY, "train.steps=2"])
    monkeypatch.undo()
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path / 'b'}", *LEARN, *RAY, "train.steps=2"]) == 0


def test_one_step_off_policy_never_exceeds_the_bound(base_model, tmp_path):
    run = tmp_path / "async"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", *LEARN, *RAY, "train.steps=5",
                 "distributed.max_staleness=1", "checkpoint.every=2"]) == 0
    lags = [r["rollout/staleness"] for r in read_jsonl(run / "metrics.jsonl")]
    # step 1 and the step after a checkpoint (the batch sampled ahead is dropped at a checkpoint so
    # the saved state resumes exactly) use current weights; the others were sampled during the update
    assert lags == [0, 1, 0, 1, 0]
    # the same run stopped right after its step-2 checkpoint (a copy without the later checkpoints)
    # and resumed continues exactly: the batch it had sampled ahead was dropped and its prompts and
    # randomness rewound when the checkpoint was written
    again = tmp_path / "again"
    shutil.copytree(run, again)
    for later in ("step_00000004", "step_00000005"):
        shutil.rmtree(again / "checkpoints" / later)
    shutil.rmtree(again / "export")
    assert main(["train", f"model.path={base_model}", f"run.dir={again}", *LEARN, *RAY, "train.steps=5",
                 "distributed.max_staleness=1", "checkpoint.every=2"]) == 0
    strip = lambda rows: [r["reward/mean"] for r in rows]  # noqa: E731
    assert strip(read_jsonl(again / "metrics.jsonl")) == strip(read_jsonl(run / "metrics.jsonl"))


def test_a_ray_start_that_cannot_place_its_workers_leaves_no_run_behind(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", f"model.path={base_model}", f"run.dir={run}", *LEARN, *RAY]
    assert main([*args, "distributed.rollout_resources={num_gpus: 4}"]) == 2
    assert "cannot place the run's actors" in capsys.readouterr().err
    assert not run.exists() or not any(run.iterdir())  # so the corrected command just runs


def rollout_pool(*overrides: str):
    """(the LM modality, RayRollouts over it) for a config of `overrides`: a trainer's rollout side
    driven directly by a test."""
    from regen.config import RLConfig, load_config
    from regen.data import EpochSampler, load_prompts
    from regen.modalities.lm import LMModality
    from regen.placement.ray import RayRollouts
    from regen.runtime.dist import Dist

    cfg = load_config(RLConfig, None, list(overrides))
    m = LMModality(cfg, torch.device("cpu"), Dist())
    prompts = load_prompts(cfg.data.train, cfg.task, "data.train", False, cfg.data.columns)
    return m, RayRollouts(m, EpochSampler(len(prompts), 0), prompts, cfg, version=0)


def test_a_batch_staler_than_the_bound_is_sampled_again(base_model, tmp_path):
    m, pool = rollout_pool(f"model.path={base_model}", *LEARN, *RAY, "distributed.max_staleness=1", "train.steps=2")
    try:
        gen = torch.Generator().manual_seed(0)
        _, first = pool.next(1, gen)  # version 0; the next batch is requested now, with version 0
        assert pool._ahead is not None
        assert first.version.tolist() == [0] * 32 and not pool.stale(first)
        pool.sync(1)
        pool.sync(2)  # the trainer moved two versions on: the batch sampled ahead lags 2 > 1
        items, batch = pool.next(2, gen)
        assert pool.discarded == 1 and batch.version.tolist() == [2] * 32
        assert pool._ahead is None  # step 2 is the last: no batch is requested past it
        assert len(items) == 4 and len(batch.completions) == 32
        # PPO's old log-probs: the trainer's own for a current batch, the actors' for a late one
        assert not pool.stale(batch)
        pool.sync(3)
        assert pool.stale(batch)
        behaviour = m.behaviour_terms(batch, {"old_logp": None, "ref_logp": None})["old_logp"]
        mask = batch.response_mask.bool()
        torch.testing.assert_close(behaviour[mask], m.policy.token_logprobs(batch, 1.0)[0][mask], atol=1e-5, rtol=1e-5)
        # a replaced actor samples a late share with the version it was requested with, not the newest
        dead = pool.workers.actors[0]
        kill_and_wait(dead, "ready")
        pool.discard_prefetch()
        _, items, plan, refs, _, version = pool._submit(4, gen)  # a batch requested ahead, with version 3...
        assert version == 3
        with torch.no_grad():
            for p in m.policy.model.parameters():
                p.add_(0.01)
        pool.sync(4)  # ...while the trainer moves on to version 4
        late = pool._collect(items, plan, refs, version)
        assert pool.workers.restarts == 1
        assert late.version.tolist() == [3] * 32  # the replacement sampled with version 3, as the lost actor would
        again = pool._collect(items, plan, pool._requests(items, plan), pool.version)
        assert again.version.tolist() == [4] * 32  # and then holds the newest weights again
    finally:
        pool.close()


def test_syncs_send_only_changed_tensors_and_a_replaced_actor_rebuilds_the_weights_from_the_chain(base_model, tmp_path):
    """distributed.sync_changed_only (the default): each sync sends the tensors that moved; a new
    actor loads every bucket that still holds a current tensor (tests/test_sync_pack.py has the
    bookkeeping). Checked here through what actors sample with: their log-probs are the trainer's."""
    from regen.config import RLConfig, load_config
    from regen.data import EpochSampler, load_prompts
    from regen.modalities.lm import LMModality
    from regen.placement.ray import RayRollouts
    from regen.runtime.dist import Dist

    cfg = load_config(RLConfig, None, [f"model.path={base_model}", *LEARN, *RAY, "distributed.max_staleness=1"])
    m = LMModality(cfg, torch.device("cpu"), Dist())
    prompts = load_prompts(cfg.data.train, cfg.task, "data.train", False, cfg.data.columns)
    pool = RayRollouts(m, EpochSampler(len(prompts), 0), prompts, cfg, version=0)
    params = dict(m.policy.model.named_parameters())
    moved = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight"]
    try:
        sent = []
        for version, name in enumerate(moved, start=1):  # one tensor moves per version
            with torch.no_grad():
                params[name].add_(0.05)
            sent.append(pool.sync(version))
        n = len({t.data_ptr() for t in m.policy.model.state_dict().values()})  # tied tensors count once
        assert [r["sync/tensors"] for r in sent] == [1.0, 1.0] and sent[0]["sync/unchanged"] == n - 1
        assert sent[0]["sync/mb"] == pytest.approx(params[moved[0]].numel() * 4 / 1e6)
        gen = torch.Generator().manual_seed(0)
        kill_and_wait(pool.workers.actors[0], "ready")  # its replacement starts from model.path
        _, items, plan, refs, _, version = pool._submit(3, gen)
        batch = pool._collect(items, plan, refs, version)
        assert pool.workers.restarts == 1 and batch.version.tolist() == [2] * 32
        # both actors' sampling log-probs (the replaced one's included: rows 0-15) are the trainer's:
        # each holds both moved tensors (a replacement that loaded only the last sync lacks the first)
        mask = batch.response_mask.bool()
        torch.testing.assert_close(batch.behaviour_logp[mask], m.policy.token_logprobs(batch, 1.0)[0][mask],
                                   atol=1e-5, rtol=1e-5)
    finally:
        pool.close()


def test_a_vlm_on_rollout_actors_gets_its_frozen_vision_tower_once(vlm_base, tmp_path):
    from safetensors.torch import load_file

    from tests.conftest import VLM_FAST

    args = ["train", f"model.path={vlm_base}", *VLM_FAST, "train.steps=3", "data.eval=null"]
    one, spread = tmp_path / "one", tmp_path / "ray"
    assert main([*args, f"run.dir={one}"]) == 0
    assert main([*args, f"run.dir={spread}", *RAY]) == 0
    rows, ref = read_jsonl(spread / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]  # the actors sample what one process does
    weights = load_file(f"{vlm_base}/model.safetensors")
    vision = [k for k in weights if "vision_tower" in k]
    vision_mb = sum(weights[k].numel() * weights[k].element_size() for k in vision) / 1e6
    all_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    assert vision and all(r["sync/unchanged"] >= len(vision) for r in rows)  # sent at the start only
    assert all(r["sync/mb"] <= all_mb - vision_mb + 1e-6 for r in rows), (rows[0]["sync/mb"], all_mb, vision_mb)


@pytest.mark.parametrize("algo", ["flow_grpo"])  # SDE steps: the most noise per sample to get right
def test_flow_models_on_rollout_actors_sample_what_one_process_does(algo, flow_base, tmp_path):
    args = [f"model.path={flow_base}", f"algorithm.name={algo}", "data.train=builtin:shapes:train", "data.eval=null",
            "rollout.global_batch_size=8", "rollout.group_size=4", "flow.steps=3", "log.progress=none",
            "log.tensorboard=false", "optim.lr=1e-3", "run.threads=1", "train.steps=3", BRIGHT]
    one, spread = tmp_path / "one", tmp_path / "ray"
    assert main(["train", *args, f"run.dir={one}"]) == 0
    killed: list = []
    # after the first step's row: two more steps need the actor (after the second, its last
    # batch may already be sampled when the kill lands, and nothing would have to restart)
    watcher = kill_when(spread, 1, "regen-rollout-1-g0", killed)
    assert main(["train", *args, f"run.dir={spread}", *RAY]) == 0
    watcher.join(1)
    rows, ref = read_jsonl(spread / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    assert killed and rows[-1]["rollout/worker_restarts"] >= 1
    # same noise, same weights: the same images, so the same rewards step after step
    assert [r["reward/mean"] for r in rows] == pytest.approx([r["reward/mean"] for r in ref], rel=1e-5)
    assert ref[-1]["grad_norm"] > 0


def test_flow_models_sampled_one_step_ahead_train_on_the_behaviour_policy(flow_base, tmp_path):
    # flow_dppo over 2 epochs reads both behaviour terms of a late batch: the SDE steps' log-probs
    # (the ratio) and their Gaussian means (the KL trust region)
    args = [f"model.path={flow_base}", "algorithm.name=flow_dppo", "data.train=builtin:shapes:train",
            "data.eval=null", "rollout.global_batch_size=8", "rollout.group_size=4", "flow.steps=3",
            "train.ppo_epochs=2", "log.progress=none", "log.tensorboard=false", "optim.lr=1e-2", "run.threads=1",
            BRIGHT, *RAY, "distributed.max_staleness=1"]
    run = tmp_path / "ahead"
    assert main(["train", *args, f"run.dir={run}", "train.steps=4", "checkpoint.every=2"]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    # sampled during the previous update (one version behind), except at the start and after a
    # checkpoint (the batch sampled ahead is dropped, so the checkpoint resumes exactly: the
    # placement code the language-model test resumes through)
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 0, 1]
    assert all(r["ratio_mean"] != 1.0 for r in rows[1::2])  # late batches: ratio to the sampling weights


def test_lora_runs_send_only_the_adapter(base_model, tmp_path):
    lora = [*LEARN, "train.steps=4", "model.lora={r: 4, alpha: 8}", "optim.lr=1e-3"]
    one, spread = tmp_path / "one", tmp_path / "ray"
    assert main(["train", f"model.path={base_model}", f"run.dir={one}", *lora]) == 0
    assert main(["train", f"model.path={base_model}", f"run.dir={spread}", *lora, *RAY]) == 0
    rows, ref = read_jsonl(spread / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    # the actors sample with base + the trainer's adapter: the same batches as one process
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]
    assert ref[-1]["grad_norm"] > 0
    from safetensors.torch import load_file

    full_mb = sum(t.numel() * t.element_size() for t in load_file(str(base_model / "model.safetensors")).values()) / 1e6
    adapter_mb = rows[0]["sync/mb"]
    assert 0 < adapter_mb < full_mb / 5, (adapter_mb, full_mb)


GROUP_ACTORS = ["distributed.mode=ray", "distributed.trainer_workers=2", "distributed.group_sampling=actors",
                "distributed.rollout_workers=2"]


@pytest.mark.parametrize("lora, placement", [(False, RAY), (True, RAY), (False, GROUP_ACTORS)],
                         ids=["full", "lora", "trainer-group"])
def test_vllm_on_rollout_actors_samples_what_vllm_in_one_process_does(lora, placement, base_model, tmp_path,
                                                                      stand_in_vllm):
    """rollout.engine=vllm on each rollout actor (tests/stand_in_vllm: vLLM's interface on the
    CPU): full weights go bucket by bucket into the engine, a LoRA adapter merged; the actors draw
    the batches one process's engine draws, and end holding the same weights; the same when rank 0
    of a trainer group (2 DDP actors) drives them."""
    from tests.conftest import export_weights, vllm_engines

    ray.shutdown()  # a Ray started before the stand-in was on PYTHONPATH would not give it to the actors
    args = [f"model.path={base_model}", *LEARN, "train.steps=3", "rollout.global_batch_size=16", "rollout.engine=vllm",
            *(["model.lora={r: 4, alpha: 8}", "optim.lr=1e-3"] if lora else [])]
    one, spread = tmp_path / "one", tmp_path / "ray"
    try:
        assert main(["train", *args, f"run.dir={one}"]) == 0
        assert main(["train", *args, f"run.dir={spread}", *placement]) == 0
    finally:
        ray.shutdown()  # later tests start a Ray without the stand-in
    rows, ref = read_jsonl(spread / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref] and ref[-1]["grad_norm"] > 0
    engines = vllm_engines(stand_in_vllm)
    mine, last = engines.pop(str(os.getpid()))  # the one-process run's engine, here
    final = {k.split(":", 1)[1]: v for k, v in export_weights(spread).items()}
    assert final and all(torch.equal(last[k], v) for k, v in
                         {k.split(":", 1)[1]: v for k, v in export_weights(one).items()}.items())
    assert len(engines) == 2 and mine.count("generate 2") == 3  # one per actor; 2 prompts per step
    for calls, weights in engines.values():
        assert calls[0] == "init tp=1 sleep_mode=False" and calls.count("generate 1") == 3  # 1 prompt each
        # each actor's engine ends with the trainer's weights, exactly (float32 sync): the run's end
        # waits for the last sync (it was killed before a slow LoRA merge ran, on a loaded machine)
        assert len(weights) == len(last) and all(torch.equal(weights[k], v) for k, v in final.items())
        assert calls[-2:] == [f"load {len(last)}" if lora else calls[-2], "reset"]  # LoRA: merged, every tensor


def test_a_multi_task_run_on_actors_routes_each_tasks_reward_as_one_process_does(base_model, tmp_path):
    """The reward actors build the task-routed reward from the config: each task's prompts are
    scored by that task's terms, so the per-task rewards (and the dynamic weights that learn from
    them) are the ones a single process logs."""
    tasks = ("tasks={even: {train: builtin:arithmetic:train, reward: [{name: format, args: {pattern: '.*[02468]', "
             "require_eos: false}}]}, small: {train: builtin:arithmetic:train, weight: 3, reward: [{name: format, "
             "args: {pattern: '[0-4].*', require_eos: false}}]}}")
    common = ["train", f"model.path={base_model}", "log.progress=none", "rollout.global_batch_size=16",
              "rollout.group_size=4", "rollout.max_new_tokens=4", "train.steps=4", "optim.lr=1e-3", "run.threads=1",
              "task_mix.weights=dynamic", tasks]
    single, spread = tmp_path / "single", tmp_path / "ray"
    assert main([*common, f"run.dir={single}"]) == 0
    assert main([*common, f"run.dir={spread}", *RAY, "distributed.max_staleness=0"]) == 0
    pick = lambda rows: [{k: v for k, v in r.items() if k.startswith(("task/", "reward/even", "reward/small"))}  # noqa: E731
                         for r in rows]
    got, want = pick(read_jsonl(spread / "metrics.jsonl")), pick(read_jsonl(single / "metrics.jsonl"))
    assert got == want and "reward/even/format" in want[0] and want[0]["task/small/share"] == 0.75


def test_bf16_sync_sends_half_the_bytes_and_the_run_still_learns(base_model, tmp_path):
    steps = ["train.steps=12", "optim.lr=1e-3"]
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    assert main(["train", f"model.path={base_model}", f"run.dir={fp32}", *LEARN, *RAY, *steps]) == 0
    assert main(["train", f"model.path={base_model}", f"run.dir={bf16}", *LEARN, *RAY, *steps,
                 "distributed.sync_dtype=bfloat16"]) == 0
    a, b = read_jsonl(fp32 / "metrics.jsonl"), read_jsonl(bf16 / "metrics.jsonl")
    assert b[0]["sync/mb"] == pytest.approx(a[0]["sync/mb"] / 2, rel=0.01)  # every tensor of GPT-2 is floating
    # the actors sample with bf16-rounded weights (tests/test_sync_pack.py: what an actor holds after
    # loading them); rounding at 3 significant digits rarely moves a sampled token, and learning goes on
    assert sum(r["reward/mean"] for r in b[-4:]) / 4 > sum(r["reward/mean"] for r in b[:4]) / 4 + 0.1


def test_a_second_run_in_one_process_gets_a_private_ray_with_room_for_its_actors():
    from types import SimpleNamespace

    from regen.errors import UserError
    from regen.placement.ray import start_ray

    def cfg(rollout_workers: int):
        return SimpleNamespace(distributed=SimpleNamespace(
            ray_address=None, trainer_workers=1, group_sampling="trainers", rollout_workers=rollout_workers,
            rollout_resources={"num_cpus": 1}, reward_workers=1, reward_resources={"num_cpus": 1}))

    ray.shutdown()
    cpus = os.cpu_count() or 1
    start_ray(cfg(cpus - 1))  # room for cpus actors: a private Ray of cpus CPUs
    assert ray.cluster_resources()["CPU"] == cpus
    start_ray(cfg(cpus + 1))  # an earlier run's private Ray is too small: started again, with room
    assert ray.cluster_resources()["CPU"] == cpus + 2
    ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False)  # the user's own Ray: joined, never restarted
    address = ray.get_runtime_context().gcs_address
    with pytest.raises(UserError, match=r"CPU: need 2, the cluster has 1"):
        start_ray(cfg(1))
    assert ray.is_initialized() and ray.get_runtime_context().gcs_address == address
    ray.shutdown()
