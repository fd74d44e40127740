"""The model zoo (the original digit-recognizer CNNs, a small ResNet; it owns the model names) and the data
sources (the embedded digits, Kaggle CSVs, TFDS). Public as ``cnnpar.models`` and ``cnnpar.data``."""
