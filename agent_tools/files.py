"""Files the project writes are whole or absent, and the machine's refusals are read as such.

Every writer (PNGs, the HTML page, report JSON, Parquet parts, the conversion cache's manifest) writes to a
temporary name in the destination's own folder and renames it into place (``os.replace``, atomic on one file
system): a process killed mid-write (SIGKILL, a full disk, power) leaves the old file or none under the final
name, never a truncated one a browser or a client would read. The temporary names start with ``.`` and end with
``.partial``, so a listing of final names never shows them; a kill leaves one behind, which the next write of
the same folder removes once its writer is dead (:func:`remove_stale_partials`).

Layer 1 (standard library only): every layer may use it.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
_HOST = re.sub(r"[^A-Za-z0-9]+", "_", socket.gethostname()) or "host"  # without the names' separators "-" and "."


def writer_tag() -> str:
    """``host-pid-``: what a temporary name carries after its prefix, so a later cleanup can tell whether the
    process writing it still runs (:func:`writer_gone`)."""
    return f"{_HOST}-{os.getpid()}-"


def writer_gone(tail: str) -> bool | None:
    """Whether the writer a name's ``host-pid-random`` tail names has exited; None when the tail names no writer
    of this machine (another host's, an older version's name), whose liveness cannot be checked."""
    parts = tail.rsplit("-", 2)
    if len(parts) != 3 or parts[0] != _HOST or not parts[1].isdigit():
        return None
    return not process_alive(int(parts[1]))


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask sets it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that takes a file name (``savefig``, ``save_file``); on a
    clean exit it is renamed to ``path``, on any exception (or a kill) ``path`` is untouched.

    The temporary file keeps ``path``'s suffix before ``.partial`` only in its name; writers that pick a format
    from the suffix must be told the format (``savefig(..., format="png")``).
    """
    final = Path(path)
    try:
        handle, name = tempfile.mkstemp(prefix=f".{final.name}.{writer_tag()}", suffix=PARTIAL_SUFFIX, dir=final.parent)
    except OSError as exc:
        raise _naming(exc, final) from exc
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        _keep_umask_mode(temporary)
        os.replace(temporary, final)
    except OSError as exc:  # a full disk, a lost permission: name the file the caller asked for, not ours
        temporary.unlink(missing_ok=True)
        raise _naming(exc, final) from exc
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _naming(exc: OSError, final: Path) -> OSError:
    """``exc`` as raised for ``final`` (same type, errno and message) when it names the temporary file or none."""
    if exc.filename is not None and not str(exc.filename).endswith(PARTIAL_SUFFIX):
        return exc
    try:
        return type(exc)(exc.errno, exc.strerror or str(exc), str(final))
    except TypeError:
        return OSError(exc.errno, exc.strerror or str(exc), str(final))


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write ``path`` whole or not at all (a temporary file in the same folder, then renamed).

    No ``fsync``: the rename makes a kill of this process safe; a power cut may still lose the newest files.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as temporary, temporary.open("wb") as stream:
        stream.write(payload)
    return Path(path)


def _keep_umask_mode(path: Path) -> None:
    """``mkstemp`` makes 0600 files; a final file gets the mode a plain ``open`` would give (0666 & ~umask)."""
    with suppress(OSError):
        os.chmod(path, 0o666 & ~current_umask())


def remove_stale_partials(folder: str | Path) -> list[Path]:
    """Delete the temporary files killed writers of this host left in ``folder``; a live writer's are kept."""
    removed: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        named = entry.name.startswith(".") and entry.name.endswith(PARTIAL_SUFFIX)
        if not named or not writer_gone(entry.name.removesuffix(PARTIAL_SUFFIX).rsplit(".", 1)[-1]):
            continue
        try:
            entry.unlink()
            removed.append(entry)
        except OSError:
            continue
    return removed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie — killed, not yet reaped — does not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's live process
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


_FREE_SPACE = "free some space there or write to another folder"
_WRITABLE = "choose a folder you can write to"
_ADVICE = {
    errno.ENOSPC: _FREE_SPACE,
    errno.EDQUOT: _FREE_SPACE,
    errno.EFBIG: "the file is over a size limit; write to another folder",
    errno.EACCES: _WRITABLE,
    errno.EPERM: _WRITABLE,
    errno.EROFS: _WRITABLE,
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path",
    errno.EISDIR: "give a file name, not a folder",
}


def os_error_message(exc: OSError, *, action: str = "") -> str:
    """One line for an operating-system error: the path, what the system said, and what to do about it."""
    where = "" if exc.filename is None else str(exc.filename)
    said = exc.strerror or str(exc) or type(exc).__name__
    advice = _ADVICE.get(exc.errno or 0, "check the path and try again")
    subject = f"{action} {where}".strip()
    return f"{subject + ': ' if subject else ''}{said}; {advice}"
