"""Tests of the inference area."""
