/* Optional speed-up for scripts/build_demo_model.py on Linux.
 *
 * The mlx[cpu] wheel links a reference (netlib) BLAS, whose sgemm runs at a few
 * GFLOP/s. This shim exports MLX's cblas_sgemm/cblas_dgemm and forwards them to the
 * OpenBLAS that scipy bundles (LP64, symbols prefixed "scipy_"): ~10x faster training.
 * Results are the same up to floating-point rounding.
 *
 *   LIBS=$(python -c "import scipy, pathlib; print(pathlib.Path(scipy.__file__).parent.parent / 'scipy.libs')")
 *   gcc -O2 -shared -fPIC scripts/openblas_shim.c -o /tmp/libopenblas_shim.so \
 *       -L$LIBS -l:$(basename $LIBS/libscipy_openblas-*.so) -Wl,-rpath,$LIBS
 *   LD_PRELOAD=/tmp/libopenblas_shim.so python scripts/build_demo_model.py
 */
void scipy_cblas_sgemm(int, int, int, int, int, int, float, const float *, int,
                       const float *, int, float, float *, int);
void scipy_cblas_dgemm(int, int, int, int, int, int, double, const double *, int,
                       const double *, int, double, double *, int);

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k, double alpha,
                 const double *a, int lda, const double *b, int ldb, double beta, double *c,
                 int ldc) {
  scipy_cblas_dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
