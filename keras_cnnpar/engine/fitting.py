"""One training run once its strategy is known: prepare, fit, finalize, log (the work of ``cnnpar.fit``).

The checks and the planner train through it, so ``cnnpar.fit`` (which may
plan first, for ``strategy="auto"``) sits above them.

>>> import keras_cnnpar as cnnpar
>>> digits = cnnpar.data.load()
>>> fit(cnnpar.models.cnn("2+2"), digits.x[:64], digits.y[:64], batch_size=64, strategy="single",
...     results_dir=None, verbose=0).strategy
<Single devices=1>
"""

import collections.abc
import contextlib
import hashlib
import math
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar import strategies
from keras_cnnpar.engine.hold import HoldBetweenEpochs
from keras_cnnpar.engine.text_logs import TextLogs
from keras_cnnpar.engine.user_callbacks import UserModelCallbacks, chief_writes
from keras_cnnpar.keras_compat import graph
from keras_cnnpar.results import callbacks as callback_lib
from keras_cnnpar.results import provenance, runs
from keras_cnnpar.runtime import hardware
from keras_cnnpar.strategies import arguments
from keras_cnnpar.zoo import data as data_lib


def fit(model, x=None, y=None, *, strategy="single", results_dir="results", batch_size=None, epochs=1,
        validation_data=None, validation_split=0.0, shuffle=True, callbacks=None, initial_epoch=0, resume=False,
        precision="float32", fused_optimizer=True, note=None, save_weights=False, **fit_kwargs):
    """``cnnpar.fit`` with a strategy object or alias (not ``"auto"``); ``note`` is a line for the run's log
    ahead of the strategy's report. See :func:`keras_cnnpar.api.fit`."""
    check_model(model)
    precision = _hardware_precision(precision)
    strategy = strategies.resolve(strategy)
    if resume and not strategy.keeps_checkpoints:
        raise ValueError(f"strategy {strategy.alias!r} keeps no checkpoint to resume; resume is for "
                         f"{strategies.names(keeps_checkpoints=True)}. Received: resume={resume!r}")
    x, validation_data = (data_lib.python_batches(data) if _python_batches(data) else data
                          for data in (x, validation_data))
    batch_size = 32 if batch_size is None and not isinstance(x, tf.data.Dataset) else batch_size
    weights = {"sample_weight": fit_kwargs.pop("sample_weight", None),
               "class_weight": fit_kwargs.pop("class_weight", None)}
    validation_batch_size = fit_kwargs.pop("validation_batch_size", None)
    train, validation, steps, samples = _inputs(
        x, y, batch_size, validation_data, validation_split, shuffle, strategy, given_steps=fit_kwargs,
        validation_batch_size=validation_batch_size, **weights)
    if samples is not None and fit_kwargs.get("steps_per_epoch"):
        samples = fit_kwargs["steps_per_epoch"] * batch_size
    fit_kwargs = {**steps, **fit_kwargs}
    if not model.built:
        model.build(train.element_spec[0].shape)
    data = _data_identity(x if isinstance(x, tf.data.Dataset) else y)
    settings = strategies.RunSettings(
        precision=precision, fused_optimizer=bool(fused_optimizer), resume=bool(resume) or strategy.resume,
        record=_run_record(model, strategy, batch_size, precision, data) if strategy.keeps_checkpoints else {})
    run = strategy.prepare(model, settings)
    with (contextlib.closing(run),  # its processes and temporary files end with this call, failed or not
          chief_writes(callbacks, strategy.is_chief) as callbacks):
        _fit_whole_chunks(run.model, fit_kwargs.get("steps_per_epoch"), fit_kwargs.get("validation_steps"))
        initial_epoch = run.resume_epoch(initial_epoch)
        if settings.resume and run.checkpoint and initial_epoch >= epochs:
            raise ValueError(f"{run.checkpoint.directory} already holds all {epochs} requested epochs "
                             f"({initial_epoch} completed); there is nothing to train, and the checkpoint is kept. "
                             f"Received: epochs={epochs}")
        report = run.report()
        if report and fit_kwargs.get("verbose", 1):
            print(report)
        report = "\n".join(line for line in (note, report) if line)
        logs = None
        if results_dir is not None and strategy.is_chief:
            info = callback_lib.RunInfo(
                model=model.name, strategy=strategy.alias, devices=strategy.num_devices,
                global_batch=batch_size, samples_per_epoch=samples, epochs=epochs, initial_epoch=initial_epoch,
                precision=settings.precision, data=data, run_id=runs.new_run_id(), version=provenance.version(),
                tensorflow=tf.__version__, machine=provenance.machine())
            logs = callback_lib.run_callbacks(info, results_dir, report=report, events=strategy.epoch_events,
                                              save_weights=save_weights)
        users = [UserModelCallbacks(callbacks, model, run)] if callbacks and strategy.trains_here else []
        # Tests only: a run that writes results waits after an epoch, its row written (the short fits of the
        # checks and the planner write none).
        held = HoldBetweenEpochs.from_environment() if results_dir is not None else []
        text = TextLogs()  # last: the words of the logs reach the callbacks, not Keras's progress bar
        try:
            history = run.fit(train, epochs=epochs, validation_data=validation,
                              callbacks=[*users, *(logs or ()), *held, text],
                              initial_epoch=initial_epoch, **fit_kwargs)
        except BaseException as error:
            if logs:
                logs.failed(error)
            raise
        text.into(history)
        run.finalize(model)
        if logs and save_weights:  # the weights, then the run's row: they agree, or the run is logged as failed
            logs.recorder.finish(model)
        for user in users:  # on_train_end, with the trained state in the user's model
            user.train_ended({name: values[-1] for name, values in history.history.items() if values})
        history.set_model(model)
        history.run_record = logs.recorder.row if logs else None  # the run's row of runs.csv, when logged
        history.strategy = strategy
        model.history = history
        return history


