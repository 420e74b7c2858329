"""Hostile HTTP clients, for the servers' flood tests and benches: run as a script (the standard library
only, so that an unprivileged user's system python3 can), it opens `--count` connections of one kind to
127.0.0.1:PORT, prints "ready" once all are open, and holds them until killed.

    idle     connects and sends nothing (with --tls: never starts the handshake)
    slow     sends a request's head one byte a second, never ending it
    partial  sends a whole head saying Content-Length: 100000, then 10 bytes of body, and stops
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
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
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
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


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
    for _ in range(args.count):
        if args.mode == "scrape":
            threads.append(threading.Thread(target=scrape, args=(args.port, args.tls, stop), daemon=True))
            continue
        sock = connect(args.port, args.tls, handshake=args.mode != "idle")
        held.append(sock)
        if args.mode == "slow":
            threads.append(threading.Thread(target=slow, args=(sock, stop), daemon=True))
        elif args.mode == "partial":
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"kind\": \"")
    for thread in threads:
        thread.start()
    print("ready", flush=True)
    try:
        sys.stdin.read()  # until the test closes our stdin or kills us
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
