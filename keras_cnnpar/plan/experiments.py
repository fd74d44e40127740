"""Sweeps over models x strategies x device counts, and the report that reads their results back.

The original protocol: every configuration gets its own CSV; speedup is T1/TN
against the same model's Single run at the same global batch (the rule of
``runs.csv``, in :mod:`keras_cnnpar.results.runs`); efficiency is speedup / N, and below 80%
means: look where the time goes (the largest share of the measured time
split names the cause) before trusting the figures; parity is checked first.

Example:

>>> [(c.model, c.strategy, c.devices) for c in plan(["2+2"], ["single", "mirrored"], [1, 2])[0]]
[('2+2', 'single', 1), ('2+2', 'mirrored', 2)]
>>> for reason in plan(["2+2"], ["single", "hybrid"], [2])[1]:
...     print(reason)
single on 2 devices: single runs on 1 device
hybrid on 2 devices: hybrid needs a multiple of 2 devices, at least 4
"""

import contextlib
import csv
import dataclasses
import functools
import math
import os
import signal
import subprocess
import time
from pathlib import Path

from keras_cnnpar.plan import figures
from keras_cnnpar.results import runs
from keras_cnnpar.runtime.atomic import write_together
from keras_cnnpar.runtime.subprocesses import dying_with_parent, python_command
from keras_cnnpar.strategies import registry

#: Summary columns, in order.
SUMMARY_COLUMNS = ["model", "strategy", "devices", "images_per_second", "speedup", "efficiency", "val_accuracy",
                   "parity", "grad_parity_max_abs_diff", *runs.SHARE_COLUMNS, "flag"]
EFFICIENCY_FLOOR = 0.8


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of a sweep."""

    model: str
    strategy: str
    devices: int

    def train_args(self):
        """The ``cnnpar train`` options that select this configuration's strategy and devices.

        The strategy's registered ``device_option`` says which option sets the
        count; a mesh keeps 2 shards on the channel axis.
        """
        option = registry.entry(self.strategy).device_option
        if option is None:
            return []
        return [f"--{option}", f"{self.devices // 2}x2" if option == "mesh" else str(self.devices)]

    def __str__(self):
        return f"{self.model} {self.strategy} on {self.devices} device{'s' * (self.devices > 1)}"


def plan(model_kinds, strategy_names, device_counts):
    """``(valid configurations, skip reasons)`` for every combination; the registry says which are valid."""
    valid, skipped = [], []
    for kind in model_kinds:
        for strategy in strategy_names:
            for devices in device_counts:
                reason = registry.entry(strategy).invalid(devices)
                if reason is None:
                    valid.append(Config(kind, strategy, devices))
                elif kind == model_kinds[0]:
                    skipped.append(f"{strategy} on {devices} devices: {reason}")
    return valid, skipped


def completed(config, model_name, results_dir, epochs, batch_size):
    """Whether ``runs.csv`` holds a finished run of ``config``, whose model is named ``model_name``, with these
    epochs and batch."""
    rows = runs.read_csv(Path(results_dir) / runs.RUNS_CSV)
    return any(r["model"] == model_name and r["strategy"] == config.strategy
               and r["devices"] == str(config.devices) and r["global_batch"] == str(batch_size)
               and r["epochs"] == str(epochs) for r in rows)


def run_config(config, *, epochs, batch_size, source, results_dir, timeout=1800, precision="float32"):
    """Train ``config`` in a fresh process with the checks on; return ``(returncode, last output lines)``.

    Past ``timeout`` seconds the configuration's whole process group is killed
    (local workers die with their launcher), and the return code is -1. So it
    is when the sweep is interrupted (Ctrl-C, SIGTERM) or killed: no
    configuration trains on after its sweep.
    """
    command = python_command("-m", "keras_cnnpar.cli", "train", "--model", config.model, "--strategy",
                             config.strategy, *config.train_args(), "--epochs", str(epochs), "--batch-size",
                             str(batch_size), "--data", source, "--results", str(results_dir), "--checks",
                             "--precision", precision, "--verbose", "0")
    process = subprocess.Popen(dying_with_parent(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(process)
        return -1, f"timed out after {timeout} s"
    except BaseException:  # interrupted: the configuration goes with the sweep
        _end(process)
        raise
    return process.returncode, "\n".join(output.strip().splitlines()[-5:])


def _end(process):
    """Kill ``process``'s group and reap it; its output is not waited for (a process outside the group may still
    hold the pipe)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.stdout.close()
    process.wait()


