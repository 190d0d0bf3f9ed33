"""User prompts for the shapes painter in words it was never trained on: the joint-training demo
(config `models:`; regen/modalities/joint.py).

The painter (the shapes flow model, regen/tasks/shapes.py) reads a bag of its own words: "a red
circle at the left". Users write "draw a crimson disc on the west side": synonyms the painter's
prompt encoder maps to <unk>, in phrasings it never saw. A tiny word-level enhancer language
model rewrites the user's prompt before the painter draws it. Its SFT teaches it the painter's
phrasing from paraphrases written in the painter's own words; where a synonym stands, its SFT
target is drawn at random, so which colour "crimson" is it can only learn from the painter's
images, through the reward.

Rows carry the attributes (colour, shape, position) so the `adherence` reward judges each image
against what the user asked. Held out for evaluation, in phrasings (templates) that training never uses (new
orders of the training phrasings' words): `phrasings`, the training attribute combinations, and
`test`, the 12 combinations the shapes task holds out.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from regen.data import Demo, PromptItem
from regen.tasks import shapes

SEED = 2718
SYNONYMS = {
    "red": ("crimson", "scarlet"), "green": ("emerald", "lime"), "blue": ("navy", "azure"),
    "yellow": ("golden", "lemon"),
    "circle": ("disc", "round"), "square": ("box", "block"), "triangle": ("wedge", "pyramid"),
    "left": ("west", "leftmost"), "right": ("east", "rightmost"), "top": ("north", "upper"),
    "bottom": ("south", "lower"), "centre": ("middle", "center"),
}
TRAIN_TEMPLATES = ("a {c} {s} at the {p}", "draw a {c} {s} on the {p} side", "{p} : one {c} {s}")
TEST_TEMPLATES = ("on the {p} side draw a {c} {s}", "one {c} {s} at the {p}")  # new orders of known words
END = "->"  # ends every user prompt: the enhancer's rewrite follows


def _text(template: str, c: str, s: str, p: str) -> str:
    return f"{template.format(c=c, s=s, p=p)} {END}"


def prompts(split_name: str) -> list[PromptItem]:
    """User prompts in synonyms.
    train: every training combination in each training phrasing, the synonyms drawn per row.
    test: the held-out combinations in the held-out phrasings, each with both synonyms of every word
      (new phrasings of combinations training never shows: what the enhancer's rewriting generalises to).
    phrasings: the training combinations in the held-out phrasings, the synonyms drawn per row; the
      first 48 rows hold each combination once (phrasings alternating), the next 48 each in its other
      phrasing (new phrasings of what training draws: where the painter's own learning counts too)."""
    train, test = shapes.split("image")
    if split_name == "phrasings":
        rng = random.Random(SEED + 2)
        rows = []
        for r in range(len(TEST_TEMPLATES)):
            for i, m in enumerate(train):
                words = [rng.choice(SYNONYMS[m[k]]) for k in ("colour", "shape", "position")]
                rows.append(PromptItem(_text(TEST_TEMPLATES[(i + r) % len(TEST_TEMPLATES)], *words), dict(m)))
        return rows
    rng = random.Random(SEED + (split_name == "test"))
    rows = []
    if split_name == "train":
        for m in train:
            for t in TRAIN_TEMPLATES:
                words = [rng.choice(SYNONYMS[m[k]]) for k in ("colour", "shape", "position")]
                rows.append(PromptItem(_text(t, *words), dict(m)))
        return rows
    for m in test:
        for t in TEST_TEMPLATES:
            for i in range(2):
                rows.append(PromptItem(_text(t, *(SYNONYMS[m[k]][i] for k in ("colour", "shape", "position"))),
                                       dict(m)))
    return rows


def demonstrations(noise: float = 0.5, known: Sequence[str] = ()) -> list[Demo]:
    """The enhancer's SFT: paraphrases in the painter's own words -> the painter's phrasing, one
    for every attribute combination and phrasing, and round(16 * noise) more of each (noise: the
    task.demo_noise of `regen sft`) in which each attribute word is, with probability 1/2, a
    synonym of a uniformly drawn value and the target's attribute another uniformly drawn value:
    the enhancer learns the painter's phrasing, and that a synonym says nothing it knows (too many
    random targets to memorise), so it guesses evenly where one stands. That is its exploration;
    which synonym means which word it can only learn from the painter's images, through the reward.
    known (task.known_synonyms): attributes whose synonym, where one stands, is of the true value
    and keeps the true target, so only the others' meaning is left to RL."""
    rng = random.Random(SEED + 7)
    choices = {"colour": list(shapes.COLOURS), "shape": list(shapes.SHAPES), "position": list(shapes.POSITIONS)}
    demos = []
    for m in shapes._all("image"):
        for t in TRAIN_TEMPLATES:
            demos.append(Demo(_text(t, m["colour"], m["shape"], m["position"]), " " + shapes.prompt_text(m), dict(m)))
            for _ in range(round(16 * noise)):
                words, target = dict(m), dict(m)
                for k in words:
                    if rng.random() < 0.5:
                        if k in known:
                            words[k] = rng.choice(SYNONYMS[m[k]])
                        else:
                            words[k] = rng.choice(SYNONYMS[rng.choice(choices[k])])
                            target[k] = rng.choice(choices[k])
                demos.append(Demo(_text(t, words["colour"], words["shape"], words["position"]),
                                  " " + shapes.prompt_text(target), dict(m)))
    return demos


def vocabulary() -> list[str]:
    words = {"a", "at", "the", END, *shapes.COLOURS, *shapes.SHAPES, *shapes.POSITIONS}
    words |= {w for syn in SYNONYMS.values() for w in syn}
    for t in TRAIN_TEMPLATES + TEST_TEMPLATES:
        words |= {w for w in t.split() if not w.startswith("{")}
    return sorted(words)


def build_model(seed: int):
    """A word-level GPT-2 (2 layers, width 64) over the painter's words, the synonyms and the
    phrasings' words, from random init, and its tokenizer (saved / loaded like any hub model)."""
    from regen.tasks.tiny_models import tiny_gpt2, wordlevel_tokenizer

    tok = wordlevel_tokenizer(vocabulary(), per_character=False)
    return tiny_gpt2(tok, seed, n_positions=32, n_embd=64, n_layer=2), tok


# builtin:shapes-paraphrase (regen/data BUILTIN)
def builtin_prompts(split_name: str, task) -> list[PromptItem]:
    return prompts(split_name)


def builtin_demos(task) -> list[Demo]:
    return demonstrations(task.demo_noise, task.known_synonyms)
