"""The reward service's deadlines and caps against a real hanging scorer and real clients (curl,
raw sockets, httpx): a scoring call past --score-timeout-s frees its slot (threads: counted as
stuck in /healthz; processes: its worker killed and replaced), SIGTERM ends the service in bounded
time, anonymous or misdirected requests never have their bodies buffered, a trickled body is cut
off and connections are capped. Each reproduces a failure seen on main."""

import asyncio
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from regen.rewards.base import Sample
from regen.rewards.server_scoring import AllStuck, Scorers, ScoreTimeout
from tests.test_reward_service import AUTH, TOKEN
from tests.test_service_hardening import curl, rss_mb

HANG = {"id": "h", "text": "hang"}
FINE = {"id": "f", "text": "fine"}


def score(url: str, samples: list[dict]) -> httpx.Response:
    return httpx.post(f"{url}/v1/score", json={"samples": samples}, headers=AUTH, timeout=60)


def sigterm_exit_s(srv) -> float:
    t0 = time.time()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(timeout=60)
    return time.time() - t0


def workers(pid: int) -> list[int]:
    """The scorer worker processes of the service `pid` (spawned interpreters)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_call_past_its_deadline_is_stuck_until_it_returns_and_stuck_calls_are_capped():
    release = threading.Event()

    def waits(samples):
        release.wait(30)
        return [1.0 for _ in samples]

    scorers = Scorers({"w": waits}, ["w"], {}, timeout_s=0.2, processes=0, slots=2)
    sample = [Sample("p", "c")]

    loop = asyncio.new_event_loop()
    try:
        for n in (1, 2):
            with pytest.raises(ScoreTimeout):
                loop.run_until_complete(scorers.call("w", sample))
            assert scorers.stuck == n
        status, body = scorers.health()
        assert status == 503 and body["status"] == "degraded" and body["stuck_scorers"] == 2
        with pytest.raises(AllStuck):  # no more threads are started while every slot is stuck
            loop.run_until_complete(scorers.call("w", sample))
        release.set()
        deadline = time.time() + 10
        while scorers.stuck and time.time() < deadline:  # the stuck calls return and are counted off
            loop.run_until_complete(asyncio.sleep(0.05))
        assert scorers.health() == (200, {"status": "ok"})
        assert loop.run_until_complete(scorers.call("w", sample)) == [1.0]
    finally:
        loop.close()


@pytest.mark.extended  # a real hanging scorer behind a real service (~5 s): second CI tier
@pytest.mark.parametrize("service", [(["tests.reward_fixtures:hang_on_text"],
                                      ["--score-timeout-s", "1", "--max-concurrency", "2"])], indirect=True)
def test_a_hanging_scorer_thread_frees_its_slot_and_shows_in_healthz(service):
    status, _ = curl("--max-time", "0.3", "-X", "POST", f"{service.url}/v1/score", "-H", f"Authorization: Bearer {TOKEN}",
                     "-H", "Content-Type: application/json", "--data", '{"samples": [{"id": "h", "text": "hang"}]}')
    assert status == 0  # the client gave up; its call runs on to the deadline
    time.sleep(1.5)
    assert score(service.url, [FINE]).json()["results"][0]["score"] == 1.0  # its slot is free again
    health = httpx.get(f"{service.url}/healthz")
    assert health.status_code == 200 and health.json()["status"] == "degraded" and health.json()["stuck_scorers"] == 1
    t0 = time.time()
    r = score(service.url, [HANG, FINE])  # one hanging sample: the whole call ends at the deadline
    assert r.status_code == 200 and 0.8 < time.time() - t0 < 10
    assert all(x["score"] is None and "--score-timeout-s" in x["error"] for x in r.json()["results"])
    assert httpx.get(f"{service.url}/healthz").status_code == 503  # as many stuck as slots: restart it
    assert score(service.url, [FINE]).status_code == 503
    assert sigterm_exit_s(service) < 15  # the stuck threads do not hold the process


@pytest.mark.extended  # a real hanging scorer in a worker process that is killed and replaced (~8 s)
@pytest.mark.parametrize("service", [(["tests.reward_fixtures:hang_on_text"],
                                      ["--score-timeout-s", "2", "--scorer-processes", "1"])], indirect=True)
def test_a_hanging_scorer_process_is_killed_and_replaced(service):
    [first] = workers(service.proc.pid)
    r = score(service.url, [HANG])
    assert r.status_code == 200 and "--score-timeout-s" in r.json()["results"][0]["error"]
    deadline = time.time() + 60
    while httpx.get(f"{service.url}/healthz").json().get("replaced_workers") != 1 and time.time() < deadline:
        time.sleep(0.2)
    health = httpx.get(f"{service.url}/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["replaced_workers"] == 1
    assert not alive(first) and len(workers(service.proc.pid)) == 1
    assert score(service.url, [FINE]).json()["results"][0]["score"] == 1.0
    left = workers(service.proc.pid)
    assert sigterm_exit_s(service) < 15
    assert not any(alive(p) for p in left)  # no orphaned worker


@pytest.mark.extended  # raw sockets, trickled bodies, a full connection table (~5 s)
@pytest.mark.parametrize("service", [(["exact_match"], ["--body-timeout-s", "2", "--max-connections", "4"])],
                         indirect=True)
def test_bodies_are_read_only_when_authenticated_within_a_deadline_on_capped_connections(service, tmp_path):
    before = rss_mb(service.proc.pid)
    big = tmp_path / "big"
    big.write_bytes(b"x" * (24 * 1024 * 1024))
    for path in ("/healthz", "/v1/info", "/nowhere"):  # anonymous POSTs: refused from their headers
        status, _ = curl("-X", "POST", f"{service.url}{path}", "--data-binary", f"@{big}")
        assert status in (401, 404, 405), (path, status)
    assert rss_mb(service.proc.pid) < before + 50  # not buffered (24 MiB each)
    head = (f"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{").encode()
    trickling = [socket.create_connection(("127.0.0.1", service.port), timeout=20) for _ in range(3)]
    for s in trickling:
        s.sendall(head)
    time.sleep(0.3)
    assert score(service.url, [FINE]).status_code == 503  # the fourth connection: over --max-connections
    t0 = time.time()
    for s in trickling:
        s.sendall(b" ")  # a byte now and then is not enough
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408")
        try:  # and the server closes the connection (a reset, with our unread bytes in its buffer)
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        s.close()
    assert time.time() - t0 < 10
    assert score(service.url, [{**FINE, "metadata": {"answer": "fine"}}]).status_code == 200
