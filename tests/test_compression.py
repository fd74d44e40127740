"""Compressed gradient all-reduce (``compression=`` of DataParallel and MultiWorker): PowerSGD's arithmetic on two
replicas of logical CPUs, its bookkeeping, and its refusals."""

import inspect
import re

import numpy as np
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.plan import checks
from keras_cnnpar.strategies import compression
from tests.helpers import assert_same_step, build_small_cnn, max_weight_difference, one_sgd_step


def summed_on_two_replicas(compressor, variables, parts):
    """Each replica's gradients ``parts[replica]`` summed by ``compressor``; returns the sums as numpy."""
    strategy = cnnpar.DataParallel(2)._tf_strategy()
    stacked = [tf.constant(np.stack([part[i] for part in parts])) for i in range(len(variables))]

    @tf.function
    def step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return [g for g, _ in compressor.summed([(tf.gather(s, replica), v) for s, v in zip(stacked, variables)])]

    return [strategy.experimental_local_results(s)[0].numpy() for s in strategy.run(step)]


def replica_gradients(variables, seed):
    generator = np.random.default_rng(seed)
    return [[generator.standard_normal(v.shape).astype(np.float32) for v in variables] for _ in range(2)]


def test_powersgd_at_each_matrix_full_rank_sums_as_the_plain_all_reduce():
    strategy = cnnpar.DataParallel(2)
    model = build_small_cnn()
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(v.shape), name=v.name) for v in model.trainable_variables]
        full = [compression.PowerSGD([v], rank=min(compression.matrix_shape(v.shape)), minimum=False)
                for v in variables if compression.matrix_shape(v.shape)]
    parts = replica_gradients(variables, seed=0)
    compressed = [v for v in variables if compression.matrix_shape(v.shape)]
    for compressor, variable in zip(full, compressed):
        index = variables.index(variable)
        (summed,) = summed_on_two_replicas(compressor, [variable], [[p[index]] for p in parts])
        np.testing.assert_allclose(summed, parts[0][index] + parts[1][index], atol=1e-5 * np.abs(summed).max())


def test_powersgd_error_feedback_keeps_what_the_approximation_left_out_on_each_replica():
    """After a step of rank 1, the approximation plus both replicas' errors is the exact sum; the next step sends
    the errors along, so over two steps the sums add up to the gradients' within what the second step leaves."""
    strategy = cnnpar.DataParallel(2)
    with strategy.scope():
        kernel = tf.Variable(tf.zeros([40, 12]), name="kernel")
        compressor = compression.PowerSGD([kernel], rank=1)
    parts = replica_gradients([kernel], seed=1)
    (first,) = summed_on_two_replicas(compressor, [kernel], parts)
    (error,) = compressor.error.values()
    errors = [e.numpy() for e in strategy._tf_strategy().experimental_local_results(error)]
    exact = parts[0][0] + parts[1][0]
    assert np.abs(first - exact).max() > 0.1  # rank 1 of a random 40x12 sum: far from it
    np.testing.assert_allclose(first + errors[0] + errors[1], exact, atol=1e-4)
    assert np.abs(errors[0] - errors[1]).max() > 0.1  # each replica keeps its own


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_checkpoint_of_powersgd_restores_q_and_the_replicas_summed_error_on_as_many_replicas_or_more(
        replicas, tmp_path):
    """Saved after a step on 2 replicas, restored on 2 (a resume) or 3 (an elastic resume): every replica holds
    the saved ``Q``, and the replicas' errors sum to the saved replicas' sum, the only error the next all-reduce
    sees; each holds its share of it."""
    with cnnpar.DataParallel(2).scope():
        kernel = tf.Variable(tf.zeros([40, 12]), name="kernel")
        saved = compression.PowerSGD([kernel], rank=1)
    summed_on_two_replicas(saved, [kernel], replica_gradients([kernel], seed=1))
    (error,), (q,) = saved.error.values(), saved.q.values()
    local = cnnpar.DataParallel(2)._tf_strategy().experimental_local_results
    errors, factor = [e.numpy() for e in local(error)], local(q)[0].numpy()
    assert np.abs(errors[0] - errors[1]).max() > 0.1  # the replicas' errors differ: a sum to keep
    saved.kept_by(holder := tf.Module())  # as an optimizer keeps it
    path = tf.train.Checkpoint(optimizer=holder).write(str(tmp_path / "ckpt"))

    strategy = cnnpar.DataParallel(replicas)
    with strategy.scope():
        restored = compression.PowerSGD([tf.Variable(tf.zeros([40, 12]), name="kernel")], rank=1, seed=7)
    restored.kept_by(holder := tf.Module())
    tf.train.Checkpoint(optimizer=holder).read(path).assert_consumed()
    (error,), (q,) = restored.error.values(), restored.q.values()
    local = strategy._tf_strategy().experimental_local_results
    shares = [e.numpy() for e in local(error)]
    np.testing.assert_allclose(sum(shares), errors[0] + errors[1], atol=1e-5)
    np.testing.assert_allclose(shares[0], (errors[0] + errors[1]) / replicas, atol=1e-6)
    for each in local(q):
        np.testing.assert_array_equal(each.numpy(), factor)


