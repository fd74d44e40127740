"""What a run leaves behind: the results folder's files (``runs.csv``, the epoch CSVs, ``results.log``), the
logging callbacks that write them, checkpoints and provenance. Never imports the strategies."""
