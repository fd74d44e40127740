import keras
import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.results import runs
from keras_cnnpar.zoo import models
from tests.helpers import assert_same_step


@pytest.mark.parametrize("kind, parameters, name", [
    ("2+2", 3_274_634, "cnn2d_2layer_fullconnected_2layer"),
    ("3+3", 246_682, "cnn2d_3layer_fullconnected_3layer"),
])
def test_original_cnns_have_the_original_sizes_and_names(kind, parameters, name):
    model = models.cnn(kind)
    assert model.count_params() == parameters
    assert model.name == name
    assert model.input_shape == (None, 28, 28, 1)
    assert model.output_shape == (None, 10)


def test_two_plus_two_compiles_with_adam_5e_4():
    model = models.cnn("2+2")
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(5e-4)
    assert [layer.rate for layer in model.layers if isinstance(layer, keras.layers.Dropout)] == [0.5]


def test_three_plus_three_compiles_with_nesterov_sgd_and_lecun_dense_layers():
    model = models.cnn("3+3")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert (float(optimizer.learning_rate.numpy()), optimizer.momentum, optimizer.nesterov) == \
        (pytest.approx(0.05), 0.9, True)
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    assert [type(layer.kernel_initializer).__name__ for layer in dense] == ["LecunUniform"] * 3
    assert [layer.rate for layer in model.layers if isinstance(layer, keras.layers.Dropout)] == [0.25, 0.25]


@pytest.mark.parametrize("kind", ["2+2", "3+3", "resnet"])
def test_loss_is_sparse_categorical_crossentropy_with_accuracy(kind):
    config = models.cnn(kind).get_compile_config()
    assert (config["loss"], config["metrics"]) == ("sparse_categorical_crossentropy", ["accuracy"])


def test_unknown_model_lists_the_valid_ones():
    with pytest.raises(ValueError,
                       match=r"^model must be one of \['2\+2', '3\+3', 'resnet'\]. Received: model='4\+4'$"):
        models.cnn("4+4")


def test_parallel_rejects_what_is_not_a_keras_model():
    with pytest.raises(TypeError, match=r"^parallel\(\) takes a keras.Model. Received: model=str$"):
        cnnpar.parallel("model")


def test_fit_without_strategy_is_plain_keras_fit_and_writes_no_logs(few_digits, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = few_digits[0][:128], few_digits[1][:128]
    keras.utils.set_random_seed(0)
    model = models.cnn("3+3")
    before = model.get_weights()
    history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    keras.utils.set_random_seed(0)
    keras_model = models.cnn("3+3")
    expected = keras.Model.fit(keras_model, x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert history.epoch == [0] and history.history.keys() == expected.history.keys()
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-6), name
    assert_same_step(keras_model, model, 1e-6, before=before)  # the same dropout masks: Keras's own steps
    assert list(tmp_path.iterdir()) == []


def test_run_file_name_follows_the_original_convention():
    assert runs.run_file_name("cnn2d_3layer_fullconnected_3layer", "single", 1) == \
        "cnn2d_3layer_fullconnected_3layer_keras_tensorflow_single_1dev.csv"
