"""Tests of saved optimizer state: `.keras` files, checkpoints, the files of
earlier releases (`tests/fixtures/`), restoring across wrapping."""
