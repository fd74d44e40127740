"""``cnnpar plan --hosts N --link RATE``: each strategy's step across hosts, computed by hand, and the table."""

import csv

import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.cluster import traffic
from keras_cnnpar.plan import scaling
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
    accumulated = [r for r in rows if r["configuration"].startswith("multi-worker accumulate")]
    assert all(float(r["communication_share"]) <= scaling.COMMUNICATION_TARGET for r in accumulated)


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
    assert float(accumulated["communication_share"]) <= scaling.COMMUNICATION_TARGET
    assert (f"calibrated with the measured runs: TensorFlow's transport adds {added['multi-worker'] * 1e3:.0f} ms to "
            f"multi-worker, {added['async-ps'] * 1e3:.0f} ms to async-ps a step") in result.output


@pytest.mark.parametrize("given, said", [
    (["--link", "1gbit"], "Error: --link is for --hosts: add --hosts N to predict training on N hosts"),
    (["--measured", "multi-worker:2=294"], "Error: --measured is for --hosts: add --hosts N to predict training on "
     "N hosts"),
    (["--hosts", "4", "--link", "1gbit", "--step-seconds", "0.07", "--measured", "mirrored:2=900"],
     "Error: --measured: expected CONFIGURATION:HOSTS=IMAGES/S, as multi-worker:2=294 (configurations: multi-worker, "
     "async-ps; 2 or more hosts; images/s above 0); received 'mirrored:2=900'"),
    (["--hosts", "4"], "Error: --hosts needs --link RATE, the hosts' link rate: 100mbit, 1gbit or 10gbit, say"),
    (["--hosts", "4", "--link", "1gbit", "--latency", "soon"], "Error: --link/--latency: link latency: expected a "
     "number and one of the units s, ms, us (0.1ms, 50us); received 'soon'"),
])
def test_plan_for_hosts_refuses_options_that_disagree_in_one_line(given, said, tmp_path):
    assert one_line_refusal(run_cli("plan", *given, "--out", tmp_path / "out")) == said
    assert not (tmp_path / "out").exists()
