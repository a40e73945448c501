"""A loopback reverse proxy that tests and benchmarks put in front of an HTTP upstream.

It forwards every request unchanged (any method, streamed bodies, Range, the client's own Host
header, so signed S3 requests stay valid), counts requests and body bytes per method and path
exactly, paces responses through a token bucket, and injects faults on the next N matching
requests: an S3-style 503, a connection reset mid-response, a body cut short of its
Content-Length, or silence after the request. It runs as threads in the calling process; query it from that process.
"""

from __future__ import annotations

import dataclasses
import enum
import http.client
import select
import socket
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit
from xml.sax.saxutils import escape

from tierflow.testing.bandwidth import TokenBucket
from tierflow.testing.lifecycle import ThreadedHTTPService

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_IO_CHUNK = 64 * 1024


class Fault(str, enum.Enum):
    """What the proxy does to a request a fault rule matches."""

    UNAVAILABLE = "503"
    RESET = "reset"
    TRUNCATE = "truncate"
    SILENT = "silent"
    """The request is read whole, then nothing comes back until the client hangs up (a peer that
    went quiet: what a client's deadline must cut)."""


@dataclass
class FaultRule:
    """Applies `kind` to the next `remaining` requests whose method and path match.

    `after_bytes` is how much of the response body reaches the client before a reset or
    truncation; by default half of it.
    """

    kind: Fault
    remaining: int
    method: str | None = None
    key: str | None = None
    after_bytes: int | None = None
    fired: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.remaining <= 0:
            return False
        if self.method is not None and self.method.upper() != method.upper():
            return False
        return self.key is None or self.key in path


@dataclass
class RequestRecord:
    """One request as the proxy saw it; `path` is percent-decoded and has no query."""

    method: str
    path: str
    query: str
    range: str | None
    status: int | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    fault: Fault | None = None


@dataclass
class PathTraffic:
    """Exact totals for one (method, path): requests, body bytes each way, faults injected."""

    requests: int = 0
    request_bytes: int = 0
    response_bytes: int = 0
    faults: int = 0


@dataclass(frozen=True)
class TrafficSnapshot:
    """A copy of the proxy's counters at one moment.

    Totals are exact however many requests were made; `records` keeps the most recent
    requests only (the proxy's `record_limit`).
    """

    by_method_path: Mapping[tuple[str, str], PathTraffic]
    records: tuple[RequestRecord, ...]

    def _select(self, method: str | None, key: str | None) -> Iterator[PathTraffic]:
        for (entry_method, path), traffic in self.by_method_path.items():
            if method is not None and entry_method != method.upper():
                continue
            if key is not None and key not in path:
                continue
            yield traffic

    def requests(self, method: str | None = None, key: str | None = None) -> int:
        """Requests received whose method is `method` and whose path contains `key`."""
        return sum(t.requests for t in self._select(method, key))

    def request_bytes(self, method: str | None = None, key: str | None = None) -> int:
        """Request body bytes read from clients (chunked bodies count their payload)."""
        return sum(t.request_bytes for t in self._select(method, key))

    def response_bytes(self, method: str | None = None, key: str | None = None) -> int:
        """Response body bytes sent to clients, including injected error bodies."""
        return sum(t.response_bytes for t in self._select(method, key))

    def faults(self, method: str | None = None, key: str | None = None) -> int:
        return sum(t.faults for t in self._select(method, key))

    def requests_per_path(self, method: str | None = None) -> dict[str, int]:
        per_path: Counter[str] = Counter()
        for (entry_method, path), traffic in self.by_method_path.items():
            if method is None or entry_method == method.upper():
                per_path[path] += traffic.requests
        return dict(per_path)

    def statuses(self, method: str | None = None, key: str | None = None) -> Counter[int | None]:
        """Response statuses among the recorded requests (None: no status line was sent)."""
        return Counter(
            r.status
            for r in self.records
            if (method is None or r.method == method.upper()) and (key is None or key in r.path)
        )


