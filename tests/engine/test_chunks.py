import pytest

from cdc_assets.engine.chunks import (
    Chunk,
    ChunkPlan,
    chunk_index,
    chunk_partition_key,
    chunks_from_boundaries,
    plan_even_integer_chunks,
    validate_plan,
)


def test_even_split_covers_key_space_contiguously() -> None:
    chunks = plan_even_integer_chunks(1, 100_000, 100_000, 10_000)
    assert chunks is not None
    assert len(chunks) == 10
    assert chunks[0].lo is None and chunks[-1].hi is None
    assert chunks[1].lo == ("10001",)
    validate_plan(ChunkPlan("t", ("id",), chunks))


def test_sparse_keys_refuse_even_split() -> None:
    assert plan_even_integer_chunks(1, 10**12, 1000, 100) is None


def test_empty_table_has_one_open_chunk() -> None:
    assert plan_even_integer_chunks(0, -1, 0, 10) == (Chunk(0, None, None),)


def test_plan_json_round_trip_and_validation() -> None:
    plan = ChunkPlan("s.t", ("a", "b"), chunks_from_boundaries([("1", "x"), ("2", 'y\n"q"')]))
    again = ChunkPlan.from_json(plan.to_json())
    assert again == plan
    assert again.chunk("chunk-000002").lo == ("2", 'y\n"q"')
    with pytest.raises(KeyError, match="no chunk"):
        again.chunk("chunk-000003")
    broken = ChunkPlan("s.t", ("a",), (Chunk(0, None, ("5",)), Chunk(1, ("6",), None)))
    with pytest.raises(ValueError, match="not contiguous"):
        validate_plan(broken)


def test_partition_keys() -> None:
    assert chunk_partition_key(12) == "chunk-000012"
    assert chunk_index("chunk-000012") == 12
    with pytest.raises(ValueError, match="chunk-NNNNNN"):
        chunk_index("12")
