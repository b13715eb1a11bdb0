"""``-c`` repeated merges in order, and every config error names its real source: the file,
a later file, an environment variable or a ``key=value`` on the command line."""

from __future__ import annotations

from typing import Any

import yaml

from rolloutbus.config import Config, load_config, with_overrides
from tests.helpers import run_cli
from tests.source_tree import ROOT


def test_a_second_config_file_merges_over_the_first_key_by_key(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "kafka: {topic_prefix: mine, partitions: 2}\nrollout: {n: 2, temperature: 0.7}\n"
    )
    metrics = tmp_path / "metrics-on.yaml"
    # a later file in verl's names still lands where the first file keeps the setting
    metrics.write_text("sessions: {metrics_port: 9101}\nactor_rollout_ref: {rollout: {n: 3}}\n")
    result = run_cli("config", "-c", str(mine), "-c", str(metrics))
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["kafka"]["topic_prefix"] == "mine"  # the first file is kept
    assert printed["kafka"]["partitions"] == 2
    assert printed["rollout"]["temperature"] == 0.7
    assert printed["sessions"]["metrics_port"] == 9101  # the second file is applied
    assert printed["rollout"]["n"] == 3  # the later file wins
    swapped = yaml.safe_load(run_cli("config", "-c", str(metrics), "-c", str(mine)).stdout)
    assert swapped["rollout"]["n"] == 2
    assert swapped["sessions"]["metrics_port"] == 9101


def test_override_errors_name_the_override_not_the_file(tmp_path):
    path = tmp_path / "ux4.yaml"
    path.write_text("rollout: {n: 2}\n")
    typo = run_cli("config", "-c", str(path), "rollout.temprature=0.5")
    assert typo.returncode == 2
    assert "unknown config key 'rollout.temprature' (from override 'rollout.temprature=0.5')" in (
        typo.stderr
    )
    assert "ux4.yaml" not in typo.stderr
    bad_value = run_cli("config", "-c", str(path), "rollout.n=abc")
    assert bad_value.returncode == 2
    assert "config key 'rollout.n' (from override 'rollout.n=abc')" in bad_value.stderr
    assert "ux4.yaml" not in bad_value.stderr


def test_environment_variable_errors_name_the_variable(tmp_path):
    path = tmp_path / "ux4.yaml"
    path.write_text("rollout: {n: 2}\n")
    result = run_cli("config", "-c", str(path), env={"ROLLOUTBUS__ROLLOUT__NN": "3"})
    assert result.returncode == 2
    assert (
        "unknown config key 'rollout.nn' (from environment variable ROLLOUTBUS__ROLLOUT__NN)"
        in result.stderr
    )
    assert "ux4.yaml" not in result.stderr


def test_file_errors_name_the_file_that_set_the_key(tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("rollout: {n: 2}\n")
    second.write_text("rollout: {n: many}\n")
    result = run_cli("config", "-c", str(first), "-c", str(second))
    assert result.returncode == 2
    assert f"config key 'rollout.n' in {second}" in result.stderr
    # a key the first file set is still blamed on it
    first.write_text("rollout: {n: 2, respone_length: 3}\n")
    result = run_cli("config", "-c", str(first), "-c", str(second.with_name("none.yaml")))
    assert result.returncode == 2 and "config file not found" in result.stderr
    result = run_cli("config", "-c", str(first), "-c", str(tmp_path / "first.yaml"))
    assert f"unknown config key 'rollout.respone_length' in {first}" in result.stderr


def test_unset_addresses_follow_the_embedded_services_ports(tmp_path):
    """A second stack on one machine moves each port once (docs/configuration.md)."""
    second = tmp_path / "second.yaml"
    second.write_text(
        "broker: {port: 19092, controller_port: 19093}\nreplica_server: {port: 18000}\n"
    )
    printed = yaml.safe_load(run_cli("config", "-c", str(second)).stdout)
    assert printed["kafka"]["bootstrap_servers"] == "127.0.0.1:19092"
    assert printed["replicas"]["urls"] == ["http://127.0.0.1:18000"]
    pinned = run_cli(
        "config",
        "-c",
        str(second),
        "kafka.bootstrap_servers=kafka.internal:9092",
        "replicas.urls=[http://gpu-1:8000]",
        "broker.nodes=3",
    )
    assert pinned.returncode == 0, pinned.stderr
    assert yaml.safe_load(pinned.stdout)["kafka"]["bootstrap_servers"] == "kafka.internal:9092"
    assert yaml.safe_load(pinned.stdout)["replicas"]["urls"] == ["http://gpu-1:8000"]
    wildcard = run_cli("config", "broker.nodes=3", "replica_server.host=0.0.0.0")
    cluster = yaml.safe_load(wildcard.stdout)
    assert cluster["kafka"]["bootstrap_servers"] == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert cluster["replicas"]["urls"] == ["http://127.0.0.1:8000"]  # a wildcard: this machine


def test_a_derived_address_is_derived_again_in_a_copy_with_another_port():
    cfg = load_config(overrides=["broker.port=19092"])
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:19092"
    moved = with_overrides(cfg, {"broker.port": 29092, "replica_server.port": 28000})
    assert moved.kafka.bootstrap_servers == "127.0.0.1:29092"
    assert moved.replicas.urls == ["http://127.0.0.1:28000"]
    assert load_config().kafka.bootstrap_servers == "127.0.0.1:9092"  # nothing set: the default


def _ports_and_folders(cfg: Config) -> dict[str, Any]:
    """Every port and folder a stack binds or writes, by key (the model cache is shared)."""
    found: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, dotted + ".")
            elif (
                value is not None
                and key != "cache_dir"
                and (key.endswith("port") or key.endswith("dir"))
            ):
                found[dotted] = value

    walk(cfg.model_dump(mode="json"), "")
    return found


def test_the_documented_second_stack_shares_no_port_or_folder_with_the_default(tmp_path):
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = page.split("## A second stack on one machine", 1)[1]
    second = tmp_path / "second.yaml"
    second.write_text(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    metrics_on = ROOT / "ops" / "metrics-on.yaml"
    mine = _ports_and_folders(load_config([metrics_on]))
    theirs = _ports_and_folders(load_config([metrics_on, second]))
    assert set(mine) == set(theirs)
    assert [key for key in mine if mine[key] == theirs[key]] == [], "shared with the default"
    cfg = load_config([metrics_on, second])
    assert cfg.kafka.bootstrap_servers == f"127.0.0.1:{cfg.broker.port}"
    assert cfg.replicas.urls == [f"http://127.0.0.1:{cfg.replica_server.port}"]
