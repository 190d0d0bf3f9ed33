"""Scored samples per second through the reward service vs the same function in-process.

For scorers of three costs (exact_match, ~1 us; +100 us; +1 ms of CPU per sample) and
request batches of 1 and 64, it scores the same text samples in-process and through a real
`regen serve-reward` process on loopback (with auth, via the client the training loop uses),
and prints throughput, the service/in-process ratio and the client overhead per sample
((service time - in-process time) / samples). Both sides run on this machine's cores.

    python bench/reward_service.py [--samples 2048] [--concurrency 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SCORERS = {"exact_match": "exact_match", "exact+100us": "bench.scorers:exact_100us", "exact+1ms": "bench.scorers:exact_1ms"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(reward: str, token: str, concurrency: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "REGEN_REWARD_TOKEN": token, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "regen", "serve-reward", "--reward", reward, "--port", str(port),
                             "--max-concurrency", str(concurrency)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def rate(fn, samples, batch: int, repeat: int = 3) -> float:
    """Best of `repeat` passes: samples per second scoring `samples` in calls of `batch`."""
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(0, len(samples), batch):
            out = fn(samples[i : i + batch])
            assert None not in out, "a sample came back unscored"
        best = max(best, len(samples) / (time.perf_counter() - t0))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=4, help="client requests in flight (and server limit)")
    p.add_argument("--out")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from regen.rewards import Sample, resolve
    from regen.rewards.client import RemoteReward

    samples = [Sample(f"{i % 97}+{i % 89}=", str(i % 97 + i % 89 + (i % 3 == 0)), {"answer": str(i % 97 + i % 89)})
               for i in range(a.samples)]
    token = "bench-token"
    os.environ["BENCH_TOKEN"] = token
    rows = []
    for label, name in SCORERS.items():
        local = resolve(name)
        proc, url = start(name, token, a.concurrency)
        try:
            for batch in (1, 64):
                n = samples[: 256] if batch == 1 or label == "exact+1ms" else samples
                client = RemoteReward(url, auth_env="BENCH_TOKEN", batch_size=batch, concurrency=a.concurrency)
                remote_rate = rate(client, n, batch * a.concurrency)  # one call keeps `concurrency` requests busy
                client.close()
                local_rate = rate(local, n, batch)
                overhead_us = 1e6 * (1 / remote_rate - 1 / local_rate)
                rows.append({"scorer": label, "batch": batch, "in_process_per_s": local_rate,
                             "service_per_s": remote_rate, "ratio": remote_rate / local_rate,
                             "client_overhead_us_per_sample": overhead_us})
        finally:
            proc.kill()
            proc.wait()
    print(f"{'scorer':<13}{'batch':>6}{'in-process/s':>15}{'service/s':>12}{'ratio':>8}{'overhead us/sample':>20}")
    for r in rows:
        print(f"{r['scorer']:<13}{r['batch']:>6}{r['in_process_per_s']:>15.0f}{r['service_per_s']:>12.0f}"
              f"{r['ratio']:>8.2f}{r['client_overhead_us_per_sample']:>20.1f}")
    print(f"(client concurrency {a.concurrency}; {os.cpu_count()} CPUs; best of 3 passes)")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
