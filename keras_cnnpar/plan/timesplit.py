"""Where a step's time goes, read from a TensorFlow profiler trace: compute, communication, input and idle.

``traced(folder)`` records what TensorFlow runs while its block runs
(``tf.profiler.experimental``); :func:`split` reads the trace it wrote (the
``XSpace`` protobuf that TensorFlow ships) and sums each op's time by kind:

- **communication**: collectives (all-reduce, all-gather, all-to-all: DTensor
  lowers its relayouts and all-reduces to them), sends and receives between
  devices and tasks, copies to a DTensor mesh, and the cross-device sum of a
  ``MirroredStrategy`` on CPUs (an ``AddN`` in the optimizer's name scope, on
  the device that reduces);
- **input**: reading batches from ``tf.data``;
- **compute**: every other op (convolutions, matmuls, element-wise, updates);
- **idle**: the devices' time with no op running (pipeline bubbles, waiting,
  Python and dispatch): ``devices x wall time`` minus the ops' time.

Each share is a fraction of ``devices x wall time``. On CPU logical devices
an op's time is its wall time on its thread, so two devices' ops running at
once on shared cores both count in full; the shares then sum to more than 1
before idle is clipped at 0, and they are scaled to sum to 1.

>>> kind_of_op("gradient_tape/conv2d/Conv2DBackpropFilter:Conv2DBackpropFilter")
'compute'
>>> kind_of_op("einsum_1/Einsum/DTensorAllReduceOp_9_1:CollectiveReduceV2")
'communication'
>>> kind_of_op("StatefulPartitionedCall/adam/AddN_4:AddN", "adam"), kind_of_op("StatefulPartitionedCall/AddN_9:AddN")
('communication', 'compute')
>>> kind_of_op("StatefulPartitionedCall:StatefulPartitionedCall") is None  # a call: its ops are traced themselves
True
"""

import collections
import contextlib
from pathlib import Path

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

#: Op types that move data between devices or tasks.
COMMUNICATION_OPS = frozenset({
    "_Send", "_Recv", "_HostSend", "_HostRecv", "CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2",
    "CollectiveReduceScatterV2", "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveReduce",
    "CollectiveGather", "CollectivePermute", "NcclAllReduce", "CopyToMesh", "CopyToMeshGrad", "Relayout",
    "RelayoutLike", "RemoteCall", "DTensorAllReduce", "DTensorAllGather", "DTensorAllScatter", "DTensorAllToAll",
    "DTensorReduceScatter"})
#: Op types that read batches from ``tf.data``.
INPUT_OPS = frozenset({"IteratorGetNext", "IteratorGetNextAsOptional", "MultiDeviceIteratorGetNextFromShard",
                       "OptionalGetValue", "OptionalHasValue"})
#: Op types that only call a function whose ops are traced themselves.
CALL_OPS = frozenset({"StatefulPartitionedCall", "PartitionedCall", "While", "If", "StatelessWhile", "StatelessIf",
                      "TPUPartitionedCall"})
KINDS = ("compute", "communication", "input", "idle")


@contextlib.contextmanager
def traced(folder):
    """Record a profiler trace of what runs inside the block into ``folder``."""
    tf.profiler.experimental.start(str(folder))
    try:
        yield
    finally:
        tf.profiler.experimental.stop()


def kind_of_op(event_name, optimizer_scope=None):
    """The kind of a traced op event named ``"op name:op type"``; None for function calls and other events.

    ``optimizer_scope`` is the name scope of the model's optimizer (its ``name``), in which a
    ``MirroredStrategy`` sums the replicas' gradients.
    """
    if "::" in event_name or ":" not in event_name:
        return None
    name, op_type = event_name.rsplit(":", 1)
    op_type = op_type.strip()
    if op_type in CALL_OPS or op_type.startswith("__inference") or "__func_" in op_type:
        return None
    if op_type in COMMUNICATION_OPS or "DTensorAll" in name or op_type.startswith("Relayout"):
        return "communication"
    if op_type == "AddN" and optimizer_scope and f"/{optimizer_scope}/" in f"/{name}":
        return "communication"  # MirroredStrategy's sum of the replicas' gradients
    if op_type in INPUT_OPS:
        return "input"
    return "compute"


def op_seconds(folder, optimizer_scope=None):
    """Seconds of traced op time per kind (compute, communication, input) in the newest trace under ``folder``
    (``optimizer_scope`` as in :func:`kind_of_op`)."""
    traces = sorted(Path(folder).glob("plugins/profile/*/*.xplane.pb"))
    if not traces:
        raise FileNotFoundError(f"no profiler trace (plugins/profile/*/*.xplane.pb) under {folder}")
    space = xplane_pb2.XSpace()
    space.ParseFromString(traces[-1].read_bytes())
    seconds = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                kind = kind_of_op(plane.event_metadata[event.metadata_id].name, optimizer_scope)
                if kind is not None:
                    seconds[kind] += event.duration_ps * 1e-12
    return seconds


def shares(seconds, wall_seconds, devices):
    """Each kind's share of ``devices x wall_seconds``, idle included, summing to 1.

    >>> shares({"compute": 1.5, "communication": 0.5}, wall_seconds=1.0, devices=4)
    {'compute': 0.375, 'communication': 0.125, 'input': 0.0, 'idle': 0.5}
    """
    busy = {kind: float(seconds.get(kind, 0.0)) for kind in KINDS[:-1]}
    budget = devices * wall_seconds
    busy["idle"] = max(budget - sum(busy.values()), 0.0)
    total = sum(busy.values()) or 1.0
    return {kind: busy[kind] / total for kind in KINDS}


def split(folder, wall_seconds, devices, optimizer_scope=None, *, one_device=False):
    """The shares of the trace in ``folder``, taken over ``wall_seconds`` on ``devices`` devices.

    ``one_device``: the run spans one device of one task, so nothing leaves it. TensorFlow still partitions
    its functions with ``_Send``/``_Recv`` pairs between host and device memory of that device (microseconds a
    step), which are then compute, not communication.
    """
    seconds = op_seconds(folder, optimizer_scope)
    if one_device:
        seconds["compute"] += seconds.pop("communication", 0.0)
    return shares(seconds, wall_seconds, devices)
