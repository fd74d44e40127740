"""One slow worker of four: AsyncPS keeps its pace, MultiWorker waits for it. Images/s and accuracy, side by side.

For each model (``--models``), ``cnnpar train`` runs Single, then AsyncPS (4 workers and 1 parameter server,
``cnnpar cluster start`` servers) and MultiWorker (4 worker processes, ``--workers 4``) with all workers at full
speed, and again with worker 3 slowed to ``--share`` of its time (a quarter by default): this script stops it
with SIGSTOP and lets it go on with SIGCONT, ``--share`` of every ``--period`` seconds (nothing in the library
sleeps), from the end of the first epoch on. Images/s is the median of the epochs after the first; accuracy is
the last epoch's validation accuracy. All processes share this machine's cores, so a stopped worker also leaves
its share of them to the others. Targets: AsyncPS with the slow worker keeps at least 0.8x of its own images/s,
and its accuracy within 3 points of Single's; MultiWorker's drop is printed beside it.

``--max-staleness 3,1`` adds AsyncPS with each bound (``--option max_staleness=B``): its ``applied`` column is
the share of the steps after the first epoch whose gradient was applied (the others were staler than the bound
and dropped, their work lost), so its useful images/s is images/s times that share.

Run: python benchmarks/slow_worker.py [--models 3+3,2+2] [--epochs 3] [--share 0.25] [--period 0.1]
                                      [--max-staleness 3,1]
"""

import argparse
import csv
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import keras_cnnpar as cnnpar

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
SLOW_WORKER = 3


def command(*args):
    return [sys.executable, "-m", "keras_cnnpar.cli", *map(str, args)]


class DutyCycle(threading.Thread):
    """Let the process found by ``find()`` run ``share`` of every ``period`` seconds, by stopping and continuing
    it from here, until :meth:`stop`."""

    def __init__(self, find, share, period):
        super().__init__(daemon=True)
        self.find, self.share, self.period = find, share, period
        self.stopped = threading.Event()

    def run(self):
        pid = None
        while pid is None and not self.stopped.wait(0.05):
            pid = self.find()
        try:
            while not self.stopped.is_set():
                os.kill(pid, signal.SIGCONT)
                self.stopped.wait(self.share * self.period)
                os.kill(pid, signal.SIGSTOP)
                self.stopped.wait((1 - self.share) * self.period)
            os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, TypeError):  # it ended, or never started
            pass

    def stop(self):
        self.stopped.set()
        self.join()


def launched_worker(launcher, index):
    """The pid of the worker ``index`` that ``cnnpar train --workers`` (process ``launcher``) started, among its
    descendants (the workers may run under ``unshare``), or None."""
    parents, configs = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        configs[int(entry.name)] = next((json.loads(v[len(b"TF_CONFIG="):]) for v in environ
                                         if v.startswith(b"TF_CONFIG=")), None)

    def descends(pid):
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == launcher:
                return True
        return False

    return next((pid for pid, config in configs.items()
                 if config and config["task"]["index"] == index and descends(pid)), None)


def trained_an_epoch(folder):
    """Whether the run in ``folder`` has written its first epoch's row (the slow worker is slowed from then on:
    joining a cluster has timeouts of its own, and the first epoch, which traces, is not timed)."""
    return any(len(path.read_text().splitlines()) > 1 for path in (folder / "results").glob("*_keras_tensorflow_*.csv"))


def figures(results):
    """Median images/s of the epochs after the first, the last validation accuracy, and the share of the steps
    after the first epoch whose gradient was applied (1 where no step is dropped), of the run in ``results``."""
    (epoch_csv,) = Path(results).glob("*_keras_tensorflow_*.csv")
    with epoch_csv.open(newline="") as file:
        rows = list(csv.DictReader(file))
    applied, dropped = (sum(float(r.get(column) or 0) for r in rows[1:]) for column in ("steps_applied",
                                                                                       "steps_dropped"))
    return (statistics.median(float(r["images_per_second"]) for r in rows[1:]), float(rows[-1]["val_accuracy"]),
            applied / (applied + dropped) if dropped else 1.0)


