"""Local worker processes: one per task of a loopback cluster, supervised as ``torchrun`` does.

:func:`launch` runs a command once per worker, in a private network namespace
where Linux allows one; :func:`run_local_workers` starts the processes, each
with its own ``TF_CONFIG``, streams the chief's output and fails as soon as one
worker fails. Inside the namespace the workers are started by this module's
entry point, ``python -m keras_cnnpar.cluster.local_workers --workers N -- COMMAND``.
"""

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import click

from keras_cnnpar.cluster import network
from keras_cnnpar.cluster.spec import Task, local_spec
from keras_cnnpar.runtime.subprocesses import dying_with_parent, python_command

#: Exit code of a worker that saved a preemption checkpoint and stopped (TensorFlow's default).
PREEMPTED_EXIT_CODE = 42




class WorkerFailed(RuntimeError):
    """A local worker process exited with a non-zero code; carries the code and its output's tail."""

    def __init__(self, index, returncode, output):
        self.index, self.returncode, self.output = index, returncode, output
        if returncode == PREEMPTED_EXIT_CODE:
            what = "was preempted: it saved a checkpoint and stopped; rerun with --resume to continue"
        elif returncode < 0:
            what = f"was killed by {signal.Signals(-returncode).name}"
        else:
            what = f"exited with code {returncode}"
        super().__init__(f"worker {index} {what}" + (f"; its last output:\n{output}" if output else ""))


#: The launcher's first line, for each network its workers get.
NETWORK_LINES = {
    "private": "cnnpar launch: {workers} worker(s) in a private network namespace: loopback only, no other network "
               "(nothing outside can reach their servers, and a script cannot reach the internet or a remote "
               "service; --network host gives them this machine's network)",
    "host": "cnnpar launch: {workers} worker(s) on this machine's network (--network host)",
}


def launch(command, workers, env=None, network_kind="private"):
    """Run ``command`` (an argv list) once per worker on this machine, as ``torchrun`` does; return the exit code.

    With ``network_kind="private"`` (the default), where Linux lets an ordinary
    user make namespaces (``unshare --user --net``), the workers run in a
    private network namespace of their own: its loopback is theirs alone, so
    the TensorFlow servers they start, which listen on every interface, cannot
    be reached from any other host or process; nor can the workers reach
    anything outside. ``"host"`` (or no namespaces) gives them this
    machine's network, and one line warns that the servers are reachable and
    how to block them. The first line printed says which it is. A failure
    prints ``Error: worker I ...`` and returns that worker's exit code (1 for
    a signal); SIGTERM and SIGINT are passed on (see :func:`run_local_workers`),
    and a second SIGINT kills every worker. ``env`` adds variables to the
    workers' environment.
    """
    if network_kind == "private" and not network.private_network_available():
        print("cnnpar launch: no private network namespace for this user here "
              "(`unshare --user --net` is refused), so the workers use this machine's network",
              file=sys.stderr, flush=True)
        network_kind = "host"
    else:
        print(NETWORK_LINES[network_kind].format(workers=workers), file=sys.stderr, flush=True)
    if network_kind == "host":
        print(network.exposure_warning("local workers"), file=sys.stderr, flush=True)
        return _run_and_report(command, workers, env=env)
    inner = python_command("-m", "keras_cnnpar.cluster.local_workers", "--workers", str(workers), "--", *command)
    process = subprocess.Popen(["unshare", "--user", "--map-root-user", "--net", "--", *inner],
                               env={**os.environ, **(env or {})})
    forward = _forward_signals([process])
    try:
        code = process.wait()
    finally:
        forward.restore()
        if process.poll() is None:
            process.kill()
            process.wait()
    return code if code >= 0 else 1


def _run_and_report(command, workers, parent=None, env=None):
    try:
        run_local_workers(command, workers, parent=parent, env=env)
    except WorkerFailed as failure:
        print(f"Error: {failure}", file=sys.stderr, flush=True)
        return failure.returncode if failure.returncode > 0 else 1
    return 0


