"""Benchmark tools that are not part of the core package: `python -m benchmarks.gpu_proof` measures ViT-B/32 on a
CUDA GPU (largest batch per precision, speed, memory, a swarm sharing the GPU) and writes logbook/gpu.md."""
