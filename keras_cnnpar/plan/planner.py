"""Choose a strategy by measuring them on the user's model and machine: ``cnnpar plan`` and ``strategy="auto"``.

Adding devices does not make training faster by itself; the way to know is to
measure. :func:`plan` tries every configuration the registry says can run on
the devices (alias, device split, micro-batches), each on a short trial of
the user's model and data:

1. the memory estimate per device (:mod:`keras_cnnpar.strategies.memory`);
2. the first-step gradient parity with Single (:mod:`keras_cnnpar.plan.checks`);
3. a few warm steps timed (the median of ``TIMED_EPOCHS`` epochs of
   ``TRIAL_STEPS`` steps, after one that traces the functions; the
   :func:`contenders` for first place are timed twice), then one more
   epoch traced with TensorFlow's profiler to
   split the step into compute, communication, input and idle
   (:mod:`keras_cnnpar.plan.timesplit`; for ``async-ps``, whose steps run in other
   processes, compute is Single's traced compute per batch and the rest of a
   worker's step counts as communication, marked ``estimate``), and the
   allocator's peak where the devices share this process's (CPU).

The table is ranked by images/s; one line of advice per row says what to try.
:func:`choose` (``fit(strategy="auto")``) takes the fastest configuration whose
parity passed and whose estimate fits the devices' memory. Plans are cached per
(model and compile fingerprint, devices, machine, global batch, precision,
versions) in ``$CNNPAR_CACHE`` (default ``~/.cache/keras_cnnpar``), so a
second ``plan`` or ``auto`` is instant.

Example:

>>> import keras_cnnpar as cnnpar
>>> [str(c) for c in configurations(2, batch_size=64)]  # doctest: +NORMALIZE_WHITESPACE
['single', 'async-ps workers=2', 'channels devices=2', 'layers devices=2 microbatches=1',
 'layers devices=2 microbatches=2', 'layers devices=2 microbatches=4', 'mirrored devices=2']
>>> [str(c) for c in configurations(4, batch_size=64) if c.alias == "hybrid"]
['hybrid data=2 model=2']
"""

import collections.abc
import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar import __version__, strategies
from keras_cnnpar.engine import fitting
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.plan import checks, figures, timesplit
from keras_cnnpar.results import provenance
from keras_cnnpar.runtime import devices as device_lib
from keras_cnnpar.runtime.atomic import write_atomic
from keras_cnnpar.strategies import memory, registry

#: Steps of a trial's epoch: one epoch traces the functions, ``TIMED_EPOCHS`` are timed, one more is profiled.
TRIAL_STEPS = 8
#: Timed epochs of a trial; its images/s is their median.
TIMED_EPOCHS = 5
#: Distinct batches a trial reads: a new one for every step.
TRIAL_BATCHES = TRIAL_STEPS * (TIMED_EPOCHS + 2)
#: Eligible configurations within this fraction of the fastest one are timed once more, in the reverse order, and
#: keep the mean of their two figures: the fastest of several noisy trials reads high by selection (docs/plan.md).
CONTENDER_MARGIN = 0.15
#: Communication share above which a row's advice is to communicate less (the original project's 20-30%).
COMMUNICATION_ADVICE = 0.25
#: Idle share above which a row's advice is to keep the devices busier.
IDLE_ADVICE = 0.3
#: The columns of ``plan.csv``.
COLUMNS = ("configuration", "images_per_second", "speedup", "compute", "communication", "input", "idle", "split",
           "memory_estimate_mib", "memory_measured_mib", "parity", "parity_difference", "advice", "error")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """A strategy alias and the options that place it on the devices."""

    alias: str
    options: tuple = ()

    def strategy(self):
        """A new strategy object of this configuration."""
        return strategies.create(self.alias, **dict(self.options))

    def __str__(self):
        return " ".join([self.alias, *(f"{name}={value}" for name, value in self.options)])


def configurations(devices, batch_size):
    """Every configuration the registered strategies offer on ``devices`` devices (each says which,
    ``Strategy.configurations``), in the order they are tried: Single first, then by name."""
    ordered = sorted(registry.entries(), key=lambda entry: (entry.alias != "single", entry.alias))
    return [Configuration(entry.alias, options) for entry in ordered
            for options in entry.load().configurations(devices, batch_size)]


