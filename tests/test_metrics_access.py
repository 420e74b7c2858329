"""Who can read /metrics: TLS and basic auth from a web config file (node_exporter's format), a unix
socket whose mode and group say who may connect, and every mistake in the file refused at start with
one line naming the file and the key. The exporter serves a registry of its own here (the agent
behind these options: tests/test_exporter.py); certificates
are made by the test with the `openssl` command, passwords hashed with the `bcrypt` package."""

from __future__ import annotations

import base64
import grp
import gzip
import http.client
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Gauge

from gemtrace import top
from gemtrace.agent import web_config
from gemtrace.agent.exporter import MIN_COLLECT_INTERVAL_SECONDS, Exporter, ListenError, listen_target, parse_mode
from gemtrace.agent.web_config import WebConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
SERIES = "gemtrace_test_secret_bytes"
PASSWORD = b"s3cret scrape"


def registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Gauge(SERIES, "A series only an allowed reader may see.", registry=r).set(42)
    return r


def make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl command is missing: apt-get install openssl", pytrace=False)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def write_config(directory: Path, text: str) -> Path:
    path = directory / "web.yml"
    path.write_text(text)
    return path


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    started: list[Exporter] = []

    def start(web_text: str | None = None, listen: str | None = None, mode: int | None = None,
              gid: int | None = None) -> Exporter:
        web = None if web_text is None else web_config.load(write_config(tmp_path, web_text))
        exporter = Exporter(registry(), listen or "127.0.0.1:0", web, mode, gid)
        exporter.start()
        started.append(exporter)
        return exporter

    yield start
    for exporter in started:
        exporter.stop()


def get(url: str, context: ssl.SSLContext | None = None, auth: tuple[str, bytes] | None = None,
        ) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth[0].encode() + b":" + auth[1]).decode())
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


# -- TLS --------------------------------------------------------------------------------------------

def test_tls_serves_metrics_to_a_client_that_trusts_the_certificate_and_nothing_in_plain_text(
        tmp_path: Path, serve) -> None:
    cert, key = make_cert(tmp_path, "localhost")
    exporter = serve(f"tls_server_config:\n  cert_file: {cert.name}\n  key_file: {key.name}\n")
    port = exporter.server.server_address[1]
    assert exporter.scheme == "https"
    trusting = ssl.create_default_context(cafile=str(cert))
    status, body, _ = get(f"https://127.0.0.1:{port}/metrics", trusting)
    assert status == 200 and f"{SERIES} 42.0" in body
    # A client that does not trust the certificate refuses it; a plain-text one gets no metrics.
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        get(f"https://127.0.0.1:{port}/metrics", ssl.create_default_context())
    with pytest.raises((http.client.HTTPException, OSError)):
        get(f"http://127.0.0.1:{port}/metrics")
    # The server is still serving after both failures.
    assert get(f"https://127.0.0.1:{port}/metrics", trusting)[0] == 200


def test_tls_with_client_certificates_refuses_a_client_without_one(tmp_path: Path, serve) -> None:
    cert, key = make_cert(tmp_path, "localhost")
    client_cert, client_key = make_cert(tmp_path, "prometheus")
    exporter = serve(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                     f"  client_ca_file: {client_cert}\n  client_auth_type: RequireAndVerifyClientCert\n")
    url = f"https://127.0.0.1:{exporter.server.server_address[1]}/metrics"
    with_cert = ssl.create_default_context(cafile=str(cert))
    with_cert.load_cert_chain(client_cert, client_key)
    status, body, _ = get(url, with_cert)
    assert status == 200 and SERIES in body
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        get(url, ssl.create_default_context(cafile=str(cert)))
    # A certificate the CA file does not vouch for is refused too.
    stranger_cert, stranger_key = make_cert(tmp_path, "stranger")
    stranger = ssl.create_default_context(cafile=str(cert))
    stranger.load_cert_chain(stranger_cert, stranger_key)
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        get(url, stranger)


# -- basic auth -------------------------------------------------------------------------------------

