"""``LakePath`` on a local disk (the same contract on an object store: tests/integration/test_lake_on_object_store.py).

The checks are functions of a root ``LakePath`` so that the integration test runs them on S3 as they are."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdc_assets.lake.files import LakePath


def check_text_files(root: LakePath) -> None:
    folder = root / "control" / "plans"
    target = folder / "a.json"
    with pytest.raises(FileNotFoundError):
        target.read_text()
    assert not target.exists() and folder.entries() == []
    target.write_text('{"v": 1}')
    assert target.read_text() == '{"v": 1}' and target.is_file() and not target.is_dir()
    target.write_text('{"v": 2}')  # replaced whole
    assert target.read_text() == '{"v": 2}'
    assert not target.write_new('{"v": 3}')  # a file is there: nothing written
    assert target.read_text() == '{"v": 2}'
    assert (folder / "b.json").write_new("first") and (folder / "b.json").read_text() == "first"
    (folder / "c.hw").write_text("7")
    assert [e.name for e in folder.entries()] == ["a.json", "b.json", "c.hw"]  # no temporary file is left
    assert [e.name for e in folder.glob("*.json")] == ["a.json", "b.json"]
    assert (folder / "c.hw").size() == 1
    assert abs((folder / "c.hw").mtime() - time.time()) < 120
    assert all(e.mtime is not None and not e.is_dir for e in folder.entries())
    (folder / "c.hw").unlink()
    (folder / "c.hw").unlink()  # gone already: no error
    assert [e.name for e in folder.glob("*.hw")] == []
    assert [(e.name, e.is_dir) for e in (root / "control").entries()] == [("plans", True)]


def check_atomic_output(root: LakePath) -> None:
    target = root / "staged" / "_cdc_attempt=a1" / "chunk-0-part-0.parquet"
    rows = pa.table({"id": [1, 2, 3], "text": ["x", None, "z"]})
    with target.open_atomic_output() as stream, pq.ParquetWriter(stream, rows.schema) as writer:
        writer.write_table(rows)
    with target.filesystem.open_input_file(target.path) as stream:
        assert pq.ParquetFile(stream).read().equals(rows)
    failed = target.with_name("chunk-1-part-0.parquet")
    with pytest.raises(RuntimeError, match="read failed"):
        with failed.open_atomic_output() as stream, pq.ParquetWriter(stream, rows.schema) as writer:
            writer.write_table(rows)
            raise RuntimeError("read failed")
    assert not failed.exists()
    assert [e.name for e in target.parent.entries()] == [target.name]  # nor its temporary file
    (root / "staged").rmtree()
    (root / "staged").rmtree()  # gone already: no error
    assert not target.exists() and (root / "staged").entries() == []


def check_names(root: LakePath) -> None:
    path = root / "a" / "b.json"
    assert path.name == "b.json" and path.stem == "b" and path.suffix == ".json"
    assert path.parent == root / "a" and path.with_name("c.hw") == root / "a" / "c.hw"
    assert str(path) == path.uri and path.uri.endswith("/a/b.json")
    assert (root / ".hidden.tmp").stem == ".hidden"
    assert LakePath(path) == path


def test_text_files_on_a_local_disk(tmp_path: Path) -> None:
    check_text_files(LakePath(tmp_path))


def test_atomic_output_on_a_local_disk(tmp_path: Path) -> None:
    check_atomic_output(LakePath(tmp_path))


def test_names_on_a_local_disk(tmp_path: Path) -> None:
    check_names(LakePath(tmp_path))
    assert LakePath(tmp_path).local_path == tmp_path and LakePath(tmp_path).uri == str(tmp_path)
    assert LakePath(f"file://{tmp_path}").uri == str(tmp_path)


def test_a_local_write_new_has_one_winner_among_racing_writers(tmp_path: Path) -> None:
    target = LakePath(tmp_path) / "plans" / "t.json"
    won = [target.write_new(f"writer {i}") for i in range(5)]
    assert won == [True, False, False, False, False] and target.read_text() == "writer 0"
