"""The package's import graph has no circles: every ``import`` / ``from ... import`` of a
``jax_fp4`` module anywhere in a source file (module level or inside a function: a lazy
import is still a dependency) is an edge, and the graph over jax_fp4/**/*.py is acyclic;
so is the graph of the module-level imports alone.

An import of a package counts as an import of its ``__init__``; ``from pkg import name``
counts as an import of ``pkg.name`` where that is a module, else of ``pkg``. A module
importing its own package's ``__init__`` is not counted (Python runs a package's
``__init__`` before any of its modules anyway)."""
import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parent.parent / "jax_fp4"


def _modules():
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = path
    return mods


def _edges(mods, module_level_only=False):
    edges = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        nodes = _module_level(tree.body) if module_level_only else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # "jax_fp4.x.y" of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):
                    edges[mod].add(t)
    return edges


def _module_level(body):
    """The statements run at import: the module body, into if / try blocks, not into
    function or class bodies."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for part in (node.body, node.orelse, getattr(node, "finalbody", []),
                         *[h.body for h in getattr(node, "handlers", [])]):
                yield from _module_level(part)


def _cycle(edges):
    """One import circle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_graph_is_read():
    """The graph has the edges it should (the test would pass vacuously otherwise)."""
    edges = _edges(_modules())
    assert "jax_fp4.prims.quantize" in edges["jax_fp4.ops"]
    assert "jax_fp4.formats" in edges["jax_fp4.qarray"]
    assert "jax_fp4.nn.params" in edges["jax_fp4.nn.flax"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_import_graph_is_acyclic():
    """Imports anywhere in a file (module level or inside functions) form no circle."""
    edges = _edges(_modules())
    cycle = _cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_module_level_import_graph_is_acyclic():
    """The imports run when a module is imported form no circle, with no exception."""
    cycle = _cycle(_edges(_modules(), module_level_only=True))
    assert cycle is None, "import circle at module level: " + " -> ".join(cycle)


def test_public_modules_do_not_import_the_launch_policy():
    """The CUDA launch policy is private to the W4A16 primitive: the public API and the
    layers reach it only through jax_fp4.prims.wmatmul."""
    edges = _edges(_modules())
    users = {m for m, e in edges.items() if "jax_fp4.prims._launch_plan" in e}
    assert users == {"jax_fp4.prims.wmatmul"}, users
