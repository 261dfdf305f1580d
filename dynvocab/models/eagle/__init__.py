"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3) built from transformers' own decoder layers, and their checkpoints.

An EAGLE head is one decoder layer that reads the target's features and the next token's embedding:

- **EAGLE-1/2** (SafeAILab/EAGLE ``eagle/model/cnets1.py``; SGLang ``python/sglang/srt/models/llama_eagle.py`` and
  ``qwen2_eagle.py``): ``fc`` [d, 2d] (bias per the config's ``bias``, default true) over
  ``cat(embedding, feature)`` — embedding first —, then ``layers.0`` without its ``input_layernorm``; no norm and
  no head of its own: its output is a feature like the target's final *normed* hidden state, so the target's LM
  head applies to it directly, and it feeds back as the next step's feature. A Qwen2 layer keeps its q/k/v biases.
- **EAGLE-3** (SafeAILab/EAGLE ``eagle/model/cnets.py``; SGLang ``models/llama_eagle3.py``; vLLM
  ``vllm/model_executor/models/llama_eagle3.py``): ``fc`` [d, 3·d_target] (bias per ``bias``, default false) over
  the target's hidden states *entering* three layers (low, mid, high), then ``midlayer`` whose attention reads
  ``cat(input_layernorm(embedding), hidden_norm(h))`` (q/k/v are 2d wide), then ``norm`` and ``lm_head``
  [draft_vocab, d]. ``d2t`` is an OFFSET table (SGLang: ``hot_token_id = d2t + arange``): target id = draft id +
  d2t[draft id]; ``t2d`` is a bool mask over the target vocabulary. From the second step the layer's *pre-norm*
  output feeds back without ``fc`` (SGLang: ``hidden_states.shape[-1] != embeds.shape[-1]`` decides).
- The vllm-project/speculators form of EAGLE-3 (speculators ``models/eagle3/{config,core,model_definitions}.py``;
  vLLM ``transformers_utils/configs/speculators/{base,algos}.py``): ``config.json`` with
  ``speculators_model_type: "eagle3"`` and a nested ``transformer_layer_config`` (a llama or qwen3 layer);
  weights ``layers.0.*`` instead of ``midlayer.*``; ``norm_before_residual`` (vLLM's default when absent: true);
  speculators' options ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` and a sliding window on the layer, run as
  its ``core.py`` runs them; a full-vocabulary head has no ``d2t``/``t2d``.

Which target layers EAGLE-3 reads — LOUD, because the layouts differ by one. With no ids in the config every
engine takes the hidden states entering layers ``(2, L // 2, L - 3)`` (vLLM ``get_eagle3_aux_hidden_state_layers``;
SGLang ``set_eagle3_layers_to_capture(None)``; EAGLE's ``modeling_llama_kv.py`` appends before running those
layers). Explicit ``eagle_aux_hidden_state_layer_ids`` mean one thing per layout: in the EAGLE/SGLang layout
(``eagle3``) id i is the OUTPUT of layer i (SGLang adds 1: "for the ith layer, it takes the output of the (i-1)th
layer"); in the speculators layout (speculators, vLLM) it is ``hidden_states[i]``, the INPUT of layer i.
:class:`EagleConfig` keeps them layout-free as ``aux_hidden_states`` (hidden-state indices); each layout converts
on reading and writing (readers cited in :mod:`.layouts.eagle3` and :mod:`.layouts.speculators`), so a head
converted between layouts keeps its layers.
:meth:`EagleConfig.target_layers` resolves the defaults; :class:`LayerTap` taps them.

Modules: :mod:`.config` (the head's shape, the target layers it reads, the check against a target),
:mod:`.modules` (the ``nn.Module``), :mod:`.layouts` (the registry of checkpoint layouts, one module per published
layout), :mod:`.checkpoint` (reading and writing a checkpoint in any registered layout),
:mod:`.tap` (the target-side hooks that produce EAGLE-3's features). The initialisations from a target are
builders' work: :mod:`dynvocab.builders.draft.init`.
"""

from dynvocab.models.eagle.checkpoint import (
    checkpoint_of_kind,
    config_from_json,
    config_to_json,
    detect_kind,
    eagle_checkpoint,
    load_eagle,
    read_config,
    read_layout,
    save_eagle,
    state_for_layout,
)
from dynvocab.models.eagle.config import EAGLE1, EAGLE3, KINDS, EagleConfig, check_target, config_like
from dynvocab.models.eagle.layouts import Layout, layout_names, lookup_layout
from dynvocab.models.eagle.modules import Eagle1Model, Eagle3Model, EagleModel
from dynvocab.models.eagle.tap import LayerTap

__all__ = [
    "EAGLE1",
    "EAGLE3",
    "KINDS",
    "Layout",
    "LayerTap",
    "checkpoint_of_kind",
    "EagleConfig",
    "Eagle1Model",
    "Eagle3Model",
    "EagleModel",
    "check_target",
    "config_from_json",
    "config_like",
    "config_to_json",
    "detect_kind",
    "eagle_checkpoint",
    "layout_names",
    "load_eagle",
    "lookup_layout",
    "read_config",
    "read_layout",
    "save_eagle",
    "state_for_layout",
]
