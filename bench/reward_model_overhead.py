"""Overhead of the reward_model reward against calling the model directly, at batch 64.

Builds a GPT-2 sequence-classification model (--layers, --width; random weights, saved and
loaded through from_pretrained like any local reward model) and 64 (prompt, completion)
samples of about --length characters. Times, alternately, over --repeats rounds:
  direct   the model's forward on the batch already tokenised and padded (the floor: what a
           hand-written scorer cannot avoid)
  regen    RewardModel(samples): tokenising, sorting by length, batching by tokens, the forward
           and reading the scores back
and prints the medians, their ratio (target <= 1.10), the 1-min load average before and after,
and torch's thread count (--threads, default 2).

    python bench/reward_model_overhead.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--length", type=int, default=96, help="Characters per sample (prompt + completion).")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from regen.rewards import Sample
    from regen.rewards.reward_model import RewardModel
    from regen.tasks.arithmetic import build_tokenizer

    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=args.length + 8, n_embd=args.width, n_layer=args.layers,
                     n_head=4, num_labels=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    folder = tempfile.mkdtemp(prefix="rm_bench_")
    GPT2ForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    rng = random.Random(0)
    samples = []
    for _ in range(args.batch):
        n = rng.randint(args.length // 2, args.length)
        text = "".join(rng.choice("0123456789+=") for _ in range(n))
        samples.append(Sample(text[: n // 2], text[n // 2:]))
    reward = RewardModel(path=folder, max_length=args.length + 8)
    model = reward.model
    enc = tok([s.prompt + s.completion for s in samples], padding=True, return_tensors="pt")

    def direct():
        with torch.no_grad():
            return model(**enc).logits[:, 0].tolist()

    def regen():
        return reward(samples)

    a, b = direct(), regen()  # warm-up; and the same scores either way
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, "the two paths disagree"
    times = {"direct": [], "regen": []}
    for _ in range(args.repeats):
        for name, fn in (("direct", direct), ("regen", regen)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    d, r = statistics.median(times["direct"]), statistics.median(times["regen"])
    print(f"GPT-2 {args.layers} layers x {args.width}, batch {args.batch}, {args.length // 2}-{args.length} chars, "
          f"{args.threads} threads, {args.repeats} alternating rounds; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"direct forward  {1000 * d:8.1f} ms (median; min {1000 * min(times['direct']):.1f})")
    print(f"reward_model    {1000 * r:8.1f} ms (median; min {1000 * min(times['regen']):.1f})")
    print(f"ratio regen / direct: {r / d:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
