"""`regen` command line: train | sft | eval | export | serve-reward | rewards | report | status.

User errors (bad config, data, paths, checkpoints) print one line `error: ...` and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from regen import __version__
from regen.cli.eval_args import add_eval_parser
from regen.cli.serve import add_serve_parser, cmd_serve_reward
from regen.errors import UserError

CONFIG_HELP = """\
Settings come from CONFIG.yaml (optional: built-in defaults otherwise) and then from
KEY=VALUE overrides in dotted form, values parsed as YAML, e.g.
    rollout.temperature=0.8  train.steps=300  reward.0.weight=2  optim.betas=[0.9,0.95]
Unknown keys, wrong types and impossible combinations are errors naming the field.
--help-config lists every key with its default and meaning."""


def _config_verb(sub, name: str, help_: str, description: str):
    p = sub.add_parser(
        name, help=help_, description=description + "\n\n" + CONFIG_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="YAML config file (see examples/).")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Dotted overrides applied after the file.")
    p.add_argument("--resume", action="store_true",
                   help="Continue the run in run.dir from its newest valid checkpoint (automatic when run.dir "
                   "holds checkpoints and run.overwrite is false).")
    p.add_argument("--force", action="store_true",
                   help="Resume even though settings that change the computation differ from the checkpoint's.")
    p.add_argument("--help-config", action="store_true", help="List every config key with default and description, then exit.")
    p.add_argument("--print-config", action="store_true", help="Print the resolved config as YAML, then exit.")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="regen",
        description="Reinforcement-learning post-training for generative models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `regen VERB --help` for the options of each verb.",
    )
    parser.add_argument("--version", action="version", version=f"regen {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    _config_verb(
        sub, "train", "Online RL of a language model (GRPO, PPO, ...) or a flow-matching model.",
        "Sample a group of completions per prompt, score them with the configured rewards, compute\n"
        "advantages and update the policy (algorithm.name: GRPO by default). Writes config.yaml,\n"
        "metrics.jsonl, TensorBoard events, checkpoints/ and export/ into run.dir.\n"
        "Several GPUs / nodes: start it with `torchrun --nproc_per_node N -m regen train ...` (data\n"
        "parallel, distributed.strategy=ddp|fsdp) or set distributed.mode=ray (rollout and reward\n"
        "workers as Ray actors); see docs/deployment.md.",
    )
    _config_verb(
        sub, "sft", "Supervised fine-tuning on prompt/completion demonstrations.",
        "Cross-entropy on completions (prompt tokens are not trained). With model.init set, starts\n"
        "from a fresh built-in model; the result in RUN_DIR/export is a base for `regen train`.",
    )

    _config_verb(
        sub, "rm", "Train a reward model on preference pairs (Bradley-Terry).",
        "A scalar head on a causal LM (usually your SFT model), trained on {prompt, chosen, rejected}\n"
        "rows so chosen scores above rejected; held-out pair accuracy at the start, every\n"
        "eval.every steps and at the end. RUN_DIR/export is a sequence-classification folder: score\n"
        "with it through the reward_model reward, in-process or `regen serve-reward --reward-model`.",
    )

    add_eval_parser(sub)

    ex = sub.add_parser(
        "export", help="Write a checkpoint as a Hugging Face model folder.",
        description="Verify a checkpoint against its manifest and copy its model as a folder that\n"
        "AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load (a joint run:\n"
        "one folder per model, OUT/NAME). SOURCE is a run directory (its newest valid healthy\n"
        "checkpoint) or one checkpoint folder. OUT is written under a temporary name and renamed\n"
        "when complete: a failed export (a full disk) leaves nothing there.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument("source", metavar="SOURCE", help="Run directory or checkpoints/step_NNNNNNNN folder.")
    ex.add_argument("--out", required=True, help="Destination folder (must not exist, or be empty).")
    ex.add_argument("--require-gates", action="store_true",
                    help="Refuse unless the run's evaluation at the checkpoint's step passed every eval.gates "
                    "threshold (read from metrics.jsonl; names the failures and the newest checkpoint that passed).")

    add_serve_parser(sub)

    rp = sub.add_parser(
        "report", help="Write a self-contained HTML report of one or several runs.",
        description="Write one self-contained HTML file (nothing fetched when viewed: inline SVG charts,\n"
        "sample images embedded) showing, for each run: state (finished / in progress / stopped /\n"
        "crashed), model, algorithm and config; reward mean +- std and each reward part, KL,\n"
        "clip fraction, entropy, response length, throughput, the time of each step by stage,\n"
        "eval/* curves; alerts on a timeline and in a table; the checkpoints (step, healthy,\n"
        "size, time); and the evaluation samples of samples/ (text, images, videos) with their\n"
        "reward, the first and last evaluation side by side. Several runs are overlaid, one\n"
        "colour each, and the x axis switches between steps, samples seen and wall-clock.\n"
        "Works on a run still training; problems reading a run are listed in the report.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="Run directories (each holds metrics.jsonl).")
    rp.add_argument("-o", "--out", metavar="FILE",
                    help="Output file (default RUN_DIR/report.html for one run, ./report.html for several).")
    st = sub.add_parser(
        "status", help="Print where a run stands: step, reward trend, eval, alerts, checkpoint, alive.",
        description="Print a few lines on a run: latest step of train.steps, the reward trend (mean of\n"
        "the last 10 steps against the 10 before, with an arrow; the loss for SFT), the latest\n"
        "eval metrics, the last 5 alerts, the newest checkpoint and its age, and whether the run\n"
        "is alive: its process (from run.json) still runs on this host; from another host, how\n"
        "long ago the last metrics row was written.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    st.add_argument("run_dir", metavar="RUN_DIR", help="Run directory.")

    sub.add_parser("rewards", help="List the registered reward functions.",
                   description="List registered reward names with what each computes and its arguments (defaults).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from regen.runtime.quiet import quiet_libraries

    quiet_libraries()
    _user_modules(args)
    try:
        return VERBS[args.verb](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `regen train --help-config | head`
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _user_modules(args) -> None:
    """A reward (or any 'module:function' of the config) next to the user's files imports as with
    `python -m`: from the current directory and from the config file's folder."""
    from regen.rewards.base import add_user_path

    add_user_path(Path.cwd())
    config = getattr(args, "config", None)
    if isinstance(config, str) and Path(config).is_file():
        add_user_path(Path(config).resolve().parent)


