"""`regen` with faults at named moments, for tests that need a real process to die there.

    python tests/fault_entry.py ARGS...        (the `regen` command line)

Environment:
  REGEN_FAULT_NAN_STEPS=5,6,7   the loss is NaN at these RL steps (every micro-batch of them),
                                counted by step, so a resumed process sees the same steps fail
  REGEN_FAULT_KILL=WHEN         SIGKILL this process at that moment:
      after_save:N      right after the checkpoint of step N is written
      after_log:N       right after the metrics row of step N is written
      before_export     after the final checkpoint, before export/ is written
      before_replace    while a resume rewrites metrics.jsonl, before the new file replaces the old
      in_retention      while an old checkpoint is being deleted by retention
"""

import os
import shutil
import signal
import sys

import regen.modalities.update as upd
import regen.runtime.checkpoint as ckpt
import regen.runtime.metrics as metrics
from regen.cli import main
from regen.train.run import Run
from tests.faults import nan_update


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install() -> None:
    nan_steps = {int(s) for s in os.environ.get("REGEN_FAULT_NAN_STEPS", "").split(",") if s}
    if nan_steps:
        upd.update = nan_update(upd.update, nan_steps)
    when = os.environ.get("REGEN_FAULT_KILL", "")
    kind, _, arg = when.partition(":")
    if kind == "after_save":
        real_save = Run.save
        Run.save = lambda self, step: (real_save(self, step), step == int(arg) and _die())[0]
    elif kind == "after_log":
        real_log = metrics.MetricsLogger.log
        metrics.MetricsLogger.log = lambda self, step, m: (real_log(self, step, m), step == int(arg) and _die())[0]
    elif kind == "before_export":
        Run.export = lambda self: _die()
    elif kind == "before_replace":
        real_replace = os.replace

        def replace(src, dst, *a, **kw):
            if str(src).endswith(".tmp-metrics.jsonl"):
                _die()
            return real_replace(src, dst, *a, **kw)

        metrics.os.replace = replace
    elif kind == "in_retention":
        real_rmtree = shutil.rmtree

        def rmtree(path, *a, **kw):
            if os.path.basename(str(path)).startswith(".del-step_"):
                _die()
            return real_rmtree(path, *a, **kw)

        ckpt.shutil.rmtree = rmtree


if __name__ == "__main__":
    _install()
    raise SystemExit(main(sys.argv[1:]))
