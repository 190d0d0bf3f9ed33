"""The process that `math_equal` checks answers in (python -m regen.rewards.math_worker): one JSON
line in (["gold", "pred"]), one JSON line out (true / false); "ready" first, or an error line
when math-verify is missing. A check that overruns is ended by killing this process."""

from __future__ import annotations

import json
import sys


def check(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    g = parse("\\boxed{" + gold + "}", parsing_timeout=None) or parse(gold, parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None) or parse(pred, parsing_timeout=None)
    return bool(g and p and verify(g, p, timeout_seconds=None))


def main() -> None:
    try:
        import math_verify  # noqa: F401  (imported once, before the first check)
    except ImportError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        gold, pred = json.loads(line)
        try:
            ok = check(gold, pred)
        except Exception:  # noqa: BLE001  (an answer math-verify cannot handle is not equal)
            ok = False
        print(json.dumps(ok), flush=True)


if __name__ == "__main__":
    main()
