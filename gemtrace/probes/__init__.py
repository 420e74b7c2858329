"""Probes: where the agent learns what each process does with libcuda, without its cooperation.

  libcuda.py     which libcuda files the processes on the host map (other mount namespaces included),
                 parsed from /proc/PID/maps; pure parsers apart from the reader.
  bpf_loader.py  bcc: compiles bpf/gemtrace_cuda.bpf.c, attaches it to each libcuda file, detaches
                 from a file whose last process exited, reads the maps and the ring buffer.
Nothing here decides anything: gemtrace.accounting turns what the probes read into a Snapshot.
"""
