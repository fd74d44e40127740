"""``cnnpar plan --hosts N --link RATE``: each strategy's step across hosts, computed by hand, and the table."""

import csv
import re

import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.cluster import traffic
from keras_cnnpar.plan import scaling
from keras_cnnpar.strategies import compression
from tests.helpers import one_line_refusal, run_cli

#: The 2+2's trainable parameters at 28x28x1 and 10 classes, and their float32 bytes.
PARAMETERS_2_2 = 3_274_634
BYTES_2_2 = 4 * PARAMETERS_2_2


def test_a_link_is_read_as_tc_writes_it_and_anything_else_is_refused_saying_what_was_expected():
    assert traffic.Link.parse("10gbit", "0.1ms") == traffic.Link(1e10, 1e-4)
    assert traffic.Link.parse("100Mbit").bits_per_second == 1e8
    assert traffic.Link.parse("1.5gbit").seconds(3 * 10**8 / 8) == pytest.approx(0.2)
    for rate in ("fast", "10", "10 gbps", "-1gbit"):
        with pytest.raises(ValueError, match=rf"^link rate: expected a number and one of the units bit, kbit, mbit, "
                                             rf"gbit, tbit \(100mbit, 1gbit, 10gbit\); received '{rate}'$"):
            traffic.Link.parse(rate)
    with pytest.raises(ValueError, match=r"^link rate: expected more than 0 bits per second; received '0gbit'$"):
        traffic.Link.parse("0gbit")


def test_each_strategys_step_across_hosts_is_its_compute_share_then_its_bytes_over_the_link():
    link = traffic.Link.parse("1gbit", "0.5ms")
    synced = cnnpar.MultiWorker.host_step(4, 0.08, link, 10**7)
    assert synced.compute_seconds == pytest.approx(0.02)  # a quarter of the batch on each host
    assert synced.communication_seconds == pytest.approx(8 * 1.5 * 10**7 / 1e9 + 6 * 0.0005)  # 2(N-1)/N, 2(N-1)
    accumulated = cnnpar.MultiWorker.host_step(4, 0.08, link, 10**7, accumulate=3)
    assert (accumulated.compute_seconds, accumulated.images_factor) == (pytest.approx(0.06), 3)
    assert accumulated.images_per_second(64) == pytest.approx(3 * 64 / (0.06 + synced.communication_seconds))
    late = cnnpar.AsyncPS.host_step(4, 0.08, link, 10**7)  # 3 workers and the parameter server's host
    assert late.communication_seconds == pytest.approx(8 * 2 * 3 * 10**7 / 1e9 + 2 * 0.0005)  # all read, all write
    assert late.parallel_steps == 3
    halves = cnnpar.AsyncPS.host_step(6, 0.08, link, 10**7, ps=2)  # 4 workers; two links carry half the bytes each
    assert halves.communication_seconds == pytest.approx(8 * 2 * 4 * 10**7 / 2 / 1e9 + 2 * 0.0005)
    assert cnnpar.AsyncPS.host_step(1, 0.08, link, 10**7) is None
    assert cnnpar.Single.host_step(1, 0.08, link, 10**7).images_per_second(64) == pytest.approx(800)
    assert cnnpar.DataParallel.host_step(2, 0.08, link, 10**7) is None  # one host's devices only


def test_plan_for_hosts_prints_and_writes_the_predicted_table_and_where_hosts_stop_paying(tmp_path):
    result = run_cli("plan", "--model", "2+2", "--hosts", "64", "--link", "10gbit", "--latency", "0.1ms",
                     "--step-seconds", "0.072", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "out" / "scaling.csv").open()))
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 0
    synced = {int(r["hosts"]): r for r in rows if r["configuration"] == "multi-worker"}
    assert sorted(synced) == [1, 2, 3, 4, 8, 16, 32, 64]
    for hosts, row in synced.items():
        step = 0.072 / hosts + 8 * 2 * (hosts - 1) / hosts * BYTES_2_2 / 1e10 + 2 * (hosts - 1) * 1e-4
        assert float(row["images_per_second"]) == pytest.approx(64 / step)
        assert float(row["efficiency"]) == pytest.approx(64 / step / (hosts * 64 / 0.072))
    best = max(synced, key=lambda hosts: float(synced[hosts]["images_per_second"]))
    assert f"adding hosts stops paying at {best} hosts" in result.output
    assert f"2+2: {PARAMETERS_2_2:,} parameters, 13.1 MB of gradient a step; one host: 889 images/s" in result.output
    accumulated = [(r, int(r["configuration"].split("K=")[1])) for r in rows
                   if r["configuration"].startswith("multi-worker accumulate")]
    assert all(k <= scaling.MAX_ACCUMULATE for _, k in accumulated)  # beyond it, another training: never advised
    assert all(float(r["communication_share"]) <= scaling.COMMUNICATION_TARGET for r, k in accumulated
               if k < scaling.MAX_ACCUMULATE)


