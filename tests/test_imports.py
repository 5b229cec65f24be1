"""The rooms and their arrows, read from the source with `ast` (nothing is imported to check them,
except where a test says it imports in a fresh interpreter):

- kernels import nothing of expertd.server or expertd.client; client nothing of expertd.server or
  expertd.kernels;
- server/ is rooms: at most 8 top-level modules, every subpackage a door (its `__init__` docstring);
- package-level arrows inside server/ (`ARROWS`): frontends -> batching, engine.api, metrics,
  errors, config and the client's codec / messages / stubs; batching -> engine.api, metrics, errors,
  config; transport -> metrics, errors, config; nothing imports app but cli and multihost;
- `import expertd.server.frontends, expertd.server.batching` loads no JAX (checked in a subprocess);
- every Prometheus family is defined under server/metrics/;
- no import cycles through server or client modules (the kernels' own lazy imports are their
  owner's to untangle);
- in server/ and client/, an expertd import inside a function says why in a comment (no cycles
  dodged with lazy imports);
- in server/, only expertd.server.config.sources reads the environment or argv (host/process.py
  sets the native kernel's variables until the kernels take explicit options);
- no server or client module over 400 lines, at most 6 server modules over 300.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

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
    assert {"expertd.kernels.moe", "expertd.server.engine.engine", "expertd.client.codec", *FRONT_ENDS} \
        <= MODULES.keys()
    assert ENVIRONMENT_READER in MODULES and ENVIRONMENT_WRITERS <= MODULES.keys()


@pytest.mark.parametrize("package, forbidden", [
    ("expertd.kernels", ("expertd.server", "expertd.client")),
    ("expertd.client", ("expertd.server", "expertd.kernels")),
])
def test_kernels_and_client_import_nothing_of_the_others(package, forbidden):
    wrong = [(module, name) for module in MODULES if module.startswith(package + ".") or module == package
             for name, _, _ in _imports(module) if name.startswith(forbidden)]
    assert not wrong, f"{package} must not import {forbidden}: {wrong}"


SERVER = ROOT / "server"
ROOMS = sorted(p.name for p in SERVER.iterdir() if (p / "__init__.py").exists())
# room -> the server rooms (or room.module) it may import besides itself; None: anything
ARROWS = {
    "frontends": {"batching", "engine.api", "engine.description", "metrics", "errors", "config"},
    "batching": {"engine.api", "engine.description", "metrics", "errors", "config"},
    "native_front": {"batching", "engine.api", "engine.description", "frontends", "transport.auth",
                     "transport.interceptors", "metrics", "errors", "config"},
    "shm_channel": {"batching", "frontends", "errors", "metrics", "transport.auth", "transport.interceptors"},
    "transport": {"metrics", "errors", "config"},
    "metrics": {"errors", "config"},
    "config": set(),
    "host": {"config"},
    "models": {"errors"},
    "engine": {"models", "host", "errors", "config"},
    "multihost": None,
}
CLIENT_FOR_SERVER = ("codec", "messages", "pb", "admission", "kserve_protos", "kserve_pool", "shm_frames")
PROMETHEUS_FAMILIES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "CounterMetricFamily",
                       "GaugeMetricFamily", "HistogramMetricFamily", "SummaryMetricFamily", "InfoMetricFamily"}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["expertd", "server"] else None


def test_server_is_rooms_with_doors():
    top = sorted(p.name for p in SERVER.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top
    assert set(ARROWS) == set(ROOMS), "every room has its arrows here"
    for room in ROOMS:
        assert ast.get_docstring(TREES[f"expertd.server.{room}"]), f"server/{room}/__init__.py has no door"


@pytest.mark.parametrize("room", sorted(ARROWS))
def test_rooms_import_along_the_arrows(room):
    allowed = ARROWS[room]
    if allowed is None:
        return
    wrong = []
    for module in MODULES:
        if _room(module) != room and module != f"expertd.server.{room}":
            continue
        for name, node, _ in _imports(module):
            if name.startswith("expertd.client."):
                if name.split(".")[2] not in CLIENT_FOR_SERVER:
                    wrong.append(f"{module} -> {name}")
            elif name.startswith("expertd.server."):
                target = name.split(".")[2]
                if target == room or target in allowed or ".".join(name.split(".")[2:4]) in allowed:
                    continue
                wrong.append(f"{module}:{node.lineno} -> {name}")
    assert not wrong, f"server/{room} imports outside its arrows {sorted(allowed)}: {wrong}"


def test_nothing_imports_app_but_cli_and_multihost():
    wrong = [module for module in MODULES for name, _, _ in _imports(module)
             if name == "expertd.server.app" and module != "expertd.server.cli" and _room(module) != "multihost"]
    assert not wrong


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_front_ends_never_reach_the_engine(front_end):
    reached = _reachable(_graph(top_level_only=False), front_end)
    engine = {m for m in reached if _room(m) == "engine"} - {"expertd.server.engine.api",
                                                             "expertd.server.engine.description"}
    assert not engine, f"{front_end} reaches {sorted(engine)}"
    assert "expertd.server.batching.batcher" in reached and "expertd.server.frontends.decode" in reached


def test_the_front_half_of_the_request_path_loads_no_jax():
    code = ("import sys; import expertd.server.frontends, expertd.server.batching, expertd.server.native_front.front; "
            "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_prometheus_family_is_defined_under_metrics():
    wrong = [f"{module}:{node.lineno} {alias.name}" for module in MODULES if module.startswith("expertd.server")
             and _room(module) != "metrics" for node in ast.walk(TREES[module])
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prometheus_client")
             for alias in node.names if alias.name in PROMETHEUS_FAMILIES]
    assert not wrong


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
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for module, path in MODULES.items()
               if not module.startswith("expertd.kernels")}
    assert not {path: n for path, n in lengths.items() if n > 400}
    over_300 = {path: n for path, n in lengths.items() if n > 300 and path.startswith("server/")}
    assert len(over_300) <= 6, over_300
