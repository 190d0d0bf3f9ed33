"""Run a Python snippet (e.g. one a model wrote) in a separate, limited process.

What it isolates, per run:
  - CPU time (RLIMIT_CPU), wall-clock time (the whole process group is SIGKILLed at the deadline),
    memory (address space, RLIMIT_AS), the size of any file written (RLIMIT_FSIZE), how many more
    processes/threads it may start (RLIMIT_NPROC), open files (RLIMIT_NOFILE) and core dumps;
  - output: at most `output_bytes` of stdout and of stderr are kept; a flood stops the process;
  - environment variables: the child gets a fixed minimal environment, none of ours (no tokens,
    no API keys, no PYTHONPATH);
  - working folder: a new empty temporary folder (also its HOME), removed afterwards;
  - the interpreter runs without site-packages or the user's site (`-s -S`), so only the
    standard library can be imported.
  - When we run as root, the snippet runs as the `nobody` user: the kernel does not apply
    RLIMIT_NPROC to root, and root could raise its own limits back.

What it does NOT isolate:
  - network access is not blocked;
  - the filesystem outside the temporary folder is readable and writable with the permissions of
    the user the snippet runs as;
  - a snippet that calls os.setsid() (or double-forks into a new session) leaves the process group
    we kill, and may outlive the run (its process count is still capped by RLIMIT_NPROC).
This is a guard against runaway or careless code (infinite loops, memory hogs, fork bombs, output
floods), not a security boundary against a determined attacker. For untrusted code at scale, run
it in a container or VM sandbox (gVisor, Firecracker, nsjail, ...).
"""

from __future__ import annotations

import math
import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields

try:
    import resource
except ImportError:  # not POSIX (Windows): check_supported says so instead of failing on import
    resource = None

from regen.errors import UserError

_MB = 1024 * 1024
_NOFILE = 64  # open files: enough for Python itself, pipes and a few files; not enough to exhaust ours
_READ_CHUNK = 65536  # memory held per read on top of output_bytes
_POLL_S = 0.02  # how often we look whether the snippet's main process has exited
_DRAIN_S = 0.5  # after the main process exits, how long we wait for pipe ends held elsewhere
_REAP_S = 2.0  # after SIGKILL, how long we wait for the process to die before leaving it to Popen
_SANDBOX_USER = "nobody"
_NOBODY_ID = 65534  # nobody's uid/gid on Debian/Ubuntu/Fedora, used if there is no passwd entry
_CHILD_FLAGS = ["-s", "-S", "-P", "-B"]  # see _command for why not -I
_SCRIPT = "snippet.py"

# The last exception line of a traceback (unindented, "Name: message") tells which limit a failing
# snippet hit when the kernel refused something rather than killed it.
_ERROR_REASONS = [
    ("memory", re.compile(r"^(MemoryError\b|.*\[Errno 12\] Cannot allocate memory)")),
    ("file_size", re.compile(r"^\w+: \[Errno 27\] File too large")),
    ("processes", re.compile(r"^(BlockingIOError: \[Errno 11\] Resource temporarily unavailable"
                             r"|RuntimeError: can't start new thread)")),
]


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 2.0  # CPU seconds (RLIMIT_CPU, rounded up; SIGXCPU there, SIGKILL a second later)
    wall_s: float = 5.0  # wall-clock seconds; past it the whole process group is SIGKILLed
    memory_mb: int = 512  # address space (RLIMIT_AS)
    output_bytes: int = 4096  # stdout and stderr kept, each; more stops the process ("[... output cut at N bytes]")
    processes: int = 16  # how many more processes/threads the snippet may start (fork bombs)
    file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)

    def __post_init__(self):
        # Limits often come from a config file: a zero or a string should be named here, not
        # surface later as an odd setrlimit error inside the child.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UserError(f"sandbox limit {f.name} must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal
    reason: str | None  # None on a normal exit; else the limit that stopped it (see _classify)
    seconds: float


# ---- what we ask of the kernel -------------------------------------------------------------


def _sandbox_ids() -> tuple[int, int] | None:
    """(uid, gid) to run snippets as, or None to run them as ourselves (we are not root)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(_SANDBOX_USER)
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return _NOBODY_ID, _NOBODY_ID


def _count_tasks(uid: int) -> int:
    """How many tasks (threads, which is what RLIMIT_NPROC counts) processes of real uid `uid` have."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # exited while we were looking
            continue
        if int(status.get("Uid", "-1 0").split()[0]) == uid:
            total += int(status.get("Threads", "1"))
    return total


