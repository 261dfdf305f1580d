"""The router's training data: one teacher-forced pass of the draft over each document (DynaSpec A.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from dynvocab.errors import DynvocabError
from dynvocab.progress import Advance


@dataclass
class RouterData:
    """Teacher-forced draft predictions: one row per document position."""

    hidden: torch.Tensor  # [N, d] bfloat16, the draft's final hidden state h_i
    tokens: torch.Tensor  # [N] int64, the token x_i fed at position i
    top: torch.Tensor  # [N, L] int64, the draft's top-L next-token ids at position i (descending)
    doc: torch.Tensor  # [N] int64, document index of each row

    def subset(self, mask: torch.Tensor) -> "RouterData":
        return RouterData(self.hidden[mask], self.tokens[mask], self.top[mask], self.doc[mask])

    @property
    def rows(self) -> int:
        return int(self.tokens.numel())



@torch.inference_mode()
def collect(
    model, documents: Iterable[list[int]], top_l: int, vocab_rows: int, advance: Advance = lambda n: None,
    chunk: int = 128,
) -> RouterData:
    """Run the draft ``model`` over each document (teacher forcing) and keep (h_i, x_i, top-L_i) per position.

    Only the first ``vocab_rows`` head rows count (ids the draft may propose at run time).
    """
    body = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    weight = head.weight[:vocab_rows]  # [V, d]
    bias = None if getattr(head, "bias", None) is None else head.bias[:vocab_rows]
    device = weight.device
    hidden, tokens, tops, docs = [], [], [], []
    for i, ids in enumerate(documents):
        x = torch.tensor(ids, dtype=torch.long, device=device)
        h = body(input_ids=x.view(1, -1)).last_hidden_state[0]  # [T, d]
        for s in range(0, h.shape[0], chunk):
            logits = F.linear(h[s : s + chunk], weight, bias)  # [c, V]
            tops.append(logits.topk(top_l, dim=-1).indices.cpu())  # [c, L]
        hidden.append(h.to(torch.bfloat16).cpu())
        tokens.append(x.cpu())
        docs.append(torch.full((x.numel(),), i, dtype=torch.long))
        advance(1)
    if not tokens:
        raise DynvocabError("the corpus gave no documents for the router; check --corpus and --max-docs")
    return RouterData(torch.cat(hidden), torch.cat(tokens), torch.cat(tops), torch.cat(docs))


def split(data: RouterData, holdout_every: int) -> tuple[RouterData, RouterData]:
    """(train, held-out): every ``holdout_every``-th document is held out."""
    held = data.doc % holdout_every == holdout_every - 1
    if not held.any() or held.all():
        docs = int(data.doc.max()) + 1
        raise DynvocabError(
            f"{docs} document(s) are too few to hold every {holdout_every}th out; "
            f"raise --max-docs to at least {holdout_every}"
        )
    return data.subset(~held), data.subset(held)
