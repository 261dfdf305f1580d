"""Hooks on a target that keep the hidden states EAGLE-3 reads (the layers: :meth:`EagleConfig.target_layers`)."""

from __future__ import annotations

import torch


class LayerTap:
    """Forward pre-hooks on a target that keep the hidden states entering some of its layers at its last pass.

    Index ``L`` (the layer count) taps the final norm's input: the last layer's output. Only references are
    kept (the layers do not write their inputs in place), so a tap costs no copy.
    """

    def __init__(self, target_model, entering: tuple[int, ...]):
        body = getattr(target_model, target_model.base_model_prefix)
        layers = list(body.layers)
        self.entering = entering
        self.seen: dict[int, torch.Tensor] = {}
        self.handles = []
        for i in sorted(set(entering)):
            module = layers[i] if i < len(layers) else body.norm
            self.handles.append(module.register_forward_pre_hook(self._keeper(i), with_kwargs=True))

    def _keeper(self, i: int):
        def keep(module, args, kwargs):
            self.seen[i] = args[0] if args else kwargs["hidden_states"]

        return keep

    def features(self) -> torch.Tensor:
        """The tapped hidden states of the last pass, concatenated low to high: [n, len(entering) * d]."""
        return torch.cat([self.seen[i][0] for i in self.entering], dim=-1)

    def batch_features(self) -> torch.Tensor:
        """As :meth:`features`, for every row of a batched pass: [B, n, len(entering) * d]."""
        return torch.cat([self.seen[i] for i in self.entering], dim=-1)

    def remove(self) -> None:
        """Take the hooks off the target."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
