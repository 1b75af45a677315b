"""Benchmark of the Flash-Overlap linears against other schedules of the same MLP (see docs/flash_overlap.md)."""
