"""Tooling around the compiler: benchmarks, the demo, the model zoo, step profiling,
progress lines; the compiler never imports it."""
