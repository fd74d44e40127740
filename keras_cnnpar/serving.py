"""SavedModel export for TensorFlow Serving, and Kaggle predictions from an export.

An export is TF Serving's layout, ``BASE/VERSION/saved_model.pb`` with its
``variables/`` and ``assets.extra/tf_serving_warmup_requests``. Its
``serving_default`` signature takes ``pixels``, float32 ``[N, 784]`` raw 0..255
values as in the Kaggle CSVs, and returns ``probabilities`` ``[N, 10]`` and
``class`` ``[N]``; scaling and reshaping happen inside the graph. Every export
is written to a temporary folder, checked in a fresh Python process that
imports only TensorFlow, and only then renamed into place.

Example:

>>> import tempfile, keras_cnnpar as cnnpar
>>> model = cnnpar.models.cnn("3+3")
>>> digits = cnnpar.data.load()
>>> history = model.fit(digits.x[:256], digits.y[:256], batch_size=64, strategy="single",
...                     results_dir=None, verbose=0)
>>> base = tempfile.mkdtemp()
>>> export(model, base).name                      # the first free version, checked in a fresh process
'1'
>>> export(model, base, verify=False).name        # the next one, unchecked
'2'
"""

import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from keras_cnnpar.results import runs
from keras_cnnpar.runtime.atomic import created_mode, made_folder, write_atomic
from keras_cnnpar.runtime.subprocesses import python_command
from keras_cnnpar.zoo import data as data_lib
from keras_cnnpar.zoo.names import MODEL_NAMES

SIGNATURE = "serving_default"
INPUT = "pixels"
TOLERANCE = 1e-5
VERIFY_TIMEOUT_S = 180
WARMUP_FILE = Path("assets.extra") / "tf_serving_warmup_requests"

#: Run in a fresh process: load the export with plain TensorFlow, without Keras (as TF Serving loads it; and
#: 1.2 s less to import), and apply its signature. It does not import this library: a worker's environment
#: (TF_CONFIG) would make the library join that worker's cluster at import.
_VERIFY_SCRIPT = """
import sys
sys.modules["keras"] = None  # TensorFlow imports Keras inside try/except ImportError
import numpy as np
import tensorflow as tf
export_dir, pixels_path, out_path = sys.argv[1:]
signature = tf.saved_model.load(export_dir).signatures["serving_default"]
outputs = signature(pixels=tf.constant(np.load(pixels_path)))
np.savez(out_path, probabilities=outputs["probabilities"].numpy(), classes=outputs["class"].numpy())
import os
os._exit(0)  # written and closed: skip TensorFlow's teardown (startup.exit_now)
"""


class ExportError(RuntimeError):
    """An export that could not be written or did not verify; nothing was left in its place."""


class NotAnExport(ValueError):
    """A folder that does not hold a SavedModel as :func:`export` writes it (damaged, or of another signature)."""


