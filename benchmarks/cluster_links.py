r"""Training across hosts over links of a given rate: measured images/s beside the prediction of `cnnpar plan --hosts`.

Needs root: the hosts are network namespaces on this machine (``tests/hosts.py``), every link shaped with
``tc``'s token bucket at the rate ("unshaped": the bare veth pair). For each rate it first probes the link
(``cnnpar cluster probe``: the rate and round trip TensorFlow's transport gets), then, for the 2+2 and the 3+3
(``cnnpar train``, global batch 64, the first ``--digits`` digits of mnist-5k as a Kaggle CSV, ``--epochs``
epochs; images/s is the median of the epochs after the first, and of ``--repeats`` runs of each configuration:
the same run on hosts that share 2 cores has read 778 and 1,150 images/s), runs:

- single on one host (unshaped, once per model: it sends nothing);
- multi-worker on 2 and on 3 hosts;
- multi-worker on 2 hosts with the accumulation the prediction advises (communication under 20% of the step),
  at most ``--max-accumulate`` (an epoch keeps at least 4 steps);
- async-ps: its parameter server on one host, 2 workers on two others, the coordinator on a fourth;
- multi-worker on 2 hosts with ``compression="powersgd"`` of ``--powersgd-rank`` (its rank-r factors counted as
  the bytes a step, in two all-reduces);
- local-steps on 2 and 3 hosts, and on 2 with ``compression="bfloat16"``, exchanging every ``--inner-steps``
  steps and at each epoch's end (the exchanges an epoch has counted in the bytes a step);
- multi-worker on 2 hosts with ``pack_bytes=--pack-bytes``: the all-reduce in packs, the last layers' first,
  which may overlap the backward pass (predicted as plain multi-worker: without overlap).

``--only REGEX`` runs the configurations whose names it finds (Single always runs).

Each is predicted by ``Strategy.host_step`` from Single's measured step and the probed link (the link alone: an upper
bound), and calibrated as ``cnnpar plan --hosts --measured`` calibrates it: the unshaped link runs first, and its
multi-worker (2 hosts) and async-ps figures give each strategy's transport time a step beyond the link's bytes
(``HostStep.transport_to``), added to every other prediction of that model (``HostStep.with_transport``). The
hosts share this machine's cores, so the hosts that compute at once share them too: a host's compute is its share
of the batch times the hosts computing at once (multi-worker: Single's step on every host; async-ps: each worker's
whole batch takes workers x Single's step). The table prints measured, predicted from the link alone, calibrated,
and measured over calibrated; the last line counts the calibrated predictions at shaped rates within 25%.

Run: sudo python benchmarks/cluster_links.py [--rates 100mbit,1gbit,unshaped] [--models 2+2,3+3] [--epochs 3]
[--repeats 3] [--only "2 hosts(, PowerSGD r=\d+)?$"] [--powersgd-rank 4] [--inner-steps 32] [--pack-bytes 1000000]
"""

import argparse
import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/hosts.py: the namespaces as hosts

import keras_cnnpar as cnnpar
from keras_cnnpar.cluster import traffic
from keras_cnnpar.plan import scaling
from keras_cnnpar.strategies import compression
from tests import hosts

BATCH = 64
#: The runs on the unshaped link that calibrate each strategy's transport.
CALIBRATED_BY = ("multi-worker, 2 hosts", "async-ps, 2 workers + ps")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def command(*args):
    return [sys.executable, "-m", "keras_cnnpar.cli", *map(str, args)]


def train(data, model, *args):
    return command("train", "--model", model, "--data", data, "--batch-size", BATCH, "--results", "results",
                   "--verbose", "0", *args)


def images_per_second(results):
    """The median images/s of the epochs after the first, in the run's epoch CSV under ``results``."""
    (epoch_csv,) = Path(results).glob("*_keras_tensorflow_*.csv")
    with epoch_csv.open(newline="") as file:
        return statistics.median(float(row["images_per_second"]) for row in list(csv.DictReader(file))[1:])


