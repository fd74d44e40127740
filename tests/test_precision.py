"""Mixed precision under every strategy: parity with Single at the same precision, float32 state, float32 exports."""

import keras
import numpy as np
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.plan import checks
from keras_cnnpar.strategies import RunSettings
from tests.helpers import (
    IN_PROCESS,
    assert_same_step,
    build_small_cnn,
    max_difference,
    max_weight_difference,
    one_sgd_step,
)

#: bfloat16 keeps 8 significant bits: every product and partial sum is rounded to about 0.4%, and two strategies
#: round in different places (a convolution as im2col matmul, a gradient summed over replicas). Through the
#: forward and backward pass of four layers this measured up to 7% of the step's largest change here, against
#: 1e-5 absolute in float32; a wrong update (summed gradients, a replica's half lost) moves it by 50-100%.
BF16_STEP_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def single_bf16(batch):
    return one_sgd_step(build_small_cnn(seed=1), "single", batch, precision="mixed_bfloat16")


@pytest.mark.parametrize("strategy", [cnnpar.LayerPlacement(2, microbatches=2) if alias == "layers" else alias
                                      for alias in IN_PROCESS if alias != "single"], ids=str)
def test_one_bfloat16_step_matches_bfloat16_single(strategy, batch, single_bf16):
    stepped = one_sgd_step(build_small_cnn(seed=1), strategy, batch, precision="mixed_bfloat16")
    assert_same_step(single_bf16, stepped, BF16_STEP_TOLERANCE, before=build_small_cnn(seed=1), relative=True)


def test_bfloat16_is_not_float32_and_the_users_model_stays_float32(batch, single_bf16):
    single = one_sgd_step(build_small_cnn(seed=1), "single", batch)
    assert max_weight_difference(single, single_bf16) > 1e-6  # the step really computed in bfloat16
    assert {layer.dtype_policy.name for layer in single_bf16.layers} == {"float32"}
    assert {w.dtype for w in single_bf16.weights} == {"float32"}
    assert single_bf16.predict(batch[0][:4], verbose=0).dtype == np.float32


#: A bfloat16 all-reduce rounds each replica's float32 gradient to 8 significant bits and rounds their sum again:
#: at most 2 x 2^-8 of the parts' size per element, so within 2^-6 of the step's largest change where the parts
#: do not cancel (measured: about 2^-9 on this model); float32 stays within 1e-5.
BF16_ALL_REDUCE_TOLERANCE = 2**-6


def test_a_bfloat16_all_reduce_steps_as_single_within_bfloat16s_rounding_and_says_so_in_its_parity(batch):
    single = one_sgd_step(build_small_cnn(seed=1), "single", batch)
    float32 = one_sgd_step(build_small_cnn(seed=1), cnnpar.DataParallel(2), batch)
    halved = one_sgd_step(build_small_cnn(seed=1), cnnpar.DataParallel(2, compression="bfloat16"), batch)
    step = assert_same_step(single, halved, BF16_ALL_REDUCE_TOLERANCE, before=build_small_cnn(seed=1), relative=True)
    assert max_weight_difference(single, float32) < 1e-5 < max_weight_difference(single, halved)  # it was cast
    assert max_weight_difference(single, halved) > 2**-12 * step  # bfloat16's rounding, not float32's
    check = checks.GradientParityCheck(build_small_cnn(seed=1), cnnpar.DataParallel(2, compression="bfloat16"),
                                       *batch)
    check.on_train_begin()
    assert check.verdict == "FAIL (expected: gradients all-reduced in bfloat16)"


def test_the_prepared_copy_computes_in_bfloat16_with_a_float32_output_layer(batch):
    prepared = cnnpar.Single().prepare(build_small_cnn(), RunSettings(precision="mixed_bfloat16")).model
    assert [layer.compute_dtype for layer in prepared.layers] == ["bfloat16"] * 5 + ["float32"]
    assert {w.dtype for w in prepared.weights} == {"float32"}


def test_float16_scales_the_loss_and_hands_back_the_inner_optimizers_state(batch):
    strategy = cnnpar.Single()
    model = build_small_cnn(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    history = model.fit(*batch, batch_size=32, epochs=1, verbose=0, strategy=strategy, results_dir=None,
                        precision="mixed_float16")
    assert np.isfinite(history.history["loss"][-1])
    assert type(model.optimizer).__name__ == "SGD" and int(model.optimizer.iterations.numpy()) == 2
    prepared = strategy.prepare(model, RunSettings(precision="mixed_float16")).model
    assert type(prepared.optimizer).__name__ == "LossScaleOptimizer"
    assert max_difference([v.numpy() for v in rebuild.optimizer_state(prepared.optimizer)],
                          [v.numpy() for v in rebuild.optimizer_state(model.optimizer)]) == 0.0


def test_tensor_parallel_refuses_float16_saying_what_works(batch):
    with pytest.raises(ValueError) as raised:
        one_sgd_step(build_small_cnn(seed=1), cnnpar.ChannelSharded(2), batch, precision="mixed_float16")
    assert str(raised.value) == (
        "tensor-parallel training computes in float32 or bfloat16; its mesh optimizer has no loss scaling, which "
        "float16 needs. Use precision='mixed_bfloat16' (or build the model under that policy). Received: "
        "precision='mixed_float16'")


@pytest.mark.parametrize("nested", [False, True], ids=["model", "nested block"])
def test_tensor_parallel_refuses_a_model_built_under_the_float16_policy_by_its_layers(batch, nested):
    """Refused as an optimizer it did not know: "implements the optimizers ['Adam', 'SGD']. Received:
    optimizer=LossScaleOptimizer". A float16 block nested in a float32 model names its layers (it named the block)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = build_small_cnn()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    float16 = [layer.name for layer in model.layers[:3]]
    if nested:
        model = cnnpar.parallel(keras.Sequential([keras.Input((28, 28, 1)), model]))
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    with pytest.raises(ValueError) as raised:
        model.fit(*batch, strategy="channels", results_dir=None, verbose=0)
    assert str(raised.value).endswith(
        "Use precision='mixed_bfloat16' (or build the model under that policy). Received: a model whose layers "
        f"compute in float16 (Keras's mixed_float16 policy): {float16}")


def test_an_unknown_precision_lists_the_valid_ones(batch):
    with pytest.raises(ValueError) as raised:
        one_sgd_step(build_small_cnn(seed=1), "single", batch, precision="bfloat16")
    assert str(raised.value) == ("precision must be one of ['float32', 'mixed_bfloat16', 'mixed_float16', 'auto']. "
                                 "Received: precision='bfloat16'")
