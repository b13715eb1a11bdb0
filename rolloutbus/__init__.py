"""Rollout Bus: verl's Agent Loop as an event-sourced streaming system on Apache Kafka."""

from rolloutbus.errors import RolloutBusError

__version__ = "0.1.0"
__all__ = ["RolloutBusError", "__version__"]
