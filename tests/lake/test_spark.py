"""The Spark session's defaults that need no session: the driver heap that fits the machine."""

from __future__ import annotations

from cdc_assets.lake.spark import default_driver_memory, machine_memory_bytes, memory_megabytes

GB = 2**30


def test_default_driver_memory_is_a_quarter_of_the_machine_with_a_floor_and_a_cap() -> None:
    assert default_driver_memory(24 * GB) == "6144m"
    assert default_driver_memory(2 * GB) == "1024m"  # the floor
    assert default_driver_memory(256 * GB) == "16384m"  # the cap
    assert machine_memory_bytes() > 0


def test_memory_sizes_read_as_the_jvm_writes_them() -> None:
    assert memory_megabytes("6026m") == 6026 and memory_megabytes("2g") == 2048 and memory_megabytes("1048576") == 1
