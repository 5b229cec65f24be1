"""Imports point one way, read from the source with `ast` (nothing is imported to check it):

- kernels import nothing of expertd.server or expertd.client; client nothing of expertd.server or
  expertd.kernels; the front ends (expertd.v1 servicer, KServe) never reach the engine module;
- no import cycles through server or client modules (the kernels' own lazy imports are their
  owner's to untangle);
- in server/ and client/, an expertd import inside a function says why in a comment (no cycles
  dodged with lazy imports);
- in server/, only expertd.server.config.sources reads the environment or argv (process.py sets
  the native kernel's variables until the kernels take explicit options).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"kernels": "expertd.kernels", "server": "expertd.server", "client": "expertd.client"}
FRONT_ENDS = ("expertd.server.frontends.expert_v1", "expertd.server.frontends.kserve")
ENVIRONMENT_READER = "expertd.server.config.sources"
# Until expertd.kernels.cpu.configure lands, the native CPU kernel takes its options from variables.
ENVIRONMENT_WRITERS = {"expertd.server.host.process"}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "pb" in path.relative_to(ROOT / folder).parts[:-1]:
                continue  # generated stubs
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    return modules


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str, *, top_level_only: bool = False) -> list[tuple[str, ast.stmt, bool]]:
    """(imported expertd module, the statement, whether it sits inside a function) of ``module``."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, child)
                for alias in child.names:
                    candidate = f"{base}.{alias.name}"
                    found.append((candidate if candidate in MODULES else base, child, in_function))
            visit(child, inside)

    visit(TREES[module], False)
    return [(name, node, inner) for name, node, inner in found
            if name.startswith("expertd.") and not (top_level_only and inner)]


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    return {module: {name for name, _, _ in _imports(module, top_level_only=top_level_only) if name in MODULES}
            for module in MODULES}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for name in graph[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


def test_the_source_was_found():
    assert {"expertd.kernels.moe", "expertd.server.engine.engine", "expertd.client.codec", *FRONT_ENDS} <= MODULES.keys()
    assert ENVIRONMENT_READER in MODULES and ENVIRONMENT_WRITERS <= MODULES.keys()


@pytest.mark.parametrize("package, forbidden", [
    ("expertd.kernels", ("expertd.server", "expertd.client")),
    ("expertd.client", ("expertd.server", "expertd.kernels")),
])
def test_kernels_and_client_import_nothing_of_the_others(package, forbidden):
    wrong = [(module, name) for module in MODULES if module.startswith(package + ".") or module == package
             for name, _, _ in _imports(module) if name.startswith(forbidden)]
    assert not wrong, f"{package} must not import {forbidden}: {wrong}"


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_front_ends_never_reach_the_engine(front_end):
    reached = _reachable(_graph(top_level_only=False), front_end)
    assert "expertd.server.engine.engine" not in reached, f"{front_end} reaches the engine through {sorted(reached)}"
    assert "expertd.server.batching.batcher" in reached and "expertd.server.frontends.decode" in reached


def test_no_import_cycles_through_server_or_client():
    graph = _graph(top_level_only=False)
    cycles = sorted(module for module in MODULES if not module.startswith("expertd.kernels")
                    and module in _reachable(graph, module))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_function_level_expertd_imports_say_why():
    lines = {module: MODULES[module].read_text().splitlines() for module in MODULES}
    unexplained = []
    for module in MODULES:
        if module.startswith("expertd.kernels"):
            continue  # the kernels' lazy imports are their owner's
        for name, node, in_function in _imports(module):
            here = lines[module][node.lineno - 1]
            above = lines[module][node.lineno - 2].strip() if node.lineno > 1 else ""
            if in_function and "#" not in here and not above.startswith("#"):
                unexplained.append(f"{MODULES[module].relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not unexplained


def _reads_environment(tree: ast.AST) -> list[int]:
    """Lines that touch os.environ / os.getenv / os.putenv / sys.argv."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                (node.value.id == "os" and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb"))
                or (node.value.id == "sys" and node.attr == "argv")):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "sys") and any(
                alias.name in ("environ", "getenv", "argv") for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_one_server_module_reads_flags_and_the_environment():
    readers = {module: lines for module in MODULES if module.startswith("expertd.server")
               if (lines := _reads_environment(TREES[module]))}
    assert ENVIRONMENT_READER in readers
    assert set(readers) - {ENVIRONMENT_READER} <= ENVIRONMENT_WRITERS, readers
    for module in ENVIRONMENT_WRITERS & readers.keys():  # they write, never read: os.environ[...] = / .pop
        source = MODULES[module].read_text()
        assert "until kernels.cpu.configure lands" in source
        assert "environ.get" not in source and "getenv" not in source


def test_no_server_or_client_module_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for module, path in MODULES.items()
            if not module.startswith("expertd.kernels") and (n := len(path.read_text().splitlines())) > 400}
    assert not long
