"""hook/cuda_driver_api.h against NVIDIA's cuda.h, so that the two cannot drift.

The project declares the part of the CUDA driver API it uses in that one header, so that the gate and
the simulated GPU build without a CUDA toolkit. The real cuda.h comes from the wheel pinned in
pyproject.toml's dev extra (nvidia-cuda-runtime ships nvidia/cu13/include/cuda.h).

How: every declaration of our header is read as the compiler sees it (after the preprocessor); one it
cannot read fails the test rather than going unchecked. From them comes one C program that prints, for
each typedef its size, alignment and whether it is the type we spell; for each struct member its
offset, size and whether its type is the one we spell; for each enumerator and macro its value. The
program is built once on our header and once on cuda.h, where a static assertion per function also
requires cuda.h's prototype to be compatible with ours; the two printouts must be equal.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "hook" / "cuda_driver_api.h"
WHEEL = "nvidia-cuda-runtime"
WHEEL_INCLUDE = "nvidia/cu13/include"
CFLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror"]


@dataclass
class Declarations:
    """What our header declares, as read from its preprocessed text."""

    typedefs: dict[str, str] = field(default_factory=dict)  # name -> the type spelled
    complete_structs: set[str] = field(default_factory=set)  # tags defined with a body
    enums: dict[str, list[str]] = field(default_factory=dict)  # typedef name -> enumerators
    members: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)  # struct -> (path, type)
    functions: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (return type, parameters)
    macros: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)


def real_include() -> Path:
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{WHEEL} is not installed: run `make venv` (pyproject.toml's dev extra pins the wheel "
                    f"whose cuda.h {HEADER.name} is checked against)")
    include = Path(str(dist.locate_file(WHEEL_INCLUDE)))
    if not (include / "cuda.h").is_file():
        pytest.fail(f"{WHEEL} {dist.version} has no {WHEEL_INCLUDE}/cuda.h: pin a version that ships it")
    return include


def _statements(text: str) -> list[str]:
    """Split at the semicolons outside braces; whitespace folded."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            out.append(" ".join(text[start:i].split()))
            start = i + 1
    if text[start:].strip():
        out.append(" ".join(text[start:].split()))
    return [s for s in out if s]


def _members(body: str, prefix: str = "") -> list[tuple[str, str | None]]:
    """(member path, type spelled) per member; a nested anonymous struct gives its own members too."""
    members: list[tuple[str, str | None]] = []
    for stmt in _statements(body):
        nested = re.fullmatch(r"struct \{(.*)\} (\w+)", stmt)
        if nested:
            members.append((prefix + nested.group(2), None))
            members += _members(nested.group(1), f"{prefix}{nested.group(2)}.")
            continue
        plain = re.fullmatch(r"([\w\s*]+?)\s*\b(\w+)\s*((?:\[\w+\])*)", stmt)
        if not plain:
            raise ValueError(stmt)
        members.append((prefix + plain.group(2), f"{plain.group(1)}{plain.group(3)}"))
    return members


