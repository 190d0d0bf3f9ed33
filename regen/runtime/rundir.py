"""Run directory set-up: checks that it is writable and that we do not clobber a finished run."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from regen.errors import UserError

RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "tensorboard", "checkpoints", "export", "samples",
             "run.json", "report.html")
RUN_INFO = "run.json"
LOCK = "run.lock"


def prepare(run_dir: str, overwrite: bool, resume: bool) -> tuple[Path, bool]:
    """Create/check the run directory and lock it for this process (see `lock`); return it and
    whether to resume. A directory that holds checkpoints is resumed automatically unless
    run.overwrite is set; one whose run stopped before its first checkpoint (killed, or a signal
    during the first evaluation) is started again: nothing of it could be resumed."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"run.dir: cannot create '{run_dir}': {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"run.dir: '{run_dir}' is not writable")
    lock(path)
    clear_leftovers(path)
    if not overwrite and (path / "checkpoints").is_dir() and any((path / "checkpoints").glob("step_*")):
        resume = True
    used = (path / "metrics.jsonl").exists() or (path / "checkpoints").exists()
    if used and not resume:
        if not overwrite and (path / "export").exists():  # a finished run whose checkpoints are gone
            raise UserError(
                f"run.dir: '{run_dir}' already holds a finished run (export/, no checkpoints); pass "
                "run.overwrite=true to replace it, or choose another run.dir"
            )
        if not overwrite:
            print(f"run.dir: '{run_dir}' holds a run that stopped before its first checkpoint: starting it again")
        for name in RUN_FILES:
            p = path / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return path, resume


@contextmanager
def undone_on_failure(run_dir: Path, fresh: bool, main: bool = True):
    """The start of a run in its locked directory: if anything fails before the first step, release
    the lock, and remove the directory when this start created it (nothing of a run is in it yet).
    main: this process prepared the directory (torchrun: rank 0)."""
    try:
        yield
    except BaseException:
        if main:
            unlock(run_dir)
            if fresh:
                shutil.rmtree(run_dir, ignore_errors=True)
        raise


def write_folder(final: Path, write) -> Path:
    """write(folder) into a temporary folder beside `final`, then renamed into place: `final`
    exists only complete (an export killed half-way is not mistaken for one)."""
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:  # a full disk, a bad model: nothing half-written is left beside `final`
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".del-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def clear_leftovers(path: Path) -> None:
    """Folders a killed process left half-written or half-deleted (`.tmp-*`, `.del-*`)."""
    for root in (path, path / "checkpoints"):
        if root.is_dir():
            for p in root.glob(".del-*"):
                shutil.rmtree(p, ignore_errors=True)
            for p in root.glob(".tmp-*"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
            for p in root.glob(".old-*"):  # a checkpoint moved aside while the same step was saved again
                if (root / p.name.removeprefix(".old-")).exists():
                    shutil.rmtree(p, ignore_errors=True)
                else:  # killed before the new copy was in place: the old one is the checkpoint
                    os.replace(p, root / p.name.removeprefix(".old-"))


# run dir's lock file (resolved) -> the descriptor whose flock holds it, for this process's life
_HELD: dict[str, int] = {}


def lock(path: Path) -> None:
    """Take run.lock for this process: a second trainer on the same run directory would
    interleave its metrics and checkpoints with the first's. The lock is an exclusive flock on
    the file, held on an open descriptor until unlock, so the kernel decides atomically who holds
    it and releases it when the holder dies (a SIGKILLed trainer leaves no stale lock). The file
    names its holder (pid, host) for the refusal message. A later run of this same process (an
    earlier one failed without closing) takes its own lock over."""
    file = path / LOCK
    key = str(file.resolve())
    me = json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(), "started": time.time()}).encode()
    if key in _HELD:
        if _locks_path(_HELD[key], file):
            _write_holder(_HELD[key], me)
            return
        os.close(_HELD.pop(key))  # its file was deleted meanwhile (the folder removed): lock the new one
    for _ in range(10):
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read_json(file)
            who = (f"process {holder.get('pid')} on {holder.get('hostname')} (since "
                   f"{time.ctime(holder.get('started', 0))})" if holder else "another process (starting now)")
            raise UserError(f"run.dir: '{path}' is in use by {who}; wait for it to finish (its lock, {file}, is "
                            "released when that process ends)") from None
        except OSError as e:
            os.close(fd)
            raise UserError(f"run.dir: cannot lock {file} ({e.strerror}): the run directory must be on a "
                            "filesystem with file locks") from None
        if _locks_path(fd, file):  # else the previous holder unlinked it between our open and our flock
            _write_holder(fd, me)
            _HELD[key] = fd
            return
        os.close(fd)
    raise UserError(f"run.dir: could not take {file}")


