"""The HTTP server that /metrics (gemtrace.agent.exporter) and the admission webhook (gemtrace.kube.webhook)
stand behind: a slow, idle or hostile client costs a file descriptor for a bounded time, never another
client's answer.

One asyncio loop, in a thread of its own, accepts connections, runs their TLS handshakes and reads each
request whole (request line, headers, body), every step under a deadline (`Limits`). Only a complete
request goes to a bounded pool of worker threads, where the standard library's http.server parses it
and a `Handler` (a BaseHTTPRequestHandler reading and writing memory) answers it; the loop sends the
answer, under a deadline too. So an idle connection, a stalled handshake, a trickled header or a body
shorter than its Content-Length holds no worker, and at most `Limits.connections` are kept open: past
that, the connection that has waited longest for its request is closed. The loop parses no more HTTP
than where a request ends (its head, then Content-Length); everything else is http.server's.

The standard library's rather than a server package: prometheus-client and grpcio (what gemtrace
already depends on) serve no HTTP with deadlines, http.server's ThreadingHTTPServer holds a thread per
connection for as long as the client likes, and a framework would be a new dependency for what
asyncio's streams and http.server's parsing do here together.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

import structlog

log = structlog.get_logger("gemtrace.httpd")

HEAD_END = b"\r\n\r\n"
# At most one `http_handler_failed` line this often: a handler's bug that a client can trigger must not
# become a flood of log lines.
FAILURE_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Limits:
    """Every deadline and bound a client meets. A request's head (line and headers) must arrive within
    head_s of the connection (idle_s between the requests of a kept-alive one), its body within body_s
    after the head, its answer be taken within send_s."""

    handshake_s: float = 5.0
    head_s: float = 10.0
    idle_s: float = 60.0
    body_s: float = 10.0
    send_s: float = 10.0
    head_bytes: int = 64 << 10
    body_bytes: int = 64 << 10
    connections: int = 256
    workers: int = 4


@dataclass(frozen=True)
class Request:
    data: bytes  # the request as received: head and body
    arrived: float  # time.monotonic() when its last byte was read, before it waited for a worker


class Handler(BaseHTTPRequestHandler):
    """A BaseHTTPRequestHandler over one request already read whole (`request`): do_GET, do_POST...
    read self.rfile and write self.wfile as usual, and always send a Content-Length (the connection
    stays open for the next request, HTTP/1.1)."""

    protocol_version = "HTTP/1.1"
    # http.server answers a request line it cannot read as HTTP/0.9 would, without a status line.
    default_request_version = "HTTP/1.1"
    request: Request  # type: ignore[assignment]

    def setup(self) -> None:
        self.rfile = io.BytesIO(self.request.data)  # type: ignore[assignment]
        self.wfile = io.BytesIO()  # type: ignore[assignment]

    def handle(self) -> None:
        self.handle_one_request()

    def finish(self) -> None:
        pass

    def handle_expect_100(self) -> bool:
        return True  # the loop sent 100 Continue before it read the body

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a line per request would drown the agent's own; the servers log what matters themselves

    def reply(self, status: int, body: bytes, content_type: str, *headers: tuple[str, str]) -> None:
        """The whole answer: its status, Content-Type, any more `headers`, its Content-Length and `body`."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def plain(status: HTTPStatus, message: str) -> bytes:
    """A whole text/plain answer that closes the connection: for what the loop refuses before a handler
    sees it."""
    body = (message + "\n").encode()
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", "Content-Type: text/plain; charset=utf-8",
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode() + body


