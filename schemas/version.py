"""Schema version stamped into every event; bump on any incompatible change."""

SCHEMA_VERSION = 1