@dataclasses.dataclass
class Trial:
    """One configuration's measured figures (shares of the step; bytes as MiB); ``error`` when it failed."""

    configuration: str
    alias: str
    devices: int
    images_per_second: float = math.nan
    speedup: float = math.nan
    compute: float = math.nan
    communication: float = math.nan
    input: float = math.nan
    idle: float = math.nan
    split: str = "trace"
    memory_estimate_mib: float = math.nan
    memory_measured_mib: float = math.nan
    parity: str = "n/a"
    parity_difference: float = math.nan
    advice: str = ""
    error: str = ""

    @property
    def impossible(self):
        """What no measurement gives in a trial that ran (a hand-edited or damaged cache), or "".

        >>> Trial("single", "single", 1, images_per_second=-5.0, speedup=1.0).impossible
        'images_per_second -5.0'
        """
        if self.error:
            return ""
        bad = [] if 0 < self.images_per_second < math.inf else [f"images_per_second {self.images_per_second}"]
        bad += [] if math.isnan(self.speedup) or 0 < self.speedup < math.inf else [f"speedup {self.speedup}"]
        shares = {name: getattr(self, name) for name in ("compute", "communication", "input", "idle")}
        bad += [f"{name} {share}" for name, share in shares.items() if not (math.isnan(share) or 0 <= share <= 1)]
        return ", ".join(bad)

    @property
    def eligible(self):
        """Whether ``auto`` may choose it: it trained and its first step is Single's."""
        return not self.error and self.parity == "pass"


@dataclasses.dataclass
class Plan:
    """The trials of one plan, fastest first, and where it is cached."""

    key: dict
    trials: list
    cached: bool = False

    def best(self, memory_limit_mib=math.inf):
        """The fastest eligible trial whose memory estimate fits ``memory_limit_mib``, or None."""
        fits = [t for t in self.trials if t.eligible and not t.memory_estimate_mib > memory_limit_mib]
        return max(fits, key=lambda t: t.images_per_second, default=None)

    def table(self):
        """The ranked table as text, one row per configuration."""
        header = (f"{'configuration':34s} {'images/s':>9s} {'speedup':>7s} {'compute':>7s} {'comm':>5s} "
                  f"{'input':>5s} {'idle':>5s} {'split':8s} {'MiB est':>7s} {'MiB run':>7s} parity")
        lines = [header]
        for t in self.trials:
            if t.error:
                lines.append(f"{t.configuration:34s} failed: {t.error}")
                continue
            lines.append(f"{t.configuration:34s} {t.images_per_second:9.0f} {t.speedup:6.2f}x {t.compute:7.0%} "
                         f"{t.communication:5.0%} {t.input:5.0%} {t.idle:5.0%} {t.split:8s} "
                         f"{t.memory_estimate_mib:7.1f} {_mib(t.memory_measured_mib):>7s} {t.parity} "
                         f"({t.parity_difference:.1g})")
            lines.append(f"{'':34s} {t.advice}")
        return "\n".join(lines)


def plan(model, x, y, *, batch_size=64, devices=None, precision="float32", candidates=None, cache=True,
         fresh=False, log=print):
    """Measure every configuration on ``devices`` devices (default: all logical devices) and rank them.

    Args:
        model: a compiled Keras model (it is not trained: each trial trains a copy).
        x, y: the training data as ``fit`` takes it (arrays, or lists or dicts of them; or a batched
            ``tf.data.Dataset`` or a ``keras.utils.PyDataset`` as ``x``; not a generator, whose batches read
            here would be lost to training); a trial reads ``TRIAL_BATCHES`` batches of them (repeated where
            there are fewer), shuffled as a run's pipeline shuffles.
        batch_size: the global batch.
        precision: as in ``cnnpar.fit``.
        candidates: strategy objects to try instead of :func:`configurations`'s.
        cache: read and write the plan cache (``candidates`` given: never cached).
        fresh: measure again where a cached plan exists, and cache the new plan in its place (``cnnpar plan
            --fresh``): the next ``plan`` and ``strategy="auto"`` read it.
        log: called with each line of progress.
    """
    devices = devices or len(device_lib.logical_names())
    key = _cache_key(model, devices, batch_size, precision)
    path = cache_path(key)
    cached = _cached(key, path, log) if cache and not fresh and candidates is None else None
    if cached:
        return cached
    x, y = _trial_data(x, y, batch_size)
    with keras.saving.custom_object_scope(rebuild.custom_objects(model)):  # a plain function as the loss
        trials = _measure(model, _labelled(candidates, devices, batch_size), x, y, batch_size, precision, log)
    _relate(trials)
    trials.sort(key=lambda t: -t.images_per_second if not t.error else math.inf)
    result = Plan(key, trials)
    if cache and candidates is None:
        _keep(result, path, log)
    return result


