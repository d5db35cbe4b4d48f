"""Measurements and the logbook, outside the core package (no role imports them): `python -m benchmarks.bench SUITE`
measures real roles on loopback into logbook/benchmarks.md, `python -m benchmarks.logbook build` renders run results
into pages, and `python -m benchmarks.gpu_proof` measures ViT-B/32 on a CUDA GPU and writes logbook/gpu.md."""
