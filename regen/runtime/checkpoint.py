"""Checkpoints: one folder per step, written under a temporary name and renamed into place
when complete, with a SHA-256 manifest. Weights and optimizer tensors are safetensors, the
rest JSON: loading a checkpoint never unpickles anything.

    checkpoints/step_00000050/
        model/              Hugging Face folder (config, safetensors weights, tokenizer)
        critic/, critic_optimizer.*   PPO only: the value model and its optimizer
        optimizer.safetensors, optimizer.json
        rng.safetensors     torch CPU/CUDA RNG and the sampling generator
        state.json          step, data position, versions, anything else the loop keeps
        manifest.json       sha256 of every file above (written last)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from regen.errors import UserError

PREFIX = "step_"
# What a failed write raises: the OS's errors, and safetensors' own type for the same I/O
# failures (a full disk while writing weights raises SafetensorError, not OSError).
WRITE_ERRORS = (OSError, SafetensorError)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into tensors (safetensors) and plain values (JSON)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


class Gathered:
    """An optimizer state gathered from FSDP2 shards, presented as the optimizer that saving reads."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class Spooled:
    """An optimizer state already written in save_optimizer's form (its tensors streamed to `path`
    while they were gathered from FSDP2 shards: regen/runtime/dist.py), moved into the checkpoint."""

    def __init__(self, path: Path, meta: dict, error: BaseException | None = None):
        self.path, self.meta, self.error = path, meta, error  # error: what stopped the streamed write


def as_saved(opt: torch.optim.Optimizer, gathered) -> object:
    """What save_optimizer writes: the optimizer itself, its state gathered in memory, or spooled."""
    if gathered is None:
        return opt
    return gathered if isinstance(gathered, Spooled) else Gathered(gathered)


def save_optimizer(opt, folder: Path, name: str) -> None:
    if isinstance(opt, Spooled):  # same filesystem (the checkpoints folder): a rename
        if opt.error is not None:
            opt.path.unlink(missing_ok=True)
            raise opt.error
        os.replace(opt.path, folder / f"{name}.safetensors")
        (folder / f"{name}.json").write_text(json.dumps(opt.meta))
        return
    tensors, meta = optimizer_to_flat(opt)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(meta))


class Stored:
    """An optimizer state saved by save_optimizer, read when it is loaded: whole (`load()`, a
    state_dict), or one tensor at a time (`tensor(key)`), so that an FSDP2 rank taking its shards
    never holds the whole state (8 bytes per parameter for AdamW) beside them."""

    def __init__(self, folder: Path, name: str):
        self.path = folder / f"{name}.safetensors"
        self.meta = json.loads((folder / f"{name}.json").read_text())
        with safe_open(str(self.path), "pt") as f:  # the header only: an unreadable file fails here
            self.keys = set(f.keys())

    def load(self) -> dict:
        return optimizer_from_flat(load_file(str(self.path)), self.meta)

    def tensor(self, key: str) -> torch.Tensor:
        with safe_open(str(self.path), "pt") as f:
            return f.get_tensor(key)


def load_optimizer(folder: Path, name: str) -> Stored | None:
    """The optimizer state saved by save_optimizer, or None when the checkpoint has none."""
    if not (folder / f"{name}.safetensors").is_file():
        return None
    return Stored(folder, name)


def state_dict_of(saved) -> dict:
    """A state_dict from what load_optimizer returned (or a state_dict already)."""
    return saved.load() if isinstance(saved, Stored) else saved


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    # JSON turned tuples (e.g. AdamW's betas) into lists; give them back their type
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(
    run_dir: Path,
    step: int,
    save_model,  # callable(folder: Path) writing a Hugging Face folder into model/ (None: save_extra writes it)
    optimizer: torch.optim.Optimizer | None,
    rng: dict[str, torch.Tensor],
    state: dict,
    keep_last: int,
    save_extra=None,  # callable(folder: Path) writing more files into the checkpoint (e.g. the critic)
) -> Path:
    """Write a checkpoint; on any failure (e.g. ENOSPC) the partial folder is removed, the
    error re-raised, and every earlier checkpoint is left as it was. `state['healthy']`
    marks checkpoints a rollback may return to; retention always keeps the newest one."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)  # leftover of a write that was interrupted
    try:
        tmp.mkdir()
        if save_model is not None:
            save_model(tmp / "model")
        if optimizer is not None:
            save_optimizer(optimizer, tmp, "optimizer")
        if save_extra is not None:
            save_extra(tmp)
        save_file({k: v.detach().cpu().contiguous() for k, v in rng.items()}, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
        (tmp / "manifest.json").write_text(json.dumps({"sha256": manifest}, indent=1))
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():  # the same step saved again: move the old copy aside until the new one is in place
        old = root / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _retain(root, keep_last)
    return final


def _flag(folder: Path, name: str, default: bool) -> bool:
    try:
        return bool(json.loads((folder / "state.json").read_text()).get(name, default))
    except (OSError, ValueError):
        return False


def _is_healthy(folder: Path) -> bool:
    return _flag(folder, "healthy", True)


def step_of(folder: Path) -> int:
    return int(folder.name.removeprefix(PREFIX))


def _retain(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints, the newest healthy one (rollback target) and the
    newest healthy one written at the best evaluation of health.hacking_metric (a held-out fall's
    rollback target)."""
    done = list_checkpoints(root.parent)
    keep = set(done[-keep_last:])
    for good in ([p for p in done if _is_healthy(p)], [p for p in done if _is_healthy(p) and _flag(p, "peak", False)]):
        if good:
            keep.add(good[-1])
    for folder in done:
        if folder not in keep:
            # renamed first: a kill during the deletion leaves a `.del-` folder, removed at the next
            # start, never a half-deleted step_ folder that looks like a checkpoint
            gone = folder.with_name(f".del-{folder.name}")
            os.replace(folder, gone)
            shutil.rmtree(gone, ignore_errors=True)


