"""Joint runs (config `models:`): several trained models in one run, with a dataflow between them.

The pipeline supported: a language model (the enhancer) rewrites each prompt, and a flow model
(the painter) draws each rewrite; one reward on the images trains both. Each entry of `models:`
holds the sections of one model (model, algorithm, rollout, flow, optim, train, critic, with the
keys of a single-model run) and its place in the run:

    feeds     the model that takes this model's samples as its prompts
    frozen    true: never trained (its weights stay as loaded)
    train_at  [[from, to], ...] steps (inclusive; to null = the end) in which it is trained;
              null = every step. Outside them it samples but is not updated (stage schedules).
    reward_against  user (default) | rewrite: for a model fed by another (the painter), whether
              its own advantage judges its images against the user's prompt or against the
              prompt it was given (the enhancer's rewrite). The run's reward, its metrics and the
              enhancer's advantage always judge against the user's prompt.

Everything else (run, data, reward, eval, checkpoint, health, log, train.steps, optim's schedule
and warm-up) is the run's, shared. Each model gets its own RLConfig here (`member_configs`),
validated with the rules of a single-model run, so a key its method does not read is refused
with the model's name in front of it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

SECTIONS = ("model", "algorithm", "rollout", "flow", "optim", "train", "critic")  # a model's own sections
OWN = ("feeds", "frozen", "train_at", "reward_against")
SHARED_TRAIN = ("steps",)  # train.* keys of the run, not of a model
SHARED_OPTIM = ("warmup_steps", "schedule")  # one learning-rate schedule, scaled to each model's optim.lr


def chain(models: dict[str, dict[str, Any]], kinds: dict[str, str]) -> list[str]:
    """The models in dataflow order (source first), or ValueError naming the field. kinds: name ->
    'lm' / 'flow'."""
    names = list(models)
    for name, spec in models.items():
        to = spec.get("feeds")
        if to is None:
            continue
        if to not in models:
            raise ValueError(f"models.{name}.feeds: unknown model '{to}' (models: {', '.join(names)})")
        if to == name:
            raise ValueError(f"models.{name}.feeds: a model cannot feed itself")
    for name in names:  # follow each chain: a cycle comes back to a model already seen
        seen, at = [name], models[name].get("feeds")
        while at is not None:
            if at in seen:
                raise ValueError(f"models.{name}.feeds: a cycle ({' -> '.join([*seen, at])})")
            seen.append(at)
            at = models[at].get("feeds")
    for name, spec in models.items():
        to = spec.get("feeds")
        if to is not None and kinds[name] == "flow" and kinds[to] == "lm":
            raise ValueError(f"models.{name}.feeds: {name} makes images, and {to} is a language model, which reads "
                             "text prompts")
    fed = {spec.get("feeds") for spec in models.values()} - {None}
    sources = [n for n in names if n not in fed]
    order = sources[:1]
    while len(sources) == 1 and models[order[-1]].get("feeds") is not None:
        order.append(models[order[-1]]["feeds"])
    if len(names) != 2 or len(order) != 2 or [kinds[n] for n in order] != ["lm", "flow"]:
        raise ValueError("models: the pipeline supported is two models, a language model that feeds a flow model "
                         "(models.ENHANCER.feeds: PAINTER); got " + ", ".join(
                             f"{n} ({kinds[n]}" + (f", feeds {models[n]['feeds']})" if models[n].get("feeds") else ")")
                             for n in names))
    if models[order[0]].get("reward_against", "user") != "user":
        raise ValueError(f"models.{order[0]}.reward_against: {order[0]} draws from the user's prompts, so it is always "
                         "judged against them; reward_against applies to the model it feeds "
                         f"(models.{order[1]}.reward_against)")
    if all(models[n].get("frozen") for n in names):
        raise ValueError("models: every model is frozen (models.NAME.frozen): nothing would be trained")
    return order


def check_spec(name: str, spec: Any) -> None:
    if not isinstance(spec, dict):
        raise ValueError(f"models.{name}: expected a mapping of sections (model, algorithm, ...), got "
                         f"{type(spec).__name__}")
    for key in spec:
        if key not in SECTIONS + OWN:
            raise ValueError(f"models.{name}.{key}: not a key of a model (a model has {', '.join(SECTIONS + OWN)}; "
                             "run, data, reward, eval, ... are the run's)")
    for key, shared in (("train", SHARED_TRAIN), ("optim", SHARED_OPTIM)):
        for k in spec.get(key) or {}:
            if k in shared:
                raise ValueError(f"models.{name}.{key}.{k}: set it once for the run ({key}.{k}), not per model")
    at = spec.get("train_at")
    if at is not None:
        ok = isinstance(at, list) and all(isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], int)
                                          and r[0] >= 1 and (r[1] is None or isinstance(r[1], int) and r[1] >= r[0])
                                          for r in at)
        if not ok:
            raise ValueError(f"models.{name}.train_at: a list of [from, to] step ranges (from >= 1, to >= from or "
                             f"null for the end), e.g. [[1, 100], [201, null]]; got {at!r}")
        if spec.get("frozen"):
            raise ValueError(f"models.{name}: frozen: true and train_at contradict each other; give one")
    against = spec.get("reward_against", "user")
    if against not in ("user", "rewrite"):
        raise ValueError(f"models.{name}.reward_against: 'user' or 'rewrite', got {against!r}")
    if against == "rewrite" and spec.get("frozen"):
        raise ValueError(f"models.{name}.reward_against: read only when {name} trains, and it is frozen "
                         "(remove reward_against, or set it to user, with frozen: true)")
    if not isinstance(spec.get("frozen", False), bool):
        raise ValueError(f"models.{name}.frozen: true or false, got {spec['frozen']!r}")


def trains_at(spec: dict, step: int) -> bool:
    """Whether the model of `spec` is trained at `step` (frozen / train_at)."""
    if spec.get("frozen"):
        return False
    at = spec.get("train_at")
    return at is None or any(a <= step and (b is None or step <= b) for a, b in at)


def kind_of(name: str, spec: dict) -> str:
    """'lm' or 'flow': what the model's algorithm.name trains."""
    from regen.config.registry import METHODS, online_methods

    method = (spec.get("algorithm") or {}).get("name", "grpo")
    if method not in online_methods():
        raise ValueError(f"models.{name}.algorithm.name: '{method}' is not an online method "
                         f"({', '.join(online_methods())})")
    return METHODS[method].modality


