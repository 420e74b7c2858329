"""The webhook's serving certificate, made and renewed with nobody's help, and its CA in the
webhook configurations that call it (deploy/'s mutating and validating ones).

The Secret that deploy/ installs empty (`gemtrace-webhook-tls`) is the one home of the certificate:
every replica of `gemtrace kube-webhook` reads it, and one that finds it empty or due for renewal
makes a new CA and serving certificate (the openssl program, which the image has) and writes them
with the Secret's resourceVersion, so that of two replicas racing, one wins and the other takes the
winner's (409 Conflict). Each replica serves the Secret's certificate and makes the caBundle of
each webhook configuration it is given the Secret's CA bundle, patching exactly those objects (its
RBAC names them). A configuration that is not there (404: an install that left it out) is logged
and skipped, so that the others stay trusted.
A renewal puts the new CA first in the bundle and keeps the previous one, so that a replica still
serving the previous certificate is trusted until it loads the new one (within CHECK_S).

`due` and `bundle_after` are pure (they take the time); `Keeper` is the adapter to the apiserver and
the files. Never writes any object but that Secret and those webhook configurations.
"""

from __future__ import annotations

import base64
import os
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gemtrace.kube.apiserver import ApiError, Apiserver, Conflict, NotFound

log = structlog.get_logger("gemtrace.kube.servingcert")

LIFETIME_DAYS = 365
# Renewed with a quarter of its life left: months in which a failing renewal is logged every minute.
RENEW_BEFORE_S = 91 * 86400
CHECK_S = 60.0
KEYS = ("ca.crt", "ca.key", "tls.crt", "tls.key")
BEGIN = "-----BEGIN CERTIFICATE-----"
# The resources of the two kinds of webhook configuration, as the apiserver's paths name them.
MUTATING = "mutatingwebhookconfigurations"
VALIDATING = "validatingwebhookconfigurations"


@dataclass(frozen=True)
class Pair:
    """A CA bundle (PEM: the CA that signed the certificate first) and the serving certificate."""

    ca_bundle: str
    ca_key: str
    cert: str
    key: str

    def data(self) -> dict[str, str]:
        """The Secret's data: base64 of each PEM."""
        values = (self.ca_bundle, self.ca_key, self.cert, self.key)
        return {k: base64.b64encode(v.encode()).decode() for k, v in zip(KEYS, values, strict=True)}

    @classmethod
    def from_data(cls, data: dict[str, str] | None) -> Pair | None:
        """The pair a Secret's data holds, None where a key is missing or not base64 of text."""
        data = data or {}
        try:
            values = [base64.b64decode(data[k], validate=True).decode() for k in KEYS]
        except (KeyError, ValueError, TypeError):
            return None
        return cls(*values)


def certificates(bundle: str) -> list[str]:
    """The PEM certificates of a bundle, in its order."""
    return [BEGIN + part.split("-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n"
            for part in bundle.split(BEGIN)[1:]]


def not_after(cert_pem: str) -> float:
    """The certificate's end of validity, seconds since the epoch."""
    out = _openssl(["x509", "-noout", "-enddate"], stdin=cert_pem).strip()
    return ssl.cert_time_to_seconds(out.partition("=")[2])


def due(pair: Pair | None, now: float) -> bool:
    """Whether the Secret's pair must be made anew: missing, or its certificate or CA ends within
    RENEW_BEFORE_S."""
    if pair is None or not certificates(pair.ca_bundle) or BEGIN not in pair.cert:
        return True
    try:
        end = min(not_after(pair.cert), not_after(certificates(pair.ca_bundle)[0]))
    except (ValueError, OSError):
        return True
    return end - now < RENEW_BEFORE_S


def bundle_after(new_ca: str, previous: Pair | None, now: float) -> str:
    """The caBundle once `new_ca` replaces `previous`: the new CA, then the previous CA while it is
    valid (replicas serve its certificate until they load the new one)."""
    if previous is None:
        return new_ca
    kept = [ca for ca in certificates(previous.ca_bundle)[:1] if _valid(ca, now)]
    return new_ca + "".join(kept)


def _valid(cert: str, now: float) -> bool:
    try:
        return not_after(cert) > now
    except (ValueError, OSError):
        return False


def make_pair(names: list[str]) -> tuple[str, str, str, str]:
    """A new CA (its certificate and key) and a serving certificate for the DNS `names` it signed
    (certificate and key), PEM, valid LIFETIME_DAYS."""
    days = str(LIFETIME_DAYS)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with tempfile.TemporaryDirectory(prefix="gemtrace-cert-") as tmp:
        d = Path(tmp)
        _openssl(["req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-days", days,
                  "-subj", "/CN=gemtrace-webhook-ca"])
        _openssl(["req", "-x509", *ec, "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt"), "-days", days,
                  "-subj", f"/CN={names[0]}", "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                  "-addext", "subjectAltName=" + ",".join(f"DNS:{n}" for n in names),
                  "-addext", "basicConstraints=critical,CA:FALSE", "-addext", "extendedKeyUsage=serverAuth"])
        return tuple((d / f).read_text() for f in KEYS)  # type: ignore[return-value]


