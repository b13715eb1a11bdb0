"""Tests of the schemas area."""
