"""The key reference, one source for two readers: `regen train|sft|rm --help-config` in the
terminal and docs/config.md (written by scripts/config_reference.py; a test fails when the
committed page differs from the schema). Every row is a leaf key with its type, default,
description and, for `regen train`, the methods that read it (regen/config/reads.py)."""

from __future__ import annotations

import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from regen.config.reads import readers
from regen.config.registry import METHODS


@dataclass(frozen=True)
class Row:
    key: str  # dotted: model.lora.r; NAME stands for a user-chosen entry name (tasks.NAME.train)
    type: str  # as a user writes it: int, float | null, 'grpo' | 'ppo', list[...], section
    default: str  # repr of the default, or (required)
    description: str


def type_name(ann) -> str:
    """An annotation as a user reads it: `Literal['a', 'b'] | None` -> "'a' | 'b' | null"."""
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args if a is not Ellipsis) + (", ...]" if Ellipsis in args else "]")
    if origin is dict:
        return f"map of {type_name(args[1])}" if args else "map"
    if origin is typing.Annotated:
        return type_name(args[0])
    if ann is typing.Any:
        return "any"
    if ann is Path:
        return "path"
    return getattr(ann, "__name__", str(ann))


def rows(kind: type[BaseModel], prefix: str = "") -> list[Row]:
    """Every leaf key of a config class. A section that is off by default (model.lora, log.wandb,
    ...) is listed itself and then with its own keys; a mapping of named sections (tasks, models)
    with the keys of one entry under NAME."""
    out = []
    for name, field in kind.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(rows(ann, key + "."))
            continue
        default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
        extra = field.json_schema_extra or {}
        if extra.get("choices") == "methods":  # algorithm.name: the registered methods, each in a clause
            out.append(Row(key, " | ".join(repr(n) for n in METHODS), default, f"{field.description} " + ", ".join(
                f"'{n}' ({m.summary})" for n, m in METHODS.items()) + "."))
            continue
        out.append(Row(key, type_name(ann), default, field.description or ""))
        section = _optional_section(ann)
        if section is not None:  # its keys, e.g. model.lora.r: set them as model.lora={r: 8, ...}
            out.extend(Row(r.key, r.type, r.default, f"{r.description} (inside {key})")
                       for r in rows(section, key + "."))
        named = _named_sections(ann)
        if named is not None:  # a mapping of name -> section (tasks): the keys of each entry
            out.extend(Row(r.key, r.type, r.default, f"{r.description} (each entry of {key})")
                       for r in rows(named, key + ".NAME."))
    return out


def describe(kind: type[BaseModel]) -> list[tuple[str, str, str]]:
    """(dotted key, default, description) of every leaf key."""
    return [(r.key, r.default, r.description) for r in rows(kind)]


def _named_sections(ann) -> type[BaseModel] | None:
    """The section class of a `dict[str, Section] | None` field, else None."""
    for arg in getattr(ann, "__args__", ()):
        if getattr(arg, "__origin__", None) is dict:
            value = arg.__args__[1]
            return value if isinstance(value, type) and issubclass(value, BaseModel) else None
    return None


def _optional_section(ann) -> type[BaseModel] | None:
    """The section class of a `Section | None` field, else None."""
    args = getattr(ann, "__args__", ())
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and type(None) in args else None


def read_by(key: str) -> str:
    """'grpo, ppo' (or 'every method'): the methods (algorithm.name) that read a `regen train` key."""
    who = readers(key)
    return "every method" if len(who) == len(METHODS) else ", ".join(who) or "no method"


def _verbs():
    from regen.config import RLConfig, RMConfig, SFTConfig

    return [("regen train", RLConfig, "online RL (and DPO with `algorithm.name: dpo`), for every modality"),
            ("regen sft", SFTConfig, "supervised fine-tuning: language models, and flow-matching pretraining"),
            ("regen rm", RMConfig, "reward-model training on preference pairs")]


def help_text(kind: type[BaseModel]) -> str:
    """The `--help-config` output of the verb whose config class is `kind`."""
    from regen.config import RLConfig

    table = rows(kind)
    width = max(len(r.key) for r in table)
    lines = []
    if kind is RLConfig:
        lines += ["Each key says which methods (algorithm.name) read it; setting a key the chosen method does not "
                  "read is an error.", ""]
    for r in table:
        lines.append(f"{r.key:<{width}}  {r.type} = {r.default}")
        desc = f"{r.description} [read by: {read_by(r.key)}]" if kind is RLConfig else r.description
        if desc:
            lines.append(textwrap.indent(textwrap.fill(desc, 88), " " * (width + 2)))
    return "\n".join(lines)


def markdown() -> str:
    """docs/config.md: one table per verb, the same rows as `--help-config`."""
    from regen.config import RLConfig

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = ["# Configuration reference", "",
           "Every key of every verb's config: its type, default and meaning, and for `regen train` the methods",
           "(`algorithm.name`) that read it. Setting a key the chosen method does not read is an error, so no",
           "setting is accepted and silently ignored. Keys are set in the YAML file or as `key.sub=value`",
           "overrides on the command line ([settings](your-model-data-reward.md#settings-a-yaml-file-and-keyvalue-overrides));",
           "`regen VERB --help-config` prints the same table in the terminal.", "",
           "This page is generated from the config schema by `python scripts/config_reference.py`; do not edit",
           "it by hand.", ""]
    out += [f"- [`{verb}`](#{verb.replace(' ', '-')}): {what}" for verb, _, what in _verbs()]
    for verb, kind, what in _verbs():
        out += ["", f"## {verb}", "", f"{what[0].upper()}{what[1:]}.", ""]
        train = kind is RLConfig
        out += ["| key | type | default | description |" + (" read by |" if train else ""),
                "|---|---|---|---|" + ("---|" if train else "")]
        for r in rows(kind):
            line = f"| `{r.key}` | {cell(r.type)} | `{cell(r.default)}` | {cell(r.description)} |"
            out.append(line + (f" {read_by(r.key)} |" if train else ""))
    return "\n".join(out) + "\n"
