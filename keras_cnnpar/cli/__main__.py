"""``python -m keras_cnnpar.cli``: the ``cnnpar`` command."""

from keras_cnnpar.cli import run

run()
