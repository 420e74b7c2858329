"""The /metrics endpoint: gemtrace.httpd's server over a prometheus-client registry.

Serves what the collectors yield at scrape time, at most one collection per
MIN_COLLECT_INTERVAL_SECONDS (`PacedMetrics`: requests that come sooner wait and share the next one),
its only state.
Uses prometheus-client's encoders and content negotiation (OpenMetrics) as shipped by Debian 12 (0.16),
which has no TLS, no authentication and no unix socket of its own: gemtrace.httpd runs each
connection's TLS handshake with the web config's ssl context (in its loop, under a deadline), basic
auth answers 401 before the scrape is made (gemtrace.agent.web_config checks both), and `unix:PATH` listens
on a socket whose mode and group say who may connect. /metrics names every user's processes (pid,
comm, group): docs/metrics.md says who can see it, and how to narrow that.
"""

from __future__ import annotations

import grp
import gzip
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from gemtrace import defaults, httpd
from gemtrace.agent.web_config import WebConfig

# A collection runs Python over every series under the agent's GIL, which the schedulers' looks need
# too: back-to-back scrapes (a curl loop, a scraper misconfigured to a tight interval, any local user
# on the default 127.0.0.1 listener) stretched the switch gap's p90 from 0.36 to 5.2 ms and cost 11%
# of throughput (issue 13). A scrape gets a collection made after it arrived (never an older one),
# but no sooner than this after the last collection: a request that comes too soon waits, asleep,
# and every request that arrived meanwhile is answered from that same collection.
MIN_COLLECT_INTERVAL_SECONDS = 0.25
# A scrape is a GET without a body; the workers mostly wait for PacedMetrics' one collection, so a few
# suffice however many scrape (gemtrace.httpd says why slow clients hold none of them).
LIMITS = httpd.Limits(body_bytes=4 << 10, workers=4)
UNIX_SOCKET_MODE = 0o660  # the owner (root) and the socket's group; --listen-mode changes it


class ListenError(ValueError):
    pass


@dataclass(frozen=True)
class UnixListen:
    """Where and how to make the unix socket: its path, mode and group (None: the agent's own)."""

    path: Path
    mode: int = UNIX_SOCKET_MODE
    gid: int | None = None


def parse_listen(listen: str) -> tuple[str, int] | Path:
    """"127.0.0.1:9843", "[::1]:9843" or ":9843" (all addresses) -> (host, port); "unix:/PATH" -> the path.
    Port 0 asks the kernel for a free one (tests use it; the agent logs the port it got)."""
    if listen.startswith(defaults.UNIX_PREFIX):
        path = Path(listen[len(defaults.UNIX_PREFIX):])
        if not path.is_absolute():
            raise ListenError(f"--listen {listen!r}: a unix socket's path is absolute, "
                              "e.g. unix:/run/gemtrace/metrics.sock")
        return path
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ListenError(f"--listen {listen!r}: expected HOST:PORT (e.g. 127.0.0.1:9843) or unix:/PATH")
    return host.strip("[]"), int(port)


def listen_target(listen: str, socket_mode: int | None = None, socket_gid: int | None = None
                  ) -> tuple[str, int] | UnixListen:
    """--listen with --listen-mode and --listen-group -> where to serve; ListenError for what does not fit."""
    where = parse_listen(listen)
    if isinstance(where, Path):
        return UnixListen(where, UNIX_SOCKET_MODE if socket_mode is None else socket_mode, socket_gid)
    if socket_mode is not None or socket_gid is not None:
        raise ListenError("--listen-mode and --listen-group apply to a unix: --listen only; a TCP port "
                          "has no file permissions (--web-config restricts it)")
    return where


