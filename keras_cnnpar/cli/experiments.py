"""``cnnpar sweep`` and ``cnnpar report``: many runs, and the report of all runs in a results folder."""

import sys
import time

import click

from keras_cnnpar.cli.common import (
    MODELS,
    PRECISION,
    Refused,
    check_writable,
    model_from_source,
    model_source,
    not_written,
    quiet_tensorflow,
)
from keras_cnnpar.results import runs
from keras_cnnpar.strategies import registry
from keras_cnnpar.zoo.names import MODEL_NAMES


def _csv_list(kind, choices=None, minimum=None):
    """A click callback parsing a comma-separated list of ``kind``; ``choices``, a list or a function returning
    one (read when the command runs), or ``minimum`` limits the values."""

    def parse(ctx, param, value):
        allowed = choices() if callable(choices) else choices
        items = [v.strip() for v in value.split(",") if v.strip()]
        try:
            items = [kind(v) for v in items]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind.__name__}. Received: {value}") from None
        bad = [v for v in items if (allowed is not None and v not in allowed) or (minimum is not None and v < minimum)]
        if bad or not items:
            expected = sorted(allowed) if allowed else kind.__name__ + (f" of at least {minimum}" if minimum else "")
            raise click.BadParameter(f"expected a comma-separated list of {expected}. Received: {value}")
        return items

    return parse


def _model_sources(ctx, param, value):
    """``--models``: a comma-separated list, each as ``--model`` of ``cnnpar train`` takes it (its form checked)."""
    return [model_source(ctx, param, source) for source in _csv_list(str)(ctx, param, value)]


@click.command()
@click.option("--models", "model_kinds", default=",".join(MODELS), show_default=True, callback=_model_sources,
              help="Comma-separated models, each as --model of `cnnpar train` takes it: 2+2, 3+3, resnet, a .keras "
                   "file or package.module:function.")
@click.option("--strategies", "strategy_names", default="single,mirrored,async-ps,layers,channels,hybrid",
              show_default=True, callback=_csv_list(str, registry.names), help="Comma-separated strategy names.")
@click.option("--devices", "device_counts", default="1,2,4", show_default=True, callback=_csv_list(int, minimum=1),
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

    names = _model_names(model_kinds, source)
    configs, skipped = experiments.plan(model_kinds, strategy_names, device_counts)
    for reason in skipped:
        click.echo(f"skip {reason}")
    failed = []
    with click.progressbar(configs, label="sweep", item_show_func=lambda c: str(c) if c else "") as bar:
        for config in bar:
            if experiments.completed(config, names[config.model], results_dir, epochs, batch_size):
                experiments.record(results_dir, config, "already complete", 0.0)
                continue
            started = time.perf_counter()
            try:
                code, tail = experiments.run_config(config, epochs=epochs, batch_size=batch_size, source=source,
                                                    precision=precision, results_dir=results_dir, timeout=timeout)
            except BaseException:  # Ctrl-C, SIGTERM: the configuration was killed with the sweep
                experiments.record(results_dir, config, "interrupted", time.perf_counter() - started,
                                   "the sweep was stopped; run it again to resume")
                raise
            experiments.record(results_dir, config, "done" if code == 0 else f"failed ({code})",
                               time.perf_counter() - started, "" if code == 0 else tail)
            if code != 0:
                failed.append(config)
                click.echo(f"\n{config} failed with exit code {code}:\n{tail}", err=True)
    click.echo(f"{len(configs) - len(failed)} of {len(configs)} configurations complete in {results_dir}; "
               f"{len(failed)} failed (see sweep.csv)")
    if failed:
        sys.exit(1)


def _model_names(sources, data_source):
    """``{source: the Keras name of its model}``, the name its runs have in runs.csv. A user's model is built
    here, once, for the data: one that does not fit it is refused in one line before any configuration runs."""
    names = {source: MODEL_NAMES[source] for source in sources if source in MODEL_NAMES}
    if len(names) < len(sources):
        quiet_tensorflow()
        from keras_cnnpar.zoo import data as data_lib

        try:
            digits = data_lib.load(data_source)
        except data_lib.DataError as error:
            raise click.BadParameter(str(error), param_hint="--data") from None
        names.update({source: model_from_source(source, digits).name for source in sources if source not in names})
    return names


@click.command()
@click.option("--results", "results_dir", type=click.Path(file_okay=False), default="results", show_default=True)
def report(results_dir):
    """Summarize RESULTS: a table (printed, summary.csv, summary.md) and plots, flagging efficiency below 80%."""
    check_writable(results_dir, "--results")
    from keras_cnnpar.plan import experiments

    try:
        _, markdown = experiments.write_report(results_dir)
    except runs.ResultsFileError as error:
        raise Refused(str(error)) from None
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    except OSError as error:
        raise not_written(error, results_dir, "--results", "the summary files are as they were") from None
    click.echo(markdown)
    click.echo(f"\nwrote summary.csv, summary.md, accuracy.png, throughput.png, speedup.png, efficiency.png "
               f"in {results_dir}")
