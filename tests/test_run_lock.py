"""run.lock between real processes: two trainers that start at the same moment on the same run
directory, with or without a lock left by a killed process, never both hold it (the old
create-then-write lock let both in about one race in six), and a holder's death frees it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.errors import UserError
from regen.runtime import rundir

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 120
GAP_S = 0.03

# Each racer locks trial directory i at the moment start + i * gap, keeps every lock it took, and
# prints the trials it won. Both racers aim at the same moments, so each trial is a real race.
RACER = """
import json, sys, time
from pathlib import Path
from regen.errors import UserError
from regen.runtime.rundir import lock
root, start, gap, n = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
won = []
for i in range(n):
    while time.time() < start + i * gap:
        pass
    try:
        lock(root / str(i))
        won.append(i)
    except UserError:
        pass
print(json.dumps(won))
"""


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.extended  # two racing processes, ~5 s: second CI tier
def test_two_processes_racing_for_the_lock_never_both_hold_it(tmp_path):
    stale = {"pid": dead_pid(), "hostname": os.uname().nodename, "started": time.time()}
    for i in range(TRIALS):
        (tmp_path / str(i)).mkdir()
        if i % 2:  # half the trials start from a lock file a killed process left behind
            (tmp_path / str(i) / rundir.LOCK).write_text(json.dumps(stale))
    start = time.time() + 3  # both interpreters are up by then
    args = [sys.executable, "-c", RACER, str(tmp_path), str(start), str(GAP_S), str(TRIALS)]
    racers = [subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    won = [set(json.loads(p.communicate(timeout=120)[0])) for p in racers]
    assert won[0] & won[1] == set(), f"both processes held the lock of trials {sorted(won[0] & won[1])}"
    assert won[0] | won[1] == set(range(TRIALS)), "a trial nobody could lock"


def test_a_killed_holders_lock_is_taken_over_and_a_live_one_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from regen.runtime.rundir import lock; lock(Path(sys.argv[1])); print('held', "
                               "flush=True); time.sleep(600)", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"in use by process {holder.pid} on"):
            rundir.lock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    rundir.lock(tmp_path)  # the kernel released the dead holder's lock; its file still names it
    assert json.loads((tmp_path / rundir.LOCK).read_text())["pid"] == os.getpid()
    rundir.unlock(tmp_path)
    assert not (tmp_path / rundir.LOCK).exists()
