"""The one registration of each method and each modality, which everything else consults.

A method (an `algorithm.name`) is declared once, as a `Method`: the modality it trains, the
config keys it reads beyond its modality's (with their conditions), its defaults and its own
checks, and where its code is. Config validation, the reads check and `--help-config`
(regen/config/reads.py, reference.py) and the modality adapters (which load `impl`) all read
the same declaration; adding a method is its code and one `register_method` call.

A modality (a kind of model: "lm", "flow") is declared once, as a `Modality`: its adapter (the
protocol of regen/modalities/base.py), the keys every one of its methods reads, and its name
in messages. A modality from outside regen (a test's toy, a user's package) registers the same
way and trains through the same loop.

Declarations hold no torch: the CLI validates a config without importing a model library;
`impl` and `adapter` are "module:attribute" strings, imported when a run starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Read:
    """A config key (a dotted prefix: "critic" covers every critic.* key) that a method reads,
    and, for keys read only in some settings, the condition: the text shown to the user and
    a predicate on the config."""

    key: str
    when: str = ""  # "" = always; else the setting it needs, as shown to the user
    test: Callable | None = None  # cfg -> bool, with `when`


def always(*keys: str) -> list[Read]:
    return [Read(k) for k in keys]


def when(text: str, test: Callable, *keys: str) -> list[Read]:
    return [Read(k, text, test) for k in keys]


@dataclass(frozen=True)
class Method:
    name: str
    modality: str  # a registered Modality's name
    summary: str  # one clause of the algorithm.name help
    reads: tuple[Read, ...] = ()  # beyond what every online method and its modality read
    online: bool = True  # False: trained offline on a dataset (dpo), its reads are all it reads
    clip: tuple[float, float] | None = None  # algorithm.clip_low / clip_high when left null
    stochastic: bool = False  # flow: trained on stochastic (SDE) sampling steps, not clean ODE samples
    check: Callable | None = None  # cfg -> error text or None: the method's own settings checks
    uses_base: Callable | None = None  # cfg -> bool: keeps a frozen copy of the starting model
    uses_ema: Callable | None = None  # cfg -> bool: keeps an EMA copy (an old policy / anchor)
    impl: str | None = None  # "module:Class": the method's code, for its modality's adapter

    def needs(self, what: str, cfg) -> bool:
        fn = getattr(self, what)
        return bool(fn and fn(cfg))


@dataclass(frozen=True)
class Modality:
    name: str
    label: str  # "language models": how messages name what it trains
    adapter: str  # "module:Class" implementing regen/modalities/base.py's protocol
    reads: tuple[Read, ...] = ()  # what every method of the modality reads


METHODS: dict[str, Method] = {}
MODALITIES: dict[str, Modality] = {}


def register_method(m: Method) -> Method:
    """Add a method; the same name twice is refused unless it is the same declaration."""
    if METHODS.get(m.name, m) != m:
        raise ValueError(f"method '{m.name}' is already registered (by {METHODS[m.name].impl})")
    if m.modality not in MODALITIES:
        raise ValueError(f"method '{m.name}': modality '{m.modality}' is not registered "
                         f"({', '.join(MODALITIES)}); register the modality first")
    METHODS[m.name] = m
    return m


def register_modality(k: Modality) -> Modality:
    if MODALITIES.get(k.name, k) != k:
        raise ValueError(f"modality '{k.name}' is already registered (adapter {MODALITIES[k.name].adapter})")
    MODALITIES[k.name] = k
    return k


def method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"algorithm.name: unknown method '{name}' (one of {', '.join(METHODS)})") from None


def online_methods() -> list[str]:
    return [n for n, m in METHODS.items() if m.online]


def load(ref: str):
    """The object a "module:attribute" declaration names."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
