"""``cnnpar train``: one run of a CNN under one strategy, its files written by the chief."""

import ast
import os
import sys
import time

import click

from keras_cnnpar.cli.common import (
    MODEL_OPTION_HELP,
    PRECISION,
    SEED,
    Refused,
    RegisteredStrategy,
    check_worker_count,
    check_writable,
    model_from_source,
    model_source,
    quiet_tensorflow,
)
from keras_cnnpar.cli.serving import export_model, refuse_existing_version
from keras_cnnpar.cluster import environments
from keras_cnnpar.results import runs
from keras_cnnpar.runtime.subprocesses import python_command
from keras_cnnpar.strategies import registry


@click.command()
@click.option("--model", "model_kind", metavar="MODEL", default="2+2", show_default=True, callback=model_source,
              help=MODEL_OPTION_HELP)
@click.option("--strategy", "strategy_name", type=RegisteredStrategy("auto"), default="single",
              show_default=True,
              help="; ".join(f"{e.alias}: {e.description}" for e in registry.entries(plugins=False))
              + "; an installed plugin's strategies are choices too; auto: the fastest configuration on --devices "
                "whose first step matches single's, measured (see `cnnpar plan`; the plan is cached); on a cluster "
                "(TF_CONFIG, srun), multi-worker or single on the chief, measured across the hosts.")
@click.option("--devices", type=click.IntRange(min=1), default=None,
              help="Devices to train on; logical CPU devices are created when the machine has fewer "
                   "accelerators. Default: 1 for single, every GPU or 2 CPUs for mirrored, 2 for layers and "
                   "channels.")
@click.option("--microbatches", type=click.IntRange(min=1), default=None,
              help="For --strategy layers: micro-batches per batch, pipelined across the stages (default 1).")
@click.option("--mesh", default=None, callback=lambda ctx, param, value: _mesh(value), metavar="DATAxMODEL",
              help="For hybrid: replicas on the batch axis x shards on the channel axis, e.g. 2x2 (default).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="For multi-worker and local-steps: start this many worker processes on this machine (without "
                   "it, this process is one worker of the cluster that TF_CONFIG, srun or a Kubernetes Indexed Job "
                   "describes). For async-ps: workers of the local cluster (default 2).")
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
              help="For multi-worker, local-steps and async-ps: continue an interrupted run from its checkpoint.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="For multi-worker, local-steps and async-ps: folder of the checkpoints. Default: "
                   "RESULTS/checkpoints.")
