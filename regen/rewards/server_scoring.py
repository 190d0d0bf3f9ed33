"""Where the reward service's scorers run, and the deadline of every call.

A scorer is user code: it can hang (a regex that backtracks for ever, a lock, a remote call
without a timeout). Every call has a deadline, score_timeout_s; a call past it gives each of its
samples an error and frees its concurrency slot, so one bad sample never wedges the service.
What happens to the call itself depends on where scorers run:

- threads (scorer_processes = 0, the default): a Python thread cannot be interrupted, so the
  call is abandoned and keeps running in its daemon thread. It is counted as stuck until it
  returns: /healthz says "degraded" with the count, and once max_concurrency calls are stuck
  the service answers 503 (and /healthz 503) rather than pile up threads: restart it.
- processes (scorer_processes = N): N worker processes, each with its own copy of the rewards
  (a reward model is loaded N times); a call past its deadline kills its worker and a new one
  is started, so the service recovers by itself. Samples cross a pipe (pickled), which costs
  little next to a scorer worth isolating.

SIGTERM ends the service within a bounded time either way: the threads are daemons, the workers
are killed at exit."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from regen.errors import ConfigError
from regen.rewards.base import resolve

log = logging.getLogger("regen.reward_service")


class ScoreTimeout(Exception):
    pass


class AllStuck(Exception):
    pass


def resolve_rewards(rewards: list[str], args: dict[str, dict]) -> dict:
    """name -> the scoring function, as the service serves it (a factory called with its args)."""
    fns = {}
    for name in rewards:
        fn = resolve(name, where="--reward")
        if getattr(fn, "reward_kind", "scalar") == "pairwise":
            raise ConfigError(f"--reward {name}: a pairwise judge compares two samples, which /score does not "
                              f"send; serve the 'pairwise' reward with of={name} instead (ServerConfig.args)")
        if getattr(fn, "reward_factory", False):
            fn = fn(**args.get(name, {}))
        fns[name] = fn
    return fns


class Scorers:
    """fn(samples) with a deadline, in threads or in worker processes (module docstring)."""

    def __init__(self, fns: dict, rewards: list[str], args: dict, timeout_s: float, processes: int, slots: int):
        self.fns, self.timeout_s, self.slots = fns, timeout_s or None, slots
        self.stuck = 0  # threads: calls past their deadline that have not returned
        self.replaced = 0  # processes: workers killed past a deadline (or dead) and started anew
        self.workers: asyncio.Queue | None = None  # the idle worker processes (None: threads)
        if processes:
            self._spawn_args = (rewards, args)
            self._pool = ThreadPoolExecutor(processes, thread_name_prefix="scorer-pipe")
            self.workers = asyncio.Queue()  # bound to the event loop on first use (Python >= 3.10)
            for _ in range(processes):
                self.workers.put_nowait(Worker(*self._spawn_args))

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /healthz."""
        body = {"status": "ok"}
        if self.stuck:
            body = {"status": "degraded", "stuck_scorers": self.stuck,
                    "detail": f"{self.stuck} scoring call(s) ran past --score-timeout-s and are still running"}
        if self.replaced:
            body["replaced_workers"] = self.replaced
        return (503 if self.stuck >= self.slots else 200), body

    async def call(self, name: str, samples: list) -> list:
        """The scores of `samples`; ScoreTimeout past the deadline, AllStuck when threads are used up."""
        if self.workers is not None:
            return await self._in_worker(name, samples)
        if self.stuck >= self.slots:
            raise AllStuck(f"{self.stuck} scoring calls are stuck past --score-timeout-s; restart the service "
                           "(or run scorers in processes: --scorer-processes)")
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def work():
            try:
                out = (True, list(self.fns[name](samples)))
            except BaseException as e:  # handed to the request, which logs it
                out = (False, e)
            try:
                loop.call_soon_threadsafe(_settle, done, out)
            except RuntimeError:  # the loop closed (the service stopped) while this call ran
                pass

        threading.Thread(target=work, daemon=True, name=f"scorer-{name}").start()
        try:
            ok, value = await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
        except TimeoutError:
            self.stuck += 1
            done.add_done_callback(lambda _: self._unstick())
            log.error("scorer '%s' ran past its deadline (%g s); %d call(s) now stuck", name, self.timeout_s,
                      self.stuck)
            raise ScoreTimeout from None
        if not ok:
            raise value
        return value

    def _unstick(self) -> None:
        self.stuck -= 1
        log.warning("a stuck scoring call returned; %d still stuck", self.stuck)

    async def _in_worker(self, name: str, samples: list) -> list:
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        try:  # waiting for a free worker counts towards the deadline
            worker = await asyncio.wait_for(self.workers.get(), None if deadline is None else deadline - loop.time())
        except TimeoutError:
            raise ScoreTimeout from None
        call = loop.run_in_executor(self._pool, worker.call, name, samples)
        try:
            ok, value = await asyncio.wait_for(asyncio.shield(call), None if deadline is None
                                               else max(deadline - loop.time(), 0.0))
        except TimeoutError:
            log.error("scorer '%s' ran past its deadline (%g s): its worker process is killed and replaced", name,
                      self.timeout_s)
            call.add_done_callback(_retrieved)  # its pipe read fails once the worker is gone: expected
            worker.kill()
            asyncio.ensure_future(self._replace())
            raise ScoreTimeout from None
        except (EOFError, OSError) as e:  # the worker died (a crash in native code, the OOM killer)
            worker.kill()
            asyncio.ensure_future(self._replace())
            raise RuntimeError(f"the scorer's worker process died ({type(e).__name__})") from None
        self.workers.put_nowait(worker)
        if not ok:
            raise RuntimeError(value)  # the worker's traceback, for the service's log
        return value

    async def _replace(self) -> None:
        worker = await asyncio.get_running_loop().run_in_executor(self._pool, lambda: Worker(*self._spawn_args))
        self.replaced += 1
        self.workers.put_nowait(worker)

    def close(self) -> None:
        if self.workers is not None:
            while not self.workers.empty():
                self.workers.get_nowait().kill()


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _settle(fut: asyncio.Future, out) -> None:
    if not fut.done():
        fut.set_result(out)


class Worker:
    """One scorer process: resolves the rewards itself, then scores what the pipe brings."""

    def __init__(self, rewards: list[str], args: dict):
        ctx = multiprocessing.get_context("spawn")  # a clean interpreter: no copy of the server's threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, rewards, args), daemon=True, name="regen-scorer")
        self.proc.start()
        child.close()
        ok, detail = self.conn.recv()  # resolving the rewards: an error here stops the service's start
        if not ok:
            self.kill()
            raise ConfigError(f"scorer worker: {detail}")

    def call(self, name: str, samples: list) -> tuple[bool, object]:
        self.conn.send((name, samples))
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


def _worker_main(conn, rewards: list[str], args: dict) -> None:
    import traceback

    _die_with_parent()
    try:
        fns = resolve_rewards(rewards, args)
    except Exception as e:  # reported to the parent, which stops
        conn.send((False, str(e)))
        return
    conn.send((True, None))
    while True:
        try:
            name, samples = conn.recv()
        except EOFError:  # the service is gone
            return
        try:
            conn.send((True, list(fns[name](samples))))
        except Exception:  # the traceback goes to the service's log
            conn.send((False, traceback.format_exc()))


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the service dies, even by SIGKILL (a worker stuck in
    its scorer would never read the closed pipe). Elsewhere the service's shutdown kills it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
