"""tidejax/sched is pure: no jax/flax, no clocks, threads, sockets or I/O, no global RNG."""

import ast
import pathlib

import tidejax.sched

SCHED = pathlib.Path(tidejax.sched.__file__).parent
FORBIDDEN = {
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "chex",
    "numpy",
    "time",
    "datetime",
    "threading",
    "multiprocessing",
    "asyncio",
    "socket",
    "subprocess",
    "random",
    "os",
    "io",
    "pathlib",
    "shutil",
    "tempfile",
    "requests",
    "urllib",
}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval"}


def _modules():
    files = sorted(SCHED.glob("*.py"))
    assert files, "no sched modules found"
    return files


def test_sched_imports_nothing_impure():
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                assert root not in FORBIDDEN, f"{path.name} imports {name}"


def test_sched_calls_no_io_builtins():
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in FORBIDDEN_CALLS, f"{path.name} calls {node.func.id}"


def test_sched_import_does_not_pull_jax():
    import subprocess
    import sys

    code = (
        "import sys, tidejax.sched; "
        "bad = [m for m in ('jax', 'flax', 'numpy') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing tidejax.sched pulled in {out.stdout.strip()}"


def test_page_pool_module_is_pure_python():
    import tidejax.serving.page_pool as pp

    tree = ast.parse(pathlib.Path(pp.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                assert name.split(".")[0] in {"__future__", "collections", "dataclasses"}, name
