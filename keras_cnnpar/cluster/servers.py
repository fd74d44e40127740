"""TensorFlow server processes of a parameter-server cluster: start, check, serve and stop them.

:func:`start_servers` starts one server process per task on loopback and
records them in a spec file; :func:`stop_servers` ends exactly those;
:func:`serve` runs one task's server in this process (``cnnpar cluster
serve``). A server process runs this module's entry point, ``python -m
keras_cnnpar.cluster.servers --cluster-json JSON --job JOB --index I --token T``.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import click

from keras_cnnpar.cluster import network
from keras_cnnpar.cluster.spec import local_spec, parse_json, parse_spec, read_json_file
from keras_cnnpar.runtime import startup
from keras_cnnpar.runtime.atomic import write_atomic
from keras_cnnpar.runtime.subprocesses import python_command


def start_servers(workers, ps, spec_path, *, timeout=60, tries=3):
    """Start one TensorFlow server process per task on loopback, check them, write their spec; return it.

    The spec file is reserved first (created exclusively, so an unwritable path
    or a second ``start`` on the same path fails before any server starts),
    then every server must answer, be alive and be the process that listens on
    its port (another process may take a free port before the server binds it:
    then the servers start again on fresh ports, ``tries`` times in all). The
    spec, ``{"cluster", "pids", "token", "started"}``, replaces the
    reservation as soon as the servers are started, before they are waited
    for, so ``cnnpar cluster stop`` finds them after any failure;
    :func:`stop_servers` signals only processes whose command line carries
    its token and whose start time it recorded. Until all are ready, every
    server dies with this process (killed, or its terminal closed); once
    they are, they are told to run on their own. A server that fails to
    start is reported with its own error output.
    """
    spec_path = Path(spec_path)
    try:
        reservation = os.open(spec_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise FileExistsError(f"{spec_path} exists: stop its servers first (cnnpar cluster stop --spec {spec_path}) "
                              f"or choose another path. Received: spec={str(spec_path)!r}") from None
    os.close(reservation)
    try:
        for attempt in range(1, tries + 1):
            try:
                config = _start_checked_servers(workers, ps, timeout, spec_path)
                break
            except _PortTaken as taken:
                if attempt == tries:
                    raise ConnectionError(f"{taken}; {tries} tries on fresh ports all failed") from None
        for pid in (pid for pids in config["pids"].values() for pid in pids):
            os.kill(pid, DETACH)  # ready: the servers outlive this process from now on
        return config
    except BaseException:
        spec_path.unlink(missing_ok=True)
        raise


class _PortTaken(RuntimeError):
    """A server could not bind its port: another process took it after it was chosen."""


#: The signal with which ``start_servers`` tells its servers that they are ready and run on their own.
DETACH = signal.SIGUSR1


def _start_checked_servers(workers, ps, timeout, spec_path):
    """Start the servers, record them in ``spec_path`` at once, then wait for them; return the spec."""
    spec, token = local_spec(workers, ps), uuid.uuid4().hex
    processes, outputs = {job: [] for job in spec}, {}
    with contextlib.ExitStack() as files:
        try:
            for job, addresses in spec.items():
                for index in range(len(addresses)):
                    output = files.enter_context(tempfile.TemporaryFile())  # shown if the server fails to start
                    outputs[job, index] = output
                    processes[job].append(subprocess.Popen(
                        python_command("-m", "keras_cnnpar.cluster.servers", "--cluster-json", json.dumps(spec),
                                       "--job", job, "--index", str(index), "--token", token,
                                       "--starter", str(os.getpid())),
                        stdout=output, stderr=subprocess.STDOUT, start_new_session=True))
            pids = {job: [p.pid for p in started] for job, started in processes.items()}
            config = {"cluster": spec, "pids": pids, "token": token,
                      "started": {str(pid): _start_time(pid) for started in pids.values() for pid in started}}
            write_atomic(spec_path, json.dumps(config, indent=2) + "\n")  # recorded before they are waited for
            _wait_for_servers(spec, processes, outputs, timeout)
        except BaseException:
            for process in (p for started in processes.values() for p in started):
                process.kill()
                process.wait()
            raise
    return config


def _wait_for_servers(spec, processes, outputs, timeout):
    """Wait until every server listens on its own port; raise with a dead server's output, or ``_PortTaken``."""
    deadline = time.monotonic() + timeout
    while True:
        for job, started in processes.items():
            for index, process in enumerate(started):
                if process.poll() is not None:
                    outputs[job, index].seek(0)
                    output = outputs[job, index].read().decode(errors="replace").strip()
                    message = f"server {job}:{index} exited with code {process.returncode} at start"
                    if "address already in use" in output.lower() or "could not start" in output.lower():
                        raise _PortTaken(f"{message}: its port {spec[job][index]} was taken")
                    raise RuntimeError(f"{message}; its output:\n{output[-2000:]}")
        waiting = [(job, index) for job, started in processes.items() for index, p in enumerate(started)
                   if not network.listens_on(p.pid, int(spec[job][index].rpartition(":")[2]))]
        if not waiting:
            return
        if time.monotonic() > deadline:
            job, index = waiting[0]
            if not network.unreachable({job: [spec[job][index]]}):
                raise _PortTaken(f"another process listens on {spec[job][index]}, the port of server {job}:{index}")
            raise ConnectionError(f"server {job}:{index} did not listen on {spec[job][index]} within {timeout} s")
        time.sleep(0.2)


