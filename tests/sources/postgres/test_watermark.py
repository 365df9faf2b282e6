import pytest

from cdc_assets.sources.postgres.watermark import LowWatermark, settled_at_low_watermark, widen_xid


def test_settled_below_xmin_and_finished_below_xmax() -> None:
    lw = LowWatermark.parse("100:110:102,105")
    assert settled_at_low_watermark(99, lw)
    assert settled_at_low_watermark(100, lw)  # xmin itself is not in xip: finished
    assert settled_at_low_watermark(104, lw)
    assert not settled_at_low_watermark(102, lw)  # in progress at LW
    assert not settled_at_low_watermark(105, lw)
    assert not settled_at_low_watermark(110, lw)  # started after LW
    assert not settled_at_low_watermark(5000, lw)


def test_parse_round_trip_and_errors() -> None:
    lw = LowWatermark.parse("7:9:8")
    assert lw == LowWatermark(7, 9, frozenset({8}))
    assert lw.text() == "7:9:8"
    assert LowWatermark.parse("5:5:").xip == frozenset()
    with pytest.raises(ValueError, match="not a pg_snapshot"):
        LowWatermark.parse("garbage")
    with pytest.raises(ValueError, match="inconsistent"):
        LowWatermark.parse("10:12:15")


def test_widen_xid_across_epoch_boundary() -> None:
    epoch1 = 1 << 32
    assert widen_xid(5, epoch1 + 10) == epoch1 + 5
    assert widen_xid(0xFFFFFFF0, epoch1 + 10) == epoch1 - 16  # previous epoch, just before wraparound
    assert widen_xid(20, epoch1 - 16) == epoch1 + 20  # next epoch
    assert widen_xid(742, 750) == 742
    with pytest.raises(ValueError):
        widen_xid(1 << 32, 10)
