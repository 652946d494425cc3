"""Bench plumbing: an instant vLLM-shaped stub engine and a lean HTTP/1.1 load client.

Both are raw asyncio so that they cost little CPU next to the process being measured (the proxy):
the stub answers every request with a canned vLLM chat answer (``prompt_token_ids``,
``choices[].token_ids``, logprobs, usage), or, for ``"stream": true``, with ``chunks`` SSE chunks
and ``[DONE]``; the client keeps one connection per worker and times each request.

Run the stub as its own process: ``python benchmarks/loadkit.py stub --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PROMPT_LEN = 64
COMPLETION_LEN = 20


def agent_chat(turns: int = 20, *, stream: bool = False) -> bytes:
    """An agent harness's chat request as OpenCode sends them mid-task (~50 KB): a ~9.7k-character
    system prompt, 10 tools, then ``turns`` rounds of user message → assistant tool call → tool
    result (61 messages with the default). The stub answers it as any other request."""
    tool: dict[str, Any] = {
        "type": "function",
        "function": {
            "description": "Reads part of a file of the workspace. " * 12,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "the file's path"},
                    "limit": {"type": "integer", "description": "lines to read"},
                },
                "required": ["path"],
            },
        },
    }
    tools = [{**tool, "function": {**tool["function"], "name": f"tool{i}"}} for i in range(10)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent that edits code carefully.\n" * 220}
    ]
    for i in range(turns):
        arguments = json.dumps({"path": f"src/module_{i}.py", "limit": 200})
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "tool1", "arguments": arguments},
        }
        source = "def f(x):\n    return x\n" * 40
        messages += [
            {"role": "user", "content": f"Step {i}: fix the bug in src/module_{i}.py. " * 8},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": source},
        ]
    body: dict[str, Any] = {"model": "stub", "messages": messages, "tools": tools}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def _chat_answer(prompt_len: int, completion_len: int) -> bytes:
    content = [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}] * completion_len
    body = {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "prompt_token_ids": list(range(1, prompt_len + 1)),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a" * completion_len},
                "logprobs": {"content": content},
                "finish_reason": "stop",
                "token_ids": list(range(100, 100 + completion_len)),
            }
        ],
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_len,
            "total_tokens": prompt_len + completion_len,
        },
    }
    return json.dumps(body).encode()


def _stream_chunks(prompt_len: int, completion_len: int) -> list[bytes]:
    chunks = []
    for i in range(completion_len):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": "a"} if i else {"role": "assistant", "content": "a"},
            "logprobs": {
                "content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]
            },
            "finish_reason": "stop" if i == completion_len - 1 else None,
            "token_ids": [100 + i],
        }
        chunk: dict[str, Any] = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "stub",
            "choices": [choice],
        }
        if i == 0:
            chunk["prompt_token_ids"] = list(range(1, prompt_len + 1))
        chunks.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return chunks


class StubEngine(asyncio.Protocol):
    """HTTP/1.1 keep-alive; answers by the body's ``stream`` flag; 404 for anything but chat."""

    whole = _chat_answer(PROMPT_LEN, COMPLETION_LEN)
    stream = _stream_chunks(PROMPT_LEN, COMPLETION_LEN)
    #: Seconds between streamed chunks; 0 writes the whole stream at once. A real engine sends
    #: each token when it is sampled, so the proxy reads (and relays) one chunk at a time.
    chunk_interval_s = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport  # uvloop's transports are not asyncio.Transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            self._answer(head.split(" ", 2)[1], body)

    def _write(self, data: bytes) -> None:
        if not self.transport.is_closing():  # the client may be gone before the stream ends
            self.transport.write(data)

    def _answer(self, path: str, body: bytes) -> None:
        if not path.endswith("/chat/completions"):
            self.transport.write(
                b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                b"content-length: 2\r\n\r\n{}"
            )
            return
        if b'"stream":true' in body.replace(b" ", b""):
            parts = [b"%x\r\n%s\r\n" % (len(c), c) for c in self.stream]
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            head += b"transfer-encoding: chunked\r\n\r\n"
            if not self.chunk_interval_s:
                self.transport.write(head + b"".join(parts) + b"0\r\n\r\n")
                return
            loop = asyncio.get_running_loop()
            self.transport.write(head)
            for i, part in enumerate([*parts, b"0\r\n\r\n"]):
                loop.call_later(i * self.chunk_interval_s, self._write, part)
            return
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(self.whole), self.whole)
        )


async def serve_stub(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(StubEngine, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# -- the load client ---------------------------------------------------------------------------


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, path: str, body: bytes, headers: Sequence[tuple[str, str]] = ()
    ) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        self.writer.write(
            (
                f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{extra}\r\n"
            ).encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        if "content-length" in fields:
            payload = await self.reader.readexactly(int(fields["content-length"]))
        else:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                parts.append(await self.reader.readexactly(size + 2))
                if size == 0:
                    break
            payload = b"".join(p[:-2] for p in parts)
        if fields.get("connection") == "close":
            await self.close()
        return status, payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def run_load(
    host: str,
    port: int,
    paths: Sequence[str],
    body: bytes,
    concurrency: int,
    duration_s: float,
    headers: Sequence[tuple[str, str]] = (),
) -> tuple[Result, float]:
    """``concurrency`` workers, requests round robin over ``paths``, for ``duration_s``."""
    result = Result()
    deadline = time.perf_counter() + duration_s
    counter = iter(range(10**12))

    async def worker() -> None:
        conn = Connection(host, port)
        try:
            while time.perf_counter() < deadline:
                path = paths[next(counter) % len(paths)]
                start = time.perf_counter()
                try:
                    status, _ = await conn.request(path, body, headers)
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    result.errors += 1
                    await conn.close()
                    continue
                result.latencies.append(time.perf_counter() - start)
                result.statuses[status] = result.statuses.get(status, 0) + 1
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result, time.perf_counter() - start


def process_cpu_s(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads), or of one of its threads
    (``thread=pid``: the main thread, which runs the event loop)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path, encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def process_run_s(pid: int) -> float:
    """CPU seconds of a process's live threads to the nanosecond (``/proc/.../schedstat``; the
    user and system times of ``process_cpu_s`` are counted in clock ticks, 10 ms). A thread that
    has ended is no longer counted: for the proxy's long-lived threads, over short windows."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
            total += int(fh.read().split()[0])
    return total / 1e9


def process_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    stub = sub.add_parser("stub", help="run the stub engine")
    stub.add_argument("--port", type=int, required=True)
    stub.add_argument(
        "--chunk-interval-ms", type=float, default=0.0, help="gap between streamed chunks"
    )
    args = parser.parse_args()
    if args.command == "stub":
        StubEngine.chunk_interval_s = args.chunk_interval_ms / 1000
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(serve_stub(args.port))


if __name__ == "__main__":
    main()
