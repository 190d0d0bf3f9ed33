"""`math_equal`: a verifiable math reward. The completion's final answer is compared with the
row's answer by mathematical equivalence (math-verify: LaTeX and plain expressions parsed with
sympy, so 1/2, 0.5, \\frac{2}{4} and 50% agree), not by string.

Which part of the text is the answer:
  reference   the row's `answer` field; GSM8K's "reasoning #### 42" keeps what follows the last ####
  completion  what follows the last "####" if any; else the last \\boxed{...}; else the last number;
              else the whole text
A completion with no parsable answer scores 0.0; a row without an answer is missing (None).

Sympy can take unbounded time on a pathological expression (a model can write 9^9^9^9), so each
check runs in a worker process and is abandoned after `timeout_s`: the worker is killed and a
new one started for the next sample. A timed-out sample is missing by default (its score could
not be obtained, so it is left out of the advantage: see the design's "missing, never zero");
on_timeout: zero scores it 0.0 instead.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import threading

from regen.errors import ConfigError
from regen.rewards.base import Sample, register

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\.\d+")
STARTUP_S = 60.0  # a fresh worker imports sympy first: seconds, not the per-check budget
TIMEOUT = object()


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


def final_answer(text: str) -> str:
    """The part of a completion that states its answer (see the module doc)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else text.strip()


class _Worker:
    """One checking process (regen/rewards/math_worker.py); killed and replaced when a check
    overruns its budget."""

    def __init__(self):
        self.proc = None
        self.lock = threading.Lock()  # the reward service may call from several threads

    def _read(self, timeout_s: float):
        """The worker's next JSON line, or TIMEOUT."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return TIMEOUT
        line = self.proc.stdout.readline()
        if not line:  # the worker died (out of memory...)
            return TIMEOUT
        return json.loads(line)

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "regen.rewards.math_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        first = self._read(STARTUP_S)
        if first != "ready":
            self.kill()
            why = first.get("error") if isinstance(first, dict) else "it did not start"
            raise ConfigError(f"math_equal: the checking process failed ({why}); it needs math-verify: "
                              "pip install 'regen[math]'")

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(5)
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
        self.proc = None

    def check(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        """True / False, or None when the check did not finish in timeout_s."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            try:
                self.proc.stdin.write(json.dumps([gold, pred]) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                self.kill()
                return None
            got = self._read(timeout_s)
            if got is TIMEOUT:
                self.kill()
                return None
            return bool(got)


@register("math_equal", version="1", kind="binary", factory=True)
class MathEqual:
    """1.0 when the completion's final answer equals the row's answer mathematically (math-verify), else 0.0.

    args: field ('answer'), timeout_s (5.0 per sample), on_timeout ('missing' or 'zero').
    Final answer: after the last ####, else the last \\boxed{}, else the last number. A row
    without the field is missing. Needs `pip install 'regen[math]'`.
    """

    def __init__(self, field: str = "answer", timeout_s: float = 5.0, on_timeout: str = "missing"):
        if on_timeout not in ("missing", "zero"):
            raise ConfigError(f"math_equal: args.on_timeout '{on_timeout}': 'missing' or 'zero'")
        if not timeout_s > 0:
            raise ConfigError(f"math_equal: args.timeout_s must be more than 0, got {timeout_s}")
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise ConfigError("math_equal needs math-verify: pip install 'regen[math]'") from None
        self.field, self.timeout_s, self.on_timeout = field, float(timeout_s), on_timeout
        self.worker = _Worker()
        self.timeouts = 0  # checks abandoned so far (a test and the curious can read it)

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in samples:
            ref = s.meta.get(self.field)
            if ref is None:
                out.append(None)
                continue
            gold = str(ref)
            gold = gold.rsplit("####", 1)[1].strip() if "####" in gold else gold.strip()
            ok = self.worker.check(gold, final_answer(s.completion), self.timeout_s)
            if ok is None:
                self.timeouts += 1
                out.append(0.0 if self.on_timeout == "zero" else None)
            else:
                out.append(float(ok))
        return out

    def __del__(self):
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.kill()
