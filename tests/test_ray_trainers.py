"""distributed.mode=ray with trainer_workers=2 on a private local Ray (gloo): the trainer group
trains the weights one process trains with the same global batch (DDP and FSDP2), and a group
whose actor is SIGKILLed mid-run restarts from its last checkpoint and still ends where the
uninterrupted single process ends."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from regen.cli import main
from tests.conftest import read_jsonl, sigkill_after_checkpoint
from tests.test_torchrun import ROOT, SETUP, assert_same_flow_training, assert_same_weights, flow_args

pytestmark = pytest.mark.extended  # multi-process: the CI's second tier (pyproject.toml markers)

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

GROUP = ["distributed.mode=ray", "distributed.trainer_workers=2", "distributed.ray_address=null"]
STEPS = "train.steps=4"


@pytest.fixture(scope="module", autouse=True)
def private_ray():
    ray.shutdown()  # a Ray an earlier module left up (a failed test) is sized for that module's actors
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_process(base_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", *SETUP, STEPS, "distributed.mode=single"]) == 0
    return run


def group(run, base, *extra) -> int:
    return main(["train", f"model.path={base}", f"run.dir={run}", *SETUP, STEPS, *GROUP, *extra])


def same_run(run, ref, base):
    rows, want = read_jsonl(run / "metrics.jsonl"), read_jsonl(ref / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # rank 0 alone wrote metrics; no step twice
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in want]
    for key in ("loss", "kl", "grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in want], rel=1e-4, abs=1e-6), key
    assert_same_weights(run / "export", ref / "export", base)


def test_two_trainer_actors_with_fsdp2_train_the_same_weights_as_one_process(base_model, one_process, tmp_path):
    run = tmp_path / "run"
    assert group(run, base_model, "distributed.strategy=fsdp") == 0
    same_run(run, one_process, base_model)


ACTORS = ["distributed.group_sampling=actors", "distributed.rollout_workers=2"]


@pytest.mark.parametrize("strategy,sync", [("ddp", "object_store"), ("fsdp", "object_store"), ("fsdp", "collective")])
def test_a_trainer_group_whose_rollout_actors_sample_trains_what_one_process_trains(strategy, sync, base_model,
                                                                                  one_process, tmp_path):
    """group_sampling=actors: rank 0 drives 2 rollout actors, every rank gets the batch; the weights
    go to the actors gathered (FSDP2) after each update, so they sample what one process samples;
    with sync=collective rank 0 broadcasts them over a group of its own beside the trainer group's."""
    run = tmp_path / "run"
    ray.shutdown()  # a private Ray sized for this run's actors (an earlier one may have had room for 2 only)
    assert group(run, base_model, f"distributed.strategy={strategy}", *ACTORS, f"distributed.sync={sync}") == 0
    same_run(run, one_process, base_model)
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(r["sync/mb"] > 0 and r["rollout/worker_restarts"] == 0 for r in rows)  # the actors sampled


def test_a_trainer_group_samples_one_step_ahead_as_one_trainer_does(base_model, tmp_path):
    """max_staleness=1 with rank 0's rollout actors: the next batch is requested before the update
    and every rank draws it at that point, so the group trains what one trainer with the same
    actors trains (late batches, behaviour log-probs, the rewind at each checkpoint)."""
    ahead = [*SETUP, "train.steps=5", "checkpoint.every=2", "distributed.max_staleness=1",
             "distributed.rollout_workers=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    ray.shutdown()  # a private Ray sized for this run's actors
    assert main(["train", f"model.path={base_model}", f"run.dir={one}", *ahead, "distributed.mode=ray",
                 "distributed.reward_workers=1"]) == 0
    ray.shutdown()
    assert main(["train", f"model.path={base_model}", f"run.dir={two}", *ahead, *GROUP,
                 "distributed.group_sampling=actors"]) == 0
    rows, want = read_jsonl(two / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    assert [r["rollout/staleness"] for r in rows] == [r["rollout/staleness"] for r in want] == [0, 1, 0, 1, 0]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in want]
    for key in ("loss", "kl", "grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in want], rel=1e-4, abs=1e-6), key
    assert_same_weights(two / "export", one / "export", base_model)


def trainer_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any("TrainerWorker" in part for part in (p.info["cmdline"] or []))]


@pytest.mark.parametrize("sampling", ["ranks", "actors"])
def test_a_killed_trainer_actor_restarts_the_group_from_its_checkpoint(sampling, base_model, one_process, tmp_path,
                                                                      capsys):
    run, killed = tmp_path / "run", []
    extra = ACTORS if sampling == "actors" else []  # actors: the new group's rank 0 starts new rollout actors
    ray.shutdown()  # a private Ray sized for this run's actors (an earlier one may have had room for 2 only)

    def kill_after_step_2():  # SIGKILL one rank's process once step 2 (and its checkpoint) is on disk
        deadline = time.time() + 300
        while time.time() < deadline:
            if (run / "checkpoints" / "step_00000002" / "manifest.json").exists() and \
                    (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
                pids = trainer_pids()
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)
                    killed.append(time.time())
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_step_2, daemon=True)
    watcher.start()
    assert group(run, base_model, "checkpoint.every=2", "distributed.strategy=ddp", *extra) == 0
    watcher.join(1)
    assert killed, "the trainer actor was not killed: the test did not exercise the restart"
    assert "restarting it from the last checkpoint (restart 1 of 3)" in capsys.readouterr().err
    # the new group resumed from step 2 (a group that started over would have rewritten that checkpoint)
    assert (run / "checkpoints" / "step_00000002" / "manifest.json").stat().st_mtime < killed[0]
    same_run(run, one_process, base_model)  # resumed exactly: the same rewards, losses and weights


