"""``cnnpar plan`` and ``strategy="auto"``: measured trials, parity first, a cache, and the choice in the run's log."""

import itertools
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.plan import planner
from keras_cnnpar.results import runs
from tests.helpers import build_small_cnn, run_cli, two_inputs_two_outputs


class Sleep(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        time.sleep(0.5)


class Slowed(cnnpar.Single):
    """Single, made slower on purpose: every epoch of its training waits half a second more."""

    def prepare(self, model, settings=None):
        run = super().prepare(model, settings)
        fit = run.fit
        object.__setattr__(run, "fit", lambda train, callbacks=(), **kwargs: fit(
            train, callbacks=[*callbacks, Sleep()], **kwargs))
        return run

    def __repr__(self):
        return "<Slowed single>"


class HalfBatch(cnnpar.Single):
    """Single with a planted bug: each step trains on the first half of its batch only (faster, and wrong)."""

    def distribute(self, dataset):
        return super().distribute(dataset.map(lambda x, y: (x[:tf.shape(x)[0] // 2], y[:tf.shape(y)[0] // 2])))

    def __repr__(self):
        return "<HalfBatch single>"


@pytest.fixture(scope="module")
def planted(few_digits):
    """One plan of Single, the slowed Single and the half-batch Single."""
    x, y = few_digits
    return planner.plan(build_small_cnn(), x, y, batch_size=64, candidates=[cnnpar.Single(), Slowed(), HalfBatch()],
                        log=lambda line: None)


def test_a_planted_slow_configuration_is_never_chosen(planted):
    by_name = {t.configuration: t for t in planted.trials}
    assert by_name["<Slowed single>"].images_per_second < 0.8 * by_name["<Single devices=1>"].images_per_second
    assert planted.best().configuration == "<Single devices=1>"


def test_a_planted_parity_failure_is_never_chosen_however_fast(few_digits, planted):
    by_name = {t.configuration: t for t in planted.trials}
    wrong = by_name["<HalfBatch single>"]
    assert wrong.parity == "FAIL" and wrong.parity_difference > 1e-3
    assert wrong.images_per_second > by_name["<Slowed single>"].images_per_second  # the faster of the two
    assert "never chosen" in wrong.advice
    x, y = few_digits
    slowed = Slowed()
    chosen, _ = planner.choose(build_small_cnn(), x, y, batch_size=64, candidates=[slowed, HalfBatch()],
                               log=lambda line: None)
    assert chosen is slowed


def test_every_trial_has_its_figures_and_the_split_sums_to_one(planted):
    for trial in planted.trials:
        shares = [trial.compute, trial.communication, trial.input, trial.idle]
        assert not trial.error and sum(shares) == pytest.approx(1.0) and min(shares) >= 0.0
        assert trial.memory_estimate_mib > 0 and trial.parity_difference >= 0
    single = next(t for t in planted.trials if t.configuration == "<Single devices=1>")
    assert single.speedup == 1.0 and single.communication == 0.0 and single.parity == "pass"


def test_data_parallel_communicates_where_single_does_not(few_digits):
    x, y = few_digits
    plan = planner.plan(build_small_cnn(), x, y, batch_size=64, candidates=[cnnpar.Single(), cnnpar.DataParallel(2)],
                        log=lambda line: None)
    single, mirrored = sorted(plan.trials, key=lambda t: t.devices)
    assert single.communication == 0.0 < mirrored.communication  # the replicas' gradients summed
    assert mirrored.parity == "pass" and mirrored.split == "trace"


class Batches(keras.utils.PyDataset):
    """Batches of 32 of ``(x, y)``, which may be lists of arrays."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y[0]) // 32

    def __getitem__(self, index):
        rows = slice(32 * index, 32 * (index + 1))
        return [part[rows] for part in self.x], [part[rows] for part in self.y]


@pytest.mark.parametrize("data", ["arrays", "py_dataset"])
def test_a_model_of_several_inputs_and_outputs_is_planned(few_digits, data):
    """numpy failed on a list of inputs or outputs and on a PyDataset ("inhomogeneous shape"), and the parity
    check took ``len(x)`` of several inputs (2) as the batch: 32 steps of 2 examples against one of 64, "FAIL"
    under every strategy, Single's own included."""
    images, labels = few_digits[0][:128], few_digits[1][:128]
    x = [images, np.random.default_rng(0).normal(size=(128, 4)).astype(np.float32)]
    y = [labels, (labels % 2).astype(np.float32)]
    x, y = (x, y) if data == "arrays" else (Batches(x, y), None)
    plan = planner.plan(two_inputs_two_outputs(), x, y, batch_size=64, cache=False, log=lambda line: None,
                        candidates=[cnnpar.Single(), cnnpar.DataParallel(2)])
    assert [(t.parity, t.images_per_second > 0) for t in plan.trials] == [("pass", True)] * 2


def test_auto_refuses_to_read_a_generator_whose_batches_training_would_lose(few_digits):
    batches = ((few_digits[0][:64], few_digits[1][:64]) for _ in itertools.count())
    with pytest.raises(ValueError) as raised:
        planner.plan(build_small_cnn(), batches, None, batch_size=64, cache=False, log=lambda line: None)
    assert str(raised.value) == (
        "strategy='auto' measures each strategy on batches it reads first, and a generator's batches read there "
        "would be lost to training; give the batches as a keras.utils.PyDataset or a tf.data.Dataset, or choose a "
        "strategy. Received: x of type generator")


def test_a_plan_is_cached_per_model_batch_and_devices(few_digits, tmp_path, monkeypatch):
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path))
    x, y = few_digits
    first = planner.plan(build_small_cnn(), x, y, batch_size=64, devices=1, log=lambda line: None)
    started = time.perf_counter()
    again = planner.plan(build_small_cnn(), x, y, batch_size=64, devices=1, log=lambda line: None)
    assert again.cached and not first.cached and time.perf_counter() - started < 1.0
    assert [t.images_per_second for t in again.trials] == [t.images_per_second for t in first.trials]
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    other = planner.plan(build_small_cnn(), x, y, batch_size=32, devices=1, log=lambda line: None)
    assert not other.cached and len(list((tmp_path / "plans").glob("*.json"))) == 2
    planner.cache_path(first.key).write_text('{"trials": [{"configuration": "single"')  # cut short
    lines = []
    remeasured = planner.plan(build_small_cnn(), x, y, batch_size=64, devices=1, log=lines.append)
    assert not remeasured.cached and lines[0].startswith(f"plan: the cached plan {planner.cache_path(first.key)} "
                                                         f"is unreadable (JSONDecodeError")


def test_fit_with_auto_trains_the_plans_choice_and_logs_it(few_digits, tmp_path, monkeypatch):
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(planner, "configurations", lambda devices, batch_size: [
        planner.Configuration("single"), planner.Configuration("mirrored", (("devices", 2),))])
    x, y = few_digits
    model = build_small_cnn()
    history = model.fit(x, y, batch_size=64, epochs=1, strategy="auto", results_dir=str(tmp_path / "results"),
                        verbose=0)
    best = history.plan.best()
    assert best.configuration in ("single", "mirrored devices=2")
    assert history.strategy.alias == best.configuration.split()[0]
    assert runs.read_csv(tmp_path / "results" / runs.RUNS_CSV)[0]["strategy"] == history.strategy.alias
    log = (tmp_path / "results" / runs.RESULTS_LOG).read_text()
    assert f"auto: chose {best.configuration} ({best.images_per_second:.0f} images/s" in log
    assert "runner-up" in log


def test_cnnpar_plan_prints_the_ranked_table_and_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path / "cache"))
    result = run_cli("plan", "--model", "2+2", "--devices", 1, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "auto would choose: single" in result.output
    rows = runs.read_csv(tmp_path / "plan.csv")
    assert [r["configuration"] for r in rows] == ["single"] and float(rows[0]["images_per_second"]) > 0
    assert (tmp_path / "plan.png").stat().st_size > 1000
    again = run_cli("plan", "--model", "2+2", "--devices", 1, "--out", tmp_path)
    assert again.exit_code == 2 and "plan.csv exists; pass --force" in again.output
    cached = run_cli("plan", "--model", "2+2", "--devices", 1, "--out", tmp_path, "--force")
    assert cached.exit_code == 0 and "(cached plan; --fresh measures again)" in cached.output
