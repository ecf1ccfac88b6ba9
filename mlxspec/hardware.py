"""What machine is this? Chip, cores, memory, working set and memory bandwidth.

The parsing functions take text (the output of ``sysctl``, ``system_profiler``, /proc files,
a printed ``mx.device_info()``) so that tests can feed recorded outputs of real Macs through
exactly the code the live path uses. Every parser is defensive: a missing key or an odd format
gives None for that field, never an exception.
"""

from __future__ import annotations

import ast
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from .units import human_bytes

SCHEMA_VERSION = 1

# -- memory bandwidth per Apple chip ------------------------------------------------------------
# (chip, CPU cores or None, GPU cores or None, GB/s or None when no citable figure, source)
# Figures and sources: tests/data/apple_hw/apple_chips.md (each row cites its source); Apple's
# marketing numbers in decimal GB/s. A chip whose variants differ is resolved by its core counts;
# when the counts do not tell the variants apart, the bandwidth is None rather than a guess.
_MACRUMORS_M3 = "https://www.macrumors.com/2023/10/31/apple-m3-pro-less-memory-bandwidth/"
_LOWYAT_M5 = "https://www.lowyat.net/2026/385170/apple-m5-pro-m5-max"
BANDWIDTH_TABLE: list[tuple[str, int | None, int | None, float | None, str]] = [
    ("Apple M1", None, None, 68.25,
     "derived, LPDDR4X-4266 x 128-bit (Apple published none): "
     "https://www.theregister.com/2020/11/19/apple_m1_high_bandwidth_memory_performance/"),
    ("Apple M1 Pro", None, None, 200.0,
     "https://mybroadband.co.za/news/hardware/418862-apple-m1-pro-and-m1-max-new-chips-powering-the-macbook-pro.html"),
    ("Apple M1 Max", None, None, 400.0,
     "https://mybroadband.co.za/news/hardware/418862-apple-m1-pro-and-m1-max-new-chips-powering-the-macbook-pro.html"),
    ("Apple M1 Ultra", None, None, 800.0,
     "https://www.notebookcheck.net/Apple-M1-Ultra-revealed-with-UltraFusion-architecture-a-20-core-CPU-and-up-to-a-64-core-GPU.607117.0.html"),
    ("Apple M2", None, None, 100.0,
     "https://talk.dob.jp/enwiki/w/index.php?diff=prev&oldid=1160753554&title=Apple_M2"),
    ("Apple M2 Pro", None, None, 200.0,
     "https://www.bgr.in/news/apple-unveils-next-gen-chipsets-m2-pro-m2-max-macbook-neural-engine-1356820/"),
    ("Apple M2 Max", None, None, 400.0,
     "https://bgr.com/tech/apple-adds-keynote-like-video-to-introduce-new-high-end-m2-macbook-pro-and-mac-mini-models"),
    ("Apple M2 Ultra", None, None, 800.0,
     "https://www.thestar.com.my/news/world/2023/06/06/apple-introduces-m2-ultra-chip-for-better-performance"),
    ("Apple M3", None, None, 100.0,
     "https://abachy.com/news/apples-m3-series-chips-enhanced-performance-and-advanced-gpus"),
    ("Apple M3 Pro", None, None, 150.0, _MACRUMORS_M3),
    ("Apple M3 Max", 14, 30, 300.0, _MACRUMORS_M3),
    ("Apple M3 Max", 16, 40, 400.0, _MACRUMORS_M3),
    ("Apple M3 Ultra", None, None, 819.0, "https://techpowerup.com/news-tags/Mac%20Studio"),
    ("Apple M4", None, None, 120.0, "https://petapixel.com/2024/05/07/apple-debuts-m4-on-the-new-ipad-pro/"),
    ("Apple M4 Pro", None, None, 273.0,
     "https://sianzzz.com/apple-announces-m4-max-chip-debuting-on-the-macbook-pro"),
    ("Apple M4 Max", 14, 32, None, "not found for the 14-core CPU / 32-core GPU part"),
    ("Apple M4 Max", 16, 40, 546.0, "https://www.macrumors.com/2024/10/30/apple-announces-m4-max-chip/"),
    ("Apple M5", None, None, 153.0, "https://www.fonearena.com/blog/466700/apple-m5-specs-features.html"),
    ("Apple M5 Pro", 15, 16, None, "not found for the 15-core CPU / 16-core GPU part"),
    ("Apple M5 Pro", 18, 20, 307.0, _LOWYAT_M5),
    ("Apple M5 Max", None, 32, 460.0,
     "secondary source: https://github.com/0xBakeer/inference-atlas/pull/194"),
    ("Apple M5 Max", None, 40, 614.0, _LOWYAT_M5),
    ("Apple M5 Ultra", None, None, 1200.0,
     "secondary source: https://github.com/midudev/canirun.ai/pull/26"),
]


