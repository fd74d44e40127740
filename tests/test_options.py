"""Every documented strategy option changes what a test can see: the passes a step runs, the ops it traces.

Parity alone cannot show an option at work: a pipeline without micro-batches,
or a step on the whole batch instead of accumulated slices, gives the same
update. These tests count what the option changes instead. (``precision``
under every in-process strategy: ``tests/test_strategies.py``; ``scale_lr``:
the rate; ``sync_batchnorm``: ``tests/test_batchnorm.py`` and
``tests/test_resnet.py``; ``precise_bn``: the AsyncPS resnet test's epoch rows.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import keras_cnnpar as cnnpar
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.strategies import RunSettings
from keras_cnnpar.strategies.tensor_parallel.layers import to_mesh
from tests.helpers import build_small_cnn

IMAGES = tf.TensorSpec([64, 28, 28, 1], tf.float32)
LABELS = tf.TensorSpec([64], tf.int64)
CONVOLUTIONS = 2  # in build_small_cnn


def traced_ops(function, *specs):
    """The op types of ``function`` traced for ``specs``, with their counts."""
    graph = tf.function(function).get_concrete_function(*specs).graph
    types = [op.type for op in graph.get_operations()]
    return {kind: types.count(kind) for kind in set(types)}


@pytest.mark.parametrize("microbatches", [1, 4])
def test_layer_placement_runs_each_micro_batch_through_the_stages(microbatches):
    run = cnnpar.LayerPlacement(2, microbatches=microbatches).prepare(build_small_cnn())
    assert traced_ops(run.model, IMAGES)["Conv2D"] == CONVOLUTIONS * microbatches


@pytest.mark.parametrize("strategy", [cnnpar.Single, cnnpar.DataParallel], ids=lambda s: s.__name__)
@pytest.mark.parametrize("accumulate", [1, 3])
def test_accumulate_runs_that_many_forward_and_backward_passes_per_update(strategy, accumulate):
    run = strategy(accumulate=accumulate).prepare(build_small_cnn())
    rebuild.build_compiled_state(run.model, (IMAGES, LABELS), run.strategy.scope())  # metrics, outside the trace
    replicas = run.strategy.num_replicas
    tf_strategy = run.strategy._tf_strategy() or tf.distribute.get_strategy()
    with run.strategy.scope():
        ops = traced_ops(lambda x, y: tf_strategy.run(run.model.train_step, args=((x, y),)), IMAGES, LABELS)
    assert ops["Conv2D"] == CONVOLUTIONS * accumulate * replicas
    assert ops["Conv2DBackpropFilter"] == CONVOLUTIONS * accumulate * replicas
    assert ops["ResourceApplyGradientDescent"] == len(run.model.trainable_variables) * replicas  # one update


@pytest.mark.parametrize("strategy", [cnnpar.ChannelSharded(2), cnnpar.Hybrid(2, 2)], ids=repr)
@pytest.mark.parametrize("fused_optimizer", [True, False])
def test_the_mesh_optimizer_applies_fused_kernels_unless_told_not_to(strategy, fused_optimizer):
    model = build_small_cnn(optimizer=keras.optimizers.Adam(0.01))
    run = strategy.prepare(model, RunSettings(fused_optimizer=fused_optimizer))
    variables = run.sharded.trainable_weights
    rate = to_mesh(np.float64(0.01), run.optimizer.scalar)

    gradients = [to_mesh(np.zeros(v.shape, v.dtype.as_numpy_dtype), dtensor.fetch_layout(v)) for v in variables]

    def update():
        run.optimizer.apply(gradients, variables, rate)

    ops = traced_ops(update)
    assert ops.get("ResourceApplyAdam", 0) == (len(variables) if fused_optimizer else 0)
