"""``cnnpar plan`` and ``strategy="auto"``: measured trials, parity first, a cache, and the choice in the run's log."""

import itertools
import json
import math
import statistics
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_cnnpar as cnnpar
from keras_cnnpar.engine import fitting
from keras_cnnpar.plan import checks, planner
from keras_cnnpar.results import runs
from keras_cnnpar.strategies import memory
from tests.helpers import build_small_cnn, run_cli, two_inputs_two_outputs


class Slowed(cnnpar.Single):
    """Single, made slower on purpose: each step trains on 16 copies of its batch, the same gradient (its first step
    passes parity) for 16 times the work. Slower by construction, on any machine: about 10x here, so a trial of
    Single measured at another moment of the machine's load still ranks far above it."""

    def distribute(self, dataset):
        return super().distribute(dataset.map(lambda x, y: (tf.concat([x] * 16, 0), tf.concat([y] * 16, 0))))

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
    single_layout = memory.estimate(build_small_cnn(), cnnpar.Single(), 64)["total"] / 2**20  # each one's layout
    for trial in planted.trials:
        shares = [trial.compute, trial.communication, trial.input, trial.idle]
        assert not trial.error and sum(shares) == pytest.approx(1.0) and min(shares) >= 0.0
        assert trial.memory_estimate_mib == pytest.approx(single_layout)
        assert (trial.parity == "pass") == (trial.parity_difference <= checks.PARITY_TOLERANCE), trial
    single = next(t for t in planted.trials if t.configuration == "<Single devices=1>")
    assert single.speedup == 1.0 and single.communication == 0.0 and single.parity == "pass"


def test_data_parallel_communicates_where_single_does_not(few_digits):
    x, y = few_digits
    plan = planner.plan(build_small_cnn(), x, y, batch_size=64, candidates=[cnnpar.Single(), cnnpar.DataParallel(2)],
                        log=lambda line: None)
    single, mirrored = sorted(plan.trials, key=lambda t: t.devices)
    assert single.communication == 0.0 < mirrored.communication  # the replicas' gradients summed
    assert mirrored.parity == "pass" and mirrored.split == "trace"


