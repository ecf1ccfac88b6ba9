"""Decode GGUF block formats to float32 with numpy: the types Ollama and LM Studio files use.

Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and the K-quants Q4_K / Q5_K / Q6_K (Q4_K_M and Q5_K_M mixes),
following ggml's block layouts (the same arithmetic as the ``gguf`` package's reference
decoders, which tests/test_gguf.py checks them against). ``mx.load`` is not used for these: it
decodes Q4_K wrongly and cannot read Q5_*. Other types (Q2_K, Q3_K, IQ*) fall back to the
``gguf`` package when it is installed.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
_NIBBLES = np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))


def _f16(x: np.ndarray) -> np.ndarray:
    return x.view(np.float16).astype(np.float32)


def _low_high(qs: np.ndarray, n: int, width: int) -> np.ndarray:
    """Low nibbles then high nibbles of each WIDTH-byte run: ggml's 4-bit element order."""
    return ((qs.reshape((n, -1, 1, width)) >> _NIBBLES) & np.uint8(0x0F)).reshape((n, -1))


def _fifth_bits(qh: np.ndarray, n: int) -> np.ndarray:
    bits = qh.copy().view(np.uint32).reshape((n, 1)) >> np.arange(32, dtype=np.uint32).reshape((1, 32))
    return (bits & np.uint32(1)).astype(np.uint8)


def _q4_0(b, n):
    d, qs = _f16(b[:, :2]), _low_high(b[:, 2:], n, 16)
    return d * (qs.astype(np.float32) - 8)


def _q4_1(b, n):
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), _low_high(b[:, 4:], n, 16)
    return d * qs.astype(np.float32) + m


def _q5_0(b, n):
    d = _f16(b[:, :2])
    q = _low_high(b[:, 6:], n, 16) | (_fifth_bits(b[:, 2:6], n) << np.uint8(4))
    return d * (q.astype(np.float32) - 16)


def _q5_1(b, n):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _low_high(b[:, 8:], n, 16) | (_fifth_bits(b[:, 4:8], n) << np.uint8(4))
    return d * q.astype(np.float32) + m


def _q8_0(b, n):
    return _f16(b[:, :2]) * b[:, 2:].copy().view(np.int8).astype(np.float32)


def _k_scales(scales: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K)."""
    s = scales.reshape((n, 3, 4))
    d, m, m_d = s[:, 0:1], s[:, 1:2], s[:, 2:3]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape((n, 8)).astype(np.float32), mn.reshape((n, 8)).astype(np.float32)


def _q4_k(b, n):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16], n)
    q = _low_high(b[:, 16:], n, 32).reshape((n, 8, 32)).astype(np.float32)
    return ((d * sc).reshape((n, 8, 1)) * q - (dmin * mn).reshape((n, 8, 1))).reshape((n, QK_K))


def _q5_k(b, n):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16], n)
    qh = b[:, 16:48].reshape((n, 1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))
    qh = (qh & np.uint8(1)).reshape((n, 8, 32))
    q = (_low_high(b[:, 48:], n, 32).reshape((n, 8, 32)) | (qh << np.uint8(4))).astype(np.float32)
    return ((d * sc).reshape((n, 8, 1)) * q - (dmin * mn).reshape((n, 8, 1))).reshape((n, QK_K))


def _q6_k(b, n):
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    d = (d * scales.copy().view(np.int8).astype(np.float32)).reshape((n, 16, 1))
    low = ((ql.reshape((n, -1, 1, 64)) >> _NIBBLES) & np.uint8(0x0F)).reshape((n, -1, 32))
    high = qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    high = (high & np.uint8(0x03)).reshape((n, -1, 32))
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (d * q.reshape((n, 16, -1)).astype(np.float32)).reshape((n, QK_K))


# type name -> (decoder, elements per block, bytes per block)
DECODERS = {
    "Q4_0": (_q4_0, 32, 18), "Q4_1": (_q4_1, 32, 20), "Q5_0": (_q5_0, 32, 22), "Q5_1": (_q5_1, 32, 24),
    "Q8_0": (_q8_0, 32, 34), "Q4_K": (_q4_k, QK_K, 144), "Q5_K": (_q5_k, QK_K, 176), "Q6_K": (_q6_k, QK_K, 210),
}


def decode(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """RAW (the tensor's bytes) as float32 of SHAPE; None when TYPE_NAME has no decoder here."""
    if type_name not in DECODERS:
        return None
    fn, block, size = DECODERS[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape((-1, size))
    return fn(blocks, blocks.shape[0]).astype(np.float32, copy=False).reshape(shape)
