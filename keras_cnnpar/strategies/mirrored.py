"""Sync data parallel on one host: ``tf.distribute.MirroredStrategy``."""

import functools

import tensorflow as tf

from keras_cnnpar.runtime import devices as device_lib
from keras_cnnpar.strategies import arguments
from keras_cnnpar.strategies.base import Strategy, register


@register("mirrored")
class DataParallel(Strategy):
    """Sync data parallel over the devices of one host, on ``MirroredStrategy``.

    Every device holds a full replica of the model. Each step splits the global
    ``batch_size`` evenly across the replicas (``batch_size / devices`` each; a
    last, short batch is split as evenly as it goes), the gradients are summed
    across replicas, and every replica applies the same update. With fewer
    accelerators than ``devices``, the CPU (or the GPU) is split into logical
    devices; that must happen before TensorFlow starts, so call
    ``cnnpar.devices.configure(N)`` first. Keras 3 fails under
    ``MirroredStrategy`` with ``steps_per_execution > 1`` (keras-team/keras#19246),
    so this strategy runs one step per call.

    Example:

    >>> import keras_cnnpar as cnnpar
    >>> cnnpar.devices.configure(2)
    ['/device:CPU:0', '/device:CPU:1']
    >>> model = cnnpar.models.cnn("3+3")
    >>> digits = cnnpar.data.load()
    >>> history = model.fit(digits.x[::20], digits.y[::20], batch_size=64,
    ...                     strategy=cnnpar.DataParallel(devices=2), results_dir=None,
    ...                     verbose=0)

    Args:
        devices: number of replicas, or a list of device names such as
            ``["/gpu:0", "/gpu:1"]``. Default: every GPU, or 2 logical CPUs.
        scale_lr: ``"linear"`` multiplies the learning rate by the number of
            replicas, ``"sqrt"`` by its square root, ``None`` (default) keeps it.
            The global batch is the same as under ``Single``, so no scaling keeps
            the two comparable; scale when you grow the global batch with the
            replicas.
        accumulate: micro-batches of ``batch_size`` per step, their mean
            gradient applied once (see ``Strategy``): one all-reduce per
            ``accumulate`` micro-batches.
        sync_batchnorm: ``BatchNormalization`` layers compute their batch
            statistics over the global batch (default True), so a step equals
            ``Single``'s; False keeps each replica's own statistics (Keras's
            and Lightning's default), which saves an all-reduce per layer and
            step but normalizes with ``batch_size / devices`` examples.
        compression: how the gradients travel between replicas. None
            (default): whole, in their own dtype, the step Single's.
            ``"bfloat16"``: half float32's bytes, summed in bfloat16 (each sum
            then cast back); the step differs from Single's by bfloat16's
            rounding (docs/data_parallel.md). ``"powersgd"``: each large
            gradient as rank ``powersgd_rank`` factors with error feedback
            (:mod:`keras_cnnpar.strategies.compression`), for slow links; the
            update approximates Single's (docs/slow_links.md).
        powersgd_rank: PowerSGD's rank (default 4), with ``compression="powersgd"``.
        all_reduce_dtype: the former spelling of ``compression="bfloat16"``
            (deprecated).
    """

    description = "sync data parallel on MirroredStrategy"
    trains_under_tf_distribute = all_reduces_gradients = True
    min_devices = 2

    def __init__(self, devices=None, *, scale_lr=None, accumulate=1, sync_batchnorm=True, compression=None,
                 powersgd_rank=None, all_reduce_dtype=None):
        super().__init__(steps_per_execution=1, accumulate=accumulate)
        self.sync_batchnorm = arguments.flag("sync_batchnorm", sync_batchnorm)
        self.compression, self.powersgd_rank = arguments.compression(compression, powersgd_rank, all_reduce_dtype)
        default = len(tf.config.list_physical_devices("GPU")) or 2
        self.devices = arguments.devices(default if devices is None else devices)
        self.scale_lr = arguments.scale_lr(scale_lr)

    @property
    def batch_pieces(self):
        return self.num_replicas

    @property
    def num_replicas(self):
        return self.num_devices

    def __repr__(self):
        shown = self.devices if isinstance(self.devices, int) else ",".join(self.devices)
        return f"<DataParallel devices={shown} scale_lr={self.scale_lr}>"

    def _tf_strategy(self):
        return _mirrored_strategy(tuple(device_lib.resolve(self.devices)))

    def xla_refusal(self):
        if all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in device_lib.resolve(self.devices)):
            return ("its replicas are logical devices of one CPU, and XLA compiles a step for one device (a variable "
                    "of another replica is an error there)")
        return None


@functools.cache
def _mirrored_strategy(devices):
    """One ``MirroredStrategy`` per device set and process.

    Two instances over the same devices number their collective ops alike, and
    TensorFlow then aborts the second model's all-reduce with "Shape mismatch in
    the collective instance 100"; sharing the instance keeps the numbers apart.
    On CPU devices, gradients are summed on one device (``ReductionToOneDevice``),
    which was faster per step than collective all-reduce on CPUs (docs/measurements/2026-11-29-intel.md).
    """
    on_cpu = all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices)
    reduction = tf.distribute.ReductionToOneDevice() if on_cpu else None  # None: NCCL on GPUs
    return tf.distribute.MirroredStrategy(devices=list(devices), cross_device_ops=reduction)
