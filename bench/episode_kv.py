"""Multi-turn episode throughput: continuing the KV cache across turns against re-encoding the
whole sequence at each turn (what an agent loop that calls a text-in/text-out generator per turn
pays). Same model, prompts, environment and randomness in one process, rounds alternated; the two
modes must sample token-identical episodes (checked), so only the time differs.

    python bench/episode_kv.py                 # both prompt lengths, 3 rounds each
    python bench/episode_kv.py --rounds 5 --prompt-tokens 400

Model: a random-init GPT-2 (transformers' GPT2LMHeadModel, 4 layers x width 256, 3.3M parameters)
over regen's calc task's character tokenizer. Prompts: a tool-use system text (the calc tool's JSON
spec, repeated to the asked length; a chat template with tools= writes a few hundred tokens like it)
then "1234*5678=". Environment: every turn is answered with a 12-token observation until
--turns turns. Each row: 8 prompts x 4 episodes, --turn-tokens per turn (a random model rarely
writes EOS, so nearly every turn is that long). Figure: episodes/s = episodes / median seconds per
batch; ratio = re-encode's median / KV continuation's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.envs import Environment, Step  # noqa: E402
from regen.envs.tools import tool_spec  # noqa: E402
from regen.policies.lm import LMPolicy  # noqa: E402
from regen.policies.lm_episodes import EpisodeSampler  # noqa: E402
from regen.tasks import calc as calc_task  # noqa: E402


class Answer(Environment):
    """Answers each turn with a fixed 12-character observation; ends after `turns` turns."""

    def __init__(self, turns: int):
        self.turns, self.k = turns, 0

    def reset(self, row, seed):
        return None

    def step(self, turn):
        self.k += 1
        return Step(None, done=True) if self.k >= self.turns else Step("<r>12345678</r>"[:12])


def build(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = calc_task.build_tokenizer()
    cfg = GPT2Config(vocab_size=len(tok), n_positions=2048, n_embd=256, n_layer=4, n_head=4,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return LMPolicy(GPT2LMHeadModel(cfg).eval(), tok, torch.device("cpu"))


def prompts(n: int, prompt_tokens: int):
    spec = json.dumps(tool_spec(calc_task.calc, "calc"), separators=(",", ":"))
    system = ("You may call tools. " + spec * (1 + prompt_tokens // len(spec)))[: max(prompt_tokens - 10, 0)]
    items = calc_task.prompts("test", 4, 500)[:n]
    for it in items:
        it.prompt = system + it.prompt
    return items


def measure(policy, items, group: int, turns: int, turn_tokens: int, rounds: int) -> dict:
    samplers = {mode: EpisodeSampler(policy, lambda: Answer(turns), turns, 10_000, False, reencode=(mode == "reencode"))
                for mode in ("kv", "reencode")}
    B = len(items) * group
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(B, turns * turn_tokens, generator=gen)
    seeds = torch.arange(B)
    times = {m: [] for m in samplers}
    outs = {}
    for r in range(rounds + 1):  # round 0: warm-up, not counted
        for mode, s in (samplers.items() if r % 2 == 0 else reversed(samplers.items())):
            t0 = time.perf_counter()
            ro = s.sample(s.inputs(items), group, 1.0, 1.0, turn_tokens, None, uniforms=u, seeds=seeds)
            if r:
                times[mode].append(time.perf_counter() - t0)
            outs[mode] = ro
    same = torch.equal(outs["kv"].input_ids, outs["reencode"].input_ids)
    kv, re = statistics.median(times["kv"]), statistics.median(times["reencode"])
    tokens = float(outs["kv"].lengths.float().mean())
    return {"episodes": B, "turns": turns, "turn_tokens": turn_tokens, "prompt_tokens": int(outs["kv"].prompt_width),
            "episode_tokens_mean": tokens, "kv_s": kv, "reencode_s": re, "kv_episodes_per_s": B / kv,
            "reencode_episodes_per_s": B / re, "ratio": re / kv, "identical": same,
            "kv_spread_s": [min(times["kv"]), max(times["kv"])],
            "reencode_spread_s": [min(times["reencode"]), max(times["reencode"])]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="Timed rounds per mode (after one warm-up; default 3).")
    ap.add_argument("--prompt-tokens", type=int, action="append",
                    help="Prompt length(s) in tokens (repeatable; default 400 and 20).")
    ap.add_argument("--turns", type=int, default=4, help="Turns per episode (default 4).")
    ap.add_argument("--turn-tokens", type=int, default=16, help="Tokens per model turn (default 16).")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2).")
    ap.add_argument("--out", help="Write the rows as JSON here.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = build()
    rows = []
    load = os.getloadavg()[0]
    print(f"# episode_kv: threads {args.threads}, load {load:.2f}, {args.rounds} rounds, torch {torch.__version__}")
    print(f"{'prompt':>6} {'turns':>5} {'tok/turn':>8} {'episodes':>8} {'kv ep/s':>8} {'re-enc ep/s':>11} {'ratio':>6} same")
    for pt in args.prompt_tokens or [400, 20]:
        row = measure(policy, prompts(8, pt), 4, args.turns, args.turn_tokens, args.rounds)
        rows.append(row)
        print(f"{row['prompt_tokens']:>6} {row['turns']:>5} {row['turn_tokens']:>8} {row['episodes']:>8} "
              f"{row['kv_episodes_per_s']:>8.1f} {row['reencode_episodes_per_s']:>11.1f} {row['ratio']:>5.2f}x "
              f"{'yes' if row['identical'] else 'NO'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"load": load, "threads": args.threads, "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