@contextlib.contextmanager
def serving(cluster, tasks, *, timeout=60):
    """Serve ``tasks`` (``(job, index)`` pairs) of ``cluster`` from server processes of this process for the
    length of the block: it begins once each listens on its port, and they end with it (SIGTERM), or with this
    process (each has it as its starter), whichever comes first.

    For a cluster of a moment on hosts that run this process already (``cnnpar plan``'s AsyncPS trial); servers
    that outlive their starter are :func:`start_servers`'s and ``cnnpar cluster serve``'s.
    """
    spec = {job: [cluster[job][index] for kind, index in tasks if kind == job] for job, _ in tasks}
    processes = {job: [] for job in spec}
    with contextlib.ExitStack() as files:
        outputs = {}
        try:
            for job, index in tasks:
                outputs[job, len(processes[job])] = output = files.enter_context(tempfile.TemporaryFile())
                processes[job].append(subprocess.Popen(
                    python_command("-m", "keras_cnnpar.cluster.servers", "--cluster-json", json.dumps(cluster),
                                   "--job", job, "--index", str(index), "--starter", str(os.getpid())),
                    stdout=output, stderr=subprocess.STDOUT))
            _wait_for_servers(spec, processes, outputs, timeout)
            yield
        finally:
            started = [process for each in processes.values() for process in each]
            for process in started:
                process.terminate()
            for process in started:
                try:
                    process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _start_time(pid):
    """When ``pid`` started (clock ticks since boot), or None once it is gone: with the pid, it names a process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stop_servers(spec_path, *, grace_seconds=5):
    """End the server processes that :func:`start_servers` recorded in ``spec_path``, then remove the file.

    A process is signalled only if it is still that server: its command line
    carries the spec's token and it started when the spec says. A spec that
    cannot be validated is refused and nothing is signalled. Returns how many
    servers were running.
    """
    spec_path = Path(spec_path)
    if not spec_path.exists():
        raise FileNotFoundError(f"{spec_path} does not exist. Received: spec={str(spec_path)!r}")
    if spec_path.stat().st_size == 0:  # a start that died before it started any server: only its reservation
        spec_path.unlink()
        return 0
    config = read_json_file(spec_path, "spec")
    if not isinstance(config, dict) or not isinstance(config.get("token"), str) or not isinstance(
            config.get("pids"), dict) or not isinstance(config.get("started"), dict):
        raise ValueError(f"{spec_path}: expected a spec written by `cnnpar cluster start` (cluster, pids, token, "
                         f"started); refusing to signal anything. Received: keys "
                         f"{sorted(config) if isinstance(config, dict) else type(config).__name__}")
    for job, pids in config["pids"].items():
        if not isinstance(pids, list) or not all(type(pid) is int and pid > 0 for pid in pids):
            raise ValueError(f"{spec_path}: field pids.{job}: expected a list of process ids; refusing to signal "
                             f"anything. Received: pids.{job}={pids!r}")
    pids = [pid for job in config["pids"].values() for pid in job]
    foreign = [pid for pid in pids if _running(pid) and not _is_server(pid, config)]
    if foreign:
        raise ValueError(f"{spec_path}: process {foreign[0]} is not a server this spec started (another command "
                         f"line or start time); refusing to signal anything. Received: pids={pids}")
    running = [pid for pid in pids if _is_server(pid, config)]
    for pid in running:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while any(_is_server(pid, config) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in running:
        if _is_server(pid, config):
            os.kill(pid, signal.SIGKILL)
    spec_path.unlink()
    return len(running)


def _running(pid):
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _is_server(pid, config):
    """Whether ``pid`` is a live server of the spec ``config``: its token on the command line, its start time."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (_running(pid) and b"keras_cnnpar.cluster.servers" in command and config["token"].encode() in command
            and _start_time(pid) == config["started"].get(str(pid)))


