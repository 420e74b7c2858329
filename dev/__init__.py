"""Development tools run from a checkout, never shipped: packaging/deb/build.sh ships gemtrace/ only.

    dashboards.py    the Grafana dashboards, generated from the metric catalogue
                     (`python -m dev.dashboards --write` rewrites grafana/provisioning/dashboards/gemtrace/)
    demo.py          `make demo`: the agent and three groups on the simulated GPU (simgpu/)

Run them from the top of the checkout (`python -m dev.NAME`), where `dev` is importable.
"""
