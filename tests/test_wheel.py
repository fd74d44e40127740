"""The wheel a user installs: built from the files it is made of, installed into a new virtual environment with the
pinned constraints (``constraints.txt``), and run there as a user would, away from this checkout.

The new environment reaches the packages of the one running the suite through a ``.pth`` line, so the pinned
dependencies it needs are found already installed and nothing is downloaded; the wheel itself goes into the new
environment and comes first on its path. The checkout's own editable install is not seen there: a directory named
by a ``.pth`` line is added to the path without its own ``.pth`` files.
"""

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from helpers import ENV

pytestmark = pytest.mark.slow  # builds, installs and trains in processes of its own

ROOT = Path(__file__).parents[1]
#: What the wheel is built from; anything else in the checkout must not be needed.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "keras_cnnpar")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(wheel, environment)``: the wheel built from ``SOURCES`` and a new virtual environment it is installed in."""
    folder = tmp_path_factory.mktemp("wheel")
    source = _copy_sources(folder / "source")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", folder / "dist", source)
    (wheel,) = (folder / "dist").glob("keras_cnnpar-*.whl")
    environment = folder / "env"
    venv.create(environment, with_pip=True)
    paths = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    (Path(_python(environment, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
     / "suite_packages.pth").write_text("\n".join(paths) + "\n")
    _python(environment, "-m", "pip", "install", "--quiet", "-c", ROOT / "constraints.txt", wheel)
    return wheel, environment


def test_the_wheel_carries_the_license_and_every_subpackage(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(init.relative_to(ROOT)) for init in (ROOT / "keras_cnnpar").rglob("__init__.py")}
    assert len(packages) >= 12 and packages <= names, sorted(packages - names)
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), sorted(names)


def test_every_public_name_imports_from_the_installed_wheel(installed, tmp_path):
    _, environment = installed
    printed = _python(environment, "-c", "import keras_cnnpar as cnnpar\n"
                      "for name in cnnpar.__all__: getattr(cnnpar, name)\n"
                      "print(len(cnnpar.__all__), cnnpar.__file__)", cwd=tmp_path)
    count, location = printed.split()[-2:]
    assert int(count) >= 20 and Path(location).is_relative_to(environment), printed


def test_the_installed_command_prints_its_help_and_trains_the_3_3(installed, tmp_path):
    _, environment = installed
    command = environment / "bin" / "cnnpar"
    assert "Usage: cnnpar [OPTIONS] COMMAND" in _run(command, "--help", cwd=tmp_path)
    _run(command, "train", "--model", "3+3", "--epochs", "1", "--results", "results", cwd=tmp_path)
    assert (tmp_path / "results" / "runs.csv").read_text().count("\n") == 2  # the header and the run


def _copy_sources(destination):
    destination.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, destination / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, destination / name)
    return destination


def _python(environment, *args, cwd=None):
    return _run(environment / "bin" / "python", *args, cwd=cwd)


def _run(*args, cwd=None):
    done = subprocess.run([str(arg) for arg in args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