def run_on(net, placed, folder):
    """Run ``placed`` (host index -> (command, env)) at once, each in ``folder/h<index>``; fail with the output of
    any that failed."""
    started = {}
    for index, (line, env) in placed.items():
        where = folder / f"h{index}"
        where.mkdir(parents=True)
        log = (where / "output.log").open("w")
        started[index] = net.popen(index, line, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT)
    return started


def finished(started, folder, timeout=1800):
    for index, process in started.items():
        if process.wait(timeout=timeout) != 0:
            raise RuntimeError(f"host {index} failed:\n{(folder / f'h{index}' / 'output.log').read_text()[-3000:]}")


def repeated(net, run, folder, repeats):
    """Run ``run(folder)`` ``repeats`` times, each in a folder of its own; return the median images/s, the median
    bytes the busiest host's link carried in one direction, and every run's images/s."""
    runs = [busiest_link_bytes(net, lambda where=folder / f"run{index}": run(where)) for index in range(repeats)]
    return (statistics.median(images for images, _ in runs), statistics.median(moved for _, moved in runs),
            [images for images, _ in runs])


def busiest_link_bytes(net, run):
    """Run ``run()``; return its result and the bytes the busiest host's link carried in one direction."""
    before = [net.bytes_moved(i) for i in range(len(net.names))]
    result = run()
    moved = [(sent - sent0, received - received0)
             for (sent, received), (sent0, received0) in zip((net.bytes_moved(i) for i in range(len(net.names))),
                                                               before)]
    return result, max(max(pair) for pair in moved)


def tf_config(cluster, job, index):
    return {**ENV, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})}


def single(net, data, model, epochs, folder):
    finished(run_on(net, {0: (train(data, model, "--epochs", epochs), ENV)}, folder), folder)
    return images_per_second(folder / "h0" / "results")


def multi_worker(net, data, model, epochs, folder, workers, accumulate=1, options=(), strategy="multi-worker"):
    cluster = {"worker": [f"{net.address(i)}:2222" for i in range(workers)]}
    line = train(data, model, "--strategy", strategy, "--epochs", epochs,
                 *(("--accumulate", accumulate) if accumulate > 1 else ()),
                 *[arg for option in options for arg in ("--option", option)])
    finished(run_on(net, {i: (line, tf_config(cluster, "worker", i)) for i in range(workers)}, folder), folder)
    return images_per_second(folder / "h0" / "results")


def async_ps(net, data, model, epochs, folder):
    cluster = {"ps": [f"{net.address(1)}:2222"], "worker": [f"{net.address(2)}:2222", f"{net.address(3)}:2222"]}
    spec = folder / "spec.json"
    folder.mkdir(parents=True)
    spec.write_text(json.dumps({"cluster": cluster}))
    servers = run_on(net, {1: (command("cluster", "serve", "--cluster", spec, "--job", "ps", "--index", 0), ENV),
                           **{2 + i: (command("cluster", "serve", "--cluster", spec, "--job", "worker", "--index", i),
                                      ENV) for i in range(2)}}, folder / "servers")
    try:
        finished(run_on(net, {0: (train(data, model, "--strategy", "async-ps", "--cluster", spec, "--epochs",
                                        epochs, "--checkpoint-dir", folder / "checkpoints"), ENV)}, folder), folder)
    finally:
        for server in servers.values():
            server.terminate()
            server.wait(timeout=60)
    return images_per_second(folder / "h0" / "results")


def probe(net, folder):
    """The link from host 2 to host 1 as ``cnnpar cluster probe`` measures it (servers on both)."""
    cluster = {"worker": [f"{net.address(2)}:2223"], "ps": [f"{net.address(1)}:2223"]}
    folder.mkdir(parents=True)
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"cluster": cluster}))
    servers = run_on(net, {1: (command("cluster", "serve", "--cluster", spec, "--job", "ps", "--index", 0), ENV),
                           2: (command("cluster", "serve", "--cluster", spec, "--job", "worker", "--index", 0), ENV)},
                     folder / "servers")
    try:
        done = run_on(net, {2: (command("cluster", "probe", "--cluster", spec), ENV)}, folder)
        finished(done, folder)
    finally:
        for server in servers.values():
            server.terminate()
            server.wait(timeout=60)
    printed = (folder / "h2" / "output.log").read_text()
    rate, latency = re.search(r"slowest link: --link (\d+mbit) --latency ([0-9.]+ms)", printed).groups()
    return traffic.Link.parse(rate, latency)


