"""Reading config trees: YAML + dotted overrides, validation with errors that name the field,
secret redaction and the resume compatibility check (the key reference: reference.py)."""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from regen.errors import ConfigError

SECRET_WORDS = ("token", "secret", "password", "api_key", "apikey", "credential")


def holds_credentials(url: str) -> bool:
    """`user:password@` or a secret-looking query parameter (token=, api_key=, ...)."""
    from urllib.parse import parse_qsl, urlsplit

    p = urlsplit(url)
    return "@" in p.netloc or any(w in k.lower() for k, _ in parse_qsl(p.query) for w in (*SECRET_WORDS, "key"))


def parse_overrides(items: list[str]) -> list[tuple[list[str], Any]]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML, so `8` is an int and `[1,2]` a list)."""
    parsed = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override '{item}' is not of the form key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': value is not valid YAML ({e.problem})") from None
        parsed.append((key.split("."), value))
    return parsed


def apply_override(tree: dict, path: list[str], value: Any, where: str) -> None:
    node: Any = tree
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            node = node[_list_index(node, part, path[: i + 1], where)]
            continue
        if not isinstance(node.get(part, {}), (dict, list)):
            raise ConfigError(f"{where}: '{'.'.join(path[: i + 1])}' is a value, not a section")
        node = node.setdefault(part, {})
    last = path[-1]
    if isinstance(node, list):
        node[_list_index(node, last, path, where)] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, path: list[str], where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"{where}: '{'.'.join(path)}': index {part} out of range (list has {len(node)} items)")
    return int(part)


def load_config(kind: type[BaseModel], path: str | None, overrides: list[str] = (),
                refuse_unread: bool = True) -> BaseModel:
    """Read YAML (optional), apply `key=value` overrides, validate; raise ConfigError with field names.
    refuse_unread: a key the chosen method does not read is an error (RLConfig). Off, the file is
    read back as a run's own config.yaml: one written by an older regen held every key, and moved
    keys under their old names (config/methods.py migrate)."""
    tree: dict = {}
    source = "defaults"
    if path is not None:
        source = path
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' not found")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file '{path}'{at}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file '{path}': top level must be a mapping of sections")
    if not refuse_unread:
        from regen.config.methods import migrate

        tree = migrate(tree)
    given = set(leaf_keys(tree))
    tree = _merge(_defaults(kind), tree)
    for keys, value in parse_overrides(list(overrides)):
        apply_override(tree, keys, value, f"override '{'.'.join(keys)}'")
        given |= set(leaf_keys(value, _until_list(keys)))
    try:
        cfg = kind.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, kind, source)) from None
    refuse = getattr(cfg, "unread", None) if refuse_unread else None  # RLConfig: keys the method would ignore
    problems = refuse(given) if refuse is not None else []
    if problems:
        raise ConfigError(f"invalid config ({source}): " + "; ".join(problems))
    return cfg


def leaf_keys(value: Any, path: list[str] = ()) -> list[str]:
    """The dotted keys a user tree sets: mappings are walked, anything else (values, lists) is one key."""
    if isinstance(value, dict) and value:
        return [k for name, v in value.items() for k in leaf_keys(v, [*path, str(name)])]
    return [".".join(path)] if path else []


def _until_list(keys: list[str]) -> list[str]:
    """An override's key up to the list it indexes ('reward.0.weight' sets 'reward')."""
    for i, part in enumerate(keys):
        if part.isdigit():
            return keys[:i]
    return keys


def _defaults(kind: type[BaseModel]) -> dict:
    """The default values of every section that has them, as a plain tree (so that an
    override such as `reward.0.weight=2` can address a default list item)."""
    tree = {}
    for name, field in kind.model_fields.items():
        if field.is_required():
            continue
        value = field.get_default(call_default_factory=True)
        if value is None:  # left out, so that dotted overrides can fill it (model.path=..., models.a.feeds=...)
            continue
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        elif isinstance(value, list):
            value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
        tree[name] = value
    return tree


