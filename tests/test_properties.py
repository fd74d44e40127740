"""Properties of the parsers and pure functions that a hostile input reaches, each checked on generated inputs.

Every test states what holds for EVERY input: a value that satisfies an invariant, or a one-line ``ValueError``
(or usage error) that names the input. The examples are derandomized and no database is kept, so the verdict is
the same on every machine and every day.
"""

import ast
import functools
import json
import math
import os
import re
import string
import sys
import warnings

import click
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from keras_cnnpar.cli.training import _strategy_options
from keras_cnnpar.cluster import environments, network, spec, traffic
from keras_cnnpar.results import runs
from keras_cnnpar.strategies import arguments
from keras_cnnpar.strategies.async_ps import run as async_run
from keras_cnnpar.zoo import data

#: One verdict on any machine: the same examples each run, no time limit, nothing remembered between runs. Under
#: mutation testing (``mutation/run.py`` sets ``CNNPAR_MUTATION``) a failing example is not shrunk: the verdict is the
#: same, and shrinking a mutant's failure can take minutes.
PROPERTY = settings(derandomize=True, deadline=None, max_examples=100, database=None,
                    phases=[phase for phase in Phase if not (os.environ.get("CNNPAR_MUTATION")
                                                             and phase in (Phase.shrink, Phase.explain))])

#: Text that looks like what a user types: digits, dots, signs, exponents, units, spaces, and some letters.
TYPED = st.text(alphabet="0123456789.eE+- kmgtbitsuMGBx:[],()=_\n\t\x00é", max_size=24)

#: Any Python value an option may be given; the bounds of the checks first.
ANY_VALUE = st.one_of(st.sampled_from([0, 1, 2, -1, 0.0, 1.0, 0.5, math.inf, -math.inf, math.nan, 1e-300]),
                      st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                      st.text(max_size=8), st.lists(st.integers(), max_size=2))


def assert_one_line_naming(error, received):
    """``error`` says in one line what was received."""
    message = str(error)
    assert "\n" not in message, message
    assert received in message, (received, message)


# Link rates and times (cluster/traffic.py)


@PROPERTY
@given(rate=st.one_of(st.sampled_from(["1gbit", "0.5mbit"]), TYPED), latency=TYPED)  # a good rate: a latency refused
@example(rate="1e300tbit", latency="0s")  # a finite number, an infinite rate
def test_every_link_text_is_read_as_a_finite_positive_rate_and_latency_or_refused_in_one_line_naming_it(rate,
                                                                                                           latency):
    try:
        link = traffic.Link.parse(rate, latency)
    except ValueError as error:
        assert str(error) in (
            f"link rate: expected a number and one of the units bit, kbit, mbit, gbit, tbit (100mbit, 1gbit, 10gbit); "
            f"received {rate!r}",
            f"link rate: expected more than 0 bits per second; received {rate!r}",
            f"link latency: expected a number and one of the units s, ms, us (0.1ms, 50us); received {latency!r}")
        return
    assert 0 < link.bits_per_second < math.inf
    assert 0 <= link.latency_seconds < math.inf


@PROPERTY
@given(number=st.floats(0, 1e300, allow_subnormal=False), unit=st.sampled_from(list(traffic.RATE_UNITS)),
       spaces=st.sampled_from(["", " ", "  "]), upper=st.booleans())
def test_a_rate_is_its_number_times_its_units_bits_whatever_the_case_and_spacing(number, unit, spaces, upper):
    text = f"{spaces}{number!r}{spaces}{unit.upper() if upper else unit}{spaces}"
    expected = number * traffic.RATE_UNITS[unit]
    if not 0 < expected < math.inf:
        with pytest.raises(ValueError, match=r"^link rate: .*received "):
            traffic.Link.parse(text)
        return
    assert traffic.Link.parse(text).bits_per_second == pytest.approx(expected, rel=1e-12)


@PROPERTY
@given(bits=st.floats(1, 1e18), latency=st.floats(0, 10))
def test_a_links_text_reads_back_as_the_same_rate_and_latency_to_its_three_digits(bits, latency):
    rate_text, latency_text = str(traffic.Link(bits, latency)).split(", ")
    back = traffic.Link.parse(rate_text, latency_text.removesuffix(" latency").replace(" ", ""))
    assert back.bits_per_second == pytest.approx(bits, rel=5e-3)
    assert back.latency_seconds == pytest.approx(latency, rel=5e-3, abs=1e-9)


@PROPERTY
@given(bits=st.one_of(st.floats(1e-3, 1e16), st.sampled_from(list(traffic.RATE_UNITS.values()))),
       tenths=st.integers(0, 999))  # up to 99.9 ms: three digits
@example(bits=0.5, tenths=5)
def test_a_links_text_gives_the_rate_in_its_largest_unit_not_above_it_and_the_latency_in_ms(bits, tenths):
    rate_text, latency_text = str(traffic.Link(bits, tenths / 1e4)).split(", ")
    number, unit = re.fullmatch(r"([0-9.e+-]+)([a-z]+)", rate_text).groups()
    assert unit == max((unit for unit, scale in traffic.RATE_UNITS.items() if scale <= bits), default="bit",
                       key=traffic.RATE_UNITS.get)
    assert 1 <= float(number) < 1000 or (unit == "bit" and float(number) < 1) or unit == "tbit"
    assert latency_text == f"{tenths / 10:g} ms latency"  # in 0.1 ms steps, exactly


