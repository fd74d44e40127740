"""The package's shape: no import cycle, tf.distribute and DTensor only where they belong, tests that stand alone."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "keras_cnnpar"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path, known):
    """The package's modules that ``path`` imports anywhere (inside functions too: they still tie them)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            inside = name.startswith(base + ".")  # `from pkg import sub` within pkg ties to pkg.sub only
            targets = ([] if inside else [base]) + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, paths) for name, path in paths.items()}


def find_cycle(graph):
    """One import cycle of ``graph`` as a list of modules, or None."""
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return [*path[path.index(imported):], imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    return next((cycle for module in sorted(graph) if module not in state and (cycle := visit(module))), None)


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 20 and graph["keras_cnnpar.training"]  # the graph really was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("api, allowed", [
    ("tf.distribute.", {"strategies", "servers.py"}),  # servers.py runs the servers of external clusters
    ("dtensor.", {"strategies", "sharded"}),
])
def test_distribution_calls_live_in_the_strategy_modules_and_sharded_layers(api, allowed):
    users = {p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py") if api in p.read_text(encoding="utf-8")}
    assert users and users <= allowed, users


def test_no_test_module_imports_another_or_the_conftest():
    for path in Path(__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        offending = {m for m in imported if m.split(".")[-1].startswith("test_") or m.endswith("conftest")}
        assert not offending, (path.name, offending)


@pytest.mark.slow
def test_exporting_a_zoo_model_loads_neither_training_nor_the_strategies(tmp_path):
    script = (
        "import sys\n"
        "from keras_cnnpar import models, serving\n"
        f"serving.export(models.build('3+3'), {str(tmp_path / 'export')!r}, verify=False)\n"
        "print(sorted(m for m in sys.modules if m == 'keras_cnnpar.training' "
        "or m.startswith('keras_cnnpar.strategies')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"
    assert (tmp_path / "export" / "1" / "saved_model.pb").exists()


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
def test_a_users_runs_into_results_leave_the_checkout_clean_and_the_reference_sweep_is_tracked():
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    run_files = ["results/runs.csv", "results/results.log", "results/summary.md",
                 "results/cnn2d_2layer_fullconnected_2layer_keras_tensorflow_single_1dev.csv"]
    assert all(ignored(path) for path in run_files)
    tracked = subprocess.run(["git", "ls-files", "docs/sweep", "results"], cwd=ROOT, capture_output=True, text=True)
    assert "docs/sweep/runs.csv" in tracked.stdout.split() and "results/" not in tracked.stdout
