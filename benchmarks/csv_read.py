"""Reading a Kaggle-size CSV: cnnpar's validated reader against pandas' C parser, seconds and peak memory.

Writes a 42,000-row ``train.csv`` (the real file's size, about 73 MiB) and a
28,000-row ``test.csv`` from the embedded digits into a temporary folder (not
committed), then reads each one in fresh processes, interleaved over rounds:

- ``pandas``: ``pandas.read_csv(dtype=uint8)`` and scaling to float32 in [0, 1]
  (in place), the field's usual tool (no validation);
- ``cnnpar``: ``cnnpar.data.load`` (train.csv through numpy's C reader,
  every value validated, float32 images) and ``cnnpar.data.read_kaggle_csv(labeled=False)`` (test.csv, as
  ``cnnpar predict`` reads it), scaled to float32 images as pandas' are.

Then the same train.csv with one bad value in its last row: how long cnnpar takes to
refuse it, and its peak memory, against reading the valid file (target: at most 1.5x both).

Peak memory is the child's peak RSS (``VmHWM``, reset after its imports) above
its RSS after its imports. Targets:
cnnpar no slower than pandas, and its peak at most twice the final arrays.

Run: python benchmarks/csv_read.py [--rounds 3]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

READ = r"""
import sys, time
import numpy as np, pandas as pd  # both readers' libraries imported before the clock starts
from keras_cnnpar import data

def status_mib(field):
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith(field + ":")) / 1024

reader, path, labeled = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # reset the peak (VmHWM) to the current RSS: the imports' own peak does not count
baseline = status_mib("VmRSS")
start = time.perf_counter()
if reader == "pandas":
    values = pd.read_csv(path, dtype=np.uint8).to_numpy()
    images = (values[:, 1:] if labeled else values).astype(np.float32)
    images /= 255.0
    arrays = images.nbytes + (values[:, 0].nbytes if labeled else 0)
elif reader == "cnnpar-refused":
    try:
        data.load(path)
        raise SystemExit(f"{path} was read; expected a refusal")
    except data.DataError:
        arrays = 1
elif labeled:
    digits = data.load(path)
    arrays = digits.x.nbytes + digits.y.nbytes
else:
    pixels, _ = data.read_kaggle_csv(path, labeled=False)
    images = data._images(pixels)
    arrays = images.nbytes
seconds = time.perf_counter() - start
peak = status_mib("VmHWM") - baseline
print(f"{seconds} {peak} {arrays / 2 ** 20}")
"""


def write_files(folder):
    """A 42,000-row train.csv and a 28,000-row test.csv made of the embedded digits, repeated."""
    from keras_cnnpar.zoo import data

    digits = data.load()
    pixels = np.rint(digits.x.reshape(len(digits), -1) * 255).astype(np.uint8)
    train_rows = np.resize(np.arange(len(digits)), 42_000)
    train = np.column_stack([digits.y[train_rows], pixels[train_rows]])
    np.savetxt(folder / "train.csv", train, fmt="%d", delimiter=",", header=",".join(data.TRAIN_HEADER), comments="")
    test = pixels[np.resize(np.arange(len(digits)), 28_000)]
    np.savetxt(folder / "test.csv", test, fmt="%d", delimiter=",", header=",".join(data.PIXEL_HEADER), comments="")
    text = (folder / "train.csv").read_text()
    (folder / "bad.csv").write_text(text.rstrip("\n").rsplit(",", 1)[0] + ",x\n")  # the last row's last value


def measure(reader, path, labeled):
    done = subprocess.run([sys.executable, "-c", READ, reader, str(path), "1" if labeled else "0"],
                          capture_output=True, text=True, check=True)
    return [float(value) for value in done.stdout.split()]


def main():
    from keras_cnnpar.runtime import hardware

    print(hardware.describe(), flush=True)  # the machine first: readers differ between CPU kinds
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        write_files(folder)
        for name, labeled in (("train.csv", True), ("test.csv", False)):
            path = folder / name
            figures = {"pandas": [], "cnnpar": []}
            for _ in range(rounds):
                for reader in figures:
                    figures[reader].append(measure(reader, path, labeled))
            print(f"\n{name}: {path.stat().st_size / 2 ** 20:.0f} MiB, median of {rounds} fresh processes each")
            for reader, runs in figures.items():
                seconds, peak, arrays = (statistics.median(column) for column in zip(*runs))
                print(f"  {reader:7s} {seconds:6.2f} s   peak +{peak:6.0f} MiB   final arrays {arrays:5.0f} MiB "
                      f"(peak / arrays {peak / arrays:.2f})")
            ratio = statistics.median(r[0] for r in figures["cnnpar"]) / statistics.median(
                r[0] for r in figures["pandas"])
            print(f"  cnnpar / pandas time = {ratio:.2f}x  (target <= 1.00x)")
        refusal(folder, rounds)


def refusal(folder, rounds):
    """cnnpar refusing train.csv with a bad value in its last row, against reading the valid file."""
    figures = {"valid": [], "refused": []}
    for _ in range(rounds):
        figures["valid"].append(measure("cnnpar", folder / "train.csv", True))
        figures["refused"].append(measure("cnnpar-refused", folder / "bad.csv", True))
    (valid_seconds, valid_peak), (refused_seconds, refused_peak) = (
        [statistics.median(run[i] for run in runs) for i in (0, 1)] for runs in figures.values())
    print(f"\nbad.csv (train.csv with a bad value in its last row), median of {rounds} fresh processes each")
    print(f"  valid   {valid_seconds:6.2f} s   peak +{valid_peak:6.0f} MiB")
    print(f"  refused {refused_seconds:6.2f} s   peak +{refused_peak:6.0f} MiB")
    print(f"  refused / valid: time {refused_seconds / valid_seconds:.2f}x, peak {refused_peak / valid_peak:.2f}x "
          f"(target <= 1.50x both)")


if __name__ == "__main__":
    main()
