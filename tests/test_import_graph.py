"""The import graph of libs/pdserve and services, read from the source (type-only imports included):
no cycles, generated protobuf code only in servicer and convert modules, and the scheduler services
(common, prefill, decode) importing no other service."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"pdserve": ROOT / "libs" / "pdserve", "pdserve.services": ROOT / "services"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] == "v1" or (package == "pdserve" and parts[0] == "services"):
                continue  # generated code; the services' own tree
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` (or pdserve.v1) that ``name`` imports, anywhere in its body."""

    def resolve(target: str) -> str | None:
        while target and target not in known and not target.startswith("pdserve.v1"):
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {resolve(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *[base] * bool(base)]
                )
            found |= {resolve(f"{base}.{alias.name}") or resolve(base) for alias in node.names}
    # importing a submodule runs its package's __init__ first: not an edge of its own
    return {m for m in found if m and m != name and not name.startswith(m + ".")}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycles() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep in edges and dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_generated_code_only_in_servicer_and_convert_modules() -> None:
    offenders = [
        name
        for name, deps in graph().items()
        if any(dep.startswith("pdserve.v1") for dep in deps)
        and not name.rpartition(".")[2].endswith(("servicer", "convert"))
    ]
    assert offenders == []


def test_scheduler_services_import_no_other_service() -> None:
    def service(name: str) -> str:
        return name.split(".")[2] if name.startswith("pdserve.services.") and name.count(".") > 2 else ""

    sideways = [
        (name, dep)
        for name, deps in graph().items()
        if service(name) in ("common", "prefill", "decode")
        for dep in deps
        if service(dep) and service(dep) not in (service(name), "common")
    ]
    assert sideways == []