def kaggle_csv(folder, digits):
    subprocess.run(command("data", "kaggle", "--out", folder), check=True, capture_output=True, env=ENV)
    lines = (folder / "train.csv").read_text().splitlines()[:digits + 1]
    path = folder / f"train_{digits}.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit,unshaped")
    parser.add_argument("--models", default="2+2,3+3")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration; the median counts")
    parser.add_argument("--digits", type=int, default=1600)
    parser.add_argument("--max-accumulate", type=int, default=5)
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=32, help="local steps' H")
    parser.add_argument("--pack-bytes", type=int, default=1_000_000, help="multi-worker's packs, overlapped")
    parser.add_argument("--only", default="", help="a regular expression: run the configurations it finds")
    args = parser.parse_args()
    print(cnnpar.hardware.describe(), flush=True)
    if reason := hosts.unshapeable():
        sys.exit(f"cluster_links: {reason}")
    root = Path(tempfile.mkdtemp(prefix="cnnpar-links-"))
    data = kaggle_csv(root, args.digits)
    models = args.models.split(",")
    rows = []
    with hosts.Hosts(4) as net:
        one_host = {model: repeated(net, lambda where, model=model: single(net, data, model, args.epochs, where),
                                    root / f"single-{model}", args.repeats)[0] for model in models}
    transports = {}
    rates = sorted(args.rates.split(","), key=lambda rate: rate != "unshaped")  # the calibration first
    for rate in rates:
        with hosts.Hosts(4, rate=None if rate == "unshaped" else rate) as net:
            link = probe(net, root / f"probe-{rate}")
            print(f"\n{rate}: probed {link}", flush=True)
            for model in models:
                measured = measure_model(net, data, model, link, one_host[model], transports.get(model, {}), args,
                                         root / f"{rate}-{model}")
                if rate == "unshaped":
                    transports[model] = {alias: step.transport_to(images, BATCH)
                                         for name, alias, step, images in measured if name in CALIBRATED_BY}
                    said = ", ".join(f"{alias} {seconds * 1e3:+.1f} ms" for alias, seconds in transports[model].items())
                    print(f"  {model} calibrated, TensorFlow's transport a step beyond the link: {said}", flush=True)
                rows += [(model, rate, name, images, step.images_per_second(BATCH),
                          step.with_transport(transports.get(model, {}).get(alias, 0.0)).images_per_second(BATCH))
                         for name, alias, step, images in measured]
    print("\nmodel  link      configuration                 measured  link only  calibrated  measured/calibrated")
    for model, rate, name, measured, link_only, calibrated in rows:
        print(f"{model:6s} {rate:9s} {name:29s} {measured:8.0f} {link_only:10.0f} {calibrated:11.0f} "
              f"{measured / calibrated:10.2f}")
    shaped = [abs(calibrated / measured - 1) <= 0.25 for model, rate, name, measured, _, calibrated in rows
              if rate != "unshaped" and not name.startswith("single")]
    print(f"\n{sum(shaped)} of {len(shaped)} calibrated predictions at shaped rates within 25% of the measured "
          f"images/s" + ("" if "unshaped" in rates else " (uncalibrated: --rates has no unshaped link)"))

