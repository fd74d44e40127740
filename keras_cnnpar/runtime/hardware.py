"""What this machine's processor can do and what TensorFlow makes of it: CPU flags, oneDNN, native bfloat16.

Machines differ: TensorFlow turns its oneDNN kernels on by default only on x86
CPUs with AVX512-VNNI, AVX512-BF16, AVX-VNNI or AMX, and runs bfloat16
natively only with AVX512-BF16 or AMX-BF16 (elsewhere it emulates it, far
slower than float32; docs/precision.md). ``import keras_cnnpar`` calls
:func:`enable_onednn` before TensorFlow starts, so the convolutions of an
AVX2-only CPU run on oneDNN too (faster there under every strategy), unless
the user set ``TF_ENABLE_ONEDNN_OPTS`` themselves. Nothing here imports TensorFlow at
module level.

>>> machine = Cpu("AMD EPYC", frozenset({"avx2", "fma"}), x86=True)
>>> native_bfloat16(machine), onednn_default(machine)
(False, False)
>>> native_bfloat16(Cpu("Xeon", frozenset({"avx512f", "amx_bf16", "amx_tile"}), x86=True))
True
"""

import functools
import os
import platform
import sys
import typing
from pathlib import Path

#: The environment variable with which TensorFlow turns oneDNN on ("1") or off ("0") when it starts.
ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
#: CPU flags (as /proc/cpuinfo names them) with which TensorFlow turns oneDNN on by default.
ONEDNN_DEFAULT_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")
#: CPU flags of native bfloat16 arithmetic.
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")
#: The speed of mixed_bfloat16 relative to float32 on a CPU without native bfloat16, as the warning quotes it: Single
#: on the 2+2 CNN, AVX2 only, oneDNN on as keras_cnnpar turns it on there (docs/measurements/2026-12-05-avx2.md).
EMULATED_BFLOAT16_SPEED = 0.08
#: How much faster Single trained the 2+2 CNN with oneDNN than without on such a CPU (the same record).
ONEDNN_SPEEDUP_WITHOUT_AVX512 = 1.65
#: What :func:`enable_onednn` says when TensorFlow started before it could act.
_STARTED_TOO_EARLY = "off: TensorFlow started before keras_cnnpar could turn it on (import keras_cnnpar first)"


class Cpu(typing.NamedTuple):
    """The processor's model name, its feature flags and whether it is an x86 CPU."""

    model: str
    flags: frozenset
    x86: bool


@functools.cache
def cpu():
    """This machine's :class:`Cpu`, read from ``/proc/cpuinfo`` (Linux; elsewhere no flags are known)."""
    fields = {}
    with_info = Path("/proc/cpuinfo")
    if with_info.exists():
        for line in with_info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    machine = platform.machine().lower()
    return Cpu(fields.get("model name") or platform.processor() or machine, frozenset(fields.get("flags", "").split()),
               x86=machine in ("x86_64", "amd64", "i686", "i386"))


def native_bfloat16(machine=None):
    """Whether the CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    return any(flag in (machine or cpu()).flags for flag in BFLOAT16_FLAGS)


def onednn_default(machine=None):
    """Whether TensorFlow turns oneDNN on by itself on this CPU (x86 with AVX512-VNNI, AVX512-BF16, AVX-VNNI, AMX)."""
    machine = machine or cpu()
    return machine.x86 and any(flag in machine.flags for flag in ONEDNN_DEFAULT_FLAGS)


def enable_onednn(environ=None, machine=None, tensorflow_started=None):
    """Turn oneDNN on for TensorFlow where it would leave it off on an x86 CPU; return what was done, in words.

    It sets ``TF_ENABLE_ONEDNN_OPTS=1`` in ``environ`` (default ``os.environ``,
    which the processes this package starts inherit) unless the user set it or
    TensorFlow already started (default: imported in this process), where it
    changes nothing.

    >>> env = {}
    >>> print(enable_onednn(env, Cpu("AMD EPYC", frozenset({"avx2"}), x86=True), tensorflow_started=False))
    on: turned on by keras_cnnpar (TensorFlow leaves it off on this CPU; set TF_ENABLE_ONEDNN_OPTS=0 to keep it off)
    >>> env["TF_ENABLE_ONEDNN_OPTS"]
    '1'
    >>> enable_onednn({"TF_ENABLE_ONEDNN_OPTS": "0"}, Cpu("AMD EPYC", frozenset({"avx2"}), x86=True))
    'off: TF_ENABLE_ONEDNN_OPTS=0, as set by the user'
    """
    environ = os.environ if environ is None else environ
    machine = machine or cpu()
    if ONEDNN_VARIABLE in environ and environ.get(_SET_BY_US) != "1":
        state = "on" if environ[ONEDNN_VARIABLE] not in ("0", "false", "False") else "off"
        return f"{state}: {ONEDNN_VARIABLE}={environ[ONEDNN_VARIABLE]}, as set by the user"
    if onednn_default(machine):
        return "on: TensorFlow's default on this CPU"
    if not machine.x86:
        return "off: not an x86 CPU"
    if tensorflow_started is None:
        tensorflow_started = "tensorflow" in sys.modules
    if tensorflow_started and environ.get(_SET_BY_US) != "1":
        return _STARTED_TOO_EARLY
    environ[ONEDNN_VARIABLE], environ[_SET_BY_US] = "1", "1"
    return (f"on: turned on by keras_cnnpar (TensorFlow leaves it off on this CPU; set {ONEDNN_VARIABLE}=0 "
            f"to keep it off)")


@functools.cache
def onednn_at_import():
    """What ``import keras_cnnpar`` did about oneDNN (:func:`enable_onednn` on this process), in words."""
    return enable_onednn()


def onednn_warning(done, machine=None):
    """The one line that warns where TensorFlow started before ``import keras_cnnpar`` could turn oneDNN on
    (``done``: what :func:`enable_onednn` said), or None.

    >>> avx2 = Cpu("AMD EPYC", frozenset({"avx2"}), x86=True)
    >>> print(onednn_warning(enable_onednn({}, avx2, tensorflow_started=True), avx2))
    oneDNN stays off: TensorFlow started before keras_cnnpar was imported, and it leaves oneDNN off on this CPU \