def lookup_bandwidth(chip: str | None, cpu_cores: int | None = None,
                     gpu_cores: int | None = None) -> tuple[float | None, str | None]:
    """(GB/s, source) for an Apple chip name such as 'Apple M4 Pro'; (None, None) if unknown."""
    if not chip:
        return None, None
    name = " ".join(chip.split()).lower()
    rows = [r for r in BANDWIDTH_TABLE if r[0].lower() == name]
    if not rows:
        return None, None
    if cpu_cores is not None and any(r[1] is not None for r in rows):
        rows = [r for r in rows if r[1] in (None, cpu_cores)] or rows
    if gpu_cores is not None and any(r[2] is not None for r in rows):
        rows = [r for r in rows if r[2] in (None, gpu_cores)] or rows
    if len({r[3] for r in rows}) == 1:
        return rows[0][3], rows[0][4]
    return None, None  # variants differ and the core counts do not say which one this is


# -- the profile -------------------------------------------------------------------------------


@dataclass
class Profile:
    os: str | None = None  # "macOS", "Linux", ...
    os_version: str | None = None
    arch: str | None = None
    chip: str | None = None  # "Apple M4 Pro", or the CPU model name on Linux
    cpu_cores: int | None = None
    cpu_core_tiers: dict[str, int] = field(default_factory=dict)  # {"performance": 10, "efficiency": 4}
    gpu: str | None = None  # GPU name when one is seen (Apple GPU, or a CUDA device MLX uses)
    gpu_cores: int | None = None
    memory_bytes: int | None = None  # unified memory (Mac) or RAM (Linux)
    working_set_bytes: int | None = None  # MLX's max_recommended_working_set_size
    wired_limit_mb: int | None = None  # iogpu.wired_limit_mb when it was read (0 = macOS default)
    bandwidth_gbs: float | None = None
    bandwidth_source: str | None = None
    mlx_version: str | None = None
    mlx_device: str | None = None  # "gpu" / "cpu"

    @property
    def memory_budget_bytes(self) -> int | None:
        """What a model may use: the working set when MLX reports one, else total memory."""
        return self.working_set_bytes or self.memory_bytes

    @property
    def memory_budget_name(self) -> str:
        return "working set" if self.working_set_bytes else "RAM"

    def to_dict(self) -> dict:
        out = {"schema": SCHEMA_VERSION}
        out.update(asdict(self))
        out["memory_budget_bytes"] = self.memory_budget_bytes
        return out


def _int(value) -> int | None:
    try:
        return int(str(value).strip().split()[0])
    except (ValueError, IndexError, TypeError):
        return None


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40,
          "TIB": 1 << 40}


def _size(text: str | None) -> int | None:
    """'16 GB' -> bytes (Apple's 'GB' in system_profiler is GiB); None when unreadable."""
    if not text:
        return None
    m = re.match(r"^\s*([\d.]+)\s*([A-Za-z]*)", text)
    if not m or m.group(2).upper() not in _UNITS:
        return None
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    except ValueError:
        return None


def _chip_name(text: str | None) -> str | None:
    if not text:
        return None
    name = " ".join(text.split())
    return name or None


# -- sysctl --------------------------------------------------------------------------------------