@PROPERTY
@given(bits=st.floats(1, 1e13), latency=st.floats(0, 1), first=st.integers(0, 10**10), second=st.integers(0, 10**10),
       rounds=st.integers(0, 100))
def test_a_links_seconds_add_up_over_payloads_and_grow_with_bytes_and_rounds(bits, latency, first, second, rounds):
    link = traffic.Link(bits, latency)
    assert link.seconds(first + second) == pytest.approx(link.seconds(first) + link.seconds(second), rel=1e-9)
    assert link.seconds(first, rounds) == pytest.approx(link.seconds(first) + rounds * latency, rel=1e-9)
    assert link.seconds(max(first, second), rounds + 1) >= link.seconds(min(first, second), rounds) >= 0
    assert link.seconds(bits / 8) == pytest.approx(1.0)  # a second's bytes take a second


# The traffic model's arithmetic


@PROPERTY
@given(payload=st.integers(0, 10**12), hosts=st.integers(1, 10**4))
def test_a_ring_all_reduce_sends_2_n_minus_1_payloads_in_all_each_host_less_than_twice_one(payload, hosts):
    each = traffic.ring_all_reduce(payload, hosts)
    assert each * hosts == pytest.approx(2 * (hosts - 1) * payload)  # every shard reduced and gathered once
    assert 0 <= each < 2 * payload or each == payload == 0
    assert traffic.ring_all_reduce(payload, hosts + 1) >= each  # more hosts never send less each
    assert traffic.ring_all_reduce(payload, 1) == 0  # one host sends nothing


@PROPERTY
@given(compute=st.floats(1e-4, 10), communication=st.floats(0, 10), parallel=st.floats(1, 64),
       factor=st.floats(0.05, 16), batch=st.integers(1, 4096), measured=st.floats(1e-3, 1e6))
def test_a_host_steps_images_per_second_are_its_images_over_its_seconds_and_transport_reaches_the_measure(
        compute, communication, parallel, factor, batch, measured):
    step = traffic.HostStep(compute, communication, parallel, factor)
    assert step.seconds == pytest.approx(compute + communication)
    assert step.images_per_second(batch) * step.seconds == pytest.approx(batch * factor * parallel)
    assert 0 <= step.communication_share < 1
    transport = step.transport_to(measured, batch)
    calibrated = step.with_transport(transport)
    assert calibrated.communication_seconds >= 0
    if communication + transport >= 0:  # the link's own time is never taken away below nothing
        assert calibrated.images_per_second(batch) == pytest.approx(measured, rel=1e-6)
    else:
        assert calibrated.images_per_second(batch) <= measured * (1 + 1e-9)


# The options every strategy takes (strategies/arguments.py)


def _int_not_bool(value):
    return isinstance(value, int) and not isinstance(value, bool)


@pytest.mark.parametrize(("check", "accepts", "refusal"), [
    (arguments.positive_int, lambda v: _int_not_bool(v) and v >= 1, "must be a positive int"),
    (arguments.non_negative_int, lambda v: _int_not_bool(v) and v >= 0, "must be an int of at least 0"),
    (arguments.positive_seconds, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
     and 0 < v < math.inf, "must be a positive number of seconds"),
    (arguments.momentum_or_none, lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                         and 0 <= v < 1), "must be a number in [0, 1) or None"),
    (arguments.flag, lambda v: isinstance(v, bool), "must be True or False"),
], ids=lambda value: getattr(value, "__name__", None) if callable(value) and "lambda" not in value.__name__ else "")
@PROPERTY
@given(value=ANY_VALUE)
def test_each_option_check_returns_exactly_the_values_it_promises_and_refuses_every_other_naming_it(check, accepts,
                                                                                                     refusal, value):
    if accepts(value):
        assert check("option_x", value) is value
        return
    with pytest.raises((ValueError, TypeError)) as caught:
        check("option_x", value)
    assert str(caught.value) == f"option_x {refusal}. Received: option_x={value!r}"


@PROPERTY
@given(value=st.one_of(ANY_VALUE, st.sampled_from(["linear", "sqrt", "none", "bfloat16", "powersgd", *arguments.
                                                   PRECISION_CHOICES])),
       rank=st.one_of(st.none(), st.integers(-2, 8), st.booleans()))
def test_the_named_options_take_their_listed_names_and_refuse_any_other_value_naming_it(value, rank):
    _named_options_take_their_names(value, rank)


@pytest.mark.parametrize("value", ["none", *arguments.PRECISION_CHOICES, *arguments.COMPRESSIONS, *arguments.SCALE_LR])
@pytest.mark.parametrize("rank", [None, 2, 0])
def test_each_listed_name_of_the_named_options_is_taken_by_its_option_and_refused_by_the_others(value, rank):
    _named_options_take_their_names(value, rank)


