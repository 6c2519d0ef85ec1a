"""Side-by-side speed and memory of kilolayer against torchscale and x-transformers.

Each script is runnable as ``python -m benchmarks.NAME --help``; ``run_all``
regenerates docs/benchmarks.md. The peers are measured, never imported by
kilolayer itself.
"""
