"""Fixtures every test module may use without importing them (pytest finds them here).

simgpu, simgpu_factory: a private simulated GPU (see simgpu_env.py for the API).
"""

from simgpu_env import simgpu, simgpu_factory  # noqa: F401
