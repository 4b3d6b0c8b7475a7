"""The sha256 of files outside the store that ids hash (a local model's weights, a local dataset): read once,
then remembered under the file's stamps on disk, in this process and in `digests.json` under the dihal cache,
as git's index remembers a file.

The stamps are the device, inode, size, mtime and ctime (ns). Any write to a file moves its ctime, which no
program can set back (`touch -d` and `os.utime` set mtime only), so a remembered digest is that of the bytes as
they are. A file written in the last RACY_S seconds is read every time and not remembered: a second write in
the same clock tick would leave its stamps as they were. The book keeps one entry per path; a lost race
between two processes writing it costs one more read, never a wrong digest.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dihal.artifacts.store import file_sha256

BOOK = "digests.json"
RACY_S = 2.0
_SEEN: dict[tuple, str] = {}  # stamps -> sha256, for this process


def stamps(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_digest(path: Path, cache: Path | None = None) -> str:
    """sha256 of the file's bytes; `cache`: the folder of the book shared across processes (None: this
    process's memory alone)."""
    key = stamps(path)
    if key in _SEEN:
        return _SEEN[key]
    book = cache / BOOK if cache is not None else None
    entries = _read(book)
    entry = entries.get(key[0])
    if entry is not None and tuple(entry["stamps"]) == key[1:]:
        _SEEN[key] = entry["sha256"]
        return entry["sha256"]
    digest = file_sha256(path)
    if stamps(path) != key:  # written while it was read: the bytes read may be neither version
        return file_digest(path, cache)
    _SEEN[key] = digest
    settled = time.time() - max(key[4], key[5]) / 1e9 > RACY_S
    if book is not None and settled:
        entries = _read(book)  # others may have added theirs meanwhile
        entries[key[0]] = {"stamps": list(key[1:]), "sha256": digest}
        _write(book, entries)
    return digest


def _read(book: Path | None) -> dict:
    if book is None or not book.is_file():
        return {}
    try:
        entries = json.loads(book.read_text())
    except (OSError, ValueError):
        return {}  # unreadable: a book is only a shortcut, read the files
    return entries if isinstance(entries, dict) else {}


def _write(book: Path, entries: dict) -> None:
    try:
        book.parent.mkdir(parents=True, exist_ok=True)
        tmp = book.with_name(f"{book.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, book)
    except OSError:
        pass  # a read-only or full cache: the digest is still right, only not remembered
