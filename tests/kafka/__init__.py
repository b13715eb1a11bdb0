"""Tests of the kafka area."""
