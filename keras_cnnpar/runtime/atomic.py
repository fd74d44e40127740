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

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def probe_folder(folder):
    """Check that this process can create files in ``folder`` by creating one (and removing it): in ``folder``, or
    where it does not exist yet, in its nearest existing parent. Raises ``NotADirectoryError`` where that is a
    file, ``os.stat``'s ``OSError`` where a link on the way leads nowhere (a loop of links, a missing target),
    else the ``OSError`` that creating a file there raised, naming that folder (``os.access`` says yes to root on
    a read-only mount or in ``/proc``, where nothing can be created).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> probe_folder(folder / "new" / "deeper"), sorted(folder.iterdir())
    (None, [])
    >>> try:
    ...     probe_folder("/proc/x")
    ... except OSError as error:
    ...     print(type(error).__name__, error.filename)
    FileNotFoundError /proc
    """
    existing = Path(os.path.abspath(folder))
    while not existing.exists():
        if existing.is_symlink():
            os.stat(existing)  # a link to nothing or a loop of links: mkdir would fail there once work was done
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".cnnpar-probe.", dir=existing)
    except OSError as error:
        raise type(error)(error.errno, os.strerror(error.errno), str(existing)) from None
    os.close(descriptor)
    os.unlink(probe)


def write_atomic(path, content, write=None):
    """Write ``path`` all at once: a unique temporary file in the same folder, flushed, fsynced, then renamed.

    ``content`` is text or bytes; or give ``write(temporary_path)`` to let
    another library write the temporary file (its name keeps ``path``'s
    suffixes). A failed write leaves the old file as it was.
    """
    temporary = stage(path, content, write)
    try:
        os.replace(temporary, path)
    except BaseException:
        discard(temporary)
        raise


def stage(path, content=None, write=None):
    """The first half of :func:`write_atomic`: ``path``'s new content (``content``, or what ``write(temporary_path)``
    writes) in a temporary file beside it, fsynced; return that file's path. ``os.replace(temporary, path)`` puts it
    in place, :func:`discard` drops it; several files staged first, then replaced, change all at once or not at all.
    A failed write leaves nothing behind.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> temporary = stage(folder / "a.txt", "new")
    >>> sorted(p.name for p in folder.iterdir()) == [Path(temporary).name], os.replace(temporary, folder / "a.txt")
    (True, None)
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
    except BaseException:
        discard(temporary)
        raise
    return temporary


def write_together(files):
    """Write several files all at once: ``files`` maps each path to its content, text or bytes, or to a
    ``write(temporary_path)`` function (as :func:`write_atomic` takes them). Every file is staged (:func:`stage`)
    before any takes its place, so a failure to write one (a full disk) leaves every file as it was and no
    temporary file behind.

    >>> folder = Path(tempfile.mkdtemp())
    >>> write_together({folder / "a.txt": "old", folder / "b.txt": b"old"})
    >>> def full(temporary):
    ...     raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    >>> write_together({folder / "a.txt": "new", folder / "b.txt": full})
    Traceback (most recent call last):
    OSError: [Errno 28] No space left on device
    >>> [(p.name, p.read_text()) for p in sorted(folder.iterdir())]
    [('a.txt', 'old'), ('b.txt', 'old')]
    """
    staged = []
    try:
        for path, content in files.items():
            staged.append((stage(path, None, content) if callable(content) else stage(path, content), path))
        for temporary, path in staged:
            os.replace(temporary, path)
    except BaseException:
        for temporary, _ in staged:
            discard(temporary)  # those renamed already are gone from their temporary names
        raise


@contextlib.contextmanager
def made_folder(folder):
    """``folder``, created with its missing parents for the block; if the block fails, the folders it created go
    again where they are empty, so a failed write leaves no empty folder behind (nor one a rerun trips on).

    >>> base = Path(tempfile.mkdtemp())
    >>> try:
    ...     with made_folder(base / "models" / "digits"):
    ...         raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    ... except OSError:
    ...     pass
    >>> list(base.iterdir())
    []
    """
    folder = Path(os.path.abspath(folder))
    missing = [path for path in (folder, *folder.parents) if not path.exists()]  # the deepest first
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    except BaseException:
        for path in missing:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


def discard(temporary):
    """Remove a temporary file (:func:`stage`), emptied first: a library that still holds it open after a failed write
    (h5py, which writes again when its file object is collected) then finds room on a full disk rather than failing
    again, and the space is free at once. A file that another name still holds (a hard link) is only unlinked."""
    with contextlib.suppress(OSError):
        if os.stat(temporary).st_nlink == 1:
            os.truncate(temporary, 0)
    Path(temporary).unlink(missing_ok=True)


def check_room(folder, size):
    """Raise ``OSError`` (``ENOSPC``) unless the disk of ``folder`` has ``size`` bytes free for this process: a
    library that fails midway on a full disk (h5py, which then complains as it is collected) is better not started.

    >>> check_room(".", 2**62)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    OSError: [Errno 28] No space left on device: ... bytes free, 4611686018427387904 needed: '.'
    """
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    if free < size:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free} bytes free, {size} needed", str(folder))


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
