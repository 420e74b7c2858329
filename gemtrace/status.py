"""`gemtrace status`: one frame of what `gemtrace top` shows, from the agent's /metrics.

Per GPU and group: the share used against MinUtil/MaxUtil, memory against the limit, and the
processes. Reuses top's parsing and rendering (one home for the view); --json prints the frame.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import TextIO

from gemtrace import top


def main(listen: str, as_json: bool, out: TextIO = sys.stdout) -> int:
    url = top.metrics_url(listen)
    frame = top.snapshot(url, None)
    if frame.error:
        print(f"gemtrace status: {frame.error} (systemctl status gemtrace)", file=sys.stderr)
        return 1
    if as_json:
        json.dump(dataclasses.asdict(frame), out, indent=2, default=str)
        out.write("\n")
    else:
        out.write("\n".join(top.render(frame, url)) + "\n")
    return 0
