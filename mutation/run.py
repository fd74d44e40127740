"""Mutation testing of one module with the tests that cover it: ``python mutation/run.py MODULE``.

mutmut (3.x) makes every small change it can to the module (an operator, a constant, a condition, a removed call or
argument), runs the module's tests against each (only those that reach the mutated function) and counts the
mutants no test notices. This script copies the package and the tests into ``mutation/work/<module>/`` (ignored
by git, made afresh each run; mutmut keeps its ``mutants/`` there for ``mutmut show`` and ``browse``), writes the
mutmut and pytest configuration of that one module there, runs mutmut, and writes
``mutation/results/<module>.txt``: the counts, the wall time and each survivor's diff. How to read it, and the
per-module table: docs/mutation.md.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Each module that is measured, and the pytest arguments of the tests that cover it: the test files or tests
#: that promise its behaviour, and its own doctests (the module's path, with ``--doctest-modules``).
SELECTION = {
    "keras_cnnpar/cluster/traffic.py": [
        "tests/test_properties.py", "tests/test_scaling.py::test_a_link_is_read_as_tc_writes_it_and_anything_else_is_"
        "refused_saying_what_was_expected", "keras_cnnpar/cluster/traffic.py"],
    "keras_cnnpar/strategies/arguments.py": [
        # Not tests/test_compression.py's test of the warning's line: mutmut's trampoline adds a frame to the stack.
        "tests/test_properties.py", "tests/test_compression.py::test_all_reduce_dtype_is_the_former_spelling_of_"
        "bfloat16_compression", "keras_cnnpar/strategies/arguments.py"],
    "keras_cnnpar/cluster/spec.py": [
        "tests/test_properties.py", "tests/test_environments.py", "keras_cnnpar/cluster/spec.py"],
}

#: pytest as the suite runs it, less what a mutant run must not do: no xdist workers (mutmut forks one process per
#: mutant), no cache, no slowest-tests list.
PYTEST = """
[tool.pytest.ini_options]
timeout = 600
filterwarnings = ["ignore::DeprecationWarning"]
markers = ["slow: accuracy floors and tests of processes, clusters and hosts"]
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", choices=sorted(SELECTION), help="the module to mutate")
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (default 1)")
    args = parser.parse_args(argv)
    module = args.module
    work = ROOT / "mutation" / "work" / Path(module).stem
    _prepare(work, module)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
                   cwd=work, check=True)
    seconds = time.perf_counter() - started
    report = _report(work, module, seconds)
    out = ROOT / "mutation" / "results" / (Path(module).stem + ".txt")
    out.parent.mkdir(exist_ok=True)
    out.write_text(report)
    print(report.split("\n\n")[0])
    print(f"written: {out.relative_to(ROOT)}")


def _prepare(work, module):
    """The package, the tests and the configuration of ``module``'s run in ``work``, afresh: mutmut's own cache
    would keep a previous run's verdicts, and the run's wall time would not be the module's."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("keras_cnnpar", "tests"):
        shutil.copytree(ROOT / folder, work / folder, ignore=ignore)
    shutil.copy2(ROOT / "conftest.py", work / "conftest.py")
    selection = SELECTION[module]
    mutmut = {"source_paths": ["keras_cnnpar"], "only_mutate": [module], "also_copy": ["conftest.py"],
              "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q", "--doctest-modules"],
              "pytest_add_cli_args_test_selection": selection}
    lines = ["[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in mutmut.items()]
    (work / "pyproject.toml").write_text("\n".join(lines) + "\n" + PYTEST)


def _report(work, module, seconds):
    """The counts, the wall time and each survivor's diff, as text."""
    stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text()) if _export(work) else {}
    listed = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=work, capture_output=True,
                            text=True).stdout
    survivors = [line.split(":")[0].strip() for line in listed.splitlines() if line.strip().endswith(": survived")]
    total = stats.get("total", 0)
    killed = stats.get("killed", 0)
    head = (f"module: {module}\ntests: {' '.join(SELECTION[module])}\nmutants: {total}\nkilled: {killed}"
            f" ({100 * killed / max(total, 1):.1f}%)\nsurvived: {stats.get('survived', 0)}\n"
            f"timeout: {stats.get('timeout', 0)}\nno tests: {stats.get('no_tests', 0)}\n"
            f"other: {total - killed - stats.get('survived', 0) - stats.get('timeout', 0) - stats.get('no_tests', 0)}\n"
            f"wall time: {seconds:.0f} s (mutmut run, after the copy)")
    diffs = [subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, capture_output=True,
                            text=True).stdout for name in survivors]
    return "\n\n".join([head, *(re.sub(r"\n{3,}", "\n\n", diff).strip() for diff in diffs)]) + "\n"


def _export(work):
    return subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=work,
                          capture_output=True).returncode == 0


if __name__ == "__main__":
    main()
