"""What the eBPF loader tells an operator when bcc cannot run: the missing path and the command
for the distribution at hand (os-release(5) text as fixtures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemtrace.sources.ebpf.probes import distribution, missing_headers_help

pytestmark = pytest.mark.unit

DEBIAN = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\nVERSION_ID="12"\nID=debian\n'
UBUNTU = 'NAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\nID_LIKE=debian\n'
MINT = 'NAME="Linux Mint"\nID=linuxmint\nID_LIKE="ubuntu debian"\n'
FEDORA = 'NAME="Fedora Linux"\nID=fedora\n'


@pytest.mark.parametrize(("text", "expected"), [(DEBIAN, "debian"), (UBUNTU, "ubuntu"), (MINT, "ubuntu"),
                                                (FEDORA, ""), ("", "")])
def test_distribution_from_os_release(text: str, expected: str) -> None:
    assert distribution(text) == expected


def test_debian_is_told_its_packages_and_what_the_agent_does_meanwhile() -> None:
    headers = Path("/lib/modules/6.1.0-26-amd64/build")
    msg = missing_headers_help(headers, "6.1.0-26-amd64", "x86_64", DEBIAN)
    assert f"{headers} is missing" in msg
    assert "`apt-get install linux-headers-6.1.0-26-amd64` as root" in msg
    assert "`apt-get install linux-headers-amd64` and reboot" in msg
    assert "generic" not in msg and ".ci" not in msg
    assert "the agent accounts what the gates and NVML report" in msg


def test_ubuntu_is_told_its_packages() -> None:
    msg = missing_headers_help(Path("/lib/modules/6.8.0-45-generic/build"), "6.8.0-45-generic", "x86_64", UBUNTU)
    assert "`apt-get install linux-headers-6.8.0-45-generic` as root" in msg
    assert "`apt-get install linux-headers-generic` and reboot" in msg
    assert "amd64" not in msg


def test_an_unknown_distribution_is_told_both() -> None:
    msg = missing_headers_help(Path("/lib/modules/6.9.1/build"), "6.9.1", "x86_64", FEDORA)
    assert "Debian and Ubuntu: `apt-get install linux-headers-6.9.1`" in msg
    assert "kernel-devel" in msg