class _Refused(Exception):
    """A request the loop answers itself, then closes the connection."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer


def _body_length(head: bytes, limit: int) -> tuple[int, bool]:
    """How many bytes of body follow `head`, and whether its client waits for 100 Continue."""
    _, _, fields = head.partition(b"\r\n")
    try:
        headers = http.client.parse_headers(io.BytesIO(fields))
    except http.client.HTTPException:
        raise _Refused(plain(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "too many or too long header lines")) from None
    if headers.get("Transfer-Encoding") is not None:
        raise _Refused(plain(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length; chunked bodies "
                                                         "are not accepted"))
    lengths = {value.strip() for value in headers.get_all("Content-Length") or ()}
    if not lengths:
        return 0, False
    if len(lengths) > 1 or not next(iter(lengths)).isdigit():
        raise _Refused(plain(HTTPStatus.BAD_REQUEST, "Content-Length is not one decimal number"))
    length = int(next(iter(lengths)))
    if length > limit:
        raise _Refused(plain(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a body here is at most {limit} bytes"))
    return length, (headers.get("Expect") or "").strip().lower() == "100-continue"


class Server:
    """Serves `handler` on `sock` (bound and listening; TLS with `tls`) once started, until stopped."""

    def __init__(self, sock: socket.socket, handler: type[Handler], tls: ssl.SSLContext | None = None,
                 limits: Limits = Limits(), name: str = "gemtrace-http") -> None:
        self.socket = sock
        self.server_address = sock.getsockname()
        self.handler = handler
        self.tls = tls
        self.limits = limits
        self._name = name
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix=f"{name}-worker")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._open: set[asyncio.StreamWriter] = set()
        # Connections waiting for (the rest of) a request, oldest first: the ones closed to make room.
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._last_failure_log = -FAILURE_LOG_INTERVAL_S
        self.evicted = 0  # connections closed to make room, for tests and benches

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self.socket.close()  # the loop's server closed it already, unless it never started
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(_quiet)
        tls: dict[str, Any] = {} if self.tls is None else {"ssl": self.tls,
                                                           "ssl_handshake_timeout": self.limits.handshake_s}
        try:
            start = asyncio.start_unix_server if self.socket.family == socket.AF_UNIX else asyncio.start_server
            server = loop.run_until_complete(start(self._connection, sock=self.socket,  # type: ignore[operator]
                                                   limit=self.limits.head_bytes, **tls))
        except BaseException as e:
            self._failure = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for writer in list(self._open):
                writer.transport.abort()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        if len(self._open) > self.limits.connections:
            self._make_room(writer)
        peer = writer.get_extra_info("peername") or ("", 0)
        try:
            first = True
            while True:
                self._waiting[writer] = None
                try:
                    request = await self._read(reader, writer, self.limits.head_s if first else self.limits.idle_s)
                finally:
                    self._waiting.pop(writer, None)
                if request is None:
                    return
                first = False
                answer, close = await self._loop.run_in_executor(self._pool, self._answer, request, peer)
                writer.write(answer)
                async with asyncio.timeout(self.limits.send_s):
                    await writer.drain()
                if close:
                    return
        except _Refused as refused:
            writer.write(refused.answer)
            try:
                async with asyncio.timeout(self.limits.send_s):
                    await writer.drain()
            except (OSError, TimeoutError):
                pass
        except (OSError, TimeoutError, EOFError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # a client that went away, stalled or broke TLS: nothing to answer, nobody to tell
        finally:
            self._open.discard(writer)
            self._waiting.pop(writer, None)
            writer.transport.abort()

    def _make_room(self, arrived: asyncio.StreamWriter) -> None:
        """Over the bound: close the connection that has waited longest for its request (this one if
        every other is being answered)."""
        oldest = next(iter(self._waiting), arrived)
        self._waiting.pop(oldest, None)
        self._open.discard(oldest)
        self.evicted += 1
        oldest.transport.abort()

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, wait_s: float
                    ) -> Request | None:
        """The next request, head and body; None when the client closed or stayed silent."""
        try:
            async with asyncio.timeout(wait_s):
                head = await reader.readuntil(HEAD_END)
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            raise _Refused(plain(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                 f"a request's head here is at most {self.limits.head_bytes} bytes")) from None
        length, expects_continue = _body_length(head, self.limits.body_bytes)
        if not length:
            return Request(head, time.monotonic())
        if expects_continue:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            async with asyncio.timeout(self.limits.body_s):
                body = await reader.readexactly(length)
        except TimeoutError:
            raise _Refused(plain(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within {self.limits.body_s:g} s "
                                                             "(is the Content-Length right?)")) from None
        return Request(head + body, time.monotonic())

    def _answer(self, request: Request, peer: Any) -> tuple[bytes, bool]:
        """In a worker: the handler's answer to one request, and whether to close the connection after it."""
        try:
            handler = self.handler(request, peer, self)  # type: ignore[arg-type]
        except Exception as e:
            now = time.monotonic()
            if now - self._last_failure_log >= FAILURE_LOG_INTERVAL_S:
                self._last_failure_log = now
                log.error("http_handler_failed", server=self._name, error=repr(e),
                          consequence="the client got 500; at most one such line a minute")
            return plain(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; the server's log says more"), True
        return handler.wfile.getvalue(), handler.close_connection  # type: ignore[attr-defined]


def _quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's reports of failed TLS handshakes and reset connections: any client can cause them, so
    they are not worth a log line each."""
    log.debug("http_connection_error", message=context.get("message"), error=repr(context.get("exception")))


class NotJson(ValueError):
    """A request body that is not one JSON document sent as application/json; str() says why."""


def json_body(content_type: str | None, body: bytes, what: str) -> Any:
    """The JSON document a request's body holds (`what` it should be, for the message); NotJson for
    another Content-Type, a body that is not JSON, or one nested too deeply to read."""
    media = (content_type or "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise NotJson(f"Content-Type {media[:40] or 'missing'!r}: {what} is application/json")
    try:
        return json.loads(body)
    except RecursionError:
        raise NotJson("the JSON is nested too deeply") from None
    except ValueError as e:  # bad JSON, bad UTF-8, an integer too long
        raise NotJson(f"not JSON: {e}") from None


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening; an IPv6 family where host has a colon."""
    # IPPROTO_TCP by name: asyncio sets TCP_NODELAY only on connections whose protocol says TCP, and
    # without it a TLS 1.3 answer waits for the client's delayed ACK of the session tickets (~25 ms).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock

