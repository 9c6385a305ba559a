"""The executor's environment switches: every variable is read in executor_svc/settings.py
(and only there), lands in the frozen config, and means what it meant before."""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest

from executor_svc import __main__ as executor_main
from executor_svc.models import decoder
from executor_svc.settings import Switches
from kernels import native
from kernels.quant import QuantWeight

ROOT = pathlib.Path(__file__).resolve().parents[2]
IPC = ["--ipc", "ipc:///tmp/continuum-test-settings.sock"]


def test_nothing_set_is_every_default():
    s = Switches.from_env({})
    assert s == Switches(faults=s.faults) and not s.faults.faults
    assert s.native_kernels and s.native_gemm and s.native_decoder
    assert s.kernel_cache is s.compiler is s.cache_dir is None
    assert decoder.native_options(s) == native.NativeOptions()
    switches = executor_main.parse_args(IPC, {}).switches
    assert decoder.native_options(switches) == native.NativeOptions()


def test_each_variable_lands_in_its_field():
    env = {"CONTINUUM_NATIVE_KERNELS": "0", "CONTINUUM_KERNEL_CACHE": "/k", "CXX": "clang++",
           "CONTINUUM_NATIVE_GEMM": "0", "CONTINUUM_NATIVE_DECODER": "0",
           "CONTINUUM_CACHE_DIR": "/models", "CONTINUUM_FAULT_INJECT": "raise_on_token=7"}
    s = executor_main.parse_args(IPC, env).switches
    assert decoder.native_options(s) == native.NativeOptions(enabled=False, cache_dir="/k",
                                                      compiler="clang++")
    assert decoder.model_options(s) == {"native_options": decoder.native_options(s),
                                        "native_gemm": False, "native_decoder": False,
                                        "weight_format": "auto"}
    assert s.cache_dir == "/models" and s.faults.faults == {7: "raise_on_token"}


@pytest.mark.parametrize("value", ["1", "", "yes"])
def test_only_zero_turns_a_native_switch_off(value):
    env = dict.fromkeys(("CONTINUUM_NATIVE_KERNELS", "CONTINUUM_NATIVE_GEMM",
                         "CONTINUUM_NATIVE_DECODER"), value)
    s = Switches.from_env(env)
    assert s.native_kernels and s.native_gemm and s.native_decoder


def test_a_malformed_switch_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as info:
        executor_main.parse_args(IPC, {"CONTINUUM_FAULT_INJECT": "explode=now"})
    assert info.value.code == 2
    assert "CONTINUUM_FAULT_INJECT='explode=now': expected" in capsys.readouterr().err


def test_the_weight_format_flag_wins_over_the_variable(capsys):
    env = {"CONTINUUM_WEIGHT_FORMAT": "bf16"}
    assert executor_main.parse_args(IPC, env).switches.weight_format == "bf16"
    flagged = executor_main.parse_args([*IPC, "--weight-format", "fp32"], env)
    assert decoder.model_options(flagged.switches)["weight_format"] == "fp32"
    with pytest.raises(SystemExit) as info:
        executor_main.parse_args([*IPC, "--weight-format", "q4"], {})
    assert info.value.code == 2 and "--weight-format" in capsys.readouterr().err


def test_serve_passes_the_weight_format_to_its_executors(tmp_path):
    from continuum.cli import build_parser
    from continuum.serve.supervisor import Supervisor

    parser, _ = build_parser()
    for flags, passed in (([], None), (["--weight-format", "fp32"], "fp32")):
        args = parser.parse_args(["serve", "--ipc", f"ipc://{tmp_path}/e.sock", *flags])
        supervisor = Supervisor(args)
        for name in ("executor", "standby"):
            config = executor_main.parse_args(supervisor.configs.argv(name), {})
            assert config.weight_format == passed, name
        shutil.rmtree(supervisor.workdir)


def test_the_config_is_built_by_keyword_and_frozen():
    config = executor_main.parse_args(IPC, {})
    with pytest.raises(TypeError):
        executor_main.ExecutorConfig(None, "ipc:///x")  # by position: refused
    with pytest.raises(AttributeError):
        config.block_size = 1


def test_no_other_module_reads_the_environment():
    # __main__ hands os.environ to settings.py; tp_ranks.py hands it to the rank processes it
    # starts: neither reads a switch.
    # kernels/triton_attention.py asks whether triton itself runs interpreted: TRITON_INTERPRET
    # is triton's own switch (triton reads it at import), not one of ours.
    allowed = {"executor_svc/settings.py", "executor_svc/__main__.py", "executor_svc/tp_ranks.py",
               "kernels/triton_attention.py"}
    readers = []
    for path in sorted([*ROOT.glob("executor_svc/**/*.py"), *ROOT.glob("kernels/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in ("environ", "getenv") and rel not in allowed:
                readers.append(f"{rel}:{node.lineno}")
    assert readers == []


@pytest.mark.parametrize("env", [{"CONTINUUM_NATIVE_KERNELS": "0"},
                                 {"CONTINUUM_NATIVE_DECODER": "0"}], ids=["kernels", "decoder"])
def test_the_executor_build_passes_the_switches_down(model_dir, env):
    # What the variables did when each component read them itself: through parse_args and
    # build, the model, the KV cache and the attention backend all see them.
    config = executor_main.parse_args([*IPC, "--device", "cpu", "--warmup-tokens", "8",
                                       "--kv-cache-bytes", "64MiB"], env)
    runner, _ = executor_main.build(config, model_dir, "inc", device="cpu")
    model, library = runner.model, native.load()
    if "CONTINUUM_NATIVE_KERNELS" in env:
        assert model._native is runner.kv._native is runner.backend.native is None
    elif library is None:
        pytest.skip("no native kernels here: nothing to switch off")
    else:
        assert model._native is not None and runner.backend.native is not None
        assert model._decoder is None
        assert isinstance(model.lm_head, native.PackedWeight | QuantWeight)
