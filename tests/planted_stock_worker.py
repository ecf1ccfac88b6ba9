"""The stock mlx-lm process with mlxspec's kernels planted in it, as a loaded model gets them in
mlxspec's own process (``kernels.install`` does nothing off CUDA, so its parts are called
directly): test_bench_stock starts it in place of ``python -m mlxspec.bench.stock_worker`` and
its evidence must say the process is not stock."""

from mlxspec.bench import stock_worker


class PlantedWorker(stock_worker.Worker):
    def build(self, *args, **kwargs) -> dict:
        super().build(*args, **kwargs)
        self.plant()
        return self.evidence()

    def load(self, *args, **kwargs) -> dict:
        super().load(*args, **kwargs)
        self.plant()
        return self.evidence()

    def plant(self) -> None:
        from mlxspec import kernels
        from mlxspec.kernels import attention, gdn, qmm

        for m in (self.model, self.draft):
            if m is not None:
                kernels.install(m)
                gdn.install()
                attention.install(m)
                qmm.install(m)


if __name__ == "__main__":
    stock_worker.main(worker=PlantedWorker)
