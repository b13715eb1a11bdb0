"""One root error type with small subclasses.

Errors from confluent-kafka, aiokafka, HTTP and torch are translated into these at one
boundary each (``raise ... from exc``), keeping the topic, partition, offset or replica
in the message so that a log line alone says where things went wrong.
"""


class RolloutBusError(Exception):
    """Root of every error Rollout Bus raises on purpose."""


class ConfigError(RolloutBusError):
    """The configuration is invalid: an unknown key, a bad value, a missing file."""


class BrokerError(RolloutBusError):
    """The Kafka broker cannot be reached, started or administered."""


class TrainerFencedError(BrokerError):
    """A newer trainer started on the same topics: this one may no longer publish versions."""


class SchemaError(RolloutBusError):
    """An event or a dataset row does not match its schema."""


class ReplicaError(RolloutBusError):
    """An inference replica failed, timed out or answered with something unparseable."""


class NoReplicaAvailableError(ReplicaError):
    """Every replica is unhealthy or removed."""


class AgentLoopError(RolloutBusError):
    """An agent loop could not be found, built or run."""


class UnknownAgentLoopError(AgentLoopError):
    """The row names an agent loop that is not registered (or names none: null)."""


class TokenDriftError(AgentLoopError):
    """A generate() prompt does not extend the logged token stream (history was re-rendered)."""


class PromptTooLongError(AgentLoopError, ValueError):
    """A multimodal prompt exceeds ``prompt_length`` and cannot be truncated safely."""


class SessionDivergedError(AgentLoopError):
    """A resumed session's agent loop asked for something other than what its log holds
    (a tool answered differently, or the loop is not deterministic): it restarts as a new
    attempt instead of mixing the two runs."""