def parse_mode(text: str) -> int:
    """"0660" -> 0o660: permission bits in octal, as chmod takes them."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ListenError(f"--listen-mode {text!r}: expected permission bits in octal, e.g. 0660")
    return mode


def parse_group(text: str) -> int:
    """A group name or number -> its gid."""
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        if text.isdigit():
            return int(text)
        raise ListenError(f"--listen-group {text!r}: no such group (getent group {text})") from None


class PacedMetrics:
    """The bytes of a scrape, from a collection made after the request arrived, at most one
    collection per `min_interval` seconds (requests that come sooner wait for the next, asleep, and
    share it), encoded once per kind of answer (format, gzip, name[] filter). A loop of requests
    costs the agent one collection and encoding per interval, whatever it asks. Thread-safe (the
    server answers each request in a thread of its own)."""

    def __init__(self, registry: CollectorRegistry, min_interval: float = MIN_COLLECT_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._families: list[Metric] = []
        self._outputs: dict[tuple[str, bool, tuple[str, ...]], bytes] = {}
        self._collected_at: float | None = None  # when the last collection began
        self.collections = 0  # how often the collectors ran, for tests

    def answer(self, accept: str | None, accept_encoding: str | None, query: str, arrived: float | None = None
               ) -> tuple[list[tuple[str, str]], bytes]:
        """The headers and body of a scrape, as prometheus-client's handler would make them. `arrived`:
        when the request came (the clock's time), if it waited before this call; a collection begun
        after it serves it."""
        arrived = self._clock() if arrived is None else arrived
        encoder, content_type = choose_encoder(accept or "")
        gzipped = any(e.strip().lower().startswith("gzip") for e in (accept_encoding or "").split(","))
        names = tuple(sorted(parse_qs(query).get("name[]", [])))
        key = (content_type, gzipped, names)
        with self._lock:
            if self._collected_at is None or self._collected_at < arrived:
                if self._collected_at is not None:
                    time.sleep(max(0.0, self._collected_at + self._min_interval - self._clock()))
                self._collected_at = self._clock()
                self._families = list(self._registry.collect())
                self._outputs.clear()
                self.collections += 1
            body = self._outputs.get(key)
            if body is None:
                body = encoder(_Families(self._families, frozenset(names)))
                if gzipped:
                    body = gzip.compress(body)
                self._outputs[key] = body
        return [("Content-Type", content_type), *([("Content-Encoding", "gzip")] if gzipped else [])], body


class _Families:
    """One collection as a registry for prometheus-client's encoders; with names (a scrape's name[]
    parameters), the samples of those names only."""

    def __init__(self, families: list[Metric], names: frozenset[str]) -> None:
        self._families, self._names = families, names

    def collect(self) -> Iterator[Metric]:
        if not self._names:
            yield from self._families
            return
        for family in self._families:
            samples = [sample for sample in family.samples if sample.name in self._names]
            if samples:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = samples
                yield kept


class _MetricsHandler(httpd.Handler):
    """Any GET path answers the scrape (as prometheus-client's handler does)."""

    metrics: PacedMetrics

    def do_GET(self) -> None:
        # The request's own arrival, not now: the requests queued for a worker since the last collection
        # share the next one instead of each asking for its own.
        headers, body = self.metrics.answer(self.headers.get("Accept"), self.headers.get("Accept-Encoding"),
                                            urlparse(self.path).query, self.request.arrived)
        self.send_response(200)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _guarded_handler(metrics: PacedMetrics, web: WebConfig | None) -> type[httpd.Handler]:
    """The handler for `metrics`, behind the web config's basic auth if it has one."""
    handler: type[_MetricsHandler] = type("MetricsHandler", (_MetricsHandler,), {"metrics": metrics})
    if web is None or web.basic_auth is None:
        return handler
    auth = web.basic_auth

    class BasicAuthHandler(handler):  # type: ignore[valid-type,misc]
        def do_GET(self) -> None:
            if not auth.allows(self.headers.get("Authorization")):
                self.reply(401, b"Unauthorized\n", "text/plain; charset=utf-8",
                           ("WWW-Authenticate", 'Basic realm="gemtrace"'))
                return
            super().do_GET()

    return BasicAuthHandler


def _unix_socket(where: UnixListen) -> socket.socket:
    """The unix socket at where.path, listening, with its mode and group."""
    _remove_stale_socket(where.path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        sock.bind(str(where.path))
        bound = True
        # Mode and group before listen(): until then a connect() is refused, so no client gets in
        # under the umask's looser bits.
        if where.gid is not None:
            os.chown(where.path, -1, where.gid)
        os.chmod(where.path, where.mode)
        sock.listen(128)
    except BaseException:
        sock.close()
        if bound:
            where.path.unlink(missing_ok=True)
        raise
    return sock


def _remove_stale_socket(path: Path) -> None:
    """A socket file left by an agent that died; anything else at the path is the operator's."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenError(f"{path} exists and is not a socket; remove it or choose another unix: path")
    path.unlink()


class Exporter:
    def __init__(self, registry: CollectorRegistry, listen: str, web: WebConfig | None = None,
                 socket_mode: int | None = None, socket_gid: int | None = None) -> None:
        where = listen_target(listen, socket_mode, socket_gid)
        self.metrics = PacedMetrics(registry)
        self._unix_path: Path | None = None
        if isinstance(where, UnixListen):
            sock = _unix_socket(where)
            self._unix_path = where.path
            self.address = f"{defaults.UNIX_PREFIX}{where.path}"
        else:
            host, port = where
            sock = httpd.listening_socket(host, port)
            self.address = f"{host}:{sock.getsockname()[1]}"
        tls = web.tls if web is not None else None
        self.server = httpd.Server(sock, _guarded_handler(self.metrics, web), tls, LIMITS, name="gemtrace-exporter")
        # Who may read it, for the log: the web config's checks, the socket's mode and group.
        self._access: dict[str, str] = {"web_config": f"{web.path} ({web.describe()})"} if web is not None else {}
        if isinstance(where, UnixListen):
            self._access.update(socket_mode=f"{where.mode:04o}", socket_gid=str(os.getgid() if where.gid is None
                                                                                 else where.gid))
        self.scheme = "https" if tls is not None else "http"

    def start(self) -> None:
        self.server.start()
        structlog.get_logger("gemtrace.exporter").info("metrics_serving", address=self.address, scheme=self.scheme,
                                                       **self._access)

    def stop(self) -> None:
        self.server.stop()
        if self._unix_path is not None:
            self._unix_path.unlink(missing_ok=True)
            self._unix_path = None
