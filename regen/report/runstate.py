"""Is a run alive, finished, stopped, or dead? From run.json (written by the training loops
at start and close) and, where it cannot tell, from how recently metrics.jsonl changed."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from regen.report.load import Run, age

RECENT_S = 300  # a run without run.json that logged within this long is probably still going


@dataclass
class RunState:
    label: str  # finished | in progress | stopped | crashed | unfinished | unknown
    alive: bool | None  # None: cannot be checked from here
    detail: str  # one line for people, after the label ("finished: ended 3 min ago")


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


def run_state(run: Run, now: float | None = None) -> RunState:
    now = time.time() if now is None else now
    last_row = f"last metrics row {age(now - run.metrics_mtime)} ago"
    info = run.info
    if info is not None:
        status, pid, host = info.get("status"), info.get("pid"), info.get("hostname")
        if status == "finished":
            return RunState("finished", False, f"ended {_ended(info, now)}; {last_row}")
        if status == "stopped":
            return RunState("stopped", False, f"before its last step, {_ended(info, now)}; rerun the same "
                            "command to resume")
        if status == "running" and isinstance(pid, int):
            if host == socket.gethostname():
                if pid_running(pid):
                    return RunState("in progress", True, f"pid {pid} runs on this host; {last_row}")
                last_alert = (run.alerts or [{}])[-1]
                if last_alert.get("kind") == "run_stopped":  # the loop stopped itself (after a checkpoint)
                    return RunState("stopped", False, f"by the run itself: {last_alert.get('message', '')}; "
                                    + last_row)
                return RunState("crashed", False, f"pid {pid} on this host exited without closing the run "
                                "(crashed or killed); " + last_row)
            return RunState("in progress", None, f"run.json says pid {pid} on host {host!r} (cannot check from "
                            f"here); {last_row}")
    # no (usable) run.json: an older run, or one from another tool; judge by its files
    total, last = run.total_steps, run.last_step
    if total is not None and last is not None and last >= total and (run.path / "export").is_dir():
        return RunState("finished", False, f"reached step {last} of {total}, export/ written (no run.json); "
                        + last_row)
    if now - run.metrics_mtime < RECENT_S:
        return RunState("in progress", None, f"probably (no run.json); {last_row}")
    return RunState("unfinished", None, f"not recently updated (no run.json); {last_row}")


def _ended(info: dict, now: float) -> str:
    ended = info.get("ended")
    return f"{age(now - ended)} ago" if isinstance(ended, (int, float)) else "end time unknown"
