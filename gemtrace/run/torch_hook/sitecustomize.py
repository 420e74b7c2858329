"""gemtrace's start-up hook for Python programs under `gemtrace run` with the PyTorch cache release
on (gemtrace/run/cache_release.py puts this directory first on PYTHONPATH).

It costs one look at each module name imported until `torch` is: only then does it load
gemtrace_cache_release.py, which watches the group's held word. Then it runs the sitecustomize this
one shadows (the user's, or the distribution's), as Python would have without gemtrace.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _AwaitTorch:
    """A meta-path finder that finds nothing: it only hears `import torch` and starts the watcher."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            try:
                sys.meta_path.remove(self)
                spec = importlib.util.spec_from_file_location(
                    "gemtrace_cache_release", os.path.join(_HERE, "gemtrace_cache_release.py"))
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.start()
            except Exception as e:  # never into the user's program
                sys.stderr.write(f"gemtrace: the PyTorch cache release is off in this process: {e}\n")
        return None


def _run_shadowed():
    """The sitecustomize further along sys.path, run under its own name, so `import sitecustomize`
    in the program finds it."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return  # this module stays sitecustomize: the import under way ends by looking it up
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # its errors reach site.py, which reports them as for any sitecustomize


if os.environ.get("GEMTRACE_RELEASE_CACHE") == "1" and "torch" not in sys.modules:
    sys.meta_path.insert(0, _AwaitTorch())
_run_shadowed()
