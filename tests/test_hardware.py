"""The machine's facts: oneDNN turned on where TensorFlow leaves it off, precision that knows native bfloat16."""

import subprocess
import sys

import pytest

import keras_cnnpar as cnnpar
from keras_cnnpar.runtime import hardware
from tests.helpers import ENV, build_small_cnn

EMULATING = hardware.Cpu("Some AVX2 CPU", frozenset({"avx", "avx2", "fma"}), x86=True)
NATIVE = hardware.Cpu("Some AMX CPU", frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}), x86=True)
ONEDNN_PROBE = ("import os, keras_cnnpar\n"
                "from tensorflow.python.util import _pywrap_util_port\n"
                "print(os.environ.get('TF_ENABLE_ONEDNN_OPTS'), _pywrap_util_port.IsMklEnabled())\n")


def onednn_in_a_fresh_process(**env):
    unset = ("TF_ENABLE_ONEDNN_OPTS", "CNNPAR_SET_ONEDNN")
    environment = {key: value for key, value in ENV.items() if key not in unset}
    done = subprocess.run([sys.executable, "-c", ONEDNN_PROBE], env={**environment, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-2:]


@pytest.mark.slow
@pytest.mark.skipif(not hardware.cpu().x86, reason="oneDNN's kernels are TensorFlow's x86 CPU kernels")
def test_importing_keras_cnnpar_leaves_onednn_on_unless_the_user_turned_it_off():
    variable, enabled = onednn_in_a_fresh_process()
    assert enabled == "True"  # TensorFlow's default on this CPU, or turned on by keras_cnnpar
    assert variable == ("None" if hardware.onednn_default() else "1")
    assert onednn_in_a_fresh_process(TF_ENABLE_ONEDNN_OPTS="0") == ["0", "False"]  # the user's choice stands


def test_onednn_is_turned_on_only_where_tensorflow_leaves_it_off_and_the_user_said_nothing():
    def enable(environ, machine, tensorflow_started=False):
        return hardware.enable_onednn(environ, machine, tensorflow_started=tensorflow_started)

    environ = {}
    assert enable(environ, EMULATING).startswith("on: turned on by keras_cnnpar")
    assert environ["TF_ENABLE_ONEDNN_OPTS"] == "1"
    environ = {}
    assert enable(environ, NATIVE) == "on: TensorFlow's default on this CPU" and environ == {}
    environ = {"TF_ENABLE_ONEDNN_OPTS": "0"}
    assert enable(environ, EMULATING) == "off: TF_ENABLE_ONEDNN_OPTS=0, as set by the user"
    assert environ == {"TF_ENABLE_ONEDNN_OPTS": "0"}
    assert enable({}, hardware.Cpu("Graviton", frozenset({"asimd"}), x86=False)) == "off: not an x86 CPU"
    environ = {}
    assert enable(environ, EMULATING, tensorflow_started=True).startswith("off: TensorFlow started before")
    assert environ == {}


def test_keras_imported_first_on_a_cpu_where_onednn_would_be_turned_on_warns_how_to_turn_it_on():
    late = hardware.enable_onednn({}, EMULATING, tensorflow_started=True)
    assert hardware.onednn_warning(late, EMULATING) == (
        "oneDNN stays off: TensorFlow started before keras_cnnpar was imported, and it leaves oneDNN off on this CPU "
        "(Some AVX2 CPU: no AVX512-VNNI, AVX512-BF16, AVX-VNNI or AMX), where oneDNN trained 1.65x as fast "
        "(docs/benchmarks.md). Import keras_cnnpar before keras and tensorflow, or set TF_ENABLE_ONEDNN_OPTS=1")
    for environ, machine in [({}, NATIVE), ({"TF_ENABLE_ONEDNN_OPTS": "0"}, EMULATING),
                             ({"TF_ENABLE_ONEDNN_OPTS": "1"}, EMULATING)]:
        assert hardware.onednn_warning(hardware.enable_onednn(environ, machine, tensorflow_started=True),
                                       machine) is None


def test_bfloat16_on_a_cpu_that_emulates_it_warns_in_one_line(monkeypatch, batch, recwarn):
    monkeypatch.setattr(hardware, "cpu", lambda: EMULATING)
    cnnpar.fit(build_small_cnn(), *batch, batch_size=64, precision="mixed_bfloat16", results_dir=None, verbose=0)
    assert [str(w.message) for w in recwarn if w.category is UserWarning] == [
        "precision='mixed_bfloat16' on a CPU without native bfloat16 (Some AVX2 CPU: no AVX512-BF16 or AMX-BF16): "
        "TensorFlow emulates it, measured at 0.08x float32's speed on such a CPU (docs/benchmarks.md); use "
        "precision='float32' or 'auto'"]
    monkeypatch.setattr(hardware, "cpu", lambda: NATIVE)
    recwarn.clear()
    cnnpar.fit(build_small_cnn(), *batch, batch_size=64, precision="mixed_bfloat16", results_dir=None, verbose=0)
    assert not [w for w in recwarn if w.category is UserWarning]


@pytest.mark.parametrize("machine, chosen", [(EMULATING, "float32"), (NATIVE, "mixed_bfloat16")], ids=["avx2", "amx"])
def test_auto_precision_takes_bfloat16_only_where_the_cpu_has_it(monkeypatch, batch, tmp_path, machine, chosen):
    monkeypatch.setattr(hardware, "cpu", lambda: machine)
    cnnpar.fit(build_small_cnn(), *batch, batch_size=64, precision="auto", results_dir=tmp_path, verbose=0)
    assert f" precision={chosen} " in (tmp_path / "results.log").read_text()
