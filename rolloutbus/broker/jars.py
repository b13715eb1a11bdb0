"""The embedded broker's jars and Java: Apache Kafka 4.x from Maven Central through
``ops/kafka/pom.xml`` into ``.cache/kafka/libs`` (``ops/install.sh`` fetches them once; a
changed pom fetches again), and the Java 17+ a Kafka 4 broker needs."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from rolloutbus.errors import BrokerError

__all__ = ["fetch_kafka_jars", "java_major_version", "kafka_libs_dir", "parse_java_major"]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
POM_PATH = REPO_ROOT / "ops" / "kafka" / "pom.xml"
MIN_JAVA = 17  # Kafka 4.x brokers need Java 17+ (Java 11 is for clients only)
FETCH_TIMEOUT_S = 900.0  # seconds; ~25 MB of jars from Maven Central on a slow link
MAVEN_TAIL_LINES = 30  # lines of Maven's output quoted when a fetch fails


def kafka_libs_dir() -> Path:
    """Where the broker's jars live: ``<repo root>/.cache/kafka/libs`` (git-ignored)."""
    return REPO_ROOT / ".cache" / "kafka" / "libs"


def fetch_kafka_jars(quiet: bool = True) -> Path:
    """Copy Kafka's runtime jars from Maven into :func:`kafka_libs_dir`, once per pom.

    A marker file keyed on the pom's hash records a finished fetch; a changed pom fetches
    into a fresh folder and replaces the old one, so two Kafka versions never share a
    classpath. A file lock makes concurrent callers (parallel test sessions) wait.
    """
    libs = kafka_libs_dir()
    marker = libs / f".fetched-{_pom_hash()}"
    if marker.exists():
        return libs
    java_major_version()  # Maven needs Java too; say so before Maven fails obscurely
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            "`mvn` not found on PATH: the embedded broker's jars are fetched with Maven "
            "(install Maven 3.8+, e.g. `apt-get install maven`), or point "
            "kafka.bootstrap_servers at an existing Kafka cluster"
        )
    libs.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(libs.parent / "fetch.lock"):
        if marker.exists():  # another process fetched while we waited for the lock
            return libs
        _run_maven_copy(mvn, libs, quiet)
        marker.touch()
    return libs


def _pom_hash() -> str:
    if not POM_PATH.exists():
        raise BrokerError(
            f"{POM_PATH} is missing: the embedded broker needs the repository's ops/ folder"
        )
    return hashlib.sha256(POM_PATH.read_bytes()).hexdigest()[:16]


def _run_maven_copy(mvn: str, libs: Path, quiet: bool) -> None:
    staging = libs.with_name(libs.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    cmd = [
        mvn,
        *(["-q"] if quiet else []),
        "-B",
        "-f",
        str(POM_PATH),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]
    try:
        result = subprocess.run(cmd, capture_output=quiet, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(
            f"fetching Kafka jars with Maven took over {FETCH_TIMEOUT_S:.0f} s"
        ) from exc
    if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        output = "\n".join(
            ((result.stdout or "") + (result.stderr or ""))
            .rstrip()
            .splitlines()[-MAVEN_TAIL_LINES:]
        )
        raise BrokerError(
            f"fetching Kafka jars failed (exit {result.returncode}): {' '.join(cmd)}\n{output}"
        )
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def java_major_version() -> int:
    """The major version of ``java`` on PATH; BrokerError if missing or older than 17."""
    java = shutil.which("java")
    if java is None:
        raise BrokerError(
            f"`java` not found on PATH: the embedded Kafka broker needs Java {MIN_JAVA}+ "
            "(e.g. `apt-get install openjdk-17-jre-headless`), or point "
            "kafka.bootstrap_servers at an existing Kafka cluster"
        )
    result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    major = parse_java_major(result.stderr + result.stdout)
    if major is None:
        raise BrokerError(
            f"cannot read the Java version from `java -version`: {result.stderr.strip()!r}"
        )
    if major < MIN_JAVA:
        raise BrokerError(
            f"Java {major} found at {java}, but Kafka 4.x brokers need Java {MIN_JAVA}+ "
            "(e.g. `apt-get install openjdk-17-jre-headless`)"
        )
    return major


def parse_java_major(version_output: str) -> int | None:
    """17 from 'openjdk version "17.0.15"', 8 from 'java version "1.8.0_392"'."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2):  # the pre-9 "1.x" scheme
        major = int(match.group(2))
    return major
