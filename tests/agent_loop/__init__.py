"""Tests of the agent loop area."""
