"""The package layering (issue 31): tokenmill's import graph, read from the source with `ast` (imports at module
level and inside functions alike), against one written order of layers.

A unit (a package, or a module of a package whose modules sit in different layers) may import units of its own
layer or below, never above; and no two top-level packages may import each other, directly or around a loop.
The order is the data below, written once. Where the tree does not hold it yet, the arrow is listed in DEBT,
with the reason it is still there: the test fails on a new arrow against the order, and on a listed arrow that
is gone (take it off the list), so the list only shrinks.
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import tokenmill

ROOT = pathlib.Path(tokenmill.__file__).parent

# Top to bottom. The two process contracts (API <-> engine messages, engine <-> worker step) sit low, beside the
# leaves: both sides of each import them.
LAYERS = [
    ("entry", ["cli"]),
    ("tools", ["tune", "bench", "plan", "eval", "fleet"]),
    ("serving", ["router", "serve"]),
    ("http", ["http"]),
    ("front", ["llm", "engine.async_llm", "engine.frontend", "engine.output_processor", "engine.prestart", "multimodal",
               "chat_template"]),
    ("core", ["engine", "structured"]),
    ("executor", ["executor"]),
    ("worker", ["worker"]),
    ("worker parts", ["spec_decode", "kv_transfer"]),
    ("models", ["models"]),
    ("layers", ["layers"]),
    ("contracts", ["lora", "messages", "step", "engine.request", "engine.stats", "outputs", "sampling_params"]),
    ("leaves", ["distributed", "perf", "config", "config_snapshot", "startup", "host"]),
]
RANK = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}

# Arrows against the order that the tree still has (importer unit, imported unit): why each is still there.
DEBT: dict[tuple[str, str], str] = {}

def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py"}


def unit_of(module: str) -> str:
    """The longest listed prefix of a module ('engine.async_llm' before 'engine')."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    return parts[0]


def imports(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    """tokenmill modules that `module` imports, anywhere in its body (names resolved to modules where they are)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"tokenmill.{target}".rstrip(".")]
            else:
                names = [node.module or ""]
            names = [f"{names[0]}.{a.name}" if f"{names[0]}.{a.name}".removeprefix("tokenmill.") in known
                     else names[0] for a in node.names]
        else:
            continue
        for name in names:
            if name == "tokenmill" or not name.startswith("tokenmill."):
                continue
            name = name.removeprefix("tokenmill.")
            while name and name not in known:  # `import tokenmill.a.b.attr` -> the module a.b
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, m, set(mods)) for m, p in mods.items()}


def against_the_order(g: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) -> the module arrows that import upward."""
    bad = defaultdict(list)
    for m, targets in g.items():
        for t in targets:
            a, b = unit_of(m), unit_of(t)
            if a != b and RANK.get(a, len(LAYERS)) > RANK.get(b, len(LAYERS)):
                bad[(a, b)].append(f"{m} -> {t}")
    return dict(bad)


def package_cycles(g: dict[str, set[str]], skip=()) -> list[list[str]]:
    """Strongly connected sets of two or more top-level packages (Tarjan), the arrows of `skip`'s unit pairs
    left out."""
    edges = defaultdict(set)
    for m, targets in g.items():
        for t in targets:
            if m.split(".")[0] != t.split(".")[0] and (unit_of(m), unit_of(t)) not in skip:
                edges[m.split(".")[0]].add(t.split(".")[0])
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in modules()}
    assert not units - set(RANK), f"place these in LAYERS: {sorted(units - set(RANK))}"


def test_imports_follow_the_layers():
    bad = against_the_order(graph())
    new = {k: v for k, v in bad.items() if k not in DEBT}
    paid = sorted(k for k in DEBT if k not in bad)
    assert not new, "imports against the layer order:\n" + "\n".join(
        f"  {a} -> {b}: {', '.join(sorted(v))}" for (a, b), v in sorted(new.items()))
    assert not paid, f"no longer imported: take these off DEBT: {paid}"


def test_no_cycles_between_packages():
    cycles = package_cycles(graph(), skip=DEBT)
    assert not cycles, f"packages importing each other (around a loop): {cycles}"


def test_function_level_imports_say_why():
    """An import of a tokenmill module kept inside a function (start-up time, an optional dependency, a cycle)
    says why: a comment on its line, or a comment line right above the run of import lines it is in."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text, filename=str(path))
        spans = [(n.lineno, n.end_lineno) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        import_lines = {i for a, b in spans for i in range(a, b + 1)}
        inner = {n.lineno: n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "tokenmill"
                                                                           for a in n.names)
                 or isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "tokenmill")}
        for node in inner.values():
            above = node.lineno - 1
            while above in import_lines:
                above -= 1
            if not any("#" in line for line in lines[node.lineno - 1:node.end_lineno]) \
                    and not (above and lines[above - 1].lstrip().startswith("#")):
                bad.append(f"tokenmill/{rel}:{node.lineno}")
    assert not bad, ("imports inside functions with no comment saying why (hoist them, or say why they stay):\n  "
                     + "\n  ".join(sorted(bad)))