def record(results_dir, config, status, seconds, detail=""):
    """Append a line for ``config`` to ``sweep.csv`` (the sweep's own record, failures included)."""
    path = Path(results_dir) / "sweep.csv"
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        if new:
            writer.writerow(["timestamp", "model", "strategy", "devices", "status", "seconds", "detail"])
        writer.writerow([time.strftime("%Y-%m-%dT%H:%M:%S"), config.model, config.strategy, config.devices, status,
                         round(seconds, 1), detail.replace("\n", " | ")])


def summarize(results_dir, recorded=None):
    """One summary row per configuration (its latest run) from ``runs.csv`` (``recorded``: its rows, as
    :func:`keras_cnnpar.results.runs.read_runs` reads them) and the epoch CSVs.

    Speedup follows ``runs.csv``'s rule (:func:`keras_cnnpar.results.runs.single_throughput`):
    against the latest Single run of the same model, global batch, precision, data and machine.
    """
    results_dir = Path(results_dir)
    recorded = runs.read_runs(results_dir / runs.RUNS_CSV) if recorded is None else recorded
    latest = {(row["model"], row["strategy"], row["devices"]): row for row in recorded}
    rows = []
    for (model, strategy, devices), run in latest.items():
        epochs = runs.read_csv(results_dir / run["epoch_csv"])
        last = epochs[-1] if epochs else {}
        throughput = float(run["images_per_second"]) if run["images_per_second"] else ""
        speedup, efficiency = runs.speedup_and_efficiency(
            strategy, devices, throughput, runs.single_throughput(recorded, run))
        row = {"model": model, "strategy": strategy, "devices": int(devices), "images_per_second": _number(throughput),
               "speedup": _number(speedup), "efficiency": _number(efficiency),
               "val_accuracy": _number(run["val_accuracy"]),
               "parity": last.get("grad_parity_verdict", "") or "n/a",
               "grad_parity_max_abs_diff": _number(last.get("grad_parity_max_abs_diff", "")),
               **{key: _number(run.get(key, "")) for key in runs.SHARE_COLUMNS}}
        row["flag"] = likely_cause(row)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["model"], r["strategy"] != "single", r["strategy"], r["devices"]))


#: What the largest share of a slow configuration's time split points at.
CAUSES = {
    "communication": "sync less often (accumulate) or fewer devices",
    "idle": "the devices wait (pipeline bubbles, dispatch, stragglers): more micro-batches or a larger batch",
    "input": "the input pipeline starves the devices",
    "compute": "the devices share the same cores or memory, so splitting the work adds no compute",
}


def likely_cause(row):
    """Why a configuration's efficiency is below the floor: the largest share of its measured time split;
    empty when the efficiency is not below it.

    >>> print(likely_cause({"strategy": "mirrored", "efficiency": 0.4, "compute_share": 0.3, "communication_share": 0.6,
    ...                     "input_share": 0.0, "idle_share": 0.1, "parity": "pass"}))
    efficiency 40% < 80%: communication takes 60% of the devices' time: sync less often (accumulate) or fewer devices
    """
    if row["strategy"] == "single" or not row["efficiency"] < EFFICIENCY_FLOOR:
        return "" if row.get("parity") != "FAIL" else "gradient parity FAILED: a bug, not noise"
    head = f"efficiency {row['efficiency']:.0%} < {EFFICIENCY_FLOOR:.0%}: "
    shares = {kind: row.get(f"{kind}_share", math.nan) for kind in CAUSES}
    if all(math.isnan(share) for share in shares.values()):
        return head + "no time split measured (cnnpar train --checks measures it)"
    kind = max(shares, key=lambda k: -1.0 if math.isnan(shares[k]) else shares[k])
    return head + f"{kind} takes {shares[kind]:.0%} of the devices' time: {CAUSES[kind]}"


