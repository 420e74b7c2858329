"""Who may read /metrics: the web config file of `gemtrace agent --web-config FILE`.

Owns reading and checking that file, in the format of the Prometheus exporters' web config
(node_exporter's `--web.config.file`: https://prometheus.io/docs/prometheus/latest/configuration/https/),
and the two checks it asks for: TLS, as an `ssl.SSLContext` from Python's ssl module (certificates
and, if asked, clients' certificates), and HTTP basic auth against bcrypt hashes, checked by the
`bcrypt` package (imported only when the file has users). Every mistake in the file is found when
the agent starts and reported as one line naming the file and the key; the exporter
(gemtrace.agent.exporter) does the serving. The subset gemtrace reads:

    tls_server_config:
      cert_file: /etc/gemtrace/tls.crt
      key_file: /etc/gemtrace/tls.key
      client_ca_file: /etc/gemtrace/clients-ca.crt     # optional, with client_auth_type
      client_auth_type: RequireAndVerifyClientCert     # or VerifyClientCertIfGiven, NoClientCert
      min_version: TLS12                               # optional, also max_version
    basic_auth_users:
      prometheus: $2y$10$...                           # htpasswd -nBC 10 prometheus
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

TLS_KEYS = ("cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version")
TOP_KEYS = ("tls_server_config", "basic_auth_users")
# Keys of the exporters' format that gemtrace does not implement: refused by name rather than as typos.
UNSUPPORTED_KEYS = {
    "http_server_config": "HTTP/2 and extra response headers",
    "cert": "certificates written inline (use cert_file)",
    "key": "keys written inline (use key_file)",
    "client_ca": "a client CA written inline (use client_ca_file)",
    "cipher_suites": "choosing cipher suites",
    "curve_preferences": "choosing curves",
    "prefer_server_cipher_suites": "choosing cipher suites",
    "client_allowed_sans": "matching clients' subject alternative names",
}
# client_auth_type -> what the ssl module asks of a client. Go's RequestClientCert and
# RequireAnyClientCert accept certificates nobody verifies; Python's ssl verifies every certificate
# it asks for, so they are refused rather than silently made stricter or looser.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# bcrypt's modular crypt format: $2a$, $2b$ or $2y$ (htpasswd -B), a cost 04-31, 53 characters of
# salt and hash in bcrypt's base64 alphabet.
BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")


class WebConfigError(ValueError):
    """A web config file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class WebConfig:
    path: Path
    tls: ssl.SSLContext | None = None
    basic_auth: BasicAuth | None = None

    def describe(self) -> str:
        """What the file turns on, for the agent's start-up log."""
        parts = []
        if self.tls is not None:
            parts.append("tls" + ("+client_certs" if self.tls.verify_mode != ssl.CERT_NONE else ""))
        if self.basic_auth is not None:
            parts.append("basic_auth")
        return ",".join(parts)


@dataclass
class BasicAuth:
    """Checks `Authorization: Basic ...` against bcrypt hashes.

    A bcrypt check costs tens of milliseconds by design, and Prometheus sends the same credentials
    every scrape: credentials once accepted are remembered (as a SHA-256 of user, hash and password,
    never the password) so that a scrape costs one check per agent start, as the exporter-toolkit
    does. Refused credentials are checked afresh each time, which keeps guessing slow. A user not in
    the file is checked against a configured hash all the same, so the answer's delay does not say
    which users exist."""

    users: Mapping[str, bytes]
    bcrypt: ModuleType
    _accepted: set[bytes] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    ACCEPTED_MAX = 64

    def allows(self, authorization: str | None) -> bool:
        credentials = _basic_credentials(authorization)
        if credentials is None:
            return False
        user, password = credentials
        hashed = self.users.get(user)
        known = hashed is not None
        if hashed is None:
            hashed = next(iter(self.users.values()))
        key = hashlib.sha256(b"\0".join((user.encode(), hashed, password))).digest()
        with self._lock:
            if known and key in self._accepted:
                return True
        ok = bool(self.bcrypt.checkpw(password, hashed)) and known
        if ok:
            with self._lock:
                if len(self._accepted) >= self.ACCEPTED_MAX:
                    self._accepted.clear()
                self._accepted.add(key)
        return ok


def _basic_credentials(authorization: str | None) -> tuple[str, bytes] | None:
    """`Basic base64(user:password)` -> (user, password); None for anything else."""
    if not authorization:
        return None
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


def load(path: Path) -> WebConfig:
    """Read and check the web config at `path`; WebConfigError says what is wrong and where."""
    try:
        import yaml
    except ImportError:
        raise WebConfigError(f"{path}: reading it needs PyYAML: apt-get install python3-yaml "
                             "(or pip install pyyaml)") from None
    try:
        text = path.read_text()
    except OSError as e:
        raise WebConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise WebConfigError(f"{path}{line}: not valid YAML: {problem}") from None
    return parse(document, path)


