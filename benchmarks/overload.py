"""Overload on loopback: N requests at concurrency C against a server whose
--max-concurrent-requests is below C. Measures how fast the excess hears
429, that every admitted request finishes, what the queue metrics say, and
the router's RSS before and after.

    python -m benchmarks.overload [--requests 600 --concurrency 200 --limit 128]

starts the real launcher on a tiny random llama (the figures are about the
router, not the model) and prints one JSON line. `overload(url, ...)` is
the load itself, also used by tests/e2e/test_overload.py. Not part of
`make bench` (it measures robustness, not speed).
"""

import argparse
import asyncio
import json
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

BODY = {"inputs": "Hello, overload", "parameters": {"max_new_tokens": 8, "do_sample": False}}


@dataclass
class OverloadResult:
    ok: int                   # 200
    rejected: int             # 429
    other: dict               # any other status: count
    reject_p50_ms: float      # time to hear 429
    reject_max_ms: float
    ok_p50_ms: float
    ok_max_ms: float
    seconds: float


async def overload(url: str, requests: int, concurrency: int, body: dict = BODY) -> OverloadResult:
    """`requests` POST /generate, `concurrency` at a time, each on a new
    connection (as a flood of clients; a kept-alive one could also race the
    server's idle timeout); statuses and latencies by outcome, a connection
    that fails counted as status 0."""
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one():
            async with slots:
                start = time.perf_counter()
                try:
                    status = (await client.post(url + "/generate", json=body)).status_code
                except httpx.TransportError:
                    status = 0
                return status, time.perf_counter() - start
        start = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(requests)))
        seconds = time.perf_counter() - start
    by_status: dict[int, list[float]] = {}
    for status, latency in results:
        by_status.setdefault(status, []).append(latency)
    ok, rejected = sorted(by_status.pop(200, [])), sorted(by_status.pop(429, []))
    return OverloadResult(ok=len(ok), rejected=len(rejected), other={s: len(v) for s, v in by_status.items()},
                          reject_p50_ms=_ms(rejected, 0.5), reject_max_ms=_ms(rejected, 1.0),
                          ok_p50_ms=_ms(ok, 0.5), ok_max_ms=_ms(ok, 1.0), seconds=seconds)


def _ms(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return round(1000 * sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 1)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def metric(url: str, name: str) -> float:
    """The value of one sample line of /metrics (`name` includes its labels); 0 if absent."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from tests.e2e.router_harness import launch
    from tests.shard_harness import save_tiny_served_model

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_served_model(Path(tmp) / "tiny")
        proc, url = launch(str(model), Path(tmp), "--max-concurrent-requests", str(args.limit),
                           "--max-total-tokens", "256", "--max-input-tokens", "200")
        try:
            asyncio.run(overload(url, args.limit, args.limit))  # warm: every permit used once
            before = rss_bytes(proc.pid)
            rounds = [asdict(asyncio.run(overload(url, args.requests, args.concurrency)))
                      for _ in range(args.rounds)]
            time.sleep(1.0)
            after = rss_bytes(proc.pid)
            print(json.dumps({
                "requests": args.requests, "concurrency": args.concurrency, "limit": args.limit,
                "rounds": rounds, "rss_before_mib": round(before / 2**20, 1), "rss_after_mib": round(after / 2**20, 1),
                "queue_size_after": metric(url, "tgi_queue_size"),
                "overloaded_total": metric(url, 'tgi_request_failure{err="overloaded"}')}))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
