"""LocalSteps's options, refused before any cluster is joined, and its checkpointed outer state (its training:
``tests/test_multi_worker.py``'s ``local-step`` and ``local-steps`` jobs; its speed and accuracy:
``benchmarks/cluster_links.py`` and ``benchmarks/compression_accuracy.py``)."""

import re

import numpy as np
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.strategies import registry
from keras_cnnpar.strategies.local_steps import Exchange
from tests.helpers import build_small_cnn


@pytest.mark.parametrize("options, message", [
    ({"inner_steps": 0}, "inner_steps must be a positive int. Received: inner_steps=0"),
    ({"outer": "adam"}, "outer must be 'nesterov' or 'average'. Received: outer='adam'"),
    ({"outer_lr": 0}, "outer_lr must be a positive number. Received: outer_lr=0"),
    ({"outer_momentum": 1.0}, "outer_momentum must be a number in [0, 1). Received: outer_momentum=1.0"),
    ({"outer": "average", "outer_lr": 0.5}, "outer_lr is for outer='nesterov'; 'average' takes the mean of the "
                                            "weights. Received: outer='average', outer_lr=0.5"),
    ({"compression": "powersgd"}, "local-steps sends its weight changes whole: compression must be None or "
                                  "'bfloat16'. Received: compression='powersgd'"),
    ({"compression": "float16"}, "compression must be None, 'bfloat16' or 'powersgd'. Received: "
                                 "compression='float16'"),
])
def test_bad_options_are_refused_in_one_line_naming_the_option(options, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cnnpar.LocalSteps(cluster={}, **options)


def test_it_is_registered_as_a_cluster_strategy_whose_workers_are_launched():
    entry = registry.entry("local-steps")
    assert (entry.class_name, entry.device_option, entry.needs_cluster, entry.keeps_checkpoints) == \
        ("LocalSteps", "workers", True, True)
    assert {"inner_steps", "outer", "outer_lr", "outer_momentum", "compression"} <= set(entry.options)
    assert "accumulate" not in entry.options and "workers" not in entry.options


def test_a_restored_checkpoint_gives_the_exchange_created_after_it_the_saved_outer_state(tmp_path):
    """As a resume runs: the checkpoint is restored into the prepared model and its optimizer before the run
    creates its exchange; the exchange's weights of the last exchange and outer momentum then take the saved
    values, not the fresh model's weights and zero."""
    saved_model = build_small_cnn(seed=0)
    saved_model.optimizer.build(saved_model.trainable_variables)
    saved = Exchange(tf.distribute.get_strategy(), saved_model, every=4, lr=0.7, momentum=0.5)
    for anchor, momentum in zip(saved.anchors, saved.momenta):
        anchor.assign_add(tf.ones_like(anchor))
        momentum.assign_add(tf.fill(momentum.shape, 0.25))
    saved.kept_by(saved_model.optimizer)
    path = tf.train.Checkpoint(model=saved_model, optimizer=saved_model.optimizer).write(str(tmp_path / "ckpt"))

    model = build_small_cnn(seed=1)
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
    resumed = Exchange(tf.distribute.get_strategy(), model, every=4, lr=0.7, momentum=0.5)
    resumed.kept_by(model.optimizer)
    for mine, kept in zip([*resumed.anchors, *resumed.momenta], [*saved.anchors, *saved.momenta]):
        np.testing.assert_array_equal(mine.numpy(), kept.numpy())
    assert float(resumed.momenta[0][0, 0, 0, 0]) == 0.25
