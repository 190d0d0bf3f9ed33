"""`distributed.mode: ray`: the trainer runs the loop here; rollout and reward workers are Ray
actors placed by `distributed.*_resources` (whole nodes, GPUs, or custom node labels).

- Rollout: each step's groups are split over the rollout actors; each gets its prompts and
  its rows of the step's plan (the uniforms or noise drawn here from the run's generator), so
  the batch is the one a single process would sample with the same weights (any modality).
- Sync: after each update the trainer's weights (for LoRA: the adapter's tensors only; with
  distributed.sync_changed_only, those that changed) go to the object store once, in buckets
  (distributed.sync_bucket_mb, cast to distributed.sync_dtype), and every actor loads them bucket
  by bucket, tagged with the version (= step). Ray runs an actor's calls in order, so a sample
  call made after a sync sees the new weights; a replaced actor loads the chain of buckets that
  holds every current tensor (regen/placement/sync.py). With `distributed.sync: collective` the
  same buckets are broadcast over a process group of the trainer and its actors instead
  (regen/placement/collective.py).
- Staleness: with `max_staleness` k >= 1 the next batch is requested before the update (it
  overlaps the update); a batch whose oldest weights lag more than k versions is thrown away
  and sampled again with the current ones.
- Faults: a dead actor (killed, node lost) is replaced by a new one that gets the current
  weights, and only its share of the step is requested again: no sample lost or counted twice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from regen.data import EpochSampler, PromptItem
from regen.errors import RunStopped, UserError
from regen.placement.local import group_rows
from regen.placement.ray_workers import RewardWorker, RolloutWorker
from regen.placement.sync import Chain, Packer, nbytes

DRAIN_S = 60.0  # the longest a run's end waits for its rollout actors to take the last weights


def start_ray(cfg) -> None:
    """Join distributed.ray_address, or start a private Ray with room for every actor."""
    try:
        import ray
    except ImportError:
        raise UserError("distributed.mode=ray needs Ray: pip install 'regen[ray]'") from None
    global _PRIVATE
    d = cfg.distributed
    if ray.is_initialized() and not d.ray_address and _PRIVATE == ray.get_runtime_context().gcs_address \
            and {k for k, _, _ in _short(d, ray.cluster_resources())} == {"CPU"}:
        ray.shutdown()  # the private Ray an earlier run in this process started has too few CPUs for this run's actors
    if ray.is_initialized():
        pass  # joined already (an earlier run in this process): its resources are checked below
    elif d.ray_address:
        try:
            ray.init(address=d.ray_address, namespace="regen", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:  # no cluster there, or a bad address
            raise UserError(f"distributed.ray_address={d.ray_address}: cannot join a Ray cluster "
                            f"({_first_error_line(e)}); start one with `ray start --head`, or set ray_address: null "
                            "for a private Ray on this machine") from None
    else:
        cpus = sum(count * res.get("num_cpus", 1) for count, res in actors(d))
        from regen.rewards.base import USER_PATHS

        # the actors import the user's reward modules from where the trainer does
        path = os.pathsep.join([*USER_PATHS, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
        ray.init(num_cpus=max(int(cpus + 0.999), os.cpu_count() or 1), include_dashboard=False, namespace="regen",
                 log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}} if path else None)
        _PRIVATE = ray.get_runtime_context().gcs_address
    short = [f"{k}: need {v:g}, the cluster has {h:g}" for k, v, h in _short(d, ray.cluster_resources())]
    if short:
        what = "rollout_workers / reward_workers or their resources" if d.trainer_workers == 1 else \
            "trainer_workers / rollout_workers or their resources" if d.group_sampling == "actors" else \
            "trainer_workers or trainer_resources"
        raise UserError("distributed: the Ray cluster cannot place the run's actors (" + "; ".join(short)
                        + f"); lower distributed.{what}")


_PRIVATE = None  # the address of the private Ray start_ray started in this process (a joined one is left alone)


def _short(d, have: dict) -> list[tuple[str, float, float]]:
    """(resource, what the run's actors need, what the cluster has) of each resource they need more of."""
    need: dict[str, float] = {}
    for count, res in actors(d):
        for k, v in res.items():
            key = {"num_cpus": "CPU", "num_gpus": "GPU"}.get(k, k)
            need[key] = need.get(key, 0) + count * v
    return [(k, v, have.get(k, 0)) for k, v in need.items() if v > have.get(k, 0)]


def actors(d) -> list[tuple[int, dict[str, float]]]:
    """(count, resources of one) of each kind of actor the run starts."""
    if d.trainer_workers > 1:  # a trainer group scores on its own ranks, and samples there or on rollout actors
        rollout = [(d.rollout_workers, d.rollout_resources)] if d.group_sampling == "actors" else []
        return [(d.trainer_workers, d.trainer_resources), *rollout]
    return [(d.rollout_workers, d.rollout_resources), (d.reward_workers, d.reward_resources)]


class ActorGroup:
    """k actors of one class; calls are retried on a replacement when an actor has died."""

    def __init__(self, cls, k: int, resources: dict, args: tuple, name: str, max_restarts: int, on_new=None):
        import ray

        opts = {"num_cpus": resources.get("num_cpus", 1), "num_gpus": resources.get("num_gpus", 0),
                "resources": {k: v for k, v in resources.items() if k not in ("num_cpus", "num_gpus")} or None}
        self.remote, self.opts, self.args, self.name = ray.remote(cls), opts, args, name
        self.max_restarts, self.on_new = max_restarts, on_new  # on_new(actor): bring a new actor up to date
        self.generation, self.restarts = 0, 0
        self.actors = [self._spawn(i) for i in range(k)]
        try:
            ray.get([a.ready.remote() for a in self.actors])
        except ray.exceptions.RayError as e:  # e.g. the model or a reward's package missing on a node
            raise UserError(f"{name} actors could not start: {_first_error_line(e)}") from None

    def _spawn(self, i: int):
        return self.remote.options(name=f"{self.name}-{i}-g{self.generation}", **self.opts).remote(*self.args)

    def call(self, i: int, method: str, *args):
        return getattr(self.actors[i], method).remote(*args)

    def get(self, refs: list, method: str, args: list[tuple], pin=None) -> list:
        """Results of refs[i] (a call of `method` with args[i] on actor i), in order; an actor
        that died is replaced and its call made again on the new one. pin(actor): bring the new
        actor to the state the lost call was made in (the weights of an older version), instead of
        on_new's current state; on_new's state follows once that call is done."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        out, tries = [], 0
        for i, ref in enumerate(refs):
            while True:
                try:
                    out.append(ray.get(ref))
                    break
                except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
                    tries += 1
                    self.restarts += 1
                    if tries > self.max_restarts:
                        raise RunStopped(f"{self.name} actors died {tries} times in one step (last: "
                                         f"{_first_error_line(e)}); see distributed.max_restarts") from None
                    self.generation += 1
                    self.actors[i] = self._spawn(i)
                    (pin or self.on_new or (lambda a: None))(self.actors[i])
                    ref = self.call(i, method, *args[i])
                    if pin is not None and self.on_new is not None:
                        self.on_new(self.actors[i])  # queued after the call: Ray runs an actor's calls in order
        return out

    def load(self, handles: list, version: int) -> None:
        """Have every actor load the weights in `handles` (object references, or bucket dicts) as
        `version`; not awaited: Ray runs an actor's calls in order, so its next sample sees them."""
        for i in range(len(self.actors)):
            self.call(i, "load_weights", handles, version)

    def drain(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) until every actor has run the calls queued to it."""
        import ray

        refs = [a.ready.remote() for a in self.actors]  # queued last: Ray runs an actor's calls in order
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


class RayRollouts:
    """The rollout side of the loop on Ray actors (see regen/placement/local.py for the interface)."""

    def __init__(self, modality, data: EpochSampler, prompts: list[PromptItem], cfg, version: int,
                 state: dict | None = None, name: str = "regen-rollout"):
        """state: the weights of the first sync (default: the modality's sync_state); name: the
        actors' name prefix (a trainer group's rank 0 adds the group's generation)."""
        import ray

        start_ray(cfg)
        d = cfg.distributed
        self.m, self.data, self.prompts, self.cfg = modality, data, prompts, cfg
        self.bound, self.version = d.max_staleness, version
        self.workers = ActorGroup(RolloutWorker, d.rollout_workers, d.rollout_resources,
                                  (for_actors(cfg), d.actor_threads), name, d.max_restarts,
                                  on_new=lambda a: ray.get(a.load_weights.remote(self._weights, self.version)))
        self._weights = None  # the object references a new actor loads, in order, for the current weights
        self._packer = Packer(getattr(torch, d.sync_dtype), int(d.sync_bucket_mb * 1e6), d.sync_changed_only)
        self._chain = Chain()
        self._collective = None  # distributed.sync=collective: the weight group (regen/placement/collective.py)
        self._by_version: dict[int, object] = {}  # the recent versions' weights, for replaced actors
        self._ahead = None  # (step, items, plan, refs, data and generator state before them, version)
        self._lag = self.discarded = 0
        self._unread: list = []  # the requests of the last batch requested ahead and then dropped
        try:
            if d.sync == "collective":
                from regen.placement.collective import CollectiveSync, backend_for

                self._collective = CollectiveSync(self.workers, backend_for(cfg), d.timeout_s, d.max_restarts)
            self.sync(version, state)
        except BaseException:
            self.workers.close()  # actors started for a run that does not start
            raise

    # -------------------------------------------------------------- loop API

    def next(self, step: int, gen: torch.Generator, again: bool = False):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (again or ahead[0] != step):  # not the batch asked for: give back what it took
            self._rewind(ahead)
            ahead = None
        _, items, plan, refs, _, version = ahead if ahead is not None else self._submit(step, gen, again)
        batch = self._collect(items, plan, refs, version)
        if self.version - int(batch.version.min()) > self.bound:  # too stale: sample again, current weights
            self.discarded += 1
            batch = self._collect(items, plan, self._requests(items, plan), self.version)
        self._lag = self.version - int(batch.version.min())
        if self.bound >= 1 and step < self.cfg.train.steps:  # the next batch overlaps this step's update
            self._ahead = self._submit(step + 1, gen)  # (at most one version behind); none past the last step
        return items, batch

    def sync(self, step: int, state: dict | None = None) -> dict[str, float]:
        """Push the weights (`state`, default the modality's sync_state) to every actor as version `step`."""
        import ray

        t0 = time.perf_counter()
        state = self.m.sync_state() if state is None else state
        buckets = self._packer.pack(state)
        # a replaced actor loads the chain through the object store on either path (its handles:
        # object references, or with a collective group the bucket dicts, which Ray sends as arguments)
        handles = buckets if self._collective else [ray.put(b) for b in buckets]
        self._weights = self._chain.add(handles, buckets)
        metrics = self._collective.send(buckets, step) if self._collective else self.workers.load(handles, step) or {}
        metrics |= {"sync/s": time.perf_counter() - t0, "sync/mb": nbytes(buckets) / 1e6,
                    "sync/buckets": float(len(buckets)), "sync/tensors": float(sum(map(len, buckets))),
                    "sync/unchanged": float(self._packer.skipped)}
        self.version = step
        self._by_version = {v: w for v, w in self._by_version.items() if v >= step - self.bound} | {step: self._weights}
        return metrics

    def stale(self, batch) -> bool:
        """Sampled with older weights than the trainer's (max_staleness >= 1): the update takes its
        ratio against the behaviour policy the actors returned with the batch."""
        return self.version - int(batch.version.min()) > 0

    def stats(self) -> dict[str, float]:
        return {"rollout/staleness": float(self._lag), "rollout/worker_restarts": float(self.workers.restarts),
                "rollout/stale_discarded": float(self.discarded)}

    def discard_prefetch(self) -> None:
        """Forget a batch requested ahead, and rewind the prompts and randomness it took, so a
        checkpoint written now resumes exactly where the loop is (it samples that batch again)."""
        if self._ahead is not None:
            self._rewind(self._ahead)
            self._ahead = None

    def close(self) -> None:
        """Stop the actors once they have taken the last weights sent (so a run ends with every
        actor holding its final weights, none killed mid-load; at most DRAIN_S), unless a batch
        nobody will read is still being sampled ahead of that load (a run stopped early): then at once."""
        import ray

        unread = [r for r in self._unread if r is not None]
        if not unread or len(ray.wait(unread, num_returns=len(unread), timeout=0)[0]) == len(unread):
            self.workers.drain(DRAIN_S)
        self.workers.close()
        if self._collective:
            self._collective.close()

    # -------------------------------------------------------------- helpers

    def _rewind(self, ahead) -> None:
        self._unread = ahead[3]  # its requests still run on the actors, ahead of any later call
        rewind(self.data, ahead[4])

    def _submit(self, step: int, gen: torch.Generator, again: bool = False):
        items, plan, before = draw(self.m, self.data, self.prompts, self.cfg, step, gen, again)
        return step, items, plan, self._requests(items, plan), before, self.version

    def _shares(self, items, plan) -> list[tuple]:
        n = self.cfg.rollout.group_size
        shares = torch.arange(len(items)).tensor_split(len(self.workers.actors))
        return [(self.m.inputs([items[g] for g in s.tolist()]), n, plan.select(group_rows(s, n)).cpu()) for s in shares]

    def _requests(self, items, plan) -> list:
        return [self.workers.call(i, "sample", *args) if args[0] else None
                for i, args in enumerate(self._shares(items, plan))]

    def _collect(self, items, plan, refs, version: int):
        """The batch of requests made when the actors held `version`: an actor that died is
        replaced and its share sampled again with that version's weights (not the newest), so
        the batch is the one it would have been."""
        import ray

        shares = self._shares(items, plan)
        live = [i for i, r in enumerate(refs) if r is not None]
        pin = None
        if version != self.version and version in self._by_version:
            pin = lambda a: ray.get(a.load_weights.remote(self._by_version[version], version))  # noqa: E731
        return self.m.concat(self.workers.get([refs[i] for i in live], "sample", [shares[i] for i in live], pin))


class RayReward:
    """The run's reward terms on reward actors; a drop-in for CombinedReward."""

    def __init__(self, cfg):
        start_ray(cfg)
        d = cfg.distributed
        self.workers = ActorGroup(RewardWorker, d.reward_workers, d.reward_resources,
                                  (for_actors(cfg), d.actor_threads), "regen-reward", d.max_restarts)

    def __call__(self, samples: list) -> tuple[list[float], dict[str, list[float]]]:
        shares = [(list(s),) for s in _split(samples, len(self.workers.actors))]
        refs = [self.workers.call(i, "score", *args) for i, args in enumerate(shares)]
        results = self.workers.get(refs, "score", shares)
        total = [x for t, _ in results for x in t]
        return total, {k: [x for _, p in results for x in p[k]] for k in results[0][1]}

    def versions(self) -> dict[str, str]:
        # through get(): an actor that died since the last scoring (it can, between two calls) is
        # replaced and asked again, as a scoring call would be, instead of failing the run
        return self.workers.get([self.workers.call(0, "versions")], "versions", [()])[0]

    def stats(self) -> dict[str, float]:
        return {"reward/worker_restarts": float(self.workers.restarts)}

    def close(self) -> None:
        self.workers.close()


def draw(m, data: EpochSampler, prompts: list[PromptItem], cfg, step: int, gen: torch.Generator, again: bool = False):
    """A step's prompts and plan (its randomness), and the sampler's and generator's state before
    them (for rewind). The one place a Ray placement draws, so a trainer group's ranks that do not
    drive the actors draw exactly what rank 0 does (regen/placement/ray_group.py)."""
    before = (data.state(), gen, gen.get_state())
    items = [prompts[i] for i in data.take(cfg.prompts_per_step)]
    return items, m.plan(gen, step, again), before


def rewind(data: EpochSampler, before: tuple) -> None:
    """Give back the draws of a batch requested ahead: the prompt sampler's and the generator's
    state from before them, `(data.state(), gen, gen.get_state())`."""
    data_state, gen, gen_state = before
    data.load_state(data_state)
    gen.set_state(gen_state)


def _split(xs: list, k: int) -> list[list]:
    idx = torch.arange(len(xs)).tensor_split(k)
    return [[xs[i] for i in part.tolist()] for part in idx]


def _first_error_line(e: BaseException) -> str:
    """The cause Ray reports, in one line (its messages carry whole remote tracebacks)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    causes = [ln for ln in lines if "Error" in ln and not ln.startswith(("File", "Traceback"))]
    return (causes[-1] if causes else lines[0] if lines else type(e).__name__)[:300]


def for_actors(cfg) -> dict:
    """The config tree the actors build from, with a local model.path made absolute (actors on
    other nodes see the same path on a shared filesystem; their working directory may differ)."""
    tree = cfg.model_dump(mode="json")
    path = tree["model"].get("path")
    if path and Path(path).expanduser().exists():
        tree["model"]["path"] = str(Path(path).expanduser().resolve())
    return tree
