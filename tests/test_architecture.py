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
    assert len(graph) > 20 and graph["keras_cnnpar.api"]  # the graph really was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def modules_mentioning(text):
    """The package's module paths (``strategies/base.py``) whose source holds ``text``."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if text in p.read_text(encoding="utf-8")}


@pytest.mark.parametrize("api, allowed", [
    ("tf.distribute.", ("strategies/", "cluster/servers.py")),  # servers.py runs the servers of external clusters
    ("dtensor.", ("strategies/tensor_parallel/",)),
])
def test_distribution_calls_live_in_the_strategy_modules_and_sharded_layers(api, allowed):
    users = modules_mentioning(api)
    assert users and all(user.startswith(allowed) for user in users), users


#: The package's layers, lowest first: a module imports only modules of its own package or of a lower layer.
LAYERS = [("runtime",), ("keras_compat",), ("zoo", "cluster"), ("results",), ("strategies",), ("engine",), ("plan",),
          ("api", "serving"), ("cli",)]
#: Imports that point up on purpose, each with its reason.
UPWARD = {
    # the zoo's models come with `fit(..., strategy=)`: `cnn` wraps the model it builds, at call time
    ("keras_cnnpar.zoo.models", "keras_cnnpar.api"),
}


def layer_of(module):
    """The index in LAYERS of ``module``'s top package below keras_cnnpar, or None (the package's face)."""
    top = module.split(".")[1] if module.count(".") else None
    return next((i for i, layer in enumerate(LAYERS) if top in layer), None)


def test_every_module_sits_in_a_layer():
    unplaced = {m for m in import_graph() if m.count(".") and layer_of(m) is None}
    assert unplaced == {"keras_cnnpar.moved"}, unplaced  # the old import paths: it imports by name only


def test_imports_point_down_the_layers():
    upward = sorted((module, imported) for module, imports in import_graph().items() for imported in imports
                    if None not in (layer_of(module), layer_of(imported))
                    and module.split(".")[1] != imported.split(".")[1]
                    and layer_of(imported) >= layer_of(module) and (module, imported) not in UPWARD)
    assert upward == [], upward


def test_results_cluster_and_the_zoo_never_import_the_strategies_and_nothing_imports_the_cli():
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith(("keras_cnnpar.results", "keras_cnnpar.cluster", "keras_cnnpar.zoo")):
            assert not {m for m in imports if m.startswith("keras_cnnpar.strategies")}, module
        assert not {m for m in imports if m.startswith("keras_cnnpar.cli")} or module.startswith("keras_cnnpar.cli")


@pytest.mark.parametrize("private", ["_inbound_nodes", "_nodes_by_depth", "_keras_history", "keras.src"])
def test_only_keras_compat_touches_keras_private_api(private):
    users = modules_mentioning(private)
    assert users and all(user.startswith("keras_compat/") for user in users), users


@pytest.mark.slow  # a fresh Python process
def test_an_old_import_path_gives_the_moved_module_with_a_deprecation_warning():
    script = ("import warnings\nwarnings.simplefilter('error')\nimport keras_cnnpar\n"
              "try:\n    import keras_cnnpar.planner\nexcept DeprecationWarning as w:\n    print(w)\n"
              "warnings.simplefilter('ignore')\nimport keras_cnnpar.planner, keras_cnnpar.plan.planner as new\n"
              "print(keras_cnnpar.planner is new, keras_cnnpar.models.__name__)\n"
              # a module of a moved package: Python's own finder loaded a second copy under the old name
              "import keras_cnnpar.sharded.layers as old, keras_cnnpar.strategies.tensor_parallel.layers as layers\n"
              "print(old is layers, layers.__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-3:] == [
        "keras_cnnpar.planner is now keras_cnnpar.plan.planner; the old path will go in a later release",
        "True keras_cnnpar.zoo.models", "True keras_cnnpar.strategies.tensor_parallel.layers"]


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
        "print(sorted(m for m in sys.modules if m == 'keras_cnnpar.api' or m.startswith('keras_cnnpar.strategies') "
        "and m not in ('keras_cnnpar.strategies', 'keras_cnnpar.strategies.registry')))\n")
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
