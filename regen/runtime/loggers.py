"""Optional experiment trackers that MetricsLogger fans out to: Weights & Biases and MLflow.

Both are off by default (`log.wandb` / `log.mlflow` null): then neither package is imported
and no network is touched. A tracker that is on gets, once per start, the resolved config
with secrets removed (`regen.config.redact`, plus credentials embedded in URLs), then every
metrics row (finite values only), and is closed at the end of the run. The ids of the tracker
runs are kept in RUN_DIR/loggers.json, so a resumed run continues the same tracker run.

API keys never pass through regen: W&B reads WANDB_API_KEY and MLflow MLFLOW_TRACKING_TOKEN
or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD from the environment themselves.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from regen.config.load import SECRET_WORDS, holds_credentials, redact  # noqa: F401  (holds_credentials: re-exported)
from regen.errors import UserError

STATE_FILE = "loggers.json"
REDACTED = "<redacted>"
# Environment variables whose values must never appear in a message we print or store.
SECRET_ENV = ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "DATABRICKS_TOKEN")
# config key -> (module imported to check it is installed, extra that installs it)
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow.tracking", "mlflow")}
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
_MLFLOW_KEY_BAD = re.compile(r"[^\w./\- ]")  # MLflow accepts alphanumerics, _ - . / and space
PARAM_MAX = 500  # MLflow servers before 2.x reject longer param values; ours are short anyway


class Sink(Protocol):
    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...

    def discard(self) -> None: ...  # undo a start (another tracker could not start)


def require(log_cfg: Any) -> None:
    """Import the package of every tracker that is turned on, or stop now, before the run
    directory is touched, naming the extra that installs it."""
    for key, (module, extra) in PACKAGES.items():
        if getattr(log_cfg, key, None) is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UserError(f"log.{key} is set but {module.split('.')[0]} cannot be imported ({e}): "
                            f"pip install 'regen[{extra}]'") from None


def open_sinks(run_dir: Path, log_cfg: Any, config: Any, resume: bool) -> list[Sink]:
    """Start every tracker turned on in `log_cfg`; each runs on its own thread (see Background).
    A tracker that cannot start is an error now: a long run should not find out at its end
    that nothing was recorded."""
    if getattr(log_cfg, "wandb", None) is None and getattr(log_cfg, "mlflow", None) is None:
        return []
    require(log_cfg)
    tree = public_config(config)
    saved = read_state(run_dir) if resume else {}
    sinks: list[Sink] = []
    state = dict(saved)  # a tracker turned off for this stretch keeps its id for a later resume
    # MLflow first: it fails on a wrong server before W&B has written anything
    for key, kind in (("mlflow", MlflowSink), ("wandb", WandbSink)):
        settings = getattr(log_cfg, key)
        if settings is None:
            continue
        try:
            sink = kind(run_dir, settings, tree, saved.get(key))
        except Exception as e:  # each library raises its own types; all mean "cannot start"
            for s in sinks:  # one failing leaves nothing of the others behind
                s.discard()
            raise UserError(f"log.{key}: cannot start the {key} run: {scrub_message(e, 600)}") from None
        sinks.append(sink)
        state[key] = sink.state
    write_state(run_dir, state)
    return [Background(s) for s in sinks]


def read_state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_state(run_dir: Path, state: dict) -> None:
    tmp = run_dir / f".tmp-{STATE_FILE}"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, run_dir / STATE_FILE)


# --------------------------------------------------------------------------- secrets


def public_config(config: Any) -> dict:
    """The config tree as trackers may see it: secret-looking keys redacted, URLs stripped of
    the parts that carry credentials."""
    if config is None:
        return {}
    tree = config.model_dump(mode="json") if hasattr(config, "model_dump") else config
    return scrub_urls(redact(tree))


def scrub_urls(tree: Any, key: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: scrub_urls(v, str(k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [scrub_urls(v, key) for v in tree]
    if isinstance(tree, str) and _URL.fullmatch(tree):
        # a webhook's path is its secret (Slack, Discord, ...): hide it too
        return scrub_url(tree, hide_path="webhook" in key.lower())
    return tree


def scrub_url(url: str, hide_path: bool = False) -> str:
    """Drop what carries credentials in a URL: `user:password@`, every query value and, with
    `hide_path`, the path. Scheme, host and port stay so the reader knows where it pointed."""
    try:
        p = urlsplit(url)
        host, port = p.hostname or "", p.port
    except ValueError:  # e.g. a port that is not a number: keep nothing of it
        return REDACTED
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")
    if p.username is not None or p.password is not None:
        netloc = f"{REDACTED}@{netloc}"
    query = "&".join(f"{k}={REDACTED}" for k, _ in parse_qsl(p.query, keep_blank_values=True))
    path = f"/{REDACTED}" if hide_path and p.path.strip("/") else p.path
    return urlunsplit((p.scheme, netloc, path, query, ""))


def scrub_message(e: BaseException, limit: int = 300) -> str:
    """One line about an exception, safe to print and store: URLs scrubbed and the values of
    the secret environment variables replaced, in case a library echoed them."""
    text = (str(e).strip().splitlines() or [""])[0]
    for name in SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, REDACTED)
    text = _URL.sub(lambda m: scrub_url(m.group(0)), text)[:limit]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """{'rollout.temperature': '1.0', 'reward.0.name': 'exact_match', ...}: MLflow params are
    flat strings. Lists of plain values stay one JSON value; lists of sections are indexed."""
    if isinstance(tree, dict) and tree:
        out: dict[str, str] = {}
        for k, v in tree.items():
            out |= flatten(v, f"{prefix}{k}.")
        return out
    if isinstance(tree, list) and any(isinstance(v, (dict, list)) for v in tree):
        out = {}
        for i, v in enumerate(tree):
            out |= flatten(v, f"{prefix}{i}.")
        return out
    return {prefix[:-1]: tree if isinstance(tree, str) else json.dumps(tree)}


# --------------------------------------------------------------------------- sinks


class WandbSink:
    name = "wandb"

    def __init__(self, run_dir: Path, cfg: Any, tree: dict, saved: dict | None):
        import wandb

        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(run_dir)}  # RUN_DIR/wandb/ by default
        self.resumed = bool((saved or {}).get("id"))
        local = run_dir / "wandb"
        before = set(local.iterdir()) if local.is_dir() else set()
        try:
            self._init(wandb, cfg, run_dir, tree, saved, where)
        except Exception:
            # a start that failed (a server that does not answer) leaves no folder of its own behind
            for p in (set(local.iterdir()) if local.is_dir() else set()) - before:
                p.unlink() if p.is_symlink() or p.is_file() else shutil.rmtree(p, ignore_errors=True)
            raise
        self.state = {"id": self.run.id, "project": cfg.project}

    def _init(self, wandb, cfg: Any, run_dir: Path, tree: dict, saved: dict | None, where: dict) -> None:
        self.run = wandb.init(
            # mode None: $WANDB_MODE (a variable the user set wins over a default they did not), read here and
            # now: W&B reads its variables once per process, so a second run in one process would miss a change
            project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.resolve().name,
            mode=cfg.mode or os.environ.get("WANDB_MODE") or None,
            tags=list(cfg.tags) or None, id=(saved or {}).get("id"), resume="allow", reinit="create_new",
            settings=wandb.Settings(console="off"),  # our progress bar owns the console; no stdout capture
            **where,
        )
        # update (rather than init(config=...)) so a resumed run may change train.steps, log.*, ...
        self.run.config.update(tree, allow_val_change=True)
        # x-axis = our step, not W&B's own counter: a resumed run redoes the steps after its
        # checkpoint, which W&B's monotonic step would drop
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, "step": step})

    def close(self) -> None:
        self.run.finish()

    def discard(self) -> None:
        """Undo a start that another tracker's failure makes pointless: finish the run and remove
        the local folder a new run wrote (an online run's server side stays)."""
        folder = Path(self.run.dir).parent if getattr(self.run, "dir", None) else None
        _close_quietly(self)
        if folder is not None and not self.resumed and folder.name.startswith(("offline-run-", "run-")):
            shutil.rmtree(folder, ignore_errors=True)
            latest = folder.parent / "latest-run"
            if latest.is_symlink():
                latest.unlink()


class MlflowSink:
    name = "mlflow"

    def __init__(self, run_dir: Path, cfg: Any, tree: dict, saved: dict | None):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
        run = None
        if saved and saved.get("run_id"):
            try:
                run = self.client.get_run(saved["run_id"])
                self.client.update_run(run.info.run_id, status="RUNNING")
            except MlflowException:  # another server or a deleted run: start a new one
                run = None
        self.resumed = run is not None
        if run is None:
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.experiment)
            run = self.client.create_run(exp_id, run_name=cfg.run_name or run_dir.resolve().name)
        self.run_id = run.info.run_id
        # MLflow params are write-once: a resumed run adds new keys only (a changed train.steps
        # keeps its first value there; config.yaml in the run directory has the current one)
        have = run.data.params
        params = [Param(_mlflow_key(k)[:250], v[:PARAM_MAX]) for k, v in flatten(tree).items()
                  if _mlflow_key(k)[:250] not in have]
        self.client.log_batch(self.run_id, params=params)
        self.state = {"run_id": self.run_id, "experiment": cfg.experiment}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(k), v, ms, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

    def discard(self) -> None:
        """Undo a start that another tracker's failure makes pointless: a new run is deleted."""
        try:
            if self.resumed:
                self.client.set_terminated(self.run_id, status="KILLED")
            else:
                self.client.delete_run(self.run_id)
        except Exception:
            pass  # already reporting the error that made us undo it