def test_plan_for_hosts_measures_one_hosts_step_here_when_none_is_given(tmp_path, small_csv):
    result = run_cli("plan", "--model", "3+3", "--hosts", "2", "--link", "1gbit", "--data", small_csv)
    assert result.exit_code == 0, result.output
    step = float(result.output.split("images/s (")[1].split(" ms a step")[0]) / 1e3  # measured here
    assert step > 0
    synced = float(next(line.split("|")[1].split()[0] for line in result.output.splitlines()
                        if line.startswith("    2 |")))
    wire = 8 * scaling.gradient_bytes(cnnpar.models.cnn("3+3")) / 1e9 + 2 * 1e-4  # the ring's bytes, 2 latencies
    assert synced == pytest.approx(64 / (step / 2 + wire), rel=0.01)  # the table is made from the measured step


def test_measured_runs_calibrate_their_configurations_predictions_with_the_transport_time_they_show(tmp_path):
    link = traffic.Link.parse("1gbit", "0.1ms")
    synced, late = (cnnpar.MultiWorker.host_step(2, 0.072, link, BYTES_2_2),
                    cnnpar.AsyncPS.host_step(3, 0.072, link, BYTES_2_2))
    added = {"multi-worker": 64 / 294 - synced.seconds, "async-ps": 2 * 64 / 199 - late.seconds}  # by hand
    result = run_cli("plan", "--model", "2+2", "--hosts", "4", "--link", "1gbit", "--step-seconds", "0.072",
                     "--measured", "multi-worker:2=294", "--measured", "async-ps:3=199", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = {(int(r["hosts"]), r["configuration"].split(" K=")[0]): r
            for r in csv.DictReader((tmp_path / "out" / "scaling.csv").open())}
    assert float(rows[2, "multi-worker"]["images_per_second"]) == pytest.approx(294)  # the measured run, predicted
    assert float(rows[3, "async-ps"]["images_per_second"]) == pytest.approx(199)
    four = cnnpar.MultiWorker.host_step(4, 0.072, link, BYTES_2_2)
    assert float(rows[4, "multi-worker"]["step_seconds"]) == pytest.approx(four.seconds + added["multi-worker"])
    assert float(rows[4, "async-ps"]["step_seconds"]) == pytest.approx(
        cnnpar.AsyncPS.host_step(4, 0.072, link, BYTES_2_2).seconds + added["async-ps"])
    assert float(rows[1, "multi-worker"]["images_per_second"]) == pytest.approx(64 / 0.072)  # one host sends nothing
    accumulated = rows[4, "multi-worker accumulate"]
    assert float(accumulated["communication_share"]) <= scaling.COMMUNICATION_TARGET or \
        accumulated["configuration"].endswith(f"K={scaling.MAX_ACCUMULATE}")
    assert (f"calibrated with the measured runs: TensorFlow's transport adds {added['multi-worker'] * 1e3:.0f} ms to "
            f"multi-worker, {added['async-ps'] * 1e3:.0f} ms to async-ps a step") in result.output


@pytest.mark.parametrize("given, said", [
    (["--link", "1gbit"], "Error: --link is for --hosts: add --hosts N to predict training on N hosts"),
    (["--measured", "multi-worker:2=294"], "Error: --measured is for --hosts: add --hosts N to predict training on "
     "N hosts"),
    (["--hosts", "4", "--link", "1gbit", "--step-seconds", "0.07", "--measured", "mirrored:2=900"],
     "Error: --measured: expected CONFIGURATION:HOSTS=IMAGES/S, as multi-worker:2=294 (configurations: multi-worker, "
     "local-steps, async-ps; 2 or more hosts; images/s above 0); received 'mirrored:2=900'"),
    (["--hosts", "4"], "Error: --hosts needs --link RATE, the hosts' link rate: 100mbit, 1gbit or 10gbit, say"),
    (["--hosts", "4", "--link", "1gbit", "--latency", "soon"], "Error: --link/--latency: link latency: expected a "
     "number and one of the units s, ms, us (0.1ms, 50us); received 'soon'"),
    (["--hosts", "4", "--link", "1gbit", "--latency", "1e999s"], "Error: --link/--latency: link latency: expected a "
     "number and one of the units s, ms, us (0.1ms, 50us); received '1e999s'"),
    (["--hosts", "4", "--link", "1gbit", "--step-seconds", "inf"], "Error: --step-seconds must be a finite number of "
     "seconds above 0. Received: --step-seconds inf"),
    (["--hosts", "4", "--link", "1gbit", "--step-seconds", "nan"], "Error: --step-seconds must be a finite number of "
     "seconds above 0. Received: --step-seconds nan"),
    (["--hosts", "4", "--link", "1gbit", "--step-seconds", "0.1", "--measured", "multi-worker:2=294", "--measured",
      "multi-worker:2=300"], "Error: --measured: multi-worker on 2 hosts given twice; give each once. Received: "
     "--measured multi-worker:2=294, --measured multi-worker:2=300"),
])
def test_plan_for_hosts_refuses_options_that_disagree_in_one_line(given, said, tmp_path):
    assert one_line_refusal(run_cli("plan", *given, "--out", tmp_path / "out")) == said
    assert not (tmp_path / "out").exists()


def test_the_powersgd_row_sends_rank_4_factors_in_two_ring_rounds_and_the_plan_says_what_it_changes(tmp_path):
    result = run_cli("plan", "--model", "2+2", "--hosts", "2", "--link", "100mbit", "--latency", "0.2ms",
                     "--step-seconds", "0.036", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = {r["configuration"]: r for r in csv.DictReader((tmp_path / "out" / "scaling.csv").open())
            if r["hosts"] == "2"}
    sent = 4 * compression.sent_floats([v.shape for v in cnnpar.models.cnn("2+2").trainable_variables], 4)
    assert sent < BYTES_2_2 / 100  # 2+2: its fc1 kernel (3136x1024) as 4 x (3136 + 1024) numbers
    step = 0.036 / 2 + 8 * sent / 1e8 + 2 * 2 * 2e-4  # the ring's bytes (P, then Q: two all-reduces' latency)
    assert float(rows["multi-worker powersgd r=4"]["images_per_second"]) == pytest.approx(64 / step)
    assert f"multi-worker powersgd r=4 {round(64 / step)} images/s: {compression.changes('powersgd', 4)}" \
        in " ".join(result.output.split())


def test_the_local_steps_row_exchanges_the_weights_every_h_steps_and_the_plan_ranks_what_each_remedy_changes(
        tmp_path):
    result = run_cli("plan", "--model", "2+2", "--hosts", "2", "--link", "100mbit", "--step-seconds", "0.072",
                     "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = {r["configuration"]: r for r in csv.DictReader((tmp_path / "out" / "scaling.csv").open())
            if r["hosts"] == "2"}
    (local,) = [name for name in rows if name.startswith("local-steps H=")]
    h = int(local.split("=")[1])
    assert h == scaling.MAX_INNER_STEPS  # 13 MB over 100 Mbit/s: the most it advises, and no more
    step = 0.072 / 2 + 8 * BYTES_2_2 / 1e8 / h  # the ring's bytes (2 hosts: the weights once) every H steps
    assert float(rows[local]["images_per_second"]) == pytest.approx(64 / step, rel=1e-3)
    lines = result.output.splitlines()
    first = lines.index("on 2 hosts, fastest first:")
    ranked = [re.fullmatch(r"  (.+?) +(\d+) images/s: (.+)", line).groups() for line in lines[first + 1:first + 6]]
    speeds = [int(images) for _, images, _ in ranked]
    assert speeds == sorted(speeds, reverse=True), ranked
    assert {name.split("=")[0] for name, _, _ in ranked} == {
        "multi-worker", "multi-worker accumulate K", "multi-worker powersgd r", "local-steps H", "async-ps"}
    changes = {name: said for name, _, said in ranked}
    assert changes["multi-worker"] == "Single's training"
    assert changes[local] == (f"inner_steps={h}: each host steps alone on its 32 examples of a batch, and the hosts "
                              f"meet every {h} steps: another training (its validation accuracy measured at most "
                              f"1.6 points below Single's in 18 runs, 14 of them within 1, docs/slow_links.md) "
                              f"(H is advised up to {h})")


def test_a_measured_run_faster_than_the_link_allows_is_refused_naming_it(tmp_path):
    result = run_cli("plan", "--model", "2+2", "--hosts", "4", "--step-seconds", "0.1", "--link", "1gbit",
                     "--measured", "async-ps:2=100000000", "--out", tmp_path / "out")
    assert one_line_refusal(result) == (
        "Error: --measured: async-ps:2=1e+08 is more than the 207 images/s that the link (1gbit, 0.1 ms latency) and "
        "the step (100 ms) allow, by more than the 25% of timing noise: it would make TensorFlow's transport take "
        "-310 ms a step; check the run, --link and --step-seconds")
    assert not (tmp_path / "out").exists()


def test_a_measured_run_a_little_faster_than_the_link_allows_is_timing_noise_and_its_figure_is_reproduced():
    """A step timed apart from the run can be slower than the run's own steps on a loaded machine; ``cnnpar plan``
    on the hosts prints its ``--measured`` run as the command for more hosts, which must then be taken."""
    bound = cnnpar.MultiWorker.host_step(2, 0.1, traffic.Link.parse("1gbit"), BYTES_2_2).images_per_second(64)
    faster = round((1 + scaling.TIMING_NOISE) * bound * 0.96)
    result = run_cli("plan", "--model", "2+2", "--hosts", "2", "--step-seconds", "0.1", "--link", "1gbit",
                     "--measured", f"multi-worker:2={faster}")
    assert result.exit_code == 0, result.output
    two_hosts = next(line.split("|")[1].split()[0] for line in result.output.splitlines() if line.startswith("    2 |"))
    assert float(two_hosts) == pytest.approx(faster, rel=0.01)