def read_header(header: Path) -> Declarations:
    decls = Declarations()
    preprocessed = subprocess.run(["cc", "-E", *CFLAGS, str(header)], check=True, capture_output=True,
                                  text=True).stdout
    ours, current = [], None
    for line in preprocessed.splitlines():
        marker = re.match(r'# \d+ "(.*)"', line)
        if marker:
            current = Path(marker.group(1))
        elif current is not None and current.resolve() == header.resolve():
            ours.append(line)
    for stmt in _statements("\n".join(ours)):
        enum = re.fullmatch(r"typedef enum (\w+) \{(.*)\} (\w+)", stmt)
        struct = re.fullmatch(r"typedef struct (\w+) \{(.*)\} (\w+)", stmt)
        alias = re.fullmatch(r"typedef ([\w\s*]+?)\s*\b(\w+)", stmt)
        function = re.fullmatch(r"([\w\s*]+?)\s*\b(\w+)\s*\((.*)\)", stmt)
        if enum:
            tag, body, name = enum.groups()
            decls.typedefs[name] = f"enum {tag}"
            decls.enums[name] = [item.split("=")[0].strip() for item in body.split(",") if item.strip()]
        elif struct:
            tag, body, name = struct.groups()
            decls.typedefs[name] = f"struct {tag}"
            decls.complete_structs.add(tag)
            try:
                decls.members[name] = _members(body)
            except ValueError as e:
                decls.unreadable.append(f"{stmt} (member {e})")
        elif alias:
            decls.typedefs[alias.group(2)] = alias.group(1)
        elif function:
            ret, name, params = function.groups()
            decls.functions[name] = (ret, params)
        else:
            decls.unreadable.append(stmt)

    def defined(source: str) -> dict[str, str]:
        out = subprocess.run(["cc", "-dM", "-E", *CFLAGS, "-"], input=source, check=True, capture_output=True,
                             text=True).stdout
        return dict(re.findall(r"^#define (\S+) ?(.*)$", out, re.M))

    system = "".join(f"#include <{h}>\n" for h in re.findall(r"^#include <(.+)>", header.read_text(), re.M))
    before = defined(system)
    for name, value in defined(f'#include "{header}"\n').items():
        if name in before or not value:  # the include guard has no value
            continue
        if "(" in name:
            decls.unreadable.append(f"#define {name} {value} (a function-like macro)")
        else:
            decls.macros.append(name)
    return decls


def _is_incomplete(decls: Declarations, spelled: str) -> bool:
    tag = re.fullmatch(r"struct (\w+)", spelled)
    return tag is not None and tag.group(1) not in decls.complete_structs


def check_program(decls: Declarations, include: str) -> str:
    lines = [include, "#include <stddef.h>", "#include <stdint.h>", "#include <stdio.h>", ""]
    for name, (ret, params) in decls.functions.items():
        lines.append(f"_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), {ret} (*)({params})), "
                     f'"{name}: the prototype differs from cuda.h");')
    lines += ["#define SHOW(key, value) printf(\"%s %lld\\n\", key, (long long)(value))", "int main(void)", "{"]
    for name, spelled in decls.typedefs.items():
        lines.append(f'SHOW("{name} is {spelled}", __builtin_types_compatible_p({name}, {spelled}));')
        if _is_incomplete(decls, spelled):
            continue
        lines.append(f'SHOW("sizeof {name}", sizeof({name}));')
        lines.append(f'SHOW("_Alignof {name}", _Alignof({name}));')
    for name, enumerators in decls.enums.items():
        lines.append(f'SHOW("{name} -1", (long long)({name})-1);')  # signed or not
        lines += [f'SHOW("{e}", {e});' for e in enumerators]
    for name, members in decls.members.items():
        for path, member_type in members:
            lines.append(f'SHOW("offsetof {name}.{path}", offsetof({name}, {path}));')
            lines.append(f'SHOW("sizeof {name}.{path}", sizeof((({name} *)0)->{path}));')
            if member_type is not None:  # None: an anonymous struct, whose members follow
                lines.append(f'SHOW("{name}.{path} is {member_type}", '
                             f"__builtin_types_compatible_p(__typeof__((({name} *)0)->{path}), {member_type}));")
    lines += [f'SHOW("{m}", (uintptr_t)({m}));' for m in decls.macros]
    lines += ["return 0;", "}", ""]
    return "\n".join(lines)


def _run(source: Path, binary: Path, *flags: str) -> dict[str, int] | list[str]:
    """The program's printout, or the compiler's errors."""
    built = subprocess.run(["cc", *CFLAGS, *flags, "-o", str(binary), str(source)], capture_output=True, text=True)
    if built.returncode != 0:
        return [line for line in built.stderr.splitlines() if "error" in line] or [built.stderr]
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return {key: int(value) for key, value in (line.rsplit(" ", 1) for line in out.splitlines())}


