"""Start/stop plumbing the rig's servers share: an HTTP server on a daemon thread, a child
process stopped by closing its stdin, and `with`-block support for anything with start/stop."""

from __future__ import annotations

import subprocess
import threading
from http.server import ThreadingHTTPServer
from types import TracebackType
from typing import Any


class Startable:
    """`with x:` starts `x` and stops it on the way out."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ThreadedHTTPService(Startable):
    """An HTTP server of the subclass's making, served on a daemon thread bound to `bind`."""

    thread_name = "tierflow-http"

    def __init__(self, bind: tuple[str, int]) -> None:
        self._bind = bind
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def _make_server(self) -> ThreadingHTTPServer:
        raise NotImplementedError

    def _not_started(self) -> str:
        return "server is not started"

    def _after_shutdown(self) -> None:
        """Hook: runs after the server stops accepting, before its thread is joined."""

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError(self._not_started())
        host, port = self._server.server_address[:2]
        assert isinstance(host, str), "an AF_INET/AF_INET6 server's host is a str"
        return f"http://{host}:{port}"

    def start(self) -> Any:
        if self._server is None:
            self._server = self._make_server()
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                # how often the loop checks for shutdown: stop() waits for it, and tests stop a server each
                kwargs={"poll_interval": 0.01},
                name=f"{self.thread_name}-{self._server.server_address[1]}",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        self._after_shutdown()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def stop_child(process: subprocess.Popen | None) -> None:
    """Stop a rig child that exits when its stdin closes; kill it if it does not within 5 s."""
    if process is None:
        return
    if process.stdin:
        process.stdin.close()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout:
        process.stdout.close()
