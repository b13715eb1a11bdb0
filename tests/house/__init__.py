"""Tests of the house area."""
