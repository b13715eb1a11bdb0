"""Seeing a run: the consumer-lag exporter, metrics serving for the processes without a
section of their own, ``rolloutbus top`` (a live view from the processes' /metrics),
``rolloutbus inspect`` (one trajectory, turn by turn, from the turn log) and the demo's
picture. Imported lazily by the CLI; nothing below it imports this package."""

# Nothing re-exported: each tool is imported from its module, by the CLI, on first use.
__all__: list[str] = []
