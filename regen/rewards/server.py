"""`regen serve-reward`: any registered reward as an HTTP scoring service (FastAPI + uvicorn).

Self-protection, in the order a request meets it (regen/rewards/server_edge.py): only the
service's routes are served (404 / 405 from the headers); the bearer token is checked from the
headers before any byte of a body is read (constant-time compare; never logged or echoed); a
connection that does not finish sending its request headers in `header_timeout_s` is closed;
only an authenticated POST to /v1/score has its body read, up to its cap (413 beyond, declared
or streamed) and within its deadline (408); connections past `max_connections` get 503. Then
the batch size and the decoded pixels of every image (per image and per request, read from the
headers of the files before anything is decoded) are capped (413 naming the limit); a
concurrency limit answers 429 + Retry-After instead of queueing without bound; every scoring
call has a deadline, `score_timeout_s`, past which its samples get errors and its slot is free
(regen/rewards/server_scoring.py: threads or worker processes). A scorer's non-finite or
non-numeric score is that sample's error; a crashing scorer gives a 500 whose body holds only
an error id (the exception goes to the server's log under that id). Nothing in a request is
executed or unpickled: samples are JSON with strict types, media are decoded as PNG/GIF only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from regen import __version__
from regen.rewards.base import Sample, version_of
from regen.rewards.protocol import SampleIn, ScoreRequest, ScoreResponse, decode_media, media_pixels
from regen.rewards.server_edge import Guard, header_timeout
from regen.rewards.server_scoring import AllStuck, Scorers, ScoreTimeout, resolve_rewards

log = logging.getLogger("regen.reward_service")
MPX = 1024 * 1024
GRACEFUL_S = 5  # how long SIGTERM waits for requests in flight


@dataclass
class ServerConfig:
    rewards: list[str]
    token: str | None  # None only when auth was explicitly disabled
    max_batch: int = 1024
    max_body_bytes: int = 32 * 1024 * 1024
    max_concurrency: int = 4
    retry_after_s: int = 1
    cache_size: int = 0  # 0 = no cache
    args: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-reward keyword arguments
    max_pixels: int = 32 * MPX  # decoded pixels of one image (frames x height x width for a video)
    max_request_pixels: int = 128 * MPX  # decoded pixels of all images of one request
    header_timeout_s: float = 10.0  # a connection must send a request's headers within this
    body_timeout_s: float = 60.0  # ... and a request's body within this
    min_body_rate: float = 64 * 1024  # ... at this many bytes/s or faster (after server_edge.BODY_GRACE_S)
    max_connections: int = 64  # open connections; beyond them uvicorn answers 503
    score_timeout_s: float = 60.0  # deadline of one scoring call (0 = none)
    scorer_processes: int = 0  # 0: scorers run in threads of the service; N: in N worker processes


class TooManyPixels(Exception):
    pass


def create_app(cfg: ServerConfig) -> FastAPI:
    fns = resolve_rewards(cfg.rewards, cfg.args)
    scorers = Scorers(fns, cfg.rewards, cfg.args, cfg.score_timeout_s, cfg.scorer_processes, cfg.max_concurrency)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        scorers.close()  # here, not after uvicorn.run: uvicorn re-raises SIGTERM once shut down

    app = FastAPI(title="regen reward service", version=__version__, lifespan=lifespan,
                  description=(__doc__ or "") + "\n\nProtocol: see regen/rewards/protocol.py.")
    state = {"inflight": 0, "served": 0, "cache_hits": 0, "timed_out": 0}
    cache: OrderedDict[str, tuple[float | None, str | None]] = OrderedDict()
    token = cfg.token.encode() if cfg.token is not None else None

    @app.exception_handler(RequestValidationError)
    async def readable_422(_request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            if err["type"] == "json_invalid":
                parts.append(f"request body is not valid JSON (at character {err['loc'][-1]})")
                continue
            loc = ".".join(str(x) for x in err["loc"] if x != "body") or "body"
            parts.append(f"{loc}: {err['msg']}")
        return JSONResponse({"detail": "; ".join(parts)}, status_code=422)

    @app.get("/healthz")
    async def healthz():
        status, body = scorers.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/info")  # the token: checked by Guard before the request reaches here
    async def info():
        return {
            "rewards": [{"name": n, "kind": getattr(f, "reward_kind", "scalar"), "version": version_of(f)}
                        for n, f in fns.items()],
            "limits": {"max_batch": cfg.max_batch, "max_body_bytes": cfg.max_body_bytes,
                       "max_concurrency": cfg.max_concurrency, "max_pixels": cfg.max_pixels,
                       "max_request_pixels": cfg.max_request_pixels},
            "stats": dict(state),
            "regen_version": __version__,
        }

    @app.post("/v1/score", response_model=ScoreResponse)
    async def score(body: ScoreRequest):
        name = body.reward or cfg.rewards[0]
        if name not in fns:
            return JSONResponse({"detail": f"reward: '{name}' is not served here (served: {', '.join(fns)})"},
                                status_code=422)
        if len(body.samples) > cfg.max_batch:
            return JSONResponse({"detail": f"samples: batch of {len(body.samples)} exceeds max_batch "
                                           f"{cfg.max_batch}"}, status_code=413)
        if state["inflight"] >= cfg.max_concurrency:
            return JSONResponse({"detail": "scorer saturated, retry later"}, status_code=429,
                                headers={"Retry-After": str(cfg.retry_after_s)})
        state["inflight"] += 1
        try:
            fn = fns[name]
            results, todo = await run_in_threadpool(_prepare, fn, name, body.samples, cache, cfg, state)
            if todo:
                try:
                    scores = await scorers.call(name, [t[1] for t in todo])
                except ScoreTimeout:
                    state["timed_out"] += 1
                    scores = None
                _finish(fn, results, todo, scores, cache, cfg)
        except TooManyPixels as e:
            return JSONResponse({"detail": str(e)}, status_code=413)
        except AllStuck as e:
            return JSONResponse({"detail": str(e)}, status_code=503, headers={"Retry-After": "60"})
        except Exception:  # the scorer itself crashed: a server error, the client retries
            error_id = uuid.uuid4().hex[:12]  # its text stays here: it may tell a caller about the scorer
            log.exception("scorer '%s' failed (error id %s)", name, error_id)
            return JSONResponse({"detail": f"scorer '{name}' failed; error id {error_id} (see the service's log)",
                                 "error_id": error_id}, status_code=500)
        finally:
            state["inflight"] -= 1
        state["served"] += len(results)
        kind = getattr(fns[name], "reward_kind", "scalar")
        # built as plain JSON: the response model documents the schema (OpenAPI) without
        # re-validating every result on the way out
        return JSONResponse({"scorer": {"name": name, "version": version_of(fns[name]), "kind": kind},
                             "results": results})

    app.add_middleware(Guard, limit=cfg.max_body_bytes, token=token, body_timeout_s=cfg.body_timeout_s,
                       min_body_rate=cfg.min_body_rate)
    return app


_SAMPLES = TypeAdapter(list[SampleIn])


def _prepare(fn, name: str, raw: list[dict], cache: OrderedDict, cfg: ServerConfig, state: dict) -> tuple[list, list]:
    """Parse, check and decode a batch: (results so far, the samples left to score as (index, Sample,
    cache key, sample id))."""
    cache_size = cfg.cache_size
    results: list[dict | None] = [None] * len(raw)
    try:  # fast path: the whole batch is well-formed
        parsed: list[SampleIn | None] = _SAMPLES.validate_python(raw)
    except ValidationError:  # find the bad ones; each gets its own error, the rest is scored
        parsed = []
        for i, item in enumerate(raw):
            try:
                parsed.append(SampleIn.model_validate(item))
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in err["loc"]) or "sample"
                sid = str(item.get("id", i)) if isinstance(item, dict) else str(i)
                results[i] = _result(fn, sid, None, f"samples.{i}.{where}: {err['msg']}")
                parsed.append(None)
    # the pixels of every image, from the files' headers, before anything is decoded
    pixels: dict[int, int] = {}
    for i, s in enumerate(parsed):
        if s is not None and s.media is not None:
            try:
                pixels[i] = media_pixels(s.media, cfg.max_pixels)
            except ValueError as e:
                results[i] = _result(fn, s.id, None, f"samples.{i}: {e}")
    for i, n in pixels.items():
        if n > cfg.max_pixels:
            raise TooManyPixels(f"samples.{i}.media: {n} pixels exceed the limit of {cfg.max_pixels} per image "
                                "(--max-pixels)")
    if sum(pixels.values()) > cfg.max_request_pixels:
        raise TooManyPixels(f"samples: {sum(pixels.values())} pixels of images in one request exceed the limit of "
                            f"{cfg.max_request_pixels} (--max-request-pixels)")
    todo: list[tuple[int, Sample, str, str]] = []  # (index, sample, cache key, sample id)
    for i, s in enumerate(parsed):
        if s is None or results[i] is not None:
            continue
        try:
            media = decode_media(s.media) if s.media is not None else None
        except ValueError as e:
            results[i] = _result(fn, s.id, None, f"samples.{i}: {e}")
            continue
        key = ""
        if cache_size:
            key = hashlib.sha256(json.dumps([name, {k: v for k, v in raw[i].items() if k != "id"}],
                                            sort_keys=True, default=str).encode()).hexdigest()
            if key in cache:
                cache.move_to_end(key)
                state["cache_hits"] += 1
                results[i] = _result(fn, s.id, *cache[key])
                continue
        todo.append((i, Sample(s.prompt, s.text or "", s.metadata, s.finished, media), key, s.id))
    return results, todo


def _finish(fn, results: list, todo: list, scores: list | None, cache: OrderedDict, cfg: ServerConfig) -> None:
    """The scorer's answers into `results` (and the cache); scores None: the call ran past its deadline."""
    if scores is None:
        error = f"the scorer did not finish within {cfg.score_timeout_s:g} s (--score-timeout-s)"
        for i, _, _, sid in todo:
            results[i] = _result(fn, sid, None, error)
        return
    scores = list(scores)
    if len(scores) != len(todo):
        raise RuntimeError(f"returned {len(scores)} scores for {len(todo)} samples")
    for (i, _, key, sid), score in zip(todo, scores):
        score, error = _checked(score)
        results[i] = _result(fn, sid, score, error)
        if cfg.cache_size and error is None:  # a failure is not remembered: the next request tries again
            cache[key] = (score, error)
            while len(cache) > cfg.cache_size:
                cache.popitem(last=False)


