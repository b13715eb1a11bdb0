"""Tests of the verl compatibility area."""