def _named_options_take_their_names(value, rank):
    for check, allowed, name in [(arguments.scale_lr, (None, "linear", "sqrt"), "scale_lr"),
                                 (arguments.precision, arguments.PRECISION_CHOICES, "precision"),
                                 (lambda v: arguments.compression(v)[0], arguments.COMPRESSIONS, "compression")]:
        spelled = None if value == "none" and name != "precision" else value
        if isinstance(spelled, (str, type(None))) and spelled in allowed:
            assert check(value) == spelled
        else:
            with pytest.raises(ValueError) as caught:
                check(value)
            assert_one_line_naming(caught.value, f"Received: {name}={value!r}")
    try:
        chosen, chosen_rank = arguments.compression(value, rank)
    except ValueError as error:
        assert "\n" not in str(error) and "Received: " in str(error)
        if value == "powersgd":  # the rank named where it is the rank that is refused
            assert str(error) == f"powersgd_rank must be a positive int. Received: powersgd_rank={rank!r}"
        return
    assert chosen in arguments.COMPRESSIONS  # a rank only with PowerSGD, 4 where none is given
    assert chosen_rank == ((arguments.POWERSGD_RANK if rank is None else rank) if chosen == "powersgd" else None)
    assert chosen_rank is None or (_int_not_bool(chosen_rank) and chosen_rank >= 1)


@PROPERTY
@given(value=st.one_of(ANY_VALUE, st.tuples(st.text(max_size=4))))
def test_devices_is_a_positive_count_or_a_non_empty_list_of_names_and_anything_else_is_refused_naming_it(value):
    try:
        result = arguments.devices(value)
    except (ValueError, TypeError) as error:
        assert_one_line_naming(error, "Received: devices=")
        if isinstance(value, (list, tuple)) and not value:
            assert str(error) == "devices must name at least one device. Received: devices=[]"
        assert not (_int_not_bool(value) and value >= 1) and not (isinstance(value, (list, tuple)) and value)
        return
    assert result == value if _int_not_bool(value) else result == list(value) and result


@PROPERTY
@given(value=ANY_VALUE, kind=st.sampled_from(arguments.COMPRESSIONS))
def test_pack_bytes_is_none_or_a_positive_int_never_with_powersgd_and_a_refusal_names_it(value, kind):
    try:
        packed = arguments.pack_bytes(value, kind)
    except ValueError as error:
        assert str(error) == (f"pack_bytes is for compression=None or 'bfloat16'. Received: compression={kind!r}, "
                              f"pack_bytes={value!r}" if kind == "powersgd" else
                              f"pack_bytes must be a positive int. Received: pack_bytes={value!r}")
        return
    assert packed is value and (value is None or (kind != "powersgd" and _int_not_bool(value) and value >= 1))


@PROPERTY
@given(value=st.sampled_from([None, "none", *arguments.COMPRESSIONS]),
       former=st.sampled_from([None, "none", "bfloat16", "powersgd", "float16"]))
