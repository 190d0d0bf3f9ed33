"""The reward service against hostile or careless clients and settings, with real clients:
curl, raw sockets, httpx, and the loop's own client. Each reproduces a failure seen on main."""

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from regen.rewards.builtin import exact_match
from regen.rewards.client import RemoteReward
from tests.test_reward_service import AUTH, ROOT, TOKEN, Server, free_port, text_samples

CURL = ["curl", "-s", "-o", "/dev/stderr", "-w", "%{http_code}", "--max-time", "20"]


def curl(*args: str) -> tuple[int, str]:
    """(status, body) of a curl request."""
    done = subprocess.run([*CURL, *args], capture_output=True, text=True)
    return int(done.stdout or 0), done.stderr


def png(h: int, w: int) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format="PNG", optimize=True)
    return {"type": "png", "data": base64.b64encode(buf.getvalue()).decode()}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.parametrize("service", [(["exact_match"], ["--max-body-mb", "1"])], indirect=True)
def test_unauthenticated_requests_get_401_and_nothing_else(service, tmp_path):
    url = f"{service.url}/v1/score"
    assert curl("-X", "POST", url, "-H", "Content-Type: application/json", "--data", "{not json")[0] == 401
    big = tmp_path / "big.json"
    big.write_bytes(b"x" * (3 * 1024 * 1024))  # over the body cap, and not JSON
    status, body = curl("-X", "POST", url, "--data-binary", f"@{big}")
    assert status == 401 and "bearer" in body
    assert curl("-X", "POST", url, "-H", "Authorization: Bearer nope", "--data", "{}")[0] == 401
    assert curl(f"{service.url}/v1/info")[0] == 401
    # with the token: the same bodies reach the size check and the parser
    auth = f"Authorization: Bearer {TOKEN}"
    assert curl("-X", "POST", url, "-H", auth, "--data-binary", f"@{big}")[0] == 413
    status, body = curl("-X", "POST", url, "-H", auth, "-H", "Content-Type: application/json", "--data", "{not json")
    assert status == 422 and "not valid JSON" in body


@pytest.mark.parametrize("service", [(["exact_match"], ["--max-body-mb", "1"])], indirect=True)
def test_a_chunked_body_over_the_cap_is_413(service, tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"1," * (700 * 1024) + b"1]")
    status, body = curl("-X", "POST", f"{service.url}/v1/score", "-H", f"Authorization: Bearer {TOKEN}",
                        "-H", "Transfer-Encoding: chunked", "-H", "Content-Type: application/json",
                        "--data-binary", f"@{big}")
    assert status == 413 and "--max-body-mb" in body


@pytest.mark.parametrize("service", [(["brightness"], ["--max-request-pixels", str(40 * 1024 * 1024)])],
                         indirect=True)
def test_image_sizes_are_checked_from_their_headers_before_decoding(service):
    before = rss_mb(service.proc.pid)
    bomb = {"id": "0", "media": png(9000, 9000)}  # ~300 KB of PNG, 81 Mpx decoded
    r = httpx.post(f"{service.url}/v1/score", json={"samples": [bomb]}, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "--max-pixels" in r.json()["detail"] and "samples.0" in r.json()["detail"]
    assert rss_mb(service.proc.pid) < before + 100  # never decoded (it would take ~250 MB)
    three = [{"id": str(i), "media": png(4000, 4000)} for i in range(3)]  # 16 Mpx each, 48 in all
    r = httpx.post(f"{service.url}/v1/score", json={"samples": three}, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "--max-request-pixels" in r.json()["detail"]
    small = [{"id": "0", "media": png(16, 16)}]
    assert httpx.post(f"{service.url}/v1/score", json={"samples": small}, headers=AUTH).status_code == 200


def test_an_image_too_large_for_pillow_to_open_is_named_by_its_real_size():
    import struct
    import zlib

    from regen.rewards.protocol import Media, media_pixels

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    head = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))  # 10^10 pixels declared
    gif = (b"GIF89a" + struct.pack("<HHBBB", 60000, 50000, 0, 0, 0)  # logical screen, then one frame's descriptor
           + b"," + struct.pack("<HHHHB", 0, 0, 60000, 50000, 0) + b"\x02\x02\x4c\x01\x00;")
    for raw, pixels in ((head, 100000 * 100000), (gif, 60000 * 50000)):
        media = Media(type="png" if raw is head else "gif", data=base64.b64encode(raw).decode())
        assert media_pixels(media, 32 * 1024 * 1024) == pixels  # not the cap + 1


