"""distributed.sync=collective on a private local Ray: the trainer and its 2 rollout actors form a
gloo group of their own and every sync is broadcast over it. The actors sample exactly what one
process samples, also when an actor is SIGKILLed between syncs or in the middle of one."""

import os
import signal
import time

import pytest
import torch

from regen.cli import main
from regen.placement import collective
from tests.conftest import read_jsonl
from tests.test_ray import LEARN, RAY, kill_when, rollout_pool

pytestmark = pytest.mark.extended  # multi-process: the CI's second tier (pyproject.toml markers)

ray = pytest.importorskip("ray")

COLLECTIVE = [*RAY, "distributed.sync=collective"]


real_broadcast = collective.broadcast


def dead_within(pid: int, timeout_s: float) -> None:
    """Until `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still alive {timeout_s} s after SIGKILL")


@pytest.fixture(scope="module", autouse=True)
def private_ray():
    ray.shutdown()  # a Ray an earlier module left up (a failed test) is sized for that module's actors
    yield
    ray.shutdown()


def test_a_collective_sync_run_samples_what_one_process_samples_through_a_killed_actor(base_model, tmp_path):
    steps = "train.steps=10"
    single, spread = tmp_path / "single", tmp_path / "collective"
    assert main(["train", f"model.path={base_model}", f"run.dir={single}", *LEARN, steps]) == 0
    killed: list = []
    watcher = kill_when(spread, 4, "regen-rollout-0-g0", killed)  # between syncs: found by the next sample
    # buckets of 0.2 MB (about 9 a sync): the replaced actor loads the chain, then joins a new group
    assert main(["train", f"model.path={base_model}", f"run.dir={spread}", *LEARN, *COLLECTIVE, steps,
                 "distributed.sync_bucket_mb=0.2"]) == 0
    watcher.join(1)
    assert killed == ["regen-rollout-0-g0"]
    rows, ref = read_jsonl(spread / "metrics.jsonl"), read_jsonl(single / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert rows[-1]["rollout/worker_restarts"] >= 1 and rows[-1]["sync/regroups"] >= 1  # replaced, regrouped
    assert rows[0]["sync/buckets"] >= 5 and all(r["sync/broadcast_s"] > 0 for r in rows)
    # every step's batch is the one one process samples: the broadcast weights are the trainer's, bit for bit
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]
    assert [r["response_length/mean"] for r in rows] == [r["response_length/mean"] for r in ref]


def test_an_actor_killed_during_a_sync_is_replaced_and_every_actor_ends_with_the_sync(base_model, monkeypatch):
    """SIGKILL of a rollout actor while the trainer broadcasts (about 17 buckets): the broadcast
    fails, the dead actor is replaced, a new group is built and the sync sent again; both actors
    then sample with exactly the trainer's weights."""
    m, pool = rollout_pool(f"model.path={base_model}", *LEARN, *COLLECTIVE, "distributed.sync_bucket_mb=0.05",
                           "distributed.sync_changed_only=false")
    try:
        pid = ray.get(pool.workers.actors[0].__ray_call__.remote(lambda self: __import__("os").getpid()))
        with torch.no_grad():
            for p in m.policy.model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        # the SIGKILL at a named moment: after the trainer has broadcast 4 of the buckets (a timer
        # raced the sync: on a loaded machine the kill landed after it had finished)
        sent = []

        def broadcast_then_kill(group, buf):
            if len(sent) == 4:
                os.kill(pid, signal.SIGKILL)
                dead_within(pid, 10)
            sent.append(buf.numel())
            real_broadcast(group, buf)

        monkeypatch.setattr(collective, "broadcast", broadcast_then_kill)
        metrics = pool.sync(1)
        monkeypatch.setattr(collective, "broadcast", real_broadcast)
        assert len(sent) > 4  # the kill came mid-sync, and the sync was sent again
        assert pool.workers.restarts == 1 and metrics["sync/regroups"] == 1 and metrics["sync/buckets"] >= 10
        gen = torch.Generator().manual_seed(0)
        _, items, plan, refs, _, version = pool._submit(2, gen)
        batch = pool._collect(items, plan, refs, version)
        assert batch.version.tolist() == [1] * 32
        # both actors (the replacement: rows 0-15) sample with the trainer's weights: their log-probs are its own
        mask = batch.response_mask.bool()
        torch.testing.assert_close(batch.behaviour_logp[mask], m.policy.token_logprobs(batch, 1.0)[0][mask],
                                   atol=1e-5, rtol=1e-5)
    finally:
        pool.close()
