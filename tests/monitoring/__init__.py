"""Tests of the monitoring area."""
