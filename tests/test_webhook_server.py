"""`gemtrace kube-webhook` as a server, over real TLS sockets: an unprivileged user's idle, slow and
partial-body connections do not delay a valid review past 1 s, and every malformed request gets an HTTP
answer (`allowed: false` with its uid for a review whose pod cannot be read, 400 for anything else).
The review's logic itself: tests/test_kube_units.py."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_metrics_access import SYSTEM_PYTHON, make_cert
from test_trust import Adversary, adversary  # noqa: F401 (a fixture)

from gemtrace import httpd
from gemtrace.kube import webhook
from gemtrace.kube.injection import Injection
from gemtrace.kube.shares import LABEL_GROUP

SLOW_CLIENTS = Path(__file__).parent / "slow_clients.py"
FLOOD = 100
DEADLINE_S = 1.0


def pod(**labels: object) -> dict:
    return {"metadata": {"name": "p", "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


def admission(uid: str = "u-1", obj: object = None) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": uid, "namespace": "ns", "object": obj or pod(**{LABEL_GROUP: "train"})}}
                      ).encode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, ssl.SSLContext]]:
    directory = tmp_path_factory.mktemp("webhook")
    cert, key = make_cert(directory, "webhook")
    server = webhook.server("127.0.0.1:0", cert, key, Injection(), lambda: {"train"})
    server.start()
    trust = ssl.create_default_context(cafile=str(cert))
    yield server.server_address[1], trust
    server.stop()


def post(where: tuple[int, ssl.SSLContext], body: bytes, content_type: str = "application/json",
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    port, trust = where
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=trust, timeout=10)
    try:
        connection.request("POST", "/mutate", body=body, headers={"Content-Type": content_type, **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def timed_review(where: tuple[int, ssl.SSLContext]) -> float:
    """Seconds for one valid review, connection and handshake included; asserts it was gated."""
    began = time.monotonic()
    status, body = post(where, admission("timed"))
    elapsed = time.monotonic() - began
    answer = json.loads(body)["response"]
    assert status == 200 and answer["uid"] == "timed" and answer["allowed"] and answer["patchType"] == "JSONPatch"
    return elapsed


# -- every malformed request gets an HTTP answer ----------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000

NOT_REVIEWS = {
    "JSON null": b"null",
    "a list": b"[1, 2]",
    "a string": b'"AdmissionReview"',
    "request null": b'{"kind": "AdmissionReview", "request": null}',
    "request a list": b'{"kind": "AdmissionReview", "request": []}',
    "no uid": b'{"kind": "AdmissionReview", "request": {"object": {}}}',
    "uid a number": b'{"kind": "AdmissionReview", "request": {"uid": 7}}',
    "another kind": b'{"kind": "Pod", "request": {"uid": "u"}}',
    "deep nesting": DEEP,
    "deep nesting inside the pod": b'{"request": {"uid": "u", "object": ' + DEEP + b"}}",
    "bad UTF-8": b'{"request": {"uid": "\xff\xfe"}}',
    "not JSON": b"{kind: AdmissionReview",
    "an integer too long": b'{"request": {"uid": "u", "x": ' + b"9" * 10_000 + b"}}",
    "empty": b"",
}


@pytest.mark.unit
@pytest.mark.parametrize("body", NOT_REVIEWS.values(), ids=NOT_REVIEWS.keys())
def test_a_body_that_is_no_review_gets_400_saying_why(served, body: bytes) -> None:
    status, answer = post(served, body)
    assert status == 400 and answer.startswith(b"not an AdmissionReview: "), answer[:200]


BAD_PODS = {
    "object a list": [],
    "metadata a list": {"metadata": []},
    "labels a list": {"metadata": {"labels": [LABEL_GROUP, "train"]}},
    "label a number": {"metadata": {"labels": {LABEL_GROUP: 7}}},
    "label no group name": {"metadata": {"labels": {LABEL_GROUP: "../etc"}}},
    "spec a string": {"metadata": {"labels": {LABEL_GROUP: "train"}}, "spec": "x"},
    "containers a dict": {"metadata": {"labels": {LABEL_GROUP: "train"}}, "spec": {"containers": {"c": {}}}},
    "a container a string": {"metadata": {"labels": {LABEL_GROUP: "train"}}, "spec": {"containers": ["c"]}},
    "env a dict": {"metadata": {"labels": {LABEL_GROUP: "train"}},
                   "spec": {"containers": [{"name": "c", "env": {"A": "1"}}]}},
    "env items strings": {"metadata": {"labels": {LABEL_GROUP: "train"}},
                          "spec": {"containers": [{"name": "c", "env": ["A=1"]}]}},
    "volumes a dict": {"metadata": {"labels": {LABEL_GROUP: "train"}}, "spec": {"volumes": {}, "containers": []}},
    "volumeMounts a string": {"metadata": {"labels": {LABEL_GROUP: "train"}},
                              "spec": {"initContainers": [{"name": "i", "volumeMounts": "x"}]}},
}


@pytest.mark.unit
@pytest.mark.parametrize("obj", BAD_PODS.values(), ids=BAD_PODS.keys())
def test_a_review_whose_pod_cannot_be_read_is_refused_with_its_uid_and_a_reason(served, obj: object) -> None:
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u-bad", "object": obj}}).encode()
    status, answer = post(served, body)
    assert status == 200, answer[:200]
    response = json.loads(answer)["response"]
    assert response["uid"] == "u-bad" and response["allowed"] is False
    assert response["status"]["code"] == 400 and response["status"]["message"]


@pytest.mark.unit
@pytest.mark.parametrize("content_type", ["text/plain", "", "application/x-www-form-urlencoded"])
def test_a_review_in_another_content_type_gets_400(served, content_type: str) -> None:
    status, answer = post(served, admission(), content_type=content_type)
    assert status == 400 and b"application/json" in answer


def raw(where: tuple[int, ssl.SSLContext], request: bytes) -> bytes:
    """What the server sends back to `request`, written as is, until it closes or 10 s pass."""
    port, trust = where
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain_sock, \
            trust.wrap_socket(plain_sock, server_hostname="localhost") as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
            if b"\r\n\r\n" in received and (b"Connection: close" in received or b"400" in received[:16]):
                break
        return received


FRAMING = {
    "two Content-Lengths": (b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", b" 400 "),
    "a negative Content-Length": (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b" 400 "),
    "Content-Length not a number": (b"POST / HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n", b" 400 "),
    "a chunked body": (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", b" 411 "),
    "a body over the limit": (b"POST / HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n", b" 413 "),
    "a head over the limit": (b"POST / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", b" 431 "),
    "a request line that is no HTTP": (b"HELLO\r\n\r\n", b" 400 "),
    "another method": (b"DELETE / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b" 501 "),
}


@pytest.mark.unit
@pytest.mark.parametrize("request_bytes, status", FRAMING.values(), ids=FRAMING.keys())
def test_a_request_badly_framed_gets_an_http_error(served, request_bytes: bytes, status: bytes) -> None:
    answer = raw(served, request_bytes)
    assert answer.startswith(b"HTTP/1.") and status in answer.split(b"\r\n")[0], answer[:200]


@pytest.mark.unit
def test_a_body_shorter_than_its_content_length_gets_408_and_frees_its_connection(served) -> None:
    port, trust = served
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as plain_sock, \
            trust.wrap_socket(plain_sock, server_hostname="localhost") as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{}")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert webhook.LIMITS.body_s - 1 <= time.monotonic() - began <= webhook.LIMITS.body_s + 5


@pytest.mark.unit
def test_reviews_on_one_kept_alive_connection_are_each_answered(served) -> None:
    port, trust = served
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=trust, timeout=10)
    try:
        for uid in ("k1", "k2", "k3"):
            connection.request("POST", "/", body=admission(uid), headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            assert json.loads(response.read())["response"]["uid"] == uid
    finally:
        connection.close()


# -- floods from an unprivileged user ---------------------------------------------------------------

def flood(user: Adversary, port: int, mode: str, count: int = FLOOD, tls: bool = True
          ) -> subprocess.Popen[str]:
    """`count` hostile connections held by the user until the returned process is killed."""
    proc = subprocess.Popen(user.command(SYSTEM_PYTHON, str(SLOW_CLIENTS), "--port", str(port), "--mode", mode,
                                              "--count", str(count), *(["--tls"] if tls else [])),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
    return proc


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["idle", "slow", "partial"])
def test_a_hundred_hostile_connections_do_not_delay_a_valid_review_past_a_second(
        served, adversary: Adversary, mode: str) -> None:  # noqa: F811 (the fixture)
    """Side by side: reviews with nobody else connected, then with the user's FLOOD connections held."""
    quiet = [timed_review(served) for _ in range(5)]
    attacker = flood(adversary, served[0], mode)
    try:
        loaded = [timed_review(served) for _ in range(10)]
    finally:
        attacker.kill()
        attacker.wait()
    assert max(loaded) < DEADLINE_S, (f"{mode}: reviews took {loaded} under the flood, "
                                      f"{statistics.median(quiet):.3f} s alone")


@pytest.mark.unit
def test_past_the_connection_bound_the_longest_waiting_connection_makes_room(tmp_path: Path) -> None:
    """More hostile connections than the server keeps: the oldest idle ones are closed, and a valid
    review still gets through."""
    cert, key = make_cert(tmp_path, "webhook")
    limits = httpd.Limits(connections=20, body_bytes=webhook.LIMITS.body_bytes)
    sock = httpd.listening_socket("127.0.0.1", 0)
    server = httpd.Server(sock, webhook._handler(Injection(), lambda: {"train"}), None, limits)
    server.start()
    try:
        port = server.server_address[1]
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        time.sleep(0.2)
        began = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("POST", "/", body=admission("room"), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["response"]["uid"] == "room"
        assert time.monotonic() - began < DEADLINE_S
        assert server.evicted >= 20
        for s in idle:
            s.close()
    finally:
        server.stop()
