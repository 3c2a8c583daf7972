"""A small HTTP/1.1 client for streamed (server-sent events) responses, on asyncio streams.

bench_serving's clients read every chunk of 64 concurrent streams in one Python process; with
httpx that process spent more CPU than the server it measured (5.3 s against the server's ~3 s
for 65k tokens on the 2-core CPU machine: benchmarks/RESULTS.md, "Ninth session"), so its own
delays entered TTFT and throughput. This client does only what the benchmark needs: one
keep-alive connection per client, a JSON POST, the status line and headers, then the body
(chunked or with a Content-Length) as lines.

    conn = SSEConnection("127.0.0.1", 8000)
    status, lines = await conn.post("/v1/chat/completions", {"messages": [...], "stream": True})
    async for line in lines: ...      # "data: {...}" lines, blank lines included
    await conn.close()
"""
import asyncio
import json
from typing import AsyncIterator
from urllib.parse import urlsplit


class SSEConnection:
    """One keep-alive connection, opened at the first request and reopened when the server closes it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @classmethod
    def of_url(cls, url: str) -> "SSEConnection":
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"an http://host:port URL is needed, got {url!r}")
        return cls(parts.hostname, parts.port or 80)

    async def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, AsyncIterator[str]]:
        """Send a JSON POST (with extra `headers`); returns the status and the response body's
        lines (read them all before the next request on this connection)."""
        await self.connect()
        data = json.dumps(body).encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self._writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                           f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{extra}"
                           f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        status, headers = await self._read_head()
        return status, self._lines(headers)

    async def connect(self) -> None:
        """Open the connection unless it is open."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        status_line = await self._reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while (line := await self._reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _lines(self, headers: dict[str, str]) -> AsyncIterator[str]:
        pending = b""
        async for data in self._body(headers):
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.decode()
        if headers.get("connection", "").lower() == "close":
            await self.close()

    async def _body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await self._reader.readline()).split(b";")[0], 16):
                yield (await self._reader.readexactly(size + 2))[:-2]  # the chunk and its CRLF
            while await self._reader.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
        elif "content-length" in headers:
            yield await self._reader.readexactly(int(headers["content-length"]))
        else:  # the body runs to the end of the connection
            yield await self._reader.read()
            await self.close()
