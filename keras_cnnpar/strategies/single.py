"""One device: the baseline every other strategy is measured against."""

from keras_cnnpar.strategies.base import Strategy, register


@register("single")
class Single(Strategy):
    """Train on one device with Keras's own ``fit``: the baseline.

    The whole global batch goes through the one device. The model still goes
    through the prepare/fit/finalize path and the cached, prefetched input
    pipeline, so its figures are comparable with every other strategy's.

    Example:

    >>> import keras_cnnpar as cnnpar
    >>> model = cnnpar.models.cnn("3+3")
    >>> digits = cnnpar.data.load()
    >>> history = model.fit(digits.x[::20], digits.y[::20], batch_size=64,
    ...                     strategy=cnnpar.Single(), results_dir=None, verbose=0)

    Args:
        steps_per_execution: training steps per call into TensorFlow (default 8).
        accumulate: micro-batches of ``batch_size`` per step, their mean
            gradient applied once (see ``Strategy``).
    """

    description = "one device, the baseline"
    max_devices = 1
    device_option = None

    @classmethod
    def configurations(cls, devices, batch_size):
        """One configuration on any machine: the baseline every plan measures first."""
        return [()]
