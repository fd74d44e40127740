"""Validators of the options every strategy and command takes; each returns the value or raises a clear error.

>>> positive_int("workers", 2)
2
>>> positive_int("workers", True)
Traceback (most recent call last):
ValueError: workers must be a positive int. Received: workers=True
>>> positive_seconds("timeout", 0)
Traceback (most recent call last):
ValueError: timeout must be a positive number of seconds. Received: timeout=0
"""

import math
import os
import warnings

#: Keras mixed-precision policies a run can train under (``precision=``).
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
#: What ``precision=`` takes: a policy, or ``"auto"`` for the fastest one the hardware computes natively.
PRECISION_CHOICES = (*PRECISIONS, "auto")
#: ``scale_lr`` rules: the learning-rate factor for ``n`` replicas.
SCALE_LR = {"linear": float, "sqrt": math.sqrt, None: lambda n: 1.0}
#: The ``compression`` option's values (:mod:`.compression`): None sends the gradients whole in their own dtype.
COMPRESSIONS = (None, "bfloat16", "powersgd")
#: PowerSGD's rank where none is given (PyTorch's hook defaults to 1; the paper's image models used 2-4).
POWERSGD_RANK = 4


def positive_int(name, value):
    """``value`` if it is an int of at least 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
    return value


def non_negative_int(name, value):
    """``value`` if it is an int of at least 0 (not a bool).

    >>> non_negative_int("precise_bn", -1)
    Traceback (most recent call last):
    ValueError: precise_bn must be an int of at least 0. Received: precise_bn=-1
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int of at least 0. Received: {name}={value!r}")
    return value


def flag(name, value):
    """``value`` if it is True or False.

    >>> flag("sync_batchnorm", 1)
    Traceback (most recent call last):
    TypeError: sync_batchnorm must be True or False. Received: sync_batchnorm=1
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False. Received: {name}={value!r}")
    return value


def momentum_or_none(name, value):
    """``value`` if it is a number in [0, 1) (not a bool), or None.

    >>> momentum_or_none("ema_momentum", 1)
    Traceback (most recent call last):
    ValueError: ema_momentum must be a number in [0, 1) or None. Received: ema_momentum=1
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1):
        raise ValueError(f"{name} must be a number in [0, 1) or None. Received: {name}={value!r}")
    return value


def positive_seconds(name, value):
    """``value`` if it is a positive, finite number of seconds (int or float, not a bool; not NaN or infinity,
    which the barriers' ``int(1000 * timeout)`` cannot take).

    >>> positive_seconds("timeout", float("nan"))
    Traceback (most recent call last):
    ValueError: timeout must be a positive number of seconds. Received: timeout=nan
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds. Received: {name}={value!r}")
    return value


def devices(value):
    """A ``devices`` option: a positive int, or a non-empty list of device names (returned as a list)."""
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise TypeError(f"devices must be an int or a list of device names. Received: devices={value!r}")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"devices must be at least 1. Received: devices={value}")
    if not isinstance(value, int) and not value:
        raise ValueError("devices must name at least one device. Received: devices=[]")
    return value if isinstance(value, int) else list(value)


def scale_lr(value):
    """A ``scale_lr`` option: ``"linear"``, ``"sqrt"`` or ``None`` (also spelled ``"none"``)."""
    value = None if value == "none" else value
    if value not in tuple(SCALE_LR):  # a tuple: an unhashable value is refused, not a TypeError of the dict's
        raise ValueError(f"scale_lr must be 'linear', 'sqrt' or None. Received: scale_lr={value!r}")
    return value


def compression(value, rank=None, all_reduce_dtype=None):
    """The ``compression`` and ``powersgd_rank`` options as ``(compression, rank)``: ``None`` (the gradients whole,
    in their own dtype; also spelled ``"none"``), ``"bfloat16"`` (half the bytes of float32 on the wire) or
    ``"powersgd"`` (rank ``powersgd_rank`` factors, 4 by default; :mod:`.compression`). ``all_reduce_dtype``,
    the former spelling of ``compression="bfloat16"``, is taken with a deprecation warning.

    >>> compression("bfloat16"), compression("none"), compression("powersgd"), compression("powersgd", 2)
    (('bfloat16', None), (None, None), ('powersgd', 4), ('powersgd', 2))
    >>> compression("float16")
    Traceback (most recent call last):
    ValueError: compression must be None, 'bfloat16' or 'powersgd'. Received: compression='float16'
    >>> compression("bfloat16", 4)
    Traceback (most recent call last):
    ValueError: powersgd_rank is for compression='powersgd'. Received: compression='bfloat16', powersgd_rank=4
    """
    if all_reduce_dtype not in (None, "none"):
        warnings.warn(f"all_reduce_dtype is now compression: give compression={all_reduce_dtype!r}",
                      DeprecationWarning, stacklevel=4)  # here, the strategy's __init__, its metaclass, the user
        value = value or all_reduce_dtype
    value = None if value == "none" else value
    if value not in COMPRESSIONS:
        raise ValueError(f"compression must be None, 'bfloat16' or 'powersgd'. Received: compression={value!r}")
    if value != "powersgd":
        if rank is not None:
            raise ValueError(f"powersgd_rank is for compression='powersgd'. Received: compression={value!r}, "
                             f"powersgd_rank={rank!r}")
        return value, None
    return value, positive_int("powersgd_rank", POWERSGD_RANK if rank is None else rank)


def pack_bytes(value, compression):
    """The ``pack_bytes`` option: None, or a positive int of bytes; not with PowerSGD, whose factors are packed
    by their two all-reduces.

    >>> pack_bytes(None, None), pack_bytes(4_000_000, "bfloat16")
    (None, 4000000)
    >>> pack_bytes(4_000_000, "powersgd")
    Traceback (most recent call last):
    ValueError: pack_bytes is for compression=None or 'bfloat16'. Received: compression='powersgd', pack_bytes=4000000
    """
    if value is None:
        return None
    if compression == "powersgd":
        raise ValueError(f"pack_bytes is for compression=None or 'bfloat16'. Received: compression={compression!r}, "
                         f"pack_bytes={value!r}")
    return positive_int("pack_bytes", value)


def precision(value):
    """A ``precision`` option: one of :data:`PRECISION_CHOICES`."""
    if value not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {list(PRECISION_CHOICES)}. Received: precision={value!r}")
    return value


def folder_or_none(name, value):
    """A folder path option that may be None."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a folder path or None. Received: {name}={value!r}")
    return value