def _cached(key, path, log):
    """The plan cached at ``path``; None where there is none, or (said to ``log``) where it is unreadable or
    holds a trial that no measurement gives: it is measured again."""
    try:
        trials = [Trial(**t) for t in json.loads(path.read_text())["trials"]]
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, TypeError, KeyError) as error:  # written by another version, damaged, or locked
        log(f"plan: the cached plan {path} is unreadable ({type(error).__name__}: {error}); measuring again")
        return None
    impossible = next((t for t in trials if t.impossible), None)
    if impossible:
        log(f"plan: the cached plan {path} holds figures no measurement gives ({impossible.configuration}: "
            f"{impossible.impossible}); measuring again")
        return None
    return Plan(key, trials, cached=True)


def _keep(result, path, log):
    """Cache ``result`` at ``path``, all or nothing; where the cache cannot be written, ``log`` says so and the
    plan is used uncached."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": result.key, "trials": [dataclasses.asdict(t) for t in result.trials]},
                                      indent=1))
    except OSError as error:
        log(f"plan: could not cache the plan in {path}: {os.strerror(error.errno) if error.errno else error}; "
            f"it is used, not kept")


def _measure(model, labelled, x, y, batch_size, precision, log):
    """A trial of every strategy in ``labelled`` (label -> strategy); the contenders timed once more."""
    trials = []
    for label, strategy in labelled.items():
        log(f"plan: trying {label}")
        trials.append(_trial(model, label, strategy, x, y, batch_size, precision))
    for trial in reversed(contenders(trials)):
        log(f"plan: timing {trial.configuration} again")
        try:
            again = _images_per_second(model, labelled[trial.configuration], x, y, batch_size, precision)
        except Exception as error:  # it ran once: its first figure stands
            log(f"plan: {trial.configuration} failed when timed again ({type(error).__name__}); its first figure "
                f"stands")
            continue
        trial.images_per_second = (trial.images_per_second + again) / 2
    return trials


def choose(model, x, y, *, batch_size=64, devices=None, precision="float32", candidates=None, log=print):
    """``strategy="auto"``: the plan (see :func:`plan`), and the strategy of its best eligible trial (Single when
    none is). The choice and the runner-up go to ``log`` with their figures."""
    devices = devices or len(device_lib.logical_names())
    result = plan(model, x, y, batch_size=batch_size, devices=devices, precision=precision, candidates=candidates,
                  log=log)
    ranked = [t for t in result.trials if t.eligible]
    best = result.best(memory_limit_mib=device_memory_mib(devices))
    chosen = best.configuration if best else "single"
    runner_up = next((t for t in ranked if t is not best), None)
    log(f"auto: chose {chosen}" + (f" ({best.images_per_second:.0f} images/s, {best.speedup:.2f}x single)"
                                   if best else " (no configuration passed parity)")
        + (f"; runner-up {runner_up.configuration} ({runner_up.images_per_second:.0f} images/s)"
           if runner_up else "") + (" [cached plan]" if result.cached else ""))
    return _labelled(candidates, devices, batch_size).get(chosen) or _parse(chosen).strategy(), result


def save(result, folder):
    """Write ``plan.csv`` (one row per configuration) and ``plan.png`` (images/s, and each step's time split)
    into ``folder``, both or neither (:func:`figures.write_table_and_figure`)."""
    measured = [t for t in result.trials if not t.error]
    labels = [t.configuration.replace(" ", "\n", 1) for t in measured]
    figure, (speed, split) = figures.pyplot().subplots(1, 2, figsize=(12, 4))
    speed.bar(labels, [t.images_per_second for t in measured],
              color=["tab:blue" if t.eligible else "tab:gray" for t in measured])
    speed.set(title="images/s (gray: parity not passed)", ylabel="images/s")
    bottom = np.zeros(len(measured))
    for kind in timesplit.KINDS:
        values = np.array([getattr(t, kind) for t in measured])
        split.bar(labels, values, bottom=bottom, label=kind)
        bottom += values
    split.set(title="where the step's time goes", ylabel="share of the devices' time")
    split.legend(fontsize=7)
    for axis in (speed, split):
        axis.tick_params(axis="x", labelsize=6)
    figure.tight_layout()
    figures.write_table_and_figure(folder, "plan", COLUMNS, [dataclasses.asdict(t) for t in result.trials], figure)


def cache_path(key):
    """The cache file of the plan identified by ``key``."""
    folder = Path(os.environ.get("CNNPAR_CACHE") or Path.home() / ".cache" / "keras_cnnpar") / "plans"
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"{digest}.json"


def fingerprint(model):
    """A digest of ``model``'s architecture and compile settings that every build of the same model shares: the
    names in its config (Keras numbers layers anew in every build) are replaced by their order of appearance.

    >>> import keras_cnnpar as cnnpar
    >>> fingerprint(cnnpar.models.cnn("2+2")) == fingerprint(cnnpar.models.cnn("2+2")) != fingerprint(
    ...     cnnpar.models.cnn("3+3"))
    True
    """
    text = model.to_json() + json.dumps(model.get_compile_config(), sort_keys=True, default=str)
    for index, name in enumerate(dict.fromkeys(re.findall(r'"name": "([^"]+)"', text))):
        text = text.replace(f'"{name}"', f'"#{index}"')
    return hashlib.sha1(text.encode()).hexdigest()


def _cache_key(model, devices, batch_size, precision):
    return {"model": fingerprint(model), "devices": device_lib.logical_names()[:devices],
            "machine": provenance.machine(), "global_batch": batch_size, "precision": precision,
            "version": __version__, "tensorflow": tf.__version__}


def _trial_data(x, y, batch_size):
    """``TRIAL_BATCHES`` global batches of ``(x, y)``, repeated where there are fewer: arrays, or tuples or dicts
    of them for a model of several inputs or outputs, read from arrays, a batched ``tf.data.Dataset`` or a
    ``keras.utils.PyDataset`` (sample weights left out). A generator is refused: what a trial reads of it would
    be lost to training."""
    wanted = TRIAL_BATCHES * batch_size
    if isinstance(x, keras.utils.PyDataset):
        x, y = _read_batches((x[index] for index in range(len(x))), wanted)
    elif isinstance(x, tf.data.Dataset):
        x, y = _read_batches(x.as_numpy_iterator(), wanted)
    elif isinstance(x, collections.abc.Iterator):
        raise ValueError("strategy='auto' measures each strategy on batches it reads first, and a generator's "
                         "batches read there would be lost to training; give the batches as a "
                         "keras.utils.PyDataset or a tf.data.Dataset, or choose a strategy. Received: x of type "
                         f"{type(x).__name__}")
    x, y = fitting.arrays(x), fitting.arrays(y)
    index = np.arange(wanted) % len(tf.nest.flatten(x)[0])
    return tf.nest.map_structure(lambda leaf: leaf[index], (x, y))


def _read_batches(batches, wanted):
    """``(x, y)`` of the first batches of ``batches`` that hold ``wanted`` examples (or of all), concatenated."""
    read, examples = [], 0
    for batch in batches:
        read.append(tuple(batch)[:2])
        examples += len(tf.nest.flatten(batch)[0])
        if examples >= wanted:
            break
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *read)


def _first(data, count):
    """The first ``count`` examples of ``data`` (an array, or a tuple or dict of them)."""
    return tf.nest.map_structure(lambda leaf: leaf[:count], data)


def _labelled(candidates, devices, batch_size):
    """The strategies to try by label: ``candidates`` under their ``repr``, else :func:`configurations`'s."""
    if candidates is not None:
        return {repr(strategy): strategy for strategy in candidates}
    return {str(c): c.strategy() for c in configurations(devices, batch_size)}


def _trial(model, label, strategy, x, y, batch_size, precision):
    """Measure ``strategy`` on a copy of ``model``: memory estimate, parity, images/s, time split, peak memory."""
    trial = Trial(label, strategy.alias, strategy.num_devices)
    try:
        trial.memory_estimate_mib = memory.estimate(model, strategy, batch_size, precision)["total"] / 2**20
        trial.parity, trial.parity_difference = _parity(model, strategy, *_first((x, y), batch_size))
        traces = strategy.steps_run_here  # async-ps: its steps run in other processes
        folder = Path(tempfile.mkdtemp(prefix="cnnpar-plan-"))
        timer = _TrialTimer(folder if traces else None, strategy.num_devices)
        try:
            trial.images_per_second = _images_per_second(model, strategy, x, y, batch_size, precision, timer)
            trial.memory_measured_mib = timer.peak_bytes_per_device / 2**20 \
                if traces and timer.peak_bytes_per_device else math.nan
            if traces:
                split = timesplit.split(folder, timer.seconds[-1], strategy.num_devices, model.optimizer.name,
                                        one_device=strategy.num_devices == 1)
                trial.compute, trial.communication, trial.input, trial.idle = (split[k] for k in timesplit.KINDS)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    except Exception as error:  # a configuration that cannot run is a row of the plan, not the end of it
        trial.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        print(f"plan: {trial.configuration} failed: {error}", file=sys.stderr)
    return trial


def _images_per_second(model, strategy, x, y, batch_size, precision, timer=None, steps=TRIAL_STEPS):
    """Train a copy of ``model`` under ``strategy`` for a trial's epochs of ``steps`` steps; the median images/s of
    the timed ones (a step of a strategy that accumulates trains on ``accumulate`` global batches)."""
    timer = timer or _TrialTimer(devices=strategy.num_devices)
    copy = rebuild.rebuild(model, scope=contextlib.nullcontext())
    fitting.fit(copy, x, y, strategy=strategy, batch_size=batch_size, epochs=TIMED_EPOCHS + 2,
                steps_per_epoch=steps, verbose=0, results_dir=None, precision=precision, callbacks=[timer])
    return steps * batch_size * strategy.accumulate / statistics.median(timer.seconds[1:-1])


def trial_images_per_second(model, strategy, x, y, *, batch_size=64, precision="float32", steps=TRIAL_STEPS):
    """The images/s of ``strategy`` training a copy of ``model`` on ``x``, ``y`` as a trial times it: the median of
    its timed epochs, of ``steps`` steps each (more for a strategy whose cycle is longer, as local steps')."""
    x, y = _trial_data(x, y, batch_size * strategy.accumulate * math.ceil(steps / TRIAL_STEPS))
    return _images_per_second(model, strategy, x, y, batch_size, precision, steps=steps)


def single_step_seconds(model, x, y, *, batch_size=64, precision="float32"):
    """Seconds of one training step of the global batch under Single on this machine, as a trial times it: one
    host's step in :mod:`keras_cnnpar.plan.scaling`'s predictions."""
    return batch_size / trial_images_per_second(model, strategies.Single(), x, y, batch_size=batch_size,
                                                precision=precision)


def contenders(trials):
    """The eligible trials within ``CONTENDER_MARGIN`` of the fastest eligible one, when there are two or more.

    >>> trials = [Trial("single", "single", 1, images_per_second=1000.0, parity="pass"),
    ...           Trial("mirrored devices=2", "mirrored", 2, images_per_second=900.0, parity="pass"),
    ...           Trial("channels devices=2", "channels", 2, images_per_second=700.0, parity="pass"),
    ...           Trial("layers devices=2 microbatches=2", "layers", 2, images_per_second=1200.0, parity="FAIL")]
    >>> [t.configuration for t in contenders(trials)]  # the 1,200 failed parity: 1,000 leads
    ['single', 'mirrored devices=2']
    """
    eligible = [t for t in trials if t.eligible]
    fastest = max((t.images_per_second for t in eligible), default=0.0)
    near = [t for t in eligible if t.images_per_second >= (1 - CONTENDER_MARGIN) * fastest]
    return near if len(near) > 1 else []


def _parity(model, strategy, x, y):
    """The first-step gradient parity verdict with Single and the difference (``n/a`` where no probe runs)."""
    check = checks.GradientParityCheck(model, strategy, x, y)
    check.on_train_begin()
    verdict = "FAIL" if check.verdict.startswith("FAIL") else check.verdict
    return verdict, check.difference


def _relate(trials):
    """Fill each trial's speedup over the first Single trial, async-ps's estimated split, and the advice."""
    single = next((t for t in trials if t.alias == "single" and not t.error), None)
    for trial in trials:
        if trial.error:
            continue
        if single is not None:
            trial.speedup = trial.images_per_second / single.images_per_second
        if math.isnan(trial.compute) and single is not None:  # async-ps: its steps ran in other processes
            trial.compute = min(single.compute * trial.speedup / trial.devices, 1.0)
            trial.communication, trial.input, trial.idle, trial.split = 1.0 - trial.compute, 0.0, 0.0, "estimate"
        trial.advice = _advice(trial)


def _advice(trial):
    """One line: what the row's figures suggest trying."""
    if trial.parity == "FAIL":
        return f"its first step differs from Single's by {trial.parity_difference:.2g}: never chosen"
    alias = trial.alias
    if trial.communication > COMMUNICATION_ADVICE:
        if strategies.accepts(alias, "accumulate"):
            return f"communication is {trial.communication:.0%} of the step: try accumulate=4"
        return f"communication is {trial.communication:.0%} of the step: try fewer devices or a larger batch"
    if trial.idle > IDLE_ADVICE:
        return f"the devices are idle {trial.idle:.0%} of the step: try {registry.entry(alias).load().idle_remedy}"
    if trial.speedup < 1:
        return "compute-bound but slower than Single: these devices share the same cores or memory"
    return "compute-bound: the devices are busy"


def _parse(label):
    """The :class:`Configuration` of a label written by ``str(configuration)``."""
    alias, *options = label.split()
    return Configuration(alias, tuple((name, int(value)) for name, value in (o.split("=") for o in options)))


def device_memory_mib(devices):
    """Memory per device: a GPU's total, else this machine's memory shared by the logical CPU devices."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return details.get("device_memory_size", math.inf) / 2**20 if details else math.inf
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 / max(devices, 1)
    return math.inf


def _mib(value):
    return "n/a" if math.isnan(value) else f"{value:.1f}"


class _TrialTimer(keras.callbacks.Callback):
    """Times each epoch of a trial; with a ``folder``, the last runs under the profiler, its trace written there.

    ``peak_bytes_per_device``: the allocator's peak during the timed epochs above what was in use when the trial
    began (0 where the device reports no figures), per device: on GPUs the largest of the first ``devices``
    GPUs' own peaks; on a CPU, whose one allocator serves every logical CPU device, its peak divided by the
    devices (an average: the devices' peaks need not fall at the same moment, docs/plan.md). The first epoch,
    which traces the functions, and the profiled one are left out: their one-time buffers made the same
    trial's figure vary by a third between runs.
    """

    TRACED_EPOCH = TIMED_EPOCHS + 1

    def __init__(self, folder=None, devices=1):
        super().__init__()
        self.folder, self.seconds, self.trace = folder, [], contextlib.ExitStack()
        self.gpus = [f"GPU:{index}" for index in range(len(tf.config.list_logical_devices("GPU")))][:devices]
        self.allocators, self.devices = self.gpus or ["CPU:0"], devices
        self.base, self.peak_bytes_per_device = None, 0

    def on_train_begin(self, logs=None):
        gc.collect()  # the previous trial's model and functions, freed later, would lower the peak below the base
        with contextlib.suppress(ValueError, RuntimeError):  # a device without memory figures
            self.base = {name: tf.config.experimental.get_memory_info(name)["current"] for name in self.allocators}

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1 and self.base is not None:
            for name in self.allocators:
                tf.config.experimental.reset_memory_stats(name)
        if epoch == self.TRACED_EPOCH and self.folder is not None:
            self.trace.enter_context(timesplit.traced(self.folder))
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)
        self.trace.close()
        if epoch == TIMED_EPOCHS and self.base is not None:
            peaks = [max(tf.config.experimental.get_memory_info(name)["peak"] - self.base[name], 0)
                     for name in self.allocators]
            self.peak_bytes_per_device = max(peaks) if self.gpus else peaks[0] / self.devices