def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl` output ('key: value' or 'key = value' lines) -> {key: value}; other lines skipped."""
    values: dict[str, str] = {}
    for line in (text or "").splitlines():
        m = re.match(r"^\s*([A-Za-z_][\w.]*)\s*(?::|=)\s?(.*)$", line)
        if m and "." in m.group(1):
            values[m.group(1)] = m.group(2).strip()
    return values


def profile_from_sysctl(text: str) -> Profile:
    """Chip, CPU cores and tiers, memory and wired limit from `sysctl` output."""
    v = parse_sysctl(text)
    p = Profile()
    brand = _chip_name(v.get("machdep.cpu.brand_string"))
    p.chip = brand if brand and brand.startswith("Apple M") else None
    p.cpu_cores = _int(v.get("hw.physicalcpu")) or _int(v.get("hw.ncpu")) or _int(v.get("machdep.cpu.core_count"))
    p.memory_bytes = _int(v.get("hw.memsize"))
    p.wired_limit_mb = _int(v.get("iogpu.wired_limit_mb"))
    default_names = ("performance", "efficiency")
    for level in range(4):
        count = _int(v.get(f"hw.perflevel{level}.physicalcpu"))
        if count is None:
            continue
        name = (v.get(f"hw.perflevel{level}.name") or "").strip().lower()
        if not name:
            name = default_names[level] if level < len(default_names) else f"level{level}"
        p.cpu_core_tiers[name] = count
    return p


# -- system_profiler ---------------------------------------------------------------------------


def _sp_fields(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in (text or "").splitlines():
        m = re.match(r"^\s*([A-Za-z][A-Za-z0-9 /()-]*?)\s*:\s*(.*?)\s*$", line)
        if m and m.group(2):
            fields.setdefault(m.group(1).strip(), m.group(2))
    return fields


def parse_core_line(value: str | None) -> tuple[int | None, dict[str, int]]:
    """'14 (10 Performance and 4 Efficiency)' -> (14, {'performance': 10, 'efficiency': 4})."""
    if not value:
        return None, {}
    total = _int(value)
    tiers = {name.lower(): int(n) for n, name in re.findall(r"(\d+)\s+([A-Za-z]+)", value.partition("(")[2])}
    return total, tiers


def profile_from_system_profiler(text: str) -> Profile:
    """Chip, cores, memory (SPHardwareDataType) and GPU cores (SPDisplaysDataType, if present)."""
    text = text or ""
    parts = re.split(r"(?m)^\s*Graphics/Displays:\s*$", text, maxsplit=1)
    hardware = parts[0]
    displays = parts[1] if len(parts) > 1 else ""
    if not displays and re.search(r"(?m)^\s*Chipset Model:", hardware):
        hardware, displays = "", hardware  # a displays-only output
    p = Profile()
    hw = _sp_fields(hardware)
    chip = _chip_name(hw.get("Chip"))
    p.chip = chip if chip and chip.startswith("Apple") else None
    p.cpu_cores, p.cpu_core_tiers = parse_core_line(hw.get("Total Number of Cores"))
    p.memory_bytes = _size(hw.get("Memory"))
    if displays:
        d = _sp_fields(displays)
        p.gpu = _chip_name(d.get("Chipset Model"))
        p.gpu_cores = _int(d.get("Total Number of Cores"))
        if p.chip is None and p.gpu and p.gpu.startswith("Apple M"):
            p.chip = p.gpu
    return p


# -- MLX device info -----------------------------------------------------------------------------


def parse_device_info_text(text: str) -> dict:
    """A printed device_info: a Python dict literal or 'key: value' lines -> dict."""
    text = text or ""
    info: dict = {}
    m = re.search(r"\{.*\}", text, re.S)
    if m:
        body = re.sub(r"#[^\n]*", "", m.group(0))
        try:
            value = ast.literal_eval(body)
            if isinstance(value, dict):
                return {str(k): v for k, v in value.items()}
        except (ValueError, SyntaxError):
            pass
    for line in text.splitlines():
        km = re.match(r"^\s*'?([a-z_]+)'?\s*:\s*'?([^',#]*)'?,?\s*(?:#.*)?$", line)
        if km:
            raw = km.group(2).strip()
            info[km.group(1)] = int(raw) if raw.isdigit() else raw
    return info


def profile_from_device_info(info: dict | None) -> Profile:
    p = Profile()
    if not isinstance(info, dict):
        return p
    name = info.get("device_name")
    if isinstance(name, str) and name.strip():
        p.gpu = " ".join(name.split())
        if p.gpu.startswith("Apple M"):
            p.chip = p.gpu
    p.working_set_bytes = _int(info.get("max_recommended_working_set_size"))
    p.memory_bytes = _int(info.get("memory_size"))
    return p


# -- Linux ----------------------------------------------------------------------------------------


def profile_from_linux(cpuinfo: str, meminfo: str) -> Profile:
    p = Profile(os="Linux")
    physical: set[tuple[str, str]] = set()
    processors = 0
    phys_id = core_id = None
    for line in (cpuinfo or "").splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and p.chip is None and value:
            p.chip = " ".join(value.split())
        elif key == "processor":
            processors += 1
        elif key == "physical id":
            phys_id = value
        elif key == "core id":
            core_id = value
            physical.add((phys_id or "0", core_id))
    p.cpu_cores = len(physical) or processors or None
    for line in (meminfo or "").splitlines():
        if line.startswith("MemTotal:"):
            p.memory_bytes = _size(line.split(":", 1)[1].strip().replace("kB", "KB"))
    return p


# -- merging and the live path --------------------------------------------------------------------


def merge(*profiles: Profile) -> Profile:
    """First non-empty value of each field wins (pass the most reliable source first)."""
    out = Profile()
    for name in Profile.__dataclass_fields__:
        for p in profiles:
            value = getattr(p, name)
            if value not in (None, {}, ""):
                setattr(out, name, value)
                break
    return out


def apple_profile(sysctl_text: str = "", system_profiler_text: str = "",
                  device_info: dict | str | None = None) -> Profile:
    """A Mac's profile from its command outputs (any of them may be missing or garbage)."""
    if isinstance(device_info, str):
        device_info = parse_device_info_text(device_info)
    p = merge(profile_from_sysctl(sysctl_text), profile_from_system_profiler(system_profiler_text),
              profile_from_device_info(device_info))
    p.os = p.os or "macOS"
    p.bandwidth_gbs, p.bandwidth_source = lookup_bandwidth(p.chip, p.cpu_cores, p.gpu_cores)
    return p


_SYSCTL_KEYS = ("machdep.cpu.brand_string", "hw.memsize", "hw.ncpu", "hw.physicalcpu", "hw.nperflevels",
                "hw.perflevel0.physicalcpu", "hw.perflevel0.name", "hw.perflevel1.physicalcpu",
                "hw.perflevel1.name", "iogpu.wired_limit_mb")


def _run(args: list[str], timeout: float = 10.0) -> str:
    try:  # unknown sysctl keys make it exit non-zero; what it did print is still used
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return ""


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _mlx_info() -> tuple[str | None, str | None, dict | None]:
    """(mlx version, default device type, device_info dict or None); never raises."""
    try:
        import mlx.core as mx
    except Exception:
        return None, None, None
    version = getattr(mx, "__version__", None)
    device = None
    with _suppress():
        device = str(mx.default_device().type).rsplit(".", 1)[-1]
    info = None
    for getter in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        if getter is None:
            continue
        with _suppress():
            info = dict(getter())
            break
    return version, device, info


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], Exception)


def detect(fast: bool = False) -> Profile:
    """This machine's profile (macOS: sysctl + system_profiler, no root; Linux: /proc).

    ``fast`` skips system_profiler (about a second; it only adds the GPU core count).
    """
    mlx_version, device, info = _mlx_info()
    if sys.platform == "darwin":
        sp = "" if fast else _run(["system_profiler", "SPHardwareDataType", "SPDisplaysDataType"], timeout=20)
        p = apple_profile(_run(["sysctl", *_SYSCTL_KEYS]), sp, info if device == "gpu" else None)
        p.os_version = platform.mac_ver()[0] or None
    else:
        p = profile_from_linux(_read("/proc/cpuinfo"), _read("/proc/meminfo"))
        if sys.platform != "linux":
            p.os = platform.system() or None
            p.chip = p.chip or platform.processor() or None
            p.cpu_cores = p.cpu_cores or os.cpu_count()
        p.os_version = platform.release() or None
        if device == "gpu" and info:  # e.g. the CUDA backend
            gpu = profile_from_device_info(info)
            p.gpu = gpu.gpu
            p.working_set_bytes = gpu.working_set_bytes
    p.arch = platform.machine() or None
    p.mlx_version, p.mlx_device = mlx_version, device
    return p


# -- memory --------------------------------------------------------------------------------------


def memory_warning(model_bytes: int | None, profile: Profile, name: str = "the model") -> str | None:
    """One line when a model is larger than the working set (or RAM); None when it fits."""
    budget = profile.memory_budget_bytes
    if not model_bytes or not budget or model_bytes <= budget:
        return None
    return (f"warning: {name} is {human_bytes(model_bytes)}, more than this machine's "
            f"{profile.memory_budget_name} ({human_bytes(budget)}); expect swapping or a crash")


def apply_memory_limits(model_bytes: int | None, profile: Profile) -> int | None:
    """On Metal, wire enough memory for the model (capped at the working set); returns the limit set.

    MLX's own default leaves the wired limit at 0; mlx-lm's generation raises it while it runs.
    Setting it before loading keeps the weights resident from the start. A no-op (None) without
    Metal, and never raises.
    """
    try:
        import mlx.core as mx

        if not (hasattr(mx, "metal") and mx.metal.is_available() and hasattr(mx, "set_wired_limit")):
            return None
        budget = profile.working_set_bytes
        if not budget or not model_bytes:
            return None
        limit = int(min(budget, model_bytes * 1.1))
        mx.set_wired_limit(limit)
        return limit
    except Exception:
        return None
