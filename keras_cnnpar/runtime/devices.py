"""Device discovery and logical devices.

TensorFlow can split one physical CPU (or GPU) into several logical devices, so
multi-device strategies run, and are tested, on a machine with one processor.
The split must happen before TensorFlow starts its runtime, which it does as
soon as the first tensor or model variable is created.

Example:

>>> import keras_cnnpar as cnnpar
>>> cnnpar.devices.configure(2)
['/device:CPU:0', '/device:CPU:1']
"""

import tensorflow as tf

#: Memory given to each logical GPU when one GPU is split (``configure(gpu_memory_mb=...)``).
DEFAULT_GPU_MEMORY_MB = 4096


def accelerator_kind():
    """Return ``"GPU"`` when TensorFlow sees a GPU, else ``"CPU"``."""
    return "GPU" if tf.config.list_physical_devices("GPU") else "CPU"


def logical_names(kind=None):
    """Names of the logical devices of ``kind`` (default: the accelerator kind).

    This starts TensorFlow's runtime if it has not started yet.
    """
    return [device.name for device in tf.config.list_logical_devices(kind or accelerator_kind())]


def configure(n, *, kind=None, gpu_memory_mb=DEFAULT_GPU_MEMORY_MB):
    """Make sure at least ``n`` logical devices of ``kind`` exist; return the first ``n`` names.

    With fewer physical devices than ``n``, the first one is split into ``n``
    logical devices. Call it at the top of a program, before any model or tensor
    exists; once the runtime has started, a missing split raises ``RuntimeError``
    saying what to do.

    Args:
        n: number of devices wanted, at least 1.
        kind: ``"CPU"`` or ``"GPU"``; by default GPU when there is one, else CPU.
        gpu_memory_mb: memory limit of each logical GPU when a GPU is split.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"devices must be an int. Received: devices={n!r}")
    if n < 1:
        raise ValueError(f"devices must be at least 1. Received: devices={n}")
    kind = kind or accelerator_kind()
    physical = tf.config.list_physical_devices(kind)
    if not physical:
        raise ValueError(f"TensorFlow sees no {kind} device. Received: kind={kind!r}")
    if len(physical) < n and len(tf.config.get_logical_device_configuration(physical[0]) or ()) < n:
        _split(physical[0], n, kind, gpu_memory_mb)
    return logical_names(kind)[:n]


def _split(device, n, kind, gpu_memory_mb):
    limit = gpu_memory_mb if kind == "GPU" else None
    try:
        tf.config.set_logical_device_configuration(
            device, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * n
        )
    except RuntimeError:
        have = logical_names(kind)
        if len(have) >= n:
            return
        raise RuntimeError(
            f"{n} {kind} devices are needed, but TensorFlow's runtime already started with "
            f"{len(have)}: {have}. Logical devices can only be created before the runtime starts: "
            f"call cnnpar.devices.configure({n}) at the top of your program, before building any "
            f"model or tensor (the `cnnpar` CLI does this for you)."
        ) from None


def describe(names):
    """One line that says which devices training uses.

    >>> describe(["/device:CPU:0"])
    'training on /device:CPU:0 (no GPU found)'
    """
    gpus = len(tf.config.list_physical_devices("GPU"))
    found = f"{gpus} GPU{'s' * (gpus > 1)}" if gpus else "no GPU"
    split = ", logical devices split from one" if len(names) > max(gpus, 1) else ""
    return f"training on {', '.join(names)} ({found} found{split})"


def resolve(devices):
    """Turn ``devices`` (a count or a list of device names) into a list of device names.

    A count calls :func:`configure`; names must be logical devices TensorFlow knows.

    >>> resolve(["/cpu:0"])
    ['/device:CPU:0']
    """
    if isinstance(devices, int) and not isinstance(devices, bool):
        return configure(devices)
    if not isinstance(devices, (list, tuple)) or not all(isinstance(d, str) for d in devices):
        raise TypeError(f"devices must be an int or a list of device names. Received: devices={devices!r}")
    if not devices:
        raise ValueError("devices must name at least one device. Received: devices=[]")
    known = {name.lower(): name for kind in ("CPU", "GPU") for name in logical_names(kind)}
    names = [known.get(_canonical(d).lower()) for d in devices]
    unknown = [d for d, name in zip(devices, names) if name is None]
    if unknown:
        raise ValueError(f"unknown device names {unknown}; TensorFlow has {sorted(known.values())}. "
                         f"Received: devices={list(devices)!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"each device may appear once. Received: devices={list(devices)!r}")
    return names


def _canonical(name):
    spec = tf.DeviceSpec.from_string(name)
    return f"/device:{(spec.device_type or '').upper()}:{spec.device_index or 0}"
