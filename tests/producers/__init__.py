"""Tests of the producers area."""