def _python_batches(data):
    """Whether ``data`` is batches made by the user's Python: a ``keras.utils.PyDataset`` or a generator."""
    return isinstance(data, (keras.utils.PyDataset, collections.abc.Iterator))


def _fit_whole_chunks(prepared, *steps):
    """Make Keras's ``steps_per_execution`` divide a user's ``steps_per_epoch`` and ``validation_steps``: Keras
    runs whole chunks of steps, in training and in validation alike, so 8 per call would make an epoch of 3 steps
    take 8, and a validation of 1 step read a finite dataset's every batch."""
    chunk = getattr(prepared, "steps_per_execution", 1) or 1
    divisor = math.gcd(chunk, *(count for count in steps if count))
    if divisor != chunk:
        prepared.steps_per_execution = divisor


def _data_identity(labels):
    """What identifies a run's data: its size and a digest of its labels (for a dataset, its cardinality),
    which a changed split, seed or source alters."""
    if isinstance(labels, tf.data.Dataset):
        return f"tf.data.Dataset of {int(labels.cardinality())} batches"
    leaves = [np.ascontiguousarray(leaf) for leaf in tf.nest.flatten(arrays(labels))]
    digest = hashlib.sha1(b"".join(leaf.tobytes() for leaf in leaves)).hexdigest()[:12]
    return f"{len(leaves[0])} examples, labels {digest}"


def arrays(data):
    """``data`` as numpy arrays: an array-like, or a list, tuple or dict of them (a model's several inputs or
    outputs, as Keras takes them), lists made tuples for ``tf.data``.

    >>> [a.shape for a in arrays([np.zeros((3, 2)), np.ones(3)])], arrays([1, 2, 3]).shape
    ([(3, 2), (3,)], (3,))
    """
    if isinstance(data, dict):
        return {key: arrays(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)) and data and all(np.ndim(part) >= 1 for part in data):
        return tuple(arrays(part) for part in data)
    return np.asarray(data)


def _examples(*structures):
    """The number of examples of each structure of arrays, refused unless they agree."""
    counts = {name: {len(leaf) for leaf in tf.nest.flatten(data)} for name, data in structures}
    if len(set().union(*counts.values())) != 1:
        raise ValueError("x, y and sample_weight must hold the same number of examples. Received: "
                         + ", ".join(f"len({name})={'/'.join(map(str, sorted(n)))}" for name, n in counts.items()))
    return next(iter(counts[structures[0][0]]))


def _run_record(model, strategy, batch_size, precision, data):
    """What a checkpoint records of its run, so that a resume with other settings is refused."""
    return {"model": model.name, "strategy": strategy.alias, "devices": strategy.num_devices,
            "global_batch": batch_size, "data": data, "precision": precision, **strategy.training_record()}


def _hardware_precision(precision):
    """``precision`` for this machine: ``"auto"`` resolved (see ``cnnpar.hardware``), and a one-line warning for
    ``mixed_bfloat16`` on a CPU that only emulates bfloat16."""
    precision = arguments.precision(precision)
    if precision == "auto":
        return hardware.auto_precision()
    warning = hardware.bfloat16_warning() if precision == "mixed_bfloat16" else None
    if warning and not tf.config.list_physical_devices("GPU"):
        warnings.warn(warning, stacklevel=3)
    return precision


