"""Multiplication with a calculator tool: the built-in task of the tool-use demo (scripts/demo_tools.sh).

Prompts "1234*5678=" ask for a product of two task.digits-digit numbers, which a model of a
million parameters cannot compute in its head but can get from the `calc` tool:

    1234*5678=<tool_call>{"name":"calc","arguments":{"expression":"1234*5678"}}</tool_call><eos>
    <tool_response>7006652</tool_response>7006652<eos>

(the model's turns are the tool call and the final answer; the tool response is the tool
environment's observation, regen/envs/tools.py). The demonstrations use the tool imperfectly:
a share task.demo_noise of them skips it (writing the answer directly) or misuses it (a typo in
an operand, then the wrong result copied), so the SFT base calls the tool only sometimes and
RL has to learn that calling it, and copying its answer, is what pays. builtin:calc-notool gives
the same prompts with direct answers: the baseline trained without tools.
"""

from __future__ import annotations

import ast
import json
import operator
import random

from regen.data import Demo, PromptItem
from regen.tasks.tiny_models import tiny_gpt2, wordlevel_tokenizer

SPLIT_SEED = 4321  # fixed: the held-out set must not depend on run.seed
TRAIN_SIZE = 20000
CHARS = [chr(c) for c in range(32, 127)]  # printable ASCII: tool calls are JSON


def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression (+, -, *, // and parentheses).

    Args:
        expression: e.g. "1234*5678"
    """
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only integers with + - * // and parentheses")

    if len(expression) > 64:
        raise ValueError("expression longer than 64 characters")
    return str(ev(ast.parse(expression, mode="eval").body))


def tool_call(expression: str) -> str:
    """The Hermes-form call the demonstrations write (compact JSON: fewer tokens to write)."""
    body = json.dumps({"name": "calc", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def split(digits: int, test_size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, test) pairs, disjoint, fixed by SPLIT_SEED. Half of each have the shorter product
    (2*digits - 1 digits: 17% of uniform four-digit pairs), so copying the tool's answer has to
    work for both lengths: trained on 17%, the model copies only the usual length."""
    from regen.errors import ConfigError

    rng = random.Random(SPLIT_SEED)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    space = (hi - lo + 1) ** 2
    if test_size >= space // 4:
        raise ConfigError(f"task.test_size: {test_size} held-out pairs leave too few of the {space} "
                          f"{digits}-digit pairs to train on (at most {space // 4 - 1})")
    want = min(TRAIN_SIZE + test_size, space // 4)
    seen, short, long_ = set(), [], []
    while min(len(short), len(long_)) < (want + 1) // 2 and len(seen) < space // 2:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) not in seen:
            seen.add((a, b))
            (short if a * b < 10 ** (2 * digits - 1) else long_).append((a, b))
    pairs = [p for pair in zip(short, long_) for p in pair][:want]
    return pairs[test_size:], pairs[:test_size]


def prompts(split_name: str, digits: int, test_size: int) -> list[PromptItem]:
    train, test = split(digits, test_size)
    return [PromptItem(f"{a}*{b}=", {"answer": str(a * b)}) for a, b in (train if split_name == "train" else test)]


def demonstrations(digits: int, test_size: int, noise: float, tools: bool = True) -> list[Demo]:
    """Two-turn demonstrations as (text, trained) pieces: the call and the answer are trained on,
    the prompt and the tool's response are context. A share `noise` skips or misuses the tool."""
    rng = random.Random(SPLIT_SEED + 1)
    demos = []
    for a, b in split(digits, test_size)[0]:
        prompt, answer = f"{a}*{b}=", str(a * b)
        meta = {"answer": answer}
        r = rng.random()
        if not tools or r < noise / 2:  # answers in its head: the right digits, which it cannot learn to compute
            demos.append(Demo(prompt, answer, meta, segments=[(prompt, False), (answer + "<eos>", True)]))
            continue
        expr = f"{a}*{b}"
        if r < noise:  # a typo in one operand: the tool answers another question, and that answer is copied
            digits_ = list(expr)
            i = rng.choice([j for j, c in enumerate(digits_) if c.isdigit() and j != 0 and digits_[j - 1] != "*"])
            digits_[i] = str((int(digits_[i]) + rng.randint(1, 9)) % 10)
            expr = "".join(digits_)
        result = calc(expr)
        demos.append(Demo(prompt, result, meta, segments=[
            (prompt, False), (tool_call(expr) + "<eos>", True),
            (f"<tool_response>{result}</tool_response>", False), (result + "<eos>", True)]))
    return demos


def build_tokenizer():
    """Character-level fast tokenizer over printable ASCII; <eos> etc. are whole tokens."""
    return wordlevel_tokenizer(CHARS, per_character=True)


def build_model(seed: int):
    """A ~0.8M-parameter GPT-2 (4 layers, width 128) from random init: enough to copy operands into
    a call and the tool's answer out of it, far too small to multiply four-digit numbers."""
    tok = build_tokenizer()
    return tiny_gpt2(tok, seed, n_positions=256, n_embd=128, n_layer=4), tok


# builtin:calc / builtin:calc-notool (regen/data BUILTIN): the config's task section gives the sizes
def builtin_prompts(split_name: str, task) -> list[PromptItem]:
    return prompts(split_name, task.digits, task.test_size)


def builtin_demos(task) -> list[Demo]:
    return demonstrations(task.digits, task.test_size, task.demo_noise)


def builtin_demos_notool(task) -> list[Demo]:
    return demonstrations(task.digits, task.test_size, task.demo_noise, tools=False)
