"""``fit``'s contract for strategies that train with a loop of their own (AsyncPS, ChannelSharded, Hybrid).

The loop keeps Keras's callback order: ``on_train_begin``, then per epoch
``on_epoch_begin``, the strategy's training (which calls the batch-level
callbacks it can), validation between ``on_test_begin`` and ``on_test_end``
with its results added as ``val_*`` (after the epochs ``validation_freq`` names),
and ``on_epoch_end``. It honours ``initial_epoch`` and ``model.stop_training``,
finalizes the optimizer's variables as Keras's ``fit`` does (``use_ema``: the
weights become their moving averages), and returns the ``History``.
"""

import collections.abc
import contextlib

import keras

#: Keras's batch-level callback hooks, by phase.
BATCH_HOOKS = {"train": ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end"),
               "test": ("on_test_batch_begin", "on_test_batch_end")}


def with_batch_hooks(callbacks, phase="train"):
    """The callbacks that override one of Keras's batch hooks of ``phase`` (``"train"`` or ``"test"``)."""
    base = keras.callbacks.Callback
    return [callback for callback in callbacks
            if any(getattr(type(callback), hook) is not getattr(base, hook) for hook in BATCH_HOOKS[phase])]


def reads_batch_logs(callbacks, phase="train"):
    """Whether one of ``callbacks`` (or of the callbacks that one of them wraps as ``.callbacks``, as the
    user's callbacks are wrapped) overrides a batch hook of ``phase`` (``"train"`` or ``"test"``).

    >>> reads_batch_logs([keras.callbacks.History()]), reads_batch_logs([keras.callbacks.ProgbarLogger()])
    (False, True)
    """
    return any(reads_batch_logs(callback.callbacks, phase) if hasattr(callback, "callbacks")
               else bool(with_batch_hooks([callback], phase)) for callback in callbacks)


def run_epochs(model, train_epoch, *, epochs, steps, callbacks=None, verbose=1, initial_epoch=0, validate=None,
               validation_freq=1, epoch_guard=None, after_epoch=None):
    """Run ``train_epoch(epoch, callback_list) -> logs`` for each epoch with Keras's callbacks; return the History.

    Args:
        model: the model the callbacks see (``callback.model``).
        train_epoch: trains one epoch and returns its logs.
        epochs, steps, callbacks, verbose, initial_epoch: as in ``keras.Model.fit``.
        validate: None, or a function of the ``CallbackList`` (whose test batch hooks it may call) returning
            the validation results as a dict.
        validation_freq: as in ``keras.Model.fit`` (see :func:`validates_after`).
        epoch_guard: None, or a function of the epoch returning a context manager
            that wraps the epoch (to turn a lost peer into a clear error).
        after_epoch: None, or a function of the epoch called after ``on_epoch_end``
            (to write a checkpoint).
    """
    validates_after(0, validation_freq)  # a bad value fails before training starts
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs, steps=steps,
        model=model)
    model.stop_training = False
    model._initial_epoch = None
    callback_list.on_train_begin()
    initial_epoch = model._initial_epoch or initial_epoch  # a callback restored a backup (as Keras's fit reads it)
    for epoch in range(initial_epoch, epochs):
        with (epoch_guard or (lambda _: contextlib.nullcontext()))(epoch):
            callback_list.on_epoch_begin(epoch)
            logs = train_epoch(epoch, callback_list)
            if validate is not None and validates_after(epoch, validation_freq):
                callback_list.on_test_begin()
                results = validate(callback_list)
                callback_list.on_test_end(results)
                logs.update({f"val_{name}": float(value) for name, value in results.items()})
            callback_list.on_epoch_end(epoch, logs)
            if after_epoch is not None:
                after_epoch(epoch)
        if model.stop_training:
            break
    if isinstance(model.optimizer, keras.optimizers.Optimizer) and epochs > 0:  # as Keras's fit ends
        model.optimizer.finalize_variable_values(model.trainable_weights)  # use_ema: the moving averages
    callback_list.on_train_end()
    return next(c for c in callback_list.callbacks if isinstance(c, keras.callbacks.History))


def validates_after(epoch, validation_freq):
    """Whether Keras's ``fit`` validates after ``epoch`` (counted from 0) with ``validation_freq``: an int ``n``,
    every ``n``-th epoch, or a list of the epochs (counted from 1).

    >>> [validates_after(epoch, 2) for epoch in range(4)], validates_after(2, [1, 3])
    ([False, True, False, True], True)
    >>> validates_after(0, 0)
    Traceback (most recent call last):
    ValueError: validation_freq must be a positive int or a list of epochs (counted from 1). Received: validation_freq=0
    """
    if isinstance(validation_freq, int) and not isinstance(validation_freq, bool) and validation_freq > 0:
        return (epoch + 1) % validation_freq == 0
    if isinstance(validation_freq, collections.abc.Container) and not isinstance(validation_freq, str):
        return epoch + 1 in validation_freq
    raise ValueError("validation_freq must be a positive int or a list of epochs (counted from 1). "
                     f"Received: validation_freq={validation_freq!r}")


def epoch_steps(strategy, train, steps_per_epoch, unsupported):
    """The set-up every custom loop shares: refuse ``fit`` arguments it does not take, and count an epoch's steps.

    Returns ``steps_per_epoch``, or the number of batches of the finite dataset ``train``.
    """
    name = type(strategy).__name__
    if unsupported:
        raise ValueError(f"{name} does not support the fit arguments {sorted(unsupported)}. Received: {unsupported}")
    return steps_per_epoch or finite_steps(train, name)


def finite_steps(dataset, strategy_name):
    """The number of batches of a finite ``dataset``; an error for an infinite one."""
    steps = int(dataset.cardinality())
    if steps < 1:
        raise ValueError(f"{strategy_name} needs the steps of an epoch: give steps_per_epoch, or a finite dataset. "
                         f"Received: a dataset of cardinality {steps}")
    return steps