def test_all_reduce_dtype_warns_that_it_is_now_compression_and_counts_only_where_compression_is_not_given(value,
                                                                                                           former):
    spelled = None if value == "none" else value
    if former in (None, "none"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert arguments.compression(value, all_reduce_dtype=former)[0] == spelled
        return
    with pytest.warns(DeprecationWarning) as caught:
        try:
            chosen = arguments.compression(value, all_reduce_dtype=former)[0]
        except ValueError:
            chosen = "refused"
    assert [str(warning.message) for warning in caught] == [
        f"all_reduce_dtype is now compression: give compression={former!r}"]
    expected = former if value is None else spelled  # "none" is given: the gradients whole
    assert chosen == (expected if expected in arguments.COMPRESSIONS else "refused")


@PROPERTY
@given(value=st.one_of(st.text(max_size=6), st.none(), st.integers(), st.binary(max_size=3)))
def test_a_folder_option_is_a_path_or_none_and_anything_else_is_a_type_error_naming_it(value):
    if value is None or isinstance(value, str):
        assert arguments.folder_or_none("results_dir", value) is value
        return
    with pytest.raises(TypeError) as caught:
        arguments.folder_or_none("results_dir", value)
    assert str(caught.value) == f"results_dir must be a folder path or None. Received: results_dir={value!r}"


# The cluster spec and TF_CONFIG (cluster/spec.py)


def assert_address_refusal(error, source, cluster):
    """``error`` is one of the refusals of a cluster's addresses, in its words, naming the job and what it listed."""
    message = str(error)
    received = {f"{job}={addresses!r}" for job, addresses in cluster.items()}
    received |= {f"{job}[{i}]={a!r}" for job, addresses in cluster.items() if isinstance(addresses, list)
                 for i, a in enumerate(addresses)}
    forms = [r"job '.*' must list 'host:port' addresses\. Received: (.*)",
             r"task .*:\d+ has an IPv6 address, which keras_cnnpar does not reach yet; give an IPv4 address or a "
             r"host name\. Received: (.*)",
             r"task .*:\d+ needs a 'host:port' address with a host and a port in 1\.\.65535\. Received: (.*)",
             r"tasks .*:\d+ and .*:\d+ have the same address; every task needs its own\. Received: (.*)",
             r"the 'chief' job has one task; list the others under 'worker'\. Received: (chief=.*)"]
    matches = [re.fullmatch(re.escape(source) + ": " + form, message) for form in forms]
    assert any(match and match[1] in received for match in matches), message

HOSTS = st.sampled_from(["localhost", "10.0.0.1", "Node-1", "node-1", "h", "", "::1", "[::1]", "é"])
PORTS = st.one_of(st.integers(-1, 70000).map(str), st.sampled_from(["", "\uff18\uff10", "0080", "22a", "1" * 4400]))
ADDRESSES = st.one_of(st.builds("{}:{}".format, HOSTS, PORTS), st.text(max_size=12))
JOBS = st.sampled_from(["worker", "chief", "ps", "evaluator", ""])
CLUSTERS = st.dictionaries(JOBS, st.one_of(st.lists(ADDRESSES, max_size=3), st.integers(), st.none()), max_size=3)


@PROPERTY
@given(cluster=CLUSTERS)
def test_a_cluster_is_accepted_only_where_every_task_has_its_own_host_and_port_else_refused_in_one_line(cluster):
    try:
        parsed = spec.parse_spec(cluster, jobs=())
    except ValueError as error:
        assert_address_refusal(error, "cluster", cluster)
        return
    assert parsed is cluster
    seen = set()
    for addresses in cluster.values():
        assert addresses
        for address in addresses:
            host, _, port = address.rpartition(":")
            assert host and ":" not in host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
            assert (host.lower(), int(port)) not in seen
            seen.add((host.lower(), int(port)))


#: Clusters whose addresses are all good: a chief or not, 1-3 workers, ps or an evaluator or not.
GOOD_CLUSTERS = st.builds(
    lambda chief, workers, others: {**({"chief": ["c0:2220"]} if chief else {}),
                                    "worker": [f"w{i}:{2222 + i}" for i in range(workers)],
                                    **{job: [f"{job}{i}:3000"] for i, job in enumerate(others)}},
    st.booleans(), st.integers(1, 3), st.lists(st.sampled_from(["ps", "evaluator"]), unique=True))


@PROPERTY
@given(cluster=st.one_of(GOOD_CLUSTERS, CLUSTERS), job=JOBS,
       index=st.one_of(st.integers(-1, 3), st.booleans(), st.none(), st.text(max_size=2)))
@example(cluster={"chief": ["h1:1", "h2:1"], "worker": ["h3:1"]}, job="chief", index=1)  # two chiefs: both would write
def test_tf_config_is_a_task_that_round_trips_and_has_exactly_one_chief_or_a_one_line_refusal(cluster, job, index):
    text = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    try:
        task = spec.Task.parse(spec.read_tf_config({"TF_CONFIG": text}))
    except ValueError as error:
        if not any(re.fullmatch(pattern, str(error)) for pattern in [
                r"TF_CONFIG: expected a 'cluster' map of job name to addresses\. Received: cluster=.*",
                r"TF_CONFIG: the cluster needs a 'worker' or 'chief' job\. Received: jobs=\[.*\]",
                r"TF_CONFIG: expected a 'task' with a 'type' among \[.*\] and an int 'index'\. Received: task=.*",
                r"TF_CONFIG: task index -?\d+ is outside job '.*', which has \d+ tasks\. Received: task=.*"]):
            assert_address_refusal(error, "TF_CONFIG", cluster)
        return
    assert spec.Task.parse(task.tf_config()) == task == spec.Task.parse(json.loads(text))
    assert repr(task) == f"<Task {job}:{index} of { {kind: len(a) for kind, a in cluster.items()} }>"
    training = [(kind, i) for kind in spec.TRAINING_JOBS for i in range(len(cluster.get(kind, ())))]
    chiefs = [(kind, i) for kind, i in training if spec.Task(cluster, kind, i).is_chief]
    assert len(chiefs) == 1 and task.num_workers == len(training)
    assert task.chief == cluster[chiefs[0][0]][chiefs[0][1]]


@PROPERTY
@given(text=st.one_of(st.text(max_size=40), st.sampled_from(["[" * 100_000, '{"a": ' * 50_000, "NaN", "{}"])))
def test_any_tf_config_text_is_a_json_object_or_refused_in_one_line_naming_tf_config(text):
    try:
        config = spec.read_tf_config({"TF_CONFIG": text})
    except ValueError as error:
        assert str(error).count("\n") == 0 and "TF_CONFIG" in str(error)
        return
    assert isinstance(config, dict) and json.dumps(config) == json.dumps(json.loads(text))


@PROPERTY
@given(raw=st.one_of(st.binary(max_size=30), st.text(max_size=30).map(str.encode)))
def test_any_bytes_in_a_cluster_file_are_a_json_value_or_refused_in_one_line_naming_the_file(raw, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "spec.json"
    path.write_bytes(raw)
    try:
        value = spec.read_json_file(path, "cluster")
    except ValueError as error:
        assert_one_line_naming(error, str(path))
        assert str(error).startswith(f"{path}: expected ")
        return
    assert json.dumps(value) == json.dumps(json.loads(raw.decode("utf-8")))
    if not isinstance(value, dict):  # a file must hold a map, for a spec as for a task
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: expected a JSON object, a TF_CONFIG-style "
                                             rf"one or a map of job name to addresses\. Received: "):
            spec.parse_spec(path)
        with pytest.raises(TypeError, match=r"^cluster must be a TF_CONFIG-style dict or the path of a JSON file\. "
                                            rf"Received: cluster of type {type(value).__name__}$"):
            spec.Task.parse(str(path))
    missing = path.with_name("missing.json")
    with pytest.raises(ValueError, match=rf"^cannot read cluster file {re.escape(str(missing))}: No such file or "
                                         rf"directory\. Received: cluster='{re.escape(str(missing))}'$"):
        spec.parse_spec(missing)


@PROPERTY
@given(workers=st.integers(1, 4), ps=st.integers(0, 3), first=st.integers(1, 60000),
       wrap=st.sampled_from(["bare", "tf_config", "file"]), missing=st.sampled_from([(), ("worker", "ps"), ("chief",)]))
def test_a_local_spec_lists_its_workers_then_its_ps_and_parses_back_whether_bare_wrapped_or_in_a_file(
        workers, ps, first, wrap, missing, tmp_path_factory):
    ports = list(range(first, first + workers + ps))
    local = spec.local_spec(workers, ps, ports=ports)
    assert local == {"worker": [f"localhost:{port}" for port in ports[:workers]],
                     **({"ps": [f"localhost:{port}" for port in ports[workers:]]} if ps else {})}
    given = {"bare": local, "tf_config": {"cluster": local, "task": {"type": "worker", "index": 0}}}.get(wrap)
    source = "cluster"
    if given is None:
        given = tmp_path_factory.mktemp("cluster") / "cluster.json"
        given.write_text(json.dumps(local))
        source = str(given)
    if all(job in local for job in missing):
        assert spec.parse_spec(given, jobs=missing) == local
        return
    with pytest.raises(ValueError) as caught:
        spec.parse_spec(given, jobs=missing)
    assert str(caught.value) == f"{source}: expected the jobs {list(missing)}. Received: jobs={sorted(local)}"


@PROPERTY
@given(coordinator=st.one_of(st.builds("{}:{}".format, HOSTS, PORTS), st.integers(), st.none()),
       chief=st.booleans())
def test_a_coordinator_is_the_spec_chief_else_the_given_address_checked_as_a_tasks_is(coordinator, chief):
    cluster = {"worker": ["localhost:2222"], **({"chief": ["10.0.0.5:2220"]} if chief else {})}
    if chief:
        assert spec.coordinator_address(cluster, coordinator) == "10.0.0.5:2220"
        return
    if not isinstance(coordinator, str):
        with pytest.raises(TypeError) as caught:
            spec.check_coordinator(coordinator)
        assert str(caught.value) == f"coordinator must be a 'host:port' string. Received: coordinator={coordinator!r}"
        return
    try:
        assert spec.coordinator_address(cluster, coordinator) == coordinator
    except ValueError as error:
        assert_address_refusal(error, "coordinator", {"chief": [coordinator]})


LONG = "[" + "1, " * 40 + "1]"  # a JSON value of more than 80 characters: each refusal shows its first 80
SPEC_REFUSALS = [
    ({"cluster": {}, "task": {}}, "TF_CONFIG: expected a 'cluster' map of job name to addresses. Received: cluster={}"),
    ({"cluster": "w:1", "task": {}}, "TF_CONFIG: expected a 'cluster' map of job name to addresses. "
                                     "Received: cluster='w:1'"),
    ({"cluster": {"ps": ["p:1"]}, "task": {}}, "TF_CONFIG: the cluster needs a 'worker' or 'chief' job. "
                                               "Received: jobs=['ps']"),
    *[({"cluster": {"worker": ["w:1"]}, "task": task}, "TF_CONFIG: expected a 'task' with a 'type' among ['worker'] "
                                                       f"and an int 'index'. Received: task={task!r}")
      for task in ["worker", {"type": "worker"}, {"type": "worker", "index": True}, {"type": "ps", "index": 0},
                   {"type": "worker", "index": "0"}]],
    ({"cluster": {"worker": ["w:1:2"]}, "task": {}}, "TF_CONFIG: task worker:0 has an IPv6 address, which "
                                                     "keras_cnnpar does not reach yet; give an IPv4 address or a host "
                                                     "name. Received: worker[0]='w:1:2'"),
    ({"cluster": {"worker": ["w:65536"]}, "task": {}}, "TF_CONFIG: task worker:0 needs a 'host:port' address with a "
                                                       "host and a port in 1..65535. Received: worker[0]='w:65536'"),
    ({"cluster": {"worker": ["W:1", "w:01"]}, "task": {}}, "TF_CONFIG: tasks worker:0 and worker:1 have the same "
                                                           "address; every task needs its own. Received: "
                                                           "worker[1]='w:01'"),
]


@pytest.mark.parametrize(("config", "expected"), SPEC_REFUSALS)
def test_each_tf_config_refusal_says_what_was_expected_and_what_was_received(config, expected):
    with pytest.raises(ValueError) as caught:
        spec.Task.parse(config)
    assert str(caught.value) == expected


def test_a_task_is_read_from_tf_config_or_a_file_and_the_reading_errors_name_their_source(tmp_path, monkeypatch):
    config = {"cluster": {"worker": ["w0:65535", "w1:1"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    (tmp_path / "task.json").write_text(json.dumps(config))
    assert spec.Task.parse() == spec.Task.parse(config) == spec.Task.parse(str(tmp_path / "task.json")) == \
        spec.Task.parse(tmp_path / "task.json") == spec.Task(config["cluster"], "worker", 1)
    (tmp_path / "bad.json").write_text('{"cluster": {"worker": ["w0:0"]}, "task": {"type": "worker", "index": 0}}')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'bad.json'))}: task worker:0 needs"):
        spec.Task.parse(tmp_path / "bad.json")
    with pytest.raises(ValueError, match=rf"^cannot read cluster file {re.escape(str(tmp_path / 'none.json'))}: No "
                                         rf"such file or directory\. Received: cluster='.*none\.json'$"):
        spec.Task.parse(tmp_path / "none.json")
    with pytest.raises(TypeError, match=r"^cluster must be a TF_CONFIG-style dict or the path of a JSON file\. "
                                        r"Received: cluster of type int$"):
        spec.Task.parse(42)
    with pytest.raises(TypeError, match=r"^cluster must be a dict, a tf.train.ClusterSpec or the path of a JSON "
                                        r"file\. Received: cluster of type int$"):
        spec.parse_spec(42)
    (tmp_path / "list.json").write_text(LONG)
    with pytest.raises(ValueError) as caught:
        spec.parse_spec(tmp_path / "list.json")
    assert str(caught.value) == (f"{tmp_path / 'list.json'}: expected a JSON object, a TF_CONFIG-style one or a map "
                                 f"of job name to addresses. Received: {LONG[:80]}")
    with pytest.raises(ValueError, match=r"^cluster: expected the jobs \['worker', 'ps'\]\. "
                                         r"Received: jobs=\['b', 'a'\]$"):
        spec.parse_spec({"cluster": ["b", "a"]})
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError) as caught:
        spec.Task.parse()
    assert str(caught.value) == (
        "no cluster: TF_CONFIG is not set. Set TF_CONFIG on every host, pass cluster=<dict or JSON file>, or start N "
        "workers on this machine with `cnnpar launch --workers N python your_script.py` (or `cnnpar train --strategy "
        "multi-worker --workers N`). Received: TF_CONFIG=''")
    for text, expected in [(LONG, "TF_CONFIG: expected a JSON object with a 'cluster' and a 'task'. Received: "
                                  f"TF_CONFIG={LONG[:80]!r}"),
                           (LONG + "x", f"TF_CONFIG: expected JSON, line 1 column {len(LONG) + 1}: Extra data. "
                                        f"Received: {LONG[:80]!r}"),
                           ("[" * 5000, f"TF_CONFIG: expected JSON nested fewer than {sys.getrecursionlimit()} "
                                        f"levels deep. Received: {'[' * 80!r}")]:
        with pytest.raises(ValueError) as caught:
            spec.read_tf_config({"TF_CONFIG": text})
        assert str(caught.value) == expected


