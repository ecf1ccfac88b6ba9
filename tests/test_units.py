"""The one byte-size format of messages (mlxspec/units.py)."""

from mlxspec.units import human_bytes


def test_human_bytes_decimal_units():
    assert human_bytes(None) == "?"
    assert [human_bytes(n) for n in (0, 999, 1000, 2_500_000, 15e9, 12_884_901_888, 1.5e12)] == [
        "0 B", "999 B", "1.0 KB", "2.5 MB", "15.0 GB", "12.9 GB", "1.5 TB"]
    assert human_bytes(-3_000_000) == "-3.0 MB"
