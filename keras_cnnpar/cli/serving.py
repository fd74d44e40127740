"""``cnnpar export`` and ``cnnpar predict``: trained weights to a verified SavedModel, and a Kaggle submission."""

import os

import click

from keras_cnnpar.cli.common import (
    FORCE,
    MODELS,
    Refused,
    check_writable,
    model_source,
    not_written,
    quiet_tensorflow,
    refuse_an_input_as_output,
    refuse_to_overwrite,
)
from keras_cnnpar.results import runs


@click.command("export")
@click.option("--weights", type=click.Path(dir_okay=False), required=True,
              help="A run's weights, RESULTS/<run>.weights.h5, as `cnnpar train` writes them.")
@click.option("--model", "model_kind", metavar="MODEL", default=None, callback=model_source,
              help="The model of the weights: 2+2, 3+3, resnet, or the .keras file or package.module:function it "
                   "was trained from (for 28x28 grayscale digits); default: read from the file name.")
@click.option("--out", "base_dir", type=click.Path(file_okay=False), required=True,
              help="Base folder of the model, e.g. models/digits (TF Serving's --model_base_path).")
@click.option("--version", type=click.IntRange(min=1), default=None,
              help="Version folder; default: the next free one, from 1.")
@click.option("--force", is_flag=True, help="Replace an existing version (after the new one verified).")
def export_command(weights, model_kind, base_dir, version, force):
    """Export trained weights as a TF Serving SavedModel, verified before it is put in place.

    Writes OUT/VERSION/saved_model.pb, variables/ and assets.extra/tf_serving_warmup_requests.
    """
    check_writable(base_dir, "--out")
    if not force:
        refuse_existing_version(base_dir, version)
    if model_kind is None and runs.kind_of(weights) is None:
        raise Refused(f"{weights}: cannot tell the model from the file name (a run's weights start with its model's "
                      f"name); give --model: {', '.join(MODELS)}, or the .keras file or package.module:function it "
                      f"was trained from. Received: --weights {weights}")
    quiet_tensorflow()
    from keras_cnnpar import serving

    try:
        model = serving.load_weights(weights, model_kind)
    except (FileNotFoundError, ValueError) as error:
        raise Refused(str(error)) from None
    export_model(model, base_dir, version, force)


@click.command()
@click.option("--model-dir", type=click.Path(file_okay=False), required=True,
              help="An exported version folder, e.g. models/digits/1.")
@click.option("--test", "test_csv", type=click.Path(dir_okay=False), required=True,
              help="Kaggle test.csv: pixel0..pixel783, no label.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Submission CSV to write.")
@FORCE
def predict(model_dir, test_csv, out, force):
    """Write Kaggle ImageId,Label predictions of an export for an unlabeled test.csv.

    Bad input exits with code 2 and writes nothing.
    """
    check_writable(os.path.dirname(os.path.abspath(out)), "--out", out)
    refuse_an_input_as_output(out, test_csv, "--test")
    quiet_tensorflow()
    from keras_cnnpar import serving
    from keras_cnnpar.zoo import data as data_lib

    if not os.path.isfile(os.path.join(model_dir, "saved_model.pb")):
        raise click.BadParameter(f"{model_dir}: expected an export holding saved_model.pb. "
                                 f"Received: model_dir={model_dir}", param_hint="--model-dir")
    refuse_to_overwrite([out], force)
    try:
        rows = serving.predict_csv(model_dir, test_csv, out)
    except data_lib.DataError as error:
        raise click.BadParameter(str(error), param_hint="--test") from None
    except serving.NotAnExport as error:
        raise Refused(str(error)) from None
    except OSError as error:
        raise not_written(error, os.path.dirname(os.path.abspath(out)), "--out", f"{out} was not written",
                           out) from None
    click.echo(f"wrote {out} ({rows} predictions)")


def refuse_existing_version(base_dir, version):
    """Refuse (one line, exit 2, before any work) where the export version ``version`` of ``base_dir`` exists."""
    if base_dir is not None and version is not None and os.path.exists(os.path.join(base_dir, str(version))):
        raise Refused(_existing_version(base_dir, version))


def _existing_version(base_dir, version):
    """The refusal of an export ``version`` that exists, the same for `cnnpar export` and `cnnpar train --export`."""
    return (f"{os.path.join(base_dir, str(version))} already exists; choose another --version, or replace it with "
            f"`cnnpar export --version {version} --force`. Received: --version {version}")


def _what_is_kept(recorded):
    return f"the run is recorded in {recorded[0]} (its weights: {recorded[1]}); " if recorded else ""


def export_model(model, base_dir, version, force, recorded=None):
    """Export ``model`` (:func:`serving.export`); a failure in one line. ``recorded``: ``(results folder, weights
    file)`` of the run that trained it (`cnnpar train --export`), which a failed export leaves as they are."""
    from keras_cnnpar import serving

    try:
        target = serving.export(model, base_dir, version, force=force)
    except FileExistsError:  # created since the refusal before the work
        raise Refused(_existing_version(base_dir, version)) from None
    except (serving.ExportError, ValueError) as error:  # ValueError: weights that are not finite
        raise click.ClickException(_what_is_kept(recorded) + str(error)) from None
    except KeyboardInterrupt:  # click prints "Aborted!" alone
        click.echo(f"Error: {_what_is_kept(recorded)}the export was interrupted: nothing of it was left in "
                   f"{base_dir}", err=True)
        raise
    click.echo(f"exported {target} (signature serving_default: pixels [N, 784] -> probabilities, class; "
               f"verified in a fresh process)")
