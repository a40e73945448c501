"""The loopback proxy in a child process, controlled over a small JSON API on its own port.

Benchmarks use it so the proxy's CPU time and GIL stay out of the process being measured;
multi-process tests can use it so that any process may read the counters. It offers the
same controls as `LoopbackProxy`; fault rules come back as copies, not live objects.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tierflow.testing.lifecycle import Startable, stop_child
from tierflow.testing.proxy import Fault, FaultRule, LoopbackProxy, PathTraffic, RequestRecord, TrafficSnapshot


class ProxyProcess(Startable):
    """A `LoopbackProxy` in front of `upstream`, running in a child process."""

    def __init__(self, upstream: str, *, bandwidth: float | None = None, start_timeout: float = 30.0) -> None:
        self.upstream = upstream
        self._initial_bandwidth = bandwidth
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[str] | None = None
        self._url: str | None = None
        self._control: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError(f"proxy process for {self.upstream} is not started")
        return self._url

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> ProxyProcess:
        if self._process is not None:
            return self
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.upstream], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._process.stdout is not None
        timer = threading.Timer(self.start_timeout, self._process.kill)
        timer.start()
        line = self._process.stdout.readline().split()
        timer.cancel()
        if len(line) != 3 or line[0] != "PORTS":
            self.stop()
            raise RuntimeError(f"proxy process for {self.upstream} failed to start: {line!r}")
        self._url = f"http://127.0.0.1:{line[1]}"
        self._control = f"http://127.0.0.1:{line[2]}"
        if self._initial_bandwidth is not None:
            self.set_bandwidth(self._initial_bandwidth)
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        self._url = self._control = None
        stop_child(process)

    def set_bandwidth(self, bytes_per_second: float | None) -> None:
        self._call("PUT", "/bandwidth", {"bytes_per_second": bytes_per_second})

    @property
    def bandwidth(self) -> float | None:
        return self._call("GET", "/bandwidth")["bytes_per_second"]

    def inject(
        self,
        kind: Fault | str,
        count: int = 1,
        *,
        method: str | None = None,
        key: str | None = None,
        after_bytes: int | None = None,
    ) -> FaultRule:
        rule = {"kind": Fault(kind).value, "count": count, "method": method, "key": key, "after_bytes": after_bytes}
        return _rule_from_json(self._call("POST", "/faults", rule))

    def clear_faults(self) -> None:
        self._call("DELETE", "/faults")

    def pending_faults(self) -> list[FaultRule]:
        return [_rule_from_json(r) for r in self._call("GET", "/faults")]

    def traffic(self) -> TrafficSnapshot:
        state = self._call("GET", "/traffic")
        totals = {(method, path): PathTraffic(*counts) for method, path, *counts in state["totals"]}
        records = tuple(
            RequestRecord(**{**r, "fault": Fault(r["fault"]) if r["fault"] else None}) for r in state["records"]
        )
        return TrafficSnapshot(totals, records)

    def reset_counters(self) -> None:
        self._call("POST", "/reset")

    def _call(self, method: str, path: str, payload: object = None) -> Any:
        if self._control is None:
            raise RuntimeError(f"proxy process for {self.upstream} is not started")
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(f"{self._control}{path}", data=data, method=method)
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")


def _rule_to_json(rule: FaultRule) -> dict[str, Any]:
    return {**dataclasses.asdict(rule), "kind": rule.kind.value}


def _rule_from_json(data: dict[str, Any]) -> FaultRule:
    return FaultRule(**{**data, "kind": Fault(data["kind"])})


class _ControlHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no delayed-ACK wait between them
    server: _ControlServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _payload(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _reply(self, result: object, status: int = 200) -> None:
        body = json.dumps(result).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        proxy = self.server.proxy
        if self.path == "/traffic":
            snapshot = proxy.traffic()
            self._reply(
                {
                    "totals": [
                        [method, path, *dataclasses.astuple(traffic)]
                        for (method, path), traffic in snapshot.by_method_path.items()
                    ],
                    "records": [
                        {**dataclasses.asdict(r), "fault": r.fault.value if r.fault else None} for r in snapshot.records
                    ],
                }
            )
        elif self.path == "/faults":
            self._reply([_rule_to_json(r) for r in proxy.pending_faults()])
        elif self.path == "/bandwidth":
            self._reply({"bytes_per_second": proxy.bandwidth})
        else:
            self._reply({"error": f"no control {self.path}"}, 404)

    def do_PUT(self) -> None:
        if self.path == "/bandwidth":
            self.server.proxy.set_bandwidth(self._payload()["bytes_per_second"])
            self._reply(None)
        else:
            self._reply({"error": f"no control {self.path}"}, 404)

    def do_POST(self) -> None:
        proxy = self.server.proxy
        if self.path == "/faults":
            spec = self._payload()
            count = spec.pop("count")
            kind = spec.pop("kind")
            self._reply(_rule_to_json(dataclasses.replace(proxy.inject(kind, count, **spec))))
        elif self.path == "/reset":
            proxy.reset_counters()
            self._reply(None)
        else:
            self._reply({"error": f"no control {self.path}"}, 404)

    def do_DELETE(self) -> None:
        if self.path == "/faults":
            self.server.proxy.clear_faults()
            self._reply(None)
        else:
            self._reply({"error": f"no control {self.path}"}, 404)


class _ControlServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, proxy: LoopbackProxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _ControlHandler)


_CHILD = "import sys; from tierflow.testing.proxyprocess import _serve; _serve(sys.argv[1])"


def _serve(upstream: str) -> None:
    with LoopbackProxy(upstream) as proxy:
        control = _ControlServer(proxy)
        threading.Thread(target=control.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
        data_port = proxy.url.rsplit(":", 1)[1]
        print(f"PORTS {data_port} {control.server_address[1]}", flush=True)
        sys.stdin.read()  # returns when the parent closes our stdin or dies
        control.shutdown()
