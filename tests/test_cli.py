"""``cdc_assets.cli``'s pure parts: what ``backfill --chunks`` accepts (the command itself runs against a webserver
in ``tests/browser``)."""

from __future__ import annotations

import pytest

from cdc_assets.cli import chunk_range, main


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3", ("chunk-000003", "chunk-000003")),
        ("0-9", ("chunk-000000", "chunk-000009")),
        (" 2 - 4 ", ("chunk-000002", "chunk-000004")),
        ("chunk-000007", ("chunk-000007", "chunk-000007")),
        ("chunk-000001...chunk-000012", ("chunk-000001", "chunk-000012")),
        ("chunk-1...chunk-000012", ("chunk-000001", "chunk-000012")),  # written back in the planner's form
    ],
)
def test_chunks_are_a_number_a_range_a_key_or_a_range_of_keys(text: str, expected: tuple[str, str]) -> None:
    assert chunk_range(text) == expected


@pytest.mark.parametrize("text", ["", "all", "-3", "1-", "chunk-x", "chunk-000001..chunk-000003", "1,2", "1...2"])
def test_anything_else_is_refused_naming_the_allowed_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"--chunks .* is not a chunk number .* START\.\.\.END of keys"):
        chunk_range(text)


def test_a_range_that_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="starts at chunk-000009, after its end chunk-000002"):
        chunk_range("9-2")


def test_bad_chunks_exit_2_before_any_request(capsys: pytest.CaptureFixture[str]) -> None:
    # a closed port: a request would fail with exit 1 and "did not answer", so exit 2 proves none was made
    argv = ["backfill", "--source", "demo", "--table", "public.orders", "--chunks", "x", "--url", "http://127.0.0.1:9"]
    assert main(argv) == 2
    assert "--chunks 'x' is not" in capsys.readouterr().err


def test_an_unreachable_webserver_launches_nothing_and_says_where(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["backfill", "--source", "demo", "--table", "public.orders", "--chunks", "1", "--url", "http://127.0.0.1:9"]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.startswith("nothing launched: the Dagster webserver at http://127.0.0.1:9 did not answer (--url)")
