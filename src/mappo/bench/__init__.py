"""Throughput benchmarks (not tests): environment steps per second and friends."""
