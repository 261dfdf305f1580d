"""Stages ``router``, ``lowrank``, ``centroids``: train vocabulary selectors on the draft's own predictions.

The first is DynaSpec's meta-classifier over the bundle's clusters, the other two the field's learned
fixed-size candidate selectors (:mod:`dynvocab.artifacts.selectors`); one data pass serves all three.

Data (DynaSpec appendix A.2, with teacher forcing instead of running EAGLE-2): one forward pass of the draft
over each training document gives, at every position i, the final hidden state h_i and the draft's top-L
tokens over its full vocabulary. A training pair is ``(h_i, E(x_i)) -> y`` with y_m = 1 iff cluster m holds
one of those top-L tokens (§4.2); the router is trained with binary cross-entropy over all M clusters.

Held-out documents (every ``holdout_every``-th of the training split; the ShareGPT evaluation split is never
read) measure the recall the runtime will see: the share of positive clusters inside the router's top-k, and
how often the draft's own top-1 token falls inside the top-k clusters' union, with the mean union size.

- :mod:`.data`: the draft's teacher-forced pass (:class:`RouterData`) and the held-out split.
- :mod:`.fit`: labels, the loss and the training loop (:class:`RouterConfig`).
- :mod:`.recall`: the held-out recall report at each cluster budget.
- :mod:`.selectors`: the candidate selectors trained on the same data (``lowrank``, ``centroids``): SVD and
  balanced-block initialisation, their loss, and their held-out recall of the draft's top-1 and top-2.
- :mod:`.stage`: the command that ties them together and rewrites the bundle.

Documents are encoded by :func:`dynvocab.builders.corpus.encode_documents`, as train-draft encodes them.
"""

from dynvocab.builders.router.fit import RouterConfig
from dynvocab.builders.router.selectors import SelectorConfig
from dynvocab.builders.router.stage import SELECTORS, RouterReport, TrainRouterConfig, train_router

__all__ = ["SELECTORS", "RouterConfig", "RouterReport", "SelectorConfig", "TrainRouterConfig", "train_router"]