def export(model, base_dir, version=None, *, force=False, verify=True):
    """Write ``model`` to ``base_dir/version`` for TF Serving; return the version folder.

    Args:
        model: a Keras model taking ``[N, 28, 28, 1]`` images in [0, 1].
        base_dir: the model's base path (``--model_base_path`` of TF Serving).
        version: a positive int; default: the next free version, starting at 1.
        force: replace an existing version (only once the new one verified).
        verify: check the export in a fresh process against ``model``'s predictions.
    """
    _check_input_shape(model)
    _check_finite(model)
    base_dir = Path(base_dir)
    version = _next_version(base_dir) if version is None else _check_version(version)
    target = base_dir / str(version)
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists; pass force=True (--force) to replace it, or another "
                              f"version. Received: version={version}")
    with made_folder(base_dir):  # a failed export leaves no folder it created
        staging = Path(tempfile.mkdtemp(prefix=f".{version}.partial-", dir=base_dir))
        try:
            os.chmod(staging, created_mode(directory=True))  # readable as any folder of the user's, by TF Serving
            pixels = sample_pixels()
            _write(model, staging, pixels[:4], target)
            if verify:
                _verify(model, staging, pixels)
            _move_into_place(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _check_input_shape(model):
    if tuple(model.input_shape[1:]) != (data_lib.IMAGE_SIDE, data_lib.IMAGE_SIDE, 1):
        raise ValueError(f"the serving signature takes {data_lib.PIXELS} pixels of a 28x28 grayscale image; the "
                         f"model must take [N, 28, 28, 1]. Received: input_shape={model.input_shape}")


def non_finite_weight(model):
    """``(path, count)`` of ``model``'s first weight holding NaN or infinity, or None where all are finite.

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")], name="digits")
    >>> _ = model.layers[0].bias.assign([float("nan")])
    >>> non_finite_weight(model)
    ('digits/head/bias', 1)
    """
    for weight in model.weights:
        values = np.asarray(weight.numpy())
        count = int(values.size - np.count_nonzero(np.isfinite(values)))
        if count:
            return weight.path, count
    return None


def _check_finite(model):
    if found := non_finite_weight(model):
        path, count = found
        raise ValueError(f"the model's weight {path} holds {count} non-finite values (NaN or infinity): a run that "
                         f"diverged, or a damaged file; nothing was exported. Received: {path}")


def _check_version(version):
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be a positive int. Received: version={version!r}")
    return version


def _next_version(base_dir):
    taken = [int(p.name) for p in base_dir.glob("*") if p.is_dir() and p.name.isdigit()] if base_dir.exists() else []
    return max(taken, default=0) + 1


def serving_function(model):
    """The ``serving_default`` function: raw pixels ``[N, 784]`` -> ``probabilities`` and ``class``."""

    @tf.function(input_signature=[tf.TensorSpec([None, data_lib.PIXELS], tf.float32, name=INPUT)])
    def serve(pixels):
        images = tf.reshape(pixels / 255.0, [-1, data_lib.IMAGE_SIDE, data_lib.IMAGE_SIDE, 1])
        probabilities = model(images, training=False)
        return {"probabilities": probabilities, "class": tf.argmax(probabilities, axis=-1)}

    return serve


def _write(model, folder, warmup_pixels, target):
    """Write the export of ``model`` into ``folder``; an ``ExportError`` in one line, naming ``target``, where the
    disk cannot take it (full, say: TensorFlow's ``ResourceExhaustedError``)."""
    archive = keras.export.ExportArchive()  # Keras's variable tracking: TF Serving's C++ loader restores them
    archive.track(model)
    serve = serving_function(model)
    archive.add_endpoint(SIGNATURE, serve, input_signature=serve.input_signature)
    try:
        archive.write_out(str(folder), verbose=False)
        _write_warmup(folder / WARMUP_FILE, warmup_pixels)
    except (OSError, tf.errors.OpError) as error:
        raise ExportError(f"could not write the export {target}: {_reason(error)}; nothing was left in its place. "
                          f"Received: {type(error).__name__}") from None


def _reason(error):
    """What a failed write says in one line: the system's words for an ``OSError``'s errno, the end of a TensorFlow
    error's message (``"...; No space left on device [Op:SaveV2]"``)."""
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    message = " ".join(getattr(error, "message", str(error)).split())
    return message.rpartition("; ")[2].partition(" [Op:")[0]


def _write_warmup(path, pixels):
    """Write one ``PredictRequest`` on ``pixels``, so a TF Serving server warms up on load."""
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(signature_name=SIGNATURE))
    request.inputs[INPUT].CopyFrom(tf.make_tensor_proto(pixels))
    log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(log.SerializeToString())


def sample_pixels():
    """A fixed batch of 32 raw-pixel rows (float32 ``[32, 784]``), three or four of each digit."""
    digits = data_lib.load()
    return np.rint(digits.x[::157][:32].reshape(32, -1) * 255.0).astype(np.float32)