def check_model(model):
    """Refuse what is not a compiled Keras model, naming what was received."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"fit() takes a keras.Model. Received: model={type(model).__name__}")
    if not graph.is_graph(model):
        raise TypeError("every strategy trains a copy of the model rebuilt from its graph of layers (as "
                        "keras.models.clone_model does), which a keras.Sequential or a functional model "
                        "(keras.Model(inputs, outputs)) has and a subclassed model has not. Received: model of "
                        f"type {type(model).__name__}")
    if not model.compiled:
        raise ValueError(f"model {model.name!r} is not compiled; call model.compile(optimizer=..., loss=...) "
                         f"before fit. Received: model.compiled=False")


def _inputs(x, y, batch_size, validation_data, validation_split, shuffle, strategy, given_steps=(),
            validation_batch_size=None, sample_weight=None, class_weight=None):
    """Return ``(train dataset, validation dataset or None, steps, training samples per epoch or None)``.

    Numpy data becomes datasets through :func:`_epoch_dataset`; ``steps`` holds
    the ``steps_per_epoch`` / ``validation_steps`` that go with repeated ones.
    A user's datasets are repeated (:func:`_repeated`) unless ``given_steps``
    (the user's ``fit`` options) already sets their steps. Numpy validation data is
    batched by ``validation_batch_size``, else ``batch_size``, as in Keras's ``fit``. Sample weights and class
    weights become the training batches' third element, as Keras's ``fit``
    makes them, before any strategy sees the data.
    """
    if sample_weight is not None and class_weight:
        raise ValueError("give sample_weight or class_weight, not both (multiply them into sample_weight). "
                         f"Received: class_weight={class_weight}")
    if isinstance(x, tf.data.Dataset):
        if sample_weight is not None:
            raise ValueError("with a dataset as x, put the sample weights in its batches, as (x, y, "
                             f"sample_weight); give no sample_weight. Received: sample_weight of type "
                             f"{type(sample_weight).__name__}")
        if batch_size is not None or y is not None or validation_split:
            raise ValueError("with a tf.data.Dataset as x, batch it yourself and give no y, batch_size or "
                             f"validation_split. Received: batch_size={batch_size}, y={type(y).__name__}, "
                             f"validation_split={validation_split}")
        if validation_data is not None and not isinstance(validation_data, tf.data.Dataset):
            raise ValueError("with a tf.data.Dataset as x, give validation_data as a dataset too. "
                             f"Received: validation_data of type {type(validation_data).__name__}")
        if class_weight:
            x = x.map(lambda *batch: (*batch[:2], data_lib.class_sample_weights(batch[1], class_weight)))
        train, steps = x, None
        if "steps_per_epoch" not in given_steps:
            train, steps = _repeated(x, strategy.steps_per_execution)
        validation, validation_steps = validation_data, None
        if "validation_steps" not in given_steps:
            validation, validation_steps = _repeated(validation_data, strategy.steps_per_execution)
        steps = {"steps_per_epoch": steps, "validation_steps": validation_steps}
        return train, validation, {k: v for k, v in steps.items() if v is not None}, None
    x, y = arrays(x), arrays(y)
    weights = None if sample_weight is None else np.asarray(sample_weight, np.float32)
    examples = _examples(("x", x), ("y", y), *([] if weights is None else [("sample_weight", weights)]))
    if validation_split:
        if validation_data is not None:
            raise ValueError("give validation_data or validation_split, not both. "
                             f"Received: validation_split={validation_split}")
        cut = int(examples * (1.0 - validation_split))
        validation_data = tf.nest.map_structure(lambda a: a[cut:], (x, y) if weights is None else (x, y, weights))
        x, y = tf.nest.map_structure(lambda a: a[:cut], (x, y))
        weights = None if weights is None else weights[:cut]
    if class_weight:  # for training only, as Keras's fit applies it
        if len(tf.nest.flatten(y)) > 1:
            raise ValueError(f"class_weight is for a model with one output; give sample_weight instead. Received: "
                             f"y with {len(tf.nest.flatten(y))} outputs")
        weights = data_lib.class_sample_weights(y, class_weight).numpy()
    if batch_size < strategy.batch_pieces:
        pieces = strategy.batch_pieces
        raise ValueError(f"{strategy!r} cuts every batch into {pieces} pieces (replicas or micro-batches), so a batch "
                         f"needs at least {pieces} examples (TensorFlow fails on an empty piece). "
                         f"Received: batch_size={batch_size}")
    _refuse_no_step(_examples(("x", x)), strategy)
    train, steps, samples = _epoch_dataset((x, y, weights), batch_size * strategy.accumulate,
                                           strategy.steps_per_execution, shuffle=bool(shuffle),
                                           seed=strategy.shuffle_seed, smallest_batch=strategy.smallest_batch)
    steps = {"steps_per_epoch": steps}
    validation = validation_data
    if validation_data is not None and not isinstance(validation_data, tf.data.Dataset):
        parts = [arrays(a) for a in validation_data] + [None]
        validation, steps["validation_steps"], _ = _epoch_dataset(parts[:3], validation_batch_size or batch_size,
                                                                  strategy.steps_per_execution)
    return train, validation, {k: v for k, v in steps.items() if v is not None}, samples


def _refuse_no_step(count, strategy):
    """A ``ValueError`` for ``count`` training examples that give an epoch no step under ``strategy``: none, or fewer
    than the pieces it cuts a batch into (a last batch that small is left out, see :func:`_short_tail`). Keras
    would train on nothing and the run be recorded without a figure."""
    smallest = max(strategy.smallest_batch, 1)
    if count < smallest:
        raise ValueError(f"{count} training example(s) give an epoch no step: {strategy!r} needs at least "
                         f"{smallest} per batch, one for each of its pieces (replicas or micro-batches, times "
                         f"accumulate), and leaves a smaller batch out. Give at least {smallest} training examples. "
                         f"Received: {count} training examples")


def _repeated(dataset, steps_per_execution):
    """A user's finite ``dataset`` repeated, with its batches per pass; as given, with None, if that cannot be.

    One iterator then serves every epoch, as for numpy inputs (see :func:`_epoch_dataset`),
    which spares ``MirroredStrategy`` a fresh distributed iterator per epoch. A dataset of
    unknown or infinite length, or whose length ``steps_per_execution`` does not divide,
    stays as it is.
    """
    if dataset is None:
        return None, None
    batches = int(dataset.cardinality())
    if batches <= 0 or batches % steps_per_execution:
        return dataset, None
    return dataset.repeat(), batches


def _epoch_dataset(examples, batch_size, steps_per_execution, *, shuffle=False, seed=None, smallest_batch=1):
    """``(dataset, steps, examples per pass)``: the input pipeline of ``examples`` (``x, y, sample_weight or None``),
    repeated with its steps per pass where Keras allows; else ``steps=None``. A last batch smaller than
    ``smallest_batch`` is left out of every pass (:func:`_short_tail`).

    A repeated dataset keeps one input iterator (and its per-device prefetching)
    for every epoch; a fresh distributed iterator per epoch costs seconds under
    ``MirroredStrategy``. Batches never straddle passes. Keras runs whole
    ``steps_per_execution`` chunks on a repeated dataset, so a pass whose steps
    are not a multiple of it stays finite and Keras stops at its end.
    """
    x, y, sample_weight = examples
    count = len(tf.nest.flatten(x)[0])
    kept = count - _short_tail(count, batch_size, smallest_batch)
    dataset = data_lib.pipeline(x, y, batch_size, sample_weight=sample_weight, shuffle=shuffle, seed=seed, take=kept)
    steps = math.ceil(kept / batch_size)
    if steps % steps_per_execution:
        return dataset, None, kept
    return dataset.repeat(), steps, kept


def _short_tail(count, batch_size, smallest_batch):
    """How many of ``count`` examples a pass leaves out: those of a last batch smaller than ``smallest_batch``
    (``Strategy.smallest_batch``), with a warning; else 0.

    A replica (or micro-batch) given no example fails TensorFlow's oneDNN
    gradients, under Keras's own ``fit`` too: an ``InvalidArgumentError``, or
    the process aborts in ``MklMaxPoolingGradOp``. 129 digits at batch 64 under
    ``DataParallel(2)`` did.
    """
    tail = count % batch_size
    if not 0 < tail < smallest_batch:
        return 0
    warnings.warn(f"{count} examples at a batch of {batch_size} leave a last batch of {tail}, which the strategy "
                  f"cannot cut into its {smallest_batch} pieces (replicas or micro-batches, times accumulate), and "
                  f"TensorFlow fails on an empty piece: each epoch leaves out {tail} example(s), other ones each "
                  f"epoch when shuffled. A batch size that leaves no remainder, or one of at least {smallest_batch}, "
                  "trains on every example.", stacklevel=4)
    return tail