def _planned_rlimits(limits: SandboxLimits, tasks_now: int) -> list[tuple[str | None, str, int, int, int]]:
    """(limit field or None for a fixed one, RLIMIT name, resource constant, soft, hard) for the child.

    RLIMIT_NPROC is not "children of this process": the kernel counts every task of the user
    (uid), so the cap is what that uid runs now plus limits.processes. The count is a snapshot
    (other processes of the same uid starting or ending change the headroom), and the kernel never
    applies it to root, which is why root runs snippets as `nobody`.
    """
    cpu = math.ceil(limits.cpu_s)
    return [
        # soft then hard: SIGXCPU first (Python dies of it), SIGKILL a second later if it is caught
        ("cpu_s", "RLIMIT_CPU", resource.RLIMIT_CPU, cpu, cpu + 1),
        ("memory_mb", "RLIMIT_AS", resource.RLIMIT_AS, limits.memory_mb * _MB, limits.memory_mb * _MB),
        ("file_mb", "RLIMIT_FSIZE", resource.RLIMIT_FSIZE, limits.file_mb * _MB, limits.file_mb * _MB),
        ("processes", "RLIMIT_NPROC", resource.RLIMIT_NPROC, tasks_now + limits.processes,
         tasks_now + limits.processes),
        (None, "RLIMIT_NOFILE", resource.RLIMIT_NOFILE, _NOFILE, _NOFILE),  # fixed, not configurable
        (None, "RLIMIT_CORE", resource.RLIMIT_CORE, 0, 0),
    ]


def _check_hard_limits(planned) -> None:
    """A limit above our own hard limit cannot be set in the child: name it now."""
    for field_name, rname, res, _soft, hard in planned:
        current = resource.getrlimit(res)[1]
        if current == resource.RLIM_INFINITY or hard <= current:
            continue
        if field_name is None:
            raise UserError(f"the Python sandbox needs {rname}={hard}, above this machine's hard limit of {current}")
        raise UserError(f"sandbox limit {field_name} needs {rname}={hard}, above this machine's hard limit "
                    f"of {current}; lower {field_name} (or raise the hard limit, e.g. `ulimit -H`)")


def _can_execute(path: str, uid: int, gid: int) -> bool:
    """Whether uid/gid may execute `path` (search every folder on the way, execute the file),
    judged from permission bits; we are root, so os.access would answer for root."""

    def allowed(st, bit_owner, bit_group, bit_other) -> bool:
        if st.st_uid == uid:
            return bool(st.st_mode & bit_owner)
        if st.st_gid == gid:
            return bool(st.st_mode & bit_group)
        return bool(st.st_mode & bit_other)

    real = os.path.realpath(path)
    folder = os.path.dirname(real)
    try:
        while True:
            if not allowed(os.stat(folder), stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
                return False
            if folder == os.path.dirname(folder):
                break
            folder = os.path.dirname(folder)
        return os.path.isfile(real) and allowed(os.stat(real), stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)
    except OSError:
        return False


def _interpreter(python: str, ids: tuple[int, int] | None) -> str:
    """The interpreter to start: `python`, except where we are root, it is the default (our own,
    often under /root, which `nobody` cannot enter) and the sandbox user cannot execute it: then
    the same Python version from the system folders. Snippets run without site-packages (-S), so
    any interpreter of the same version gives them the same language and standard library."""
    if ids is None or python != sys.executable or _can_execute(python, *ids):
        return python
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        candidate = os.path.join(folder, name)
        if _can_execute(candidate, *ids):
            return candidate
    return python


def check_supported(limits: SandboxLimits, python: str = sys.executable) -> None:
    """Raise UserError naming the limit when it cannot be enforced on this machine (not Linux/POSIX,
    no `resource` module, RLIMIT_AS/RLIMIT_NPROC missing, or a requested limit above the hard limit).
    Called once before any snippet runs."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        raise UserError(f"the Python sandbox needs Linux (it counts processes in /proc); this is {sys.platform}")
    if resource is None:
        raise UserError("the Python sandbox needs the `resource` module to set limits, and this Python has none")
    for rname in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CORE"):
        if not hasattr(resource, rname):
            raise UserError(f"the Python sandbox cannot enforce its limits: resource.{rname} is missing here")
    ids = _sandbox_ids()
    _check_hard_limits(_planned_rlimits(limits, _count_tasks(os.getuid() if ids is None else ids[0])))
    chosen = _interpreter(python, ids)
    if ids is None and not os.access(chosen, os.X_OK):
        raise UserError(f"the Python sandbox cannot execute the interpreter {chosen}")
    if ids is not None and not _can_execute(chosen, *ids):
        raise UserError(f"running as root, the Python sandbox runs snippets as '{_SANDBOX_USER}' (uid {ids[0]}) "
                        f"because the kernel does not apply the process limit to root, and that user cannot "
                        f"execute {chosen} ({os.path.realpath(chosen)}); pass python= an interpreter it can run, "
                        "e.g. /usr/bin/python3, or run as a normal user")


# ---- the child -----------------------------------------------------------------------------


def _command(python: str, script: str) -> list[str]:
    # -s -S -P is -I without -E: no user site, no site-packages, no script folder on sys.path. We
    # do not need -E to keep our PYTHON* variables out (the environment is not inherited), and
    # without it the child honours the PYTHONHASHSEED=0 we set, so its printed sets and dicts of
    # strings are the same on every run. -B: no .pyc files.
    return [python, *_CHILD_FLAGS, script]


def _child_env(home: str) -> dict[str, str]:
    # Built from nothing, never from os.environ: tokens and keys in our environment stay here.
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0"}


def _make_preexec(planned):
    """The function the forked child runs before exec. It only calls setrlimit on values computed
    here: between fork and exec in a threaded parent, anything that takes locks could deadlock."""
    values = [(res, (soft, hard)) for _f, _n, res, soft, hard in planned]

    def preexec() -> None:
        for res, pair in values:
            resource.setrlimit(res, pair)

    return preexec


def _prepare_folders(code: str, ids: tuple[int, int] | None) -> tuple[str, str, str]:
    """(top, work, script): top holds the snippet file and work/, the snippet's empty working
    folder and HOME; the script lives outside work/ so the snippet sees an empty folder."""
    top = tempfile.mkdtemp(prefix="regen-sandbox-")
    work = os.path.join(top, "work")
    os.mkdir(work, 0o700)
    script = os.path.join(top, _SCRIPT)
    with open(script, "w", encoding="utf-8") as f:
        f.write(code)
    if ids is not None:  # the snippet's user must reach the script (not list top) and own work/
        os.chmod(top, 0o711)
        os.chmod(script, 0o644)
        os.chown(work, *ids)
    return top, work, script


def _remove_tree(path: str) -> None:
    """Remove the run's folder even where the snippet took away its own write permissions."""

    def retry(func, failed_path, _exc):
        parent = os.path.dirname(failed_path)
        try:
            os.chmod(parent, 0o700)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, 0o700)
            func(failed_path)
        except OSError:
            pass  # a file we truly cannot remove stays in the temp folder; never fail the run for it

    shutil.rmtree(path, onerror=retry)