def test_a_local_spec_takes_free_ports_and_a_coordinator_defaults_to_this_hosts_route_to_the_first_task():
    local = spec.local_spec(2, 1)
    addresses = local["worker"] + local["ps"]
    assert len(local["worker"]) == 2 and len(set(addresses)) == 3 and spec.parse_spec(local) == local
    host, _, port = spec.coordinator_address({"worker": ["localhost:2222"], "ps": ["10.9.9.9:1"]}).rpartition(":")
    assert host == "127.0.0.1" and 1 <= int(port) <= 65535
    try:
        route = network.route_address("10.9.9.9")
    except OSError:
        pytest.skip("no route from this machine to another host: the coordinator's address would be loopback")
    assert spec.coordinator_address({"worker": ["10.9.9.9:2222"]}).rpartition(":")[0] == route  # the first task's


def test_a_cluster_file_that_is_not_utf8_is_refused_naming_the_file_and_the_byte(tmp_path):
    path = tmp_path / "spec.json"
    path.write_bytes(b'{"worker": ["h\xff:1"]}')
    with pytest.raises(ValueError) as caught:
        spec.parse_spec(path)
    assert str(caught.value) == (f"{path}: expected UTF-8 JSON; byte 0xff at offset 14 is not UTF-8. "
                                 f"Received: cluster={str(path)!r}")


