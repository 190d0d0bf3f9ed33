"""Preference pairs from a `regen eval` result: for each sampled completion that is not the row's
answer, the pair {prompt, chosen: answer, rejected: completion} (duplicates dropped). The
rejected side is what the model itself gets wrong, which is what a reward model must tell
apart (random wrong answers teach it plausibility, not correctness).

    regen eval runs/demo-sft/export --data builtin:arithmetic:train --num-prompts 4000 \
        --samples-per-prompt 4 --out samples.json
    python scripts/pairs_from_samples.py samples.json pairs.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/pairs_from_samples.py EVAL.json PAIRS.jsonl")
    rows = json.loads(Path(sys.argv[1]).read_text())["samples"]
    if rows and "answer" not in rows[0]:
        sys.exit(f"{sys.argv[1]}: the samples have no 'answer' field to prefer")
    seen, out = set(), []
    for r in rows:
        key = (r["prompt"], r["completion"].strip())
        if r["completion"].strip() != str(r["answer"]).strip() and key not in seen:
            seen.add(key)
            out.append({"prompt": r["prompt"], "chosen": str(r["answer"]), "rejected": r["completion"],
                        "answer": str(r["answer"])})
    Path(sys.argv[2]).write_text("".join(json.dumps(p) + "\n" for p in out))
    print(f"{len(out)} pairs from {len(rows)} samples -> {sys.argv[2]}")


if __name__ == "__main__":
    main()