def latest_healthy(run_dir: Path, at_most: int | None = None) -> Path | None:
    """Newest checkpoint marked healthy that passes verification (at step at_most or before, if given)."""
    for folder in reversed(list_checkpoints(run_dir)):
        if _is_healthy(folder) and (at_most is None or step_of(folder) <= at_most):
            try:
                verify(folder)
                return folder
            except UserError:
                continue
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify(folder: Path) -> None:
    """Raise UserError naming the first file that is missing or does not match the manifest."""
    mf = folder / "manifest.json"
    if not mf.is_file():
        raise UserError(f"checkpoint '{folder}' has no manifest.json (incomplete or not a checkpoint)")
    try:
        manifest = json.loads(mf.read_text())["sha256"]
    except (ValueError, KeyError) as e:
        raise UserError(f"checkpoint '{folder}': unreadable manifest.json ({e})") from None
    for rel, digest in manifest.items():
        p = folder / rel
        if not p.is_file():
            raise UserError(f"checkpoint '{folder}': file '{rel}' is missing")
        if _sha256(p) != digest:
            raise UserError(f"checkpoint '{folder}': file '{rel}' does not match its checksum (corrupt)")


def load_checkpoint(folder: Path) -> dict:
    """Verified contents: {'folder', 'model_dir', 'optimizer' (a Stored, or None), 'rng', 'state'}.
    A file that matches the manifest but cannot be read (written corrupt, manifest recomputed)
    is a UserError naming it."""
    verify(folder)
    try:
        return {
            "folder": folder,
            "model_dir": folder / "model",
            "optimizer": load_optimizer(folder, "optimizer"),
            "rng": load_file(str(folder / "rng.safetensors")),
            "state": json.loads((folder / "state.json").read_text()),
        }
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise UserError(f"checkpoint '{folder}': unreadable although it matches its manifest "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def latest_valid(run_dir: Path) -> tuple[Path | None, list[str]]:
    """Newest checkpoint that passes verification, and a warning for each newer one skipped."""
    warnings = []
    for folder in reversed(list_checkpoints(run_dir)):
        try:
            verify(folder)
            return folder, warnings
        except UserError as e:
            warnings.append(f"skipping {e}")
    return None, warnings


def load_latest(run_dir: Path, warn=print) -> dict:
    """The newest valid checkpoint of a run, for --resume; corrupt newer ones (a checksum that
    does not match, or a file that cannot be read) are skipped with a warning."""
    for folder in reversed(list_checkpoints(run_dir)):
        try:
            return load_checkpoint(folder)
        except UserError as e:
            warn(f"warning: skipping {e}")
    raise UserError(f"--resume: no valid checkpoint in '{run_dir / 'checkpoints'}'")


def resumed_model(model_cfg, state: dict | None):
    """The model config to load from: the checkpoint's weights when resuming, else as configured."""
    if state is None:
        return model_cfg
    return model_cfg.model_copy(update={"path": str(state["model_dir"]), "init": None})


def restore(state: dict, run_dir: Path, opt, data, gen: torch.Generator | None = None, load_optimizer=None) -> int:
    """Put optimizer, data position and RNG streams back as they were at the checkpoint, drop
    metrics rows logged after it (those steps are redone), and return its step.
    load_optimizer(saved): how the optimizer takes its state (a Stored; default opt.load_state_dict)."""
    from regen.runtime import dist
    from regen.runtime.metrics import truncate_after

    if state["optimizer"] is not None:
        (load_optimizer or (lambda saved: opt.load_state_dict(state_dict_of(saved))))(state["optimizer"])
    data.load_state(state["state"]["data"])
    torch.set_rng_state(state["rng"]["torch_cpu"])
    if gen is not None:
        gen.set_state(state["rng"]["sampler"])
    step = int(state["state"]["step"])
    if dist.current().main:  # torchrun: rank 0 owns the run directory
        # the steps after the checkpoint are redone: their metrics rows and alerts go, and a line
        # torn by a full disk or a kill is dropped with a note instead of stopping the resume
        for name in ("metrics.jsonl", "alerts.jsonl"):
            torn = truncate_after(run_dir / name, step, keep_before_start=name == "alerts.jsonl")
            if torn:
                print(f"note: {name}: dropped {torn} unreadable line(s) (a write cut off by a full disk or a kill)")
    return step


# what wrote a run directory's checkpoints (state.json "trainer"), as the user started it
TRAINERS = {"rl": "`regen train` (RL)", "dpo": "`regen train` with algorithm.name=dpo", "sft": "`regen sft`",
            "flow_sft": "`regen sft` of a flow model", "rm": "`regen rm`"}


def trainer_of(state: dict) -> str | None:
    """Which trainer wrote a checkpoint (its state.json); checkpoints of an older regen name none: an RL run's is
    known by its reward versions, an offline one is not known (not compared)."""
    return state.get("trainer") or ("rl" if "reward_versions" in state else None)


def check_trainer(state: dict, trainer: str, run_dir: Path) -> None:
    """Refuse to resume another trainer's checkpoint: it would be trained on as if it were this one's, pruned by
    retention, and its export replaced."""
    other = trainer_of(state["state"])
    if other is not None and other != trainer:
        raise UserError(f"run.dir: '{run_dir}' holds a run of {TRAINERS.get(other, other)}; {TRAINERS[trainer]} "
                        "would resume from its checkpoints and replace its export: choose another run.dir")