def _load(kind, args):
    from regen.config import load_config

    if args.help_config:
        from regen.config.reference import help_text

        print(help_text(kind))
        return None
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]  # only overrides were given
    cfg = load_config(kind, config, overrides)
    if args.print_config:
        import yaml

        from regen.config import redact, resolved_tree

        print(yaml.safe_dump(redact(resolved_tree(cfg)), sort_keys=False), end="")
        return None
    return cfg


def _train_verb(kind, trainer, args) -> int:
    """A training verb: its config loaded (or --help-config / --print-config answered), trainer(cfg) -> the
    summary, printed unless the run stopped early."""
    cfg = _load(kind, args)
    if cfg is None:
        return 0
    summary = trainer(cfg)(cfg, resume=args.resume, force=args.force)
    if not summary.get("stopped_early"):
        _print_summary(summary)
    return 0


def cmd_train(args) -> int:
    from regen.config import RLConfig

    def trainer(cfg):
        from regen.train import train

        return train

    return _train_verb(RLConfig, trainer, args)


def cmd_sft(args) -> int:
    from regen.config import SFTConfig

    def trainer(cfg):  # a flow model's flow-matching SFT, or a language model's
        from regen.offline.flow_sft import is_flow_model, sft_flow
        from regen.offline.sft import sft

        return sft_flow if is_flow_model(cfg.model) else sft

    return _train_verb(SFTConfig, trainer, args)


def cmd_rm(args) -> int:
    from regen.config import RMConfig

    def trainer(cfg):
        from regen.offline.rm import train_rm

        return train_rm

    return _train_verb(RMConfig, trainer, args)


def _print_summary(summary: dict) -> None:
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 speaks for the run
        return
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    for key in ("eval/accuracy", "eval/greedy_accuracy", "eval/reward", "eval/preference_accuracy",
                "eval/pair_accuracy"):
        if key not in after:
            continue
        name = "held-out " + key.removeprefix("eval/").replace("_", " ")
        if key in before:
            print(f"{name}: {before[key]:.3f} -> {after[key]:.3f} ({after[key] - before[key]:+.3f})")
        else:
            print(f"{name}: {after[key]:.3f}")
    print(f"model exported to {summary['export']}")


def cmd_eval(args) -> int:
    from regen.cli.eval import cmd_eval as run_eval_verb  # the verb's logic lives in its own module

    return run_eval_verb(args)


def cmd_export(args) -> int:
    from regen.cli.export import cmd_export as export

    return export(args)


def cmd_report(args) -> int:
    from regen.report import make_report

    print(f"report written to {make_report(args.run_dirs, args.out)}")
    return 0


def cmd_status(args) -> int:
    from regen.report.status import status_text

    print(status_text(args.run_dir))
    return 0


def cmd_rewards(args) -> int:
    from regen.rewards import REGISTRY
    from regen.rewards.base import describe_reward

    rows = [describe_reward(name, fn) for name, fn in sorted(REGISTRY.items())]
    width = max(len(name) for name, _, _ in rows) + 2
    for name, summary, arguments in rows:
        print(textwrap.fill(summary, 100, initial_indent=f"{name:<{width}}", subsequent_indent=" " * width))
        if arguments:
            print(textwrap.fill("args: " + arguments, 100, initial_indent=" " * width,
                                subsequent_indent=" " * (width + 6)))
    print("\nIn a config: reward: [{name: NAME, weight: 1.0, args: {...}}]; `regen eval --reward NAME "
          "--reward-args '{...}'`. Any 'package.module:function' works too (docs/your-model-data-reward.md).")
    return 0


VERBS = {
    "train": cmd_train, "sft": cmd_sft, "rm": cmd_rm, "eval": cmd_eval, "export": cmd_export,
    "serve-reward": cmd_serve_reward, "rewards": cmd_rewards, "report": cmd_report, "status": cmd_status,
}
