"""Tests of the training area."""