(AMD EPYC: no AVX512-VNNI, AVX512-BF16, AVX-VNNI or AMX), where oneDNN trained 1.65x as fast (docs/benchmarks.md). \
Import keras_cnnpar before keras and tensorflow, or set TF_ENABLE_ONEDNN_OPTS=1
    >>> onednn_warning(enable_onednn({}, avx2, tensorflow_started=False), avx2) is None
    True
    """
    if done != _STARTED_TOO_EARLY:
        return None
    return (f"oneDNN stays off: TensorFlow started before keras_cnnpar was imported, and it leaves oneDNN off on "
            f"this CPU ({(machine or cpu()).model}: no AVX512-VNNI, AVX512-BF16, AVX-VNNI or AMX), where oneDNN "
            f"trained {ONEDNN_SPEEDUP_WITHOUT_AVX512}x as fast (docs/benchmarks.md). Import keras_cnnpar before "
            f"keras and tensorflow, or set {ONEDNN_VARIABLE}=1")


#: Marks a ``TF_ENABLE_ONEDNN_OPTS`` that this package set (so a child process does not take it for the user's).
_SET_BY_US = "CNNPAR_SET_ONEDNN"


def tensorflow_default_environment(environ=None, machine=None):
    """A copy of ``environ`` (default ``os.environ``) with oneDNN as TensorFlow itself sets it on this CPU: the
    ``TF_ENABLE_ONEDNN_OPTS`` that :func:`enable_onednn` added is replaced by TensorFlow's default, written out
    so that ``import keras_cnnpar`` in a process started with it changes nothing. Such a process runs
    TensorFlow as users without this package run it (``benchmarks/peer_throughput.py``'s peer); a value the
    user set is kept.

    >>> avx2 = Cpu("AMD EPYC", frozenset({"avx2"}), x86=True)
    >>> tensorflow_default_environment({"TF_ENABLE_ONEDNN_OPTS": "1", "CNNPAR_SET_ONEDNN": "1"}, avx2)
    {'TF_ENABLE_ONEDNN_OPTS': '0'}
    >>> tensorflow_default_environment({"TF_ENABLE_ONEDNN_OPTS": "1"}, avx2)  # the user's own
    {'TF_ENABLE_ONEDNN_OPTS': '1'}
    """
    environ = dict(os.environ if environ is None else environ)
    if environ.pop(_SET_BY_US, None) == "1":
        environ[ONEDNN_VARIABLE] = "1" if onednn_default(machine) else "0"
    return environ


def gpu_names():
    """The names of TensorFlow's GPUs (this starts TensorFlow), or ``[]``."""
    import tensorflow as tf

    return [tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
            for gpu in tf.config.list_physical_devices("GPU")]


def gpus_have_bfloat16():
    """Whether there are GPUs and every one computes bfloat16 natively (compute capability 8.0 or later)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return bool(gpus) and all(
        tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0)) >= (8, 0) for gpu in gpus)


def auto_precision():
    """``"mixed_bfloat16"`` where the hardware computes bfloat16 natively (GPUs of compute capability 8.0 or
    later, or a CPU with AVX512-BF16 or AMX-BF16 when there is no GPU), else ``"float32"``."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return "mixed_bfloat16" if gpus_have_bfloat16() else "float32"
    return "mixed_bfloat16" if native_bfloat16() else "float32"


def bfloat16_warning(machine=None):
    """The one line that warns about ``mixed_bfloat16`` on a CPU that emulates it, or None where it is native.

    >>> print(bfloat16_warning(Cpu("AMD EPYC", frozenset({"avx2"}), x86=True)))
    precision='mixed_bfloat16' on a CPU without native bfloat16 (AMD EPYC: no AVX512-BF16 or AMX-BF16): TensorFlow \
emulates it, measured at 0.08x float32's speed on such a CPU (docs/benchmarks.md); use precision='float32' or 'auto'
    """
    machine = machine or cpu()
    if native_bfloat16(machine):
        return None
    return (f"precision='mixed_bfloat16' on a CPU without native bfloat16 ({machine.model}: no AVX512-BF16 or "
            f"AMX-BF16): TensorFlow emulates it, measured at {EMULATED_BFLOAT16_SPEED}x float32's speed on such a "
            f"CPU (docs/benchmarks.md); use precision='float32' or 'auto'")


def describe(machine=None):
    """One line naming the machine: CPU model, the flags that matter, oneDNN on or off and why, the GPUs.

    It asks TensorFlow (which it starts) whether oneDNN is on. Every benchmark prints it first, and every
    run's ``results.log`` has it.
    """
    from tensorflow.python.util import _pywrap_util_port

    machine = machine or cpu()
    flags = ", ".join(f"{name} {'yes' if any(f in machine.flags for f in names) else 'no'}" for name, names in (
        ("AVX-512", ("avx512f",)), ("AVX512-BF16", ("avx512_bf16",)), ("AMX", ("amx_tile",))))
    onednn = "on" if _pywrap_util_port.IsMklEnabled() else "off"
    reason = onednn_at_import().partition(": ")[2]
    return f"CPU {machine.model} ({flags}); oneDNN {onednn} ({reason}); GPU {', '.join(gpu_names()) or 'none'}"