def differences(header: Path, tmp_path: Path) -> list[str]:
    """Where `header` is not cuda.h: an empty list when it mirrors it."""
    decls = read_header(header)
    if decls.unreadable:
        return [f"cannot check: {stmt}" for stmt in decls.unreadable]
    ours_c, real_c = tmp_path / "ours.c", tmp_path / "real.c"
    ours_c.write_text(check_program(decls, f'#include "{header}"'))
    real_c.write_text(check_program(decls, "#define __CUDA_API_VERSION_INTERNAL 1\n#include <cuda.h>"))
    ours = _run(ours_c, tmp_path / "ours")
    if isinstance(ours, list):
        return [f"our header: {line}" for line in ours]
    real = _run(real_c, tmp_path / "real", f"-I{real_include()}")
    if isinstance(real, list):
        return [f"cuda.h: {line}" for line in real]
    return [f"{key}: ours {ours[key]}, cuda.h {real.get(key)}" for key in ours if ours[key] != real.get(key)]


def test_the_header_mirrors_cuda_h(tmp_path: Path) -> None:
    decls = read_header(HEADER)
    # The check sees the header: every part of it, the gated symbols among the functions.
    assert len(decls.functions) > 100 and "cuMemAlloc_v2" in decls.functions
    assert "CUmemAllocationProp" in decls.members and "CU_STREAM_LEGACY" in decls.macros
    assert "CUDA_VERSION" in decls.macros  # so it says which cuda.h it mirrors, and the wheel must be that one
    assert differences(HEADER, tmp_path) == []


def _mutated(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    text = HEADER.read_text()
    for old, new in edits:
        assert old in text, f"{HEADER.name} no longer has {old!r}: pick another line to break"
        text = text.replace(old, new, 1)
    path = tmp_path / HEADER.name
    path.write_text(text)
    return path


def test_a_wrong_prototype_fails(tmp_path: Path) -> None:
    wrong = _mutated(tmp_path, ("cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)",
                                "cuMemAlloc_v2(CUdeviceptr *dptr, unsigned int bytesize)"))
    found = differences(wrong, tmp_path)
    assert any("cuMemAlloc_v2: the prototype differs" in line for line in found), found


def test_a_function_cuda_h_does_not_declare_fails(tmp_path: Path) -> None:
    wrong = _mutated(tmp_path, ("CUresult cuMemAlloc_v2(", "CUresult cuMemAlloc_v9("))
    found = differences(wrong, tmp_path)
    assert any("cuMemAlloc_v9" in line for line in found), found


def test_wrong_values_types_and_layouts_fail(tmp_path: Path) -> None:
    wrong = _mutated(
        tmp_path,
        ("CUDA_ERROR_OUT_OF_MEMORY = 2,", "CUDA_ERROR_OUT_OF_MEMORY = 3,"),
        ("#define CU_STREAM_PER_THREAD ((CUstream)0x2)", "#define CU_STREAM_PER_THREAD ((CUstream)0x3)"),
        ("    CUmemLocationType type;\n    int id;", "    CUmemLocationType type;\n    unsigned int id;"),
        ("    unsigned short usage;\n    unsigned char reserved[54];", "    unsigned int usage;\n    "
                                                                      "unsigned char reserved[54];"),
        ("typedef int CUdevice;", "typedef unsigned int CUdevice;"),
    )
    found = differences(wrong, tmp_path)
    for key in ("CUDA_ERROR_OUT_OF_MEMORY:", "CU_STREAM_PER_THREAD:", "CUmemLocation.id is unsigned int:",
                "offsetof CUmemPoolProps.reserved:", "CUdevice is unsigned int:"):
        assert any(line.startswith(key) for line in found), (key, found)


def test_a_declaration_the_check_cannot_read_fails(tmp_path: Path) -> None:
    wrong = _mutated(tmp_path, ("#endif", "extern int cuda_driver_api_unchecked;\n#endif"))
    assert differences(wrong, tmp_path) == ["cannot check: extern int cuda_driver_api_unchecked"]
