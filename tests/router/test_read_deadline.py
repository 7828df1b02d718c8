"""ReadDeadlineProtocol under a real uvicorn server: a connection whose
request does not arrive in time is closed (408 before the headers are in),
and the clock stops once a request has arrived."""

import asyncio
import functools
import json
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tgi_router.web.read_deadline import ReadDeadlineProtocol

TIMEOUT = 0.5


async def echo(request: Request) -> JSONResponse:
    try:
        body = await request.body()
    except ClientDisconnect:
        request.app.state.disconnects += 1
        raise
    await asyncio.sleep(float(request.query_params.get("think", "0")))
    return JSONResponse({"bytes": len(body)})


@pytest.fixture
def server():
    """(port, app): uvicorn with the deadline protocol, in its own loop and thread."""
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    app.state.disconnects = 0
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off",
                            http=functools.partial(ReadDeadlineProtocol, read_timeout=TIMEOUT))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1], app
    server.should_exit = True
    thread.join(5)


def connect(port: int) -> socket.socket:
    """A connection whose reads fail after 5 s (ten deadlines): a server that
    never closes it fails the test there instead of hanging it."""
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_all(s: socket.socket) -> tuple[bytes, float]:
    """(everything until the server closes, seconds it took)."""
    start, data = time.monotonic(), b""
    while chunk := s.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def response(s: socket.socket) -> tuple[bytes, bytes]:
    """(status line, body) of the next response on a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head.split(b"\r\n")[0], body


def request(path: str = "/echo", body: bytes = b"{}") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), len(body), body))


def test_a_silent_connection_is_closed_at_the_deadline(server):
    port, _ = server
    with connect(port) as s:
        data, seconds = read_all(s)
    assert data == b"" and seconds > TIMEOUT * 0.8


def test_a_request_cut_off_before_its_headers_end_gets_408_in_tgi_shape(server):
    port, _ = server
    with connect(port) as s:
        s.sendall(request()[:20])
        data, seconds = read_all(s)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert json.loads(data.split(b"\r\n\r\n", 1)[1]) == {"error": "Request was not received in time",
                                                        "error_type": "timeout"}
    assert seconds > TIMEOUT * 0.8


def test_headers_dribbled_a_byte_at_a_time_are_cut_off_at_the_deadline(server):
    port, _ = server
    with connect(port) as s:
        sent = 0
        try:
            for byte in request()[:-10]:  # never completes its headers... and body
                s.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.05)
        except OSError:  # the server closed while the client was still writing
            pass
        data, _ = read_all(s)
    assert sent < len(request()) - 10 and data.startswith(b"HTTP/1.1 408 ")


def test_a_stalled_body_closes_the_connection_and_the_route_sees_a_disconnect(server):
    port, app = server
    with connect(port) as s:
        s.sendall(request(body=b"x" * 100)[:-60])  # headers and 40 of the 100 body bytes
        data, _ = read_all(s)
    assert data == b""
    deadline = time.monotonic() + 30  # only stops a hang
    while app.state.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.state.disconnects == 1


def test_answers_slower_than_the_deadline_and_kept_alive_requests_are_served(server):
    port, _ = server
    with connect(port) as s:
        s.sendall(request("/echo?think=%g" % (TIMEOUT * 2), b'{"a": 1}'))
        # The route thinks past the deadline: the request had arrived.
        assert response(s) == (b"HTTP/1.1 200 OK", b'{"bytes":8}')
        for _ in range(3):  # kept alive: each request gets its own deadline
            time.sleep(TIMEOUT * 0.6)
            s.sendall(request(body=b"[]"))
            assert response(s) == (b"HTTP/1.1 200 OK", b'{"bytes":2}')