def basic_auth_yaml(**passwords: bytes) -> str:
    lines = ["basic_auth_users:"]
    for user, password in passwords.items():
        lines.append(f"  {user}: {bcrypt.hashpw(password, bcrypt.gensalt(rounds=4)).decode()}")
    return "\n".join(lines) + "\n"


def test_basic_auth_lets_the_right_password_in_and_answers_401_otherwise(serve) -> None:
    exporter = serve(basic_auth_yaml(prometheus=PASSWORD, grafana=b"other"))
    url = f"http://127.0.0.1:{exporter.server.server_address[1]}/metrics"
    status, body, _ = get(url, auth=("prometheus", PASSWORD))
    assert status == 200 and f"{SERIES} 42.0" in body
    # Twice: the second answer comes from the remembered check and must be the same.
    assert get(url, auth=("prometheus", PASSWORD))[0] == 200
    for auth in (("prometheus", b"wrong"), ("grafana", PASSWORD), ("nobody", PASSWORD), None):
        status, body, headers = get(url, auth=auth)
        assert status == 401, auth
        assert SERIES not in body
        assert headers["WWW-Authenticate"].startswith("Basic")


def test_basic_auth_refuses_headers_that_are_not_basic_credentials(serve) -> None:
    exporter = serve(basic_auth_yaml(prometheus=PASSWORD))
    port = exporter.server.server_address[1]
    for header in ("Bearer abc", "Basic !!!notbase64", "Basic " + base64.b64encode(b"no-colon").decode(), "Basic"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics", headers={"Authorization": header})
        response = conn.getresponse()
        assert response.status == 401, header
        assert SERIES not in response.read().decode()
        conn.close()


def test_tls_and_basic_auth_together(tmp_path: Path, serve) -> None:
    cert, key = make_cert(tmp_path, "localhost")
    exporter = serve(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                     + basic_auth_yaml(prometheus=PASSWORD))
    url = f"https://localhost:{exporter.server.server_address[1]}/metrics"
    trusting = ssl.create_default_context(cafile=str(cert))
    assert get(url, trusting, ("prometheus", PASSWORD))[0] == 200
    assert get(url, trusting, ("prometheus", b"wrong"))[0] == 401
    assert get(url, trusting)[0] == 401


# -- unix socket ------------------------------------------------------------------------------------

def get_unix(path: Path) -> tuple[int, str]:
    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(str(path))

    conn = UnixConnection("localhost")
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    try:
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_unix_socket_serves_metrics_with_the_mode_and_group_asked_for(tmp_path: Path, serve) -> None:
    path = tmp_path / "metrics.sock"
    group = grp.getgrnam("nogroup").gr_gid if os.geteuid() == 0 else os.getgid()
    exporter = serve(listen=f"unix:{path}", mode=0o640, gid=group)
    assert exporter.address == f"unix:{path}"
    st = path.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_gid == group
    status, body = get_unix(path)
    assert status == 200 and f"{SERIES} 42.0" in body
    # `gemtrace status` and `gemtrace top` read it there too (--listen unix:PATH).
    assert f"{SERIES} 42.0" in top.fetch(top.metrics_url(f"unix:{path}"))
    exporter.stop()
    assert not path.exists(), "the agent removes its socket when it stops"


def test_unix_socket_defaults_to_owner_and_group_only(tmp_path: Path, serve) -> None:
    path = tmp_path / "metrics.sock"
    serve(listen=f"unix:{path}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o660


# The distribution's Python: the venv's may lie in a checkout other users cannot reach (/root).
SYSTEM_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def test_a_user_the_socket_mode_leaves_out_cannot_connect(tmp_path: Path, serve) -> None:
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root")
    # pytest's own tmp directories are root's alone: a directory everyone may pass through, so that
    # the socket's own mode decides.
    directory = Path(tempfile.mkdtemp(prefix="gemtrace-sock-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        path = directory / "metrics.sock"
        serve(listen=f"unix:{path}", mode=0o660)
        connect = ("import socket,sys; s=socket.socket(socket.AF_UNIX); "
                   "s.connect(sys.argv[1]); print('connected')")
        as_nobody = subprocess.run([SYSTEM_PYTHON, "-c", connect, str(path)], capture_output=True, text=True,
                                   user=65534, group=65534, extra_groups=[], timeout=30)
        assert as_nobody.returncode != 0 and "PermissionError" in as_nobody.stderr, as_nobody
        path.chmod(0o666)
        as_nobody = subprocess.run([SYSTEM_PYTHON, "-c", connect, str(path)], capture_output=True, text=True,
                                   user=65534, group=65534, extra_groups=[], timeout=30)
        assert as_nobody.stdout.strip() == "connected", as_nobody.stderr
    finally:
        shutil.rmtree(directory)


def test_a_stale_socket_is_replaced_and_any_other_file_is_left_alone(tmp_path: Path, serve) -> None:
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # what an agent killed by SIGKILL leaves behind
    serve(listen=f"unix:{stale}")
    assert get_unix(stale)[0] == 200
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    with pytest.raises(ListenError, match="not a socket"):
        Exporter(registry(), f"unix:{other}")
    assert other.read_text() == "keep me"


def test_listen_options_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ListenError, match="unix: --listen only"):
        listen_target("127.0.0.1:9843", socket_mode=0o660)
    with pytest.raises(ListenError, match="absolute"):
        listen_target("unix:metrics.sock")
    for bad in ("0999", "rw", "1777", ""):
        with pytest.raises(ListenError, match="--listen-mode"):
            parse_mode(bad)
    assert parse_mode("0660") == 0o660 and parse_mode("600") == 0o600


# -- the web config file's mistakes -----------------------------------------------------------------

GOOD_HASH = bcrypt.hashpw(b"x", bcrypt.gensalt(rounds=4)).decode()


@pytest.mark.parametrize(("text", "said"), [
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  certfile: c\n", "tls_server_config.certfile: unknown key"),
    ("basic_auth_users: {}\ntls_config: {}\n", "tls_config: unknown key"),
    ("http_server_config:\n  http2: true\n", "http_server_config: gemtrace does not support"),
    ("tls_server_config:\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
     "tls_server_config.cipher_suites: gemtrace does"),
    ("basic_auth_users:\n  prometheus: secret\n", "basic_auth_users.prometheus: not a bcrypt hash"),
    (f"basic_auth_users:\n  prometheus: '{GOOD_HASH[:-1]}'\n", "basic_auth_users.prometheus: not a bcrypt hash"),
    (f"basic_auth_users:\n  'a:b': '{GOOD_HASH}'\n", "basic_auth_users.a:b: a user name"),
    ("basic_auth_users: [prometheus]\n", "basic_auth_users: expected a mapping"),
    ("tls_server_config:\n  cert_file: /nonexistent/tls.crt\n  key_file: /nonexistent/tls.key\n",
     "tls_server_config.cert_file: cannot read /nonexistent/tls.crt"),
    ("tls_server_config:\n  key_file: /dev/null\n", "tls_server_config.cert_file: missing"),
    ("tls_server_config:\n  cert_file: /dev/null\n  key_file: /dev/null\n", "tls_server_config.cert_file: /dev/null"),
    ("tls_server_config: [a, b]\n", "tls_server_config: expected a mapping"),
    ("basic_auth_users:\n  a: b\n  - c\n", "not valid YAML"),
    ("", "empty"),
    ("- just\n- a list\n", "the file: expected a mapping"),
    ("tls_server_config: {}\n", "tls_server_config.cert_file: missing"),
    ("tls_server_config:\nbasic_auth_users: {}\n", "both empty"),
])
def test_a_bad_web_config_is_one_line_naming_the_file_and_key(tmp_path: Path, text: str, said: str) -> None:
    path = write_config(tmp_path, text)
    with pytest.raises(WebConfigError) as caught:
        web_config.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}"), message
    assert said in message, message
    assert "\n" not in message


def test_tls_options_that_python_cannot_honour_or_that_contradict_are_refused(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "localhost")
    tls = "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
    for extra, said in [
        ("  client_auth_type: RequireAnyClientCert\n", "client_auth_type: 'RequireAnyClientCert' is not one"),
        ("  client_auth_type: RequireAndVerifyClientCert\n", "needs client_ca_file"),
        (f"  client_ca_file: {cert}\n", "client_ca_file: set, but client_auth_type"),
        ("  min_version: TLS14\n", "min_version: 'TLS14' is not a TLS version"),
    ]:
        path = write_config(tmp_path, tls.format(cert=cert, key=key) + extra)
        with pytest.raises(WebConfigError) as caught:
            web_config.load(path)
        assert said in str(caught.value), str(caught.value)
    # The certificate given as its own key: both files read, the pair does not load.
    path = write_config(tmp_path, tls.format(cert=cert, key=cert))
    with pytest.raises(WebConfigError, match=f"tls_server_config.cert_file: {cert} with key_file {cert}"):
        web_config.load(path)


def test_an_unreadable_web_config_is_named() -> None:
    with pytest.raises(WebConfigError, match="/nonexistent/web.yml: cannot read it: No such file"):
        web_config.load(Path("/nonexistent/web.yml"))


def test_the_agent_stops_at_once_on_a_bad_web_config_before_touching_a_gpu(tmp_path: Path) -> None:
    """No simulated GPU, no state dir: the web config is checked first, one line, exit 1."""
    path = write_config(tmp_path, "basic_auth_users:\n  prometheus: plaintext\n")
    out = subprocess.run([sys.executable, "-m", "gemtrace.cli", "agent", "--web-config", str(path),
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"gemtrace: {path}: basic_auth_users.prometheus: not a bcrypt hash; make one with "
        "`htpasswd -nBC 10 prometheus` (the part after the colon)"]
    out = subprocess.run([sys.executable, "-m", "gemtrace.cli", "agent", "--listen-mode", "0600",
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 1 and "unix: --listen only" in out.stderr
    assert not (tmp_path / "state").exists()



def test_back_to_back_scrapes_cost_one_collection_per_interval_and_none_is_older_than_its_request(
        serve) -> None:
    """A scrape loop costs the agent one collection per MIN_COLLECT_INTERVAL_SECONDS, not one per
    request (its Python runs under the GIL the schedulers need); each answer comes from a collection
    made after its request arrived."""
    exporter = serve()
    url = f"http://{exporter.address}/metrics"
    served: list[str] = []

    def scrape_loop() -> None:
        for _ in range(6):
            served.append(get(url)[1])

    started = time.monotonic()
    loops = [threading.Thread(target=scrape_loop) for _ in range(4)]
    for loop in loops:
        loop.start()
    for loop in loops:
        loop.join()
    elapsed = time.monotonic() - started
    assert len(served) == 24 and all(f"{SERIES} 42.0" in body for body in served)
    # 4 threads asking back to back: each request waits for the collection after the one that served
    # the previous, so 6 rounds take about 6 intervals and need about 6 collections, not 24. The bound
    # is one collection an interval of the time it took: on a busy host the threads drift apart and
    # the rounds take longer, never more collections than intervals.
    assert exporter.metrics.collections <= 1 + elapsed / MIN_COLLECT_INTERVAL_SECONDS + 1
    assert exporter.metrics.collections < len(served) and elapsed >= 4 * MIN_COLLECT_INTERVAL_SECONDS
    status, body, _ = get(url + f"?name[]={SERIES}")
    assert status == 200 and f"{SERIES} 42.0" in body
    status, body, _ = get(url + "?name[]=no_such_metric")
    assert status == 200 and SERIES not in body


def test_a_scrape_negotiates_openmetrics_and_gzip_as_prometheus_asks(serve) -> None:
    exporter = serve()
    request = urllib.request.Request(f"http://{exporter.address}/metrics", headers={
        "Accept": "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5",
        "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        body = gzip.decompress(r.read()).decode()
    assert f"{SERIES} 42.0" in body and body.endswith("# EOF\n")
    with urllib.request.urlopen(f"http://{exporter.address}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain") and "Content-Encoding" not in r.headers
        assert f"{SERIES} 42.0" in r.read().decode()
