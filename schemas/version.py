"""The schema version stamped into every record (``schema_version``; the trajectory's Arrow
schema metadata ``rolloutbus.schema_version``).

It counts *breaking* changes only (``docs/schema-evolution.md``): a change that an older
reader could misread, or that leaves an old record unreadable without help (a field renamed,
removed, retyped or given new meaning). Such a change bumps it, and readers keep an
upcaster from the previous version (``schemas/evolution.py``).

Add-only changes (a new field, optional, with a default) do not bump it and carry no other
number on the wire: a reader recognises them by their field names. Every release's formats
are pinned by the samples and fingerprints in ``tests/data/formats/``. Version 1 covers every
release so far (stops 4, 11 and 12): each change since the first was add-only.
"""

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = "rolloutbus.schema_version"  # the Arrow schema metadata key