@pytest.mark.parametrize("service", [(["tests.reward_fixtures:unruly"], ["--cache-size", "10"])], indirect=True)
def test_non_finite_and_non_numeric_scores_are_per_sample_errors(service):
    samples = [{"id": str(i), "text": f"t{i}"} for i in range(5)]
    for _ in range(2):  # the second time partly from the cache: the same answer
        r = httpx.post(f"{service.url}/v1/score", json={"samples": samples}, headers=AUTH)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["score"] for x in results] == [None, None, None, None, 0.5]
        assert "non-finite" in results[0]["error"] and "non-finite" in results[1]["error"]
        assert "non-numeric" in results[2]["error"] and results[4]["error"] is None


@pytest.mark.parametrize("service", [(["exact_match"],)], indirect=True)
def test_sample_fields_have_strict_types(service):
    samples = [{"id": "0", "text": "12", "metadata": {"answer": "12"}, "finished": "yes"},
               {"id": "1", "text": "12", "metadata": {"answer": "12"}, "finished": True}]
    results = httpx.post(f"{service.url}/v1/score", json={"samples": samples}, headers=AUTH).json()["results"]
    assert results[0]["score"] is None and "finished" in results[0]["error"]
    assert results[1]["score"] == 1.0


@pytest.mark.parametrize("service", [(["exact_match"], ["--header-timeout-s", "1"])], indirect=True)
def test_a_client_that_never_finishes_its_headers_is_disconnected(service):
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as s:
        s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\n")  # and then nothing more
        t0 = time.time()
        assert s.recv(1024) == b""  # closed by the server
        assert time.time() - t0 < 5
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as s:
        t0 = time.time()
        assert s.recv(1024) == b"" and time.time() - t0 < 5  # a connection that sends nothing at all


def _serve(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "regen", "serve-reward", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "REGEN_REWARD_TOKEN": TOKEN, **(env or {})})


