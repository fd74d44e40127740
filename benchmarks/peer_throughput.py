"""Images/s of cnnpar against its peer, tf-keras 2 (Keras 2 on tf.distribute), on the same model, data and batch.

Both train the 2+2 CNN (Adam 5e-4) on the same 4,000 mnist-5k digits at global
batch 64 through the same cached, shuffled, prefetched ``tf.data`` pipeline, one
device and 2-replica ``MirroredStrategy`` over 2 logical CPUs, in turn. Each
tf-keras run has a process of its own, with oneDNN as TensorFlow sets it on this
CPU (as tf-keras users run it: off on CPUs without AVX512-VNNI, AVX512-BF16,
AVX-VNNI or AMX, where ``import keras_cnnpar`` turns it on); its machine line is
printed too. cnnpar runs with TensorFlow's fused optimizer kernels (its default)
and, for comparison, with Keras 3's element-wise update (``fused_optimizer=False``).
Each figure is the median images/s over the epochs after the first of every round.
Targets on the 2-core CPU: cnnpar Single >= 1.05x tf-keras single, cnnpar
DataParallel(2) >= 1.05x tf-keras MirroredStrategy(2), and cnnpar Single >= 1.3x
what it was when issue 19 was filed. Absolute images/s vary from run to run on
this machine by more than that, so the last is measured against the peer in the
same run: cnnpar Single / tf-keras single, divided by that ratio at the time
(``BASELINE_RATIO``). The fused / unfused ratio shows the kernels' own share.

tf-keras is not a dependency: ``pip install tf-keras==2.21.0`` first.

Run: python benchmarks/peer_throughput.py [--epochs 4] [--rounds 2]
"""

import json
import subprocess
import sys

from timing import EpochTimer, cnnpar, keras, parse_args, run_rounds, tf, training_split

try:
    import tf_keras
except ImportError:
    raise SystemExit("peer_throughput needs tf-keras, the peer it measures against: pip install tf-keras==2.21.0") \
        from None

BATCH = 64
#: cnnpar Single / tf-keras single when issue 19 was filed: 1,605-1,610 against 2,130-2,188 images/s, one run.
BASELINE_RATIO = 0.745
STEPS_PER_EXECUTION = 8


def tf_keras_cnn():
    """The 2+2 CNN of ``cnnpar.models.cnn("2+2")``, written in tf-keras 2, with the same optimizer and loss."""
    layers = tf_keras.layers
    model = tf_keras.Sequential([
        tf_keras.Input((28, 28, 1)),
        layers.Conv2D(32, 5, padding="same", activation="relu"), layers.MaxPooling2D(2),
        layers.Conv2D(64, 5, padding="same", activation="relu"), layers.MaxPooling2D(2),
        layers.Flatten(), layers.Dense(1024, activation="relu"), layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer=tf_keras.optimizers.Adam(5e-4), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=STEPS_PER_EXECUTION)
    return model


class TfKerasTimer(tf_keras.callbacks.Callback):
    """An ``EpochTimer`` as a tf-keras callback."""

    def __init__(self, timer):
        super().__init__()
        self.timer = timer

    def on_epoch_begin(self, epoch, logs=None):
        self.timer.on_epoch_begin(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.timer.on_epoch_end(epoch)


#: The machine lines the tf-keras processes printed (each printed once).
PEER_MACHINES = set()


def measure(name, train, epochs):
    """The images/s of the run ``name`` after its first epoch: a tf-keras run in a process of its own."""
    if name.startswith("tf-keras"):
        return measure_peer(name, epochs)
    return measure_here(name, train, epochs)


def measure_peer(name, epochs):
    """Run the tf-keras run ``name`` with this script's ``--peer`` in a fresh process whose oneDNN setting is
    TensorFlow's default for this CPU; print its machine line the first time; return its images/s."""
    done = subprocess.run([sys.executable, __file__, "--peer", name, "--epochs", str(epochs)], check=True,
                          env=cnnpar.hardware.tensorflow_default_environment(), capture_output=True, text=True)
    machine, *_, rates = done.stdout.strip().splitlines()
    if machine not in PEER_MACHINES:
        PEER_MACHINES.add(machine)
        print(f"tf-keras runs in: {machine}", flush=True)
    return json.loads(rates)


def measure_here(name, train, epochs):
    """Run ``name`` in this process; return its images/s after the first epoch."""
    keras.utils.set_random_seed(0)
    dataset = cnnpar.data.pipeline(train.x, train.y, BATCH, shuffle=True, seed=0)
    timer = EpochTimer(len(train))
    options = {"epochs": epochs, "verbose": 0, "callbacks": [TfKerasTimer(timer) if "tf-keras" in name else timer]}
    if name == "tf-keras single":
        tf_keras_cnn().fit(dataset, **options)
    elif name == "tf-keras mirrored(2)":
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            model = tf_keras_cnn()
        model.fit(dataset, **options)
    else:
        strategy = cnnpar.DataParallel(2) if "mirrored" in name else cnnpar.Single()
        cnnpar.models.cnn("2+2").fit(dataset, strategy=strategy, results_dir=None,
                                     fused_optimizer="unfused" not in name, **options)
    return timer.rates[1:]


def main():
    args = parse_args(__doc__, ("--peer", {"help": "run only this tf-keras run here; print its images/s as JSON"}))
    train = training_split()
    if args.peer:
        print(json.dumps(measure_here(args.peer, train, args.epochs)))
        return
    names = ["tf-keras single", "cnnpar single", "cnnpar single unfused",
             "tf-keras mirrored(2)", "cnnpar mirrored(2)", "cnnpar mirrored(2) unfused"]
    median = run_rounds(names, args.rounds, lambda name: measure(name, train, args.epochs))
    print(f"\n2+2 CNN (Adam), {len(train)} images, global batch {BATCH}, {args.rounds} rounds x "
          f"{args.epochs - 1} timed epochs")
    for name in names:
        print(f"  {name:28s} {median[name]:8.0f} images/s")
    ratios = [("cnnpar single / tf-keras single", "cnnpar single", "tf-keras single", 1.05),
              ("cnnpar mirrored(2) / tf-keras mirrored(2)", "cnnpar mirrored(2)", "tf-keras mirrored(2)", 1.05),
              ("cnnpar single fused / unfused", "cnnpar single", "cnnpar single unfused", None),
              ("cnnpar mirrored(2) fused / unfused", "cnnpar mirrored(2)", "cnnpar mirrored(2) unfused", None)]
    for label, top, bottom, target in ratios:
        goal = f"  (target >= {target:.2f}x)" if target else ""
        print(f"  {label:42s} = {median[top] / median[bottom]:.2f}x{goal}")
    against_baseline = median["cnnpar single"] / median["tf-keras single"] / BASELINE_RATIO
    print(f"  {'cnnpar single / its issue-19 baseline':42s} = {against_baseline:.2f}x  (target >= 1.30x; "
          f"baseline {BASELINE_RATIO}x tf-keras single)")


if __name__ == "__main__":
    main()