def _locks_path(fd: int, file: Path) -> bool:
    """The descriptor is open on the file now at `file` (not on one unlinked since)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(file))
    except FileNotFoundError:
        return False


def _write_holder(fd: int, holder: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder, 0)


def unlock(path: Path) -> None:
    """Release run.lock if this process holds it. The file is removed while still locked, so a
    process waiting on the old file finds it gone and locks the new one (lock checks the inode)."""
    file = path / LOCK
    fd = _HELD.pop(str(file.resolve()), None)
    if fd is not None:
        file.unlink(missing_ok=True)
        os.close(fd)


def _read_json(file: Path) -> dict | None:
    try:
        out = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def mark_running(run_dir: Path) -> None:
    """Write run.json: which process on which host trains this run, so `regen status` can tell
    a live run from one whose process is gone (a crash or a kill leaves status 'running')."""
    _write_info(run_dir, {"pid": os.getpid(), "hostname": socket.gethostname(), "started": time.time(),
                          "status": "running"})


def mark_closed(run_dir: Path, status: str) -> None:
    """Record how the run ended ('finished' or 'stopped') in run.json, and release run.lock."""
    info = read_run_info(run_dir) or {"pid": os.getpid(), "hostname": socket.gethostname()}
    _write_info(run_dir, {**info, "status": status, "ended": time.time()})
    unlock(run_dir)


def end_status(run_dir: Path, steps: int) -> str:
    """'finished' when the newest checkpoint is at the configured last step, else 'stopped'
    (a graceful stop checkpoints an earlier step)."""
    done = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    try:
        last = int(done[-1].removeprefix("step_")) if done else -1
    except ValueError:
        last = -1
    return "finished" if last >= steps else "stopped"


def read_run_info(run_dir: Path) -> dict | None:
    """run.json as a dict, or None when it is absent or unreadable (older runs have none)."""
    try:
        info = json.loads((run_dir / RUN_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _write_info(run_dir: Path, info: dict) -> None:
    tmp = run_dir / f".tmp-{RUN_INFO}"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, run_dir / RUN_INFO)  # readers never see half a file


def setup_torch(threads: int, seed: int) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


def versions(model_source: str, reward_versions: dict, config_tree: dict) -> dict:
    """What produced a checkpoint: regen version, git commit of regen's source when it is a
    checkout, model source, reward versions, and a hash of the resolved config."""
    import subprocess

    from regen import __version__
    from regen.config import config_hash

    commit = None
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"regen": __version__, "git_commit": commit, "model": model_source, "rewards": reward_versions,
            "config_hash": config_hash(config_tree)}


def prepare_on_rank0(cfg, resume: bool, d) -> tuple[Path, bool]:
    """Rank 0 creates or checks the run directory; the others learn the outcome (or its error)."""
    outcome: tuple = (None, resume, None)
    if d.main:
        try:
            outcome = (*prepare(cfg.run.dir, cfg.run.overwrite, resume), None)
        except UserError as e:
            outcome = (None, resume, str(e))
    run_dir, resume, error = d.broadcast_object(outcome)
    if error is not None:
        raise UserError(error)
    return Path(run_dir), resume
