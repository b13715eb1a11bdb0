"""Tests of the sessions area."""
