"""``-c`` repeated merges in order, and every config error names its real source: the file,
a later file, an environment variable or a ``key=value`` on the command line."""

from __future__ import annotations

import yaml

from tests.helpers import run_cli


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
