"""Parallel training strategies; each module registers its string alias.

>>> from keras_cnnpar import strategies
>>> strategies.names()
['mirrored', 'single']
"""

from keras_cnnpar.strategies.base import Strategy, create, names, register, resolve
from keras_cnnpar.strategies.mirrored import DataParallel
from keras_cnnpar.strategies.single import Single

__all__ = ["DataParallel", "Single", "Strategy", "create", "names", "register", "resolve"]
