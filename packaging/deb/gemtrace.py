#!/usr/bin/python3
"""/usr/bin/gemtrace as the Debian package installs it.

gemtrace's code and the pynvml it carries live in a private directory, so that they neither shadow
nor are shadowed by anything in the system's dist-packages; the other dependencies come from the
distribution (python3-bpfcc, python3-psutil, python3-prometheus-client, python3-structlog).
"""

import sys

sys.path.insert(0, "/usr/lib/gemtrace/python")

from gemtrace.cli import main  # noqa: E402  (the path above must come first)

sys.exit(main())
