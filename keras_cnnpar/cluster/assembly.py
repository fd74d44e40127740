"""A watch on a cluster's assembly: one line naming the peers that never answered, where TensorFlow says nothing.

TensorFlow waits for every peer of a cluster to register without a limit,
inside a call that holds the interpreter: no Python thread of the waiting
process runs, and it ignores SIGTERM. So the watch is a small process of its
own (:func:`watched`): unless the waiting process tells it that it is done
within the timeout, it prints which peers accept no connection at their
address, and ``faulthandler``'s timer, which needs no Python thread, then
exits the waiting process with code 1 (its stack goes nowhere).

>>> peers_line("worker 0", {"worker": ["localhost:2222", "localhost:2223"]}, ["worker:1"], 5.0)  # doctest: +ELLIPSIS
'Error: worker 0: the cluster did not assemble within timeout=5.0 s: worker 1 (localhost:2223) never answered; ...'
"""

import contextlib
import faulthandler
import json
import os
import select
import subprocess
import sys
import time

from keras_cnnpar.cluster import network
from keras_cnnpar.cluster.spec import JOIN_AT_IMPORT
from keras_cnnpar.runtime.subprocesses import python_command

#: Seconds the waiting process lives past the timeout, for its watch to print the line.
NAMING_SECONDS = 2


@contextlib.contextmanager
def watched(who, cluster, timeout):
    """Run the body, a wait for ``cluster`` (job name -> addresses) to assemble, under a watch: past ``timeout``
    seconds, one line on standard error names the peers that never answered, and this process exits with code 1.
    ``who``: this task, as the line names it (``"worker 0"``)."""
    deadline = time.monotonic() + timeout  # one clock for both processes: the watch may take seconds to start
    env = {name: value for name, value in os.environ.items() if name != JOIN_AT_IMPORT}  # the watch joins nothing
    command = python_command("-m", __name__, who, json.dumps(cluster), str(timeout), repr(deadline))
    watch = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
    with open(os.devnull, "w") as nowhere:
        faulthandler.dump_traceback_later(timeout + NAMING_SECONDS, exit=True, file=nowhere)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            with contextlib.suppress(BrokenPipeError):  # the watch ended already: its line is out
                watch.stdin.write(b"done")  # assembled, or failed otherwise: the watch ends quietly
                watch.stdin.close()
            watch.wait()


def peers_line(who, cluster, silent, timeout):
    """The line that says the cluster did not assemble, naming the ``silent`` peers (``job:index`` names)."""
    head = f"Error: {who}: the cluster did not assemble within timeout={timeout} s: "
    if not silent:
        return head + ("every peer accepts connections at its address, yet they did not join this cluster: check "
                       "that every task was given the same cluster and its own task index")
    named = ", ".join(f"{job} {index} ({cluster[job][int(index)]})" for job, index in
                      (name.split(":") for name in silent))
    return head + (f"{named} never answered; start every task of the cluster, or check the names and ports its "
                   f"environment gives (TF_CONFIG, Slurm, Kubernetes)")


def main(who, cluster_json, timeout, deadline):
    """The watch: probe the peers each second until the waiting process writes to standard input (it is done);
    where it has not by ``deadline`` (``time.monotonic``'s), print the line naming those silent in the last
    probe, at once (an address that does not resolve can take seconds)."""
    cluster, deadline = json.loads(cluster_json), float(deadline)
    while True:
        silent = [name for name in network.unreachable(cluster) if name != who.replace(" ", ":")]
        if select.select([sys.stdin], [], [], max(0.0, min(deadline - time.monotonic(), 1.0)))[0]:
            if sys.stdin.buffer.read(1) or time.monotonic() < deadline:
                return  # done waiting, or the process ended before its time: not for want of peers
            break  # its timer ended it
        if time.monotonic() >= deadline:
            break
    print(peers_line(who, cluster, silent, float(timeout)), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
