"""The embedded Kafka broker, a room of its own: ``embedded`` (start, stop, status, a local
cluster, a node killed for tests), ``properties`` (its ``server.properties``), ``addresses`` (its
listen address and ports, checked before a start), ``jars``
(Kafka from Maven Central, the Java it needs) and ``acls`` (each role's ACLs: applied to the
embedded broker, or printed as ``kafka-acls.sh`` commands for your own cluster). Only the
entry points (``rolloutbus broker``, the demo) and the tests import it: a process that talks
to Kafka uses ``rolloutbus.kafka`` and never starts a broker."""

# Nothing re-exported: import from the modules (``rolloutbus.broker.embedded``, ...).
__all__: list[str] = []
