"""Words in an epoch's logs (a check's verdict, the kind of a time split), kept out of Keras's progress bar.

Keras's ``ProgbarLogger`` averages every value of the logs it is given, and a
string fails it at ``verbose=1`` and ``2`` (``TypeError: the resolved dtypes are
not compatible with add.reduce``), after the run trained. ``cnnpar.fit`` passes
a :class:`TextLogs` last of its callbacks, so the callbacks before it (the
checks, then ``EpochLogger``, which writes them into the run's CSV) see every
value, and Keras's ``History`` and progress bar, which Keras adds after the
given callbacks, see the numbers only; :meth:`TextLogs.into` then gives the
``History`` the words too.

>>> import keras, keras_cnnpar as cnnpar
>>> class Verdict(keras.callbacks.Callback):
...     def on_epoch_end(self, epoch, logs=None):
...         logs["verdict"] = "pass"
>>> digits = cnnpar.data.load()
>>> history = cnnpar.fit(cnnpar.models.cnn("3+3"), digits.x[:64], digits.y[:64], batch_size=64,
...                      callbacks=[Verdict()], results_dir=None, verbose=2)  # doctest: +ELLIPSIS
1/1 - ...
>>> history.history["verdict"]
['pass']
"""

import keras


class TextLogs(keras.callbacks.Callback):
    """Takes the text values out of each epoch's logs, keeping them for the ``History``.

    It must be the last callback given to ``fit``: it removes what the
    callbacks after it would see. It has no batch hook, so Keras still
    dispatches the batch-level callbacks asynchronously (any override of
    ``on_train_batch_end`` makes every step wait for its logs).
    """

    def __init__(self):
        super().__init__()
        #: The text values taken from each epoch's logs, in order.
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(_take_text(logs))

    def into(self, history):
        """Append the text values taken to ``history.history`` by name, as Keras's ``History`` appends numbers."""
        for words in self.epochs:
            for name, value in words.items():
                history.history.setdefault(name, []).append(value)
        return history


def _take_text(logs):
    """Remove the text values of ``logs`` (a dict, or None) and return them."""
    words = {name: value for name, value in (logs or {}).items() if isinstance(value, str)}
    for name in words:
        del logs[name]
    return words
