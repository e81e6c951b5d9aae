# The fused path on CUDA (test_gpu.py). Tests marked `gpu` skip without a device (CI has none); the
# device-agnostic ones run on the CPU too. benchmarks/gpu/run.sh runs this folder's file on a GPU machine.
