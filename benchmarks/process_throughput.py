"""Images/s of ``Single``, ``MultiWorker`` (2 local worker processes) and ``AsyncPS`` (2 workers + 1 ps), side by side.

Each configuration is one ``cnnpar train`` run of the 2+2 CNN on the 4,000/1,000
mnist-5k split at global batch 64, in interleaved rounds so that machine noise
hits them alike. Its figure is the median of the per-epoch images/s in its CSV
(training time up to validation) over the epochs after the first (tracing).
The workers share this machine's cores: the launcher gives each worker
TF_NUM_INTRAOP_THREADS=cores/workers and TF_NUM_INTEROP_THREADS=2; "TF's own
thread pools" sets both to 0, so each worker sizes its pools for every core.
AsyncPS runs its local cluster (target on 2 cores: >= 0.8x Single).

Run: python benchmarks/process_throughput.py [--epochs 4] [--rounds 2]
"""

import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import parse_args

CONFIGS = {
    "single": ["--strategy", "single"],
    "multi-worker(2)": ["--strategy", "multi-worker", "--workers", "2"],
    "multi-worker(2), TF's own thread pools": ["--strategy", "multi-worker", "--workers", "2"],
    "async-ps(2 workers, 1 ps)": ["--strategy", "async-ps", "--workers", "2", "--ps", "1"],
}
THREADS = {"multi-worker(2), TF's own thread pools": {"TF_NUM_INTRAOP_THREADS": "0", "TF_NUM_INTEROP_THREADS": "0"}}


def measure(name, epochs):
    with tempfile.TemporaryDirectory() as results:
        command = [sys.executable, "-m", "keras_cnnpar.cli", "train", *CONFIGS[name], "--epochs", str(epochs),
                   "--batch-size", "64", "--verbose", "0", "--results", results]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **THREADS.get(name, {})}
        subprocess.run(command, env=env, check=True, capture_output=True)
        (epoch_csv,) = Path(results).glob("*_keras_tensorflow_*dev.csv")
        with open(epoch_csv, newline="") as file:
            return [float(row["images_per_second"]) for row in csv.DictReader(file)][1:]


def main():
    args = parse_args(__doc__)
    rates = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            rates[name] += measure(name, args.epochs)
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"\n2+2 CNN, 4000 images, global batch 64, {args.rounds} rounds x {args.epochs - 1} timed epochs")
    for name in CONFIGS:
        print(f"  {name:38s} {median[name]:8.0f} images/s  {median[name] / median['single']:.2f}x single")


if __name__ == "__main__":
    main()
