"""The registry of strategies: each strategy's declared facts, read without starting TensorFlow.

A strategy is a class in a module of ``keras_cnnpar/strategies/`` (or its packages) decorated
with ``@register("alias")``. It declares, as plain class attributes, a one-line
``description``, the device counts it runs on (``min_devices``,
``max_devices``, ``device_multiple``), the ``cnnpar train`` option that sets
that count (``device_option``), whether it ``keeps_checkpoints`` and whether it
``needs_cluster`` (TensorFlow servers and processes beyond the caller's); the
options it takes are its ``__init__`` parameters. The CLI's help and option
checks, the sweep's plan and the tests derive from these facts, which are read
from the source, so ``cnnpar --help`` stays instant; :func:`load` imports the
class itself when it is needed.

A strategy defined elsewhere, in a user's script or package, registers when
its class is created with the same ``@register("alias")`` (:func:`add`), and
a package can offer its strategies to every ``cnnpar`` command through the
entry-point group ``keras_cnnpar.strategies`` (``[project.entry-points."keras_cnnpar.strategies"]``
``mine = "my_package.strategies"``: the module is imported when the registry's names are first read; one that fails
is left out with a warning).

>>> names()
['async-ps', 'channels', 'hybrid', 'layers', 'local-steps', 'mirrored', 'multi-worker', 'single']
>>> names(needs_cluster=True)
['async-ps', 'local-steps', 'multi-worker']
>>> entry("hybrid").invalid(2)
'hybrid needs a multiple of 2 devices, at least 4'
>>> "devices" in entry("mirrored").options, "devices" in entry("single").options
(True, False)
"""

import ast
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import warnings
from pathlib import Path

STRATEGIES = Path(__file__).parent
#: Class attributes a strategy declares; the base ``Strategy`` (in ``strategies/base.py``) sets their defaults.
FACTS = ("description", "min_devices", "max_devices", "device_multiple", "device_option", "keeps_checkpoints",
         "needs_cluster")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered strategy: its alias, where its class is, and its declared facts."""

    alias: str
    module: str
    class_name: str
    options: tuple
    description: str
    min_devices: int
    max_devices: int | None
    device_multiple: int
    device_option: str | None
    keeps_checkpoints: bool
    needs_cluster: bool
    #: The class itself, for a strategy registered at run time (:func:`add`).
    cls: type | None = dataclasses.field(default=None, compare=False, repr=False)

    def invalid(self, devices):
        """Why this strategy cannot run on ``devices`` devices, or None."""
        return invalid(self, devices)

    def load(self):
        """The strategy class (this imports TensorFlow)."""
        return self.cls or getattr(importlib.import_module(self.module), self.class_name)


def invalid(facts, devices):
    """Why the strategy whose facts (``alias``, ``min_devices``, ...) are ``facts`` cannot run on ``devices``
    devices, or None; ``facts`` is an :class:`Entry` or a strategy class."""
    if facts.max_devices == facts.min_devices and devices != facts.min_devices:
        return f"{facts.alias} runs on {facts.min_devices} device{'s' * (facts.min_devices > 1)}"
    if devices < facts.min_devices or devices % facts.device_multiple or \
            (facts.max_devices is not None and devices > facts.max_devices):
        if facts.device_multiple > 1:
            return f"{facts.alias} needs a multiple of {facts.device_multiple} devices, at least {facts.min_devices}"
        return f"{facts.alias} needs at least {facts.min_devices} devices"
    return None


#: Strategies registered at run time, by alias (classes defined outside this package).
_ADDED = {}
#: The entry-point group through which installed packages offer strategies.
ENTRY_POINTS = "keras_cnnpar.strategies"


def add(cls):
    """Register ``cls``, a strategy class defined outside this package, under its ``alias``; its facts are read
    from the class. ``@register("alias")`` calls it; an alias of the package's own is refused."""
    if cls.alias in _entries():
        raise ValueError(f"the strategy name {cls.alias!r} is taken by {_entries()[cls.alias].class_name}; choose "
                         f"another. Received: {cls.__qualname__} registered as {cls.alias!r}")
    facts = {key: getattr(cls, key) for key in FACTS}
    _ADDED[cls.alias] = Entry(cls.alias, cls.__module__, cls.__qualname__, tuple(inspect.signature(cls).parameters),
                              **facts, cls=cls)


def names(**facts):
    """The registered aliases, sorted; ``facts`` filter them, e.g. ``keeps_checkpoints=True``."""
    return sorted(alias for alias, e in _registered().items()
                  if all(getattr(e, key) == value for key, value in facts.items()))


def entry(alias):
    """The :class:`Entry` of ``alias``; an error lists the valid names."""
    if alias not in _registered():
        raise ValueError(f"unknown strategy {alias!r}; valid names are {names()}. Received: strategy={alias!r}")
    return _registered()[alias]


def entries(*, plugins=True):
    """Every :class:`Entry`, in alias order; ``plugins=False``: the package's own, read without importing a plugin."""
    registered = _registered() if plugins else _entries()
    return [registered[alias] for alias in sorted(registered)]


def _registered():
    _load_entry_points()
    return {**_entries(), **_ADDED}


_entry_points_loaded = []


def _load_entry_points():
    """Import, once, the modules that installed packages name in the ``keras_cnnpar.strategies`` group; one that
    fails (it raises, it is missing, it takes a name already taken) is left out with a warning of one line."""
    if not _entry_points_loaded:
        _entry_points_loaded.append(True)  # first: a plugin's module may read the registry as it imports
        for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
            try:
                point.load()
            except Exception as error:  # anything a user's module raises: it must not break every command
                said = " ".join(str(error).split())
                warnings.warn(f"the strategy plugin {point.name} = {point.value} is left out: "
                              f"{type(error).__name__}: {said}", stacklevel=3)


@functools.cache
def _entries():
    classes = {}
    for path in sorted(STRATEGIES.rglob("*.py")):
        parts = path.relative_to(STRATEGIES).with_suffix("").parts
        module = ".".join(["keras_cnnpar.strategies", *(parts[:-1] if parts[-1] == "__init__" else parts)])
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (module, node)
    found = {}
    for name, (module, node) in classes.items():
        alias = _registered_alias(node)
        if alias is not None:
            facts = {key: _fact(classes, node, key) for key in FACTS}
            found[alias] = Entry(alias, module, name, _options(classes, node), **facts)
    return found


def _registered_alias(node):
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "register":
            return ast.literal_eval(decorator.args[0])
    return None


def _chain(classes, node):
    """``node`` and its base classes that are defined in the strategies package, nearest first."""
    while node is not None:
        yield node
        bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
        node = classes[bases[0]][1] if bases else None


def _fact(classes, node, key):
    """The value that ``node`` (or its nearest base that sets it) assigns to ``key``, as ``key = value`` or
    within ``a, key = 1, value``; every strategy inherits one from ``Strategy``."""
    for cls in _chain(classes, node):
        for statement in cls.body:
            if not isinstance(statement, ast.Assign):
                continue
            for target in statement.targets:
                names = [getattr(t, "id", None) for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
                if key in names:
                    value = ast.literal_eval(statement.value)
                    return value[names.index(key)] if isinstance(target, ast.Tuple) else value
    raise ValueError(f"strategy class {node.name} declares no {key}, and no base class sets it")


def _options(classes, node):
    for cls in _chain(classes, node):
        for statement in cls.body:
            if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
                arguments = statement.args
                return tuple(a.arg for a in [*arguments.args[1:], *arguments.kwonlyargs])
    return ()
