"""The project's import graph, read with ast: no cycle (deferred imports inside functions count:
a cycle that holds only because an import was moved into a function is still a cycle), the
kernels are a leaf, and every module-level import sits at the top of its file."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> the dotted name it installs as (pyproject's package-dir)
PACKAGES = {"kvcli": "kvcli", "convert": "kvcli.convert"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((dotted, *parts))] = path
    return mods


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from P import m` with m a
    submodule of P is an import of P.m, as Python resolves it)."""
    tree = ast.parse(MODULES[name].read_text())
    base = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                mod = ".".join(anchor + ([mod] if mod else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import a.b.c` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_kernels_import_nothing_from_kvcli():
    """kvcli.kernels takes tensors and layout constants: it is a leaf under the library."""
    for m, deps in GRAPH.items():
        if m.startswith("kvcli.kernels"):
            outside = sorted(d for d in deps if not d.startswith("kvcli.kernels"))
            assert not outside, f"{m} imports {outside}"


def test_no_cache_module_imports_attention():
    """The stores are formats: no module of kvcli.cache imports kvcli.attention (attention reads the cache, and
    hands each cache its kernels)."""
    for m, deps in GRAPH.items():
        if m.startswith("kvcli.cache"):
            assert "kvcli.attention" not in deps, f"{m} imports kvcli.attention"


def _external_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_llvmlite_is_imported_by_one_module():
    """Every llvmlite line of the CPU kernels lives in kvcli/kernels/cpu/vectors.py."""
    users = sorted(m for m, path in MODULES.items() if "llvmlite" in _external_imports(path))
    assert users == ["kvcli.kernels.cpu.vectors"], users


def test_only_the_roles_owners_ask_the_kernel_table():
    """One place chooses kernels: the table, asked by the modules that own its roles' glue alone (kvcli/attention.py,
    kvcli/weights.py, kvcli/rope.py, kvcli/swiglu.py)."""
    askers = sorted(m for m, deps in GRAPH.items() if "kvcli.kernel_table" in deps)
    owners = {"kvcli.attention", "kvcli.weights", "kvcli.rope", "kvcli.swiglu"}
    assert set(askers) <= owners | {"kvcli.commands.info", "kvcli.cli"}, askers


def test_module_imports_are_at_the_top():
    """No module-level import below code (the sign of an import moved to dodge a cycle)."""
    for m, path in MODULES.items():
        seen_code = None
        for node in ast.parse(path.read_text()).body:
            is_import = isinstance(node, (ast.Import, ast.ImportFrom))
            is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            type_checking = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            if is_import and seen_code is not None:
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno}: import below code "
                                     f"(line {seen_code})")
            if not (is_import or is_docstring or type_checking):
                seen_code = seen_code or node.lineno


def test_no_generic_top_level_names_installed():
    """`import kernels` / `import convert` do not reach this project (kvcli.kernels, kvcli.convert do)."""
    code = ("import importlib.util as u; "
            f"print([n for n in ('kernels', 'convert') if u.find_spec(n) and {str(ROOT)!r} in str(u.find_spec(n).origin)]); "
            "import kvcli.kernels, kvcli.convert")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_command_line_imports_no_torch():
    """`kvcli --help` stays instant: building the app imports neither torch nor numpy."""
    code = "import sys, kvcli.cli; print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