def serve(cluster, job, index, announce=False, starter=None):
    """Run the TensorFlow gRPC server of task ``job:index`` of ``cluster`` until SIGTERM or SIGINT (exit 0).

    The task's host must be an address of this machine (or a name that
    resolves to one): the spec is what the other tasks dial. TensorFlow's
    server listens on every interface at the task's port; it runs any graph
    sent to it, unauthenticated (docs/hosts.md, Security). A worker's
    server gets ``inter_op_parallelism_threads >= workers + 1``: with fewer, a
    parameter-server cluster hangs. ``announce`` prints one line once the
    server is up (``cnnpar cluster serve``). With ``starter`` (a process id),
    the server exits once that process is no longer its parent (looked at as
    soon as TensorFlow is loaded, then five times a second), until the
    starter sends it ``DETACH``.
    """
    if job not in cluster or not 0 <= index < len(cluster[job]):
        raise ValueError(f"the cluster has no task {job}:{index}. Received: jobs "
                         f"{ {name: len(tasks) for name, tasks in cluster.items()} }")
    address = cluster[job][index]
    _check_own_address(address, f"{job}:{index}")
    awaited = {signal.SIGTERM, signal.SIGINT} | ({DETACH} if starter else set())
    signal.pthread_sigmask(signal.SIG_BLOCK, awaited)  # TensorFlow's threads inherit the mask: signals wait here
    import tensorflow as tf

    _exit_if_orphaned(starter)  # the starter died while TensorFlow loaded
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=len(cluster["worker"]) + 1) \
        if job == "worker" else None
    tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index, config=config,
                         protocol="grpc")
    if announce:
        print(f"cnnpar cluster serve: task {job}:{index} ready at {address}; TensorFlow listens on every interface "
              f"of this host at port {address.rpartition(':')[2]}, unauthenticated: trusted networks only", flush=True)
    received = _wait_for_stop(awaited, starter)
    if announce:
        print(f"cnnpar cluster serve: task {job}:{index} stopped ({signal.Signals(received).name})", flush=True)
    sys.stdout.flush()
    os._exit(0)  # TensorFlow's server threads never end on their own; nothing of ours is left to clean up


def _wait_for_stop(awaited, starter):
    """Wait for SIGTERM or SIGINT and return it; until ``DETACH`` arrives, exit once ``starter`` is not the parent.

    One thread does both: a ``DETACH`` sent before the starter exited is
    pending, and taken, before the parent is looked at (a second thread that
    watched the parent could see it gone before this one took the signal).
    """
    while True:
        received = signal.sigtimedwait(awaited, 0.2)
        if received is None:
            _exit_if_orphaned(starter)
        elif received.si_signo == DETACH:
            starter = None
        else:
            return received.si_signo


def _exit_if_orphaned(starter):
    """End this process if ``starter`` (a process id, or None) is no longer its parent and sent no ``DETACH``."""
    if starter and os.getppid() != starter and DETACH not in signal.sigpending():
        os._exit(1)


def _check_own_address(address, task):
    """Refuse to serve ``task`` at an address that is not this machine's (binding there fails)."""
    host = address.rpartition(":")[0]
    with socket.socket() as probe:
        try:
            probe.bind((host, 0))
        except OSError as error:
            raise ValueError(f"task {task} has the address {address}, whose host is not an address of this "
                             f"machine ({error.strerror}); start it on the host the spec names. "
                             f"Received: {task}={address!r}") from None


@click.command()
@click.option("--cluster-json", required=True, help="The cluster's jobs map, as JSON.")
@click.option("--job", required=True)
@click.option("--index", type=int, required=True)
@click.option("--token", default="", help="The spec's token, so `cnnpar cluster stop` can tell its servers.")
@click.option("--starter", type=int, default=None, help="Die with this process until it sends SIGUSR1.")
def main(cluster_json, job, index, token, starter):  # the token only marks the command line
    """Run the TensorFlow server of task JOB:INDEX until SIGTERM or SIGINT (a server process of start_servers)."""
    startup.quiet_start(keras=False)  # a server runs the graphs sent to it: no Keras in this process
    serve(parse_spec(parse_json(cluster_json, "--cluster-json")), job, index, starter=starter)


if __name__ == "__main__":
    main()
