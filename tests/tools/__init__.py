"""Tests of what surrounds the package: the demo, the README and docs site,
the supported releases, the private APIs relied on, the benchmarks."""