def group_sizes(models: dict) -> list[int]:
    """Each model's rollout.group_size (8 when not given)."""
    return [int((spec.get("rollout") or {}).get("group_size", 8)) for spec in models.values()]


def member_configs(cfg) -> dict[str, Any]:
    """Each model's RLConfig, in dataflow order: the run's shared sections with the model's own.
    Batch sizes follow the chain: the enhancer samples rollout.group_size rewrites of each prompt,
    the painter rollout.group_size images of each rewrite; the run's rollout.global_batch_size
    counts the final samples (images) of a step."""
    from regen.config import RLConfig

    models = cfg.models
    for name, spec in models.items():
        check_spec(name, spec)
    kinds = {name: kind_of(name, spec) for name, spec in models.items()}
    order = chain(models, kinds)
    shared = cfg.model_dump(mode="json", exclude={"models", "model", "algorithm", "flow", "critic"})
    prompts = cfg.prompts_per_step
    rows = prompts
    out = {}
    for name in order:
        spec = models[name]
        tree = {**shared, **{k: v for k, v in spec.items() if k in SECTIONS}}
        n = int((spec.get("rollout") or {}).get("group_size", 8))
        rows *= n
        rollout = {k: v for k, v in shared["rollout"].items() if k not in ("global_batch_size", "group_size")}
        tree["rollout"] = {**rollout, **(spec.get("rollout") or {}), "global_batch_size": rows}
        tree["train"] = {"steps": shared["train"]["steps"], **(spec.get("train") or {})}
        tree["optim"] = {**{k: shared["optim"][k] for k in SHARED_OPTIM}, **(spec.get("optim") or {})}
        try:
            member = RLConfig.model_validate(tree)
        except ValidationError as e:
            raise ValueError(f"models.{name}: " + "; ".join(_line(item) for item in e.errors())) from None
        unread = member.unread(_given(spec))
        if unread:
            raise ValueError(f"models.{name}: " + "; ".join(unread))
        if member.algorithm.dynamic_sampling:  # the loop refills a step's groups of one model only
            raise ValueError(f"models.{name}.algorithm.dynamic_sampling: not supported in a joint run (it would "
                             "resample the groups of one model of the pipeline)")
        out[name] = member
    return out


def _given(spec: dict) -> list[str]:
    from regen.config.load import leaf_keys

    return leaf_keys({k: v for k, v in spec.items() if k in SECTIONS})


def _line(item: dict) -> str:
    dotted = ".".join(str(x) for x in item["loc"])
    msg = item["msg"].removeprefix("Value error, ")
    if item["type"] == "extra_forbidden":
        return f"unknown key '{dotted}'"
    if item["type"] == "missing":
        return f"'{dotted}' is required"
    return f"{dotted}: {msg}" if dotted else msg
