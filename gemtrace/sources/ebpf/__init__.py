"""The eBPF source: uprobes on every libcuda file on the host, and what they count, as figures.

Listed bottom-up, each file importing only those listed before it (and the sources' interface):
    libcuda.py   which libcuda files the processes on the host map (other mount namespaces included),
                 parsed from /proc/PID/maps; pure parsers apart from the reader
    probes.py    bcc: compiles bpf/gemtrace_cuda.bpf.c, attaches it to each libcuda file, detaches from
                 a file whose last process exited, reads the maps and the ring buffer
    source.py    EbpfSource: the probes' lifetime, the libcuda rescans, the ring-buffer thread, and
                 the maps read as per-process figures
Nothing here merges, decides or kills: gemtrace.agent.accounting merges the figures with the other sources'.
"""

from gemtrace.sources.ebpf.probes import BpfUnavailable
from gemtrace.sources.ebpf.source import EbpfSource, boot_ticks, memory_figures, usage_figures

__all__ = ["BpfUnavailable", "EbpfSource", "boot_ticks", "memory_figures", "usage_figures"]
