"""regen/envs/sandbox.py: snippets run in a separate process, stopped at each limit, and leave
nothing behind (no processes, no temp folder) and learn nothing of ours (no environment)."""

import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import pytest

from regen.envs import sandbox
from regen.envs.sandbox import SandboxLimits, check_supported, python_tool, run_python
from regen.errors import UserError

MB = 1024 * 1024

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, Z, ...), or None when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _running(pid: int) -> bool:
    # a zombie has stopped running; it waits for its parent (here: PID 1, which reaps lazily)
    return _state(pid) not in (None, "Z")


def _running_in_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is pgid."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(name))
    return found


def _gone_soon(check, timeout_s: float = 1.0) -> bool:
    """Whether check() becomes true within timeout_s (SIGKILL delivery is not instantaneous)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return check()


def test_a_normal_snippet_returns_its_output():
    r = run_python("import sys\nprint('hello', 6 * 7)\nprint('warn', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.exit_code, r.reason) == ("hello 42\n", "warn\n", 0, None)
    assert 0 < r.seconds < 3


def test_a_failing_snippet_keeps_its_exit_code_and_traceback():
    r = run_python("raise ValueError('boom')")
    assert r.exit_code == 1 and r.reason is None
    assert "ValueError: boom" in r.stderr
    assert run_python("raise SystemExit(3)").exit_code == 3


def test_output_is_decoded_with_replacement():
    r = run_python("import sys\nsys.stdout.buffer.write(b'\\xff ok')")
    assert r.stdout == "\ufffd ok" and r.reason is None


def test_an_infinite_loop_stops_at_the_cpu_limit():
    r = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=3))
    assert r.reason == "cpu_time" and r.exit_code is None
    assert r.seconds < 2.5  # the CPU limit, not the 3 s wall limit, stopped it


def test_a_snippet_ignoring_sigxcpu_is_killed_at_the_hard_cpu_limit():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    r = run_python(code, SandboxLimits(cpu_s=1, wall_s=4))
    assert r.reason == "cpu_time" and r.exit_code is None
    assert r.seconds < 3.5


def test_a_sleep_stops_at_the_wall_limit_and_the_folder_is_removed():
    r = run_python("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(100)", SandboxLimits(wall_s=1))
    assert r.reason == "wall_time" and r.exit_code is None
    assert 1 <= r.seconds < 2
    cwd = r.stdout.strip()
    assert cwd.startswith(tempfile.gettempdir()) and not os.path.exists(cwd)


def test_the_wall_limit_kills_the_processes_the_snippet_started():
    code = ("import subprocess, time\n"
            "child = subprocess.Popen(['sleep', '100'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(100)\n")
    r = run_python(code, SandboxLimits(wall_s=1))
    assert r.reason == "wall_time"
    pid = int(r.stdout)
    assert _gone_soon(lambda: not _running(pid)), f"the snippet's child {pid} still runs: {_state(pid)}"


def test_a_finished_snippet_does_not_wait_for_its_leftover_children():
    # the leftover sleep holds the output pipes open: without killing it we would wait for wall_s
    code = "import subprocess\nprint(subprocess.Popen(['sleep', '100']).pid)\n"
    r = run_python(code, SandboxLimits(wall_s=5))
    assert (r.exit_code, r.reason) == (0, None)
    assert r.seconds < 2
    pid = int(r.stdout)
    assert _gone_soon(lambda: not _running(pid))


def test_a_snippet_that_closes_its_output_still_stops_at_the_wall_limit():
    r = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(100)", SandboxLimits(wall_s=1))
    assert r.reason == "wall_time" and r.seconds < 2


def test_a_memory_hog_gets_a_memory_error_and_we_keep_our_own_limits():
    ours = resource.getrlimit(resource.RLIMIT_AS)
    r = run_python("x = bytearray(2_000_000_000)", SandboxLimits(memory_mb=256))
    assert r.reason == "memory" and r.exit_code == 1
    assert "MemoryError" in r.stderr
    assert resource.getrlimit(resource.RLIMIT_AS) == ours  # the limit was set in the child only
    assert len(bytearray(300 * MB)) == 300 * MB  # and this process can still use more than 256 MB


def test_a_fork_bomb_is_contained():
    code = "import os\nprint(os.getpid(), flush=True)\nwhile True: os.fork()"
    t0 = time.monotonic()
    r = run_python(code, SandboxLimits(processes=8, wall_s=2))
    assert time.monotonic() - t0 < 3
    assert r.reason in ("processes", "wall_time")
    pgid = int(r.stdout.split()[0])  # the snippet leads its own process group
    assert _gone_soon(lambda: not _running_in_group(pgid)), _running_in_group(pgid)
    assert subprocess.run(["true"]).returncode == 0  # and we can still start processes


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_output_flood_is_cut_and_stopped(stream):
    code = f"import sys\nwhile True: print('x' * 1000, file=sys.{stream})"
    r = run_python(code, SandboxLimits(output_bytes=1000, wall_s=5))
    assert r.reason == "output" and r.exit_code is None
    assert r.seconds < 2  # stopped at the flood, not at the wall limit
    text = getattr(r, stream)
    assert text == "x" * 1000 + "\n[... output cut at 1000 bytes]"


def test_output_under_the_cap_is_not_marked():
    r = run_python("print('x' * 999, end='')", SandboxLimits(output_bytes=1000))
    assert r.stdout == "x" * 999 and r.reason is None


def test_a_big_file_stops_at_the_file_limit():
    r = run_python("open('big', 'wb').write(b'x' * (3 * 1024 * 1024))", SandboxLimits(file_mb=1))
    assert r.reason == "file_size" and "File too large" in r.stderr


def test_the_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("REGEN_TEST_SECRET", "s3cr3t")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    r = run_python("import json, os, sys\nprint(json.dumps([dict(os.environ), sys.path]))")
    env, path = json.loads(r.stdout)
    assert "s3cr3t" not in r.stdout and "REGEN_TEST_SECRET" not in env
    assert set(env) == {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED"}
    assert env["PATH"] == "/usr/bin:/bin"
    assert "/nowhere" not in path and not any("site-packages" in p for p in path)


def test_string_hashing_is_the_same_on_every_run():
    # PYTHONHASHSEED=0 is honoured, so a printed set of strings reads the same each time
    code = "print(hash('regen'), list({'a', 'b', 'c', 'd'}))"
    assert run_python(code).stdout == run_python(code).stdout


def test_the_working_folder_is_empty_and_removed_afterwards():
    code = ("import json, os\n"
            "seen = [os.getcwd(), os.listdir('.'), os.environ['HOME']]\n"
            "open('made_here.txt', 'w').write('x')\n"
            "print(json.dumps(seen))\n")
    r = run_python(code)
    cwd, listing, home = json.loads(r.stdout)
    assert listing == [] and home == cwd
    assert os.path.realpath(cwd).startswith(os.path.realpath(tempfile.gettempdir()))
    assert not os.path.exists(cwd) and not os.path.exists(os.path.dirname(cwd))


def test_python_tool_answers_with_output_or_a_one_line_error():
    tool = python_tool(SandboxLimits(wall_s=1))
    assert tool("print(6 * 7)") == "42"
    failed = tool("raise ValueError('boom')")
    assert "stderr:\n" in failed and "ValueError: boom" in failed and failed.endswith("(exit code 1)")
    timeout = tool("import time\ntime.sleep(10)")
    assert timeout == "error: stopped after 1 s wall time (limit)"


def test_python_tool_is_a_tool_spec_with_one_string_parameter():
    from regen.envs.tools import tool_spec

    tool = python_tool()
    assert list(inspect.signature(tool).parameters) == ["code"]
    spec = tool_spec(tool)["function"]
    assert spec["name"] == "python" and spec["description"].startswith("Run a Python 3 program")
    assert spec["parameters"]["properties"]["code"]["type"] == "string"
    assert spec["parameters"]["required"] == ["code"]


@pytest.mark.parametrize("field, rlimit", [("memory_mb", "RLIMIT_AS"), ("file_mb", "RLIMIT_FSIZE"),
                                           ("processes", "RLIMIT_NPROC")])
def test_a_limit_above_the_hard_limit_is_named(monkeypatch, field, rlimit):
    # this machine's hard limits may be unlimited: pretend they are small for one resource
    real = resource.getrlimit
    small = 10_000 * MB if rlimit != "RLIMIT_NPROC" else 100_000
    monkeypatch.setattr(resource, "getrlimit",
                        lambda res: (small, small) if res == getattr(resource, rlimit) else real(res))
    too_big = SandboxLimits(**{field: 10**6})
    with pytest.raises(UserError, match=rf"{field} needs {rlimit}=.*hard limit of {small}"):
        check_supported(too_big)
    with pytest.raises(UserError, match=field):
        run_python("print(1)", too_big)  # the same check, before any process starts
    check_supported(SandboxLimits(**{field: 8}))  # under the hard limit: fine


def test_check_supported_refuses_a_machine_without_what_it_needs(monkeypatch):
    check_supported(SandboxLimits())
    monkeypatch.setattr(sandbox, "resource", None)
    with pytest.raises(UserError, match="resource"):
        check_supported(SandboxLimits())
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(UserError, match="needs Linux"):
        check_supported(SandboxLimits())


def test_a_missing_interpreter_is_a_user_error():
    with pytest.raises(UserError, match="/no/such/python"):
        run_python("print(1)", python="/no/such/python")


@pytest.mark.parametrize("bad", [{"wall_s": 0}, {"memory_mb": -1}, {"processes": "8"}])
def test_limits_must_be_positive_numbers(bad):
    with pytest.raises(UserError, match=next(iter(bad))):
        SandboxLimits(**bad)
