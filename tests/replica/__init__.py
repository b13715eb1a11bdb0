"""Tests of the replica area."""
