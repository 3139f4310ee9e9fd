import pytest

from lightning_gpumem._core.units import GIB, check_budget, format_gib, parse_budget, to_gib


def test_conversions():
    assert to_gib(3 * GIB) == 3.0
    assert to_gib(None) is None
    assert format_gib(1.5 * GIB) == "1.5 GiB"
    assert format_gib(None) == "n/a"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (2**20, 2**20),
        ("1MiB", 2**20),
        ("24GiB", 24 * GIB),
        ("16 GB", 16 * 10**9),
        ("512mib", 512 * 2**20),
        ("1.5GiB", 3 * GIB // 2),
    ],
)
def test_parse_budget_sizes(value, expected):
    assert parse_budget(value, None, "X") == expected


def test_parse_budget_fraction_needs_the_device_size():
    assert parse_budget(0.25, 80 * GIB, "budget") == 20 * GIB
    with pytest.raises(ValueError, match="no device memory is known"):
        parse_budget(0.25, None, "X")


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, "at least 1 MiB"),
        (-5, ValueError, "at least 1 MiB"),
        (1, ValueError, r"at least 1 MiB .*for the whole device pass 1.0"),
        ("0.5B", ValueError, "Expected a size of at least 1 MiB"),
        ("1023KiB", ValueError, "Expected a size of at least 1 MiB"),
        (1.5, ValueError, r"must be in \(0, 1\]"),
        (0.0, ValueError, r"must be in \(0, 1\]"),
        ("24 parsecs", ValueError, "Expected a positive size with a unit"),
        ("GiB", ValueError, "Expected a positive size with a unit"),
        ("0GiB", ValueError, "Expected a positive size with a unit"),
        (True, TypeError, "Expected bytes"),
        ([24], TypeError, "Expected bytes"),
    ],
)
def test_parse_budget_rejects_bad_values_naming_them(value, error, match):
    with pytest.raises(error, match=match) as info:
        parse_budget(value, 80 * GIB, "Tuner")
    assert "Tuner" in str(info.value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("9" * 400 + "GiB", r"at most 2\*\*64 bytes"),  # was an OverflowError (float infinity to integer)
        ("16777217TiB", r"at most 2\*\*64 bytes"),
        (10**400, r"at most 2\*\*64 bytes"),
        (2**64 + 1, r"at most 2\*\*64 bytes"),
        (1e-300, "less than 1 MiB of any device"),
    ],
)
def test_a_budget_no_device_can_have_is_refused_by_name(value, match):
    for check in (lambda: parse_budget(value, 80 * GIB, "Tuner"), lambda: check_budget(value, "Tuner")):
        with pytest.raises(ValueError, match=match) as info:
            check()
        assert "`Tuner(budget=" in str(info.value)


def test_the_largest_budget_is_2_to_the_64_bytes():
    assert parse_budget(2**64, None, "X") == 2**64
    assert parse_budget("16777216TiB", None, "X") == 2**64


def test_a_fraction_under_1_mib_of_the_device_is_refused_when_resolved():
    check_budget(1e-10, "MemoryBudget")  # 1.8 GB of a 2**64-byte device: only the device can tell
    with pytest.raises(
        ValueError, match=r"`MemoryBudget\(budget=1e-10\)` is 8 bytes of the device's 80.0 GiB"
    ):
        parse_budget(1e-10, 80 * GIB, "MemoryBudget")
    assert parse_budget(2**-16, 64 * GIB, "X") == 2**20  # exactly 1 MiB
    with pytest.raises(ValueError, match="Expected at least 1 MiB"):
        parse_budget(2**-16, 64 * GIB - 1, "X")
