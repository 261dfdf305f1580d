"""DynaSpec's router (meta-classifier): the MLP both the trainer and the runtime policy run, and its bundle stage.

The router scores the M token clusters of the ``clusters`` stage from the draft's context (DynaSpec §4.2):
input ``concat[h, E(x)]`` (the draft's final hidden state at a step and the input embedding of the token it
was fed), one hidden layer, M logits. Inputs are standardised with per-feature statistics of the training
data, stored with the weights, so hidden states and embeddings of very different scales weigh alike.

Stage ``router``: tensors ``in_mean``, ``in_std`` [D], ``w1`` [H, D], ``b1`` [H], ``w2`` [M, H], ``b2`` [M]
(float32, D = d_hidden + d_embed); the config holds the shapes, the training settings, and the checksum of the
``clusters.assign`` tensor it was trained for, so a router is never used with clusters it has not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynvocab.artifacts.bundle import Bundle
from dynvocab.errors import DynvocabError

STAGE = "router"
# DynaSpec gives no k_max for M = 1024. On the demo draft (152k ids, 1024 clusters) a trained router's top-288
# clusters hold ~47k ids; under the position-aware schedule at γ = 4 (288, 288, 48, 36 clusters) the mean
# shortlist is ~27.5k ids, the paper's Table 1 mean (27,344) — with ~97% of the draft's top-1 tokens inside.
DEFAULT_K_MAX = 288
DEFAULT_TOP_L = 10  # positives = the draft's top-L tokens; L = EAGLE-2's per-step top-k, which A.2 collects


class RouterMLP(nn.Module):
    """``r_θ(h, E(x))``: standardise ``concat[h, e]``, one ReLU hidden layer, M cluster logits."""

    def __init__(self, hidden_dim: int, embed_dim: int, width: int, num_clusters: int):
        super().__init__()
        d = hidden_dim + embed_dim
        self.hidden_dim, self.embed_dim = hidden_dim, embed_dim
        self.register_buffer("in_mean", torch.zeros(d))  # [D]
        self.register_buffer("in_std", torch.ones(d))  # [D]
        self.fc1 = nn.Linear(d, width)
        self.fc2 = nn.Linear(width, num_clusters)

    @property
    def num_clusters(self) -> int:
        return self.fc2.out_features

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Cluster logits [n, M] for hidden states ``h`` [n, d_h] and token embeddings ``e`` [n, d_e]."""
        x = (torch.cat([h, e], dim=-1).float() - self.in_mean) / self.in_std  # [n, D]
        return self.fc2(F.relu(self.fc1(x)))

    def set_input_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Standardisation statistics of the training inputs (std floored so constant features stay finite)."""
        self.in_mean.copy_(mean)
        self.in_std.copy_(std.clamp_min(1e-4))


@dataclass(frozen=True)
class RouterTable:
    """The ``router`` stage: the MLP's tensors and the config they were trained with."""

    tensors: dict[str, torch.Tensor]
    config: dict  # hidden_dim, embed_dim, width, num_clusters, top_l, clusters_sha256, training settings

    @classmethod
    def from_module(cls, module: RouterMLP, config: dict) -> "RouterTable":
        """Snapshot a trained module (float32, CPU)."""
        sd = module.state_dict()
        tensors = {
            "in_mean": sd["in_mean"], "in_std": sd["in_std"],
            "w1": sd["fc1.weight"], "b1": sd["fc1.bias"], "w2": sd["fc2.weight"], "b2": sd["fc2.bias"],
        }
        shapes = {"hidden_dim": module.hidden_dim, "embed_dim": module.embed_dim,
                  "width": module.fc1.out_features, "num_clusters": module.num_clusters}
        return cls({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, {**config, **shapes})

    def module(self, device: torch.device | str = "cpu") -> RouterMLP:
        """A float32 :class:`RouterMLP` in eval mode holding these weights, whatever torch's default dtype (an engine
        builds its draft, and with it this module, under the model's: vLLM's bfloat16 made it a bfloat16 router)."""
        c = self.config
        m = RouterMLP(int(c["hidden_dim"]), int(c["embed_dim"]), int(c["width"]), int(c["num_clusters"]))
        t = self.tensors
        m.load_state_dict({"in_mean": t["in_mean"], "in_std": t["in_std"], "fc1.weight": t["w1"],
                           "fc1.bias": t["b1"], "fc2.weight": t["w2"], "fc2.bias": t["b2"]})
        return m.to(device=device, dtype=torch.float32).eval()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors for the bundle, keyed without the stage prefix."""
        return dict(self.tensors)

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> "RouterTable":
        """Read the ``router`` stage and check its tensors agree with its config."""
        tensors, config = bundle.stage_tensors(STAGE), bundle.config(STAGE)
        try:
            d = int(config["hidden_dim"]) + int(config["embed_dim"])
            width, m = int(config["width"]), int(config["num_clusters"])
            expected = {"in_mean": (d,), "in_std": (d,), "w1": (width, d), "b1": (width,), "w2": (m, width), "b2": (m,)}
            ok = all(tuple(tensors[k].shape) == s for k, s in expected.items())
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise DynvocabError(
                f"bundle {bundle.path} has a malformed router stage; "
                f"retrain it with `dynvocab train-router --bundle {bundle.path}`"
            )
        return cls(tensors, config)


def clusters_checksum(bundle: Bundle) -> str:
    """SHA-256 of the bundle's ``clusters.assign`` tensor: which clustering a router belongs to."""
    bundle.require("clusters")
    return bundle.metadata["checksums"]["clusters.assign"]
