"""Fault-tolerant client of a reward service, usable as a reward term:

    reward:
      - name: remote
        args: {url: "http://127.0.0.1:8008", reward: exact_match, timeout_s: 10}

The token is read from the environment variable named by `auth_env` (default
REGEN_REWARD_TOKEN) or from `auth_file`; it never appears in the config or the run directory.
An `https://` url is verified against the system's CAs, or against `ca_bundle` (a PEM file).

What did not come back is *missing* (None), never zero: after the retries are spent
(connection errors, timeouts, 5xx and 429, with exponential backoff and full jitter), or
while the circuit breaker is open after repeated failures. The loop excludes missing
samples from the advantages and raises alerts / stops the run when too many are missing;
while the breaker is open it waits, probing the service, instead of spending steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from regen.errors import ConfigError, UserError
from regen.rewards.base import Sample, register
from regen.rewards.protocol import encode_media

RETRYABLE = {429, 500, 502, 503, 504}


class CircuitBreaker:
    """Open after `threshold` consecutive failed requests; while open, calls fail at once.
    After `cooldown_s` one trial request goes through (half-open): success closes it."""

    def __init__(self, threshold: int, cooldown_s: float):
        self.threshold, self.cooldown_s = threshold, cooldown_s
        self.failures, self.opened_at = 0, None
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return True
            if time.monotonic() - self.opened_at >= self.cooldown_s:
                self.opened_at = time.monotonic()  # half-open: this caller is the trial
                return True
            return False

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.failures, self.opened_at = 0, None
            else:
                self.failures += 1
                if self.failures >= self.threshold:
                    self.opened_at = time.monotonic()

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None


@register("remote", version="service", factory=True)
class RemoteReward:
    """Score through a reward service (see regen/rewards/protocol.py)."""

    def __init__(
        self,
        url: str,
        reward: str | None = None,
        auth_env: str = "REGEN_REWARD_TOKEN",
        auth_file: str | None = None,
        batch_size: int = 64,
        concurrency: int = 4,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 30.0,
        cache_size: int = 0,
        ca_bundle: str | None = None,
    ):
        if batch_size < 1 or concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ConfigError("remote reward: batch_size and concurrency >= 1, retries >= 0, timeout_s > 0")
        self.url, self.reward = url.rstrip("/"), reward
        self.batch_size, self.retries = batch_size, retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._rng = random.Random()  # jitter only; never touches the training RNG streams
        headers = {}
        token = _read_token(auth_env, auth_file)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        verify = True
        if ca_bundle is not None:  # a service with a certificate of a private CA (or self-signed)
            if not Path(ca_bundle).expanduser().is_file():
                raise ConfigError(f"remote reward: ca_bundle '{ca_bundle}' not found")
            import ssl

            verify = ssl.create_default_context(cafile=str(Path(ca_bundle).expanduser()))
        self._http = httpx.Client(headers=headers, timeout=timeout_s, verify=verify)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regen-reward")
        self.reward_version = "unknown"  # what the service reports; stored in checkpoints
        self.counters = {"requests": 0, "retries": 0, "failed_requests": 0, "cache_hits": 0, "breaker_open": 0}

    # -------------------------------------------------------------- public

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        out: list[float | None] = [None] * len(samples)
        payloads, todo = [], []
        for i, s in enumerate(samples):
            payload = _payload(i, s)
            key = self._key(payload) if self.cache_size else ""
            if key and key in self._cache:
                with self._lock:
                    out[i] = self._cache[key]
                    self._cache.move_to_end(key)
                    self.counters["cache_hits"] += 1
                continue
            payloads.append((i, key, payload))
        for start in range(0, len(payloads), self.batch_size):
            todo.append(payloads[start : start + self.batch_size])
        for chunk, scores in zip(todo, self._pool.map(self._score_chunk, todo)):
            for (i, key, _), score in zip(chunk, scores):
                out[i] = score
                if key and score is not None:
                    with self._lock:
                        self._cache[key] = score
                        while len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
        return out

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self.counters, "breaker_open": float(self.breaker.is_open)}

    def is_down(self) -> bool:
        """The circuit breaker is open: the service failed `breaker_failures` requests in a row."""
        return self.breaker.is_open

    def probe(self) -> bool:
        """Is the service answering again (GET /healthz)? Closes the breaker when it is."""
        try:
            ok = self._http.get(f"{self.url}/healthz").status_code == 200
        except httpx.TransportError:
            ok = False
        if ok:
            self.breaker.record(True)
        return ok

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()

    # -------------------------------------------------------------- internals

    def _key(self, payload: dict) -> str:
        body = {k: v for k, v in payload.items() if k != "id"}
        return hashlib.sha256(json.dumps([self.url, self.reward, body], sort_keys=True).encode()).hexdigest()

    def _score_chunk(self, chunk: list[tuple[int, str, dict]]) -> list[float | None]:
        """One request (with retries) for a chunk; None for every sample it could not score."""
        missing = [None] * len(chunk)
        if not self.breaker.allow():
            self._count("breaker_open")
            return missing
        body = {"reward": self.reward, "samples": [p for _, _, p in chunk]}
        for attempt in range(self.retries + 1):
            self._count("requests")
            wait = None
            try:
                resp = self._http.post(f"{self.url}/v1/score", json=body)
            except httpx.TransportError:  # refused, reset, timed out
                resp = None
            if resp is not None and resp.status_code == 200:
                self.breaker.record(True)
                return self._parse(resp.json(), chunk)
            if resp is not None and resp.status_code in (401, 403):
                raise UserError(f"reward service at {self.url} refused the token ({resp.status_code}); "
                                "check auth_env / auth_file")
            if resp is not None and resp.status_code not in RETRYABLE:
                break  # 4xx other than 429: retrying the same request cannot help
            if resp is not None and resp.status_code == 429:
                wait = _retry_after(resp)
            if attempt < self.retries:
                self._count("retries")
                cap = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                time.sleep(min(self.max_backoff_s, wait) if wait is not None else self._rng.uniform(0, cap))
        self._count("failed_requests")
        self.breaker.record(False)
        return missing

    def _parse(self, data: dict, chunk) -> list[float | None]:
        self.reward_version = str(data.get("scorer", {}).get("version", "unknown"))
        by_id = {r["id"]: r for r in data.get("results", [])}
        out = []
        for i, _, _ in chunk:
            r = by_id.get(str(i))
            score = None if r is None else r.get("score")
            out.append(None if score is None else float(score))
        return out

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1


def _payload(i: int, s: Sample) -> dict:
    p = {"id": str(i), "prompt": s.prompt, "text": s.completion, "metadata": _jsonable(s.meta),
         "finished": bool(s.finished)}
    if s.media is not None:
        p["media"] = encode_media(s.media)
    return p


def _jsonable(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool, type(None), list, dict))}


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers.get("retry-after", ""))
    except ValueError:
        return None


def _read_token(env: str | None, file: str | None) -> str | None:
    if file:
        p = Path(file).expanduser()
        if not p.is_file():
            raise ConfigError(f"remote reward: auth_file '{file}' not found")
        return p.read_text().strip() or None
    return os.environ.get(env) if env else None
