"""``cnnpar plan``: every configuration measured here and ranked, or on a cluster, or predicted for hosts."""

import math
import os

import click

from keras_cnnpar.cli.common import (
    FORCE,
    MODEL_OPTION_HELP,
    PRECISION,
    Refused,
    check_writable,
    model_from_source,
    model_source,
    not_written,
    quiet_tensorflow,
    refuse_to_overwrite,
)
from keras_cnnpar.cluster import environments
from keras_cnnpar.runtime import atomic


@click.command("plan")
@click.option("--model", "model_kind", metavar="MODEL", default="2+2", show_default=True, callback=model_source,
              help=MODEL_OPTION_HELP)
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
    it measures single, multi-worker, multi-worker accumulating, in bfloat16
    and with PowerSGD, local steps and async-ps there, each beside its
    prediction and saying what it changes in the training; the chief prints
    the table.
    """
    quiet_tensorflow()
    cluster_link = _link(hosts, link, latency, step_seconds, measured_runs)
    measured = _measured(measured_runs)
    on_cluster = hosts is None and environments.detect() is not None
    if on_cluster:
        from keras_cnnpar import strategies

        cluster_strategy = strategies.create("multi-worker", checkpoint_dir=None)  # joins before any tensor
    outputs = ("scaling.csv", "scaling.png") if hosts else ("plan.csv", "plan.png")
    if out_dir is not None:
        refuse_to_overwrite([os.path.join(out_dir, name) for name in outputs], force)
        check_writable(out_dir, "--out")
    import keras

    from keras_cnnpar.plan import planner
    from keras_cnnpar.runtime import devices as device_lib
    from keras_cnnpar.runtime import hardware
    from keras_cnnpar.zoo import data as data_lib

    click.echo(device_lib.describe(device_lib.configure(
        cluster_strategy.local_devices if on_cluster else 1 if hosts else devices)))
    try:
        digits = data_lib.load(source, data_dir=data_dir)
    except data_lib.DataError as error:
        raise click.BadParameter(str(error), param_hint="--data") from None
    keras.utils.set_random_seed(0)
    model = model_from_source(model_kind, digits)
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
    if step_seconds is not None and not step_seconds < math.inf:  # click's range lets inf and nan through
        raise Refused(f"--step-seconds must be a finite number of seconds above 0. Received: --step-seconds "
                      f"{step_seconds}")
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
        runs = [scaling.Measured.parse(text) for text in measured_runs]
    except ValueError as error:
        raise Refused(f"--measured: {error}") from None
    seen = {}
    for text, run in zip(measured_runs, runs):
        if (earlier := seen.setdefault((run.configuration, run.hosts), text)) != text:
            raise Refused(f"--measured: {run.configuration} on {run.hosts} hosts given twice; give each once. "
                          f"Received: --measured {earlier}, --measured {text}")
    return runs


def _plan_hosts(model, model_kind, digits, batch_size, hosts, link, step_seconds, measured, out_dir):
    """``cnnpar plan --hosts``: the predicted scaling table of ``model`` (see :mod:`keras_cnnpar.plan.scaling`)."""
    from keras_cnnpar.plan import planner, scaling

    if step_seconds is None:
        step_seconds = planner.single_step_seconds(model, digits.x, digits.y, batch_size=batch_size)
    try:
        result = scaling.predict(model, hosts, link, step_seconds, batch_size, name=model_kind, measured=measured)
    except ValueError as error:  # a measured run faster than the link allows
        raise Refused(f"--measured: {error}") from None
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
        raise not_written(error, out_dir, "--out", f"neither {names[0]} nor {names[1]} was written") from None
    click.echo(f"wrote {names[0]} and {names[1]} in {out_dir}")