def _openssl(args: list[str], stdin: str | None = None) -> str:
    try:
        done = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise OSError("the openssl program is missing: install it (Debian: apt-get install openssl)") from None
    if done.returncode != 0:
        raise ValueError(f"openssl {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Keeper:
    """Keeps `secret` (namespace, name) holding a valid pair for the service (namespace, name), its
    certificate in the files `cert` and `key`, and the caBundle of each of `configurations`
    (resource, name: MUTATING or VALIDATING and the object's name) trusting it."""

    api: Apiserver
    secret: tuple[str, str]
    service: tuple[str, str]
    configurations: tuple[tuple[str, str], ...]
    cert: Path
    key: Path
    clock: Callable[[], float] = time.time
    on_change: Callable[[], None] = lambda: None
    serving: Pair | None = None

    def names(self) -> list[str]:
        namespace, name = self.service
        return [f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]

    def check(self) -> Pair:
        """One round: renew if due, load what the Secret holds, patch the caBundle if it differs."""
        pair = self._current_or_renewed()
        if pair != self.serving:
            _write(self.key, pair.key, 0o600)
            _write(self.cert, pair.cert, 0o644)
            self.serving = pair
            log.info("webhook_certificate_loaded", not_after=int(not_after(pair.cert)))
            self.on_change()
        for resource, name in self.configurations:
            self._patch_bundle(resource, name, pair.ca_bundle)
        return pair

    def _secret_path(self) -> str:
        namespace, name = self.secret
        return f"/api/v1/namespaces/{namespace}/secrets/{name}"

    def _current_or_renewed(self) -> Pair:
        secret = self.api.call("GET", self._secret_path())
        pair = Pair.from_data(secret.get("data"))
        now = self.clock()
        if not due(pair, now):
            assert pair is not None
            return pair
        ca, ca_key, cert, key = make_pair(self.names())
        new = Pair(bundle_after(ca, pair, now), ca_key, cert, key)
        secret["data"] = new.data()  # the Secret's resourceVersion stays: a concurrent write is a 409
        try:
            self.api.call("PUT", self._secret_path(), secret)
        except Conflict:
            # Another replica renewed first: serve its pair.
            found = Pair.from_data(self.api.call("GET", self._secret_path()).get("data"))
            if found is None or due(found, now):
                raise ApiError(f"{self._secret_path()} changed while renewing and holds no valid certificate; "
                               "the next check tries again") from None
            return found
        log.info("webhook_certificate_made", secret="/".join(self.secret), names=self.names(),
                 not_after=int(not_after(cert)), renewed=pair is not None)
        return new

    def _patch_bundle(self, resource: str, name: str, bundle: str) -> None:
        path = f"/apis/admissionregistration.k8s.io/v1/{resource}/{name}"
        try:
            configuration = self.api.call("GET", path)
        except NotFound:
            log.warning("webhook_configuration_missing", configuration=f"{resource}/{name}")
            return
        wanted = base64.b64encode(bundle.encode()).decode()
        patch: list[dict[str, Any]] = []
        for i, webhook in enumerate(configuration.get("webhooks") or []):
            service = (webhook.get("clientConfig") or {}).get("service") or {}
            if (service.get("namespace"), service.get("name")) != self.service:
                continue
            if webhook["clientConfig"].get("caBundle") != wanted:
                # The test op: a webhook list reordered meanwhile fails the patch, not another webhook.
                patch += [{"op": "test", "path": f"/webhooks/{i}/name", "value": webhook.get("name")},
                          {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": wanted}]
        if patch:
            self.api.call("PATCH", path, patch, content_type="application/json-patch+json")
            log.info("webhook_ca_bundle_patched", configuration=f"{resource}/{name}", webhooks=len(patch) // 2)

    def run(self, stop: threading.Event) -> None:
        """check() every CHECK_S until `stop`; a failed check is logged and tried again then."""
        while not stop.wait(CHECK_S):
            try:
                self.check()
            except (ApiError, ValueError, OSError) as e:
                log.warning("webhook_certificate_check_failed", error=str(e))


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(name, mode)
    os.replace(name, path)