def _mlflow_key(key: str) -> str:
    return _MLFLOW_KEY_BAD.sub("_", key)


class Background:
    """One sink's calls on its own thread, so a slow or unreachable tracker (MLflow's HTTP
    client retries for minutes by default) never stalls a training step. The first error is
    kept and raised on the caller's thread at its next call, where MetricsLogger turns it into
    one warning and goes on without the sink."""

    def __init__(self, sink: Sink, max_pending: int = 10_000, close_timeout_s: float = 120.0):
        self.sink, self.name, self.close_timeout_s = sink, sink.name, close_timeout_s
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._work, name=f"regen-{sink.name}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is None:  # after a failure the rest is dropped, never retried out of order
                try:
                    self.sink.log(*item)
                except Exception as e:
                    self.error = e

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.error is not None:
            raise self.error
        try:
            self._queue.put_nowait((step, metrics))
        except queue.Full:
            raise TimeoutError(f"{self._queue.maxsize} rows waiting: the {self.name} server does not keep up") from None

    def abandon(self) -> None:
        """Stop the worker without closing the tracker run (after a failure, closing would
        only hit the same dead connection)."""
        self.error = self.error or RuntimeError("abandoned")
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the daemon thread ends with the process

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=self.close_timeout_s)
        except queue.Full:
            raise TimeoutError(f"rows still unsent after {self.close_timeout_s:.0f}s") from None
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"rows still unsent after {self.close_timeout_s:.0f}s")
        if self.error is not None:
            raise self.error
        self.sink.close()


def _close_quietly(sink: Sink) -> None:
    try:
        sink.close()
    except Exception:
        pass  # already reporting the error that made us close it