def _kill_group(pgid: int) -> None:
    # The snippet leads its own session and process group (start_new_session), so this reaches
    # every process it started that did not leave the group. The kernel makes a group kill atomic
    # with fork: a fork bomb cannot add a member the signal misses.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _has_exited(pid: int) -> bool:
    # WNOWAIT leaves the exited child a zombie: its pid stays ours, so killing its group
    # afterwards cannot hit an unrelated process that reused the number.
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _reap(proc: subprocess.Popen) -> tuple[int | None, float | None]:
    """(Popen-style returncode, CPU seconds used) once the process has died; (None, None) if it has
    not died within _REAP_S of being killed (then Popen reaps it later)."""
    give_up = time.monotonic() + _REAP_S
    while not _has_exited(proc.pid):
        if time.monotonic() > give_up:
            return None, None
        time.sleep(_POLL_S)
    # wait4 rather than Popen.wait: it also says how much CPU the child used, which tells a CPU
    # limit SIGKILL from any other
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _pump(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[dict, set, str | None]:
    """Read stdout and stderr until both close and the main process has exited, keeping at most
    `cap` bytes of each. Returns (bytes by stream, streams cut, "wall_time" | "output" | None);
    on a non-None stop the process is still running and the caller kills it."""
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    cut: set[str] = set()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    exited_at = None
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
                # processes it left behind would hold the pipes open until the deadline
                _kill_group(proc.pid)
            if exited_at is not None and (not sel.get_map() or now - exited_at > _DRAIN_S):
                return kept, cut, None
            if now >= deadline:
                return kept, cut, "wall_time"
            wait = min(deadline - now, _POLL_S)
            if not sel.get_map():  # it closed both pipes and still runs
                time.sleep(wait)
                continue
            for key, _ in sel.select(wait):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.data]
                room = cap - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:  # more than we keep: stop reading and stop the writer
                    cut.add(key.data)
                    return kept, cut, "output"
    finally:
        sel.close()


def _decode(data: bytes, was_cut: bool, cap: int) -> str:
    text = data.decode("utf-8", errors="replace")
    return text + f"\n[... output cut at {cap} bytes]" if was_cut else text


