"""The webhook's certificate made, shared between replicas and renewed with nobody's help
(gemtrace/kube/servingcert.py), against a fake apiserver that keeps the Secret and the webhook
configuration the way the real one does: resourceVersions, 409 on a stale write, JSON patches."""

from __future__ import annotations

import base64
import copy
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gemtrace.kube import servingcert
from gemtrace.kube.apiserver import Apiserver
from gemtrace.kube.servingcert import Keeper, Pair

pytestmark = pytest.mark.unit

SECRET = "/api/v1/namespaces/gemtrace-system/secrets/gemtrace-webhook-tls"
CONFIGURATION = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/gemtrace-webhook"
VALIDATION = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/gemtrace-webhook-validation"
SERVICE_NAME = "gemtrace-webhook.gemtrace-system.svc"
DAY = 86400.0


class FakeApiserver:
    """The three objects the keeper may touch; every other path is 403, as the webhook's RBAC makes it.
    A path in `absent` is one the RBAC names but nobody created: 404."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {
            SECRET: {"metadata": {"name": "gemtrace-webhook-tls", "resourceVersion": "1"}, "type": "Opaque"},
            CONFIGURATION: {"metadata": {"name": "gemtrace-webhook", "resourceVersion": "1"}, "webhooks": [
                {"name": "other.example.com", "clientConfig": {"url": "https://example.com/", "caBundle": "b3RoZXI="}},
                {"name": "gate.gemtrace.io",
                 "clientConfig": {"service": {"name": "gemtrace-webhook", "namespace": "gemtrace-system"}}},
            ]},
            VALIDATION: {"metadata": {"name": "gemtrace-webhook-validation", "resourceVersion": "1"}, "webhooks": [
                {"name": "settings.gemtrace.io", "clientConfig": {
                    "service": {"name": "gemtrace-webhook", "namespace": "gemtrace-system", "path": "/validate"}}},
            ]},
        }
        self.absent: set[str] = set()
        self.writes: list[tuple[str, str]] = []
        self.before_put: list[dict[str, Any]] = []  # Secrets another replica writes just before ours
        self.lock = threading.Lock()

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        with self.lock:
            if path in self.absent:
                return 404, {"message": "not found"}
            if path not in self.objects:
                return 403, {"message": "forbidden"}
            current = self.objects[path]
            if method == "GET":
                return 200, copy.deepcopy(current)
            self.writes.append((method, path))
            if method == "PUT":
                if self.before_put:
                    self._store(path, self.before_put.pop(0))
                # As the apiserver: a write that names a resourceVersion is refused unless it is the current one.
                version = body["metadata"].get("resourceVersion")
                if version is not None and version != self.objects[path]["metadata"]["resourceVersion"]:
                    return 409, {"message": "the object has been modified"}
                self._store(path, body)
                return 200, copy.deepcopy(self.objects[path])
            if method == "PATCH":
                patched = copy.deepcopy(current)
                for op in body:
                    *parents, last = op["path"].strip("/").split("/")
                    node: Any = patched
                    for part in parents:
                        node = node[int(part)] if isinstance(node, list) else node[part]
                    if op["op"] == "test" and node[last] != op["value"]:
                        return 422, {"message": "test failed"}
                    if op["op"] == "add":
                        node[last] = op["value"]
                self._store(path, patched)
                return 200, copy.deepcopy(patched)
            return 405, {}

    def _store(self, path: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        version = int(self.objects[path]["metadata"]["resourceVersion"]) + 1
        obj["metadata"]["resourceVersion"] = str(version)
        self.objects[path] = obj

    def ca_bundle(self, path: str = CONFIGURATION) -> str | None:
        """The caBundle of the configuration's webhook that calls the Service."""
        client = self.objects[path]["webhooks"][-1]["clientConfig"]
        return base64.b64decode(client["caBundle"]).decode() if "caBundle" in client else None


@pytest.fixture
def api() -> Iterator[tuple[FakeApiserver, Apiserver]]:
    fake = FakeApiserver()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, answer = fake.handle(self.command, self.path, body)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = do_PATCH = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, Apiserver(f"http://127.0.0.1:{server.server_address[1]}", ssl.create_default_context())
    finally:
        server.shutdown()
        server.server_close()


def keeper(api: Apiserver, directory: Path, clock: float | None = None) -> Keeper:
    k = Keeper(api, ("gemtrace-system", "gemtrace-webhook-tls"), ("gemtrace-system", "gemtrace-webhook"),
               ((servingcert.MUTATING, "gemtrace-webhook"), (servingcert.VALIDATING, "gemtrace-webhook-validation")),
               directory / "tls.crt", directory / "tls.key")
    if clock is not None:
        k.clock = lambda: clock
    return k


def verifies(bundle: str, cert: Path, tmp: Path) -> bool:
    """Whether a client given `bundle` as its CAs accepts `cert` for the Service's name, as the
    apiserver does."""
    (tmp / "bundle.pem").write_text(bundle)
    done = subprocess.run(["openssl", "verify", "-CAfile", str(tmp / "bundle.pem"), "-verify_hostname", SERVICE_NAME,
                           "-purpose", "sslserver", str(cert)], capture_output=True, text=True)
    return done.returncode == 0


