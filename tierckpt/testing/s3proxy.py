"""Faults at the client's boundary with a real S3 server: a proxy on 127.0.0.1 in front of it.

A real server cannot be made to throttle (503 SlowDown) or to stall a request on demand. This proxy
forwards each request to the server as it came (the ``Host`` header kept, so the client's signature
still verifies) and can, for requests that match a rule, answer an S3 error itself, drop the
connection (before or after forwarding the request), or hold the request until the test releases it (to kill a writer at an exact point)::

    proxy = S3Proxy(server.endpoint)
    proxy.fail("PUT", "/manifest.msgpack", status=503, code="SlowDown", times=3)   # a 503 storm
    held = proxy.hold("PUT", "/manifest.msgpack")      # the commit object waits...
    held.reached.wait(30)                              # ...until the writer is there; then SIGKILL it
    proxy.close()

A rule matches a method and a substring of the path with its query (``?uploadId=`` marks a part or a
multipart upload's completion). :attr:`S3Proxy.seen` counts the requests forwarded, by method.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import threading
import urllib.parse
from dataclasses import dataclass, field

__all__ = ["HeldRequests", "S3Proxy"]

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@dataclass
class _Rule:
    method: str
    path: str
    action: str  # "fail", "reset", "lose" or "hold"
    times: int | None  # None: every matching request
    status: int = 503
    code: str = "SlowDown"
    held: HeldRequests | None = None

    def matches(self, method: str, path: str) -> bool:
        return self.method in ("*", method) and self.path in path and (self.times is None or self.times > 0)


@dataclass
class HeldRequests:
    """A rule holding requests: ``reached`` is set when one arrives; :meth:`release` lets them go on,
    :meth:`drop` closes their connections unanswered and never forwards them (the client died first)."""

    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    dropped: bool = False

    def release(self) -> None:
        self.released.set()

    def drop(self) -> None:
        self.dropped = True
        self.released.set()


class S3Proxy:
    """Forwards to ``upstream`` (http://127.0.0.1:port); :attr:`endpoint` is the proxy's own address."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        assert parsed.hostname == "127.0.0.1", "the proxy forwards to a local server only"
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.rules: list[_Rule] = []
        self.seen: collections.Counter[str] = collections.Counter()
        self.failed: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail(self, method: str, path: str, *, status: int = 503, code: str = "SlowDown", times: int | None = None) -> None:
        """Answer ``status`` with S3 error ``code`` to matching requests (``times`` of them; None: all)."""
        with self._lock:
            self.rules.append(_Rule(method, path, "fail", times, status, code))

    def reset(self, method: str, path: str, *, times: int | None = None) -> None:
        """Close the connection of matching requests without an answer."""
        with self._lock:
            self.rules.append(_Rule(method, path, "reset", times))

    def lose(self, method: str, path: str, *, times: int | None = None) -> None:
        """Forward matching requests, then close the connection instead of answering: the server did
        the work, and the client never hears of it."""
        with self._lock:
            self.rules.append(_Rule(method, path, "lose", times))

    def hold(self, method: str, path: str) -> HeldRequests:
        """Hold matching requests until :meth:`HeldRequests.release` (or :meth:`close`)."""
        held = HeldRequests()
        with self._lock:
            self.rules.append(_Rule(method, path, "hold", None, held=held))
        return held

    def clear(self) -> None:
        """Drop every rule; requests still held are let go on."""
        with self._lock:
            rules, self.rules = self.rules, []
        for rule in rules:
            if rule.held is not None:
                rule.held.release()

    def _rule(self, method: str, path: str) -> _Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path):
                    if rule.times is not None:
                        rule.times -= 1
                    return rule
        return None

    def _handle(self, request: http.server.BaseHTTPRequestHandler) -> None:
        method, path = request.command, request.path
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        rule = self._rule(method, path)
        if rule is not None and rule.action == "hold":
            assert rule.held is not None
            rule.held.reached.set()
            rule.held.released.wait()
            if rule.held.dropped:
                request.close_connection = True
                request.connection.close()
                return
        elif rule is not None and rule.action == "reset":
            self.failed[method] += 1
            request.close_connection = True
            request.connection.close()
            return
        elif rule is not None and rule.action == "fail":
            self.failed[method] += 1
            payload = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code><Message>injected by the test proxy</Message></Error>'.encode()
            request.send_response(rule.status)
            request.send_header("Content-Type", "application/xml")
            request.send_header("Content-Length", str(len(payload)))
            request.end_headers()
            if method != "HEAD":
                request.wfile.write(payload)
            return
        self.seen[method] += 1
        upstream = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            upstream.request(method, path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        except OSError:
            request.close_connection = True
            request.connection.close()
            return
        finally:
            upstream.close()
        if rule is not None and rule.action == "lose":
            self.failed[method] += 1
            request.close_connection = True
            request.connection.close()
            return
        request.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP and key.lower() != "content-length":
                request.send_header(key, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if method != "HEAD":
            request.wfile.write(data)

    def close(self) -> None:
        self.clear()
        self._server.shutdown()
        self._server.server_close()