def _classify(stop: str | None, returncode: int | None, cpu_used: float | None, cpu_limit: int,
              stderr: str) -> str | None:
    """The short word for what stopped the snippet, or None for a normal exit (any exit code):
    wall_time, output (we killed it), cpu_time, memory, file_size, processes, signal."""
    if stop is not None:
        return stop
    if returncode is None:  # it did not die within _REAP_S of SIGKILL: we cannot tell why it stopped
        return "signal"
    if returncode < 0:
        signum = -returncode
        if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_used is not None and cpu_used >= cpu_limit):
            return "cpu_time"
        if signum == signal.SIGXFSZ:
            return "file_size"
        if signum == signal.SIGKILL:  # not us, not the CPU limit: the kernel's OOM killer, usually
            return "memory"
        return "signal"
    if returncode != 0:
        for line in reversed(stderr.splitlines()):
            for reason, pattern in _ERROR_REASONS:
                if pattern.match(line):
                    return reason
    return None


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable) -> SandboxResult:
    """Run `code` as a Python program in a fresh process under `limits`; never waits much past
    limits.wall_s. Raises UserError when the sandbox cannot be set up (see check_supported)."""
    ids = _sandbox_ids()
    python = _interpreter(python, ids)
    planned = _planned_rlimits(limits, _count_tasks(os.getuid() if ids is None else ids[0]))
    _check_hard_limits(planned)
    top, work, script = _prepare_folders(code, ids)
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(
                _command(python, script), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=work, env=_child_env(work), start_new_session=True, preexec_fn=_make_preexec(planned),
                user=None if ids is None else ids[0], group=None if ids is None else ids[1],
                extra_groups=None if ids is None else [])
        except (OSError, subprocess.SubprocessError) as e:
            raise UserError(f"the Python sandbox could not start {python}: {e}") from None
        try:
            kept, cut, stop = _pump(proc, start + limits.wall_s, limits.output_bytes)
        finally:
            _kill_group(proc.pid)  # before reaping: the pgid is still ours while the leader is unreaped
            proc.stdout.close()
            proc.stderr.close()
        returncode, cpu_used = _reap(proc)
        seconds = time.monotonic() - start
    finally:
        _remove_tree(top)
    stderr = _decode(kept["stderr"], "stderr" in cut, limits.output_bytes)
    reason = _classify(stop, returncode, cpu_used, math.ceil(limits.cpu_s), stderr)
    return SandboxResult(stdout=_decode(kept["stdout"], "stdout" in cut, limits.output_bytes), stderr=stderr,
                         exit_code=returncode if returncode is not None and returncode >= 0 else None,
                         reason=reason, seconds=seconds)


# ---- the tool ------------------------------------------------------------------------------


def _limit_message(reason: str, limits: SandboxLimits) -> str:
    return {
        "wall_time": f"stopped after {limits.wall_s} s wall time (limit)",
        "cpu_time": f"stopped after {math.ceil(limits.cpu_s)} s of CPU time (limit)",
        "memory": f"ran out of memory ({limits.memory_mb} MB limit)",
        "output": f"stopped: output over {limits.output_bytes} bytes (limit)",
        "file_size": f"stopped: a file grew over {limits.file_mb} MB (limit)",
        "processes": f"could not start another process or thread ({limits.processes} limit)",
    }.get(reason, "the process was killed by a signal")


def _tool_text(result: SandboxResult, limits: SandboxLimits) -> str:
    """What the model reads: on a limit, a one-line error first; then stdout, and stderr labelled;
    a failing exit code last."""
    lines = [f"error: {_limit_message(result.reason, limits)}"] if result.reason else []
    if result.stdout:
        lines.append(result.stdout.rstrip("\n"))
    if result.stderr:
        lines.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.reason is None and result.exit_code:
        lines.append(f"(exit code {result.exit_code})")
    return "\n".join(lines) if lines else "(no output)"


def python_tool(limits: SandboxLimits = SandboxLimits(), python: str = sys.executable):
    """A tool function for tool environments: `fn(code: str) -> str` returning what a model should
    see (see _tool_text). Checks that the limits can be enforced here when built."""
    check_supported(limits, python)

    def python_(code: str) -> str:
        return _tool_text(run_python(code, limits, python), limits)

    python_.__name__ = python_.__qualname__ = "python"
    # real types, not the strings `from __future__ import annotations` leaves: tool specs map str -> "string"
    python_.__annotations__ = {"code": str, "return": str}
    python_.__doc__ = (
        "Run a Python 3 program in a fresh process and return what it prints (stdout, then stderr).\n\n"
        "Only the standard library is available and nothing carries over between calls: print what you "
        f"need to see. Limits: {limits.wall_s} s, {limits.memory_mb} MB of memory, {limits.output_bytes} "
        "bytes of output.\n\n"
        "Args:\n"
        "    code: the complete Python program to run.\n")
    return python_
