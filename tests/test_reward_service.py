"""The reward service as a real server process on loopback, and the client the loop uses."""

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from regen.cli import main
from regen.rewards import Sample
from regen.rewards.builtin import brightness, exact_match
from regen.rewards.client import RemoteReward
from tests.conftest import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *rewards, extra=(), port=None, ca=None):
        """ca: the PEM the service's TLS certificate is checked against (https)."""
        self.port = port or free_port()
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{self.port}"
        self.args = [a for r in rewards for a in ("--reward", r)] + list(extra)
        self.proc, self.verify = None, ssl.create_default_context(cafile=str(ca)) if ca else True

    def start(self):
        env = {**os.environ, "REGEN_REWARD_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "regen", "serve-reward", *self.args,
                                      "--port", str(self.port)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5, verify=self.verify).status_code == 200:
                    return self
            except httpx.TransportError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise RuntimeError(f"server did not start: {self.stop()}")

    def stop(self) -> str:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        out = self.proc.communicate(timeout=10)[0] if self.proc else ""
        return out


@pytest.fixture()
def server(request):
    srv = Server(*request.param[0], extra=request.param[1] if len(request.param) > 1 else ()).start()
    yield srv
    log = srv.stop()
    assert TOKEN not in log  # the token is never logged


def text_samples():
    return [Sample("5+7=", c, {"answer": "12"}) for c in ("12", "13", " 12", "1")]


