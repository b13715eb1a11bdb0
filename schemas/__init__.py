"""What flows: verl's agent-loop models, the events on each topic, the Arrow schema."""

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.schemas.dlq import DeadLetter
from rolloutbus.schemas.prompts import (
    DatasetRow,
    GroupSamplingParams,
    Message,
    PromptGroup,
    SamplingParams,
)
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_SCHEMA,
    Trajectory,
    TrajectoryStatus,
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectories,
    encode_trajectory,
    trajectories_to_batch,
)
from rolloutbus.schemas.turns import (
    Generation,
    GenerationChunk,
    GroupSettings,
    GroupStarted,
    Observation,
    OutputSummary,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
    TurnEvent,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.schemas.version import SCHEMA_VERSION

__all__ = [
    "SCHEMA_VERSION",
    "TRAJECTORY_SCHEMA",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "DatasetRow",
    "DeadLetter",
    "Generation",
    "GenerationChunk",
    "GroupSamplingParams",
    "GroupSettings",
    "GroupStarted",
    "Message",
    "Observation",
    "OutputSummary",
    "PolicyVersionPublished",
    "PromptGroup",
    "SamplingParams",
    "SegmentStarted",
    "SessionFailed",
    "SessionFinished",
    "SessionStarted",
    "TokenOutput",
    "Trajectory",
    "TrajectoryStatus",
    "TurnEvent",
    "batch_to_trajectories",
    "decode_trajectory_batch",
    "decode_turn_event",
    "encode_trajectories",
    "encode_trajectory",
    "encode_turn_event",
    "trajectories_to_batch",
]