# The environments' variables (cluster/environments.py)

NAMES = st.text(alphabet=string.ascii_lowercase + "-", min_size=1, max_size=5)


@PROPERTY
@given(groups=st.lists(st.tuples(NAMES, st.integers(0, 120), st.integers(0, 4), st.integers(1, 3)), min_size=1,
                       max_size=4))
def test_a_slurm_host_list_expands_to_its_names_in_order_and_back(groups):
    parts, expected = [], []
    for prefix, first, count, width in groups:
        numbers = range(first, first + count + 1)
        parts.append(f"{prefix}[{str(first).zfill(width)}-{str(numbers[-1]).zfill(width)}]" if count else
                     f"{prefix}{first}")
        expected += [prefix + (str(n).zfill(width) if count else str(n)) for n in numbers]
    assert environments.expand_hostlist(",".join(parts)) == expected


@PROPERTY
@given(text=st.text(alphabet="ab01-9[],", max_size=10))  # at most 10**5 names: no range of a billion
def test_any_host_list_text_is_names_without_brackets_or_commas_or_refused_in_one_line_naming_it(text):
    try:
        hosts = environments.expand_hostlist(text)
    except ValueError as error:
        assert_one_line_naming(error, f"SLURM_STEP_NODELIST={text!r}")
        return
    assert hosts and all(host and not set(host) & set("[],") for host in hosts)


@PROPERTY
@given(counts=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=4),
       text=st.text(alphabet="0123(x),", max_size=9))  # at most 10**5 tasks
