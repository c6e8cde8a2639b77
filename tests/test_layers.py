"""The import graph of peft_slim follows the layers of docs/architecture.md.

Each module belongs to one layer; it imports only from its own layer and the layers above it, no method package
imports another's, no modules import each other in a cycle, and an import inside a function (which hides a cycle
or a layer crossed upward) is allowed only where ``FUNCTION_LEVEL`` says why. Read from the source with ``ast``:
nothing is imported.
"""

from __future__ import annotations

import ast
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(os.path.dirname(HERE), "peft_slim")
ARCHITECTURE = os.path.join(os.path.dirname(HERE), "docs", "architecture.md")

# docs/architecture.md's table, top to bottom: a module's layer is that of the longest name here that it is or
# lies in. Change both together.
LAYERS = [
    (
        "glue",
        [
            "peft_slim._version",
            "peft_slim.versions",
            "peft_slim.quiet",
            "peft_slim.registry",
            "peft_slim.compat",
            "peft_slim.atomic_folder",
            "peft_slim.process_rank",
            "peft_slim.trainer_state",
        ],
    ),
    ("config checks", ["peft_slim.configuration"]),
    (
        "components",
        [
            "peft_slim.compression",
            "peft_slim.token_selection",
            "peft_slim.nested_lora",
            "peft_slim.trainable",
            "peft_slim.lora_inputs",
            "peft_slim.memory",
            "peft_slim.training_context",
        ],
    ),
    ("tuner base", ["peft_slim.tuner"]),
    ("methods", ["peft_slim.tokentune", "peft_slim.slimfit"]),
    ("tools", ["peft_slim.export", "peft_slim.distributed", "peft_slim.recipe", "peft_slim.planner"]),
    ("package face", ["peft_slim"]),
    ("command line", ["peft_slim.cli", "peft_slim.__main__"]),
]
METHODS = ("peft_slim.tokentune", "peft_slim.slimfit")

# (importing module, imported module): why the import is inside a function. Each entry must still be needed.
FUNCTION_LEVEL = {
    ("peft_slim.cli", "peft_slim"): "imported when the command line builds its parser",
}


def _modules() -> dict[str, str]:
    """Every module of the package: its dotted name -> its file."""
    found = {}
    for top, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(top, name)
                parts = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: str) -> list[tuple[str, int, bool]]:
    """``(imported peft_slim module, line, inside a function)`` for every import of ``module``. ``from x import y``
    imports ``x`` (unless ``module`` lies in it) and ``x.y`` where that is a module."""
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                targets = set()
                for alias in child.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in MODULES:
                        targets.add(submodule)
                    if submodule not in MODULES or not module.startswith(source + "."):
                        targets.add(source)  # the package itself (a module's own packages are imported already)
                found.extend((target, child.lineno, in_function) for target in sorted(targets))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return [(target, line, inner) for target, line, inner in found if target.split(".")[0] == "peft_slim"]


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def layer_of(module: str, layers: list[tuple[str, list[str]]] = LAYERS) -> int:
    owners = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(layers)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert owners, f"{module} is in no layer: add it to docs/architecture.md's table and to LAYERS here"
    return max(owners)[1]


def _edges(modules: dict[str, list[tuple[str, int, bool]]]) -> list[tuple[str, str, int]]:
    """Every import between peft_slim modules but the allowed function-level ones."""
    return [
        (module, target, line)
        for module, imports in modules.items()
        for target, line, inner in imports
        if not (inner and (module, target) in FUNCTION_LEVEL)
    ]


def _cycles(edges: list[tuple[str, str, int]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan's algorithm), each as a path."""
    graph: dict[str, set[str]] = {}
    for module, target, _ in edges:
        if module != target:
            graph.setdefault(module, set()).add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in sorted(graph.get(node, ())):
            if after not in index:
                connect(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for group in groups:  # a path around the group, for the message
        start = min(group)
        path, seen = [start], {start}
        while True:
            after = min(n for n in graph[path[-1]] if n in group)
            if after in seen:
                cycles.append(path[path.index(after) :] + [after])
                break
            path.append(after)
            seen.add(after)
    return cycles


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def _documented_layers() -> list[tuple[str, list[str]]]:
    """The layers of docs/architecture.md's table: each with the modules its rows name (`tuner/`, `memory.py`)."""
    with open(ARCHITECTURE) as handle:
        text = handle.read()
    rows = text[text.index("| layer | modules |") :].split("\n\n")[0].splitlines()[2:]
    layers: list[tuple[str, list[str]]] = []
    for row in rows:
        layer, names = (cell.strip() for cell in row.strip("|").split("|")[:2])
        if layer:
            layers.append((layer, []))
        for name in names.split("`")[1::2]:
            parts = ["peft_slim", *name.removesuffix(".py").strip("/").split("/")]
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if module in MODULES:
                layers[-1][1].append(module)
    return layers


def test_the_layers_are_those_of_the_architecture_page():
    documented = _documented_layers()
    assert [name for name, _ in documented] == [name for name, _ in LAYERS]
    differ = [
        f"{module}: {LAYERS[layer_of(module)][0]} here, {documented[layer_of(module, documented)][0]} in the docs"
        for module in MODULES
        if layer_of(module, documented) != layer_of(module)
    ]
    assert not differ, "docs/architecture.md's table and LAYERS disagree:\n" + "\n".join(differ)


def test_no_module_imports_from_a_lower_layer():
    wrong = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]}), line {line}"
        for module, target, line in _edges(IMPORTS)
        if layer_of(target) > layer_of(module)
    ]
    assert not wrong, "imports from a lower layer:\n" + "\n".join(wrong)


def test_no_method_imports_another_method():
    def method(module: str) -> str | None:
        return next((name for name in METHODS if module == name or module.startswith(name + ".")), None)

    wrong = [
        f"{module} imports {target}, line {line}"
        for module, target, line in _edges(IMPORTS)
        if method(module) and method(target) and method(module) != method(target)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    cycles = _cycles(_edges(IMPORTS))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_function_level_imports_are_the_allowed_ones():
    inner = {(module, target): line for module, imports in IMPORTS.items() for target, line, flag in imports if flag}
    unexplained = [
        f"{module} imports {target} inside a function, line {line}"
        for (module, target), line in inner.items()
        if (module, target) not in FUNCTION_LEVEL
    ]
    assert not unexplained, (
        "imports between peft_slim modules belong at the top of the module; one inside a function hides a cycle "
        "or an upward import (fix that instead), or add it to FUNCTION_LEVEL with the reason:\n"
        + "\n".join(unexplained)
    )
    stale = sorted(set(FUNCTION_LEVEL) - set(inner))
    assert not stale, f"FUNCTION_LEVEL entries no import needs any more (remove them): {stale}"


@pytest.mark.parametrize(
    ("imports", "problem"),
    [
        ({"peft_slim.compat": [("peft_slim.tuner.model", 1, False)]}, "lower layer"),
        (
            {
                "peft_slim.tuner.model": [("peft_slim.tuner.saving", 1, False)],
                "peft_slim.tuner.saving": [("peft_slim.tuner.model", 1, False)],
            },
            "cycle",
        ),
    ],
)
def test_the_checks_catch_what_they_are_for(imports, problem):
    edges = _edges(imports)
    if problem == "lower layer":
        assert any(layer_of(target) > layer_of(module) for module, target, _ in edges)
    else:
        assert _cycles(edges) == [["peft_slim.tuner.model", "peft_slim.tuner.saving", "peft_slim.tuner.model"]]
