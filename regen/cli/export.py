"""`regen export SOURCE --out DIR`: a checkpoint's model as a folder its library loads. A LoRA
checkpoint is merged into its base; a joint run's checkpoint (one folder per model) gives one
folder per model, DIR/NAME, as the run's own export/ does. DIR is written under a temporary name
beside it and renamed when complete, so a full disk or a kill leaves no truncated folder that
looks like a model."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from regen.cli.eval_joint import joint_names
from regen.errors import UserError
from regen.runtime import checkpoint as ckpt
from regen.runtime.rundir import write_folder


def cmd_export(args) -> int:
    src, out = Path(args.source), Path(args.out)
    if not src.is_dir():
        raise UserError(f"export: '{src}' is not a folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"export: '{out}' exists and is not an empty folder")
    folder = _checkpoint(src)
    ckpt.verify(folder)
    if args.require_gates:
        from regen.quality.gates import require

        require(folder)
    names = joint_names(folder)  # a joint run's checkpoint: one folder per model
    if not names and not (folder / "model").is_dir():
        raise UserError(f"export: checkpoint '{folder}' holds no model/ folder")

    def write(tmp: Path) -> None:
        for name in names or [None]:
            _model(folder / name / "model" if name else folder / "model", tmp / name if name else tmp)

    try:
        write_folder(out, write)
    except ckpt.WRITE_ERRORS as e:  # write_folder left nothing behind
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise UserError(f"export: writing '{out}' failed ({why}); nothing was left there") from None
    print(f"exported {folder} to {out}" + (f" ({', '.join(f'{out / n}' for n in names)})" if names else ""))
    return 0


def _checkpoint(src: Path) -> Path:
    """SOURCE itself when it is a checkpoint folder, else the run's newest valid healthy one."""
    if (src / "manifest.json").is_file():
        return src
    folder, warnings = ckpt.latest_valid(src)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if folder is None:
        raise UserError(f"export: no valid checkpoint in '{src}'")
    healthy = ckpt.latest_healthy(src)  # a run stopped by its health monitor: its last state is broken
    if healthy is None:
        raise UserError(f"export: every valid checkpoint of '{src}' is marked unhealthy (non-finite or "
                        f"collapsed training); export one by its folder if you want it anyway: {folder}")
    if healthy != folder:
        print(f"note: {folder.name} is marked unhealthy (see {src / 'alerts.jsonl'}); exporting the newest "
              f"healthy checkpoint, {healthy.name} (name a checkpoint folder to export another)", file=sys.stderr)
    return healthy


def _model(model: Path, out: Path) -> None:
    """One checkpoint model/ folder into `out`: a LoRA adapter merged into its base, else copied."""
    if (model / "adapter_config.json").is_file():
        try:
            from peft import AutoPeftModelForCausalLM
            from transformers import AutoTokenizer
        except ImportError:
            raise UserError("export: this checkpoint holds a LoRA adapter; merging it needs peft") from None
        try:
            merged = AutoPeftModelForCausalLM.from_pretrained(str(model)).merge_and_unload()
        except (OSError, ValueError) as e:
            raise UserError(f"export: cannot load the adapter's base model: {str(e).splitlines()[0]}") from None
        merged.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(model)).save_pretrained(out)
    else:
        shutil.copytree(model, out, dirs_exist_ok=True)