def _merge(base: Any, top: Any) -> Any:
    """Mappings merge key by key; anything else (values, lists) in `top` replaces `base`."""
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for k, v in top.items():
            out[k] = _merge(base.get(k), v) if k in base else v
        return out
    return top


def format_validation_error(err: ValidationError, kind: type[BaseModel], source: str) -> str:
    lines = []
    for item in err.errors():
        loc = [str(x) for x in item["loc"]]
        dotted = ".".join(loc) or "(top level)"
        if item["type"] == "extra_forbidden":
            hint = _closest_key(kind, loc)
            lines.append(f"unknown key '{dotted}'" + (f" (did you mean '{hint}'?)" if hint else ""))
        elif item["type"] == "missing":
            lines.append(f"'{dotted}' is required")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            got = "" if item["type"] == "value_error" else f" (got {item.get('input')!r})"
            lines.append(f"{dotted}: {msg}{got}" if loc else msg)
    head = f"invalid config ({source}): "
    return head + ("; ".join(lines))


def _closest_key(kind: type[BaseModel], loc: list[str]) -> str | None:
    """Walk the model classes along `loc` and suggest the nearest valid key for its last part."""
    model: Any = kind
    for part in loc[:-1]:
        if part.isdigit():
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        for cand in (ann, *getattr(ann, "__args__", ())):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                model = cand
                break
        else:
            return None
    names = list(getattr(model, "model_fields", {}))
    match = [ALIASES[loc[-1]]] if ALIASES.get(loc[-1]) in names else \
        difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
    return ".".join([*loc[:-1], match[0]]) if match else None


# Names other libraries use for a key of ours, too unlike it for a spelling match (peft's LoRA
# settings, TRL's and OpenRLHF's names).
ALIASES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target": "target_modules",
           "beta": "kl_coef", "epsilon": "clip_low", "epsilon_high": "clip_high", "num_generations": "group_size",
           "max_completion_length": "max_new_tokens", "learning_rate": "lr", "num_train_epochs": "ppo_epochs"}


# Settings a resumed run may change freely: they do not alter what the run computes.
# run.dir: the run resumed is the one in that folder, whatever path names it (./runs/x, an
# absolute path, the folder after a move).
RESUME_FREE = ("train.steps", "run.overwrite", "run.device", "run.threads", "run.dir", "checkpoint.", "log.",
               "eval.", "health.", "mirror.", "distributed.")


def incompatible_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config trees, outside RESUME_FREE,
    as 'key: old -> new'. Keys that no longer exist are not compared."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if key not in current:
            continue  # a setting this version no longer has
        dotted = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += incompatible_changes(a, b, dotted + ".")
        # "<redacted>" cannot be compared (checkpoints written before max_new_tokens stopped being redacted)
        elif a != b and not dotted.startswith(RESUME_FREE) and "<redacted>" not in (a, b):
            out.append(f"{dotted}: {a!r} -> {b!r}")
    return out


def config_hash(tree: dict) -> str:
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def redact(tree: Any) -> Any:
    """Copy of a config tree with values of secret-looking keys replaced (never written to disk)."""
    if isinstance(tree, dict):
        return {k: ("<redacted>" if _secret(str(k), v) and v else redact(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    return tree


def _secret(key: str, value: Any) -> bool:
    # 'max_new_tokens: 8' counts tokens: a number under a '...tokens' key is no credential (and
    # redacting it made config.yaml unloadable); 'auth_tokens: [...]' still is one
    k = key.lower()
    if any(w in k.replace("tokens", "") for w in SECRET_WORDS):
        return True
    return "tokens" in k and not isinstance(value, (int, float))


def resolved_tree(cfg: BaseModel) -> dict:
    """The resolved config as written to config.yaml and printed by --print-config: for RL runs
    only the keys the chosen method reads (regen/config/reads.py), so it reloads as it is."""
    tree = cfg.model_dump(mode="json")
    read_only = getattr(cfg, "read_tree", None)
    return read_only(tree) if read_only is not None else tree


def dump_config(cfg: BaseModel, path: Path) -> None:
    path.write_text(yaml.safe_dump(redact(resolved_tree(cfg)), sort_keys=False))
