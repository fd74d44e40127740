"""A callback that records each epoch's images/s; no side effects, so any benchmark can import it."""

import time

import keras


class EpochTimer(keras.callbacks.Callback):
    """Records each epoch's images/s: ``images`` over the epoch's wall time."""

    def __init__(self, images):
        super().__init__()
        self.images, self.rates = images, []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(self.images / (time.perf_counter() - self.start))