def run_local_workers(command, workers, *, poll_seconds=0.2, preemption_grace_seconds=120, parent=None, env=None):
    """Run ``command`` (an argv list) once per worker on loopback; raise ``WorkerFailed`` on failure.

    Each process gets its own ``TF_CONFIG`` and its share of the cores for
    TensorFlow's thread pools (environment variables already set win), and
    dies with this process. The chief's output goes to this process's stdout
    and stderr as it comes; the other workers' goes to unnamed temporary files
    (nothing is left on disk, even when this process is killed outright), and
    a failing worker's last lines are in the error. When one worker fails the
    others are killed, except after a preemption: then they get
    ``preemption_grace_seconds`` to finish their checkpoint. A SIGTERM or
    SIGINT sent here is passed on to the workers as SIGTERM, so they save a
    preemption checkpoint and stop; a second SIGINT kills them. With
    ``parent``, the workers are killed as soon as that process is gone.
    """
    spec = local_spec(workers)
    with contextlib.ExitStack() as stack:
        logs = [None] + [stack.enter_context(tempfile.TemporaryFile()) for _ in range(1, workers)]
        processes = []
        forward = _forward_signals(processes)
        try:
            for index in range(workers):
                processes.append(_start_worker(command, Task(spec, "worker", index), logs[index], env))
            failed = _wait_for_failure(processes, poll_seconds, parent)
            if failed is not None and processes[failed].returncode == PREEMPTED_EXIT_CODE:
                _wait_all(processes, preemption_grace_seconds)
        finally:
            forward.restore()
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
        if failed is not None:
            raise WorkerFailed(failed, processes[failed].returncode, _tail(logs[failed]))


def _start_worker(command, task, log, extra_env=None):
    """Start one worker; its output goes to ``log`` (a binary file), or to this process's own where None."""
    env = {**_thread_share(task.num_workers), **os.environ, **(extra_env or {}),
           "TF_CONFIG": json.dumps(task.tf_config())}
    return subprocess.Popen(dying_with_parent(command), env=env, stdout=log,
                            stderr=subprocess.STDOUT if log else None, start_new_session=True)


def _thread_share(workers):
    """TensorFlow thread pools for one of ``workers`` processes sharing this machine's cores (unless set already).

    Each process would otherwise size its pools for every core, and the
    workers would compete for them (figures in docs/measurements/2026-11-29-intel.md).
    """
    return {"TF_NUM_INTRAOP_THREADS": str(max(1, (os.cpu_count() or 1) // workers)), "TF_NUM_INTEROP_THREADS": "2"}


def _wait_for_failure(processes, poll_seconds, parent=None):
    """Wait until every process ended; return the index of the first that failed, or None.

    One thread per process waits for it, so "first" is the order in which they
    ended: a worker killed outright, then its peer failing on the lost
    connection a moment later, names the killed one (a poll every
    ``poll_seconds`` that saw both gone named the lower index). When
    ``parent`` is given and is no longer this process's parent, every process
    is killed and this process exits: its launcher is gone.
    """
    ended = queue.SimpleQueue()

    def wait(index):
        processes[index].wait()
        ended.put(index)

    for index in range(len(processes)):
        threading.Thread(target=wait, args=(index,), daemon=True, name=f"wait-worker-{index}").start()
    running = len(processes)
    while running:
        if parent is not None and os.getppid() != parent:
            for process in processes:
                process.kill()
            sys.exit(1)
        try:
            index = ended.get(timeout=poll_seconds)
        except queue.Empty:
            continue
        running -= 1
        if processes[index].returncode != 0:
            return index
    return None


def _wait_all(processes, seconds):
    deadline = time.monotonic() + seconds
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


class _forward_signals:
    """Pass SIGTERM, SIGINT and SIGHUP (a closed terminal) on to ``processes`` as SIGTERM, so they save a
    preemption checkpoint and stop, until ``restore()``; a second SIGINT kills them."""

    def __init__(self, processes):
        self.processes, self.interrupted = processes, False
        self.previous = {sig: signal.signal(sig, self._forward)
                         for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def _forward(self, signum, frame):
        escalate = signum == signal.SIGINT and self.interrupted
        self.interrupted = self.interrupted or signum == signal.SIGINT
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL if escalate else signal.SIGTERM)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _tail(log, lines=20):
    """The last ``lines`` lines written to the binary file ``log`` ("" for None: the chief's went to stdout)."""
    if log is None:
        return ""
    log.seek(0)
    return "\n".join(log.read().decode("utf-8", errors="replace").splitlines()[-lines:])


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--workers", type=click.IntRange(min=1), required=True)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def main(workers, command):
    """Run COMMAND once per local worker, inside the private network namespace that :func:`launch` made."""
    network.loopback_up()
    sys.exit(_run_and_report(list(command), workers, parent=os.getppid()))


if __name__ == "__main__":
    main()
