"""The package can be drawn bottom-up: no import circle anywhere in gemtrace/ (an import inside a function
or under TYPE_CHECKING counts: it is a circle broken at run time, not gone), the region's subpackage
imports only downwards in the order its __init__ lists, `gemtrace run`'s side (gemtrace/run/) and the
agent's (gemtrace/agent/ and the sources it opens) stay apart, the root holds only what they share and the
command line, no two files of the gate (hook/) lean on each other's functions, and nothing shipped
imports what only tests/ holds (issue 28)."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

import pytest

import gemtrace.agent
import gemtrace.region
import gemtrace.run
import gemtrace.sources.ebpf

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gemtrace"
HOOK = ROOT / "hook"
GENERATED = re.compile(r"_pb2(_grpc)?\.py$")  # protoc's output (make proto), not ours to shape


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package's name names its __init__.py)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        if GENERATED.search(path.name):
            continue
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that module `name` imports, wherever the import statement stands. `from P
    import x` is module P.x where that is a module, else P itself (x is a name P defines)."""
    modules = set(known)
    is_package = path.name == "__init__.py"
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    deps = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name and target != "gemtrace":  # the top __init__ holds only the version
            deps.add(target)
    return deps


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(package)
    return {name: imported(name, path, files) for name, path in files.items()}


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every set of nodes that reach each other (Tarjan's strongly connected components of two or more),
    each as one circle through it, for the failure message."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(one_circle(graph, set(members)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_circle(graph: Mapping[str, Iterable[str]], members: set[str]) -> list[str]:
    """A path from the first member back to itself within `members` (breadth-first: a shortest one)."""
    start = min(members)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for dep in sorted(graph.get(node, ())):
                if dep == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if dep in members and dep not in came_from:
                    came_from[dep] = node
                    following.append(dep)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(members)}")


def test_the_circle_finder_finds_a_circle_through_a_local_import(tmp_path: Path) -> None:
    """The check itself: a circle closed by an import inside a function, and one under TYPE_CHECKING,
    are found; a package importing its own module is not a circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.c import y\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "sub" / "d.py").write_text("from .c import y\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert sorted(circles(graph)) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.sub.c", "pkg.sub.d", "pkg.sub.c"]]


def test_no_import_circle_in_gemtrace() -> None:
    graph = import_graph()
    assert len(graph) > 60  # every module was read
    found = circles(graph)
    assert not found, "import circles (move the shared piece into a module below both): " + "; ".join(
        " -> ".join(c) for c in found)


def test_no_shipped_module_imports_a_test_helper() -> None:
    """The .deb copies gemtrace/ whole (packaging/deb/build.sh) and tests/ not at all: a shipped module
    importing the fakes or another helper of tests/ would fail on every host it is installed on."""
    helpers = {path.stem for path in (ROOT / "tests").glob("*.py")}
    assert {"fake_sources", "testkit"} <= helpers
    offenders = []
    for path in module_files().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] in helpers]
    assert not offenders, "move what they need into gemtrace/, or the import into tests/: " + "; ".join(offenders)


def listed_order(package: ModuleType) -> list[str]:
    """A subpackage's modules in the order its __init__.py lists them, bottom first."""
    doc = package.__doc__ or ""
    return [f"{package.__name__}.{m}" for m in re.findall(r"^\s{4}(\w+)\.py\s", doc, re.MULTILINE)]


def region_order() -> list[str]:
    return listed_order(gemtrace.region)


def test_the_region_package_imports_only_downwards() -> None:
    """Each module of gemtrace/region/ imports only those listed before it, and from the rest of
    gemtrace only the header's constants and the log setup: the gates' side stays apart from the agent."""
    order = region_order()
    graph = import_graph()
    assert sorted(order) == sorted(n for n in graph if n.startswith("gemtrace.region."))  # the list is whole
    for position, name in enumerate(order):
        inside = {d for d in graph[name] if d.startswith("gemtrace.region")}
        assert inside <= set(order[:position]), f"{name} imports {sorted(inside - set(order[:position]))}"
        outside = graph[name] - inside
        assert outside <= {"gemtrace.contract", "gemtrace.eventlog"}, f"{name} imports {sorted(outside)}"
    assert graph["gemtrace.region"] <= set(order) | {"gemtrace.contract"}


def test_the_ebpf_source_imports_only_downwards() -> None:
    """gemtrace/sources/ebpf/: libcuda discovery, then bcc's probes, then the source over both, each
    file importing only those listed before it; the package's __init__ only re-exports them."""
    order = listed_order(gemtrace.sources.ebpf)
    graph = import_graph()
    assert sorted(order) == sorted(n for n in graph if n.startswith("gemtrace.sources.ebpf."))  # the list is whole
    for position, name in enumerate(order):
        inside = {d for d in graph[name] if d.startswith("gemtrace.sources.ebpf")}
        assert inside <= set(order[:position]), f"{name} imports {sorted(inside - set(order[:position]))}"
    assert graph["gemtrace.sources.ebpf"] <= set(order)


# What `gemtrace run` may take from the rest of gemtrace, directly or through each other: what the agent and
# the user's side both need (the region and the resource file they agree on, the header's constants, the GPUs'
# listing, MPS's client variables beside the daemons the agent starts), never the agent's own machinery.
RUN_SHARED = {"gemtrace.config", "gemtrace.contract", "gemtrace.defaults", "gemtrace.eventlog", "gemtrace.gpus",
              "gemtrace.groups_of", "gemtrace.mps", "gemtrace.region"}


