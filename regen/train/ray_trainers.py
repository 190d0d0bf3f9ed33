"""`distributed.mode: ray` with `trainer_workers: N > 1`: a group of N trainer actors that form
one process group (DDP or FSDP2; NCCL on GPUs, gloo on CPUs), placed by a Ray placement group.

The process the user started is a thin driver. It checks the cluster, reserves one bundle of
`trainer_resources` per actor, starts a TrainerWorker in each, gives each its rank and the
group's rendezvous (rank 0's node address and a free port there: what torchrun's c10d store
does), and has each run the same `train` a torchrun rank runs (regen/runtime/dist.py joins the
group when REGEN_TRAINER_GROUP is set). So everything torchrun guarantees holds here: N actors
train the weights one process trains with the same global batch, rank 0 writes the run
directory (on shared storage when the actors span nodes), checkpoints are single-process ones.

The driver follows the run from metrics.jsonl and alerts.jsonl (the actors' own consoles go to
Ray's worker logs), passes a stop request (SIGINT / SIGTERM) on to every actor so they stop at
the same step with a checkpoint (an actor's loop runs in a thread of its own, where a signal
cannot be caught: the request is an actor call), and when an actor dies (killed, out of memory,
node lost) it stops the others and starts the group again; the new group resumes from the last
checkpoint, exactly as a rerun of the command would (`distributed.max_restarts` restarts per run).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from regen.errors import RunStopped, UserError
from regen.runtime.dist import GENERATION_ENV, GROUP_ENV

DRIVER_ENV = "REGEN_GROUP_DRIVER"  # host:pid:start-time of the driver, which the actors watch


class TrainerWorker:
    """One rank of the group: a plain class, made an actor by TrainerGroup."""

    def where(self) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": len(ray.get_gpu_ids())}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def stop(self) -> None:
        """Finish the step, checkpoint, return (runs beside `run`: the actor has two threads)."""
        from regen.runtime.signals import request_stop

        request_stop()

    def run(self, tree: dict, env: dict[str, str], cwd: str, resume: bool, force: bool) -> tuple[str, object]:
        """("ok", summary) or ("user" | "stopped" | "interrupted", message); other errors raise."""
        from regen.config import RLConfig
        from regen.runtime.quiet import quiet_libraries
        from regen.train import train

        os.environ.update(env)
        _watch_driver(env.get(DRIVER_ENV))
        if Path(cwd).is_dir():  # relative paths of the config mean what they meant to the driver
            os.chdir(cwd)
        quiet_libraries()
        try:
            return "ok", train(RLConfig.model_validate(tree), resume=resume, force=force)
        except RunStopped as e:
            return "stopped", str(e)
        except UserError as e:
            return "user", str(e)
        except KeyboardInterrupt:
            return "interrupted", ""


class TrainerGroup:
    """N TrainerWorker actors in one placement group, ranked so that each node's ranks are contiguous."""

    def __init__(self, cfg, generation: int):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from regen.placement.ray import _first_error_line

        d = cfg.distributed
        self.generation = generation  # names a rank 0's rollout actors (group_sampling=actors) per group
        res = d.trainer_resources
        bundle = {"CPU": res.get("num_cpus", 1.0), "GPU": res.get("num_gpus", 0.0),
                  **{k: v for k, v in res.items() if k not in ("num_cpus", "num_gpus")}}
        self.pg = placement_group([{k: v for k, v in bundle.items() if v}] * d.trainer_workers, strategy="PACK")
        self.actors: list = []
        if not self.pg.wait(timeout_seconds=120):
            self.close()
            raise UserError(f"distributed: Ray could not place {d.trainer_workers} trainer actors of {res} each within "
                            "120 s; lower distributed.trainer_workers or trainer_resources, or add nodes")
        remote = ray.remote(TrainerWorker)
        for i in range(d.trainer_workers):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)
            self.actors.append(remote.options(
                name=f"regen-trainer-{i}-g{generation}", num_cpus=bundle["CPU"], num_gpus=bundle["GPU"],
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None,
                scheduling_strategy=strategy, max_concurrency=2).remote())  # 2 threads: stop() beside run()
        try:
            places = ray.get([a.where.remote() for a in self.actors])
        except ray.exceptions.RayError as e:  # e.g. regen or a package missing on a node
            self.close()
            raise UserError(f"trainer actors could not start: {_first_error_line(e)}") from None
        order = sorted(range(len(places)), key=lambda i: (places[i]["ip"], i))
        self.actors, self.places = [self.actors[i] for i in order], [places[i] for i in order]

    def env(self) -> list[dict[str, str]]:
        """Each rank's torchrun-style environment."""
        import ray

        master, port = self.places[0]["ip"], ray.get(self.actors[0].free_port.remote())
        out = []
        for rank, p in enumerate(self.places):
            local = [q for q in self.places if q["node"] == p["node"]]
            # an actor given GPUs by Ray sees only those (CUDA_VISIBLE_DEVICES): its device is 0
            local_rank = 0 if p["gpus"] else local.index(p)
            out.append({GROUP_ENV: "1", "RANK": str(rank), "WORLD_SIZE": str(len(self.places)),
                        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(len(local)),
                        "MASTER_ADDR": master, "MASTER_PORT": str(port), GENERATION_ENV: str(self.generation),
                        DRIVER_ENV: f"{socket.gethostname()}:{os.getpid()}:{_started(os.getpid())}"})
        return out

    def stop(self) -> None:
        import ray

        ray.get([a.stop.remote() for a in self.actors])

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)


