"""LocalSteps's options, refused before any cluster is joined (its training: ``tests/test_multi_worker.py``'s
``local-step`` and ``local-steps`` jobs; its speed and accuracy: ``benchmarks/cluster_links.py`` and
``benchmarks/compression_accuracy.py``)."""

import re

import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.strategies import registry


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
