"""The router <-> shard transport: generate.proto's messages in
length-prefixed frames over a unix socket, one connection a shard.

    request:  u32 size of the rest | u32 call id | u8 method | request message
    answer:   u32 size of the rest | u32 call id | u8 status | answer message,
                                                             or UTF-8 details

(little-endian). Calls on a connection are answered in any order, matched
by id; the server runs each call in a task of its own, so a Step sent ahead
(async scheduling) waits in the servicer while a Health is answered.
Statuses keep gRPC's codes and names.

Why not gRPC, which this replaced: grpc.aio spent the client's CPU on every
call, more the longer an answer took (its pollers run while it waits), and
the shard's event loop time in its server; both processes share the cores
with the shard's OpenMP threads, so all of it came off the model's time
(figures: docs/tuning.md#router-shard-transport). A frame here costs a
read, a protobuf parse and a write."""

import asyncio
import contextlib
import enum
import logging
import os
import struct
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError, Message

from . import generate_pb2 as pb

log = logging.getLogger("tgi_proto")

_HEADER = struct.Struct("<IIB")   # size of the rest, call id, method or status
_AFTER_SIZE = _HEADER.size - 4     # header bytes that the size field counts
MAX_MESSAGE = 256 << 20
# method byte -> (name, request type, answer type): generate.proto's service, in its order
METHODS = tuple((m.name, getattr(pb, m.input_type.name), getattr(pb, m.output_type.name))
                for m in pb.DESCRIPTOR.services_by_name["TextGenerationService"].methods)
_METHOD_IDS = {name: (i, answer) for i, (name, _, answer) in enumerate(METHODS)}


class StatusCode(enum.IntEnum):
    """gRPC's status codes, the ones the contract uses."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14


class RpcError(Exception):
    """A call that failed: raised by a handler to answer with `code`, and by
    Channel.call when the answer is one, or when no answer can come."""

    def __init__(self, code: StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


def _frame(call_id: int, kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(_AFTER_SIZE + len(payload), call_id, kind) + payload


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """(call id, method or status, payload); IncompleteReadError at EOF."""
    size, call_id, kind = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if not _AFTER_SIZE <= size <= _AFTER_SIZE + MAX_MESSAGE:
        raise ConnectionError(f"frame of {size} bytes")
    return call_id, kind, await reader.readexactly(size - _AFTER_SIZE)


Handler = Callable[[Message], Awaitable[Message]]


class Server:
    """Serves `handlers` (method name -> async function of the request that
    returns the answer or raises RpcError) on a unix socket."""

    def __init__(self, handlers: dict[str, Handler]):
        self._handlers = handlers
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._connection, path, limit=1 << 20)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        calls: set[asyncio.Task] = set()
        try:
            while True:
                call_id, method, payload = await _read_frame(reader)
                task = asyncio.ensure_future(self._answer(writer, call_id, method, payload))
                calls.add(task)
                task.add_done_callback(calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except asyncio.CancelledError:
            # stop() cancels it: ending normally, not cancelled, since asyncio's
            # stream callback (Python 3.11) asks a cancelled task for its
            # exception and logged a CancelledError traceback at every shutdown.
            pass
        finally:
            for task in calls:
                task.cancel()
            writer.close()
            self._tasks.discard(asyncio.current_task())

    async def _answer(self, writer: asyncio.StreamWriter, call_id: int, method: int, payload: bytes) -> None:
        try:
            if method >= len(METHODS) or METHODS[method][0] not in self._handlers:
                raise RpcError(StatusCode.UNKNOWN, f"no method {method}")
            name, request_type, _ = METHODS[method]
            try:
                request = request_type.FromString(payload)
            except DecodeError as err:
                raise RpcError(StatusCode.INVALID_ARGUMENT, f"cannot parse {request_type.__name__}: {err}") from err
            frame = _frame(call_id, StatusCode.OK, (await self._handlers[name](request)).SerializeToString())
        except RpcError as err:
            frame = _frame(call_id, err.code, err.details.encode())
        except Exception as err:  # a status, never a dropped call
            log.exception("call failed")
            frame = _frame(call_id, StatusCode.INTERNAL, f"{type(err).__name__}: {err}".encode())
        if not writer.is_closing():
            writer.write(frame)
            with contextlib.suppress(ConnectionError):  # the client left meanwhile
                await writer.drain()


class Channel:
    """A client connection to one server, opened at the first call and again
    after it drops. `call` raises RpcError: the server's status, UNAVAILABLE
    when the socket cannot be reached or closes before the answer, or
    DEADLINE_EXCEEDED past `timeout` seconds."""

    def __init__(self, path: str):
        self.path = path
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._connecting = asyncio.Lock()

    async def connect(self) -> asyncio.StreamWriter:
        """Opens the connection unless open; RpcError UNAVAILABLE if it cannot."""
        async with self._connecting:
            if self._writer is None:
                try:
                    reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
                except OSError as err:
                    raise RpcError(StatusCode.UNAVAILABLE, f"cannot connect to unix://{self.path}: "
                                                           f"{os.strerror(err.errno) if err.errno else err}") from err
                self._writer = writer
                self._reading = asyncio.ensure_future(self._read(reader, writer))
            return self._writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                call_id, status, payload = await _read_frame(reader)
                future = self._pending.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result((status, payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(RpcError(StatusCode.UNAVAILABLE, "the shard closed the connection"))

    async def call(self, method: str, request: Message, timeout: float | None = None) -> Message:
        method_id, answer_type = _METHOD_IDS[method]
        writer = await self.connect()
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        call_id = self._next_id
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        writer.write(_frame(call_id, method_id, request.SerializeToString()))
        try:
            status, payload = await (future if timeout is None else asyncio.wait_for(future, timeout))
        except TimeoutError:
            raise RpcError(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            self._pending.pop(call_id, None)
        if status != StatusCode.OK:
            try:
                code = StatusCode(status)
            except ValueError:
                code = StatusCode.UNKNOWN
            raise RpcError(code, payload.decode(errors="replace"))
        return answer_type.FromString(payload)

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)
            self._reading = None
