"""The /metrics endpoint: a small threaded HTTP server over a prometheus-client registry.

Serves only what the collectors yield at scrape time; it keeps no state of its own. Uses
prometheus-client's own handler (content negotiation, OpenMetrics) as shipped by Debian 12 (0.16).
"""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler


class ListenError(ValueError):
    pass


def parse_listen(listen: str) -> tuple[str, int]:
    """"127.0.0.1:9843", "[::1]:9843" or ":9843" (all addresses) -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ListenError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:9843")
    return host.strip("[]"), int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, ipv6: bool) -> None:
        if ipv6:
            import socket

            self.address_family = socket.AF_INET6
        super().__init__(address, handler)


class Exporter:
    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        host, port = parse_listen(listen)
        self.server = _Server((host, port), MetricsHandler.factory(registry), ipv6=":" in host)
        self.address = f"{host}:{self.server.server_address[1]}"
        # serve_forever looks for shutdown() this often: the default 0.5 s would add as much to every stop.
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="gemtrace-exporter",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
