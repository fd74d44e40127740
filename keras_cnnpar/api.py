"""``cnnpar.fit`` (choose the strategy for ``"auto"``, then one run of :mod:`keras_cnnpar.engine.fitting`) and
``cnnpar.parallel``.

Example:

>>> import keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> digits = cnnpar.data.load()
>>> history = cnnpar.fit(model, digits.x[:256], digits.y[:256], batch_size=64,
...                      strategy="single", results_dir=None, verbose=0)
>>> sorted(history.history)
['accuracy', 'loss']
"""

import functools

import keras
import tensorflow as tf

from keras_cnnpar import strategies
from keras_cnnpar.cluster.joined import this_process
from keras_cnnpar.engine import fitting
from keras_cnnpar.keras_compat import rebuild
from keras_cnnpar.plan import across_hosts, planner
from keras_cnnpar.runtime import hardware
from keras_cnnpar.strategies import arguments


def fit(model, x=None, y=None, *, strategy="single", results_dir="results", batch_size=None, epochs=1,
        validation_data=None, validation_split=0.0, shuffle=True, callbacks=None, initial_epoch=0, resume=False,
        precision="float32", fused_optimizer=True, save_weights=False, **fit_kwargs):
    """Train ``model`` under ``strategy`` and return a Keras ``History``, as ``model.fit`` does.

    The model is rebuilt for the strategy (weights, optimizer config and state,
    loss and metrics carried over), trained, and its trained weights and
    optimizer state are copied back, so ``predict``, ``evaluate``, ``save`` and
    ``export`` on ``model`` then work with no strategy involved.

    Numpy inputs go through a cached, shuffled, prefetched ``tf.data`` pipeline.
    ``validation_split`` takes the last fraction of ``x`` before shuffling, as
    Keras does. A ``tf.data.Dataset`` is used as given (already batched).

    Args:
        model: a compiled Keras model.
        x, y: images and integer labels (numpy arrays), or a batched dataset as ``x``.
        strategy: a strategy object or an alias such as ``"single"`` or ``"mirrored"``; ``"auto"`` measures the
            configurations the logical devices allow on this model and data and trains with the fastest whose
            first step matches Single's (``keras_cnnpar.plan.planner``; the plan is cached). The choice and the
            runner-up are printed and logged, the plan is ``history.plan`` and the strategy ``history.strategy``. In a
            process that joined a cluster of hosts (``cnnpar launch``, ``srun``), ``"auto"`` measures across
            the hosts and trains multi-worker, or single on the chief (``cnnpar.strategies.SingleOnChief``).
        resume: continue an interrupted run from the strategy's checkpoint
            (strategies that keep one: ``MultiWorker``, ``AsyncPS``); the same as
            creating the strategy with ``resume=True``.
        precision: ``"float32"`` (default), ``"mixed_bfloat16"``, ``"mixed_float16"`` or ``"auto"``: the Keras
            mixed-precision policy the strategy's copy of the model trains under (variables and
            optimizer state stay float32, the output layer computes in float32, float16 gets loss
            scaling). The user's model stays float32, so its exports take and return float32.
            It is an argument of ``fit``, not of a strategy: it means the same under every one. ``"auto"``
            takes mixed_bfloat16 where the hardware computes bfloat16 natively (GPUs of compute capability 8.0
            or later, CPUs with AVX512-BF16 or AMX), else float32; mixed_bfloat16 on a CPU that emulates it
            warns (it ran at 0.08x float32's speed there).
        fused_optimizer: apply the optimizer's updates with TensorFlow's fused kernels (``ResourceApplyAdam``
            and kin; see ``cnnpar.fused``), with Keras's results; False keeps Keras's element-wise update,
            for comparison (the tensor-parallel mesh optimizer follows the same switch).
        results_dir: folder of the run's CSVs and log; ``None`` switches logging off.
        save_weights: also write the trained weights into ``results_dir``, as ``cnnpar train`` does: the run's
            own ``.weights.h5`` and the configuration's (its latest run's), put in place with the run's row of
            ``runs.csv``; a failure to write them (a full disk) logs the run as failed, leaves the files of the
            runs before as they were, and raises ``keras_cnnpar.results.callbacks.RunNotRecorded``.
        batch_size: the **global** batch (default 32); each strategy says how it splits it.
        callbacks: Keras callbacks, run against ``model`` (``self.model`` is the user's model, which holds
            each completed epoch's weights; see ``keras_cnnpar.engine.user_callbacks``).
        epochs, validation_data, validation_split, shuffle, initial_epoch,
        **fit_kwargs: as in ``keras.Model.fit``.
    """
    plan = note = None
    with keras.saving.custom_object_scope(rebuild.custom_objects(model)):  # a plain function as the loss
        if isinstance(strategy, str) and strategy == "auto":
            strategy, plan, note = _auto(model, x, y, batch_size, precision, fit_kwargs.get("verbose", 1))
        history = fitting.fit(model, x, y, strategy=strategy, results_dir=results_dir, batch_size=batch_size,
                              epochs=epochs, validation_data=validation_data, validation_split=validation_split,
                              shuffle=shuffle, callbacks=callbacks, initial_epoch=initial_epoch, resume=resume,
                              precision=precision, fused_optimizer=fused_optimizer, note=note,
                              save_weights=save_weights, **fit_kwargs)
    history.plan = plan
    return history


def _auto(model, x, y, batch_size, precision, verbose):
    """``strategy="auto"``: the chosen strategy, the plan, and the line that tells the choice (printed when
    ``verbose``)."""
    fitting.check_model(model)
    precision = hardware.auto_precision() if arguments.precision(precision) == "auto" else precision
    lines = []
    batch_size = _global_batch(x, batch_size)
    if this_process.current("multi-worker") is not None:  # a worker of a cluster: plan across its hosts
        cluster = strategies.MultiWorker(checkpoint_dir=None)
        strategy, plan = across_hosts.choose(model, x, y, cluster, batch_size=batch_size, precision=precision,
                                             log=lines.append)
        verbose = verbose and cluster.is_chief
    else:
        strategy, plan = planner.choose(model, x, y, batch_size=batch_size, precision=precision, log=lines.append)
    if verbose:
        print("\n".join(lines))
    return strategy, plan, lines[-1]


def parallel(model):
    """Return ``model`` with a ``fit`` that also accepts ``strategy=`` (and ``results_dir=``).

    Without ``strategy`` the call is Keras's own ``fit``, unchanged. With it, the
    call is :func:`fit`: the model is rebuilt for the strategy, trained, and the
    trained weights are copied back. The model stays an ordinary Keras model in
    every other way.

    >>> import keras, keras_cnnpar as cnnpar
    >>> model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
    ...                           keras.layers.Dense(10, activation="softmax")])
    >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    >>> model = parallel(model)
    >>> digits = cnnpar.data.load()
    >>> history = model.fit(digits.x[::40], digits.y[::40], batch_size=64, strategy="single",
    ...                     results_dir=None, verbose=0)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"parallel() takes a keras.Model. Received: model={type(model).__name__}")
    keras_fit = type(model).fit

    @functools.wraps(keras_fit)
    def fit_with_strategy(*args, strategy=None, **kwargs):
        if strategy is None:
            return keras_fit(model, *args, **kwargs)
        return fit(model, *args, strategy=strategy, **kwargs)

    model.fit = fit_with_strategy
    return model


def _global_batch(x, batch_size):
    """The global batch: ``batch_size`` (default 32), or that of a batched dataset's first batch."""
    if isinstance(x, tf.data.Dataset):
        return int(tf.shape(tf.nest.flatten(next(iter(x)))[0])[0])
    return batch_size or 32
