"""The one reader of a Keras model's layer graph: its layers in topological order, and which feeds which.

Keras keeps the graph of a ``Sequential`` or functional model in private
attributes (``_nodes_by_depth``, ``_inbound_nodes``, ``_keras_history``); this
module is the only place that reads them, so a change of Keras's internals has
one home. A subclassed model has no graph: :func:`is_graph` says so, and the
callers refuse it with their own reason. Wrappers that hold the real model as
``inner`` (micro-batching, gradient accumulation) are seen through by
:func:`unwrap`.

>>> inputs = keras.Input((4,))
>>> hidden = keras.layers.Dense(3, name="hidden")(inputs)
>>> model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))
>>> [call.layer.name for call in read(model).calls]
['hidden', 'out']
>>> [layer.name for layer in sources(model.get_layer("out"))], [layer.name for layer in output_layers(model)]
(['hidden'], ['out'])
"""

import typing

import keras


class Call(typing.NamedTuple):
    """One call of a layer (or of an operation on tensors) in the graph, with the keys of its tensors."""

    layer: object
    inputs: tuple
    output: int


class Graph(typing.NamedTuple):
    """A model's calls in a topological order, between the keys of its input and output tensors."""

    input: int
    calls: list
    output: int

    def shared_layers(self):
        """The names of the layers called more than once (shared weights), sorted."""
        names = [call.layer.name for call in self.calls]
        return sorted({name for name in names if names.count(name) > 1})


def unwrap(model):
    """``model`` through the wrappers that hold the real model as ``inner``."""
    while hasattr(model, "inner"):
        model = model.inner
    return model


def is_graph(model):
    """Whether ``model`` is a ``keras.Sequential`` or functional model: a graph of layers to read."""
    return isinstance(model, keras.Sequential) or (isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth"))


def read(model):
    """The :class:`Graph` of ``model`` (``Sequential``, or functional with one input and one output), a model
    nested in it (a ``Sequential`` block used as a layer, one input and one output) read in place as its layers.

    The caller checks :func:`is_graph` and the number of inputs and outputs
    first; an operation called on tensors (``a + b``) appears as a call whose
    ``layer`` is no ``keras.layers.Layer``.

    >>> block = keras.Sequential([keras.layers.Dense(3, name="inner")], name="block")
    >>> nested = keras.Sequential([keras.Input((4,)), block, keras.layers.Dense(2, name="out")])
    >>> [call.layer.name for call in read(nested).calls]
    ['inner', 'out']
    """
    if isinstance(model, keras.Sequential):
        calls = [Call(layer, (i,), i + 1) for i, layer in enumerate(model.layers)]
        graph = Graph(0, calls, len(calls))
    else:
        calls = [Call(node.operation, tuple(id(t) for t in keras.tree.flatten(node.input_tensors)),
                      id(node.outputs[0]))
                 for depth in sorted(model._nodes_by_depth, reverse=True)
                 for node in model._nodes_by_depth[depth] if not node.is_input]
        graph = Graph(id(model.inputs[0]), calls, id(model.outputs[0]))
    return graph._replace(calls=[inner for call in graph.calls for inner in _in_place(call)])


def _in_place(call):
    """``[call]``, or the calls of the model that ``call`` calls, keyed within it, between ``call``'s keys."""
    nested = call.layer
    if not (is_graph(nested) and len(call.inputs) == 1 and len(nested.inputs) == 1 and len(nested.outputs) == 1):
        return [call]
    inner = read(nested)
    keys = {inner.input: call.inputs[0], inner.output: call.output}

    def key(inner_key):
        return keys.get(inner_key, (call.output, inner_key))

    return [Call(c.layer, tuple(key(k) for k in c.inputs), key(c.output)) for c in inner.calls]


def weight_order(model):
    """``model``'s layers in the order of its weights (``model.weights``), a nested model's layers in its place.

    >>> block = keras.Sequential([keras.layers.Dense(3, name="inner")], name="block")
    >>> nested = keras.Sequential([keras.Input((4,)), block, keras.layers.Dense(2, name="out")])
    >>> [layer.name for layer in weight_order(nested)]
    ['inner', 'out']
    """
    return [inner for layer in model.layers
            for inner in (weight_order(layer) if is_graph(layer) else [layer])]


def is_operation(node):
    """Whether ``node`` of a model's graph is an operation called on tensors (``a + b``, ``x[:, ::-1]``,
    ``keras.ops.relu(x)``), not a layer: Keras keeps those out of ``model.layers``, and they have no weights,
    ``build`` or ``training`` argument.

    >>> inputs = keras.Input((2,))
    >>> is_operation((inputs * 0.5)._keras_history.operation), is_operation(keras.layers.Dense(1))
    (True, False)
    """
    return not isinstance(node, keras.layers.Layer)


def sources(layer):
    """The layers whose outputs ``layer`` takes as inputs (in its first call in the model)."""
    node = layer._inbound_nodes[0]
    return [operation_of(tensor) for tensor in keras.tree.flatten(node.input_tensors)]


def nodes(model):
    """``(layer, node)`` for every call of every layer of ``model`` (its input layers included); a node has
    ``output_tensors``.

    >>> inputs = keras.Input((4,))
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="out")(inputs))
    >>> [(layer.name, len(node.output_tensors)) for layer, node in nodes(model)][-1]
    ('out', 1)
    """
    return [(layer, node) for layer in model._flatten_layers(include_self=False)
            for node in getattr(layer, "_inbound_nodes", [])]


def operation_of(tensor):
    """The layer or operation that computed ``tensor``, a symbolic tensor of a model's graph.

    >>> inputs = keras.Input((2,))
    >>> operation_of(keras.layers.Dense(1, name="d")(inputs)).name
    'd'
    """
    return tensor._keras_history.operation


def call_operation(operation, tensors):
    """Run ``operation``, called on tensors in a model's graph (``x * 0.5``), on ``tensors`` in place of its graph
    tensors (in the order :func:`read` keys them), its other arguments (the ``0.5``) as they were given.

    >>> import tensorflow as tf
    >>> inputs = keras.Input((2,))
    >>> call_operation(operation_of(inputs * 0.5), [tf.constant([[2.0, 4.0]])]).numpy().tolist()
    [[1.0, 2.0]]
    """
    arguments = operation._inbound_nodes[0].arguments
    args, kwargs = arguments.fill_in({id(t): x for t, x in zip(arguments.keras_tensors, tensors)})
    return operation.call(*args, **kwargs)


def output_layers(model):
    """The layers that compute ``model``'s outputs (through wrappers, see :func:`unwrap`)."""
    model = unwrap(model)
    if isinstance(model, keras.Sequential):
        return model.layers[-1:]
    return [operation_of(output) for output in model.outputs]