def test_bad_settings_are_refused_before_serving(monkeypatch, capsys):
    from regen.cli import main

    port = str(free_port())
    for args, token, message in [
        (["--max-body-mb", "-1"], TOKEN, "--max-body-mb must be more than 0"),
        (["--max-pixels", "0"], TOKEN, "--max-pixels must be at least 1"),
        ([], "tökén", "printable ASCII"),
        (["--host", "0.0.0.0"], TOKEN, "without TLS"),
        (["--ssl-certfile", "/no/such.pem"], TOKEN, "--ssl-certfile: '/no/such.pem' not found"),
    ]:
        monkeypatch.setenv("REGEN_REWARD_TOKEN", token)
        assert main(["serve-reward", "--reward", "exact_match", "--port", port, *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "serving exact_match" not in err and TOKEN not in err, (args, err)
    # the real command: one line, the reward resolved before anything is announced
    done = _serve("--reward", "no_such_reward", "--port", port)
    assert done.returncode == 2 and "no_such_reward" in done.stderr and "serving no_such" not in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl)."""
    d = tmp_path_factory.mktemp("tls")
    done = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"),
                           "-out", str(d / "cert.pem")], capture_output=True)
    if done.returncode:
        pytest.skip(f"openssl could not make a certificate: {done.stderr[-200:]}")
    return d / "cert.pem", d / "key.pem"


def test_tls_service_and_client(certificate, monkeypatch):
    cert, key = certificate
    srv = Server("exact_match", extra=["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)], ca=cert).start()
    try:
        status, body = curl("--cacert", str(cert), f"{srv.url}/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert curl(f"{srv.url}/healthz")[0] == 0  # curl refuses a certificate it cannot verify
        monkeypatch.setenv("TEST_TOKEN_ENV", TOKEN)
        good = RemoteReward(srv.url, auth_env="TEST_TOKEN_ENV", ca_bundle=str(cert))
        assert good(text_samples()) == exact_match(text_samples())
        unverified = RemoteReward(srv.url, auth_env="TEST_TOKEN_ENV", retries=0, breaker_failures=100)
        assert unverified(text_samples()) == [None] * 4  # the system CAs do not know it: missing, never trusted
    finally:
        log = srv.stop()
    assert "serving exact_match on https://" in log and TOKEN not in log


# ------------------------------------------------------------------ the loop during an outage


def _remote(url: str, **kw) -> str:
    args = {"url": f"'{url}'", "auth_env": "TEST_TOKEN_ENV", "retries": 1, "backoff_s": 0.01, "timeout_s": 2,
            "breaker_failures": 2, "breaker_cooldown_s": 600, **kw}
    return "reward=[{name: remote, args: {" + ", ".join(f"{k}: {v}" for k, v in args.items()) + "}}]"


def _train(base, run, *extra) -> list[str]:
    return ["train", f"model.path={base}", f"run.dir={run}", "log.progress=none", "data.eval=null",
            "log.tensorboard=false", "rollout.global_batch_size=16", "rollout.group_size=4",
            "rollout.max_new_tokens=4", *extra]


@pytest.mark.extended  # a run that waits out a service outage (8 s): second CI tier, keeps scripts/test.sh short
def test_the_loop_waits_for_a_service_that_is_down_instead_of_spending_steps(base_model, tmp_path, monkeypatch):
    import threading

    from regen.cli import main
    from tests.conftest import read_jsonl

    monkeypatch.setenv("TEST_TOKEN_ENV", TOKEN)
    srv = Server("tests.reward_fixtures:quick_exact").start()
    back = Server("tests.reward_fixtures:quick_exact", port=srv.port)
    run = tmp_path / "run"

    def outage():  # down after step 5, up again 3 s later
        deadline = time.time() + 120
        while time.time() < deadline and not ((run / "metrics.jsonl").exists()
                                              and len((run / "metrics.jsonl").read_text().splitlines()) >= 5):
            time.sleep(0.02)
        srv.stop()
        time.sleep(3)
        back.start()

    t = threading.Thread(target=outage)
    t.start()
    try:
        assert main(_train(base_model, run, _remote(srv.url), "train.steps=30", "health.stop_after_unscored_steps=3",
                           "health.reward_patience_s=60")) == 0
    finally:
        t.join()
        back.stop()
    rows = read_jsonl(run / "metrics.jsonl")
    unscored = [r["step"] for r in rows if r["reward/missing_frac"] == 1.0]
    assert 1 <= len(unscored) <= 2  # the steps that opened the breaker; then the loop waited
    kinds = [a["kind"] for a in read_jsonl(run / "alerts.jsonl")]
    assert "reward_service_down" in kinds and "reward_service_back" in kinds
    assert [r["step"] for r in rows] == list(range(1, 31)) and rows[-1]["reward/missing_frac"] == 0.0


def test_a_service_that_stays_down_stops_the_run_with_a_checkpoint_and_no_false_version_alert(
        base_model, tmp_path, monkeypatch, capsys):
    from regen.cli import main
    from tests.conftest import read_jsonl

    monkeypatch.setenv("TEST_TOKEN_ENV", TOKEN)
    port = free_port()
    run = tmp_path / "run"
    args = _train(base_model, run, _remote(f"http://127.0.0.1:{port}"), "train.steps=6",
                  "health.reward_patience_s=1.5")
    assert main(args) == 2  # nothing listens there from the start
    assert "did not come back in 1.5 s" in capsys.readouterr().err
    # two steps opened the breaker (2 failed requests), then the loop waited before step 3
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    state = json.loads((run / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert state["reward_versions"] == {"remote": "unknown"}  # it never answered
    srv = Server("tests.reward_fixtures:quick_exact", port=port).start()
    try:
        assert main(args) == 0  # resumed with the service up: its version is now known
    finally:
        srv.stop()
    assert "scorer_version_changed" not in [a["kind"] for a in read_jsonl(run / "alerts.jsonl")]
