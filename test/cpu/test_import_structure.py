"""The package's import structure, read from the source with `ast` (nothing is imported):

(a) no import cycle among replaylm's modules. Counted: imports at module level and inside
    functions (a function-local import that closes a cycle only hides it); not counted: imports
    under `if TYPE_CHECKING:` (annotations only). Importing `a.b.c` also runs the packages `a.b`
    and `a`, except those the importer is itself inside (they are running already).
(b) no module under `replaylm.layers` imports `replaylm.model_executor`, at module level, in a
    function or under TYPE_CHECKING, with one exception: a TYPE_CHECKING import of
    `replaylm.model_executor.forward_batch` (ForwardBatch, the type of the batch every layer is
    handed, used in annotations only). Layers are the lower level; what both sides need (the
    graph-break marker) lives in `layers/`.
(c) `replaylm.model_executor.engine_config` (the flags resolved for the machine), with the
    CUDA-graph resolver and the mode table, imports no torch, not even transitively at module
    level: the launcher resolves before it spawns the model process, without torch. Nor do the
    launcher itself and the GGUF tokenizer: torch is the scheduler process's to import.
(d) nothing the graph runners import reaches the model runner back, and no module outside the
    CUDA-graph package names a graph runner's class.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "python"
RESOLVERS = (
    "replaylm.model_executor.engine_config",
    "replaylm.model_executor.cuda_graph.config",
    "replaylm.cuda_graph_modes",
)
LAYERS_MAY_TYPE_IMPORT = {"replaylm.model_executor.forward_batch"}


@dataclass(frozen=True)
class Import:
    target: str  # the imported name, resolved to a module of the package where it is one
    where: str  # "module", "function" or "type_checking"
    line: int


def _modules() -> dict[str, Path]:
    found = {}
    for path in (PACKAGE_ROOT / "replaylm").rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    # `from a import b` imports module a.b when there is one, else the name b of module a
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def _own_module(name: str) -> str | None:
    """The package module `name` is or is inside (None: not this package's)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[Import] = []

    def visit(body: list[ast.stmt], where: str) -> None:
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.body, "type_checking")
                visit(node.orelse, where)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, "type_checking" if where == "type_checking" else "function")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported_names(node, module):
                    found.append(Import(_own_module(name) or name, where, node.lineno))
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit(inner, where)

    visit(tree.body, "module")
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _runs(importer: str, target: str) -> set[str]:
    """The package modules importing `target` runs: it and its packages, less the importer's."""
    if target not in MODULES:
        return set()
    parts = target.split(".")
    inside = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    if MODULES[importer].name == "__init__.py":
        inside.add(importer)
    ran = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - inside
    return {m for m in ran if m in MODULES and m != importer}


def _edges(wheres: set[str]) -> dict[str, set[str]]:
    return {
        module: {ran for i in imports if i.where in wheres for ran in _runs(module, i.target)}
        for module, imports in IMPORTS.items()
    }


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return components


def test_the_walker_sees_the_kinds_of_import():
    """The checks below are only as good as the walker: it must see each kind where it is."""

    def kinds(module: str, target: str) -> set[str]:
        return {i.where for i in IMPORTS[module] if i.target == target}

    registry = "replaylm.layers.attention.registry"
    assert kinds(registry, "replaylm.layers.attention.base") == {"type_checking"}
    assert kinds(registry, "importlib") == {"module"}
    assert kinds("replaylm.layers.sampler", "replaylm.layers.kernels.seeded_sample") == {"function"}
    # importing a module runs its packages too, not those the importer is inside
    assert _runs("replaylm.launch_server", "replaylm.layers.attention.selection") == {
        "replaylm.layers",
        "replaylm.layers.attention",
        "replaylm.layers.attention.selection",
    }
    assert _runs("replaylm.layers.linear", "replaylm.layers.kernels.ops") == {
        "replaylm.layers.kernels",
        "replaylm.layers.kernels.ops",
    }


def test_no_import_cycles():
    cycles = _cycles(_edges({"module", "function"}))
    assert not cycles, f"import cycles (outside TYPE_CHECKING): {cycles}"


def test_the_layers_do_not_import_the_model_executor():
    offending = {
        f"{module}:{i.line} imports {i.target} ({i.where})"
        for module, imports in IMPORTS.items()
        if module.startswith("replaylm.layers.") or module == "replaylm.layers"
        for i in imports
        if i.target.startswith("replaylm.model_executor")
        and not (i.where == "type_checking" and i.target in LAYERS_MAY_TYPE_IMPORT)
    }
    assert not offending, sorted(offending)


def _module_level_closure(start: str) -> dict[str, str]:
    """Every name `start` imports at module level, transitively through the package, mapped to
    the package module that imports it first (breadth first: the shortest chain)."""
    edges = _edges({"module"})
    seen = {start: ""}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for i in IMPORTS[module]:
            if i.where != "module":
                continue
            for name in _runs(module, i.target) or {i.target}:
                if name not in seen:
                    seen[name] = module
                    if name in edges:
                        queue.append(name)
    return seen


def _heavy_chains(reached: dict[str, str], roots: set[str]) -> list[str]:
    """The import chains (`_module_level_closure`'s) that reach a module of `roots`."""
    chains = []
    for name in sorted(n for n in reached if n.split(".")[0] in roots):
        chain = [name]
        while reached[chain[-1]]:
            chain.append(reached[chain[-1]])
        chains.append(" <- ".join(chain))
    return chains


def test_the_resolvers_import_no_torch():
    reached = _module_level_closure(RESOLVERS[0])
    # the walk does go through the package
    assert {"replaylm.layers.attention.registry", *RESOLVERS[1:]} <= set(reached)
    for resolver in RESOLVERS:
        assert not _heavy_chains(_module_level_closure(resolver), {"torch", "triton", "numpy"})


def test_the_graph_runners_see_no_model_runner():
    """The runners get a narrow context: what they import, even for annotations, never reaches
    the ModelRunner; nor does anything outside the graph package ask a runner's type."""
    runner_package = "replaylm.model_executor.cuda_graph"
    for module, imports in IMPORTS.items():
        if module.startswith(runner_package):
            assert not [i for i in imports if i.target.endswith("model_runner")], module
    for module, path in MODULES.items():
        if module.startswith(runner_package):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not any(n.endswith("CudaGraphRunner") for n in names), module


def test_the_front_end_and_its_tokenizer_import_no_torch():
    """The HTTP process leaves torch to the scheduler process; the GGUF tokenizer (its cache
    included) loads without it."""
    walks_through = {
        "replaylm.launch_server": "replaylm.runtime.scheduler_process",
        "replaylm.model_loader.gguf_tokenizer": "replaylm.model_loader.gguf_header",
    }
    for module, inner in walks_through.items():
        reached = _module_level_closure(module)
        assert inner in reached
        assert not _heavy_chains(reached, {"torch", "triton"}), module
