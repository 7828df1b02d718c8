"""The router's layout: no import cycle between its modules (imports inside
functions count: a lazy import hides a cycle, it does not remove it), no
import of torch, transformers or the shard's package from any of them, and
each subpackage says in its docstring what it owns."""

import ast
from pathlib import Path

import pytest

ROUTER = Path(__file__).resolve().parents[2] / "router" / "tgi_router"
FORBIDDEN = ("torch", "transformers", "tgi_server")


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package `root`
    (a package is named by its __init__.py)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(absolute dotted target, line) of every import in the module, at any
    depth; `from pkg import x` yields both pkg and pkg.x (x may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((target, node.lineno))
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports."""
    names = module_names(root)
    return {name: {target for target, _ in imports(name, path) if target in names and target != name}
            for name, path in names.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def forbidden_imports(root: Path) -> list[str]:
    return [f"{path.relative_to(root.parent)}:{line} imports {target}"
            for name, path in module_names(root).items() for target, line in imports(name, path)
            if target.split(".")[0] in FORBIDDEN]


def test_router_modules_import_no_cycle():
    assert cycles(graph(ROUTER)) == []


def test_router_imports_no_torch_transformers_or_shard():
    assert forbidden_imports(ROUTER) == []


def test_each_subpackage_says_what_it_owns():
    packages = [p for p in ROUTER.iterdir() if (p / "__init__.py").is_file()]
    assert packages, "the router is grouped into subpackages"
    for package in packages:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{package.name}/__init__.py: what it owns and what it may import"


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("files", [
    # a lazy import inside a function (as config and limits once did)
    {"__init__.py": "", "config.py": "def f():\n    from . import limits\n",
     "limits.py": "from .config import f\n"},
    # across subpackages, absolute and relative
    {"__init__.py": "", "a/__init__.py": "", "a/x.py": "from pkg.b.y import g\n",
     "b/__init__.py": "", "b/y.py": "from ..a import x\ng = 1\n"},
])
def test_the_cycle_check_finds_a_cycle(tmp_path, files):
    root = write(tmp_path / "pkg", files)
    assert len(cycles(graph(root))) == 1


def test_the_forbidden_check_finds_a_lazy_torch_import(tmp_path):
    root = write(tmp_path / "pkg", {"__init__.py": "", "m.py": "def f():\n    import torch.nn\n"})
    assert forbidden_imports(root) == ["pkg/m.py:2 imports torch.nn"]
