"""The ``cnnpar`` command line: thin commands over the library.

TensorFlow is imported inside the commands, so ``--help`` is instant and the
logical devices can be created before TensorFlow starts its runtime.
"""

import ast
import os
import sys
import time
import warnings

import click

from keras_cnnpar import __version__
from keras_cnnpar.cluster import environments
from keras_cnnpar.cluster import spec as cluster_lib
from keras_cnnpar.results import runs
from keras_cnnpar.runtime import atomic, startup
from keras_cnnpar.runtime.subprocesses import python_command
from keras_cnnpar.strategies import arguments, registry
from keras_cnnpar.zoo.names import MODEL_NAMES

MODELS = list(MODEL_NAMES)
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


def _quiet_tensorflow():
    startup.quiet_start()


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


@main.command()
@click.option("--model", "model_kind", type=click.Choice(MODELS), default="2+2", show_default=True,
              help="2+2: 2 conv + 2 dense layers; 3+3: 3 conv + 3 dense layers; resnet: a residual CNN with "
                   "BatchNormalization (functional).")
@click.option("--strategy", "strategy_name", type=RegisteredStrategy("auto"), default="single",
              show_default=True,
              help="; ".join(f"{e.alias}: {e.description}" for e in registry.entries())
              + "; auto: the fastest configuration on --devices whose first step matches single's, measured "
                "(see `cnnpar plan`; the plan is cached).")
@click.option("--devices", type=click.IntRange(min=1), default=None,
              help="Devices to train on; logical CPU devices are created when the machine has fewer "
                   "accelerators. Default: 1 for single, every GPU or 2 CPUs for mirrored, 2 for layers and "
                   "channels.")
@click.option("--microbatches", type=click.IntRange(min=1), default=None,
              help="For --strategy layers: micro-batches per batch, pipelined across the stages (default 1).")
