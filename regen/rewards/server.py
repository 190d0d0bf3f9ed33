"""`regen serve-reward`: any registered reward as an HTTP scoring service (FastAPI + uvicorn).

Self-protection: bearer token compared in constant time (never logged or echoed), caps on
body bytes and batch size, a concurrency limit that answers 429 + Retry-After instead of
queueing without bound, and an optional LRU cache keyed by sample content. Nothing in a
request is executed or unpickled: samples are JSON, media are decoded as PNG/GIF only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from regen import __version__
from regen.rewards.base import Sample, resolve, version_of
from regen.rewards.protocol import SampleIn, ScoreRequest, ScoreResponse, decode_media


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


class BodyLimit:
    """ASGI middleware: 413 as soon as a request body is known to exceed the cap, whether the
    client declared its length or streams it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await _too_large(self.limit, send)


class _BodyTooLarge(Exception):
    pass


async def _too_large(limit: int, send) -> None:
    await JSONResponse({"detail": f"request body exceeds {limit} bytes"}, status_code=413)(
        {"type": "http"}, None, send
    )


def create_app(cfg: ServerConfig) -> FastAPI:
    fns = {}
    for name in cfg.rewards:
        fn = resolve(name, where="--reward")
        if getattr(fn, "reward_factory", False):
            fn = fn(**cfg.args.get(name, {}))
        fns[name] = fn
    app = FastAPI(title="regen reward service", version=__version__,
                  description=(__doc__ or "") + "\n\nProtocol: see regen/rewards/protocol.py.")
    state = {"inflight": 0, "served": 0, "cache_hits": 0}
    cache: OrderedDict[str, tuple[float | None, str | None]] = OrderedDict()
    token = cfg.token.encode() if cfg.token is not None else None

    def require_token(request: Request) -> None:
        """A dependency: runs before the body is parsed, so a caller without the token learns
        nothing about the request format."""
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token)):
            raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})

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
        return {"status": "ok"}

    @app.get("/v1/info", dependencies=[Depends(require_token)])
    async def info():
        return {
            "rewards": [{"name": n, "kind": getattr(f, "reward_kind", "scalar"), "version": version_of(f)}
                        for n, f in fns.items()],
            "limits": {"max_batch": cfg.max_batch, "max_body_bytes": cfg.max_body_bytes,
                       "max_concurrency": cfg.max_concurrency},
            "stats": dict(state),
            "regen_version": __version__,
        }

    @app.post("/v1/score", response_model=ScoreResponse, dependencies=[Depends(require_token)])
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
            results = await run_in_threadpool(_score_batch, fn, name, body.samples, cache, cfg.cache_size, state)
        except Exception as e:  # the scorer itself crashed: a server error, the client retries
            return JSONResponse({"detail": f"scorer '{name}' failed: {type(e).__name__}: {e}"}, status_code=500)
        finally:
            state["inflight"] -= 1
        state["served"] += len(results)
        kind = getattr(fns[name], "reward_kind", "scalar")
        # built as plain JSON: the response model documents the schema (OpenAPI) without
        # re-validating every result on the way out
        return JSONResponse({"scorer": {"name": name, "version": version_of(fns[name]), "kind": kind},
                             "results": results})

    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    return app


_SAMPLES = TypeAdapter(list[SampleIn])


def _score_batch(fn, name: str, raw: list[dict], cache: OrderedDict, cache_size: int, state: dict) -> list[dict]:
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
    todo: list[tuple[int, Sample, str]] = []
    for i, s in enumerate(parsed):
        if s is None:
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
        todo.append((i, Sample(s.prompt, s.text or "", s.metadata, s.finished, media), key))
    if todo:
        scores = list(fn([t[1] for t in todo]))
        if len(scores) != len(todo):
            raise RuntimeError(f"returned {len(scores)} scores for {len(todo)} samples")
        for (i, _, key), score in zip(todo, scores):
            score = None if score is None or score != score else float(score)
            error = None if score is not None else "the scorer returned no score"
            results[i] = _result(fn, parsed[i].id, score, error)
            if cache_size:
                cache[key] = (score, error)
                while len(cache) > cache_size:
                    cache.popitem(last=False)
    return results  # type: ignore[return-value]


def _result(fn, sid: str, score: float | None, error: str | None) -> dict:
    label = None
    if score is not None and getattr(fn, "reward_kind", "scalar") == "binary":
        label = int(score >= 0.5)
    return {"id": sid, "score": score, "label": label, "error": error}


def serve(cfg: ServerConfig, host: str, port: int, log_level: str = "warning") -> None:
    import uvicorn

    # access_log off: request lines are harmless, but a service of ours logs nothing it does not need
    uvicorn.run(create_app(cfg), host=host, port=port, log_level=log_level, access_log=False)
