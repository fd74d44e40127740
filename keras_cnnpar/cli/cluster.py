"""``cnnpar launch`` and ``cnnpar cluster``: worker processes of a user's script, and TensorFlow server processes
on this machine or on each host."""

import os
import sys

import click

from keras_cnnpar.cli.common import Refused, check_worker_count, quiet_tensorflow
from keras_cnnpar.cluster import environments
from keras_cnnpar.cluster import spec as cluster_lib
from keras_cnnpar.runtime import startup


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes to start (under srun or in a Kubernetes Indexed Job: one per task, this option "
                   "optional).")
@click.option("--network", "network_kind", type=click.Choice(["private", "host"]), default="private",
              show_default=True, help="private: the workers see only their own loopback (nothing can reach their "
                                      "servers; they reach no remote service); host: this machine's network.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def launch(workers, network_kind, command):
    """Run any training script once per worker on this machine under MultiWorker, as torchrun does.

    \b
      cnnpar launch --workers 2 -- python train.py --epochs 3

    Each process gets its own TF_CONFIG on loopback and joins the cluster when
    it imports keras_cnnpar, so the script may build its model first and call
    model.fit(..., strategy="multi-worker") later. By default the workers run
    in a private network namespace (where the user may make one): only their
    own loopback, so nothing can reach their unauthenticated TensorFlow
    servers, and a script cannot download data or log to a remote service;
    --network host gives them this machine's network (and a warning that the
    servers listen on its interfaces). The chief's output is streamed; a
    failing worker fails the command, naming it; SIGTERM and Ctrl-C are passed
    on. The same script runs on several hosts with TF_CONFIG and
    CNNPAR_MULTI_WORKER=1 set on each. Where a scheduler started each worker
    (no TF_CONFIG; srun's Slurm job step, or a Kubernetes Indexed Job's pods
    with CNNPAR_K8S_WORKERS and CNNPAR_K8S_SERVICE set) the command runs once,
    in this process's network, and joins the cluster that the scheduler's
    variables describe (keras_cnnpar.cluster.environments):

    \b
      srun --ntasks-per-node=1 cnnpar launch -- python train.py --epochs 3
    """
    from keras_cnnpar.cluster import local_workers

    command = [sys.executable if command[0] in ("python", "python3") else command[0], *command[1:]]
    environment = environments.detect()
    if environment is not None and environment.creates_processes_externally:
        if workers is not None:
            check_worker_count(workers)
        os.execvpe(command[0], command, {**os.environ, cluster_lib.JOIN_AT_IMPORT: "1"})
    if workers is None:
        schedulers = " or ".join(kind.name for kind in environments.ENVIRONMENTS if kind.creates_processes_externally)
        raise click.UsageError(f"Missing option '--workers' (needed unless {schedulers} started this process).")
    if environment is not None:  # TF_CONFIG: a cluster of its own, which the launched workers would not be
        given = " ".join(os.environ.get("TF_CONFIG", "").split())
        raise Refused(f"TF_CONFIG is set, and cnnpar launch --workers {workers} starts a cluster of its own on this "
                      f"machine: unset TF_CONFIG to launch here, or run the script itself on each host of "
                      f"TF_CONFIG's cluster with {cluster_lib.JOIN_AT_IMPORT}=1. Received: "
                      f"TF_CONFIG={given[:80]}{'...' if len(given) > 80 else ''}")
    code = local_workers.launch(command, workers, env={cluster_lib.JOIN_AT_IMPORT: "1"}, network_kind=network_kind)
    if code:
        sys.exit(code)


@click.group("cluster")
def cluster_group():
    """TensorFlow server processes for --strategy async-ps: on this machine (start, stop) or on each host (serve);
    the links between them (probe)."""


@cluster_group.command("start")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--ps", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="JSON file to write: the cluster's addresses and the servers' process ids.")
def cluster_start(workers, ps, spec_path):
    """Start one server process per task on loopback and write their spec.

    Train on them with `cnnpar train --strategy async-ps --cluster SPEC`; end
    them with `cnnpar cluster stop --spec SPEC`.
    """
    from keras_cnnpar.cluster import network, servers

    try:
        config = servers.start_servers(workers, ps, spec_path)
    except FileExistsError as error:
        raise click.BadParameter(str(error), param_hint="--spec") from None
    except OSError as error:
        if isinstance(error, ConnectionError):
            raise click.ClickException(str(error)) from None
        raise click.BadParameter(f"cannot write the spec {spec_path}: {error.strerror}; no server was started. "
                                 f"Received: --spec {spec_path}", param_hint="--spec") from None
    except RuntimeError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"started {workers} workers and {ps} parameter servers: {config['cluster']}; spec in {spec_path}")
    ports = [address.rpartition(":")[2] for addresses in config["cluster"].values() for address in addresses]
    click.echo(network.exposure_warning("cluster", ports), err=True)


