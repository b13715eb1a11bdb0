"""Tests of the assembly area."""
