"""A strategy defined outside the package registers at run time and then works like the package's own."""

import subprocess
import sys

import keras
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar import strategies
from keras_cnnpar.plan import planner
from keras_cnnpar.strategies import registry
from tests import helpers


@pytest.fixture
def user_strategy(monkeypatch):
    """A user's strategy class, registered as "user-single" for this test only."""
    monkeypatch.setattr(registry, "_ADDED", {})

    @strategies.register("user-single")
    class UserSingle(strategies.Strategy):
        """Keras's own ``fit`` on one device, under a name of the user's."""

        description = "a user's strategy: one device"
        max_devices = 1
        device_option = None

        @classmethod
        def configurations(cls, devices, batch_size):
            return [()]

    return UserSingle


def test_a_registered_user_strategy_trains_through_fit_as_single_does(user_strategy, small_cnn, few_digits):
    x, y = few_digits
    mine, single = small_cnn(seed=3), small_cnn(seed=3)
    keras.utils.set_random_seed(0)
    history = cnnpar.fit(mine, x, y, strategy="user-single", epochs=1, batch_size=32, shuffle=False, verbose=0,
                         results_dir=None)
    keras.utils.set_random_seed(0)
    cnnpar.fit(single, x, y, strategy="single", epochs=1, batch_size=32, shuffle=False, verbose=0, results_dir=None)
    assert len(history.history["loss"]) == 1
    helpers.assert_same_step(single, mine, 1e-6, before=small_cnn(seed=3))


def test_a_registered_user_strategy_is_a_cli_choice_and_a_plan_configuration(user_strategy):
    assert "user-single" in registry.names()
    assert registry.entry("user-single").options == ("steps_per_execution", "accumulate")
    assert strategies.resolve("user-single").alias == "user-single"
    help_text = helpers.run_cli("train", "--help").output
    assert "user-single" in help_text
    refused = helpers.run_cli("sweep", "--strategies", "single,user-singel")
    assert refused.exit_code == 2 and "'user-single'" in refused.output
    planned = [str(c) for c in planner.configurations(2, batch_size=64)]
    assert planned[0] == "single" and planned.count("user-single") == 1


def test_a_user_strategy_cannot_take_a_name_of_the_package(monkeypatch):
    monkeypatch.setattr(registry, "_ADDED", {})
    with pytest.raises(ValueError, match=r"^the strategy name 'mirrored' is taken by DataParallel; choose another\. "
                                         r"Received: .*Mine registered as 'mirrored'$"):
        @strategies.register("mirrored")
        class Mine(strategies.Strategy):
            """Clashes with DataParallel."""
    assert "mirrored" not in registry._ADDED


#: Plugins of an installed distribution (``plugins`` fixture): entry point name -> module source (None: missing).
PLUGINS = {
    "raises": "raise RuntimeError('this plugin is broken')",
    "absent": None,
    "clash": "from keras_cnnpar import strategies\n\n"
             "@strategies.register('mirrored')\nclass Clash(strategies.Strategy):\n    pass\n",
    "fine": "import os, pathlib\npathlib.Path(os.environ['PLUGIN_MARK']).touch()\n"
            "from keras_cnnpar import strategies\n\n"
            "@strategies.register('plugin-single')\nclass PluginSingle(strategies.Strategy):\n"
            "    description = \"a plugin's strategy: one device\"\n    max_devices = 1\n    device_option = None\n",
}


@pytest.fixture
def plugins(tmp_path):
    """The environment of a process that sees a distribution offering ``PLUGINS`` in the entry-point group, and the
    file the fine plugin creates when it is imported."""
    site = tmp_path / "site"
    (site / "user_plugins-1.0.dist-info").mkdir(parents=True)
    (site / "user_plugins-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: user-plugins\n"
                                                                 "Version: 1.0\n")
    points = [f"{name} = {name}_plugin" for name in PLUGINS]
    (site / "user_plugins-1.0.dist-info" / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINTS}]\n" + "\n".join(points) + "\n")
    for name, source in PLUGINS.items():
        if source is not None:
            (site / f"{name}_plugin.py").write_text(source)
    mark = tmp_path / "fine-plugin-imported"
    return {**helpers.ENV, "PYTHONPATH": str(site), "PLUGIN_MARK": str(mark)}, mark


@pytest.mark.slow  # fresh processes; the fine plugin imports TensorFlow
def test_a_broken_or_clashing_plugin_is_one_warning_line_and_left_out(plugins, tmp_path):
    env, mark = plugins
    done = subprocess.run(helpers.cnnpar_command("train", "--help"), env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "plugin-single" in done.stdout and mark.exists(), done.stderr[-2000:]
    warned = [line for line in done.stderr.splitlines() if line.startswith("Warning:")]
    assert warned == [
        "Warning: the strategy plugin raises = raises_plugin is left out: RuntimeError: this plugin is broken",
        "Warning: the strategy plugin absent = absent_plugin is left out: ModuleNotFoundError: No module named "
        "'absent_plugin'",
        "Warning: the strategy plugin clash = clash_plugin is left out: ValueError: the strategy name 'mirrored' is "
        "taken by DataParallel; choose another. Received: Clash registered as 'mirrored'",
    ], done.stderr[-2000:]


@pytest.mark.slow  # fresh processes
@pytest.mark.parametrize("command", [["--help"], ["--version"], ["data", "--help"]])
def test_help_version_and_import_load_no_plugin(plugins, tmp_path, command):
    env, mark = plugins
    done = subprocess.run(helpers.cnnpar_command(*command), env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    imported = subprocess.run([sys.executable, "-c", "import keras_cnnpar, sys; print('tensorflow' in sys.modules)"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "" and imported.stdout == "False\n" and imported.stderr == ""
    assert not mark.exists()