def test_a_stop_request_to_the_driver_stops_every_trainer_at_one_step_and_the_rerun_resumes(
        base_model, tmp_path, capsys):
    run, steps = tmp_path / "run", 40  # long enough (a step takes about 0.2 s) for the stop to land mid-run

    def sigterm_once_started():  # as a scheduler's SIGTERM reaches the process the user started
        deadline = time.time() + 300
        while time.time() < deadline:
            if (run / "config.yaml").exists():  # rank 0 is up
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=sigterm_once_started, daemon=True)
    watcher.start()
    assert group(run, base_model, "checkpoint.every=0", f"train.steps={steps}") == 0
    watcher.join(1)
    done = [r["step"] for r in read_jsonl(run / "metrics.jsonl")]
    assert done and done[-1] < steps, done
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{done[-1]:08d}"]  # written at the stop
    assert not (run / "export").exists()
    assert group(run, base_model, f"train.steps={steps}") == 0  # the same command resumes and finishes
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, steps + 1))
    assert (run / "export").exists()

def test_a_flow_model_trains_the_same_weights_in_a_trainer_group(flow_base, tmp_path):
    # the trainer group is modality-blind: DiffusionNFT with its EMA old policy and a weight EMA, DDP
    args = flow_args(flow_base, "nft")
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *args, f"run.dir={one}", "distributed.mode=single"]) == 0
    assert main(["train", *args, f"run.dir={two}", *GROUP]) == 0
    assert_same_flow_training(two, one, flow_base)
    three = tmp_path / "three"  # and with rank 0's rollout actors sampling
    ray.shutdown()  # a private Ray sized for this run's actors
    assert main(["train", *args, f"run.dir={three}", *GROUP, *ACTORS]) == 0
    assert_same_flow_training(three, one, flow_base)

def test_a_group_the_cluster_cannot_place_is_one_error_before_anything_is_written(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert group(run, base_model, "distributed.trainer_resources={num_gpus: 1}") == 2
    err = capsys.readouterr().err
    assert "cannot place the run's actors (GPU: need 2, the cluster has 0)" in err and "trainer_workers" in err
    assert not run.exists()


def test_what_torchrun_refuses_a_trainer_group_refuses_before_starting_actors(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert group(run, base_model, "rollout.global_batch_size=12", "rollout.group_size=4",
                 "train.global_minibatch_size=12") == 2  # 3 prompts a step for 2 ranks
    assert "3 prompts per step cannot be split evenly over 2 trainer processes" in capsys.readouterr().err
    assert not run.exists()


def test_a_killed_driver_takes_its_trainers_with_it_and_the_rerun_resumes(base_model, tmp_path):
    """SIGKILL to the process the user started (its private Ray with it): no trainer actor goes on writing the run
    directory, and the same command resumes from the last checkpoint. A checkpoint every step, so that each step
    the actors took after the kill would leave one: without the actors' watch of their driver, Ray's own clean-up
    took 1.9-2.6 s here, in which they wrote 9-12 more checkpoints."""
    run, steps = tmp_path / "run", 20
    args = ["train", f"model.path={base_model}", f"run.dir={run}", *SETUP, *GROUP, f"train.steps={steps}",
            "checkpoint.every=1", "checkpoint.keep_last=100"]
    before = set(trainer_pids())
    driver = subprocess.Popen([sys.executable, "-m", "regen", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    sigkill_after_checkpoint(driver, run, 5)
    killed = time.time()
    while time.time() < killed + 60 and set(trainer_pids()) - before:
        time.sleep(0.05)
    assert time.time() < killed + 5, "trainer actors outlived their driver (they watch it every 0.1 s)"
    after = sorted(p.name for p in (run / "checkpoints").iterdir() if p.stat().st_mtime > killed)
    assert len(after) <= 1, f"checkpoints written after the driver's death: {after}"  # at most the step in flight
    left = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "manifest.json").exists())
    assert left and left[-1] < f"step_{steps:08d}" and not (run / "export").exists(), left  # killed mid-run
    assert main(args) == 0  # the same command resumes from the newest complete checkpoint
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, steps + 1))
