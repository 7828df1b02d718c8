"""Faults lose nothing: clients that hang up mid-stream are cancelled within
a step and their KV blocks come back; a slow reader stalls nobody else; a
shard that hangs mid-step (SIGSTOP) hits the step deadline, every request in
flight ends with an error, /health turns 503 and the launcher exits 1."""

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from benchmarks.overload import metric
from tgi_router.scheduling.engine import Engine

from ..router.test_read_deadline import request
from ..shard_harness import save_tiny_served_model
from .router_harness import RunningServer, launch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    return tmp, str(save_tiny_served_model(tmp / "tiny", eos_token_id=None))  # never stops early


@pytest.fixture(scope="module")
def server(model):
    tmp, path = model
    with RunningServer(tmp / "s", path, max_total_tokens=256, max_input_tokens=200) as s:
        yield s


class EngineLog:
    """When each step started and when each request (by its inputs) was cancelled."""

    def __init__(self, monkeypatch):
        self.steps: list[float] = []
        self.cancels: dict[str, float] = {}
        step, cancel = Engine.step, Engine.cancel

        async def logged_step(engine):
            self.steps.append(time.perf_counter())
            return await step(engine)

        def logged_cancel(engine, stream):
            self.cancels.setdefault(stream.request.inputs, time.perf_counter())
            return cancel(engine, stream)
        monkeypatch.setattr(Engine, "step", logged_step)
        monkeypatch.setattr(Engine, "cancel", logged_cancel)

    def steps_between(self, start: float, end: float) -> int:
        return sum(start < t < end for t in self.steps)


async def stream_client(url: str, prompt: str, hang_up_after: int | None) -> dict:
    """Streams 30 tokens, or hangs up after `hang_up_after` of them."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 30}}
    events = []
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url + "/generate_stream", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == hang_up_after:
                        hung_up = time.perf_counter()
                        break
            else:
                hung_up = None
    return {"prompt": prompt, "events": events, "hung_up": hung_up}


def test_clients_that_hang_up_are_cancelled_within_a_step_and_blocks_return(server, monkeypatch):
    log = EngineLog(monkeypatch)
    rng = random.Random(0)
    clients = 20
    quitters = set(rng.sample(range(clients), k=clients * 3 // 10))  # 30%

    async def go():
        return await asyncio.gather(*(
            stream_client(server.url, f"client {i}", rng.randint(1, 25) if i in quitters else None)
            for i in range(clients)))
    results = asyncio.run(go())

    for i, r in enumerate(results):
        if i in quitters:
            cancelled = log.cancels.get(r["prompt"])
            assert cancelled is not None, r["prompt"]
            # Within a step, or within 50 ms where the tiny model's steps
            # (~6 ms on our float32 GEMM) are shorter than the time the
            # server takes to see the socket close (measured up to ~12 ms).
            assert log.steps_between(r["hung_up"], cancelled) <= 1 or cancelled - r["hung_up"] < 0.05
        else:
            assert len(r["events"]) == 30 and r["events"][-1]["generated_text"] is not None
            assert r["prompt"] not in log.cancels
    capacity = metric(server.url, "tgi_kv_cache_blocks_capacity")
    deadline = time.monotonic() + 5
    while metric(server.url, "tgi_kv_cache_blocks_free") != capacity and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server.url, "tgi_kv_cache_blocks_free") == capacity
    assert metric(server.url, "tgi_queue_size") == 0


def test_a_client_that_does_not_read_stalls_nobody(server):
    """Its events wait in its own queue (at most max_new_tokens of them);
    the engine never waits for a client."""
    body = {"inputs": "slow reader", "parameters": {"max_new_tokens": 60}}
    with httpx.Client(timeout=60) as slow, slow.stream("POST", server.url + "/generate_stream", json=body) as r:
        start = time.monotonic()

        async def others():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(server.url + "/generate", json={
                    "inputs": f"other {i}", "parameters": {"max_new_tokens": 8}}) for i in range(6)))
        assert all(o.status_code == 200 for o in asyncio.run(others()))
        assert time.monotonic() - start < 20
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 60 and json.loads(events[-1][5:])["generated_text"] is not None


def test_a_hung_shard_fails_every_request_at_the_step_deadline_and_the_launcher_exits_1(model):
    tmp, path = model
    (tmp / "hung").mkdir()
    proc, url = launch(path, tmp / "hung", "--step-timeout", "2")
    shard = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
    outcomes: dict[str, str] = {}
    # Set by each stream at its first token: the hang must come mid-generation,
    # and a fixed sleep lets a fast step finish all 900 tokens first.
    started = {"stream": threading.Event(), "chat stream": threading.Event()}

    def streaming(name: str, route: str, body: dict):
        with httpx.stream("POST", url + route, json=body, timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    started[name].set()
        outcomes[name] = events[-1]

    def plain(name: str, route: str, body: dict):
        r = httpx.post(url + route, json=body, timeout=60)
        outcomes[name] = f"{r.status_code} {r.text}"
    long = {"inputs": "Hello", "parameters": {"max_new_tokens": 900}}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 900}
    calls = [(streaming, "stream", "/generate_stream", long), (plain, "generate", "/generate", long),
             (plain, "chat", "/v1/chat/completions", chat),
             (streaming, "chat stream", "/v1/chat/completions", {**chat, "stream": True})]
    threads = [threading.Thread(target=f, args=a) for f, *a in calls]
    try:
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        os.kill(shard, signal.SIGSTOP)
        stopped = time.monotonic()
        for t in threads:
            t.join(15)
        assert time.monotonic() - stopped < 2 + 5
        assert sorted(outcomes) == ["chat", "chat stream", "generate", "stream"]
        assert outcomes["generate"].startswith("424") and outcomes["chat"].startswith("424")
        assert '"error_type"' in outcomes["stream"] and "error" in outcomes["chat stream"]
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        os.kill(shard, signal.SIGCONT)  # so that it stops at once when the launcher stops it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(shard, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_slow_clients_are_cut_off_at_the_read_deadline_and_hold_nothing(model):
    """Slowloris: 40 connections that send part of a request (or nothing, or
    a body that stalls) are closed at --request-read-timeout, while a normal
    client is served; no route fails on the cut-off bodies."""
    tmp, path = model
    proc, url = launch(path, tmp / "slowloris", "--request-read-timeout", "1")
    port = int(url.rsplit(":", 1)[1])
    body = b'{"inputs": "Hello", "parameters": {"max_new_tokens": 4}}'
    whole = request("/generate", body)
    partial = [b"", whole[:30], whole[:len(whole) - len(body) + 10]]  # nothing, part of the headers, of the body
    try:
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
        start = time.monotonic()
        for i, s in enumerate(sockets):
            s.sendall(partial[i % 3])
        assert httpx.post(url + "/generate", content=body, headers={"content-type": "application/json"},
                          timeout=10).status_code == 200
        answers = []
        for s in sockets:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            answers.append(data.split(b"\r\n")[0])
            s.close()
        assert time.monotonic() - start < 1 + 5
        assert answers == [[b"", b"HTTP/1.1 408 Request Timeout", b""][i % 3] for i in range(40)]
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    log = (tmp / "slowloris" / "launcher.log").read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