def _verify(model, folder, pixels):
    expected = model.predict(pixels.reshape(-1, 28, 28, 1) / 255.0, verbose=0)
    served = load_in_fresh_process(folder, pixels)["probabilities"]
    difference = float(np.max(np.abs(served - expected)))
    if difference > TOLERANCE:
        raise ExportError(f"{folder.parent}: the export's predictions differ from the model's by {difference:.3g} "
                          f"(tolerance {TOLERANCE}); nothing was written. Received: max_abs_difference={difference}")


def load_in_fresh_process(export_dir, pixels):
    """Apply ``export_dir``'s ``serving_default`` to ``pixels`` in a new Python importing only TensorFlow."""
    with tempfile.TemporaryDirectory() as scratch:
        pixels_path, out_path = Path(scratch) / "pixels.npy", Path(scratch) / "out.npz"
        np.save(pixels_path, np.asarray(pixels, np.float32))
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
        command = python_command("-c", _VERIFY_SCRIPT, str(export_dir), str(pixels_path), str(out_path))
        done = subprocess.run(command, capture_output=True, text=True, timeout=VERIFY_TIMEOUT_S, env=env)
        if done.returncode != 0:
            raise ExportError(f"{export_dir}: loading the export in a fresh process failed:\n{done.stderr[-2000:]}")
        with np.load(out_path) as outputs:
            return {"probabilities": outputs["probabilities"], "class": outputs["classes"]}


def load_signature(model_dir):
    """The ``serving_default`` signature of the export ``model_dir``; :class:`NotAnExport`, in one line, where
    TensorFlow cannot load it (a file cut short or damaged) or its signature is not the one :func:`export` writes."""
    expected = f"{INPUT} float32 [N, {data_lib.PIXELS}] -> probabilities, class"
    try:
        signatures = tf.saved_model.load(str(model_dir)).signatures
    except (OSError, LookupError, ValueError, tf.errors.OpError) as error:  # "Wire format was corrupt", ...
        said = " ".join(str(error).split())
        raise NotAnExport(f"{model_dir}: expected a SavedModel as `cnnpar export` writes it, which TensorFlow cannot "
                          f"load from there. Received: {type(error).__name__}: {said}") from None
    if SIGNATURE not in signatures:
        raise NotAnExport(f"{model_dir}: expected a SavedModel with the signature {SIGNATURE} ({expected}). "
                          f"Received: signatures {sorted(signatures) or 'none'}")
    signature = signatures[SIGNATURE]
    _, inputs = signature.structured_input_signature
    outputs = signature.structured_outputs
    spec = inputs.get(INPUT)
    if (set(inputs) != {INPUT} or spec.dtype != tf.float32 or spec.shape.as_list() != [None, data_lib.PIXELS]
            or not {"probabilities", "class"} <= set(outputs)):
        taken = ", ".join(f"{name} {value.dtype.name} {value.shape.as_list()}" for name, value in inputs.items())
        raise NotAnExport(f"{model_dir}: expected its {SIGNATURE} signature to take {expected}. Received: "
                          f"{taken or 'no input'} -> {', '.join(outputs) or 'no output'}")
    return signature