@click.option("--mesh", default=None, callback=lambda ctx, param, value: _mesh(value), metavar="DATAxMODEL",
              help="For hybrid: replicas on the batch axis x shards on the channel axis, e.g. 2x2 (default).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="For multi-worker: start this many worker processes on this machine (without it, this process "
                   "is one worker of the cluster that TF_CONFIG, srun or a Kubernetes Indexed Job describes). For "
                   "async-ps: workers of the local cluster (default 2).")
@click.option("--ps", type=click.IntRange(min=1), default=None,
              help="For async-ps: parameter servers of the local cluster (default 1).")
@click.option("--cluster", "cluster_spec", type=click.Path(dir_okay=False), default=None,
              help="For async-ps: JSON spec of running servers, as `cnnpar cluster start` writes it. "
                   "For multi-worker: a TF_CONFIG JSON file instead of the variable.")
@click.option("--coordinator", default=None, metavar="HOST:PORT",
              help="For async-ps with --cluster on other hosts: the address this process announces to the cluster "
                   "as its coordinator, which every task must reach (default: the spec's chief task, else this "
                   "host's address on the interface that routes to the cluster).")
@click.option("--resume", is_flag=True, default=None,
              help="For multi-worker and async-ps: continue an interrupted run from its checkpoint.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="For multi-worker and async-ps: folder of the checkpoints. Default: RESULTS/checkpoints.")
@click.option("--collective-timeout", "timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="For multi-worker: seconds a worker waits for its peers, at the start and in every "
                   "all-reduce, before failing (default 60). For async-ps: seconds to wait for the servers of "
                   "--cluster to answer (default 30).")
@click.option("--accumulate", type=click.IntRange(min=1), default=None,
              help="For single, mirrored and multi-worker: micro-batches of --batch-size per step, their mean "
                   "gradient applied (and synced) once.")
@click.option("--option", "strategy_options", multiple=True, metavar="NAME=VALUE",
              help="Any other option of the strategy's constructor (its __init__ parameters), as NAME=VALUE: a "
                   "Python literal, else text; repeatable. E.g. --strategy async-ps --option warmup_steps=0.")
@click.option("--checks", is_flag=True,
              help="Run the parity protocol's checks: first-step gradient parity with single, input sharding, "
                   "and where the last epoch's time goes (compute, communication, input, idle, from a profiler "
                   "trace); their figures go into the epoch CSV and runs.csv.")
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Global batch, split across the devices.")
@click.option("--data", "source", default="mnist-5k", show_default=True,
              help="mnist-5k (embedded), a Kaggle train.csv or a folder holding one, or tfds:NAME.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="tensorflow-datasets data_dir, for --data tfds:NAME.")
@click.option("--validation-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.2,
              show_default=True, help="Share of each class held out for validation (stratified).")
@click.option("--scale-lr", type=click.Choice(["none", "linear", "sqrt"]), default=None,
              help="Scale the learning rate by the number of replicas (linear) or its square root. "
                   "Default: none.")
@click.option("--results", "results_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Folder of the per-epoch CSV, runs.csv and results.log.")
@click.option("--no-log", is_flag=True, help="Write no result files.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the split, weights and shuffling.")
@PRECISION
@click.option("--fused-optimizer/--no-fused-optimizer", default=True, show_default=True,
              help="Apply the optimizer's updates with TensorFlow's fused kernels (ResourceApplyAdam and kin); "
                   "--no-fused-optimizer keeps Keras's element-wise update, for comparison.")
@click.option("--verbose", type=click.IntRange(0, 2), default=1, show_default=True,
              help="Keras progress: 0 silent, 1 progress bar, 2 one line per epoch.")
@click.option("--export", "export_dir", type=click.Path(file_okay=False), default=None,
              help="After training, export a TF Serving SavedModel under this base folder (models/NAME).")
@click.option("--version", "export_version", type=click.IntRange(min=1), default=None,
              help="Version folder for --export; default: the next free one, from 1.")
def train(model_kind, strategy_name, devices, mesh, microbatches, workers, ps, cluster_spec, coordinator, resume,
          checkpoint_dir, timeout, accumulate, strategy_options, checks, epochs, batch_size, source, data_dir,
          validation_fraction, scale_lr, results_dir, no_log, seed, precision, fused_optimizer, verbose, export_dir,
          export_version):
    """Train a CNN with one strategy and write the run's CSVs, log and weights.

    The weights go to RESULTS/<run>.weights.h5 for `cnnpar export`. Bad data
    exits with code 2 before anything is written. With --strategy multi-worker
    --workers N, N worker processes run this same command; only the chief
    (worker 0) writes files, and any worker's failure fails the command.
    """
    if workers is not None and strategy_name == "multi-worker" and environments.detect() is None:
        return _launch_workers(workers)  # without TensorFlow: the launcher only waits on its workers
    _quiet_tensorflow()
    from keras_cnnpar import strategies

    if workers is not None and strategy_name == "multi-worker":
        _check_worker_count(workers)
        workers = None
    elif workers is not None and not strategies.accepts(strategy_name, "workers"):
        raise click.BadParameter(f"--workers is for --strategy multi-worker or async-ps. "
                                 f"Received: --strategy {strategy_name}", param_hint="--workers")

    import keras

    from keras_cnnpar import api
    from keras_cnnpar.plan.checks import ShardCheckFailed
    from keras_cnnpar.results.callbacks import RunNotRecorded
    from keras_cnnpar.runtime import devices as device_lib
    from keras_cnnpar.zoo import data as data_lib
    from keras_cnnpar.zoo import models

    user_checkpoint_dir = checkpoint_dir is not None
    if checkpoint_dir is None and strategies.accepts(strategy_name, "checkpoint_dir"):
        checkpoint_dir = os.path.join(results_dir, runs.CHECKPOINTS)
    if strategy_name == "auto":
        if strategy_options:
            raise click.BadParameter(f"auto chooses its strategies' options itself. Received: --option "
                                     f"{strategy_options[0]}", param_hint="--option")
        strategy, local_devices = "auto", _auto_devices(devices, checks)
    else:
        options = _strategy_options(strategy_name, strategy_options, {
            "devices": devices, "data": mesh and mesh[0], "model": mesh and mesh[1], "microbatches": microbatches,
            "workers": workers, "ps": ps, "cluster": cluster_spec, "coordinator": coordinator, "resume": resume,
            "checkpoint_dir": checkpoint_dir, "timeout": timeout, "scale_lr": scale_lr, "accumulate": accumulate})
        try:
            strategy = strategies.create(strategy_name, **options)
        except (TypeError, ValueError) as error:
            raise click.BadParameter(str(error), param_hint="--strategy/--devices") from None
        except ConnectionError as error:
            raise click.ClickException(str(error)) from None
        if no_log and not user_checkpoint_dir and strategy.keeps_checkpoints:
            strategy = strategy.replace(checkpoint_dir=None)  # --no-log writes nothing; --checkpoint-dir keeps them
        local_devices = strategy.local_devices
    _check_writable(None if no_log else results_dir, "--results")  # before training: no run lost at its end
    _check_runs_csv(None if no_log else results_dir)
    _check_writable(export_dir, "--export")
    _check_writable(checkpoint_dir if user_checkpoint_dir else None, "--checkpoint-dir")
    _refuse_existing_version(export_dir, export_version)
    click.echo(device_lib.describe(device_lib.configure(local_devices)))
    try:
        digits = data_lib.load(source, data_dir=data_dir)
    except data_lib.DataError as error:
        raise click.BadParameter(str(error), param_hint="--data") from None
    train_part, val_part = data_lib.split(digits, validation_fraction=validation_fraction, seed=seed)
    keras.utils.set_random_seed(seed)
    model = models.cnn(model_kind, input_shape=digits.x.shape[1:], num_classes=digits.num_classes)
    started = time.perf_counter()
    validation = (val_part.x, val_part.y) if len(val_part) else None
    try:
        history = api.fit(model, train_part.x, train_part.y, strategy=strategy, epochs=epochs,
                          batch_size=batch_size, validation_data=validation, verbose=verbose,
                          results_dir=None if no_log else results_dir, precision=precision,
                          fused_optimizer=fused_optimizer, save_weights=True,
                          callbacks=_checks(model, strategy, train_part, batch_size) if checks else None)
    except strategies.Preempted as preempted:
        click.echo(f"preempted: {preempted}", err=True)
        raise
    except (strategies.PeerLost, ShardCheckFailed, RunNotRecorded) as error:  # RunNotRecorded: a full disk, say
        raise click.ClickException(str(error)) from None
    except ValueError as error:  # refused before training (a resume that does not match, a results file)
        raise Refused(str(error)) from None
    strategy = history.strategy  # the one "auto" chose
    if not strategy.is_chief:
        return
    if export_dir is not None:
        _export(model, export_dir, export_version, force=False, recorded=None if no_log else (
            results_dir, os.path.join(results_dir, runs.weights_files(history.run_record)[-1])))
    click.echo(_summary(model, model_kind, digits, train_part, val_part, strategy, batch_size, history,
                        time.perf_counter() - started, None if no_log else results_dir))


def _auto_devices(devices, checks):
    """The devices ``--strategy auto`` plans over: ``--devices``, else 2; on a cluster that the environment
    describes (TF_CONFIG, srun, ...), the cluster is joined first and auto plans across its hosts."""
    if checks:
        raise click.BadParameter("--strategy auto checks the parity of every configuration in its plan; "
                                 "leave --checks out, or name a strategy. Received: --checks", param_hint="--checks")
    if environments.detect() is None:
        return devices or 2
    from keras_cnnpar import strategies

    try:
        return strategies.create("multi-worker", checkpoint_dir=None).local_devices  # joins before any tensor
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint=environments.detect().name) from None


def _checks(model, strategy, train_part, batch_size):
    from keras_cnnpar.plan import checks

    x, y = train_part.x[:batch_size], train_part.y[:batch_size]
    return [checks.GradientParityCheck(model, strategy, x, y),
            checks.ShardCheck(strategy, train_part.x, train_part.y, batch_size),
            checks.StepTimeSplit(model, strategy, x, y)]


def _mesh(value):
    """``"DxM"`` -> ``(D, M)``; None stays None."""
    if value is None:
        return None
    parts = value.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise click.BadParameter(f"expected DATAxMODEL with two positive ints, e.g. 2x2. Received: --mesh {value}")
    return int(parts[0]), int(parts[1])


def _launch_workers(workers):
    """Run this command in ``workers`` local processes (each finds TF_CONFIG set); exit with a failure's code."""
    from keras_cnnpar.cluster import local_workers

    code = local_workers.launch(python_command("-m", "keras_cnnpar.cli", *_command_line(click.get_current_context())),
                                workers)
    if code:
        sys.exit(code)


def _refuse_to_overwrite(paths, force):
    """A usage error naming the first of ``paths`` that exists, unless ``force``."""
    existing = [path for path in paths if os.path.exists(path)]
    if existing and not force:
        raise click.BadParameter(f"{existing[0]} exists; pass --force to replace it, or choose another path. "
                                 f"Received: {existing[0]}", param_hint="--out")


def _check_worker_count(workers):
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


def _command_line(context):
    """The arguments that give ``context``'s command the same parameters again."""
    args = [context.info_name]
    for param in context.command.params:
        args += _option_args(param, context.params[param.name])
    return args


def _option_args(param, value):
    """The arguments that give the click option ``param`` the value ``value`` (none for an unset one)."""
    if value is None or value == ():
        return []
    if isinstance(value, bool):  # a flag: its own name, or its off switch (--no-fused-optimizer)
        names = param.opts if value else param.secondary_opts
        return names[:1]
    if param.multiple:
        return [arg for item in value for arg in (param.opts[0], str(item))]
    return [param.opts[0], str(value)]


def _summary(model, model_kind, digits, train_part, val_part, strategy, batch_size, history, seconds,
             results_dir):
    final = "  ".join(f"{key} {values[-1]}" if isinstance(values[-1], str) else f"{key} {values[-1]:.4f}"
                      for key, values in sorted(history.history.items()))
    lines = [
        "",
        "Run summary",
        f"  model         {model.name} ({model_kind}, {model.count_params():,} parameters)",
        f"  data          {digits.source}: {len(train_part)} train / {len(val_part)} validation",
        f"  strategy      {strategy!r}",
        f"  global batch  {batch_size}, {len(history.epoch)} epochs in {seconds:.1f} s",
        f"  final         {final}",
    ]
    if results_dir is not None:
        record = history.run_record  # this run's row of runs.csv (another run may have appended since)
        lines += [
            f"  throughput    {record['images_per_second']} images/s (median of the epochs after the first), "
            f"speedup vs single {record['speedup'] or 'n/a'}",
            f"  run           {record['run_id']}, its files in "
            f"{os.path.join(results_dir, os.path.dirname(record['epoch_csv']))}",
            f"  files         {os.path.join(results_dir, os.path.basename(record['epoch_csv']))} (the latest run's),",
            f"                {os.path.join(results_dir, runs.RUNS_CSV)}, "
            f"{os.path.join(results_dir, runs.RESULTS_LOG)}",
        ]
    return "\n".join(lines)


class Refused(click.ClickException):
    """A run refused before it trained, for its settings or files: one line, exit code 2 (a usage error)."""

    exit_code = 2


def _check_writable(folder, option, value=None):
    """Refuse (one line, exit 2) unless this process can create files in ``folder`` (or, where it does not exist
    yet, in its nearest existing parent), found by creating one there (:func:`atomic.probe_folder`); None passes.
    ``value``: what the user gave ``option``, where that is a file in ``folder``."""
    if folder is None:
        return
    try:
        atomic.probe_folder(folder)
    except OSError as error:
        where = error.filename or folder
        raise Refused(f"cannot write into {folder}: {where}: {os.strerror(error.errno)}; nothing was done. "
                      f"Received: {option} {value or folder}") from None


def _not_written(error, folder, option, left, value=None):
    """The one-line failure (exit 1) of a write into ``folder`` that the disk stopped (full, say) once the work was
    done; ``left``: what the all-or-nothing write left there; ``value``: what the user gave ``option``, where that
    is a file in ``folder``."""
    reason = os.strerror(error.errno) if error.errno else " ".join(str(error).split())
    return click.ClickException(f"could not write into {folder}: {reason}; {left}. "
                                f"Received: {option} {value or folder}")


def _strategy_options(alias, pairs, given):
    """The constructor options of strategy ``alias``: ``given`` (the dedicated flags' values, None where unset)
    with each ``NAME=VALUE`` of ``pairs`` (``--option``) added, its value a Python literal, else text. A usage
    error names a pair that is not NAME=VALUE of an option the strategy takes, or one a flag set already.

    >>> _strategy_options("async-ps", ["warmup_steps=0", "ema_momentum=None"], {"workers": 2})
    {'workers': 2, 'warmup_steps': 0, 'ema_momentum': None}
    """
    options, accepted = dict(given), registry.entry(alias).options
    for pair in pairs:
        name, equals, text = pair.partition("=")
        if not equals or name not in accepted:
            raise click.BadParameter(f"expected NAME=VALUE, NAME one of {alias}'s options ({', '.join(accepted)}). "
                                     f"Received: --option {pair}", param_hint="--option")
        if options.get(name) is not None:
            raise click.BadParameter(f"{name} is set by its own flag already; give it once. Received: --option "
                                     f"{pair}", param_hint="--option")
        try:
            options[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[name] = text
    return options


def _refuse_existing_version(base_dir, version):
    """Refuse (one line, exit 2, before any work) where the export version ``version`` of ``base_dir`` exists."""
    if base_dir is not None and version is not None and os.path.exists(os.path.join(base_dir, str(version))):
        raise Refused(_existing_version(base_dir, version))


def _existing_version(base_dir, version):
    """The refusal of an export ``version`` that exists, the same for `cnnpar export` and `cnnpar train --export`."""
    return (f"{os.path.join(base_dir, str(version))} already exists; choose another --version, or replace it with "
            f"`cnnpar export --version {version} --force`. Received: --version {version}")


def _check_runs_csv(results_dir):
    """Refuse (exit 2) a results folder whose ``runs.csv`` could not take a run's row without losing one (see
    ``runs.check_runs_csv``); None passes. It only reads: an older file is migrated when the run starts."""
    if results_dir is None:
        return
    try:
        runs.check_runs_csv(results_dir)
    except ValueError as error:
        raise Refused(str(error)) from None


def _export(model, base_dir, version, force, recorded=None):
    """Export ``model`` (:func:`serving.export`); a failure in one line. ``recorded``: ``(results folder, weights
    file)`` of the run that trained it (`cnnpar train --export`), which a failed export leaves as they are."""
    from keras_cnnpar import serving

    try:
        target = serving.export(model, base_dir, version, force=force)
    except FileExistsError:  # created since the refusal before the work
        raise Refused(_existing_version(base_dir, version)) from None
    except serving.ExportError as error:
        done = f"the run is recorded in {recorded[0]} (its weights: {recorded[1]}); " if recorded else ""
        raise click.ClickException(done + str(error)) from None
    click.echo(f"exported {target} (signature serving_default: pixels [N, 784] -> probabilities, class; "
               f"verified in a fresh process)")


def _csv_list(kind, choices=None):
    """A click callback parsing a comma-separated list of ``kind``; ``choices``, a list or a function returning
    one (read when the command runs), limits the values."""

    def parse(ctx, param, value):
        allowed = choices() if callable(choices) else choices
        items = [v.strip() for v in value.split(",") if v.strip()]
        try:
            items = [kind(v) for v in items]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind.__name__}. Received: {value}") from None
        bad = [v for v in items if allowed is not None and v not in allowed]
        if bad or not items:
            expected = sorted(allowed) if allowed else kind.__name__
            raise click.BadParameter(f"expected a comma-separated list of {expected}. Received: {value}")
        return items

    return parse


@main.command()
@click.option("--models", "model_kinds", default=",".join(MODELS), show_default=True, callback=_csv_list(str, MODELS),
              help="Comma-separated model kinds.")
@click.option("--strategies", "strategy_names", default="single,mirrored,async-ps,layers,channels,hybrid",
              show_default=True, callback=_csv_list(str, registry.names), help="Comma-separated strategy names.")
@click.option("--devices", "device_counts", default="1,2,4", show_default=True, callback=_csv_list(int),
              help="Comma-separated device counts (workers for async-ps and multi-worker).")
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--data", "source", default="mnist-5k", show_default=True, help="As for `cnnpar train`.")
@click.option("--results", "results_dir", type=click.Path(file_okay=False), default="results", show_default=True)
@click.option("--timeout", type=click.IntRange(min=1), default=1800, show_default=True,
              help="Seconds one configuration may run.")
@PRECISION
def sweep(model_kinds, strategy_names, device_counts, epochs, batch_size, source, results_dir, timeout, precision):
    """Train every valid model x strategy x devices combination, each in a fresh process, with the checks on.

    Combinations a strategy cannot run are skipped with the reason. A
    configuration already complete in RESULTS/runs.csv (same epochs and
    batch) is skipped, so an interrupted sweep resumes. A failing
    configuration is recorded in RESULTS/sweep.csv and the sweep goes on; the
    command exits 1 when any failed. Then run `cnnpar report`.
    """
    from keras_cnnpar.plan import experiments

    configs, skipped = experiments.plan(model_kinds, strategy_names, device_counts)
    for reason in skipped:
        click.echo(f"skip {reason}")
    failed = []
    with click.progressbar(configs, label="sweep", item_show_func=lambda c: str(c) if c else "") as bar:
        for config in bar:
            if experiments.completed(config, results_dir, epochs, batch_size):
                experiments.record(results_dir, config, "already complete", 0.0)
                continue
            started = time.perf_counter()
            code, tail = experiments.run_config(config, epochs=epochs, batch_size=batch_size, source=source,
                                                precision=precision,
                                                results_dir=results_dir, timeout=timeout)
            experiments.record(results_dir, config, "done" if code == 0 else f"failed ({code})",
                               time.perf_counter() - started, "" if code == 0 else tail)
            if code != 0:
                failed.append(config)
                click.echo(f"\n{config} failed with exit code {code}:\n{tail}", err=True)
    click.echo(f"{len(configs) - len(failed)} of {len(configs)} configurations complete in {results_dir}; "
               f"{len(failed)} failed (see sweep.csv)")
    if failed:
        sys.exit(1)


@main.command("plan")
@click.option("--model", "model_kind", type=click.Choice(MODELS), default="2+2", show_default=True)
@click.option("--devices", type=click.IntRange(min=1), default=2, show_default=True,
              help="Devices to plan for; logical CPU devices are created when the machine has fewer accelerators.")
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True, help="Global batch.")
@click.option("--data", "source", default="mnist-5k", show_default=True, help="As for `cnnpar train`.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="As for `cnnpar train`.")
@PRECISION
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Also write plan.csv and plan.png into this folder.")
@FORCE
@click.option("--fresh", is_flag=True, help="Measure again instead of reading the cached plan.")
@click.option("--hosts", type=click.IntRange(min=1), default=None,
              help="Predict training on 1 to this many hosts joined by --link instead (a cluster you may not have "
                   "yet): images/s, efficiency and communication share of multi-worker and async-ps.")
@click.option("--link", default=None, metavar="RATE",
              help="For --hosts: each host's link rate, as tc writes it: 100mbit, 1gbit, 10gbit (`cnnpar cluster "
                   "probe` measures yours).")
@click.option("--latency", default="0.1ms", show_default=True, metavar="TIME",
              help="For --hosts: one message's latency over the link, e.g. 0.1ms or 50us.")
@click.option("--step-seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="For --hosts: one host's step of the global batch in seconds, where the hosts differ from this "
                   "machine (default: measured here).")
@click.option("--measured", "measured_runs", multiple=True, metavar="CONFIGURATION:HOSTS=IMAGES/S",
              help="For --hosts: images/s a run over this link measured, e.g. multi-worker:2=294 or async-ps:3=199 "
                   "(its parameter server's host and 2 workers'); calibrates that configuration's predictions with "
                   "TensorFlow's transport time (repeatable).")
def plan_command(model_kind, devices, batch_size, source, data_dir, precision, out_dir, force, fresh, hosts, link,
                 latency, step_seconds, measured_runs):
    """Measure every configuration the devices allow on a model and rank them: images/s, speedup, where the step's
    time goes (compute, communication, input, idle), memory per device, first-step parity, and advice.

    Each configuration trains a copy of the model for a few warm steps. The
    plan is cached per model, devices, machine, batch and precision, so a
    second `plan` (or `train --strategy auto`) is instant; --fresh measures again.

    With --hosts N --link RATE it predicts instead, for hosts joined by that link,
    from one host's step measured here (or --step-seconds) and the model's
    gradient bytes: where adding hosts stops paying (--out writes scaling.csv
    and scaling.png); --measured runs calibrate it.

    Run on every host of a cluster (cnnpar launch, srun, or TF_CONFIG on each),
    it measures single, multi-worker, multi-worker accumulating and async-ps
    there, each beside its prediction; the chief prints the table.
    """
    _quiet_tensorflow()
    cluster_link = _link(hosts, link, latency, step_seconds, measured_runs)
    measured = _measured(measured_runs)
    on_cluster = hosts is None and environments.detect() is not None
    if on_cluster:
        from keras_cnnpar import strategies

        cluster_strategy = strategies.create("multi-worker", checkpoint_dir=None)  # joins before any tensor
    outputs = ("scaling.csv", "scaling.png") if hosts else ("plan.csv", "plan.png")
    if out_dir is not None:
        _refuse_to_overwrite([os.path.join(out_dir, name) for name in outputs], force)
        _check_writable(out_dir, "--out")
    import keras

    from keras_cnnpar.plan import planner
    from keras_cnnpar.runtime import devices as device_lib
    from keras_cnnpar.runtime import hardware
    from keras_cnnpar.zoo import data as data_lib
    from keras_cnnpar.zoo import models

    click.echo(device_lib.describe(device_lib.configure(
        cluster_strategy.local_devices if on_cluster else 1 if hosts else devices)))
    try:
        digits = data_lib.load(source, data_dir=data_dir)
    except data_lib.DataError as error:
        raise click.BadParameter(str(error), param_hint="--data") from None
    keras.utils.set_random_seed(0)
    model = models.cnn(model_kind, input_shape=digits.x.shape[1:], num_classes=digits.num_classes)
    if hosts:
        _plan_hosts(model, model_kind, digits, batch_size, hosts, cluster_link, step_seconds, measured, out_dir)
        return
    if on_cluster:
        _plan_on_cluster(model, model_kind, digits, batch_size, precision, cluster_strategy, out_dir)
        return
    result = planner.plan(model, digits.x, digits.y, batch_size=batch_size, devices=devices,
                          precision=hardware.auto_precision() if precision == "auto" else precision,
                          fresh=fresh, log=lambda line: click.echo(line, err=True))
    click.echo(result.table())
    best = result.best(memory_limit_mib=planner.device_memory_mib(devices))  # as `auto` chooses
    click.echo(f"\nauto would choose: {best.configuration if best else 'single (no configuration passed parity)'}"
               + (" (cached plan; --fresh measures again)" if result.cached else ""))
    _write_out(out_dir, ("plan.csv", "plan.png"), lambda: planner.save(result, out_dir))


def _link(hosts, link, latency, step_seconds, measured_runs):
    """The link of ``plan --hosts``, or None without --hosts; a one-line refusal where the options disagree."""
    if hosts is None:
        given = [name for name, value in (("--link", link), ("--step-seconds", step_seconds),
                                          ("--measured", measured_runs or None)) if value is not None]
        if given:
            raise Refused(f"{given[0]} is for --hosts: add --hosts N to predict training on N hosts")
        return None
    if link is None:
        raise Refused("--hosts needs --link RATE, the hosts' link rate: 100mbit, 1gbit or 10gbit, say")
    from keras_cnnpar.cluster import traffic

    try:
        return traffic.Link.parse(link, latency)
    except ValueError as error:
        raise Refused(f"--link/--latency: {error}") from None


def _plan_on_cluster(model, model_kind, digits, batch_size, precision, strategy, out_dir):
    """``cnnpar plan`` on every host of a cluster: single, multi-worker and multi-worker accumulating, measured on
    the hosts (see :mod:`keras_cnnpar.plan.across_hosts`); the chief prints the table and writes --out."""
    from keras_cnnpar.plan import across_hosts
    from keras_cnnpar.runtime import hardware

    result = across_hosts.plan(model, digits.x, digits.y, strategy, name=model_kind, batch_size=batch_size,
                               precision=hardware.auto_precision() if precision == "auto" else precision,
                               log=(lambda line: click.echo(line, err=True)) if strategy.is_chief else _print_nothing)
    if not strategy.is_chief:
        return
    click.echo(result.table())
    click.echo(f"\nfor more hosts: {result.hosts_command()}")
    _write_out(out_dir, ("plan.csv", "plan.png"), lambda: result.save(out_dir))


def _print_nothing(line):
    """A log that keeps the line to itself: the workers of a cluster plan leave the printing to the chief."""


def _measured(measured_runs):
    """The runs of ``plan --hosts --measured`` (:class:`scaling.Measured`); a one-line refusal for one that does not
    read."""
    from keras_cnnpar.plan import scaling

    try:
        return [scaling.Measured.parse(text) for text in measured_runs]
    except ValueError as error:
        raise Refused(f"--measured: {error}") from None


def _plan_hosts(model, model_kind, digits, batch_size, hosts, link, step_seconds, measured, out_dir):
    """``cnnpar plan --hosts``: the predicted scaling table of ``model`` (see :mod:`keras_cnnpar.plan.scaling`)."""
    from keras_cnnpar.plan import planner, scaling

    if step_seconds is None:
        step_seconds = planner.single_step_seconds(model, digits.x, digits.y, batch_size=batch_size)
    result = scaling.predict(model, hosts, link, step_seconds, batch_size, name=model_kind, measured=measured)
    click.echo(result.text())
    _write_out(out_dir, ("scaling.csv", "scaling.png"), lambda: result.save(out_dir))


def _write_out(out_dir, names, save):
    """Call ``save()``, which writes the table and the plot ``names`` into ``out_dir`` (none: nothing to write), and
    say so; the one-line refusal of ``--out`` when they cannot be written (neither is then)."""
    if out_dir is None:
        return
    try:
        with atomic.made_folder(out_dir):
            save()
    except OSError as error:
        raise _not_written(error, out_dir, "--out", f"neither {names[0]} nor {names[1]} was written") from None
    click.echo(f"wrote {names[0]} and {names[1]} in {out_dir}")


@main.command()
@click.option("--results", "results_dir", type=click.Path(file_okay=False), default="results", show_default=True)
def report(results_dir):
    """Summarize RESULTS: a table (printed, summary.csv, summary.md) and plots, flagging efficiency below 80%."""
    _check_writable(results_dir, "--results")
    from keras_cnnpar.plan import experiments

    try:
        _, markdown = experiments.write_report(results_dir)
    except runs.ResultsFileError as error:
        raise Refused(str(error)) from None
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    except OSError as error:
        raise _not_written(error, results_dir, "--results", "the summary files are as they were") from None
    click.echo(markdown)
    click.echo(f"\nwrote summary.csv, summary.md, accuracy.png, throughput.png, speedup.png, efficiency.png "
               f"in {results_dir}")


@main.command("export")
@click.option("--weights", type=click.Path(dir_okay=False), required=True,
              help="A run's weights, RESULTS/<run>.weights.h5, as `cnnpar train` writes them.")
@click.option("--model", "model_kind", type=click.Choice(MODELS), default=None,
              help="The model of the weights; default: read from the file name.")
@click.option("--out", "base_dir", type=click.Path(file_okay=False), required=True,
              help="Base folder of the model, e.g. models/digits (TF Serving's --model_base_path).")
@click.option("--version", type=click.IntRange(min=1), default=None,
              help="Version folder; default: the next free one, from 1.")
@click.option("--force", is_flag=True, help="Replace an existing version (after the new one verified).")
def export_command(weights, model_kind, base_dir, version, force):
    """Export trained weights as a TF Serving SavedModel, verified before it is put in place.

    Writes OUT/VERSION/saved_model.pb, variables/ and assets.extra/tf_serving_warmup_requests.
    """
    _check_writable(base_dir, "--out")
    if not force:
        _refuse_existing_version(base_dir, version)
    _quiet_tensorflow()
    from keras_cnnpar import serving

    try:
        model = serving.load_weights(weights, model_kind)
    except (FileNotFoundError, ValueError) as error:
        raise Refused(str(error)) from None
    _export(model, base_dir, version, force)


@main.command()
@click.option("--model-dir", type=click.Path(file_okay=False), required=True,
              help="An exported version folder, e.g. models/digits/1.")
@click.option("--test", "test_csv", type=click.Path(dir_okay=False), required=True,
              help="Kaggle test.csv: pixel0..pixel783, no label.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Submission CSV to write.")
@FORCE
def predict(model_dir, test_csv, out, force):
    """Write Kaggle ImageId,Label predictions of an export for an unlabeled test.csv.

    Bad input exits with code 2 and writes nothing.
    """
    _check_writable(os.path.dirname(os.path.abspath(out)), "--out", out)
    _quiet_tensorflow()
    from keras_cnnpar import serving
    from keras_cnnpar.zoo import data as data_lib

    if not os.path.isfile(os.path.join(model_dir, "saved_model.pb")):
        raise click.BadParameter(f"{model_dir}: expected an export holding saved_model.pb. "
                                 f"Received: model_dir={model_dir}", param_hint="--model-dir")
    _refuse_to_overwrite([out], force)
    try:
        rows = serving.predict_csv(model_dir, test_csv, out)
    except data_lib.DataError as error:
        raise click.BadParameter(str(error), param_hint="--test") from None
    except serving.NotAnExport as error:
        raise Refused(str(error)) from None
    except OSError as error:
        raise _not_written(error, os.path.dirname(os.path.abspath(out)), "--out", f"{out} was not written",
                           out) from None
    click.echo(f"wrote {out} ({rows} predictions)")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes to start (under srun or in a Kubernetes Indexed Job: one per task, this option "
                   "optional).")
@click.option("--network", "network_kind", type=click.Choice(["private", "host"]), default="private",
              show_default=True, help="private: the workers see only their own loopback (nothing can reach their "
                                      "servers; they reach no remote service); host: this machine's network.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def launch(workers, network_kind, command):
    """Run any training script once per worker on this machine under MultiWorker, as torchrun does.

    \b
      cnnpar launch --workers 2 -- python train.py --epochs 3

    Each process gets its own TF_CONFIG on loopback and joins the cluster when
    it imports keras_cnnpar, so the script may build its model first and call
    model.fit(..., strategy="multi-worker") later. By default the workers run
    in a private network namespace (where the user may make one): only their
    own loopback, so nothing can reach their unauthenticated TensorFlow
    servers, and a script cannot download data or log to a remote service;
    --network host gives them this machine's network (and a warning that the
    servers listen on its interfaces). The chief's output is streamed; a
    failing worker fails the command, naming it; SIGTERM and Ctrl-C are passed
    on. The same script runs on several hosts with TF_CONFIG and
    CNNPAR_MULTI_WORKER=1 set on each. Where a scheduler started each worker
    (no TF_CONFIG; srun's Slurm job step, or a Kubernetes Indexed Job's pods
    with CNNPAR_K8S_WORKERS and CNNPAR_K8S_SERVICE set) the command runs once,
    in this process's network, and joins the cluster that the scheduler's
    variables describe (keras_cnnpar.cluster.environments):

    \b
      srun --ntasks-per-node=1 cnnpar launch -- python train.py --epochs 3
    """
    from keras_cnnpar.cluster import local_workers

    command = [sys.executable if command[0] in ("python", "python3") else command[0], *command[1:]]
    environment = environments.detect()
    if environment is not None and environment.creates_processes_externally:
        if workers is not None:
            _check_worker_count(workers)
        os.execvpe(command[0], command, {**os.environ, cluster_lib.JOIN_AT_IMPORT: "1"})
    if workers is None:
        schedulers = " or ".join(kind.name for kind in environments.ENVIRONMENTS if kind.creates_processes_externally)
        raise click.UsageError(f"Missing option '--workers' (needed unless {schedulers} started this process).")
    code = local_workers.launch(command, workers, env={cluster_lib.JOIN_AT_IMPORT: "1"}, network_kind=network_kind)
    if code:
        sys.exit(code)


@main.group("cluster")
def cluster_group():
    """TensorFlow server processes for --strategy async-ps: on this machine (start, stop) or on each host (serve);
    the links between them (probe)."""


@cluster_group.command("start")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--ps", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="JSON file to write: the cluster's addresses and the servers' process ids.")
def cluster_start(workers, ps, spec_path):
    """Start one server process per task on loopback and write their spec.

    Train on them with `cnnpar train --strategy async-ps --cluster SPEC`; end
    them with `cnnpar cluster stop --spec SPEC`.
    """
    from keras_cnnpar.cluster import network, servers

    try:
        config = servers.start_servers(workers, ps, spec_path)
    except FileExistsError as error:
        raise click.BadParameter(str(error), param_hint="--spec") from None
    except OSError as error:
        if isinstance(error, ConnectionError):
            raise click.ClickException(str(error)) from None
        raise click.BadParameter(f"cannot write the spec {spec_path}: {error.strerror}; no server was started. "
                                 f"Received: --spec {spec_path}", param_hint="--spec") from None
    except RuntimeError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"started {workers} workers and {ps} parameter servers: {config['cluster']}; spec in {spec_path}")
    ports = [address.rpartition(":")[2] for addresses in config["cluster"].values() for address in addresses]
    click.echo(network.exposure_warning("cluster", ports), err=True)


@cluster_group.command("stop")
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="The spec file `cnnpar cluster start` wrote.")
def cluster_stop(spec_path):
    """End the server processes of a spec file and remove it."""
    from keras_cnnpar.cluster import servers

    try:
        stopped = servers.stop_servers(spec_path)
    except (FileNotFoundError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--spec") from None
    click.echo(f"stopped {stopped} server processes; removed {spec_path}")


@cluster_group.command("serve")
@click.option("--cluster", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="The cluster's spec: JSON with 'worker' and 'ps' jobs (as `cluster start` writes it, a TF_CONFIG, "
                   "or a bare jobs map).")
@click.option("--job", type=click.Choice(["worker", "ps"]), required=True, help="This task's job.")
@click.option("--index", type=click.IntRange(min=0), required=True, help="This task's index in its job.")
def cluster_serve(spec_path, job, index):
    """Run one task's TensorFlow server, on a host of a multi-host cluster, until SIGTERM or Ctrl-C.

    Run it once per worker and parameter server, each on the host its address in
    the spec names, then train from any host with `cnnpar train --strategy
    async-ps --cluster SPEC`. It prints one line when the server is up. The
    server listens on every interface of its host at its port and runs any graph
    sent to it, unauthenticated: use it on trusted networks only (docs/hosts.md).
    """
    startup.quiet_start(keras=False)  # a server runs the graphs sent to it
    from keras_cnnpar.cluster import servers
    from keras_cnnpar.cluster import spec as cluster

    try:
        spec = cluster.parse_spec(spec_path)
        servers.serve(spec, job, index, announce=True)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--cluster/--job/--index") from None


@cluster_group.command("probe")
@click.option("--cluster", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="The cluster's spec, as for `cluster serve` (worker and ps jobs); its servers must be running.")
@click.option("--coordinator", default=None, metavar="HOST:PORT",
              help="This process's address, which every task must reach, as for `train --coordinator` (default: "
                   "this host's address on the interface that routes to the cluster).")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=0.5, show_default=True,
              help="How long the largest transfer of each pair takes at least (tensors double until it does).")
def cluster_probe(spec_path, coordinator, seconds):
    """Measure the link from the first task of a running cluster to every other task, with TensorFlow's own
    transport: the rate and the round trip of each pair, and the slowest pair's as `cnnpar plan --hosts`
    options."""
    _quiet_tensorflow()
    from keras_cnnpar.cluster import network
    from keras_cnnpar.cluster import spec as cluster
    from keras_cnnpar.plan import probe

    try:
        spec = cluster.parse_spec(spec_path)
        chief = cluster.coordinator_address(spec, coordinator)
        network.wait_reachable(spec, 30)
    except ValueError as error:
        raise Refused(str(error)) from None
    except ConnectionError as error:
        raise click.ClickException(str(error)) from None
    click.echo(network.exposure_warning("probe's coordinator", [chief.rpartition(":")[2]]), err=True)
    measured = probe.probe(spec, chief, seconds=seconds)
    for pair in measured:
        click.echo(str(pair))
    slowest = min(measured, key=lambda pair: pair.bits_per_second).link()
    click.echo(f"slowest link: --link {slowest.bits_per_second / 1e6:.0f}mbit "
               f"--latency {slowest.latency_seconds * 1e3:.2f}ms")


@main.group()
def data():
    """Prepare data files."""


@data.command("kaggle")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Folder for train.csv and test.csv.")
@click.option("--test-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2,
              show_default=True, help="Share of each class written, unlabeled, to test.csv.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@FORCE
def kaggle(out_dir, test_fraction, seed, force):
    """Write the embedded digits as Kaggle digit-recognizer CSVs.

    train.csv has label,pixel0..pixel783; test.csv has pixel0..pixel783 and no label.
    """
    _check_writable(out_dir, "--out")
    _quiet_tensorflow()
    from keras_cnnpar.zoo import data as data_lib

    _refuse_to_overwrite([os.path.join(out_dir, name) for name in ("train.csv", "test.csv")], force)
    try:
        paths = data_lib.write_kaggle(out_dir, test_fraction=test_fraction, seed=seed)
    except OSError as error:
        raise _not_written(error, out_dir, "--out", "neither train.csv nor test.csv was written") from None
    for path in paths:
        click.echo(f"wrote {path}")


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


if __name__ == "__main__":
    run()