class Clock(keras.callbacks.Callback):
    """The test's own clock: each epoch's steps and seconds."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps, self.start = 0, time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps = batch + 1  # Keras calls it once per ``steps_per_execution`` steps, with the last one's index

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((self.steps, time.perf_counter() - self.start))


def test_images_per_second_is_steps_times_the_batch_over_the_median_timed_epoch(few_digits, monkeypatch):
    """Against the test's own clock around every epoch of each trial's training (a contender, timed twice, keeps
    the mean of its two figures): the epoch that traces and the one profiled are left out."""
    timed, fit = {}, fitting.fit

    def clocked_fit(model, x, y, *, strategy, callbacks=(), **kwargs):
        clock = Clock()
        result = fit(model, x, y, strategy=strategy, callbacks=[*callbacks, clock], **kwargs)
        if kwargs["epochs"] == planner.TIMED_EPOCHS + 2:  # a trial's training, not the parity check's step
            assert [steps for steps, _ in clock.epochs] == [planner.TRIAL_STEPS] * (planner.TIMED_EPOCHS + 2)
            seconds = statistics.median(seconds for _, seconds in clock.epochs[1:-1])
            timed.setdefault(repr(strategy), []).append(planner.TRIAL_STEPS * kwargs["batch_size"] / seconds)
        return result

    monkeypatch.setattr(fitting, "fit", clocked_fit)
    x, y = few_digits
    plan = planner.plan(build_small_cnn(), x, y, batch_size=64, candidates=[cnnpar.Single(), cnnpar.DataParallel(2)],
                        log=lambda line: None)
    assert sorted(timed) == sorted(t.configuration for t in plan.trials)
    for trial in plan.trials:
        assert trial.images_per_second == pytest.approx(statistics.mean(timed[trial.configuration]), rel=0.05)


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
    assert [(t.error, t.parity) for t in plan.trials] == [("", "pass")] * 2
    assert max(t.parity_difference for t in plan.trials) <= checks.PARITY_TOLERANCE


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
    with monkeypatch.context() as patch:  # a cached plan trains nothing
        patch.setattr(planner, "_measure", lambda *args: pytest.fail("the cached plan was measured again"))
        again = planner.plan(build_small_cnn(), x, y, batch_size=64, devices=1, log=lambda line: None)
    assert again.cached and not first.cached
    assert [t.images_per_second for t in again.trials] == [t.images_per_second for t in first.trials]
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    other = planner.plan(build_small_cnn(), x, y, batch_size=32, devices=1, log=lambda line: None)
    assert not other.cached and len(list((tmp_path / "plans").glob("*.json"))) == 2
    planner.cache_path(first.key).write_text('{"trials": [{"configuration": "single"')  # cut short
    lines = []
    remeasured = planner.plan(build_small_cnn(), x, y, batch_size=64, devices=1, log=lines.append)
    assert not remeasured.cached and lines[0].startswith(f"plan: the cached plan {planner.cache_path(first.key)} "
                                                         f"is unreadable (JSONDecodeError")


@pytest.mark.parametrize("edit, figures", [({"images_per_second": -5.0}, "images_per_second -5.0"),
                                           ({"images_per_second": math.nan}, "images_per_second nan"),
                                           ({"compute": 1.5}, "compute 1.5")])
def test_a_cached_plan_with_figures_no_measurement_gives_is_measured_again(few_digits, tmp_path, monkeypatch, edit,
                                                                            figures):
    """docs/plan.md: a hand-edited cache (Single at -5 images/s, a NaN, a share above 1) is not what auto
    trains from."""
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path))
    x, y = few_digits
    first = planner.plan(build_small_cnn(), x, y, batch_size=64, devices=1, log=lambda line: None)
    path = planner.cache_path(first.key)
    cached = json.loads(path.read_text())
    cached["trials"][0].update(edit)
    path.write_text(json.dumps(cached))
    lines = []
    again = planner.plan(build_small_cnn(), x, y, batch_size=64, devices=1, log=lines.append)
    assert lines[0] == (f"plan: the cached plan {path} holds figures no measurement gives (single: {figures}); "
                        f"measuring again")
    assert not again.cached and again.trials[0].images_per_second > 0
    assert json.loads(path.read_text())["trials"][0]["images_per_second"] > 0  # the new measurement replaced it


def test_a_plan_cache_that_cannot_be_written_is_said_and_the_plan_still_used(few_digits, tmp_path, monkeypatch):
    """CNNPAR_CACHE naming a regular file: the plan is measured, said uncached in one line, and returned."""
    (tmp_path / "a-file").write_text("not a folder\n")
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path / "a-file"))
    lines = []
    plan = planner.plan(build_small_cnn(), *few_digits, batch_size=64, devices=1, log=lines.append)
    assert plan.trials[0].images_per_second > 0 and not plan.cached
    assert lines[-1] == (f"plan: could not cache the plan in {planner.cache_path(plan.key)}: Not a directory; it "
                         f"is used, not kept")


def test_fit_with_auto_trains_the_plans_choice_and_logs_it(few_digits, tmp_path, monkeypatch):
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(planner, "configurations", lambda devices, batch_size: [
        planner.Configuration("single"), planner.Configuration("mirrored", (("devices", 2),))])
    x, y = few_digits
    model = build_small_cnn()
    history = model.fit(x, y, batch_size=64, epochs=1, strategy="auto", results_dir=str(tmp_path / "results"),
                        verbose=0)
    trials = history.plan.trials
    assert sorted(t.configuration for t in trials) == ["mirrored devices=2", "single"]
    assert all(t.eligible for t in trials)
    best = max(trials, key=lambda t: t.images_per_second)  # the fastest of the table the plan reports
    assert (history.strategy.alias, history.strategy.num_devices) == (best.alias, best.devices)
    assert runs.read_csv(tmp_path / "results" / runs.RUNS_CSV)[0]["strategy"] == history.strategy.alias
    log = (tmp_path / "results" / runs.RESULTS_LOG).read_text()
    assert f"auto: chose {best.configuration} ({best.images_per_second:.0f} images/s" in log
    assert "runner-up" in log


def test_auto_chooses_the_fastest_configuration_that_passed_parity_and_fits_in_memory(few_digits, tmp_path,
                                                                                       monkeypatch):
    """Every configuration the registry offers on the 4 devices is tried (the test names none); their figures
    come through a seam: the test plants each trial's, so the fastest eligible one is known. The fastest failed
    parity, the next needs more memory than the machine has, the next failed to run: the fourth is chosen."""
    configurations = planner.configurations(4, 64)
    offered = [str(c) for c in configurations]
    speed = {label: 1000 * 1.5 ** rank for rank, label in enumerate(offered)}  # 50% apart: no contender re-timed
    *_, chosen, failed, too_large, wrong = offered
    tried = []

    def planted_trial(model, label, strategy, x, y, batch_size, precision):
        tried.append(label)
        trial = planner.Trial(label, strategy.alias, strategy.num_devices, images_per_second=speed[label],
                              compute=1.0, communication=0.0, input=0.0, idle=0.0, memory_estimate_mib=1.0,
                              parity="FAIL" if label == wrong else "pass", parity_difference=0.0)
        if label == too_large:
            trial.memory_estimate_mib = 2 * planner.device_memory_mib(4)
        if label == failed:
            trial.error = "ValueError: planted"
        return trial

    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(planner, "_trial", planted_trial)
    x, y = few_digits
    history = build_small_cnn().fit(x, y, batch_size=64, epochs=1, strategy="auto", verbose=0,
                                    results_dir=str(tmp_path / "results"))
    assert sorted(tried) == sorted(offered) and len(offered) > 4
    expected = configurations[offered.index(chosen)]
    assert history.strategy.alias == expected.alias
    assert {name: history.strategy.given_options[name] for name, _ in expected.options} == dict(expected.options)
    log = (tmp_path / "results" / runs.RESULTS_LOG).read_text()
    assert f"auto: chose {chosen} ({speed[chosen]:.0f} images/s" in log


def test_cnnpar_plan_prints_the_ranked_table_and_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path / "cache"))
    result = run_cli("plan", "--model", "2+2", "--devices", 1, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "auto would choose: single" in result.output
    (row,) = runs.read_csv(tmp_path / "plan.csv")
    (cached,) = (tmp_path / "cache" / "plans").glob("*.json")
    (trial,) = json.loads(cached.read_text())["trials"]  # the plan as measured
    assert row["configuration"] == "single" and float(row["images_per_second"]) == trial["images_per_second"]
    assert (row["speedup"], row["parity"]) == ("1.0", "pass")
    assert f"{'single':34s} {trial['images_per_second']:9.0f}   1.00x" in result.output  # the printed table's row
    assert (tmp_path / "plan.png").stat().st_size > 1000
    again = run_cli("plan", "--model", "2+2", "--devices", 1, "--out", tmp_path)
    assert again.exit_code == 2 and "plan.csv exists; pass --force" in again.output
    cached = run_cli("plan", "--model", "2+2", "--devices", 1, "--out", tmp_path, "--force")
    assert cached.exit_code == 0 and "(cached plan; --fresh measures again)" in cached.output


def test_a_plan_tries_every_configuration_the_docs_list_and_leaves_out_multi_worker():
    """docs/plan.md: single; mirrored; layers with 1, 2 and 4 micro-batches; channels; every hybrid mesh with both
    axes at least 2; async-ps with N workers; not multi-worker, whose workers are processes of their own."""
    assert [str(c) for c in planner.configurations(4, batch_size=64)] == [
        "single", "async-ps workers=4", "channels devices=4", "hybrid data=2 model=2",
        "layers devices=4 microbatches=1", "layers devices=4 microbatches=2", "layers devices=4 microbatches=4",
        "mirrored devices=4"]
    assert [str(c) for c in planner.configurations(2, batch_size=64)] == [
        "single", "async-ps workers=2", "channels devices=2", "layers devices=2 microbatches=1",
        "layers devices=2 microbatches=2", "layers devices=2 microbatches=4", "mirrored devices=2"]


def measured(alias, configuration=None, **figures):
    """A trial of ``alias`` that passed parity, with ``figures`` (the shares 0 unless given)."""
    return planner.Trial(configuration or alias, alias, 2, **{"images_per_second": 100.0, "parity": "pass",
                                                              "compute": 0.0, "communication": 0.0, "input": 0.0,
                                                              "idle": 0.0, **figures})


def test_each_rows_advice_follows_the_documented_thresholds():
    """docs/plan.md: communication above 25% of the step suggests accumulate=4 (fewer devices or a larger batch where
    the strategy takes no accumulate); devices idle above 30% the strategy's remedy; else compute-bound."""
    single = measured("single", compute=1.0, images_per_second=200.0)
    rows = [measured("mirrored", "comm 26%", communication=0.26, compute=0.74),
            measured("mirrored", "comm 24%", communication=0.24, compute=0.76),
            measured("channels", "channels comm 26%", communication=0.26, compute=0.74),
            measured("layers", "idle 31%", idle=0.31, compute=0.69),
            measured("layers", "idle 29%", idle=0.29, compute=0.71),
            measured("mirrored", "idle 31%, mirrored", idle=0.31, compute=0.69, images_per_second=300.0)]
    planner._relate([single, *rows])
    assert {t.configuration: t.advice for t in rows} == {
        "comm 26%": "communication is 26% of the step: try accumulate=4",
        "comm 24%": "compute-bound but slower than Single: these devices share the same cores or memory",
        "channels comm 26%": "communication is 26% of the step: try fewer devices or a larger batch",
        "idle 31%": "the devices are idle 31% of the step: try more micro-batches",
        "idle 29%": "compute-bound but slower than Single: these devices share the same cores or memory",
        "idle 31%, mirrored": "the devices are idle 31% of the step: try a larger batch"}
    assert single.advice == "compute-bound: the devices are busy"