def _started(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid it
    names one process, never a later one that reuses the pid. None when it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _watch_driver(driver: str | None, every_s: float = 0.1) -> None:
    """End this trainer actor's process within every_s of its driver's death: with a private Ray, a
    SIGKILLed driver's actors otherwise trained on for the 1.9-2.6 s Ray took to end them, writing
    9-14 more checkpoints (one per step) into the run directory its rerun was about to use; with
    this watch, none or the one in flight (tests/test_ray_trainers.py). The driver is watched where
    its process can be seen: an actor on the driver's host; on other hosts, and on a cluster
    started with `ray start` (measured: the actors end with their driver), Ray's fate-sharing does."""
    if not driver:
        return
    host, pid, started = driver.rsplit(":", 2)
    if host != socket.gethostname() or started == "None" or _started(int(pid)) != started:
        return  # another host, or a process namespace (a container) where the driver cannot be seen

    def watch():
        import time

        while _started(int(pid)) == started:
            time.sleep(every_s)
        print(f"regen: the trainer group's driver (pid {pid}) is gone: this trainer stops", file=sys.stderr,
              flush=True)
        os._exit(1)  # at once: no further step or checkpoint (a half-written one is a .tmp folder, ignored)

    import threading

    threading.Thread(target=watch, daemon=True, name="regen-driver-watch").start()


def train_group(cfg, resume: bool = False, force: bool = False) -> dict:
    """The driver: place the group, follow it, restart it when an actor dies; the rank-0 summary."""
    from regen.placement.checks import check_placement
    from regen.placement.ray import start_ray
    from regen.runtime.dist import Dist
    from regen.runtime.progress import StepProgress, run_label
    from regen.runtime.signals import GracefulStop

    d = cfg.distributed
    check_placement(cfg, Dist(d.strategy, 0, d.trainer_workers))  # what torchrun refuses, before anything starts
    start_ray(cfg)
    tree = cfg.model_dump(mode="json")
    tree["run"]["dir"] = str(Path(cfg.run.dir).expanduser().absolute())
    restarts = 0
    with StepProgress(cfg.train.steps, 0, cfg.log.progress, cfg.log.every,
                      f"{run_label(cfg)} x{d.trainer_workers} trainers", cfg.log.every_s) as bar, \
            GracefulStop(bar.print) as stop:
        while True:
            group = TrainerGroup(cfg, restarts)
            try:
                kind, value = _follow(group, tree, resume, force, stop, bar)
            finally:
                group.close()
            if kind == "ok":
                return value
            if kind == "interrupted":
                raise KeyboardInterrupt
            if kind != "died":
                raise (RunStopped if kind == "stopped" else UserError)(value)
            restarts += 1
            if restarts > d.max_restarts:
                raise RunStopped(f"trainer actors died {restarts} times (last: {value}); see distributed.max_restarts. "
                                 "Rerun the same command to resume from the last checkpoint")
            bar.print(f"trainer group: {value}; restarting it from the last checkpoint "
                      f"(restart {restarts} of {d.max_restarts})")
            # the new group resumes from the run directory's checkpoints (none yet: it starts over)
            tree["run"]["overwrite"], resume = False, False


def _follow(group: TrainerGroup, tree: dict, resume: bool, force: bool, stop, bar) -> tuple[str, object]:
    """Run the group to its end: ("ok", rank 0's summary), ("died", which), or a rank's error."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    from regen.placement.ray import _first_error_line

    run_dir = Path(tree["run"]["dir"])
    feed = _Feed(run_dir)
    refs = {a.run.remote(tree, env, os.getcwd(), resume, force): rank for rank, (a, env)
            in enumerate(zip(group.actors, group.env(), strict=True))}
    pending, summary, forwarded = list(refs), None, False
    while pending:
        done, pending = ray.wait(pending, timeout=0.5)
        feed.show(bar)
        if stop.requested and not forwarded:  # every rank finishes the step, checkpoints, stops
            group.stop()
            forwarded = True
        for ref in done:
            rank = refs[ref]
            try:
                kind, value = ray.get(ref)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
                return "died", f"trainer rank {rank} died ({_first_error_line(e)})"
            except ray.exceptions.RayTaskError as e:
                # a rank whose peer was lost fails in its next collective: report the loss, not that
                dead = _first_death(pending, refs)
                if dead:
                    return "died", dead
                print(str(e), file=sys.stderr)
                raise RunStopped(f"trainer rank {rank} failed: {_first_error_line(e)} (its traceback is above); "
                                 "rerun the same command to resume from the last checkpoint") from None
            if kind != "ok":
                return kind, value  # the others fail alike, or wait in a collective: close() ends them
            if rank == 0:
                summary = value
    feed.show(bar)
    return "ok", summary


def _first_death(pending: list, refs: dict, grace_s: float = 10.0) -> str | None:
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    from regen.placement.ray import _first_error_line

    done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
            return f"trainer rank {refs[ref]} died ({_first_error_line(e)})"
        except ray.exceptions.RayError:
            pass
    return None


class _Feed:
    """New rows of rank 0's metrics.jsonl and alerts.jsonl, shown on the driver's console."""

    def __init__(self, run_dir: Path):
        self.files = {"metrics": run_dir / "metrics.jsonl", "alerts": run_dir / "alerts.jsonl"}
        self.offsets = {k: self._size(p) if k == "alerts" else 0 for k, p in self.files.items()}

    @staticmethod
    def _size(path: Path) -> int:
        return path.stat().st_size if path.exists() else 0

    def show(self, bar) -> None:
        for kind, path in self.files.items():
            if self._size(path) < self.offsets[kind]:  # rewritten: a resumed run trims rows past its checkpoint
                self.offsets[kind] = 0
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(self.offsets[kind])
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
            self.offsets[kind] += end
            for line in chunk[:end].decode("utf-8", "replace").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if kind == "alerts":
                    bar.print(f"ALERT [{row.get('kind')}] step {row.get('step')}: {row.get('message')}")
                elif "reward/mean" in row:
                    bar.update(int(row["step"]), f"reward {row['reward/mean']:.3f}  "
                                                 f"{row.get('throughput/samples_per_s', 0.0):.1f} samples/s")

