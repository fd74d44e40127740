"""The parity protocol's checks catch planted bugs, and gradient accumulation equals a larger batch."""

import keras
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.plan import checks
from keras_cnnpar.results import runs
from tests.helpers import assert_same_step, build_cnn_with_operations_on_tensors, build_small_cnn, read_rows, run_cli


class SummedReplicaGradients(cnnpar.DataParallel):
    """Planted bug: the update applies the sum of the replicas' gradients instead of their mean."""

    def prepare(self, model, settings=None):
        prepared = rebuild.rebuild(model, scope=self.scope(), lr_factor=self.num_replicas, steps_per_execution=1)
        return cnnpar.strategies.Run(self, settings, prepared)


class SameBatchOnEveryReplica(cnnpar.DataParallel):
    """Planted bug: every replica gets the first half of the global batch."""

    def distribute(self, dataset):
        def first_half_twice(x, y):
            half = tf.shape(x)[0] // 2
            return tf.concat([x[:half], x[:half]], 0), tf.concat([y[:half], y[:half]], 0)

        return super().distribute(dataset.map(first_half_twice))


def build_cnn_with_random_layers():
    """``build_small_cnn``'s layers among the random ones a user's CNN has: augmentation in a nested block, noise,
    spatial dropout and dropout."""
    model = build_small_cnn()
    augment = keras.Sequential([keras.layers.RandomFlip("horizontal"), keras.layers.RandomRotation(0.1)],
                               name="augment")
    conv, pool, conv2, flatten, hidden, logits = model.layers
    random_model = keras.Sequential([keras.Input((28, 28, 1)), augment, keras.layers.GaussianNoise(0.1), conv,
                                     keras.layers.SpatialDropout2D(0.2), pool, conv2, flatten,
                                     keras.layers.Dropout(0.3), hidden, logits], name="random_cnn")
    random_model.compile(optimizer=model.optimizer, loss=model.loss)
    return cnnpar.parallel(random_model)


@pytest.mark.parametrize("strategy, verdict", [(cnnpar.DataParallel(2), "pass"), (SummedReplicaGradients(2), "FAIL"),
                                               (cnnpar.ChannelSharded(2), "pass")], ids=repr)
@pytest.mark.parametrize("build", [build_small_cnn, build_cnn_with_random_layers], ids=["plain", "random-layers"])
def test_gradient_parity_check_passes_correct_strategies_and_catches_a_scaling_bug(strategy, verdict, build,
                                                                                   few_digits):
    """On a model with random layers too, whose randomness the check's copies leave out: it used to measure the
    model's float noise at 0.56 and pass any difference below four times that, the planted bug's 0.5 included."""
    check = checks.GradientParityCheck(build(), strategy, few_digits[0][:64], few_digits[1][:64])
    check.on_train_begin()
    assert check.verdict == verdict
    assert check.noise < 1e-5
    if verdict == "pass":
        assert check.difference < 1e-5
    else:
        assert check.difference > 1e-2


def test_the_float_noise_of_a_regularized_model_is_measured(few_digits):
    """Keras cannot add a float64 copy's penalties to its float32 loss, so the noise of a model with a weight or
    an activity regularizer went unmeasured (nan, and a line printed by every check; the tolerance alone
    decided). The noise is now measured without the penalties, in both copies."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, activation="relu",
                                                                            kernel_regularizer="l2"),
                              keras.layers.ActivityRegularization(l2=1e-3), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    check = checks.GradientParityCheck(model, cnnpar.DataParallel(2), few_digits[0][:64], few_digits[1][:64])
    check.on_train_begin()
    assert 0 < check.noise < 1e-5
    assert check.verdict == "pass"


@pytest.mark.parametrize("strategy", [cnnpar.DataParallel(2), cnnpar.LayerPlacement(2)], ids=repr)
def test_a_model_that_calls_operations_on_tensors_is_checked(strategy, few_digits):
    """The check's copies asked every operation of the graph (``a + b``, a slice) for the random layers' seed
    generators, which only layers have: no probe ran ("'GetItem' object has no attribute '_seed_generators'")."""
    check = checks.GradientParityCheck(build_cnn_with_operations_on_tensors(), strategy, few_digits[0][:64],
                                       few_digits[1][:64])
    check.on_train_begin()
    assert check.verdict == "pass"
    assert check.difference < 1e-5
    assert 0 < check.noise < 1e-5


def test_shard_check_passes_sharded_input_and_fails_loudly_on_the_same_batch(few_digits):
    x, y = few_digits[0][:256], few_digits[1][:256]
    good = checks.ShardCheck(cnnpar.DataParallel(2), x, y, 64)
    good.on_train_begin()
    assert good.overlap == 0.0
    model = build_small_cnn()
    with pytest.raises(checks.ShardCheckFailed, match=r"^ShardCheck: replicas of <DataParallel devices=2 "
                                                       r"scale_lr=None> received the same examples in the first step"):
        model.fit(x, y, batch_size=64, verbose=0, results_dir=None, strategy=SameBatchOnEveryReplica(2),
                  callbacks=[checks.ShardCheck(SameBatchOnEveryReplica(2), x, y, 64)])


@pytest.mark.parametrize("strategy", [cnnpar.Single(accumulate=2), cnnpar.DataParallel(2, accumulate=2)], ids=repr)
def test_accumulating_two_steps_equals_one_step_on_twice_the_batch(few_digits, strategy):
    x, y = few_digits[0][:64], few_digits[1][:64]
    once, accumulated = build_small_cnn(), build_small_cnn()
    expected = cnnpar.fit(once, x, y, strategy="single", batch_size=64, shuffle=False, verbose=0, results_dir=None)
    history = cnnpar.fit(accumulated, x, y, strategy=strategy, batch_size=32, shuffle=False, verbose=0,
                         results_dir=None)
    # The epoch's loss and accuracy are the whole batch's (the loss read 0.0).
    assert sorted(history.history) == sorted(expected.history) == ["accuracy", "loss"]
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_same_step(once, accumulated, 1e-5, before=build_small_cnn())
    assert int(accumulated.optimizer.iterations.numpy()) == 1  # one update for the two micro-batches


@pytest.mark.parametrize("args", [["--strategy", "single"], ["--strategy", "mirrored", "--devices", "2"]], ids=" ".join)
@pytest.mark.parametrize("verbose", ["1", "2"])
def test_train_with_checks_records_the_run_under_a_progress_bar(small_csv, tmp_path, args, verbose):
    """Keras's progress bar averages every value of the logs; the checks' words (``pass``, ``trace``) failed it
    after training, and the run had no row and no weights."""
    result = run_cli("train", *args, "--checks", "--epochs", 1, "--data", small_csv, "--results", tmp_path,
                     "--verbose", verbose)
    assert result.exit_code == 0, result.output[-3000:]
    assert "grad_parity_verdict pass" in result.output  # the run summary's last values, words too
    (row,) = read_rows(tmp_path / "runs.csv")
    assert row["time_split"] == "trace"
    assert sum(float(row[column]) for column in runs.SHARE_COLUMNS) == pytest.approx(1.0, abs=2e-3)
    (epoch,) = read_rows(tmp_path / row["epoch_csv"])
    assert (epoch["grad_parity_verdict"], epoch["time_split"]) == ("pass", "trace")
    assert (tmp_path / row["epoch_csv"].replace(".csv", ".weights.h5")).exists()
