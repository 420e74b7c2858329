"""An agent stopped for a while (SIGSTOP: a debugger, a frozen VM, a starved CPU) and then continued:
its gates ran unheld meanwhile (its heartbeat went stale), and its first look charged the whole stall
to the group that held the GPU. A group capped at 0.9 was then held for about as long as the stall,
its MaxUtil bucket paying the stall back: capped at 0.3, held 23 s after a stall of 10 s (issue 25:
"groups resume within 1 s of a stall")."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from agent_host import Host, stop, wait_until

pytestmark = pytest.mark.e2e

STALL_S = 10


def test_a_capped_group_runs_again_within_a_second_of_the_agent_continuing_after_a_stall(host: Host) -> None:
    host.config.write_text("[capped]\nMaxUtil = 0.3\n")
    agent = host.start_agent()
    client = host.run("capped", "launch-loop", "--kernel-ns", "2000000", "--seconds", str(STALL_S + 20),
                      "--progress")
    launches: list[tuple[float, int]] = []  # (CLOCK_MONOTONIC when read, launches so far)

    def follow() -> None:
        assert client.stdout is not None
        for line in client.stdout:
            if line.startswith(b'{"progress"'):
                launches.append((time.monotonic(), json.loads(line)["launches"]))

    threading.Thread(target=follow, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while len(launches) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(launches) >= 3, "the capped client made no progress before the stall"
        # Stopped while the group holds the GPU: the stall is charged to it.
        region = host.region()
        group = region.group_index("capped")
        assert group is not None
        wait_until("the capped group released", lambda: not region.is_held(0, group), timeout=10, step=0.001)
        os.kill(agent.proc.pid, signal.SIGSTOP)
        time.sleep(STALL_S)
        os.kill(agent.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        time.sleep(4)
        # Progress lines come once a second: between the first one a second after the agent continued
        # and the last, the group ran (held for the whole stall's charge, it did not for 9 s).
        after = [n for t, n in launches if t >= resumed + 1.0]
        assert len(after) >= 2 and after[-1] > after[0], launches[-6:]
    finally:
        client.kill()
        client.wait()
        stop(agent)
