"""Kafka infrastructure: the embedded broker, topic admin, client factories, the partition
reader and the dead-letter writer. Every confluent-kafka client in the project is made and
every ``KafkaException`` is translated here."""
