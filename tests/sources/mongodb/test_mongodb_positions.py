"""Positions, resume tokens and timestamps of the MongoDB source (pure)."""

import pytest
from bson.timestamp import Timestamp

from cdc_assets.sources.mongodb.watermark import (
    format_position,
    parse_timestamp,
    position_of,
    timestamp_of,
    token_position,
)


def test_positions_order_like_cluster_times_and_round_trip() -> None:
    times = [Timestamp(1, 1), Timestamp(1, 2), Timestamp(1, 4294967295), Timestamp(2, 0), Timestamp(1795724544, 7)]
    positions = [position_of(t) for t in times]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert [timestamp_of(p) for p in positions] == times
    assert format_position(position_of(Timestamp(1795724544, 7))) == "1795724544:7"
    with pytest.raises(ValueError):
        timestamp_of(-1)


def test_resume_tokens_of_both_forms_give_their_cluster_time() -> None:
    test_server = {"_data": "6b08950000000003"}
    assert token_position(test_server) == position_of(Timestamp(0x6B089500, 3))
    assert token_position('{"_data": "6b08950000000003"}') == token_position("6b08950000000003")
    # a MongoDB 6.0 insert event's token: 82, the 8-byte timestamp, then the rest of the KeyString
    real = "8265F1A2B3000000022B042C0100296E5A1004A5F3E2D1C0B0A09080706050403020146645F696400645F3A8E1F0004"
    assert token_position({"_data": real}) == position_of(Timestamp(0x65F1A2B3, 2))


@pytest.mark.parametrize("token", ["zz", "", "abc", {"_data": 5}, '{"_data": ', "7f65F1A2B3000000022B04", {"x": "1"}])
def test_unparsable_tokens_name_the_allowed_forms(token) -> None:
    with pytest.raises(ValueError, match=r"not a resume token as \{\"_data\": \"<hex>\"\}.*16 hex digits"):
        token_position(token)


def test_timestamps() -> None:
    assert parse_timestamp("1795724544") == position_of(Timestamp(1795724544, 0))
    assert parse_timestamp(" 1795724544:12 ") == position_of(Timestamp(1795724544, 12))
    for bad in ("", "x", "1:2:3", "-1", "1.5", "4294967296", "1:4294967296"):
        with pytest.raises(ValueError, match=r"SEC or SEC:ORD|unsigned 32-bit"):
            parse_timestamp(bad)
