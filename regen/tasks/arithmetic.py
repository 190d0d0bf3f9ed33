"""Synthetic addition: prompts "a+b=", answers the decimal sum, held-out split, noisy demos.

The split is drawn with a fixed task seed (not the run seed) so that an SFT run and the RL
run after it agree on which prompts are held out. The base model is a real transformers
class (GPT-2) with a character vocabulary, built from a tiny config and saved/loaded through
`save_pretrained` / `from_pretrained` like any hub model.
"""

from __future__ import annotations

import random

from regen.data import Demo, PrefPair, PromptItem
from regen.tasks.tiny_models import tiny_gpt2, wordlevel_tokenizer

SPLIT_SEED = 1234  # fixed: the held-out set must not depend on run.seed
CHARS = list("0123456789+=")


def all_pairs(digits: int) -> list[tuple[int, int]]:
    n = 10**digits
    return [(a, b) for a in range(n) for b in range(n)]


def split(digits: int, test_size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = all_pairs(digits)
    if test_size >= len(pairs):
        from regen.errors import ConfigError

        raise ConfigError(f"task.test_size={test_size} leaves no training prompts ({len(pairs)} pairs in all)")
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs[test_size:], pairs[:test_size]


def prompt_of(a: int, b: int) -> PromptItem:
    return PromptItem(prompt=f"{a}+{b}=", meta={"answer": str(a + b)})


def prompts(split_name: str, digits: int, test_size: int) -> list[PromptItem]:
    train, test = split(digits, test_size)
    return [prompt_of(a, b) for a, b in (train if split_name == "train" else test)]


def demonstrations(digits: int, test_size: int, noise: float) -> list[Demo]:
    """One demonstration per training prompt; a fraction `noise` of them has a wrong answer.

    Corrupted answers are uniform over the range of possible sums (never the true sum), so
    the SFT model learns the right algorithm but spreads probability over wrong answers:
    decent greedy accuracy, much lower accuracy when sampled, and room for RL to sharpen it.
    """
    rng = random.Random(SPLIT_SEED + 1)
    top = 2 * 10**digits - 1
    demos = []
    for a, b in split(digits, test_size)[0]:
        answer = a + b
        if rng.random() < noise:
            wrong = rng.randrange(top)
            answer = wrong if wrong < answer else wrong + 1
        demos.append(Demo(prompt=f"{a}+{b}=", completion=str(answer), meta={"answer": str(a + b)}))
    return demos


def preference_pairs(split_name: str, digits: int, test_size: int) -> list[PrefPair]:
    """One pair per prompt of the split: chosen = the true sum, rejected = a uniformly drawn
    wrong sum (the same kind of error as the noisy demonstrations)."""
    rng = random.Random(SPLIT_SEED + 2)
    top = 2 * 10**digits - 1
    train, test = split(digits, test_size)
    pairs = []
    for a, b in train if split_name == "train" else test:
        wrong = rng.randrange(top)
        wrong = wrong if wrong < a + b else wrong + 1
        pairs.append(PrefPair(f"{a}+{b}=", str(a + b), str(wrong), {"answer": str(a + b)}))
    return pairs


def build_tokenizer():
    """Character-level fast tokenizer that round-trips through AutoTokenizer."""
    return wordlevel_tokenizer(CHARS, per_character=True)


def build_model(seed: int, digits: int = 2):
    """A ~0.4M-parameter GPT-2 (2 layers, width 128, 4 heads) from random init, and its tokenizer."""
    tok = build_tokenizer()
    max_len = 2 * digits + 2 + digits + 2 + 8  # prompt + answer + EOS, with slack for longer sampling
    return tiny_gpt2(tok, seed, n_positions=max(32, max_len), n_embd=128, n_layer=2), tok


# builtin:arithmetic (regen/data BUILTIN): the config's task section gives the sizes
def builtin_prompts(split_name: str, task) -> list[PromptItem]:
    return prompts(split_name, task.digits, task.test_size)


def builtin_demos(task) -> list[Demo]:
    return demonstrations(task.digits, task.test_size, task.demo_noise)


def builtin_pairs(split_name: str, task) -> list[PrefPair]:
    return preference_pairs(split_name, task.digits, task.test_size)
