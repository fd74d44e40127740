"""``cnnpar data``: data files prepared from the embedded digits."""

import os

import click

from keras_cnnpar.cli.common import FORCE, SEED, check_writable, not_written, quiet_tensorflow, refuse_to_overwrite


@click.group()
def data():
    """Prepare data files."""


@data.command("kaggle")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Folder for train.csv and test.csv.")
@click.option("--test-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2,
              show_default=True, help="Share of each class written, unlabeled, to test.csv.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@FORCE
def kaggle(out_dir, test_fraction, seed, force):
    """Write the embedded digits as Kaggle digit-recognizer CSVs.

    train.csv has label,pixel0..pixel783; test.csv has pixel0..pixel783 and no label.
    """
    check_writable(out_dir, "--out")
    quiet_tensorflow()
    from keras_cnnpar.zoo import data as data_lib

    refuse_to_overwrite([os.path.join(out_dir, name) for name in ("train.csv", "test.csv")], force)
    try:
        paths = data_lib.write_kaggle(out_dir, test_fraction=test_fraction, seed=seed)
    except OSError as error:
        raise not_written(error, out_dir, "--out", "neither train.csv nor test.csv was written") from None
    for path in paths:
        click.echo(f"wrote {path}")
