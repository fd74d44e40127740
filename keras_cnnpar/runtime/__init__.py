"""This machine and process: processor features, devices, process start-up, subprocesses, atomic files.

Nothing here imports another part of the package; everything else may import it.
"""
