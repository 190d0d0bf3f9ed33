"""`regen serve-reward`: its options and the checks made before anything is served."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from regen.errors import UserError


def add_serve_parser(sub) -> None:
    sv = sub.add_parser(
        "serve-reward", help="Serve reward functions over HTTP (the reward-service protocol).",
        description="Serve registered rewards (or 'module:function') as an HTTP scoring service:\n"
        "POST /v1/score, GET /v1/info, GET /healthz, OpenAPI schema at /openapi.json and docs at\n"
        "/docs. A bearer token is required unless --no-auth: it is read from the environment\n"
        "variable named by --token-env (default REGEN_REWARD_TOKEN) or from --token-file, and is\n"
        "never logged. Listens on loopback unless --host says otherwise; beyond loopback it serves\n"
        "https (--ssl-certfile, --ssl-keyfile) unless --insecure-http says the network is trusted.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sv.add_argument("--reward", action="append", default=None, metavar="NAME",
                    help="Reward to serve (repeatable; the first is the default of requests).")
    sv.add_argument("--reward-model", metavar="PATH",
                    help="Serve the learned reward model in PATH (a sequence-classification folder, e.g. a `regen rm` "
                    "export) as 'reward_model'; same as --reward reward_model --reward-args '{path: PATH}'.")
    sv.add_argument("--reward-args", action="append", default=None, metavar="YAML",
                    help="Arguments of the --reward at the same position, as a YAML mapping, e.g. --reward clip_score "
                    "--reward-args '{model: /models/clip}' (`regen rewards` lists each reward's arguments).")
    sv.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1: this machine only).")
    sv.add_argument("--port", type=int, default=8008, help="TCP port (default 8008).")
    sv.add_argument("--token-env", default="REGEN_REWARD_TOKEN", help="Environment variable holding the token.")
    sv.add_argument("--token-file", help="File holding the token (overrides --token-env).")
    sv.add_argument("--no-auth", action="store_true", help="Serve without authentication (explicit opt-out).")
    sv.add_argument("--max-batch", type=int, default=1024, help="Most samples per request (default 1024; more: 413).")
    sv.add_argument("--max-body-mb", type=float, default=32.0, help="Largest request body in MiB (default 32; more: 413).")
    sv.add_argument("--max-concurrency", type=int, default=4,
                    help="Requests scored at once; beyond that 429 + Retry-After (default 4).")
    sv.add_argument("--cache-size", type=int, default=0, help="LRU cache of results by sample content (default 0: off).")
    sv.add_argument("--max-pixels", type=int, default=32 * 1024 * 1024,
                    help="Most decoded pixels of one image (frames x height x width of a video), read from the file's "
                    "header before decoding (default 32 Mi; more: 413).")
    sv.add_argument("--max-request-pixels", type=int, default=128 * 1024 * 1024,
                    help="Most decoded pixels of all images of one request (default 128 Mi; more: 413).")
    sv.add_argument("--header-timeout-s", type=float, default=10.0,
                    help="Close a connection that has not sent a request's headers within this (default 10).")
    sv.add_argument("--body-timeout-s", type=float, default=60.0,
                    help="A request's body must arrive whole within this (default 60; then 408 and the connection "
                    "is closed).")
    sv.add_argument("--min-body-kib-s", type=float, default=64.0,
                    help="... and at this many KiB/s or faster after its first 5 s (default 64: a client trickling "
                    "its body is cut off).")
    sv.add_argument("--max-connections", type=int, default=64,
                    help="Most open connections; beyond them 503 (default 64). Request bodies hold at most "
                    "max-connections x max-body-mb of memory.")
    sv.add_argument("--score-timeout-s", type=float, default=60.0,
                    help="Deadline of one scoring call (default 60; 0: none): past it each of its samples gets an "
                    "error and its concurrency slot is free, so a scorer that hangs cannot wedge the service.")
    sv.add_argument("--scorer-processes", type=int, default=0,
                    help="Run the scorers in this many worker processes, each with its own copy of the rewards; one "
                    "past its deadline is killed and replaced (default 0: threads of the service, where a call "
                    "past its deadline is abandoned and counted as stuck in /healthz).")
    sv.add_argument("--ssl-certfile", help="TLS certificate (PEM): serve https. With --ssl-keyfile.")
    sv.add_argument("--ssl-keyfile", help="TLS private key (PEM) of --ssl-certfile.")
    sv.add_argument("--insecure-http", action="store_true",
                    help="Allow plain http on an address other than loopback (the token then crosses the network "
                    "in clear); without it such a bind needs --ssl-certfile / --ssl-keyfile.")
    sv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def cmd_serve_reward(args) -> int:
    import os

    from regen.rewards.server import ServerConfig, create_app, serve

    token = None
    if not args.no_auth:
        if args.token_file:
            p = Path(args.token_file).expanduser()
            if not p.is_file():
                raise UserError(f"--token-file '{args.token_file}' not found")
            token = p.read_text().strip()
        else:
            token = os.environ.get(args.token_env, "").strip()
        if not token:
            raise UserError(f"no token: set ${args.token_env} or --token-file, or pass --no-auth explicitly")
        if not (token.isascii() and token.isprintable() and " " not in token):
            where = args.token_file or f"${args.token_env}"
            raise UserError(f"the token ({where}) must be printable ASCII without spaces: it travels in an HTTP header")
    for flag in ("max_batch", "max_concurrency", "max_pixels", "max_request_pixels", "max_connections"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("score_timeout_s", "scorer_processes"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} must be 0 or more, got {getattr(args, flag)}")
    for flag in ("max_body_mb", "header_timeout_s", "body_timeout_s", "min_body_kib_s"):
        if not getattr(args, flag) > 0:
            raise UserError(f"--{flag.replace('_', '-')} must be more than 0, got {getattr(args, flag)}")
    tls = args.ssl_certfile is not None or args.ssl_keyfile is not None
    if tls:
        for flag in ("ssl_certfile", "ssl_keyfile"):
            value = getattr(args, flag)
            if value is None or not Path(value).expanduser().is_file():
                raise UserError(f"--{flag.replace('_', '-')}: " + ("missing (TLS needs both files)" if value is None
                                                                   else f"'{value}' not found"))
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not loopback and not tls and not args.insecure_http:
        raise UserError(f"--host {args.host}: serving beyond this machine without TLS would send the token and the "
                        "samples in clear; pass --ssl-certfile and --ssl-keyfile, or --insecure-http on a trusted network")
    if args.no_auth and not loopback:
        print(f"warning: serving without authentication on {args.host}", file=sys.stderr)
    from regen.cli.eval import _reward_args

    if args.reward_model:
        import json

        args.reward = [*(args.reward or []), "reward_model"]
        args.reward_args = [*(args.reward_args or []), *["{}"] * (len(args.reward) - 1 - len(args.reward_args or [])),
                            json.dumps({"path": args.reward_model})]
    if not args.reward:
        raise UserError("serve-reward: name at least one --reward (or --reward-model PATH)")
    if args.reward_args and len(args.reward_args) > len(args.reward):
        raise UserError("--reward-args: each one goes with the --reward before it (more --reward-args than --reward)")
    reward_args = {name: _reward_args(args.reward_args, i) for i, name in enumerate(args.reward)}
    cfg = ServerConfig(rewards=args.reward, token=token, max_batch=args.max_batch, args=reward_args,
                       max_body_bytes=int(args.max_body_mb * 1024 * 1024), max_concurrency=args.max_concurrency,
                       cache_size=args.cache_size, max_pixels=args.max_pixels,
                       max_request_pixels=args.max_request_pixels, header_timeout_s=args.header_timeout_s,
                       body_timeout_s=args.body_timeout_s, min_body_rate=args.min_body_kib_s * 1024,
                       max_connections=args.max_connections, score_timeout_s=args.score_timeout_s,
                       scorer_processes=args.scorer_processes)
    app = create_app(cfg)  # resolves the rewards: a bad name is an error before anything is announced
    scheme = "https" if tls else "http"
    serve(cfg, args.host, args.port, args.log_level, args.ssl_certfile, args.ssl_keyfile, app=app,
          ready=lambda: print(f"serving {', '.join(args.reward)} on {scheme}://{args.host}:{args.port} "
                              f"(auth {'off' if token is None else 'on'})", file=sys.stderr, flush=True))
    return 0
