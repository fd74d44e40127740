"""What the ``cnnpar`` commands share: the option types, the one-line refusals, and the checks of the places a
command writes into, made before it starts any work."""

import errno
import os

import click

from keras_cnnpar.cluster import environments
from keras_cnnpar.runtime import atomic, startup
from keras_cnnpar.strategies import arguments, registry
from keras_cnnpar.zoo.names import MODEL_NAMES, check_model_source

MODELS = list(MODEL_NAMES)
#: ``--model`` of ``train`` and ``plan``: a zoo kind or the user's own model (``zoo.models.from_source``).
MODEL_OPTION_HELP = ("2+2: 2 conv + 2 dense layers; 3+3: 3 conv + 3 dense layers; resnet: a residual CNN with "
                     "BatchNormalization (functional); or your own: a .keras file, or package.module:function "
                     "returning a compiled Keras model, for images of the data's shape and its classes.")
#: Seeds as TensorFlow and numpy take them.
SEED = click.IntRange(0, 2**32 - 1)
FORCE = click.option("--force", is_flag=True, help="Replace files that exist already.")
PRECISION = click.option(
    "--precision", type=click.Choice(arguments.PRECISION_CHOICES), default="float32", show_default=True,
    help="Keras mixed-precision policy of training: mixed_bfloat16 on CPUs with AMX/AVX512-BF16 or GPUs with "
         "bfloat16, mixed_float16 on GPUs (with loss scaling); auto: mixed_bfloat16 where the hardware has it, "
         "else float32; see docs/precision.md.")



class RegisteredStrategy(click.Choice):
    """The registered strategies' names, and ``extra`` names, read when a command runs: a strategy registered
    after this module was imported (a user's, see :mod:`keras_cnnpar.strategies.registry`) is a choice too.

    >>> "mirrored" in RegisteredStrategy("auto").choices, RegisteredStrategy("auto").choices[-1]
    (True, 'auto')
    """

    def __init__(self, *extra):
        self.extra = extra
        super().__init__([])

    @property
    def choices(self):
        return [*registry.names(), *self.extra]

    @choices.setter
    def choices(self, value):
        """Click's own constructor sets the choices; they are the registry's."""


def quiet_tensorflow():
    startup.quiet_start()


class Refused(click.ClickException):
    """A run refused before it trained, for its settings or files: one line, exit code 2 (a usage error)."""

    exit_code = 2


def model_source(context, parameter, source):
    """``--model``'s value, its form checked before anything starts (``zoo.names.check_model_source``); None
    where it is not given and has no default."""
    if source is None:
        return None
    try:
        check_model_source(source)
    except ValueError as error:
        raise click.BadParameter(str(error), context, parameter) from None
    return source


def model_from_source(source, digits):
    """The compiled model ``--model`` names for ``digits`` (see ``zoo.models.from_source``); anything that does
    not fit is refused in one line (exit 2)."""
    from keras_cnnpar.zoo import models

    try:
        return models.from_source(source, input_shape=digits.x.shape[1:], num_classes=digits.num_classes)
    except ValueError as error:
        raise Refused(str(error)) from None


def check_writable(folder, option, value=None):
    """Refuse (one line, exit 2) unless this process can create files in ``folder`` (or, where it does not exist
    yet, in its nearest existing parent), found by creating one there (:func:`atomic.probe_folder`); None passes.
    ``value``: what the user gave ``option``, where that is a file in ``folder``."""
    if folder is None:
        return
    try:
        atomic.probe_folder(folder)
    except OSError as error:
        where = error.filename or folder
        reason = os.strerror(error.errno)
        if error.errno == errno.ENOENT and os.path.isdir(where):  # /proc's answer
            reason += " (a folder where no file can be created)"
        raise Refused(f"cannot write into {folder}: {where}: {reason}; nothing was done. "
                      f"Received: {option} {value or folder}") from None


def not_written(error, folder, option, left, value=None):
    """The one-line failure (exit 1) of a write into ``folder`` that the disk stopped (full, say) once the work was
    done; ``left``: what the all-or-nothing write left there; ``value``: what the user gave ``option``, where that
    is a file in ``folder``."""
    reason = os.strerror(error.errno) if error.errno else " ".join(str(error).split())
    return click.ClickException(f"could not write into {folder}: {reason}; {left}. "
                                f"Received: {option} {value or folder}")


def refuse_to_overwrite(paths, force):
    """A usage error naming the first of ``paths`` that exists, unless ``force``."""
    existing = [path for path in paths if os.path.exists(path)]
    if existing and not force:
        raise click.BadParameter(f"{existing[0]} exists; pass --force to replace it, or choose another path. "
                                 f"Received: {existing[0]}", param_hint="--out")


def refuse_an_input_as_output(out, source, option):
    """Refuse (one line, exit 2) where the output file ``out`` is the input file ``source`` that ``option`` names,
    by its path, a link or a hard link: writing it would destroy what the command reads."""
    same = os.path.realpath(out) == os.path.realpath(source) or (
        os.path.exists(out) and os.path.exists(source) and os.path.samefile(out, source))
    if same:
        raise Refused(f"--out is the file that {option} reads; choose another path: nothing was written. "
                      f"Received: --out {out}, {option} {source}")


def check_worker_count(workers):
    """In a worker that its environment describes (TF_CONFIG, a Slurm job step, ...), --workers must agree with it."""
    environment = environments.resolve()
    source = environment.name
    try:
        task = environment.task()
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint=source) from None
    if task.num_workers != workers:
        raise click.BadParameter(f"{source} holds {task.num_workers} workers. Received: --workers {workers}",
                                 param_hint="--workers")
