"""Imports point down: the package's import graph, read from the source (imports inside functions
included, since they run too), has no cycle between modules nor between subpackages; argparse belongs
to the command line (and the trtllm-build launcher) alone; and nothing the package ships imports the tests."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "qwen3vl_trt"
# Where each installed package's source lies (pyproject.toml, [tool.setuptools] package-dir).
SOURCES = {PACKAGE: REPO / "build", f"{PACKAGE}.plugins": REPO / "plugins"}
SHIPPED = (REPO / "build", REPO / "plugins", REPO / "triton_models")
CLI = f"{PACKAGE}.cli"
# The one other command line: build-llm-engine's launcher (`python -m qwen3vl_trt.llm.engine_build`), run
# as trtllm-build's stand-in, hands TensorRT-LLM's add_plugin_argument (tensorrt_llm/commands/build.py,
# 1.2.1) an argparse argument group to declare trtllm-build's plugin flags, so it parses with argparse.
TRTLLM_BUILD_LAUNCHER = f"{PACKAGE}.llm.engine_build"


def _modules() -> dict[str, Path]:
    modules = {}
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _modules()


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every module `name` imports, absolute and relative, anywhere in it: `from p import x` imports the
    module p.x where there is one, else p."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield submodule if submodule in MODULES else source


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imported(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _subpackage(module: str) -> str:
    """The package's top-level unit a module belongs to: qwen3vl_trt.serving.gateway -> qwen3vl_trt.serving."""
    return ".".join(module.split(".")[:2])


def _cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path (its first node repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_graph_sees_every_kind_of_import():
    graph = _graph()
    assert len(MODULES) > 50 and f"{PACKAGE}.serving.gateway.app" in MODULES and f"{PACKAGE}.plugins" in MODULES
    # relative (`from ..common.limits import`), of a submodule by name (`from . import interface`), in a function
    assert f"{PACKAGE}.common.limits" in graph[f"{PACKAGE}.pipeline.build"]
    assert f"{PACKAGE}.serving.interface" in graph[f"{PACKAGE}.serving.repository.writer"]
    assert f"{PACKAGE}.serving.repository.trtllm_config" in graph[f"{PACKAGE}.serving.repository.writer"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_modules():
    assert _cycle(_graph()) is None


def test_no_import_cycle_between_subpackages():
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        packages.setdefault(_subpackage(module), set()).update(
            _subpackage(t) for t in targets if _subpackage(t) != _subpackage(module)
        )
    assert _cycle(packages) is None


def test_argparse_only_in_the_command_line():
    users = sorted(name for name, path in MODULES.items() if "argparse" in set(_imported(name, path)))
    assert users == sorted([CLI, TRTLLM_BUILD_LAUNCHER])


@pytest.mark.parametrize("root", SHIPPED, ids=lambda root: root.name)
def test_shipped_code_never_imports_the_tests(root):
    for path in sorted(root.rglob("*.py")):
        imported = set(_imported(path.stem, path))
        assert not {m for m in imported if m.split(".")[0] in ("tests", "conftest")}, path


# The serving rooms (build/serving/__init__.py): which may not import which. Stages run inside Triton's stubs and
# must not pull in the serve process or the HTTP gateway; the gateway speaks to Triton over gRPC only; the
# repository writer (build time) declares what the stages read through serving.parameters, never through them.
SERVING = f"{PACKAGE}.serving"
FORBIDDEN = {
    f"{SERVING}.stages": (f"{SERVING}.gateway", f"{SERVING}.server"),
    f"{SERVING}.gateway": (f"{SERVING}.stages",),
    f"{SERVING}.repository": (f"{SERVING}.stages",),
}


def _room(module: str) -> str:
    return ".".join(module.split(".")[:3])


def _violations(graph: Mapping[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if _room(target) in FORBIDDEN.get(_room(module), ()):
                found.append(f"{module} -> {target}")
    return found


def test_the_serving_rooms_keep_their_boundaries():
    graph = _graph()
    assert {_room(m) for m in MODULES if m.startswith(f"{SERVING}.")} >= {*FORBIDDEN, f"{SERVING}.server"}
    assert _violations(graph) == []


def test_a_planted_boundary_violation_is_caught():
    graph = {name: set(targets) for name, targets in _graph().items()}
    graph[f"{SERVING}.stages.preprocessing"].add(f"{SERVING}.gateway.app")
    graph[f"{SERVING}.repository.writer"].add(f"{SERVING}.stages.visual_cache")
    graph[f"{SERVING}.gateway.app"].add(f"{SERVING}.stages.preprocessing")
    assert _violations(graph) == [
        f"{SERVING}.gateway.app -> {SERVING}.stages.preprocessing",
        f"{SERVING}.repository.writer -> {SERVING}.stages.visual_cache",
        f"{SERVING}.stages.preprocessing -> {SERVING}.gateway.app",
    ]


def test_every_package_says_what_runs_where():
    for package in sorted({p.parent for p in (REPO / "build").rglob("*.py")}):
        init = package / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), (
            f"{package} needs an __init__.py docstring"
        )


def test_no_serving_module_is_over_600_lines():
    """A serving module that grows past this is two rooms' worth: split it by what runs where."""
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / "build" / "serving").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert not long, long