class LoopbackProxy(ThreadedHTTPService):
    """A reverse proxy on 127.0.0.1 in front of `upstream` (an http:// base URL)."""

    thread_name = "tierflow-proxy"

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        bandwidth: float | None = None,
        record_limit: int = 100_000,
        upstream_timeout: float = 60.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"proxy upstream must be an http(s) URL, got {upstream!r}")
        self.upstream = upstream
        self._upstream_scheme = parts.scheme
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port or (443 if parts.scheme == "https" else 80)
        self._upstream_prefix = parts.path.rstrip("/")
        self.upstream_timeout = upstream_timeout
        super().__init__((host, port))
        self._bucket = TokenBucket(bandwidth)
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []
        self._totals: dict[tuple[str, str], PathTraffic] = {}
        self._records: deque[RequestRecord] = deque(maxlen=record_limit)
        self._connections: set[socket.socket] = set()

    # lifecycle

    def _make_server(self) -> ThreadingHTTPServer:
        return _ProxyServer(self._bind, _ProxyHandler, self)

    def _not_started(self) -> str:
        return f"proxy for {self.upstream} is not started"

    def _after_shutdown(self) -> None:
        """Drop open client connections so their handler threads end."""
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # controls

    @property
    def bandwidth(self) -> float | None:
        return self._bucket.rate

    def set_bandwidth(self, bytes_per_second: float | None) -> None:
        """Throttle response bodies, across all connections, to this rate; None lifts it."""
        self._bucket.set_rate(bytes_per_second)

    def inject(
        self,
        kind: Fault | str,
        count: int = 1,
        *,
        method: str | None = None,
        key: str | None = None,
        after_bytes: int | None = None,
    ) -> FaultRule:
        """Apply a fault to the next `count` requests matching `method` and path substring `key`.

        The returned rule is live: its `fired` and `remaining` change as requests hit it.
        """
        if count < 1:
            raise ValueError(f"fault count must be >= 1, got {count}")
        rule = FaultRule(Fault(kind), count, method, key, after_bytes)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear_faults(self) -> None:
        with self._lock:
            self._rules.clear()

    def pending_faults(self) -> list[FaultRule]:
        with self._lock:
            return [dataclasses.replace(r) for r in self._rules if r.remaining > 0]

    def traffic(self) -> TrafficSnapshot:
        with self._lock:
            totals = {k: dataclasses.replace(v) for k, v in self._totals.items()}
            records = tuple(dataclasses.replace(r) for r in self._records)
        return TrafficSnapshot(totals, records)

    def reset_counters(self) -> None:
        with self._lock:
            self._totals.clear()
            self._records.clear()

    # used by the request handlers

    def _open_record(self, method: str, path: str, query: str, range_: str | None) -> RequestRecord:
        record = RequestRecord(method, path, query, range_)
        with self._lock:
            self._totals.setdefault((method, path), PathTraffic()).requests += 1
            self._records.append(record)
        return record

    def _claim_fault(self, record: RequestRecord) -> FaultRule | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(record.method, record.path):
                    rule.remaining -= 1
                    rule.fired += 1
                    record.fault = rule.kind
                    self._totals.setdefault((record.method, record.path), PathTraffic()).faults += 1
                    return dataclasses.replace(rule)
        return None

    def _count(self, record: RequestRecord, *, request: int = 0, response: int = 0) -> None:
        with self._lock:
            record.request_bytes += request
            record.response_bytes += response
            totals = self._totals.get((record.method, record.path))
            if totals is not None:
                totals.request_bytes += request
                totals.response_bytes += response

    def _track(self, connection: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def _connect_upstream(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._upstream_scheme == "https" else http.client.HTTPConnection
        return cls(self._upstream_host, self._upstream_port, timeout=self.upstream_timeout)


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, proxy: LoopbackProxy) -> None:
        self.proxy = proxy
        super().__init__(address, handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """Clients that hang up mid-request are routine here (fault tests); say nothing."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class _UpstreamFailed(Exception):
    pass


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: a response goes out as a header write then body writes; with Nagle on, a small
    # body waits for the client's delayed ACK of the headers (~40 ms a request on Linux)
    disable_nagle_algorithm = True
    timeout = 300
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        self._upstream: http.client.HTTPConnection | None = None
        self._was_reset = False
        self.server.proxy._track(self.connection, True)

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except ValueError:  # the server flushes the streams an injected reset closed: expected, quiet
            if not self._was_reset:
                raise

    def finish(self) -> None:
        self._drop_upstream()
        self.server.proxy._track(self.connection, False)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        if name.startswith("do_"):
            return self._forward
        raise AttributeError(name)

    # one request

    def _forward(self) -> None:
        proxy = self.server.proxy
        target = self.path
        if "://" in target.split("?", 1)[0]:
            parts = urlsplit(target)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
        raw_path, _, query = target.partition("?")
        record = proxy._open_record(self.command, unquote(raw_path), query, self.headers.get("Range"))
        fault = proxy._claim_fault(record)
        body = self._request_body(record)
        if fault is not None and fault.kind is Fault.UNAVAILABLE:
            for _ in body:
                pass
            self._send_unavailable(record)
            return
        if fault is not None and fault.kind is Fault.SILENT:
            for _ in body:
                pass
            self._stay_silent()
            return
        try:
            response = self._send_upstream(proxy._upstream_prefix + target, body)
        except _UpstreamFailed as exc:
            self._drop_upstream()
            self._send_bad_gateway(record, exc)
            return
        self._relay(response, record, fault)

    def _request_body(self, record: RequestRecord) -> Iterator[bytes]:
        proxy = self.server.proxy
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size_line = self.rfile.readline(65537)
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                remaining = size
                while remaining:
                    chunk = self.rfile.read(min(remaining, _IO_CHUNK))
                    if not chunk:
                        raise ConnectionError(f"client closed mid-body of {record.path}")
                    remaining -= len(chunk)
                    proxy._count(record, request=len(chunk))
                    yield chunk
                self.rfile.readline(3)
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining:
            chunk = self.rfile.read(min(remaining, _IO_CHUNK))
            if not chunk:
                raise ConnectionError(f"client closed mid-body of {record.path}")
            remaining -= len(chunk)
            proxy._count(record, request=len(chunk))
            yield chunk

    def _upstream_connection(self) -> http.client.HTTPConnection:
        connection = self._upstream
        if connection is not None and connection.sock is not None:
            readable, _, _ = select.select([connection.sock], [], [], 0)
            if readable:  # an idle upstream connection that is readable has been closed
                self._drop_upstream()
        if self._upstream is None:
            self._upstream = self.server.proxy._connect_upstream()
        return self._upstream

    def _send_upstream(self, target: str, body: Iterator[bytes]) -> http.client.HTTPResponse:
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        try:
            connection = self._upstream_connection()
            connection.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    connection.putheader(name, value)
            if chunked:
                connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            for chunk in body:
                connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if chunked:
                connection.send(b"0\r\n\r\n")
            return connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise _UpstreamFailed(f"upstream {self.server.proxy.upstream} failed: {exc!r}") from exc

    def _relay(self, response: http.client.HTTPResponse, record: RequestRecord, fault: FaultRule | None) -> None:
        status = response.status
        has_body = self.command != "HEAD" and status >= 200 and status not in (204, 304)
        if not has_body:
            response.read()  # lets http.client mark the upstream connection reusable
        length = response.length if has_body else 0
        headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
        chunked_to_client = has_body and length is None
        cut: int | None = None
        if fault is not None:
            if fault.after_bytes is not None:
                cut = fault.after_bytes
            else:
                cut = (length // 2) if length is not None else _IO_CHUNK
            if length:  # the client must miss at least one byte
                cut = min(cut, length - 1)
            if fault.kind is Fault.RESET and (not has_body or length == 0 or cut == 0):
                self._reset()
                return
            if fault.kind is Fault.TRUNCATE and not has_body:
                self.close_connection = True
                return
            if fault.kind is Fault.TRUNCATE and length == 0:
                headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
                headers.append(("Content-Length", "1"))
        self._start_response(record, status, response.reason, headers, chunked_to_client)
        sent = 0
        bucket = self.server.proxy._bucket
        while True:
            want = bucket.chunk_size()
            if cut is not None:
                want = min(want, cut - sent)
                if want <= 0:
                    break
            try:
                chunk = response.read1(want)
            except (OSError, http.client.HTTPException):
                self._drop_upstream()
                self.close_connection = True
                return
            if not chunk:
                break
            bucket.take(len(chunk))
            self._write_body(record, chunk, chunked_to_client)
            sent += len(chunk)
        if fault is not None:
            self._drop_upstream()
            if fault.kind is Fault.RESET:
                self._reset()
            else:
                self.close_connection = True
            return
        if chunked_to_client:
            self.wfile.write(b"0\r\n\r\n")
        if length is not None and sent < length:  # the upstream itself ended early
            self.close_connection = True
        if response.will_close or not response.isclosed():
            self._drop_upstream()

    # writing to the client

    def _start_response(
        self, record: RequestRecord, status: int, reason: str, headers: list[tuple[str, str]], chunked: bool
    ) -> None:
        record.status = status
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()

    def _write_body(self, record: RequestRecord, data: bytes, chunked: bool) -> None:
        proxy = self.server.proxy
        proxy._count(record, response=len(data))  # counted before the client can see it
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        except OSError:
            proxy._count(record, response=-len(data))
            raise

    def _send_unavailable(self, record: RequestRecord) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            "<Error><Code>SlowDown</Code>"
            "<Message>Please reduce your request rate (fault injected by the tierflow test proxy)."
            f"</Message><Resource>{escape(record.path)}</Resource>"
            "<RequestId>tierflow-proxy-fault</RequestId></Error>"
        ).encode()
        self._start_response(
            record,
            503,
            "Slow Down",
            [
                ("Content-Type", "application/xml"),
                ("Content-Length", str(len(body) if self.command != "HEAD" else 0)),
                ("x-amz-request-id", "tierflow-proxy-fault"),
            ],
            False,
        )
        if self.command != "HEAD":
            self._write_body(record, body, False)

    def _send_bad_gateway(self, record: RequestRecord, error: Exception) -> None:
        body = f"{error}\n".encode()
        self.close_connection = True
        self._start_response(
            record, 502, "Bad Gateway", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))], False
        )
        self._write_body(record, body, False)

    def _stay_silent(self) -> None:
        """Answer nothing until the client hangs up (or the proxy stops, or `timeout` passes)."""
        self.close_connection = True
        until = time.monotonic() + self.timeout
        while time.monotonic() < until:
            readable, _, _ = select.select([self.connection], [], [], 0.1)
            if not readable:
                continue
            try:
                if not self.connection.recv(_IO_CHUNK):
                    return  # the client hung up
            except OSError:
                return

    def _reset(self) -> None:
        """Abort the client connection with a TCP RST instead of an orderly close."""
        self.close_connection = True
        self._was_reset = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for stream in (self.wfile, self.rfile):
            try:
                stream.close()
            except OSError:
                pass
        self.connection.close()

    def _drop_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