def _checked(score) -> tuple[float | None, str | None]:
    """(score, error) of what a scorer returned for one sample: a finite number, or an error."""
    if score is None:
        return None, "the scorer returned no score"
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        try:
            score = float(score)  # numpy / torch scalars
        except (TypeError, ValueError):
            return None, f"the scorer returned a non-numeric score of type {type(score).__name__}"
    if not math.isfinite(score):
        return None, f"the scorer returned a non-finite score ({score})"
    return float(score), None


def _result(fn, sid: str, score: float | None, error: str | None) -> dict:
    label = None
    if score is not None and getattr(fn, "reward_kind", "scalar") == "binary":
        label = int(score >= 0.5)
    return {"id": sid, "score": score, "label": label, "error": error}


def serve(cfg: ServerConfig, host: str, port: int, log_level: str = "warning", ssl_certfile: str | None = None,
          ssl_keyfile: str | None = None, app=None, ready=None) -> None:
    """Run the service (app: built by create_app already, e.g. so that a bad --reward fails before
    anything is announced; ready(): called once the rewards are resolved)."""
    import uvicorn

    app = app or create_app(cfg)
    if ready is not None:
        ready()
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # access_log off: request lines are harmless, but a service of ours logs nothing it does not need;
    # SIGTERM waits at most GRACEFUL_S for requests in flight (a stuck scorer's thread is a daemon)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                http=header_timeout(cfg.header_timeout_s), limit_concurrency=cfg.max_connections,
                timeout_graceful_shutdown=GRACEFUL_S, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