def test_an_empty_secret_is_filled_and_the_ca_put_in_only_the_webhooks_calling_the_service(
        api: tuple[FakeApiserver, Apiserver], tmp_path: Path) -> None:
    fake, client = api
    k = keeper(client, tmp_path / "a")
    pair = k.check()

    stored = Pair.from_data(fake.objects[SECRET]["data"])
    assert stored == pair
    assert (tmp_path / "a" / "tls.crt").read_text() == pair.cert
    assert (tmp_path / "a" / "tls.key").stat().st_mode & 0o777 == 0o600
    assert fake.ca_bundle() == pair.ca_bundle
    assert fake.ca_bundle(VALIDATION) == pair.ca_bundle  # the validating configuration's too
    assert fake.objects[CONFIGURATION]["webhooks"][0]["clientConfig"]["caBundle"] == "b3RoZXI="
    assert verifies(fake.ca_bundle() or "", tmp_path / "a" / "tls.crt", tmp_path)
    assert verifies(fake.ca_bundle(VALIDATION) or "", tmp_path / "a" / "tls.crt", tmp_path)
    # The certificate is good for a year, and the CA is one (not the serving certificate reused).
    assert abs(servingcert.not_after(pair.cert) - (time.time() + 365 * DAY)) < 600
    assert len(servingcert.certificates(pair.ca_bundle)) == 1 and pair.ca_bundle != pair.cert


def test_a_second_replica_serves_the_first_ones_pair_and_writes_nothing(
        api: tuple[FakeApiserver, Apiserver], tmp_path: Path) -> None:
    fake, client = api
    first = keeper(client, tmp_path / "a").check()
    writes = len(fake.writes)
    second = keeper(client, tmp_path / "b").check()
    assert second == first
    assert (tmp_path / "b" / "tls.crt").read_text() == first.cert
    assert len(fake.writes) == writes  # neither the Secret nor the caBundle written again


def test_a_replica_that_loses_the_race_serves_the_winners_pair(
        api: tuple[FakeApiserver, Apiserver], tmp_path: Path) -> None:
    fake, client = api
    winner = keeper(client, tmp_path / "winner").check()
    won = copy.deepcopy(fake.objects[SECRET])
    fake.objects[SECRET] = {"metadata": {"name": "gemtrace-webhook-tls", "resourceVersion": "7"}, "type": "Opaque"}
    fake.before_put.append(won)  # the other replica's write lands between our GET and our PUT
    loser = keeper(client, tmp_path / "loser").check()
    assert loser == winner
    assert Pair.from_data(fake.objects[SECRET]["data"]) == winner
    assert verifies(fake.ca_bundle() or "", tmp_path / "loser" / "tls.crt", tmp_path)


def test_renewal_comes_before_expiry_and_keeps_replicas_on_the_old_certificate_trusted(
        api: tuple[FakeApiserver, Apiserver], tmp_path: Path) -> None:
    fake, client = api
    old = keeper(client, tmp_path / "old").check()
    # 273 days on, the year's certificate has 92 days left: not yet due.
    assert keeper(client, tmp_path / "b", clock=time.time() + 273 * DAY).check() == old
    # 275 days on, 90 left: renewed.
    later = keeper(client, tmp_path / "new", clock=time.time() + 275 * DAY)
    changed: list[bool] = []
    later.on_change = lambda: changed.append(True)
    new = later.check()
    assert new.cert != old.cert and changed == [True]
    assert servingcert.certificates(new.ca_bundle)[1] == servingcert.certificates(old.ca_bundle)[0]
    bundle = fake.ca_bundle() or ""
    assert bundle == new.ca_bundle == fake.ca_bundle(VALIDATION)
    assert verifies(bundle, tmp_path / "new" / "tls.crt", tmp_path)
    assert verifies(bundle, tmp_path / "old" / "tls.crt", tmp_path)  # a replica that has not reloaded yet
    # The replica still serving the old pair loads the new one at its next check.
    reloaded: list[bool] = []
    stale = keeper(client, tmp_path / "old")
    stale.serving, stale.on_change = old, lambda: reloaded.append(True)
    assert stale.check() == new and reloaded == [True]
    assert (tmp_path / "old" / "tls.crt").read_text() == new.cert


def test_a_cleared_ca_bundle_is_put_back_at_the_next_check(
        api: tuple[FakeApiserver, Apiserver], tmp_path: Path) -> None:
    fake, client = api
    k = keeper(client, tmp_path / "a")
    pair = k.check()
    for path in (CONFIGURATION, VALIDATION):  # a re-apply of old manifests
        del fake.objects[path]["webhooks"][-1]["clientConfig"]["caBundle"]
    k.check()
    assert fake.ca_bundle() == pair.ca_bundle == fake.ca_bundle(VALIDATION)


def test_a_configuration_left_out_of_the_install_costs_only_its_own_bundle(
        api: tuple[FakeApiserver, Apiserver], tmp_path: Path) -> None:
    fake, client = api
    fake.absent.add(VALIDATION)
    pair = keeper(client, tmp_path / "a").check()
    assert fake.ca_bundle() == pair.ca_bundle
    assert ("PATCH", VALIDATION) not in fake.writes


@pytest.mark.parametrize("data", [None, {}, {"ca.crt": "bm90IHBlbQ==", "ca.key": "", "tls.crt": "", "tls.key": ""},
                                  {"ca.crt": "!!", "ca.key": "", "tls.crt": "", "tls.key": ""}])
def test_a_secret_without_a_readable_pair_is_due(data: dict[str, str] | None) -> None:
    assert servingcert.due(Pair.from_data(data), time.time())
