"""How the strategies that sum gradients over replicas (``DataParallel``, ``MultiWorker``) send them: whole, in
bfloat16, or compressed by PowerSGD, always on TensorFlow's own all-reduce.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019; PyTorch's ``powerSGD_hook``) sends each large gradient
as two thin factors of rank ``r``. A gradient of two or more dimensions, seen as a matrix ``M`` of ``n =
prod(shape[:-1])`` rows and ``m = shape[-1]`` columns, is compressed where that sends fewer numbers,
``r (n + m) < n m``; biases, BatchNormalization and small kernels are sent whole. Each step, on each replica,
with its error feedback ``e`` (what earlier steps' approximations left out) and the factor ``Q`` of the step
before (warm start; the same on every replica)::

    M = g + e;   P = sum over replicas of M Q;   P = an orthonormal basis of P's columns (QR)
    Q = sum over replicas of M^T P;   the gradients' sum ~ P Q^T;   e = M - P Q^T / replicas

Two all-reduces a step: the ``P`` factors with the tensors sent whole, then the ``Q`` factors. At the full rank of
every matrix the sum is exact; below it the update is an approximation that the error feedback corrects over the
following steps, so training differs from Single's (docs/slow_links.md gives the measured cost).

>>> compresses((3136, 1024), 4), compresses((64, 4), 4), compresses((1024,), 4)
(True, False, False)
>>> sent_floats([(5, 5, 32, 64), (64,), (3136, 1024)], rank=4), 5 * 5 * 32 * 64 + 64 + 3136 * 1024
(20160, 3262528)
"""

import math

import numpy as np
import tensorflow as tf

from keras_cnnpar.strategies.arguments import POWERSGD_RANK

#: What bfloat16 gradients change in the training, and its measured cost (docs/slow_links.md), said wherever a
#: plan or a run's log names them.
BFLOAT16_CHANGES = ("each part of the gradient and their sum rounded to 8 significant bits: Single's training "
                    "within rounding (no measurable accuracy cost, docs/slow_links.md)")


def changes(compression, rank=POWERSGD_RANK):
    """What ``compression`` (None, ``"bfloat16"`` or ``"powersgd"`` of ``rank``) changes in the training, with its
    measured cost (docs/slow_links.md), said wherever a plan or a run's log names it; None where nothing changes.

    >>> changes(None), changes("powersgd", 4).startswith("compression='powersgd': each large gradient summed as rank-4")
    (None, True)
    """
    if compression == "bfloat16":
        return f"compression='bfloat16': {BFLOAT16_CHANGES}"
    if compression == "powersgd":
        return (f"compression='powersgd': each large gradient summed as rank-{rank} factors with error feedback, an "
                f"approximation of Single's update (at rank 4, its validation accuracy measured at most 0.8 points "
                f"below Single's in 6 of 6 runs, docs/slow_links.md)")
    return None


def matrix_shape(shape):
    """``(n, m)``: a gradient of ``shape`` as PowerSGD sees it, its last dimension the columns; None for a
    vector or a scalar."""
    shape = tuple(int(d) for d in shape)
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) >= 2 else None


def compresses(shape, rank):
    """Whether PowerSGD of ``rank`` sends a gradient of ``shape`` as factors: only where they are smaller."""
    matrix = matrix_shape(shape)
    return matrix is not None and rank * sum(matrix) < math.prod(matrix)


def sent_floats(shapes, rank):
    """The numbers each replica sends a step for gradients of ``shapes`` under PowerSGD of ``rank``."""
    return sum(rank * sum(matrix_shape(s)) if compresses(s, rank) else math.prod(s) for s in shapes)


def check_rank(rank, variables):
    """``rank`` where it compresses at least one of ``variables``' gradients; else a ``ValueError`` naming the
    largest, whose factors would not be smaller than it."""
    if any(compresses(v.shape, rank) for v in variables):
        return rank
    largest = max(variables, key=lambda v: math.prod(v.shape))
    n, m = matrix_shape(largest.shape) or (math.prod(largest.shape), 1)
    raise ValueError(f"powersgd_rank={rank} compresses none of the model's gradients: its largest, {largest.path} "
                     f"({n}x{m}), would be sent as {rank * (n + m)} numbers, no fewer than its {n * m}; choose a rank "
                     f"below {math.ceil(n * m / (n + m))}. Received: powersgd_rank={rank}")


def reducer(compression=None, pack_bytes=None):
    """The function ``summed(gradients_and_variables)`` that sums gradients over the replicas in sync, whole,
    in bfloat16 where ``compression`` is ``"bfloat16"`` (PowerSGD's is :meth:`PowerSGD.summed`): a list of
    ``(gradient, variable)`` pairs in, the same with each gradient summed. ``pack_bytes``: see
    :func:`summed_whole`."""
    dtype = "bfloat16" if compression == "bfloat16" else None

    def summed(pairs):
        gradients = summed_whole([g for g, _ in pairs], dtype, pack_bytes)
        return [(g, v) for g, (_, v) in zip(gradients, pairs)]

    return summed


