"""A strategy defined outside the package registers at run time and then works like the package's own."""

import ast
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


# The registry's reading of the package's source and of plugins (strategies/registry.py), without TensorFlow

#: Each strategy of the package as the registry reads it from the source: alias, class, devices (min, max, multiple),
#: the option that sets them, checkpoints kept, cluster needed.
PACKAGE_FACTS = {
    "async-ps": ("AsyncPS", 2, None, 1, "workers", True, True),
    "channels": ("ChannelSharded", 2, None, 1, "devices", False, False),
    "hybrid": ("Hybrid", 4, None, 2, "mesh", False, False),
    "layers": ("LayerPlacement", 2, None, 1, "devices", False, False),
    "local-steps": ("LocalSteps", 2, None, 1, "workers", True, True),
    "mirrored": ("DataParallel", 2, None, 1, "devices", False, False),
    "multi-worker": ("MultiWorker", 1, None, 1, "workers", True, True),
    "single": ("Single", 1, 1, 1, None, False, False),
}


@pytest.fixture
def afresh():
    """The registry read again from the source (it is cached per process), and no strategy added at run time."""
    registry._entries.cache_clear()
    yield
    registry._entries.cache_clear()


def test_the_registry_reads_each_strategys_class_facts_and_options_from_the_source(afresh, monkeypatch):
    monkeypatch.setattr(registry, "_ADDED", {})
    assert {e.alias: (e.class_name, e.min_devices, e.max_devices, e.device_multiple, e.device_option,
                      e.keeps_checkpoints, e.needs_cluster) for e in registry.entries()} == PACKAGE_FACTS
    assert [e.module for e in registry.entries()][-3:] == [
        "keras_cnnpar.strategies.mirrored", "keras_cnnpar.strategies.multi_worker", "keras_cnnpar.strategies.single"]
    assert registry.entry("mirrored").options == ("devices", "scale_lr", "accumulate", "sync_batchnorm", "compression",
                                                  "powersgd_rank", "all_reduce_dtype")
    assert registry.entry("hybrid").options == ("data", "model", "sync_batchnorm")  # keyword-only ones too
    assert registry.entry("async-ps").module == "keras_cnnpar.strategies.async_ps.strategy"
    assert registry.entry("single").description == "one device, the baseline"
    assert registry.names(needs_cluster=True, device_option="workers") == ["async-ps", "local-steps", "multi-worker"]
    assert registry.names(max_devices=1) == ["single"] and registry.names(alias="none") == []


def test_each_strategy_says_why_a_device_count_does_not_suit_it(user_strategy):
    def facts(low, high, multiple):
        return registry.Entry("s", "m", "S", (), "", low, high, multiple, "devices", False, False)

    said = {(low, high, multiple): [facts(low, high, multiple).invalid(d) for d in range(7)]
            for low, high, multiple in [(1, 1, 1), (2, 2, 1), (2, None, 1), (4, None, 2), (1, 4, 1)]}
    assert said == {
        (1, 1, 1): ["s runs on 1 device", None, *["s runs on 1 device"] * 5],
        (2, 2, 1): [*["s runs on 2 devices"] * 2, None, *["s runs on 2 devices"] * 4],
        (2, None, 1): [*["s needs at least 2 devices"] * 2, *[None] * 5],
        (4, None, 2): [*["s needs a multiple of 2 devices, at least 4"] * 4, None,
                       "s needs a multiple of 2 devices, at least 4", None],
        (1, 4, 1): ["s needs at least 1 devices", *[None] * 4, *["s needs at least 1 devices"] * 2]}
    assert registry.invalid(user_strategy, 2) == "user-single runs on 1 device"  # a class's facts, as an entry's
    assert registry.entry("user-single").load() is user_strategy
    assert (registry.entry("user-single").module, registry.entry("user-single").class_name) == (
        __name__, "user_strategy.<locals>.UserSingle")  # where the class is, as the package's entries say
    assert "user-single" in registry.names() and "user-single" not in [e.alias for e in registry.entries(
        plugins=False)]


SOURCE = '''
class Strategy:
    description, min_devices = "base", 1
    max_devices = None
    def __init__(self, devices, *, accumulate=1):
        pass

@other
class NotRegistered(Strategy):
    pass

@register("child")
@other
class Child(Strategy):
    notes.seen, (min_devices, device_multiple) = True, (0, 0)  # neither a name alone nor a tuple of names
    min_devices, device_multiple = 2, 4
    description = "child"

@register("grandchild")
class Grandchild(Mixin, Child, object):  # a base from elsewhere first
    def __init__(self, cluster):
        pass
'''


def test_a_fact_is_the_nearest_classs_assignment_alone_or_in_a_tuple_and_a_missing_one_is_named():
    classes = {node.name: ("m", node) for node in ast.parse(SOURCE).body}
    child, grandchild = classes["Child"][1], classes["Grandchild"][1]
    assert [registry._registered_alias(classes[name][1]) for name in classes] == [None, None, "child", "grandchild"]
    assert [registry._fact(classes, node, key) for node in (child, grandchild)
            for key in ("description", "min_devices", "device_multiple", "max_devices")] == [
        "child", 2, 4, None, "child", 2, 4, None]
    assert registry._options(classes, grandchild) == ("cluster",)
    assert registry._options(classes, child) == ("devices", "accumulate")
    assert registry._options({}, ast.parse("class Bare: pass").body[0]) == ()
    with pytest.raises(ValueError) as raised:
        registry._fact(classes, grandchild, "needs_cluster")
    assert str(raised.value) == "strategy class Grandchild declares no needs_cluster, and no base class sets it"


def test_a_plugin_that_fails_to_import_is_left_out_with_a_one_line_warning_and_loaded_once(monkeypatch):
    class Point:
        def __init__(self, name, error):
            self.name, self.value, self.error = name, f"{name}_module", error

        def load(self):
            loaded.append(self.name)
            if self.error:
                raise self.error

    loaded = []
    points = [Point("broken", RuntimeError("two\nlines  of   it")), Point("fine", None)]
    monkeypatch.setattr(registry.importlib.metadata, "entry_points",
                        lambda group: points if group == "keras_cnnpar.strategies" else [])
    monkeypatch.setattr(registry, "_entry_points_loaded", [])
    with pytest.warns(UserWarning) as warned:
        registry.names()
    registry.names()
    assert [str(w.message) for w in warned] == [
        "the strategy plugin broken = broken_module is left out: RuntimeError: two lines of it"]
    assert loaded == ["broken", "fine"]