def write_report(results_dir):
    """Write ``summary.csv``, ``summary.md`` and the plots into ``results_dir``, all at once (a failure to write
    one, a full disk, leaves every summary file as it was); return the rows and the Markdown.

    A ``runs.csv`` that does not read as a version wrote it raises
    :class:`keras_cnnpar.results.runs.ResultsFileError` (see :func:`keras_cnnpar.results.runs.read_runs`), and so
    does a results file that cannot be read at all (a folder in its place, say).
    """
    results_dir = Path(results_dir)
    try:
        recorded = runs.read_runs(results_dir / runs.RUNS_CSV)
        rows = summarize(results_dir, recorded)
    except OSError as error:
        raise runs.ResultsFileError(f"{error.filename or results_dir}: cannot read it: {os.strerror(error.errno)}; "
                                    f"nothing was written. Received: --results {results_dir}") from None
    if not rows:
        raise ValueError(f"no runs to report: {results_dir / 'runs.csv'} is missing or empty. "
                         f"Received: --results {results_dir}")
    markdown = markdown_table(rows) + "\n\n" + provenance_text(recorded)
    drawn = plot(results_dir, rows, recorded)
    try:
        write_together({
            results_dir / "summary.csv": runs.csv_text(SUMMARY_COLUMNS, [{k: _cell(v) for k, v in row.items()}
                                                                         for row in rows]),
            results_dir / "summary.md": "# Sweep summary\n\n" + markdown + "\n",
            **{results_dir / name: functools.partial(_save, figure) for name, figure in drawn.items()}})
    finally:
        _close(drawn.values())
    return rows, markdown


def provenance_text(recorded):
    """What produced the latest run of each configuration: each package version, TensorFlow version and
    machine with its number of runs; a warning first when they differ (the figures then do not compare).

    >>> print(provenance_text([{"model": "m", "strategy": "single", "devices": "1", "version": "0.1.0",
    ...                         "tensorflow": "2.21.0", "machine": "AMD EPYC"}]))
    Produced by: version 0.1.0, TensorFlow 2.21.0, machine AMD EPYC (1 runs)
    """
    latest = {(r["model"], r["strategy"], r["devices"]): r for r in recorded}.values()
    keys = [(r.get("version") or "unknown", r.get("tensorflow") or "unknown", r.get("machine") or "unknown")
            for r in latest]
    lines = [f"Produced by: version {v}, TensorFlow {t}, machine {m} ({keys.count((v, t, m))} runs)"
             for v, t, m in sorted(set(keys))]
    if len(set(keys)) > 1:
        lines.insert(0, "Warning: this table mixes machines or versions; compare only rows produced alike.")
    return "\n".join(lines)


def markdown_table(rows):
    """The summary rows as a Markdown table."""
    header = "| " + " | ".join(SUMMARY_COLUMNS) + " |"
    lines = [header, "|" + "---|" * len(SUMMARY_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in SUMMARY_COLUMNS) + " |")
    return "\n".join(lines)


def plot(results_dir, rows, recorded):
    """The figures of the summary ``rows`` (and ``runs.csv``'s ``recorded`` rows) by file name: ``accuracy.png``
    (validation accuracy per epoch), ``throughput.png``, ``speedup.png`` and ``efficiency.png``."""
    from matplotlib import ticker

    pyplot = figures.pyplot()

    kinds = sorted({r["model"] for r in rows})
    figure, axes = pyplot.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    latest = {(r["model"], r["strategy"], r["devices"]): r for r in recorded}
    for axis, kind in zip(axes[0], kinds):
        for (model, strategy, devices), run in sorted(latest.items()):
            if model == kind:
                epochs = runs.read_csv(Path(results_dir) / run["epoch_csv"])
                axis.plot([int(e["epoch"]) for e in epochs], [_number(e.get("val_accuracy", "")) for e in epochs],
                          marker="o", label=f"{strategy} x{devices}")
        axis.set(title=runs.model_label(kind), xlabel="epoch", ylabel="validation accuracy")
        axis.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        axis.legend(fontsize=7)
    drawn = {"accuracy.png": figure}
    for column, label in (("images_per_second", "images/s"), ("speedup", "speedup vs single"),
                          ("efficiency", "efficiency (speedup / N)")):
        figure, axes = pyplot.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
        for axis, kind in zip(axes[0], kinds):
            chosen = [r for r in rows if r["model"] == kind]
            axis.bar([f"{r['strategy']}\nx{r['devices']}" for r in chosen], [r[column] for r in chosen])
            if column == "efficiency":
                axis.axhline(EFFICIENCY_FLOOR, color="red", linestyle="--", linewidth=1)
            axis.set(title=runs.model_label(kind), ylabel=label)
            axis.tick_params(axis="x", labelsize=7)
        drawn[f"{column.replace('images_per_second', 'throughput')}.png"] = figure
    return drawn


def _save(figure, path):
    """Write ``figure`` as a PNG into ``path`` (a temporary file, see :func:`write_together`)."""
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")


def _close(drawn):
    for figure in drawn:
        figures.pyplot().close(figure)


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _cell(value):
    if isinstance(value, float):
        return "" if math.isnan(value) else (f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}")
    return str(value)
