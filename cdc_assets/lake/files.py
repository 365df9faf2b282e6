"""Files and folders of the lake, on a local disk or in an object store, through one API.

Contract: ``LakePath(location)`` names a file or folder by a local path, a ``file://`` URI or an ``s3a://`` URI
(``cdc_assets.lake.object_store.arrow_filesystem`` resolves it; any other scheme raises its ``ValueError``). Its
``uri`` is what Spark reads and writes (the local path, or the ``s3a://`` URI); its ``filesystem`` and ``path`` are
what pyarrow reads and writes. Every file the pipeline handles outside Delta's own API goes through it: chunk plans,
markers, the window bounds, staged chunk files (written by Spark's Python workers), spill parts.

- ``read_text()`` raises ``FileNotFoundError`` for a missing file, on every store.
- ``write_text(text)``: a reader sees the old content or the new one, never a part: on a local disk a temporary
  file in the same folder renamed over the target; in an object store one PUT (visible whole when complete).
- ``write_new(text)``: writes only when no file is there; ``True`` when it wrote. Atomic on a local disk (a hard
  link, which fails on an existing name). An object store's check and write are two requests: two writers racing in
  between both write (the later one's content stays), so callers that need one winner across processes must also
  serialize themselves there (documented where used).
- ``open_atomic_output()``: a stream for a big file (Parquet) that becomes visible under its name only when the
  block ends without an error: it is written under a hidden temporary name (``.<name>.<random>.tmp``: Spark and the
  staged-file listing skip names that start with ``.``) and moved into place; on an error the temporary file is
  removed. An object store's move is a server-side copy, then a delete.
- ``entries()``: the folder's direct children (name, kind, size, modification time) in one listing; none for a
  missing folder. ``glob(pattern)``: the children that are files and match ``pattern`` (``fnmatch``).
- ``unlink``, ``rmtree`` and ``mkdir`` never fail because the thing is already gone (or already there). An object
  store has no folders: a folder exists while a file lies under it, and ``mkdir`` is a no-op there.
- ``mtime()``: the file's modification time in epoch seconds (an object store's: when it was last written, to the
  second on S3).
"""

from __future__ import annotations

import fnmatch
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from cdc_assets.lake.object_store import arrow_filesystem


@dataclass(frozen=True)
class LakeEntry:
    """One child of a folder, as one listing returned it."""

    path: LakePath
    is_dir: bool
    size: int | None
    mtime: float | None

    @property
    def name(self) -> str:
        return self.path.name


class LakePath:
    __slots__ = ("filesystem", "path", "uri")

    def __init__(self, location: str | os.PathLike[str] | LakePath) -> None:
        if isinstance(location, LakePath):
            self.uri, self.filesystem, self.path = location.uri, location.filesystem, location.path
            return
        text = os.fspath(location)
        self.filesystem, self.path = arrow_filesystem(text)
        self.uri = self.path if self.is_local else text.rstrip("/")

    @classmethod
    def _of(cls, uri: str, filesystem: pafs.FileSystem, path: str) -> LakePath:
        made = cls.__new__(cls)
        made.uri, made.filesystem, made.path = uri, filesystem, path
        return made

    # -- names ---------------------------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    @property
    def local_path(self) -> Path | None:
        """The path on the local disk, ``None`` in an object store."""
        return Path(self.path) if self.is_local else None

    def __truediv__(self, name: str) -> LakePath:
        name = name.strip("/")
        return LakePath._of(f"{self.uri.rstrip('/')}/{name}", self.filesystem, f"{self.path.rstrip('/')}/{name}")

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rpartition("/")[2]

    @property
    def stem(self) -> str:
        name = self.name
        return name.rpartition(".")[0] if "." in name.lstrip(".") else name

    @property
    def suffix(self) -> str:
        name = self.name
        return "." + name.rpartition(".")[2] if "." in name.lstrip(".") else ""

    @property
    def parent(self) -> LakePath:
        return LakePath._of(self.uri.rstrip("/").rpartition("/")[0], self.filesystem, self.path.rpartition("/")[0])

    def with_name(self, name: str) -> LakePath:
        return self.parent / name

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"LakePath({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LakePath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    # -- reading -------------------------------------------------------------------------------------------
    def _info(self) -> pafs.FileInfo:
        return self.filesystem.get_file_info(self.path)

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self._info().type == pafs.FileType.Directory

    def is_file(self) -> bool:
        return self._info().type == pafs.FileType.File

    def mtime(self) -> float:
        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(self.uri)
        return info.mtime.timestamp() if info.mtime is not None else 0.0

    def size(self) -> int:
        info = self._info()
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(self.uri)
        return int(info.size or 0)

    def read_bytes(self) -> bytes:
        if not self.is_file():
            raise FileNotFoundError(self.uri)
        with self.filesystem.open_input_stream(self.path) as stream:
            return stream.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def entries(self) -> list[LakeEntry]:
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=False)
        try:
            infos = self.filesystem.get_file_info(selector)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [
            LakeEntry(
                path=self / info.base_name,
                is_dir=info.type == pafs.FileType.Directory,
                size=info.size,
                mtime=info.mtime.timestamp() if info.mtime is not None else None,
            )
            for info in sorted(infos, key=lambda i: i.base_name)
        ]

    def glob(self, pattern: str) -> list[LakeEntry]:
        return [e for e in self.entries() if not e.is_dir and fnmatch.fnmatchcase(e.name, pattern)]

    # -- writing -------------------------------------------------------------------------------------------
    def mkdir(self) -> None:
        if self.is_local:
            self.filesystem.create_dir(self.path, recursive=True)

    def write_bytes(self, data: bytes) -> None:
        if not self.is_local:
            with self.filesystem.open_output_stream(self.path) as stream:
                stream.write(data)
            return
        with self.open_atomic_output() as stream:
            stream.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def touch(self) -> None:
        """An empty file whose modification time is now."""
        self.write_bytes(b"")

    def write_new(self, text: str) -> bool:
        local = self.local_path
        if local is None:
            if self.exists():
                return False
            self.write_text(text)
            return True
        temporary = self._temporary()
        self.parent.mkdir()
        Path(temporary.path).write_text(text)
        try:
            os.link(temporary.path, local)  # atomic, fails when the name exists
        except FileExistsError:
            return False
        finally:
            Path(temporary.path).unlink(missing_ok=True)
        return True

    def _temporary(self) -> LakePath:
        return self.with_name(f".{self.name}.{uuid.uuid4().hex}.tmp")

    @contextmanager
    def open_atomic_output(self) -> Iterator[pa.NativeFile]:
        temporary = self._temporary()
        self.parent.mkdir()
        try:
            with self.filesystem.open_output_stream(temporary.path) as stream:
                yield stream
            if self.is_local:
                os.replace(temporary.path, self.path)
            else:
                self.filesystem.move(temporary.path, self.path)
        finally:
            temporary.unlink()

    def unlink(self) -> None:
        try:
            self.filesystem.delete_file(self.path)
        except FileNotFoundError:
            pass

    def rmtree(self) -> None:
        try:
            self.filesystem.delete_dir(self.path)
        except FileNotFoundError:
            pass
