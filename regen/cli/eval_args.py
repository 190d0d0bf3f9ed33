"""The arguments of `regen eval` (the verb itself: regen/cli/eval.py, eval_flow.py)."""

from __future__ import annotations


def add_eval_parser(sub) -> None:
    """The `regen eval` verb's arguments."""
    import argparse

    ev = sub.add_parser(
        "eval", help="Score a checkpoint, a run or a model on held-out prompts.",
        description="Sample completions (language models) or images / videos (flow models) for held-out prompts,\n"
        "score them with rewards and report accuracy (exact match against each row's 'answer'), the\n"
        "mean reward of each term, the length, and any quality metrics (FID, BLEU-4, ...: --metrics).\n"
        "SOURCE is a run directory (its newest valid checkpoint, else its export/), a checkpoint\n"
        "folder (LoRA adapters are merged into their base), a model folder, or a hub id. A joint\n"
        "run (models:) or its checkpoint is evaluated as a pipeline, as in training: each prompt\n"
        "rewritten greedily by the enhancer, drawn by the painter, scored against the prompt.\n"
        "For a run or one of its checkpoints, the run's config.yaml gives the held-out data, the\n"
        "reward terms (weights, args) and the eval settings; flags override them. Prints a table\n"
        "and writes a JSON file (metrics, settings, every sample) to --out, by default\n"
        "RUN/eval/eval_<checkpoint>.json for a run or checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("source", nargs="?", metavar="SOURCE",
                    help="Run directory, checkpoint folder, model folder or hub id.")
    ev.add_argument("--model", help="Same as SOURCE (kept for scripts written before SOURCE existed).")
    ev.add_argument("--config", help="Config YAML whose data.eval, reward and eval settings to use "
                    "(default: the run's config.yaml when SOURCE is in a run directory).")
    ev.add_argument("--data", help="Prompts: JSONL file or builtin:arithmetic:test (default: the config's "
                    "data.eval, else builtin:arithmetic:test).")
    ev.add_argument("--num-prompts", type=int,
                    help="Evaluate the first N prompts (default: eval.num_prompts, else 500).")
    ev.add_argument("--samples-per-prompt", type=int,
                    help="Completions per prompt (default: eval.samples_per_prompt, else 4).")
    ev.add_argument("--temperature", type=float,
                    help="Sampling temperature (default: eval.temperature or rollout.temperature, else 1.0).")
    ev.add_argument("--top-p", type=float, help="Nucleus threshold (default: rollout.top_p, else 1.0 = off).")
    ev.add_argument("--max-new-tokens", type=int,
                    help="Completion length cap (default: rollout.max_new_tokens, else 8).")
    ev.add_argument("--greedy", action="store_true", help="Decode greedily (one completion per prompt).")
    ev.add_argument("--reward", action="append", default=None, metavar="NAME",
                    help="Score with this reward (repeatable; registered name or module:function); replaces the "
                    "config's reward terms. `regen rewards` lists them with their arguments.")
    ev.add_argument("--reward-args", action="append", default=None, metavar="YAML",
                    help="Arguments of the --reward at the same position, as a YAML mapping, e.g. "
                    "--reward format --reward-args '{pattern: \"[0-9]+\"}'.")
    ev.add_argument("--seed", type=int, help="Sampling seed (default: run.seed, else 0).")
    ev.add_argument("--digits", type=int,
                    help="Operand digits of the built-in arithmetic task (default: task.digits, else 2).")
    ev.add_argument("--test-size", type=int,
                    help="Held-out size of the built-in task (default: task.test_size, else 500).")
    ev.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="Device (default auto).")
    ev.add_argument("--show", type=int, default=0, metavar="N",
                    help="Also print the first N samples with their rewards.")
    ev.add_argument("--out", metavar="FILE", help="Write the JSON result here (default: "
                    "RUN/eval/eval_<checkpoint>.json for a run or checkpoint; otherwise only printed).")
    ev.add_argument("--json", action="store_true", help="Print the JSON result instead of the table.")
    q = ev.add_argument_group("quality metrics and gates (docs/evaluation.md)")
    q.add_argument("--metrics", metavar="LIST", help="Comma-separated eval.metrics, replacing the config's: images/"
                   "videos fid, kid, precision_recall, ssim, psnr, temporal_ssim, clip_score; text bleu4, chrf, "
                   "exact_match, length.")
    q.add_argument("--reference", "--ref", dest="reference", metavar="REF",
                   help="What fid/kid/precision_recall/ssim/psnr compare with: shapes, base (the run's starting "
                   "model), a folder of images, or hf:NAME[:SPLIT] (default: eval.reference, else shapes for the "
                   "built-in shapes prompts).")
    q.add_argument("--features", metavar="SPEC", help="Feature space of fid/kid/precision_recall: shapes, "
                   "clip:PATH or inception:PATH (default: eval.features, else shapes). Nothing is downloaded.")
    q.add_argument("--clip-model", metavar="DIR", help="Local CLIPModel folder for clip_score.")
    q.add_argument("--metric-samples", type=int, metavar="N",
                   help="Compute the metrics on the first N samples (default: all).")
    ev.epilog = ("Flow models (a flow run, its checkpoints or export/) are sampled with the ODE on the run's held-out\n"
                 "noise; a grid of the samples is written beside the JSON (.png, videos .gif). The config's\n"
                 "eval.gates are checked and reported as gate/NAME and gates_passed.")
