"""A valid admission review's latency while other clients hold the webhook's connections (issue 25):
`gemtrace kube-webhook` on 127.0.0.1 with a self-signed certificate, and `--samples` reviews, each on
a connection of its own (TLS handshake included), 0.1 s apart, alone and while `--connections`
clients of tests/slow_clients.py hold theirs idle (no handshake), slow (a head trickled a byte a
second) or partial (a body shorter than its Content-Length). A review that takes over the API
server's timeout (`--timeout`, 5 s) counts as unanswered: with `failurePolicy: Fail` its pod is refused.

Each tree runs every case, side by side (`--tree NAME=DIR` adds the webhook from DIR/gemtrace, e.g. a
`git archive` of an older commit).

    .venv/bin/python -m bench.bench_webhook_load [--connections 100] [--samples 30] [--tree NAME=DIR]
        [--no-record]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit import free_port

from bench.bench_scrape_load import flood, percentile
from bench.recording import REPO, add_record_flag, add_tree_flag, record, trees

RESULTS = REPO / "bench" / "results" / "webhook_load.md"
MODES = ("idle", "slow", "partial")
REVIEW = json.dumps({
    "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
    "request": {"uid": "bench", "namespace": "ns", "object": {
        "metadata": {"name": "p", "labels": {"gemtrace.io/group": "train"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}}).encode()


def certificate(directory: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        sys.exit("the openssl command is missing: apt-get install openssl")
    cert, key = directory / "webhook.crt", directory / "webhook.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def review(port: int, trust: ssl.SSLContext, timeout: float) -> float:
    """Seconds for one review on a new connection; inf past `timeout` or on any failure."""
    began = time.monotonic()
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=trust, timeout=timeout)
    try:
        connection.request("POST", "/mutate", body=REVIEW, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        allowed = json.loads(response.read())["response"]["allowed"]
    except (OSError, ValueError, KeyError, http.client.HTTPException):
        return float("inf")
    finally:
        connection.close()
    elapsed = time.monotonic() - began
    return elapsed if allowed and elapsed <= timeout else float("inf")


def measure(tree: Path | None, connections: int, samples: int, timeout: float) -> list[tuple[str, list[float]]]:
    with tempfile.TemporaryDirectory(prefix="gemtrace-webhook-") as tmp:
        cert, key = certificate(Path(tmp))
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [*([str(tree)] if tree is not None else []), str(REPO), os.environ.get("PYTHONPATH", "")]))
        log = (Path(tmp) / "webhook.log").open("wb")
        webhook = subprocess.Popen([sys.executable, "-m", "gemtrace.cli", "kube-webhook", "--listen",
                                    f"127.0.0.1:{port}", "--cert", str(cert), "--key", str(key)],
                                   env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=log)
        trust = ssl.create_default_context(cafile=str(cert))
        try:
            deadline = time.monotonic() + 30
            while review(port, trust, 2) == float("inf"):
                if webhook.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the webhook did not start: {(Path(tmp) / 'webhook.log').read_text()[-2000:]}")
                time.sleep(0.1)
            cases = []
            for mode in ("alone", *MODES):
                attacker = None if mode == "alone" else flood(port, mode, connections, tls=True)
                try:
                    times = []
                    for _ in range(samples):
                        times.append(review(port, trust, timeout))
                        time.sleep(0.1)
                finally:
                    if attacker is not None:
                        attacker.kill()
                        attacker.wait()
                cases.append((mode if mode == "alone" else f"{connections} {mode}", times))
                print(row("", *cases[-1]), flush=True)
                time.sleep(1)  # the server closes what the flood left before the next case
        finally:
            webhook.send_signal(signal.SIGTERM)
            try:
                webhook.wait(timeout=10)
            except subprocess.TimeoutExpired:
                webhook.kill()
                webhook.wait()
            log.close()
    return cases


def row(code: str, case: str, times: list[float]) -> str:
    answered = [t for t in times if t != float("inf")]

    def ms(t: float) -> str:
        return "timeout" if t == float("inf") else f"{t * 1e3:.0f}"

    return (f"| {code} | {case} | {ms(statistics.median(times))} | {ms(percentile(times, 0.99))} | "
            f"{ms(max(times))} | {len(answered)}/{len(times)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=100, help="hostile connections held in each case")
    ap.add_argument("--samples", type=int, default=30, help="reviews timed per case")
    ap.add_argument("--timeout", type=float, default=5.0, help="the API server's timeout for a review, seconds")
    add_tree_flag(ap, "the webhook")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    side_by_side = trees(args.tree)
    rows = []
    for code, tree in side_by_side:
        rows += [row(code, case, times) for case, times in measure(tree, args.connections, args.samples, args.timeout)]
    text = "\n".join([
        f"{args.samples} valid reviews per case, each on a new TLS connection, 0.1 s apart; a review past "
        f"{args.timeout:g} s counts as a timeout (the API server's)",
        "",
        "| webhook | other connections | p50 ms | p99 ms | max ms | answered in time |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows])
    print(text)
    if not args.no_record:
        record(RESULTS, "A valid review beside idle and slow connections (bench/bench_webhook_load.py)", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
