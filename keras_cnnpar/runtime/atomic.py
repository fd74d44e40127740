"""Files written all at once: a reader sees the old file or the new one, never half of one.

Temporary files and folders are created private (0600, 0700); before one takes its place it gets the mode
that ``open()`` or ``mkdir`` would have given it under the umask, so TF Serving running as another user
reads an export as it would read any file of the user's.

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
    os.fchmod(descriptor, created_mode())
    try:
        with os.fdopen(descriptor, "wb") as file:
            if write is None:
                file.write(content.encode("utf-8") if isinstance(content, str) else content)
        if write is not None:
            write(temporary)
        with open(temporary, "rb+") as file:
            os.fchmod(file.fileno(), created_mode())  # a library may have written a new file in its place
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def umask():
    """This process's umask, read where Linux shows it (``/proc/self/status``), else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def created_mode(directory=False):
    """The mode ``open()`` (or, with ``directory``, ``mkdir``) gives a new file under the umask.

    >>> old = os.umask(0o027); created_mode(), created_mode(directory=True), os.umask(old) == 0o027
    (416, 488, True)
    """
    return (0o777 if directory else 0o666) & ~umask()
