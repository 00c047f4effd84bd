"""fit_id: stable, collision-resistant fitting of ids into a gateway's byte limit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.modes.ids import DYNAMO_MAX_ID_BYTES, SMG_MAX_KEY_BYTES, fit_id


@pytest.mark.parametrize("limit", [SMG_MAX_KEY_BYTES, DYNAMO_MAX_ID_BYTES])
def test_ids_that_fit_are_unchanged(limit: int) -> None:
    for value in ("a", "sess-1", "x" * limit, "é" * (limit // 2)):
        assert fit_id(value, limit) == value


@pytest.mark.parametrize("limit", [SMG_MAX_KEY_BYTES, DYNAMO_MAX_ID_BYTES])
def test_long_ids_fit_with_readable_prefix_and_digest(limit: int) -> None:
    value = "conversation/" + "z" * 300
    out = fit_id(value, limit)
    assert len(out.encode()) <= limit
    prefix, sep, digest = out.rpartition("~")
    assert sep and value.startswith(prefix) and len(prefix) >= limit - 40
    assert len(digest) == 32 and digest.isalnum() and digest == digest.lower()
    assert fit_id(value, limit) == out


def test_fitting_is_collision_resistant_for_shared_prefixes() -> None:
    base = "p" * 400
    outs = {fit_id(base + str(i), 128) for i in range(1000)}
    assert len(outs) == 1000
    # One byte over the limit already maps to a different id than the cut-down one.
    assert fit_id("a" * 129, 128) != fit_id("a" * 130, 128) != "a" * 128


def test_multibyte_characters_are_never_split() -> None:
    value = "€" * 200  # 3 bytes each
    out = fit_id(value, 128)
    assert len(out.encode("utf-8")) <= 128
    prefix = out.rpartition("~")[0]
    assert prefix == "€" * len(prefix) and len(prefix) == (128 - 33) // 3


def test_undecodable_header_bytes_are_counted_as_raw_bytes() -> None:
    value = b"\xff\xfe".decode("utf-8", "surrogateescape") * 100  # how HTTP parsers hand them over
    out = fit_id(value, 128)
    assert len(out.encode("utf-8", "surrogateescape")) <= 128


def test_same_in_every_process() -> None:
    # No per-process salt: another interpreter (another sidecar replica) computes the same id.
    value = "replica-check-" + "q" * 300
    code = "import sys; from sidecar.modes.ids import fit_id; print(fit_id(sys.argv[1], 256))"
    other = subprocess.run(
        [sys.executable, "-c", code, value], check=True, capture_output=True, text=True, env={"PYTHONHASHSEED": "12345"}
    )
    assert other.stdout.strip() == fit_id(value, 256)


def test_limit_must_leave_room_for_the_digest() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        fit_id("x" * 50, 16)