def parse(document: Any, path: Path) -> WebConfig:
    """The checked WebConfig of an already-parsed YAML document; relative paths in it are relative
    to the file's directory, as the exporters read them."""
    if document is None:
        raise WebConfigError(f"{path}: empty; give tls_server_config, basic_auth_users or both "
                             "(or leave out --web-config)")
    top = _mapping(document, path, "", TOP_KEYS)
    if not top:
        raise WebConfigError(f"{path}: no tls_server_config or basic_auth_users; give one (or leave out --web-config)")
    tls = None
    if top.get("tls_server_config") is not None:
        tls = _tls_context(_mapping(top["tls_server_config"], path, "tls_server_config", TLS_KEYS), path)
    auth = None
    if top.get("basic_auth_users") is not None:
        auth = _basic_auth(top["basic_auth_users"], path)
    if tls is None and auth is None:
        raise WebConfigError(f"{path}: tls_server_config and basic_auth_users are both empty; fill one in "
                             "(or leave out --web-config)")
    return WebConfig(path, tls, auth)


def _mapping(value: Any, path: Path, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    name = where or "the file"
    if not isinstance(value, dict):
        raise WebConfigError(f"{path}: {name}: expected a mapping of keys to values, found {_kind(value)}")
    for key in value:
        full = f"{where}.{key}" if where else str(key)
        if key in UNSUPPORTED_KEYS:
            raise WebConfigError(f"{path}: {full}: gemtrace does not support {UNSUPPORTED_KEYS[key]}; remove it")
        if key not in known:
            raise WebConfigError(f"{path}: {full}: unknown key; {name} takes {', '.join(known)}")
    return value


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"a {type(value).__name__}"


def _string(section: Mapping[str, Any], key: str, path: Path, where: str) -> str | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise WebConfigError(f"{path}: {where}.{key}: expected a string, found {_kind(value)}")
    return value


def _file(section: Mapping[str, Any], key: str, path: Path, where: str) -> Path | None:
    value = _string(section, key, path, where)
    if value is None:
        return None
    file = path.parent / value  # an absolute value stays itself
    try:
        file.open("rb").close()
    except OSError as e:
        raise WebConfigError(f"{path}: {where}.{key}: cannot read {file}: {e.strerror or e}") from None
    return file


def _tls_context(section: Mapping[str, Any], path: Path) -> ssl.SSLContext:
    where = "tls_server_config"
    cert = _file(section, "cert_file", path, where)
    key = _file(section, "key_file", path, where)
    for name, value in (("cert_file", cert), ("key_file", key)):
        if value is None:
            raise WebConfigError(f"{path}: {where}.{name}: missing; TLS needs both cert_file and key_file")
    assert cert is not None and key is not None
    ca = _file(section, "client_ca_file", path, where)
    auth_type = _string(section, "client_auth_type", path, where)
    if auth_type is not None and auth_type not in CLIENT_AUTH:
        raise WebConfigError(f"{path}: {where}.client_auth_type: {auth_type!r} is not one gemtrace supports; "
                             f"use {', '.join(CLIENT_AUTH)}")
    verify = CLIENT_AUTH[auth_type or "NoClientCert"]
    if ca is not None and verify == ssl.CERT_NONE:
        raise WebConfigError(f"{path}: {where}.client_ca_file: set, but client_auth_type does not ask clients for "
                             "certificates; set client_auth_type: RequireAndVerifyClientCert")
    if ca is None and verify != ssl.CERT_NONE:
        raise WebConfigError(f"{path}: {where}.client_auth_type: {auth_type} needs client_ca_file, the CA that "
                             "signs the clients' certificates")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # the exporters' default min_version
    for name, attribute in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
        version = _string(section, name, path, where)
        if version is None:
            continue
        if version not in TLS_VERSIONS:
            raise WebConfigError(f"{path}: {where}.{name}: {version!r} is not a TLS version; use "
                                 f"{', '.join(TLS_VERSIONS)}")
        setattr(context, attribute, TLS_VERSIONS[version])
    try:
        context.load_cert_chain(certfile=cert, keyfile=key)
    except (ssl.SSLError, OSError) as e:
        raise WebConfigError(f"{path}: {where}.cert_file: {cert} with key_file {key}: not a certificate and its "
                             f"private key in PEM ({getattr(e, 'reason', None) or e})") from None
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as e:
            raise WebConfigError(f"{path}: {where}.client_ca_file: {ca}: not PEM certificates "
                                 f"({getattr(e, 'reason', None) or e})") from None
        context.verify_mode = verify
    return context


def _basic_auth(value: Any, path: Path) -> BasicAuth | None:
    where = "basic_auth_users"
    if not isinstance(value, dict):
        raise WebConfigError(f"{path}: {where}: expected a mapping of user names to bcrypt hashes, "
                             f"found {_kind(value)}")
    if not value:
        return None
    users: dict[str, bytes] = {}
    for user, hashed in value.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(f"{path}: {where}.{user}: a user name is a string without ':'")
        if not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed):
            raise WebConfigError(f"{path}: {where}.{user}: not a bcrypt hash; make one with "
                                 f"`htpasswd -nBC 10 {user}` (the part after the colon)")
        users[user] = hashed.encode()
    try:
        import bcrypt
    except ImportError:
        raise WebConfigError(f"{path}: {where}: checking passwords needs the bcrypt Python package: "
                             "apt-get install python3-bcrypt (or pip install bcrypt)") from None
    return BasicAuth(users, bcrypt)
