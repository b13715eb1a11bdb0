"""Kafka infrastructure: the embedded broker, topic admin, client factories, the partition
reader and the dead-letter writer. Every confluent-kafka client in the project is made and
every ``KafkaException`` is translated here."""

# Nothing re-exported: import from the modules (``rolloutbus.kafka.clients``, ...), so a pure
# one (``version_ledger``) loads no Kafka client.
__all__: list[str] = []
