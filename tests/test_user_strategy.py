"""A strategy defined outside the package registers at run time and then works like the package's own."""

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
