"""Tests of the gateway area."""
