"""How bytes reach the engine: one small interface, two implementations.

``Transport.send(method, path, body)`` → an open :class:`RawResponse` (status known, body not yet
read). :class:`SocketTransport` is the production one: HTTP/1.1 over asyncio streams with a
keep-alive pool and the C parser ``httptools``. Measured on this machine (instant stub engine,
c=1), forwarding one chat call cost ~0.17 ms of CPU this way against ~1.6 ms through
``httpx.AsyncClient`` and ~0.43 ms through aiohttp — the httpx client alone was more than the whole
capture path's budget. :class:`HttpxTransport` adapts any ``httpx.AsyncBaseTransport``, so unit
tests drive the same client code with an ``httpx.MockTransport`` and no sockets.

Failures are left as the standard exceptions (``OSError``, ``TimeoutError``,
``ConnectionError``, :class:`ProtocolError`); :class:`~capture_proxy.upstream.client.Upstream`
translates them, once, into the service's errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

import httptools
import httpx

_READ_SIZE = 65536
#: Idle connections older than this are not reused (uvicorn, which vLLM runs on, closes idle
#: keep-alive connections after 5 s; reusing one it is closing would fail the request). Every
#: client of the engine keeps to it (httpx's own default, 5 s, is the same as uvicorn's).
ENGINE_IDLE_S = 4.0
#: How long ``RawResponse.finish`` waits for the end of a stream after its ``[DONE]`` (vLLM sends
#: both in the same write or right after; beyond this the connection is closed, not reused).
FINISH_TIMEOUT_S = 0.05


class ProtocolError(Exception):
    """The engine sent something that is not HTTP/1.1."""


class RawResponse(Protocol):
    status_code: int

    async def read_some(self) -> bytes:
        """The body's next bytes as they arrive (what one read brought, all of it), ``b""``
        once the body is complete. A relay awaits this once per piece: no iterator layers."""
        ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Read what is left of a response whose body the caller has all of (a stream after
        its ``[DONE]``: the chunked encoding's end), waiting at most ``timeout_s``, so that its
        connection can serve the next request."""
        ...

    async def aclose(self) -> None: ...


class Transport(Protocol):
    async def send(self, method: str, path: str, body: bytes | None) -> RawResponse: ...

    async def aclose(self) -> None: ...


# -- sockets ----------------------------------------------------------------------------------


class _Parser:
    """httptools callbacks: the status line, headers and body pieces of one response."""

    def __init__(self) -> None:
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.chunks: deque[bytes] = deque()
        self.parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()  # only valid before the message ends

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise ProtocolError(f"malformed HTTP response: {exc}") from exc


class _ReadWatch:
    """The read timeout of one connection: a read that waits longer than ``timeout_s`` for
    data fails with ``TimeoutError`` (the connection's reader is failed, so it is never reused).

    One timer serves all of the connection's reads: a read only notes when it began, and the
    timer, when it fires, either fails the read still waiting since then or sets itself for that
    read's deadline. ``asyncio.timeout`` around each read (a timer made and cancelled per read:
    ~20 µs of CPU) cost a streamed call, whose every token is a read, ~0.4 ms.
    """

    __slots__ = ("began", "loop", "reader", "timeout_s", "timer")

    def __init__(self, reader: asyncio.StreamReader, timeout_s: float) -> None:
        self.reader = reader
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.began: float | None = None  # when the read now waiting began (None: none waits)
        self.timer: asyncio.TimerHandle | None = None

    async def read(self) -> bytes:
        began = self.began = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(began + self.timeout_s, self._check)
        try:
            return await self.reader.read(_READ_SIZE)
        finally:
            self.began = None

    def _check(self) -> None:
        self.timer = None
        began = self.began
        if began is None:  # no read waits; the next one sets the timer again
            return
        deadline = began + self.timeout_s
        if self.loop.time() >= deadline:
            self.reader.set_exception(
                TimeoutError(f"the engine sent nothing for {self.timeout_s:g} s")
            )
        else:
            self.timer = self.loop.call_at(deadline, self._check)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Connection:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read_timeout_s: float
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.watch = _ReadWatch(reader, read_timeout_s)
        #: The next bytes the engine sent (b"" at the end), waiting at most the read timeout.
        self.read = self.watch.read
        self.idle_since = time.monotonic()

    def reusable(self) -> bool:
        return (
            not self.reader.at_eof()
            and self.reader.exception() is None  # (a read that timed out as its data came)
            and not self.writer.is_closing()
            and time.monotonic() - self.idle_since < ENGINE_IDLE_S
        )

    def close(self) -> None:
        self.watch.stop()
        self.writer.close()