def measure_model(net, data, model, link, single_images, transport, args, folder):
    """The runs of ``model`` at one link rate: (configuration, strategy alias, predicted ``HostStep`` from the link
    alone, measured images/s: the median of ``args.repeats`` runs), each also printed with every run's figure and
    with the bytes a step moved on the busiest link, measured (the links' counters over the run, divided by its
    training steps) and as the prediction counts them. The accumulation is the one the prediction advises,
    calibrated with ``transport`` where there is one."""
    step = BATCH / single_images
    size = scaling.gradient_bytes(cnnpar.models.cnn(model))
    steps = args.epochs * (args.digits - args.digits // 5) // BATCH  # validation's bytes count in, a few percent
    synced = cnnpar.MultiWorker.host_step(2, 2 * step, link, size)
    advised = scaling.accumulation_for(synced.with_transport(transport.get("multi-worker", 0.0)),
                                       scaling.COMMUNICATION_TARGET)
    k = min(advised, args.max_accumulate)
    rank = args.powersgd_rank
    compressed = 4 * compression.sent_floats([v.shape for v in cnnpar.models.cnn(model).trainable_variables], rank)
    configurations = [
        ("multi-worker, 2 hosts", "multi-worker",
         "mw2", lambda where: multi_worker(net, data, model, args.epochs, where, 2), synced,
         traffic.ring_all_reduce(size, 2), steps),
        ("multi-worker, 3 hosts", "multi-worker",
         "mw3", lambda where: multi_worker(net, data, model, args.epochs, where, 3),
         cnnpar.MultiWorker.host_step(3, 3 * step, link, size), traffic.ring_all_reduce(size, 3), steps),
        (f"multi-worker, 2 hosts, K={k}", "multi-worker",
         "mw2k", lambda where: multi_worker(net, data, model, args.epochs, where, 2, k),
         cnnpar.MultiWorker.host_step(2, 2 * step, link, size, accumulate=k), traffic.ring_all_reduce(size, 2),
         steps // k),
        ("async-ps, 2 workers + ps", "async-ps", "async", lambda where: async_ps(net, data, model, args.epochs, where),
         cnnpar.AsyncPS.host_step(3, 2 * step, link, size), size, steps),  # the ps link one way
        (f"multi-worker, 2 hosts, PowerSGD r={rank}", "multi-worker",
         "mw2p", lambda where: multi_worker(net, data, model, args.epochs, where, 2, options=(
             "compression='powersgd'", f"powersgd_rank={rank}")),
         cnnpar.MultiWorker.host_step(2, 2 * step, link, compressed, all_reduces=2),
         traffic.ring_all_reduce(compressed, 2), steps),
        (f"multi-worker, 2 hosts, packs of {args.pack_bytes / 1e6:g} MB", "multi-worker",
         "mw2o", lambda where: multi_worker(net, data, model, args.epochs, where, 2, options=(
             f"pack_bytes={args.pack_bytes}",)),
         synced, traffic.ring_all_reduce(size, 2), steps),
    ]
    h = args.inner_steps
    exchanges = math.ceil(steps / args.epochs / h) * args.epochs  # and one at each epoch's end
    for count, options in ((2, ()), (3, ()), (2, ("compression='bfloat16'",))):
        sent = size // 2 if options else size
        configurations.append((
            f"local-steps, {count} hosts, H={h}{', bfloat16' if options else ''}", "local-steps",
            f"ls{count}{'b' if options else ''}", lambda where, count=count, options=options: multi_worker(
                net, data, model, args.epochs, where, count, options=(f"inner_steps={h}", *options),
                strategy="local-steps"),
            cnnpar.LocalSteps.host_step(count, count * step, link, sent, inner_steps=steps / exchanges),
            traffic.ring_all_reduce(sent, count) * exchanges / steps, steps))
    configurations = [c for c in configurations if re.search(args.only, c[0])]
    measured = [("single, 1 host", "single", cnnpar.Single.host_step(1, step, link, size), single_images)]
    for name, alias, key, run, predicted, step_bytes, run_steps in configurations:
        images, moved, runs = repeated(net, run, folder / key, args.repeats)
        measured.append((name, alias, predicted, images))
        print(f"  {name:29s} measured {images:7.0f} images/s ({', '.join(f'{each:.0f}' for each in runs)}), "
              f"from the link {predicted.images_per_second(BATCH):7.0f}; bytes a step on the busiest link "
              f"{moved / run_steps / 1e6:6.2f} MB, counted {step_bytes / 1e6:6.2f} MB", flush=True)
    return measured

if __name__ == "__main__":
    main()