@cluster_group.command("stop")
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="The spec file `cnnpar cluster start` wrote.")
def cluster_stop(spec_path):
    """End the server processes of a spec file and remove it."""
    from keras_cnnpar.cluster import servers

    try:
        stopped = servers.stop_servers(spec_path)
    except (FileNotFoundError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--spec") from None
    click.echo(f"stopped {stopped} server processes; removed {spec_path}")


@cluster_group.command("serve")
@click.option("--cluster", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="The cluster's spec: JSON with 'worker' and 'ps' jobs (as `cluster start` writes it, a TF_CONFIG, "
                   "or a bare jobs map).")
@click.option("--job", type=click.Choice(["worker", "ps"]), required=True, help="This task's job.")
@click.option("--index", type=click.IntRange(min=0), required=True, help="This task's index in its job.")
def cluster_serve(spec_path, job, index):
    """Run one task's TensorFlow server, on a host of a multi-host cluster, until SIGTERM or Ctrl-C.

    Run it once per worker and parameter server, each on the host its address in
    the spec names, then train from any host with `cnnpar train --strategy
    async-ps --cluster SPEC`. It prints one line when the server is up. The
    server listens on every interface of its host at its port and runs any graph
    sent to it, unauthenticated: use it on trusted networks only (docs/hosts.md).
    """
    startup.quiet_start(keras=False)  # a server runs the graphs sent to it
    from keras_cnnpar.cluster import servers
    from keras_cnnpar.cluster import spec as cluster

    try:
        spec = cluster.parse_spec(spec_path)
        servers.serve(spec, job, index, announce=True)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--cluster/--job/--index") from None


@cluster_group.command("probe")
@click.option("--cluster", "spec_path", type=click.Path(dir_okay=False), required=True,
              help="The cluster's spec, as for `cluster serve` (worker and ps jobs); its servers must be running.")
@click.option("--coordinator", default=None, metavar="HOST:PORT",
              help="This process's address, which every task must reach, as for `train --coordinator` (default: "
                   "this host's address on the interface that routes to the cluster).")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=0.5, show_default=True,
              help="How long the largest transfer of each pair takes at least (tensors double until it does).")
def cluster_probe(spec_path, coordinator, seconds):
    """Measure the link from the first task of a running cluster to every other task, with TensorFlow's own
    transport: the rate and the round trip of each pair, and the slowest pair's as `cnnpar plan --hosts`
    options."""
    quiet_tensorflow()
    from keras_cnnpar.cluster import network
    from keras_cnnpar.cluster import spec as cluster
    from keras_cnnpar.plan import probe

    try:
        spec = cluster.parse_spec(spec_path)
        chief = cluster.coordinator_address(spec, coordinator)
        network.wait_reachable(spec, 30)
    except ValueError as error:
        raise Refused(str(error)) from None
    except ConnectionError as error:
        raise click.ClickException(str(error)) from None
    click.echo(network.exposure_warning("probe's coordinator", [chief.rpartition(":")[2]]), err=True)
    measured = probe.probe(spec, chief, seconds=seconds)
    for pair in measured:
        click.echo(str(pair))
    slowest = min(measured, key=lambda pair: pair.bits_per_second).link()
    click.echo(f"slowest link: --link {slowest.bits_per_second / 1e6:.0f}mbit "
               f"--latency {slowest.latency_seconds * 1e3:.2f}ms")
