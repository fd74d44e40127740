"""Files written all at once: a reader sees the old file or the new one, never half of one.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> write_atomic(folder / "a.txt", "hello")
>>> (folder / "a.txt").read_text(), sorted(p.name for p in folder.iterdir())
('hello', ['a.txt'])
"""

import os
import tempfile
from pathlib import Path


def write_atomic(path, content, write=None):
    """Write ``path`` all at once: a unique temporary file in the same folder, flushed, fsynced, then renamed.

    ``content`` is text or bytes; or give ``write(temporary_path)`` to let
    another library write the temporary file (its name keeps ``path``'s
    suffixes). A failed write leaves the old file as it was.
    """
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".partial" + "".join(path.suffixes),
                                             dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            if write is None:
                file.write(content.encode("utf-8") if isinstance(content, str) else content)
        if write is not None:
            write(temporary)
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