def _move_into_place(staging, target):
    if not target.exists():
        os.replace(staging, target)
        return
    retired = target.with_name(f".{target.name}.replaced")
    shutil.rmtree(retired, ignore_errors=True)
    os.replace(target, retired)
    os.replace(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


def save_weights(model, path):
    """Save ``model``'s weights to ``path`` (ending in ``.weights.h5``) through a temporary file and a rename."""
    path = Path(path)
    write_atomic(path, None, write=model.save_weights)
    return path


def load_weights(path, kind=None):
    """Rebuild the model of ``kind`` (default: read from the run file's name) holding the weights in ``path``:
    a zoo kind, or the source of a user's model (a ``.keras`` file or ``package.module:function``, as
    ``zoo.models.from_source`` takes it, for 28x28 grayscale digits in 10 classes).

    A file Keras cannot take raises ``ValueError`` in one line: a name without the ``.weights.h5`` suffix (Keras
    reads any other ``.h5`` as a Keras 2 file), a file that is not HDF5 or is cut short, the weights of another
    model kind (the message names the kind they fit).
    """
    path = Path(path)
    kind = kind or runs.kind_of(path.name)
    if kind is None:
        raise ValueError(f"{path}: cannot tell the model from the file name; give the model kind "
                         f"({sorted(MODEL_NAMES)}). Received: model=None")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found. Received: weights={path}")
    if not path.name.endswith(".weights.h5"):
        raise ValueError(f"{path}: expected a file named *.weights.h5, as `cnnpar train` writes them: Keras reads "
                         f"the weights by that suffix (any other .h5 as a Keras 2 model); rename it. "
                         f"Received: weights={path}")
    model = _built(kind)  # a user's model that does not fit the digits raises its own one-line error
    try:
        _load_weights_into(model, path)
    except OSError as error:  # h5py's, in one line: "file signature not found", "truncated file: eof = ..."
        raise ValueError(f"{path}: expected an HDF5 file of weights, as `cnnpar train` writes them, which h5py cannot "
                         f"read. Received: {type(error).__name__}: {' '.join(str(error).split())}") from None
    except ValueError:  # Keras's lists every layer that did not fit, with its arrays
        fits = [other for other in MODEL_NAMES if other != kind and _fits(other, path)]
        raise ValueError(f"{path}: these weights are not the {kind} model's (asked for: --model, or the file name); "
                         + (f"they are the {fits[0]} model's: give --model {fits[0]}" if fits else
                            f"they fit none of the models ({', '.join(MODEL_NAMES)})")
                         + f". Received: model={kind}") from None
    if found := non_finite_weight(model):
        raise ValueError(f"{path}: the weight {found[0]} holds {found[1]} non-finite values (NaN or infinity): a "
                         f"damaged file, or a run that diverged. Received: weights={path}")
    return model


def _built(kind):
    """The compiled model of ``kind``, a zoo kind or a user's model's source, its optimizer built."""
    from keras_cnnpar.zoo import models

    model = models.build(kind) if kind in MODEL_NAMES else models.from_source(kind)
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)  # the file holds the optimizer state too
    return model


def _load_weights_into(model, path):
    """Load the weights in ``path`` into ``model`` (Keras's warnings of what did not fit left out)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_weights(path)


def _fits(kind, path):
    """Whether the weights in ``path`` are those of the CNN of ``kind``."""
    try:
        _load_weights_into(_built(kind), path)
    except ValueError:
        return False
    return True


def predict_csv(model_dir, test_csv, out, *, batch_size=512):
    """Write Kaggle ``ImageId,Label`` predictions of the export ``model_dir`` for an unlabeled ``test_csv``.

    ImageId starts at 1. Bad input raises :class:`keras_cnnpar.zoo.data.DataError`
    before anything is written, and the CSV is written atomically. Returns the
    number of rows.
    """
    pixels, _ = data_lib.read_kaggle_csv(test_csv, labeled=False)
    signature = load_signature(model_dir)
    outputs = [signature(**{INPUT: tf.constant(pixels[i:i + batch_size], tf.float32)})
               for i in range(0, len(pixels), batch_size)]
    probabilities = np.concatenate([output["probabilities"].numpy() for output in outputs])
    if (bad := np.flatnonzero(~np.isfinite(probabilities).all(axis=1))).size:
        raise NotAnExport(f"{model_dir}: its probabilities are not finite (NaN or infinity) for {bad.size} of the "
                          f"{len(pixels)} rows of {test_csv}, the first at line {bad[0] + 2} (ImageId {bad[0] + 1}): "
                          f"its weights are damaged; nothing was written. Received: {probabilities[bad[0]].tolist()}")
    classes = np.concatenate([output["class"].numpy() for output in outputs])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = np.column_stack([np.arange(1, len(classes) + 1), classes])
    write_atomic(out, None, write=lambda partial: np.savetxt(partial, rows, fmt="%d", delimiter=",",
                                                                   header="ImageId,Label", comments=""))
    return len(rows)
