"""Hardware profile: recorded Mac outputs (tests/data/apple_hw, copied from the shared reference)
go through the same parsing functions as the live path."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxspec import cli, hardware

DATA = Path(__file__).parent / "data" / "apple_hw"
GiB = 1 << 30


def load(name):
    return (DATA / name).read_text()


# file, parser, chip, cpu cores, tiers, memory GiB, bandwidth GB/s
CASES = [
    ("m1_system_profiler_hardware.txt", "sp", "Apple M1", 8, {"performance": 4, "efficiency": 4}, 8, 68.25),
    ("m1pro_system_profiler_hardware.txt", "sp", "Apple M1 Pro", 10, {"performance": 8, "efficiency": 2}, 16, 200),
    ("m1pro_system_profiler_hardware_mini.txt", "sp", "Apple M1 Pro", 10, {"performance": 8, "efficiency": 2}, 16, 200),
    ("m1pro_sysctl_hw_machdep.txt", "sysctl", "Apple M1 Pro", 8, {"performance": 6, "efficiency": 2}, 16, 200),
    ("m1ultra_system_profiler_hardware.txt", "sp", "Apple M1 Ultra", 20, {"performance": 16, "efficiency": 4}, None,
     800),
    ("m2_sysctl_hw_machdep.txt", "sysctl", "Apple M2", 8, {"performance": 4, "efficiency": 4}, 16, 100),
    ("m2max_system_profiler_hardware.txt", "sp", "Apple M2 Max", 12, {"performance": 8, "efficiency": 4}, 32, 400),
    ("m3_system_profiler_hardware.txt", "sp", "Apple M3", 8, {"performance": 4, "efficiency": 4}, 16, 100),
    ("m3max_sysctl_hw_machdep.txt", "sysctl", "Apple M3 Max", 14, {"performance": 10, "efficiency": 4}, 36, 300),
    ("m4_system_profiler_hardware.txt", "sp", "Apple M4", 10, {"performance": 4, "efficiency": 6}, 16, 120),
    ("m4pro_system_profiler_hardware.txt", "sp", "Apple M4 Pro", 14, {"performance": 10, "efficiency": 4}, 48, 273),
    ("m4max_sysctl_hw_machdep.txt", "sysctl", "Apple M4 Max", 16, {"performance": 12, "efficiency": 4}, 64, 546),
    ("m5_sysctl_hw_machdep.txt", "sysctl", "Apple M5", 10, {"super": 4, "efficiency": 6}, 24, 153),
    ("m5_system_profiler_hardware.txt", "sp", "Apple M5", 10, {"super": 4, "efficiency": 6}, 32, 153),
    # outputs without a chip line: cores and memory still parsed, no bandwidth guessed
    ("m2ultra_system_profiler_hardware_grep.txt", "sp", None, 24, {"performance": 16, "efficiency": 8}, 64, None),
    ("m4max_system_profiler_hardware_grep.txt", "sp", None, 16, {"performance": 12, "efficiency": 4}, 128, None),
    ("m5pro_system_profiler_hardware_grep.txt", "sp", None, 15, {"super": 5, "performance": 10}, 24, None),
    ("m4pro_sysctl_hw_machdep_partial.txt", "sysctl", None, 12, {"performance": 8, "efficiency": 4}, 24, None),
    ("m1max_sysctl_hw.txt", "sysctl", None, 10, {"performance": 8, "efficiency": 2}, 64, None),
]


@pytest.mark.parametrize("name, kind, chip, cores, tiers, mem_gib, bandwidth", CASES, ids=[c[0] for c in CASES])
def test_recorded_mac_outputs(name, kind, chip, cores, tiers, mem_gib, bandwidth):
    text = load(name)
    p = hardware.apple_profile(**({"sysctl_text": text} if kind == "sysctl" else {"system_profiler_text": text}))
    assert p.os == "macOS"
    assert p.chip == chip
    assert p.cpu_cores == cores
    assert p.cpu_core_tiers == tiers
    assert p.memory_bytes == (mem_gib * GiB if mem_gib else None)
    assert p.bandwidth_gbs == bandwidth
    assert (p.bandwidth_source is None) == (bandwidth is None)


def test_sysctl_and_system_profiler_and_device_info_merge():
    p = hardware.apple_profile(load("m3_system_profiler_hardware.txt"), load("m3_system_profiler_displays.txt"))
    # the hardware text passed as sysctl gives nothing; the chip comes from the displays block
    assert (p.chip, p.cpu_cores, p.gpu_cores) == ("Apple M3", None, 10)
    p = hardware.apple_profile("", load("m3_system_profiler_hardware.txt") + load("m3_system_profiler_displays.txt"))
    assert (p.chip, p.cpu_cores, p.gpu, p.gpu_cores, p.bandwidth_gbs) == ("Apple M3", 8, "Apple M3", 10, 100)

    p = hardware.apple_profile(device_info=load("m4max_mlx_device_info.txt"))
    assert p.chip == "Apple M4 Max" and p.working_set_bytes == 115448725504 and p.memory_bytes == 128 * GiB
    assert p.bandwidth_gbs is None  # 14- and 16-core M4 Max differ; the cores are not known here
    p = hardware.apple_profile(load("m4max_sysctl_hw_machdep.txt"), "", load("m4max_mlx_device_info.txt"))
    assert p.memory_bytes == 64 * GiB  # sysctl first
    assert p.working_set_bytes == 115448725504 and p.bandwidth_gbs == 546
    assert p.memory_budget_bytes == 115448725504

    p = hardware.apple_profile(device_info=load("m3max_mlx_device_info_mlxc.txt"))
    assert p.chip == "Apple M3 Max" and p.working_set_bytes == 103079215104
    p = hardware.apple_profile(device_info=load("m2ultra_mlx_device_info_early.txt"))
    assert p.chip is None and p.working_set_bytes == 188743680000


@pytest.mark.parametrize("garbage", [
    "", "\x00\xff garbage", "hw.memsize: lots\nhw.ncpu:\nmachdep.cpu.brand_string:",
    "Chip:\nMemory: many GB\nTotal Number of Cores: (x and y)", "{'max_recommended_working_set_size': 'x'",
    "Graphics/Displays:\n  Total Number of Cores: ten", "hw.perflevel0.physicalcpu: -\n" * 3,
    "Memory: 16 ZB\nChip: Intel Core i9",
])
def test_defensive_parsing(garbage):
    for p in (hardware.apple_profile(garbage, garbage, garbage), hardware.profile_from_linux(garbage, garbage),
              hardware.profile_from_device_info(None), hardware.profile_from_device_info({"device_name": 3})):
        assert p.memory_bytes is None and p.bandwidth_gbs is None
        json.dumps(p.to_dict())


def test_bandwidth_variants():
    assert hardware.lookup_bandwidth("Apple M3 Max", 16, None)[0] == 400
    assert hardware.lookup_bandwidth("Apple M3 Max", None, 30)[0] == 300
    assert hardware.lookup_bandwidth("Apple M3 Max")[0] is None
    assert hardware.lookup_bandwidth("Apple M5 Max", 18, 40)[0] == 614
    assert hardware.lookup_bandwidth("Apple M5 Pro", 15)[0] is None  # no citable figure
    assert hardware.lookup_bandwidth("Intel Core i9") == (None, None)


def test_linux_parsers():
    cpuinfo = ("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nphysical id\t: 0\ncore id\t: 0\n\n"
               "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nphysical id\t: 0\ncore id\t: 0\n")
    p = hardware.profile_from_linux(cpuinfo, "MemTotal:       24684092 kB\nMemFree: 1 kB\n")
    assert (p.chip, p.cpu_cores, p.memory_bytes) == ("AMD EPYC 7B13", 1, 24684092 * 1024)


def test_live_profile_here():
    p = hardware.detect()
    assert p.os and p.mlx_version and p.mlx_device in ("cpu", "gpu")
    assert p.memory_bytes and p.memory_bytes > 0 and p.cpu_cores and p.cpu_cores >= 1
    assert hardware.apply_memory_limits(10 * GiB, p) is None  # no Metal here: a no-op, never raises


SCHEMA = {"schema": int, "os": str, "os_version": (str, type(None)), "arch": (str, type(None)),
          "chip": (str, type(None)), "cpu_cores": (int, type(None)), "cpu_core_tiers": dict,
          "gpu": (str, type(None)), "gpu_cores": (int, type(None)), "memory_bytes": (int, type(None)),
          "working_set_bytes": (int, type(None)), "wired_limit_mb": (int, type(None)),
          "bandwidth_gbs": (float, int, type(None)), "bandwidth_source": (str, type(None)),
          "mlx_version": (str, type(None)), "mlx_device": (str, type(None)),
          "memory_budget_bytes": (int, type(None))}


def test_profile_json_schema():
    result = CliRunner().invoke(cli.app, ["profile", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == set(SCHEMA)
    for key, kind in SCHEMA.items():
        assert isinstance(data[key], kind), key
    text = CliRunner().invoke(cli.app, ["profile"])
    assert text.exit_code == 0 and "memory" in text.stdout and "mlx" in text.stdout


def test_memory_warning():
    p = hardware.Profile(memory_bytes=16 * GiB, working_set_bytes=12 * GiB)
    assert hardware.memory_warning(10 * GiB, p) is None
    line = hardware.memory_warning(14 * GiB, p, "big")
    assert "big" in line and "15.0 GB" in line and "working set (12.9 GB)" in line and "\n" not in line
    assert "RAM" in hardware.memory_warning(20 * GiB, hardware.Profile(memory_bytes=16 * GiB))
