"""`ReadDeadlineProtocol`: uvicorn's HTTP/1.1 protocol with a deadline on
reading each request.

uvicorn arms a timer only between requests on a kept-alive connection (5 s
of idleness). A connection that never sends a byte, or sends its headers or
body a few bytes at a time (slowloris), holds its socket and file descriptor
for as long as the client likes, and enough of them starve the server of
descriptors. Here each request must arrive whole, headers and body, within
`read_timeout` seconds of the connection opening or of the previous response
ending (nginx bounds the same thing with client_header_timeout and
client_body_timeout). Time spent generating the answer is not bounded: the
clock stops once the request has arrived.
"""

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ReadDeadlineProtocol"]

_TIMEOUT_BODY = json.dumps({"error": "Request was not received in time", "error_type": "timeout"}).encode()


class ReadDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request has not fully
    arrived within `read_timeout` seconds (> 0). A client that sent part of
    its headers gets a 408 with TGI's error shape first; one that sent
    nothing is closed silently, as uvicorn closes an idle kept-alive
    connection; after the headers (a slow body) the route sees a disconnect."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._deadline: asyncio.TimerHandle | None = None
        self._started = False  # bytes of the awaited request have come in

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._started = True
        super().data_received(data)
        if self._deadline is not None and self._request_arrived():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request at once
        if not self.transport.is_closing() and not self._request_arrived():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _request_arrived(self) -> bool:
        """A request in progress whose headers and body are all in."""
        return self.cycle is not None and not self.cycle.response_complete and not self.cycle.more_body

    def _arm(self) -> None:
        self._disarm()
        self._started = False
        self._deadline = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._request_arrived():
            return
        if self._started and (self.cycle is None or self.cycle.response_complete):  # no route has it yet
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
        self.transport.close()
