"""Benchmarks of sokratos-worker against procrastinate and pgqueuer (see bench/README.md)."""
