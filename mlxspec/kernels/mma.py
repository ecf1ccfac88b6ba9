"""CUDA helpers for the kernels that compute on tensor cores (:mod:`.qmm_tc`, :mod:`.attention_mma`).

``mma16816<T>(c, a, b0, b1)``: one warp-wide ``mma.sync.m16n8k16`` of T (``__nv_bfloat16`` or
``__half``) into float32 accumulators c[4]. Fragments, lane = 4 * g + t: A (16 x 16, rows x k)
a[0] = (row g, k 2t..2t+1), a[1] = (row g + 8, same k), a[2] = (row g, k 2t+8..), a[3] = (row
g + 8, k 2t+8..); B (16 x 8, k x columns) b0 = (k 2t..2t+1, column g), b1 = (k 2t+8.., column
g); C (16 x 8) c[0..1] = (row g, columns 2t..2t+1), c[2..3] = (row g + 8, same columns). Each
register holds two halves, the lower index in the low 16 bits.
"""

MMA16816 = """
template <typename T> __device__ inline void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <> __device__ inline void mma16816<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ inline void mma16816<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""