def train(folder, model, epochs, *args, slow=None):
    """``cnnpar train`` in ``folder``; ``slow(process)`` returns a :class:`DutyCycle` to run beside it."""
    folder.mkdir(parents=True)
    line = command("train", "--model", model, "--epochs", epochs, "--results", "results", "--verbose", "0", *args)
    process = subprocess.Popen(line, cwd=folder, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cycle = slow(process) if slow else None
    if cycle:
        cycle.start()
    output = process.communicate()[0]
    if cycle:
        cycle.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(line)} failed:\n{output[-3000:]}")
    return figures(folder / "results")


def async_ps(folder, model, epochs, share, period, slowed, options=()):
    folder.mkdir(parents=True)
    spec = folder / "spec.json"
    subprocess.run(command("cluster", "start", "--workers", 4, "--ps", 1, "--spec", spec), env=ENV, check=True,
                   capture_output=True)
    try:
        worker = json.loads(spec.read_text())["pids"]["worker"][SLOW_WORKER]
        run = folder / "run"
        return train(run, model, epochs, "--strategy", "async-ps", "--cluster", spec, *options,
                     slow=(lambda _: DutyCycle(lambda: worker if trained_an_epoch(run) else None, share, period))
                     if slowed else None)
    finally:
        subprocess.run(command("cluster", "stop", "--spec", spec), env=ENV, check=True, capture_output=True)


def multi_worker(folder, model, epochs, share, period, slowed):
    def slowed_worker(launcher):
        return DutyCycle(lambda: launched_worker(launcher.pid, SLOW_WORKER) if trained_an_epoch(folder) else None,
                         share, period)

    return train(folder, model, epochs, "--strategy", "multi-worker", "--workers", 4,
                 slow=slowed_worker if slowed else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="3+3,2+2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--share", type=float, default=0.25, help="the slow worker's share of its time")
    parser.add_argument("--period", type=float, default=0.1, help="seconds of one stop-and-continue cycle")
    parser.add_argument("--max-staleness", default="", help="bounds of AsyncPS rows to add, e.g. 3,1")
    args = parser.parse_args()
    runs = [("async-ps", async_ps), *((f"async-ps <={bound}", functools.partial(
        async_ps, options=("--option", f"max_staleness={bound}"))) for bound in args.max_staleness.split(",") if bound),
            ("multi-worker", multi_worker)]
    print(cnnpar.hardware.describe(), flush=True)
    print(f"mnist-5k (4,000 training images), batch 64, {args.epochs} epochs; worker {SLOW_WORKER} of 4 runs "
          f"{args.share:.0%} of every {args.period} s", flush=True)
    root = Path(tempfile.mkdtemp(prefix="cnnpar-slow-"))
    print(f"{'model':6s} {'strategy':13s} {'images/s':>9s} {'slowed':>9s} {'ratio':>6s} {'accuracy':>9s} "
          f"{'slowed':>7s} {'applied':>8s} {'slowed':>7s}")
    verdicts = []
    for model in args.models.split(","):
        single_images, single_accuracy, _ = train(root / model / "single", model, args.epochs)
        print(f"{model:6s} {'single':13s} {single_images:9.0f} {'':>9s} {'':>6s} {single_accuracy:9.3f}", flush=True)
        for name, run in runs:
            (full, full_accuracy, full_applied), (slowed, slowed_accuracy, slowed_applied) = (
                run(root / model / f"{name.replace(' <=', '-')}-{kind}", model, args.epochs, args.share, args.period,
                    kind == "slow") for kind in ("full", "slow"))
            print(f"{model:6s} {name:13s} {full:9.0f} {slowed:9.0f} {slowed / full:6.2f} {full_accuracy:9.3f} "
                  f"{slowed_accuracy:7.3f} {full_applied:8.2f} {slowed_applied:7.2f}", flush=True)
            if name == "async-ps":
                verdicts.append((model, slowed / full >= 0.8, single_accuracy - slowed_accuracy <= 0.03))
    for model, pace, accuracy in verdicts:
        print(f"{model}: async-ps slowed keeps 0.8x of its images/s: {'pass' if pace else 'FAIL'}; its accuracy "
              f"within 3 points of single's: {'pass' if accuracy else 'FAIL'}")


if __name__ == "__main__":
    main()
