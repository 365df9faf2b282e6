"""When a partitioned table must be read again: its set of partitions changed since the planner last looked."""

from cdc_assets.engine.partitions import repartition_reason


def test_a_first_look_and_an_unchanged_set_need_nothing() -> None:
    assert repartition_reason(None, ["public.m1"]) is None
    assert repartition_reason(["public.m1", "public.m2"], ["public.m2", "public.m1"]) is None
    assert repartition_reason([], []) is None


def test_an_attached_or_detached_partition_is_named() -> None:
    reason = repartition_reason(["public.m1"], ["public.m1", "public.m2"])
    assert reason is not None and "public.m2 attached" in reason and "read again" in reason
    reason = repartition_reason(["public.m1", "public.m2"], ["public.m2"])
    assert reason is not None and "public.m1 detached" in reason
