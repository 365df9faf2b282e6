"""LSNs: the text form, and the end of the inserted WAL at page and segment boundaries (no database)."""

from __future__ import annotations

import pytest

from cdc_assets.sources.postgres.lsn import end_of_inserted_wal, format_lsn, parse_lsn

BLOCK, SEGMENT = 8192, 16 * 2**20


def test_text_form_round_trips_and_a_malformed_one_is_refused() -> None:
    assert parse_lsn("1A/B9A018") == (0x1A << 32) | 0xB9A018
    assert format_lsn(parse_lsn("0/1AB9A018")) == "0/1AB9A018"
    with pytest.raises(ValueError, match="XXXXXXXX/XXXXXXXX"):
        parse_lsn("1AB9A018")


@pytest.mark.parametrize(
    ("insert", "end"),
    [
        # the case a suite run met: the last record ended at 0/1AB9A000; the insert position names the next page's
        # first record, past its 24-byte header; the server's flush position stays at 0/1AB9A000 while idle
        ("0/1AB9A018", "0/1AB9A000"),
        ("0/1B000028", "0/1B000000"),  # a segment's first page: a 40-byte header
        ("1/28", "1/0"),
        ("0/1AB9A040", "0/1AB9A040"),  # a record starts at 24 on this page: 0x40 is after it
        ("0/1B000018", "0/1B000018"),  # inside a segment's long header no record starts: left as it is
        ("0/1AB99FC8", "0/1AB99FC8"),
        ("0/1AB9A000", "0/1AB9A000"),
    ],
)
def test_the_end_of_inserted_wal_is_a_pages_start_where_the_insert_position_is_past_its_header(
    insert: str, end: str
) -> None:
    assert format_lsn(end_of_inserted_wal(parse_lsn(insert), BLOCK, SEGMENT)) == end


def test_other_block_and_segment_sizes() -> None:
    assert end_of_inserted_wal(32768 * 5 + 24, 32768, 2**20) == 32768 * 5
    assert end_of_inserted_wal(2**20 * 3 + 40, 32768, 2**20) == 2**20 * 3
    assert end_of_inserted_wal(8192 * 5 + 24, 32768, 2**20) == 8192 * 5 + 24  # not a page start with 32 kB pages