@example(counts=[(1, 1)], text="2(x00),1")  # was [1]: the node of 2(x00) had no tasks, and no refusal said so
def test_tasks_per_node_expand_to_their_counts_and_any_other_text_is_refused_naming_it(counts, text):
    written = ",".join(f"{tasks}(x{repeat})" if repeat > 1 else str(tasks) for tasks, repeat in counts)
    assert environments.expand_tasks_per_node(written) == [tasks for tasks, repeat in counts for _ in range(repeat)]
    try:
        expanded = environments.expand_tasks_per_node(text)
    except ValueError as error:
        assert_one_line_naming(error, f"SLURM_STEP_TASKS_PER_NODE={text!r}")
        return
    assert len(expanded) >= len(text.split(",")) and all(tasks >= 1 for tasks in expanded)  # a node at least a piece


@PROPERTY
@given(text=st.one_of(st.text(max_size=6), st.integers(0, 70000).map(str), st.just("9" * 4400)),
       high=st.sampled_from([None, 65535]))
def test_an_environment_variables_int_is_within_its_bounds_or_refused_in_one_line_naming_the_variable(text, high):
    try:
        value = environments._int({"CNNPAR_X": text}, "CNNPAR_X", 7, low=1, high=high)
    except ValueError as error:
        assert_one_line_naming(error, f"CNNPAR_X={text!r}")
        return
    assert value == 7 if not text else (1 <= value <= (high or value) and value == int(text))


# runs.csv (results/runs.py)

#: What a cell of runs.csv may hold where it is text: any character a file of UTF-8 holds, line breaks, quotes and
#: commas first.
CELLS = st.one_of(st.text(max_size=6), st.sampled_from(["", ",", '"', "a\r\nb", "\r", "\n", "\x1c", "\x85",
                                                        "\u2028", "\x0c", "\ufeff"]))
NUMBERS = st.one_of(st.just(""), st.floats(allow_nan=False).map(str), st.integers().map(str))


def runs_rows(columns):
    """Rows of runs.csv under ``columns``: numbers (or nothing) in the columns of numbers, any text elsewhere."""
    return st.lists(st.fixed_dictionaries({column: NUMBERS if column in runs.NUMBER_COLUMNS else CELLS
                                           for column in columns}), max_size=3)