class _SocketResponse:
    def __init__(
        self,
        pool: SocketTransport,
        conn: _Connection,
        parser: _Parser,
    ) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self._parser = parser
        self.status_code = parser.parser.get_status_code()

    async def _fill(self) -> bool:
        """Read from the socket into the parser; False once the response is complete."""
        if self._parser.complete:
            return False
        assert self._conn is not None
        data = await self._conn.read()
        if not data:
            raise ConnectionError("the engine closed the connection mid-response")
        self._parser.feed(data)
        return True

    def _take(self) -> bytes:
        """The body pieces parsed so far, as one: what one read brought is handed on at once
        (an engine's stream that came whole is one piece, not one per chunk of its encoding)."""
        chunks = self._parser.chunks
        if len(chunks) == 1:
            return chunks.popleft()
        taken = b"".join(chunks)
        chunks.clear()
        return taken

    async def read_some(self) -> bytes:
        try:
            while not self._parser.chunks:
                if not await self._fill():
                    self._release()
                    return b""
            return self._take()
        except BaseException:
            self._release()
            raise

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        # (left early by its reader, it keeps the connection: finish() or aclose() decides)
        while piece := await self.read_some():
            yield piece

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        conn = self._conn
        if conn is None or self._parser.complete:
            return
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(timeout_s):
                while not self._parser.complete:
                    data = await conn.reader.read(_READ_SIZE)
                    if not data:
                        return
                    self._parser.feed(data)
        self._parser.chunks.clear()  # past the end of the stream the caller read

    async def aclose(self) -> None:
        self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._parser.complete and self._parser.keep_alive:
            self._pool.put_back(conn)
        else:  # closing mid-response aborts the engine's request (vLLM stops generating)
            conn.close()


class SocketTransport:
    """HTTP/1.1 keep-alive connections to one engine base URL."""

    def __init__(self, base_url: str, *, connect_timeout_s: float, read_timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(
                f"the engine URL must be http://host[:port][/prefix], got {base_url!r}"
            )
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []
        self._head = f"host: {self.host}:{self.port}\r\n"
        self.extra_headers = ""

    def put_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def _connection(self) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable():
                return conn, True
            conn.close()
        async with asyncio.timeout(self.connect_timeout_s):
            reader, writer = await asyncio.open_connection(self.host, self.port)
        return _Connection(reader, writer, self.read_timeout_s), False

    async def send(self, method: str, path: str, body: bytes | None) -> RawResponse:
        for attempt in (0, 1):
            conn, reused = await self._connection()
            try:
                return await self._exchange(conn, method, path, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                conn.close()
                # A reused connection the engine had just closed: nothing was answered, so the
                # request was not processed; send it once more on a fresh connection.
                if not reused or attempt:
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def _exchange(
        self, conn: _Connection, method: str, path: str, body: bytes | None
    ) -> RawResponse:
        payload = body or b""
        head = (
            f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}{self.extra_headers}"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        )
        conn.writer.write(head.encode("latin-1") + payload)
        parser = _Parser()
        while not parser.headers_done:
            data = await conn.read()
            if not data:
                raise ConnectionError("the engine closed the connection before answering")
            parser.feed(data)
        return _SocketResponse(self, conn, parser)

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


# -- httpx (unit tests with httpx.MockTransport) --------------------------------------------------


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self._pieces: AsyncGenerator[bytes, None] | None = None

    async def read_some(self) -> bytes:
        if self._pieces is None:
            self._pieces = self.aiter_bytes()
        return await anext(self._pieces, b"")

    async def aiter_bytes(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._response.aiter_bytes():
                if chunk:  # (b"" is the end, for read_some)
                    yield chunk
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise TimeoutError(str(exc)) from exc
        except (httpx.HTTPError, httpx.StreamError) as exc:
            raise ConnectionError(repr(exc)) from exc
        finally:
            await self._response.aclose()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        return None  # httpx reuses its connections by itself

    async def aclose(self) -> None:
        if self._pieces is not None:  # (read_some's iterator, left at a piece: closed now)
            await self._pieces.aclose()
        await self._response.aclose()


class HttpxTransport:
    """Any ``httpx.AsyncBaseTransport`` (e.g. ``httpx.MockTransport``) as a :class:`Transport`."""

    def __init__(self, base_url: str, transport: httpx.AsyncBaseTransport, **kw: float) -> None:
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), transport=transport)
        self.extra_headers: dict[str, str] = {}

    async def send(self, method: str, path: str, body: bytes | None) -> RawResponse:
        request = self._client.build_request(
            method,
            path,
            content=body,
            headers={"content-type": "application/json", **self.extra_headers},
        )
        try:
            return _HttpxResponse(await self._client.send(request, stream=True))
        except httpx.TimeoutException as exc:
            raise TimeoutError(str(exc)) from exc
        except httpx.HTTPError as exc:
            raise ConnectionError(repr(exc)) from exc

    async def aclose(self) -> None:
        await self._client.aclose()
