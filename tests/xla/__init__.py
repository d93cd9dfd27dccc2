"""Tests under XLA: the record a compiled step writes, the host acting on it
(`with_xla_checks`, the callbacks), and every way of running an XLA step."""
