"""A read-only HTTP server for a local directory, with Range support.

It stands in for a slow remote store in tests and in `tierflow demo` (put a throttled
`LoopbackProxy` in front of it to get an L4 with a chosen bandwidth).
"""

from __future__ import annotations

import os
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from tierflow.testing.lifecycle import ThreadedHTTPService

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class DirectoryServer(ThreadedHTTPService):
    """Serves the files under `root` for GET and HEAD; never lists, writes or leaves `root`."""

    thread_name = "tierflow-dirserver"

    def __init__(self, root: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 0):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise NotADirectoryError(f"cannot serve {self.root}: not a directory")
        super().__init__((host, port))

    def _make_server(self) -> ThreadingHTTPServer:
        return _DirectoryHTTPServer(self._bind, _DirectoryHandler, self.root)

    def _not_started(self) -> str:
        return f"server for {self.root} is not started"


def serve_directory(root: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 0) -> DirectoryServer:
    """Start serving `root` read-only over HTTP; stop it with `.stop()` or a `with` block."""
    return DirectoryServer(root, host=host, port=port).start()


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The [start, stop) bytes a single-range `Range` header asks of a `size`-byte file.

    None when the range cannot be satisfied; ValueError when the header is not one we serve.
    """
    match = _RANGE.match(header.strip())
    if not match or match.groups() == ("", ""):
        raise ValueError(f"unsupported Range header {header!r}")
    first, last = match.groups()
    if first == "":
        start, stop = max(0, size - int(last)), size
        if int(last) == 0:
            return None
    else:
        start = int(first)
        stop = min(size, int(last) + 1) if last else size
        if last and int(last) < start:
            raise ValueError(f"unsupported Range header {header!r}")
    if start >= size:
        return None
    return start, stop


class _DirectoryHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, root: Path) -> None:
        self.root = root
        super().__init__(address, handler)


class _DirectoryHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no delayed-ACK wait between them
    timeout = 300
    server: _DirectoryHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def _serve(self, send_body: bool) -> None:
        path = self._resolve()
        if path is None:
            self._plain(404, f"not found: {self.path}")
            return
        size = path.stat().st_size
        status, start, stop = 200, 0, size
        header = self.headers.get("Range")
        if header:
            try:
                wanted = parse_range(header, size)
            except ValueError as exc:
                self._plain(400, str(exc))
                return
            if wanted is None:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status, (start, stop) = 206, wanted
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(stop - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.end_headers()
        if send_body:
            with path.open("rb") as file:
                file.seek(start)
                _copy_exactly(file, self.wfile, stop - start)  # type: ignore[arg-type]

    def _resolve(self) -> Path | None:
        relative = unquote(urlsplit(self.path).path).lstrip("/")
        candidate = (self.server.root / relative).resolve()
        if candidate != self.server.root and self.server.root not in candidate.parents:
            return None
        return candidate if candidate.is_file() else None

    def _plain(self, status: int, message: str) -> None:
        body = f"{message}\n".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _copy_exactly(source: BinaryIO, target: BinaryIO, length: int) -> None:
    remaining = length
    while remaining:
        chunk = source.read(min(remaining, 256 * 1024))
        if not chunk:
            raise OSError(f"{source.name} shrank while being served ({remaining} bytes short)")
        target.write(chunk)
        remaining -= len(chunk)