def test_the_contenders_timed_again_are_the_eligible_trials_within_15_percent_of_the_fastest():
    """docs/plan.md: the eligible configurations within 15% of the fastest eligible one (CONTENDER_MARGIN)."""
    trials = [measured("single", images_per_second=1000.0), measured("mirrored", images_per_second=851.0),
              measured("channels", images_per_second=849.0),
              measured("layers", images_per_second=1300.0, parity="FAIL")]
    assert [t.configuration for t in planner.contenders(trials)] == ["single", "mirrored"]
    assert planner.contenders(trials[:1] + trials[2:]) == []  # one contender alone is not timed again


def test_cnnpar_plan_reads_its_cached_plan_and_fresh_measures_again(tmp_path, monkeypatch):
    """docs/cli.md: the plan is cached; `--fresh` measures again (batches of 8: each plan trains 56 steps)."""
    monkeypatch.setenv("CNNPAR_CACHE", str(tmp_path))
    first = run_cli("plan", "--model", "2+2", "--devices", 1, "--batch-size", 8)
    assert first.exit_code == 0 and "(cached plan" not in first.output, first.output
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    again = run_cli("plan", "--model", "2+2", "--devices", 1, "--batch-size", 8)
    assert again.exit_code == 0 and "(cached plan; --fresh measures again)" in again.output
    (cached,) = (tmp_path / "plans").glob("*.json")
    before = cached.read_text()
    fresh = run_cli("plan", "--model", "2+2", "--devices", 1, "--batch-size", 8, "--fresh")
    assert fresh.exit_code == 0 and "(cached plan" not in fresh.output, fresh.output
    assert cached.read_text() != before  # the new measurement replaced the cached plan: auto and plan read it next
