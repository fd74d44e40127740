"""The ``cnnpar`` command line: thin commands over the library, one module per command group.

TensorFlow is imported inside the commands, so ``--help`` is instant and the
logical devices can be created before TensorFlow starts its runtime. What the
commands share (option types, refusals, the checks of output places) is
:mod:`.common`.
"""

import sys
import warnings

import click

from keras_cnnpar import __version__
from keras_cnnpar.cli import cluster, data, experiments, planning, serving, training
from keras_cnnpar.runtime import startup


class OneLineErrors(click.Group):
    """A command group whose every refusal is one line, ``Error: ...``, with click's exit status (2 for bad
    usage): click itself prints the usage block and a hint before a usage error's line."""

    def main(self, args=None, prog_name=None, **extra):
        extra.pop("standalone_mode", None)
        try:
            status = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.ClickException as error:
            click.echo(f"Error: {error.format_message()}", err=True)
            sys.exit(error.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        # Without standalone mode click returns a command's value, or the status of an early exit (--help: 0).
        sys.exit(status if isinstance(status, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cnnpar")
def main():
    """Train the digit-recognizer CNNs with parallel strategies on Keras 3 + TensorFlow.

    \b
    Examples:
      cnnpar train --model 2+2 --epochs 3                    # Single, embedded mnist-5k
      cnnpar train --strategy mirrored --devices 2           # sync data parallel
      cnnpar train --strategy multi-worker --workers 2       # 2 worker processes on loopback
      cnnpar train --strategy hybrid --mesh 2x2 --checks     # DTensor mesh, with parity checks
      cnnpar sweep --models 2+2 --strategies single,mirrored --devices 1,2
      cnnpar report --results results                       # table, summary.md, plots
      cnnpar plan --model 2+2 --devices 2                    # measure every strategy, rank them
      cnnpar train --strategy auto --devices 2               # train with the plan's choice
      cnnpar data kaggle --out data                          # Kaggle-format CSVs
      cnnpar train --data data/train.csv --results results
    """


for _command in (training.train, experiments.sweep, experiments.report, planning.plan_command,
                 serving.export_command, serving.predict, cluster.launch, cluster.cluster_group, data.data):
    main.add_command(_command)


def _one_line_warning(message, category, filename, lineno, line=None):
    """A warning as the command's user reads it: ``Warning: message``, without the source line that raised it.

    >>> _one_line_warning(UserWarning("no checkpoint in ckpt; starting anew"), UserWarning, "fitting.py", 1)
    'Warning: no checkpoint in ckpt; starting anew\\n'
    """
    return f"Warning: {message}\n"


def run():
    """The ``cnnpar`` command: :func:`main`, ended by ``startup.exit_now`` (its commands import TensorFlow with
    ``startup.quiet_start``); warnings print in one line each."""
    warnings.formatwarning = _one_line_warning
    try:
        main()
    except SystemExit as done:  # click's way to end every command, with its exit status
        code = done.code
    if not isinstance(code, int):  # None: success; a message: printed, status 1 (as sys.exit does)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    startup.exit_now(code)
