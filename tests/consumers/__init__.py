"""Tests of the consumers area."""