def test_powersgd_trains_a_step_near_single_and_says_how_it_differs(batch):
    single = one_sgd_step(build_small_cnn(seed=1), "single", batch)
    compressed = one_sgd_step(build_small_cnn(seed=1), cnnpar.DataParallel(2, compression="powersgd",
                                                                           powersgd_rank=4), batch)
    step = assert_same_step(single, compressed, 0.5, before=build_small_cnn(seed=1), relative=True)  # near it
    assert max_weight_difference(single, compressed) > 0.01 * step  # yet not Single's: the sum was approximated
    check = checks.GradientParityCheck(build_small_cnn(seed=1), cnnpar.DataParallel(2, compression="powersgd"),
                                       *batch)
    check.on_train_begin()
    assert check.verdict == "FAIL (expected: gradients compressed by PowerSGD of rank 4)"


@pytest.mark.parametrize("options, changes", [
    ({"compression": "powersgd", "powersgd_rank": 2}, compression.changes("powersgd", 2)),
    ({"compression": "bfloat16"}, compression.changes("bfloat16")),
    ({"accumulate": 2}, "accumulate=2: each update the mean gradient of 2 batches, 2 times Single's: another training"),
])
def test_a_run_that_trains_differently_from_single_says_how_and_at_what_measured_cost_in_its_log(batch, tmp_path,
                                                                                                options, changes):
    cnnpar.fit(build_small_cnn(), *batch, batch_size=32, strategy=cnnpar.DataParallel(2, **options),
               results_dir=tmp_path, verbose=0)
    assert changes in (tmp_path / "results.log").read_text()
    assert "Single's" in changes and ("docs/slow_links.md" in changes or "another training" in changes)


def test_a_run_that_trains_as_single_says_nothing_of_changes_in_its_log(batch, tmp_path):
    cnnpar.fit(build_small_cnn(), *batch, batch_size=32, strategy=cnnpar.DataParallel(2), results_dir=tmp_path,
               verbose=0)
    logged = (tmp_path / "results.log").read_text()
    assert "compression=" not in logged and "accumulate=" not in logged and "another training" not in logged


@pytest.mark.parametrize("options, message", [
    ({"compression": "float16"}, "compression must be None, 'bfloat16' or 'powersgd'. Received: "
                                 "compression='float16'"),
    ({"compression": "powersgd", "powersgd_rank": 0}, "powersgd_rank must be a positive int. Received: "
                                                      "powersgd_rank=0"),
    ({"powersgd_rank": 2}, "powersgd_rank is for compression='powersgd'. Received: compression=None, "
                           "powersgd_rank=2"),
])
def test_bad_compression_options_are_refused_naming_the_option(options, message):
    for strategy in (cnnpar.DataParallel, cnnpar.MultiWorker):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            strategy(**({"devices": 2} if strategy is cnnpar.DataParallel else {"cluster": {}}), **options)


def test_a_rank_that_compresses_no_gradient_is_refused_before_training(batch):
    model = build_small_cnn()
    with pytest.raises(ValueError, match=r"^powersgd_rank=1000 compresses none of the model's gradients: its "
                                         r"largest, \S+/dense\S*/kernel \(2304x32\), would be sent as "
                                         r"2336000 numbers, no fewer than its 73728; choose a rank below 32\. "
                                         r"Received: powersgd_rank=1000$"):
        one_sgd_step(model, cnnpar.DataParallel(2, compression="powersgd", powersgd_rank=1000), batch)


def test_all_reduce_dtype_is_the_former_spelling_of_bfloat16_compression():
    with pytest.warns(DeprecationWarning, match=r"^all_reduce_dtype is now compression: give "
                                                r"compression='bfloat16'$"):
        strategy = cnnpar.DataParallel(2, all_reduce_dtype="bfloat16")
    assert strategy.compression == "bfloat16"


def test_the_former_spelling_is_warned_at_the_line_of_the_user_that_wrote_it():
    with pytest.warns(DeprecationWarning) as caught:
        line = inspect.currentframe().f_lineno + 1
        cnnpar.DataParallel(2, all_reduce_dtype="bfloat16")
    assert [(warning.filename, warning.lineno) for warning in caught] == [(__file__, line)]