@click.option("--collective-timeout", "timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="For multi-worker and local-steps: seconds a worker waits for its peers, at the start and in every "
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
    launched = workers is not None and _runs_in_launched_workers(strategy_name)
    if launched and environments.detect() is None:
        return _launch_workers(workers)  # without TensorFlow: the launcher only waits on its workers
    quiet_tensorflow()
    from keras_cnnpar import strategies

    if launched:
        check_worker_count(workers)
        workers = None
    elif workers is not None and not strategies.accepts(strategy_name, "workers"):
        raise click.BadParameter(f"--workers is for --strategy multi-worker, local-steps or async-ps. "
                                 f"Received: --strategy {strategy_name}", param_hint="--workers")

    import keras

    from keras_cnnpar import api
    from keras_cnnpar.plan.checks import ShardCheckFailed
    from keras_cnnpar.results.callbacks import RunNotRecorded
    from keras_cnnpar.runtime import devices as device_lib
    from keras_cnnpar.zoo import data as data_lib

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
            raise Refused(str(error)) from None  # the message names the option or variable
        except ConnectionError as error:
            raise click.ClickException(str(error)) from None
        if no_log and not user_checkpoint_dir and strategy.keeps_checkpoints:
            strategy = strategy.replace(checkpoint_dir=None)  # --no-log writes nothing; --checkpoint-dir keeps them
        local_devices = strategy.local_devices
    check_writable(None if no_log else results_dir, "--results")  # before training: no run lost at its end
    _check_runs_csv(None if no_log else results_dir)
    check_writable(export_dir, "--export")
    check_writable(checkpoint_dir if user_checkpoint_dir else None, "--checkpoint-dir")
    refuse_existing_version(export_dir, export_version)
    click.echo(device_lib.describe(device_lib.configure(local_devices)))
    try:
        digits = data_lib.load(source, data_dir=data_dir)
    except data_lib.DataError as error:
        raise click.BadParameter(str(error), param_hint="--data") from None
    train_part, val_part = data_lib.split(digits, validation_fraction=validation_fraction, seed=seed)
    keras.utils.set_random_seed(seed)
    model = model_from_source(model_kind, digits)
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
        export_model(model, export_dir, export_version, force=False, recorded=None if no_log else (
            results_dir, os.path.join(results_dir, runs.weights_files(history.run_record)[-1])))
    click.echo(_summary(model, model_kind, digits, train_part, val_part, strategy, batch_size, history,
                        time.perf_counter() - started, None if no_log else results_dir))


def _runs_in_launched_workers(alias):
    """Whether ``--workers N`` of strategy ``alias`` starts N processes that each run this command (multi-worker,
    local-steps): its device count is ``--workers``, yet it takes no ``workers`` option (async-ps does: it starts
    servers that one process drives).

    >>> _runs_in_launched_workers("multi-worker"), _runs_in_launched_workers("async-ps")
    (True, False)
    """
    return (alias in registry.names() and registry.entry(alias).device_option == "workers"
            and "workers" not in registry.entry(alias).options)


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


#: The options whose ``cnnpar train`` flag is not ``--`` and the option's name (``checkpoint_dir``:
#: ``--checkpoint-dir``).
FLAGS_NAMED_OTHERWISE = {"data": "--mesh", "model": "--mesh", "timeout": "--collective-timeout"}


def _strategy_options(alias, pairs, given):
    """The constructor options of strategy ``alias``: ``given`` (the options that have flags of their own, with
    the flags' values, None where unset) with each ``NAME=VALUE`` of ``pairs`` (``--option``) added, its value a
    Python literal, else text. A usage error names a pair that is not NAME=VALUE of an option the strategy takes,
    one that has a flag (a name in ``given``), or one given twice.

    >>> _strategy_options("async-ps", ["warmup_steps=0", "ema_momentum=None"], {"workers": 2})
    {'workers': 2, 'warmup_steps': 0, 'ema_momentum': None}
    """
    options, accepted, named = dict(given), registry.entry(alias).options, {}
    for pair in pairs:
        name, equals, text = pair.partition("=")
        shown = pair if pair.isprintable() else repr(pair)  # a newline or a control character: the error one line
        if not equals or name not in accepted:
            raise click.BadParameter(f"expected NAME=VALUE, NAME one of {alias}'s options ({', '.join(accepted)}). "
                                     f"Received: --option {shown}", param_hint="--option")
        if name in given:
            flag = FLAGS_NAMED_OTHERWISE.get(name, "--" + name.replace("_", "-"))
            raise click.BadParameter(f"{name} has a flag of its own: give it as {flag}. Received: "
                                     f"--option {shown}", param_hint="--option")
        if name in named:
            raise click.BadParameter(f"{name} is given twice; give it once. Received: --option {named[name]}, "
                                     f"--option {shown}", param_hint="--option")
        named[name] = shown
        try:
            options[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError, RecursionError, MemoryError):  # the last two: a literal nested too deep
            options[name] = text
    return options


def _check_runs_csv(results_dir):
    """Refuse (exit 2) a results folder whose ``runs.csv`` could not take a run's row without losing one (see
    ``runs.check_runs_csv``); None passes. It only reads: an older file is migrated when the run starts."""
    if results_dir is None:
        return
    try:
        runs.check_runs_csv(results_dir)
    except ValueError as error:
        raise Refused(str(error)) from None