@PROPERTY
@given(rows=runs_rows(runs.RUNS_COLUMNS), mark=st.sampled_from(["", runs.BYTE_ORDER_MARK]))
def test_every_runs_csv_row_reads_back_as_written_whatever_its_text(rows, mark, tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / runs.RUNS_CSV
    path.write_bytes((mark + runs.csv_text(runs.RUNS_COLUMNS, rows)).encode())
    assert runs.read_runs(path) == rows == runs.read_csv(path)
    runs.check_runs_csv(path.parent)  # this version's header: nothing to refuse
    runs.prepare_runs_csv(path.parent)  # nor to migrate
    assert path.read_bytes() == (mark + runs.csv_text(runs.RUNS_COLUMNS, rows)).encode()


@PROPERTY
@given(data=st.data(), old_columns=st.sampled_from(runs.OLDER_RUNS_COLUMNS),
       mark=st.sampled_from(["", runs.BYTE_ORDER_MARK]))
def test_every_row_of_an_older_runs_csv_is_kept_by_the_migration_and_the_warning_names_the_added_columns(
        data, old_columns, mark, tmp_path_factory):
    rows = data.draw(runs_rows(old_columns))
    path = tmp_path_factory.mktemp("runs") / runs.RUNS_CSV
    text = mark + runs.csv_text(old_columns, rows)
    path.write_bytes(text.encode())
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        runs.prepare_runs_csv(path.parent)
    added = [column for column in runs.RUNS_COLUMNS if column not in old_columns]
    assert [str(w.message).split("; ")[1] for w in warned] == [
        f"added {','.join(added)} (empty in the {len(rows)} earlier rows)"]
    assert runs.read_runs(path) == [{**dict.fromkeys(runs.RUNS_COLUMNS, ""), **row} for row in rows]
    (backup,) = path.parent.glob("runs.csv.*.bak")
    assert backup.read_bytes() == text.encode()


# `--option NAME=VALUE` (cli/training.py)

OPTIONS = st.one_of(st.sampled_from(["warmup_steps", "ema_momentum", "workers", "nothing", "", "timeout"]),
                    st.text(max_size=5))
VALUES = st.one_of(st.text(max_size=10), st.integers().map(str), st.sampled_from(["None", "[1, (2", "-" * 3000 + "1",
                                                                                  "(" * 300, "\udcff", "\x00"]))


@PROPERTY
@given(pairs=st.lists(st.one_of(st.builds("{}={}".format, OPTIONS, VALUES), st.text(max_size=8)), max_size=3))
def test_every_option_pair_is_a_literal_or_its_text_or_a_one_line_usage_error_naming_the_pair(pairs):
    given_flags = {"workers": 2, "timeout": None}
    try:
        options = _strategy_options("async-ps", pairs, given_flags)
    except click.BadParameter as error:
        assert "\n" not in error.message and "Received: --option " in error.message
        assert any(f"--option {pair if pair.isprintable() else repr(pair)}" in error.message for pair in pairs)
        return
    assert {name: options[name] for name in given_flags} == given_flags
    assert len(options) == len(given_flags) + len(pairs)  # every pair once, none lost
    for pair in pairs:
        name, _, text = pair.partition("=")
        value = options[name]
        assert value == text or value == ast.literal_eval(text)


# The slices and groups of an AsyncPS epoch (strategies/async_ps/run.py)


@PROPERTY
@given(size=st.integers(1, 10_000), slices=st.integers(1, 64))
def test_a_batch_is_cut_into_slices_that_hold_each_example_once_none_empty_within_one_of_each_other(size, slices):
    sizes = async_run._slice_sizes(size, slices)
    assert sum(sizes) == size and len(sizes) == min(size, slices)
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@PROPERTY
@given(slices=st.one_of(st.none(), st.integers(1, 10**6)), workers=st.integers(1, 10**4),
       batch_size=st.one_of(st.none(), st.integers(1, 10**5)))
def test_a_batch_is_trained_in_the_slices_asked_for_or_in_as_few_as_keep_batches_in_flight_bounded(slices, workers,
                                                                                                     batch_size):
    got = async_run.batch_slices(slices, workers, batch_size)
    assert got >= 1 and (batch_size is None or got <= batch_size)  # a slice holds an example at least
    if slices is not None:
        assert got == (slices if batch_size is None else min(slices, batch_size))
    elif batch_size is None or got < batch_size:  # whole batches in flight: at most BATCHES_IN_FLIGHT, no fewer
        in_flight = async_run.BATCHES_IN_FLIGHT
        assert workers / got <= in_flight and (got == 1 or workers / (got - 1) > in_flight)


@PROPERTY
@given(steps_per_execution=st.integers(1, 64), steps=st.integers(1, 10**5), workers=st.integers(1, 1000))
def test_an_epoch_is_scheduled_in_groups_no_larger_than_asked_that_leave_no_worker_without_one(steps_per_execution,
                                                                                                steps, workers):
    group = async_run.steps_per_group(steps_per_execution, steps, workers)
    assert 1 <= group <= steps_per_execution
    assert math.ceil(steps / group) >= min(workers, steps)  # as many groups as workers, where the steps allow


@settings(PROPERTY, max_examples=25)
@given(batch_sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5), slices=st.integers(1, 5))
def test_an_indexed_epoch_gives_every_example_once_in_order_and_each_batchs_slices_share_it_whole(batch_sizes,
                                                                                                   slices):
    examples = np.arange(sum(batch_sizes))
    parts = np.split(examples, np.cumsum(batch_sizes)[:-1])
    batches = functools.reduce(lambda a, b: a.concatenate(b),
                               [tf.data.Dataset.from_tensors((part, -part)) for part in parts])
    indexed = async_run._IndexedBatches(batches, slices)
    epoch = next(iter(indexed.dataset()))
    steps = [async_run._IndexedBatches.batch(epoch, i) for i in range(len(indexed.sizes))]
    seen = np.concatenate([x.numpy() for (x, _), _ in steps])
    assert seen.tolist() == examples.tolist()  # every example once, in order
    assert all(np.array_equal(y.numpy(), -x.numpy()) for (x, y), _ in steps)  # each with its own label
    shares = [float(share) for _, share in steps]
    first = 0
    for size in batch_sizes:  # each batch's slices: its examples cut as evenly as can be, their shares summing to 1
        count = min(size, slices)
        assert math.isclose(sum(shares[first:first + count]), 1.0, rel_tol=1e-6)
        first += count
    assert first == len(steps)


# The Kaggle CSV reader (zoo/data.py)

#: A labeled Kaggle table of 3 rows (label, then 784 pixels), the same on every run.
KAGGLE_ROWS = np.concatenate([np.random.default_rng(0).integers(0, 10, (3, 1)),
                              np.random.default_rng(1).integers(0, 256, (3, data.PIXELS))], axis=1)


@settings(PROPERTY, max_examples=80)
@given(row=st.integers(0, 2), column=st.sampled_from([0, 1, 2, 400, data.PIXELS]),
       text=st.one_of(TYPED, st.integers(-300, 300).map(str),
                      st.sampled_from(["12.0", "255.0", "256", "-1", "1e2", " 7", "", "nan", "0x10", "9", "10"])))
def test_a_kaggle_csv_with_any_one_value_rewritten_is_read_as_numbers_or_refused_naming_its_file_and_line(
        tmp_path_factory, row, column, text):
    cells = KAGGLE_ROWS.astype(str).astype(object)
    cells[row, column] = text
    path = tmp_path_factory.mktemp("kaggle") / "train.csv"
    path.write_text(",".join(data.TRAIN_HEADER) + "\n" + "".join(",".join(line) + "\n" for line in cells))
    try:
        pixels, labels = data.read_kaggle_csv(path, labeled=True)
    except data.DataError as error:
        message = str(error)
        assert "\n" not in message and message.startswith(f"{path}, line {row + 2}"), message
        return
    read = np.concatenate([labels[:, None], pixels], axis=1).astype(np.int64)
    expected = KAGGLE_ROWS.copy()
    expected[row, column] = read[row, column]
    assert np.array_equal(read, expected)  # every other value as written
    assert float(text) == read[row, column] <= (9 if column == 0 else 255)  # this one a number written otherwise
