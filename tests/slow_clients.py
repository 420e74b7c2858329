"""Hostile HTTP clients, for the servers' flood tests and benches: run as a script (the standard library
only, so that an unprivileged user's system python3 can), it opens `--count` connections of one kind to
127.0.0.1:PORT, prints "ready" once all are open (or 10 s have passed: a server that stopped accepting), and holds them
until killed.

    idle     connects and sends nothing (with --tls: never starts the handshake)
    slow     sends a request's head one byte a second, never ending it
    partial  sends a whole head saying Content-Length: 100000, then 10 bytes of body, and stops
(each connects again as soon as the server closes it)
    scrape   asks GET /metrics back to back, reading each answer (with --tls: unverified)

    python3 tests/slow_clients.py --port PORT --mode idle --count 100 [--tls]
"""

from __future__ import annotations

import argparse
import socket
import ssl
import sys
import threading
import time

SLOW_HEAD = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Padding: " + b"a" * 4096


def connect(port: int, tls: bool, handshake: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if tls and handshake:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        sock = context.wrap_socket(sock)
    return sock


def slow(sock: socket.socket, stop: threading.Event) -> None:
    for byte in SLOW_HEAD:
        if stop.wait(1.0):
            return
        sock.sendall(bytes([byte]))


def scrape(port: int, tls: bool, stop: threading.Event) -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    while not stop.is_set():
        try:
            with connect(port, tls) as sock:
                while not stop.is_set():
                    sock.sendall(request)
                    reader = sock.makefile("rb")
                    length = 0
                    while (line := reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    if not reader.read(length):
                        break
        except OSError:
            time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=("idle", "slow", "partial", "scrape"), required=True)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--tls", action="store_true")
    args = ap.parse_args()
    stop = threading.Event()
    held: list[socket.socket] = []
    threads = []

    def hold() -> None:
        """One connection of the mode, opened again whenever the server closes it: a flood that lasts."""
        while not stop.is_set():
            try:
                sock = connect(args.port, args.tls, handshake=args.mode != "idle")
            except OSError:
                stop.wait(0.5)  # a server whose backlog is full: try again
                continue
            held.append(sock)
            try:
                sock.settimeout(None)
                if args.mode == "slow":
                    slow(sock, stop)
                else:
                    if args.mode == "partial":
                        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 100000\r\n\r\n{\"kind\": \"")
                    while sock.recv(65536):  # until the server closes it
                        pass
            except OSError:
                pass
            finally:
                sock.close()

    for _ in range(args.count):
        target, targs = (scrape, (args.port, args.tls, stop)) if args.mode == "scrape" else (hold, ())
        threads.append(threading.Thread(target=target, args=targs, daemon=True))
        threads[-1].start()
    deadline = time.monotonic() + 10
    while len(held) < args.count and args.mode != "scrape" and time.monotonic() < deadline:
        time.sleep(0.01)
    print("ready", flush=True)
    try:
        sys.stdin.read()  # until the test closes our stdin or kills us
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