def summed_whole(gradients, dtype=None, pack_bytes=None):
    """``gradients`` (None left as None) summed over the replicas in sync, sent in ``dtype`` where given; as they
    are in the cross-replica context, where there is nothing to sum (as in Keras's own all-reduce).

    ``pack_bytes``: all-reduces of packs of about that many bytes (TensorFlow's ``bytes_per_pack``), the last
    layers' gradients first, as the backward pass gives them, so that a pack may cross the link while the
    gradients of the layers before it are computed; None: one all-reduce of them all."""
    context = tf.distribute.get_replica_context()
    present = [g for g in gradients if g is not None]
    if context is None or not present:
        return gradients
    sent = [tf.cast(g, dtype) for g in present] if dtype else present
    if pack_bytes:
        options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack_bytes)
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent[::-1], options=options)[::-1]
    else:
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
    summed = iter([tf.cast(s, g.dtype) for s, g in zip(summed, present)] if dtype else summed)
    return [None if g is None else next(summed) for g in gradients]


class PowerSGD:
    """PowerSGD's state for one model on this replica: for each gradient it compresses (found by ``key`` of its
    variable; default ``id``), ``Q`` (warm-started, the same on every replica) and this replica's error feedback,
    kept in variables that every replica holds its own copy of (``ON_READ``).

    :meth:`kept_by` makes an optimizer's checkpoints keep it. The error
    feedback is saved summed over the replicas, and a restore gives each
    replica the sum divided by their number (TensorFlow's rule for ``SUM``
    variables): since the next all-reduce only sees the replicas' errors
    through their sum, a resume continues the same training, on as many
    workers or on another number.

    Example (two replicas on logical CPUs; at a matrix's full rank the sum is exact):

    >>> import keras_cnnpar as cnnpar
    >>> cnnpar.devices.configure(2)
    ['/device:CPU:0', '/device:CPU:1']
    >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     kernel = tf.Variable(tf.zeros([6, 3]), name="kernel")
    ...     compressor = PowerSGD([kernel], rank=3, minimum=False)
    >>> parts = [np.arange(18, dtype=np.float32).reshape(6, 3) * (i + 1) for i in range(2)]
    >>> def step():
    ...     mine = tf.gather(tf.constant(np.stack(parts)), tf.distribute.get_replica_context().replica_id_in_sync_group)
    ...     return compressor.summed([(mine, kernel)])[0][0]
    >>> summed = strategy.experimental_local_results(strategy.run(tf.function(step)))[0]
    >>> bool(np.allclose(summed, parts[0] + parts[1], atol=1e-4))
    True
    """

    def __init__(self, variables, rank=POWERSGD_RANK, seed=0, minimum=True, key=None):
        self.rank, self.key = rank, key or id
        self.q, self.error = {}, {}
        generator = np.random.default_rng(seed)
        for variable in variables:
            matrix = matrix_shape(variable.shape)
            if not (compresses(variable.shape, rank) if minimum else matrix and rank <= min(matrix)):
                continue
            # Orthonormal columns: P = M Q then keeps M's conditioning (a Gaussian Q's would cost float32 digits).
            q = np.linalg.qr(generator.standard_normal((matrix[1], rank)))[0].astype(np.float32)
            self.q[self.key(variable)] = _replica_local(q, "powersgd_q")
            self.error[self.key(variable)] = _replica_local(np.zeros(matrix, np.float32), "powersgd_error",
                                                            tf.VariableAggregation.SUM)

    def kept_by(self, optimizer):
        """Make ``optimizer``'s checkpoints hold every ``Q`` and error feedback (in the order of the variables
        given: a model's trainable variables, the same in every process) as they hold its slots."""
        optimizer._track_trackable(tf.train.Checkpoint(factors=list(self.q.values()),
                                                       errors=list(self.error.values())), "powersgd")

    def summed(self, pairs):
        """``pairs`` of ``(gradient, variable)`` with each gradient summed over the replicas in sync."""
        context = tf.distribute.get_replica_context()
        if context is None:
            return pairs
        if all(g is None for g, _ in pairs):
            return pairs
        compressed = {i: self.key(v) for i, (g, v) in enumerate(pairs) if g is not None and self.key(v) in self.q}
        matrices = {i: tf.reshape(tf.cast(pairs[i][0], tf.float32), self.error[key].shape) + self.error[key]
                    for i, key in compressed.items()}
        whole = [i for i, (g, _) in enumerate(pairs) if g is not None and i not in compressed]
        first = context.all_reduce(tf.distribute.ReduceOp.SUM, [pairs[i][0] for i in whole]
                                   + [matrices[i] @ self.q[key] for i, key in compressed.items()])
        summed = dict(zip(whole, first[:len(whole)]))
        bases = {i: tf.linalg.qr(p)[0] for i, p in zip(compressed, first[len(whole):])}
        second = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                    [tf.transpose(matrices[i]) @ bases[i] for i in compressed]) if compressed else []
        replicas = float(context.num_replicas_in_sync)
        for (i, key), q in zip(compressed.items(), second):
            approximation = bases[i] @ tf.transpose(q)
            self.error[key].assign(matrices[i] - approximation / replicas)
            self.q[key].assign(q)
            summed[i] = tf.cast(tf.reshape(approximation, pairs[i][0].shape), pairs[i][0].dtype)
        return [(summed.get(i), variable) for i, (_, variable) in enumerate(pairs)]


def _replica_local(initial, name, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA):
    """A variable of which every replica keeps and writes its own copy, read outside the replicas as
    ``aggregation`` says (by default the first replica's)."""
    return tf.Variable(initial, trainable=False, name=name, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)