def reached(graph: Mapping[str, Iterable[str]], starts: Iterable[str]) -> set[str]:
    """Every module that `starts` import, directly or through others."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_run_package_imports_only_downwards() -> None:
    """gemtrace/run/: each module imports only those listed before it in run/__init__.py; the torch hook,
    run in the user's interpreter where gemtrace may not be importable, imports none of gemtrace."""
    order = listed_order(gemtrace.run)
    graph = import_graph()
    hook = {n for n in graph if n.startswith("gemtrace.run.torch_hook.")}
    assert {"gemtrace.run.torch_hook.sitecustomize", "gemtrace.run.torch_hook.gemtrace_cache_release"} <= hook
    assert sorted(order) == sorted(n for n in graph if n.startswith("gemtrace.run.") and n not in hook)
    for position, name in enumerate(order):
        inside = {d for d in graph[name] if d.startswith("gemtrace.run")}
        assert inside <= set(order[:position]), f"{name} imports {sorted(inside - set(order[:position]))}"
    for name in hook:
        assert not graph[name], f"{name} imports {sorted(graph[name])}: the hook runs with the stdlib only"


# The agent's side: the daemon and the sources it opens. Nothing outside it imports it but the command line,
# which starts the agent.
AGENT_SIDE = ("gemtrace.agent", "gemtrace.sources")
COMMAND_LINE = "gemtrace.cli"


def on_side(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_run_side_and_the_agent_side_stay_apart() -> None:
    """`gemtrace run` reaches only what both sides share, and the agent never reaches gemtrace/run/: the
    user's command cannot pull in the agent's machinery, nor the agent the user's."""
    graph = import_graph()
    run = {n for n in graph if n.startswith("gemtrace.run")}
    outside = reached(graph, run) - run
    allowed = {n for n in outside if on_side(n, RUN_SHARED)}
    assert "gemtrace.mps" in outside  # the closure was followed out of the package
    assert outside == allowed, f"gemtrace/run/ reaches the agent's {sorted(outside - allowed)}"
    agent_side = {n for n in graph if on_side(n, AGENT_SIDE)}
    agent = reached(graph, agent_side)
    assert {"gemtrace.agent.scheduler", "gemtrace.sources.ebpf.probes", "gemtrace.region"} <= agent
    assert not agent & run, f"the agent reaches {sorted(agent & run)}"


def test_only_the_command_line_imports_the_agent_side() -> None:
    """The root's shared modules, the region, `gemtrace run`, top and Kubernetes' side never import the agent's
    modules: what they share with it sits in the root, below both (move a piece the agent and another side
    both need there)."""
    graph = import_graph()
    agent_side = {n for n in graph if on_side(n, AGENT_SIDE)}
    assert graph[COMMAND_LINE] & agent_side  # the side was recognised
    offenders = [f"{name} imports {sorted(graph[name] & agent_side)}" for name in sorted(graph)
                 if name not in agent_side and name != COMMAND_LINE and graph[name] & agent_side]
    assert not offenders, "; ".join(offenders)


def test_the_agent_map_lists_every_part() -> None:
    """gemtrace/agent/__init__.py's map names each module and subpackage of gemtrace/agent/, and only those:
    a newcomer draws the agent from it."""
    doc = gemtrace.agent.__doc__ or ""
    listed = set(re.findall(r"^\s{4}(\w+)(?:\.py|/)\s", doc, re.MULTILINE))
    folder = Path(gemtrace.agent.__file__).parent
    present = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    present |= {p.parent.name for p in folder.glob("*/__init__.py")}
    assert {"agent", "policy", "collectors"} <= present
    assert listed == present, f"unlisted: {sorted(present - listed)}, listed but gone: {sorted(listed - present)}"


def gate_graph(build: Path) -> dict[str, set[str]]:
    """hook/X.c -> the hook files whose gt_ functions or data it uses, from each object's symbol table.
    Only the gate's own gt_ names count: intercept.c hands out the CUDA wrappers' addresses (the gated
    list) and they call the driver back through it, which is what interposing is, not two files
    leaning on each other's logic."""
    defined: dict[str, set[str]] = {}
    used: dict[str, set[str]] = {}
    for source in sorted(HOOK.glob("*.c")):
        if source.name == "contract_py.c":  # a build-time program, not part of the gate
            continue
        obj = build / (source.stem + ".o")
        subprocess.run(["cc", "-std=c11", "-fPIC", "-fvisibility=hidden", "-I", str(HOOK), "-c", str(source),
                        "-o", str(obj)], check=True)
        symbols = [line.split() for line in subprocess.run(["nm", str(obj)], capture_output=True, text=True,
                                                            check=True).stdout.splitlines()]
        defined[source.name] = {s[2] for s in symbols if len(s) == 3 and s[1] in "TDBRC" and s[2].startswith("gt_")}
        used[source.name] = {s[1] for s in symbols if len(s) == 2 and s[0] == "U" and s[1].startswith("gt_")}
    return {name: {other for other in defined if other != name and used[name] & defined[other]} for name in defined}


def test_no_two_gate_files_lean_on_each_other(tmp_path: Path) -> None:
    graph = gate_graph(tmp_path)
    assert "futex.c" in graph["attach.c"] and "futex.c" in graph["launch.c"]  # the symbols were read
    found = circles(graph)
    assert not found, "hook/ files that use each other's gt_ functions: " + "; ".join(" -> ".join(c) for c in found)