def image_samples():
    rng = np.random.default_rng(0)
    return [Sample("red", "", {}, True, rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(5)]


def client(url, **kw):
    kw.setdefault("backoff_s", 0.01)
    return RemoteReward(url, auth_env="TEST_TOKEN_ENV", **kw)


@pytest.fixture(autouse=True)
def token_env(monkeypatch):
    monkeypatch.setenv("TEST_TOKEN_ENV", TOKEN)


@pytest.mark.parametrize("server", [(["exact_match", "brightness"],)], indirect=True)
def test_scores_equal_in_process_for_text_and_images(server):
    assert client(server.url, reward="exact_match")(text_samples()) == exact_match(text_samples())
    imgs = image_samples()
    remote = client(server.url, reward="brightness")(imgs)
    assert remote == pytest.approx(brightness(imgs), abs=1e-12)
    info = httpx.get(f"{server.url}/v1/info", headers=AUTH).json()
    assert {r["name"]: r["kind"] for r in info["rewards"]} == {"exact_match": "binary", "brightness": "scalar"}
    assert httpx.get(f"{server.url}/openapi.json").status_code == 200


@pytest.mark.parametrize("server", [(["exact_match"],)], indirect=True)
def test_token_required(server):
    body = {"samples": [{"id": "a", "text": "1", "metadata": {"answer": "1"}}]}
    assert httpx.post(f"{server.url}/v1/score", json=body).status_code == 401
    wrong = httpx.post(f"{server.url}/v1/score", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and TOKEN not in wrong.text
    ok = httpx.post(f"{server.url}/v1/score", json=body, headers=AUTH)
    assert ok.status_code == 200
    assert ok.json()["results"] == [{"id": "a", "score": 1.0, "label": 1, "error": None}]
    assert ok.json()["scorer"] == {"name": "exact_match", "version": "1", "kind": "binary"}


@pytest.mark.parametrize("server", [(["exact_match"], ["--max-body-mb", "0.01", "--max-batch", "4"])],
                         indirect=True)
def test_size_limits(server):
    big = {"samples": [{"id": "a", "text": "x" * 20000}]}
    r = httpx.post(f"{server.url}/v1/score", json=big, headers=AUTH)
    assert r.status_code == 413 and "exceeds" in r.json()["detail"]
    many = {"samples": [{"id": str(i), "text": "1"} for i in range(5)]}
    r = httpx.post(f"{server.url}/v1/score", json=many, headers=AUTH)
    assert r.status_code == 413 and "max_batch 4" in r.json()["detail"]


@pytest.mark.parametrize("server", [(["exact_match"],)], indirect=True)
def test_malformed_requests_name_the_field(server):
    r = httpx.post(f"{server.url}/v1/score", content=b'{"samples": [', headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["detail"]
    r = httpx.post(f"{server.url}/v1/score", json={"samples": 5}, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"].startswith("samples:")
    r = httpx.post(f"{server.url}/v1/score", json={"samples": [], "rewrad": "x"}, headers=AUTH)
    assert r.status_code == 422 and "rewrad" in r.json()["detail"]
    # one bad sample gets its own error; the rest of the batch is scored
    body = {"samples": [{"id": "ok", "text": "3", "metadata": {"answer": "3"}}, {"id": "bad", "text": 7},
                        {"id": "img", "media": {"type": "png", "data": "bm90IGEgcG5n"}}]}
    res = httpx.post(f"{server.url}/v1/score", json=body, headers=AUTH).json()["results"]
    assert res[0]["score"] == 1.0
    assert res[1]["score"] is None and "samples.1.text" in res[1]["error"]
    assert res[2]["score"] is None and "not a readable PNG" in res[2]["error"]


@pytest.mark.parametrize("server", [(["tests.reward_fixtures:slow_exact"], ["--max-concurrency", "1"])],
                         indirect=True)
def test_saturated_server_answers_429_with_retry_after(server):
    body = {"samples": [{"id": "a", "text": "1"}]}
    with ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/score", json=body, headers=AUTH), range(3)))
    assert sorted(r.status_code for r in codes)[0] == 200
    refused = [r for r in codes if r.status_code == 429]
    assert refused and all(r.headers["retry-after"] == "1" for r in refused)


@pytest.mark.parametrize("server", [(["tests.reward_fixtures:slow_exact"],)], indirect=True)
def test_slow_server_times_out_and_retries_then_missing(server):
    c = client(server.url, timeout_s=0.05, retries=2)
    assert c(text_samples()) == [None] * 4  # never 0.0
    assert c.stats()["retries"] == 2 and c.stats()["failed_requests"] == 1


@pytest.mark.parametrize("server", [(["tests.reward_fixtures:crashing"],)], indirect=True)
def test_server_error_retries_then_missing(server):
    r = httpx.post(f"{server.url}/v1/score", json={"samples": [{"id": "a"}]}, headers=AUTH)
    # the client learns an error id; what the scorer raised stays in the service's log under it
    assert r.status_code == 500 and "scorer exploded" not in r.text and "RuntimeError" not in r.text
    error_id = r.json()["error_id"]
    assert error_id in r.json()["detail"]
    c = client(server.url, retries=3)
    assert c(text_samples()) == [None] * 4
    assert c.stats()["requests"] == 4 and c.stats()["retries"] == 3
    log = server.stop()
    assert f"error id {error_id}" in log and "scorer exploded" in log


@pytest.mark.extended  # a service killed and started again (~9 s): second CI tier, keeps scripts/test.sh short
def test_killed_server_then_back_with_circuit_breaker():
    srv = Server("exact_match").start()
    c = client(srv.url, retries=1, breaker_failures=2, breaker_cooldown_s=0.5)
    assert c(text_samples()) == exact_match(text_samples())
    srv.stop()
    assert c(text_samples()) == [None] * 4
    assert c(text_samples()) == [None] * 4
    assert c.stats()["breaker_open"] == 1.0
    before = c.stats()["requests"]
    assert c(text_samples()) == [None] * 4  # open: fails at once, no request sent
    assert c.stats()["requests"] == before
    back = Server("exact_match", port=srv.port).start()
    time.sleep(0.6)  # cooldown over: the half-open trial succeeds and closes the breaker
    try:
        assert c(text_samples()) == exact_match(text_samples())
        assert c.stats()["breaker_open"] == 0.0
    finally:
        back.stop()


def test_wrong_token_stops_with_a_clear_error(monkeypatch):
    srv = Server("exact_match").start()
    try:
        monkeypatch.setenv("TEST_TOKEN_ENV", "wrong")
        with pytest.raises(Exception, match="refused the token"):
            client(srv.url)(text_samples())
    finally:
        srv.stop()


def test_client_cache_skips_repeat_requests():
    srv = Server("exact_match").start()
    try:
        c = client(srv.url, cache_size=100)
        first = c(text_samples())
        assert c(text_samples()) == first and c.stats()["cache_hits"] == 4 and c.stats()["requests"] == 1
    finally:
        srv.stop()


def _train(base, run, url, *extra, backoff_s=0.01):
    # during an outage each step spends its retries' backoff, so the outage spans a few steps
    reward = f"reward=[{{name: remote, args: {{url: '{url}', auth_env: TEST_TOKEN_ENV, retries: 2, " \
             f"backoff_s: {backoff_s}, max_backoff_s: {backoff_s}, timeout_s: 2, breaker_failures: 1000}}}}]"
    return main(["train", f"model.path={base}", f"run.dir={run}", "log.progress=none", "data.eval=null",
                 "rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=4",
                 "log.tensorboard=false", reward, *extra])


@pytest.mark.extended  # a server killed and restarted under a run (9 s): second CI tier, keeps scripts/test.sh short
def test_training_survives_a_server_that_dies_and_returns(base_model, tmp_path):
    srv = Server("tests.reward_fixtures:quick_exact").start()
    back = Server("tests.reward_fixtures:quick_exact", port=srv.port)

    def outage():
        time.sleep(1.0)
        srv.stop()
        time.sleep(1.5)
        back.start()

    t = threading.Thread(target=outage)
    t.start()
    try:
        assert _train(base_model, tmp_path, srv.url, "train.steps=80", "health.stop_after_unscored_steps=1000",
                      backoff_s=0.4) == 0
    finally:
        t.join()
        back.stop()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    lost = [r for r in rows if r["reward/missing_frac"] == 1.0]
    assert lost, "the outage should have left steps without scores"
    assert all(r["reward/mean"] is None and r.get("update_skipped") == 1.0 for r in lost)  # missing, never 0
    assert rows[-1]["reward/missing_frac"] == 0.0 and rows[-1]["reward/mean"] is not None  # recovered
    kinds = {a["kind"] for a in read_jsonl(tmp_path / "alerts.jsonl")}
    assert "reward_missing" in kinds
    state = json.loads(sorted((tmp_path / "checkpoints").iterdir())[-1].joinpath("state.json").read_text())
    assert state["reward_versions"] == {"remote": "unversioned"}  # the served function's version


