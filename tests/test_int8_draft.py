"""Int8 draft weights (fbgemm, per-row scales): the draft's linears, its head's rows gathered per active set, and an
EAGLE head's — the output is still the float32 target's own, token for token, with every policy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import tiny_qwen2
from test_eagle_loop import LAYERS, eagle1, eagle3
from test_loop import VOCAB, greedy_case, make_policy
from dynvocab.models.eagle import EAGLE1, LayerTap
from dynvocab.models.int8 import (
    INT8, INT8_GATHERED, REDUCE_RANGE, batched_int8_rows, int8_supported, quantize_rows)
from dynvocab.models.prepack import Int8Linear, quantize_linears
from dynvocab.models.rows import Int8Rows
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft, Eagle3Draft
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.heads.active_set import ActiveSet, Gathered, RowRanges
from dynvocab.runtime.heads.head import DraftHead
from dynvocab.runtime.selection import VocabPolicy
from dynvocab.runtime.session import ModelConfig, Session

pytestmark = [
    pytest.mark.skipif(not int8_supported("cpu"), reason="this torch has no fbgemm"),
    pytest.mark.usefixtures("one_thread"),
]


class RangesPolicy(VocabPolicy):
    """Random merged ranges of one fixed order per step (DynaSpec's shape of active set)."""

    name = "ranges"

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(VOCAB, generator=self.gen)

    def active_ids(self, step, hidden=None, token=None):
        cuts = sorted(torch.randperm(VOCAB, generator=self.gen)[:6].tolist())
        return ActiveSet.of(RowRanges(self.order, tuple(cuts[0::2]), tuple(cuts[1::2])))

    def observe(self, cycle):
        pass


def policy(kind: str, seed: int) -> VocabPolicy:
    return RangesPolicy(seed) if kind == "ranges" else make_policy(kind, seed)


def test_rows_quantize_per_row_and_gather_what_the_full_product_reads():
    torch.manual_seed(0)
    w, b = torch.randn(300, 64), torch.randn(300)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (300,)
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6
    rows = Int8Rows(w, b, keep_rows=True)
    x = torch.randn(3, 64)
    full = rows.linear(x)  # [3, 300]
    want = x @ w.T + b
    assert full.shape == (3, 300) and (full - want).abs().max() < 0.05 * want.abs().max()
    ids = torch.tensor([5, 7, 299, 0])
    for int8 in (False, True):
        rows.gathers_int8 = int8
        r, rs, rb = rows.gather(ids)
        if int8:
            assert torch.equal(r, q[ids]) and torch.equal(rs, scale[ids].bfloat16())
        else:
            assert torch.equal(r, q[ids].float() * scale[ids, None]) and rs is None
        assert torch.equal(rb, b[ids])
        got = rows.matmul(x, r, rs, rb)  # [3, 4] float32
        assert got.dtype == torch.float32
        assert (got - full[:, ids]).abs().max() < 0.05 * want.abs().max()  # activation rounding only
    assert torch.equal(Int8Rows(w, b).q, q)  # unpacked from fbgemm's copy when not kept
    assert rows.first(200).linear(x).shape == (3, 200)


@pytest.mark.skipif(not INT8_GATHERED, reason="aten._weight_int8pack_mm runs where the CPU has AVX-512 BF16")
def test_batched_int8_rows_give_each_row_the_bits_it_gets_alone():
    """``lowrank``'s scorer over a batch (the vLLM plugin's) and over one row (dynvocab's loop): the same bits."""
    torch.manual_seed(0)
    for width in (16, 64, 256):
        w, b = torch.randn(1003, width), torch.randn(1003)
        linear = batched_int8_rows(w, b)
        x = torch.randn(5, width)
        batch = linear(x)
        assert batch.dtype == torch.float32 and batch.shape == (5, 1003)
        assert all(torch.equal(batch[i], linear(x[i : i + 1])[0]) for i in range(5))
        want = x @ w.T + b
        assert (batch - want).abs().max() < 0.05 * want.abs().max()
    for width in (8, 12, 24):  # widths the kernel gets wrong or crashes on: not offered
        assert batched_int8_rows(torch.randn(10, width), None) is None


def test_a_ranking_prefix_is_packed_after_repeated_use_and_kept():
    torch.manual_seed(1)
    rows = Int8Rows(torch.randn(200, 32), keep_rows=True)
    rows.gathers_int8 = False  # the path of CPUs that multiply gathered rows as float32
    order, x = torch.randperm(200), torch.randn(1, 32)
    for _ in range(Int8Rows.PACK_AFTER - 1):
        assert rows.prefix_linear(x, order, 50) is None  # a set that does not last is never packed
    got = rows.prefix_linear(x, order, 50)
    assert torch.equal(got, rows.linear(x)[:, order[:50]])  # the same int8 rows, the same fbgemm product
    assert rows.prefix_linear(x, order, 50) is not None and len(rows._prefix_packs) == 1
    again = order.clone()  # the next prompt's policy: the same ranking in a new tensor uses the kept pack at once
    assert torch.equal(rows.prefix_linear(x, again, 50), got) and len(rows._prefix_packs) == 1
    other = torch.cat([order[1:50], order[:1], order[50:]])  # other ids at those positions: not the kept pack
    assert rows.prefix_linear(x, other, 50) is None


def test_short_sequences_count_on_toward_a_prefix_pack():
    """Each prompt's policy holds its ranking in a new tensor; prompts of fewer than PACK_AFTER draft steps still
    reach a pack together (counted per ids, not per tensor)."""
    rows = Int8Rows(torch.randn(200, 32), keep_rows=True)
    rows.gathers_int8 = False
    order, x = torch.randperm(200), torch.randn(1, 32)
    half = Int8Rows.PACK_AFTER // 2
    for _ in range(2):  # two short "prompts", a new tensor each
        ranking = order.clone()
        results = [rows.prefix_linear(x, ranking, 50) for _ in range(half)]
    assert all(r is None for r in results[:-1]) and results[-1] is not None
    assert len(rows._prefix_packs) == 1 and len(rows._prefix_uses) == 0


def test_int8_linear_keeps_float_for_gradients_and_casts_back():
    torch.manual_seed(2)
    linear = nn.Linear(32, 48)
    fast = Int8Linear(linear)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        assert fast(x).shape == (2, 5, 48) and fast(x.bfloat16()).dtype == torch.bfloat16
    xg = torch.randn(1, 32, requires_grad=True)
    assert torch.equal(fast(xg), linear(xg))


@pytest.fixture(scope="module")
def int8_pair(tiny_pair):
    target, draft = tiny_pair
    draft = copy.deepcopy(draft)
    assert quantize_linears(draft, draft.get_output_embeddings()) > 0
    return CausalLM(target), DraftModel(draft)


@pytest.mark.parametrize(
    "kind,pack_after",
    [("full", 32), ("fr", 1), ("fr", 32), ("fr-pa", 1), ("random", 1), ("ranges", 32), ("microspec", 32),
     ("hybrid", 1)],
)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("gathers_int8", [False, True], ids=["float32-gathers", "int8-gathers"])
def test_greedy_with_an_int8_draft_is_the_float32_target_own(
    int8_pair, kind, seed, pack_after, gathers_int8, monkeypatch
):
    """``pack_after`` 1: every prefix of a ranking runs from its own fbgemm pack; 32: from the gathered rows.
    ``gathers_int8``: gathered rows kept as int8 (AVX-512 BF16 CPUs) or dequantized to float32 (elsewhere)."""
    monkeypatch.setattr(Int8Rows, "PACK_AFTER", pack_after)
    monkeypatch.setattr(Int8Rows, "gathers_int8", gathers_int8)
    target, draft = int8_pair
    assert isinstance(draft.step_rows[0], Int8Rows)
    prompt, cfg = greedy_case(seed)
    ar = speculative_generate(target, prompt, cfg, set())
    spec = speculative_generate(target, prompt, cfg, set(), draft, policy(kind, seed))
    assert spec.token_ids == ar.token_ids
    assert spec.metrics.new_tokens == len(ar.token_ids)


@pytest.mark.parametrize("gathers_int8", [False, True], ids=["float32-gathers", "int8-gathers"])
def test_full_and_dynamic_heads_read_the_same_int8_rows(int8_pair, gathers_int8, monkeypatch):
    monkeypatch.setattr(Int8Rows, "gathers_int8", gathers_int8)
    _, draft = int8_pair
    head = DraftHead(*draft.step_rows)
    h = torch.randn(1, draft.hidden_size)
    full, _ = head.logits(h, ActiveSet.full(draft.vocab_size))
    ids = torch.tensor([3, 50, 7])
    part, cols = head.logits(h, ActiveSet.of(ids))
    assert torch.equal(cols, ids) and (part - full[:, ids]).abs().max() < 0.05 * full.abs().max()
    order = torch.randperm(draft.vocab_size)
    ranges = RowRanges(order, (0, 40), (10, 45))  # two ranges: gathered by position; one range: a slice
    for r in (ranges, RowRanges(order, (5,), (30,))):
        part, cols = head.logits(h, ActiveSet.of(r))
        assert torch.equal(cols, r.ids) and (part - full[:, r.ids]).abs().max() < 0.05 * full.abs().max()
    if gathers_int8:
        assert head.segments[0].rows.dtype == torch.int8
    fresh = Gathered(torch.tensor([9, 2, 40]))  # a selector's ids, gathered at each step
    part, cols = head.logits(h, ActiveSet.of(fresh, torch.tensor([5])))
    assert torch.equal(cols, torch.tensor([9, 2, 40, 5]))
    assert (part - full[:, cols]).abs().max() < 0.05 * full.abs().max()


@pytest.mark.parametrize("kind", ["full", "fr", "ranges"])
@pytest.mark.parametrize("eagle", ["eagle1", "eagle3"])
def test_greedy_with_an_int8_eagle_head_is_lossless(kind, eagle):
    target_model = tiny_qwen2(layers=LAYERS, seed=0)
    target = CausalLM(target_model)
    model = eagle1(target_model) if eagle == "eagle1" else eagle3(target_model)
    quantize_linears(model, getattr(model, "lm_head", None))
    assert isinstance(model.fc, Int8Linear)
    tap = None if eagle == "eagle1" else LayerTap(target_model, model.config.target_layers(LAYERS))
    draft = Eagle1Draft(model, target, INT8) if tap is None else Eagle3Draft(model, target, tap)
    assert isinstance(draft.step_rows[0], Int8Rows)
    for seed in range(2):
        prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        cfg = DecodeConfig(gamma=4, max_new_tokens=24, branch_below=0.8)
        ar = speculative_generate(target, prompt, cfg, set())
        assert speculative_generate(target, prompt, cfg, set(), draft, policy(kind, seed)).token_ids == ar.token_ids
    if tap is not None:
        tap.remove()


def test_session_defaults_to_int8_for_float32_on_cpu_and_reports_bytes(tiny_dirs):
    s = Session(ModelConfig(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", "float32"))
    assert s.draft_weights == INT8
    body = [m for m in s.draft.body.modules() if isinstance(m, nn.Linear)]
    assert body and all(isinstance(m, Int8Linear) for m in body)
    assert isinstance(s.draft.step_rows[0], Int8Rows)
    b = s.draft_bytes
    assert b["weights"] > 0 and 0 < b["prepared"] < b["weights"] and b["total"] == b["weights"] + b["prepared"]
    decode = DecodeConfig(gamma=4, max_new_tokens=24)
    for strategy in ("full", "microspec"):
        assert s.generate([5, 9, 13], strategy, decode).token_ids == s.generate([5, 9, 13], "ar", decode).token_ids


def test_session_defaults_to_int8_for_bfloat16_on_cpu_too(tiny_dirs):
    """Measured on an AVX-512 BF16 CPU: int8 steps beat a bfloat16 model's (docs/bench.md), so int8 is the CPU
    default whatever the dtype; the output is still the target's own wherever it was verified."""
    s = Session(ModelConfig(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", "bfloat16"))
    assert s.draft_weights == INT8 and isinstance(s.draft.step_rows[0], Int8Rows)
    decode = DecodeConfig(gamma=4, max_new_tokens=16, branch_below=0.0)
    out = s.generate([5, 9, 13], "full", decode)
    assert len(out.token_ids) == 16 and out.metrics.mean_accepted_length >= 1


@pytest.mark.skipif(REDUCE_RANGE, reason="no AVX-512 VNNI here: 7-bit activations are the default")
def test_activations_keep_all_8_bits_where_vnni_sums_in_int32(monkeypatch):
    """On a VNNI CPU the default product quantizes activations to 8 bits, not quantize_dynamic's 7: half the
    rounding error (the draft's agreement with the target fell 1.2 points with 7 bits, docs/bench.md)."""
    import dynvocab.models.int8 as kernels

    gen = torch.Generator().manual_seed(0)
    rows = Int8Rows(torch.randn(256, 128, generator=gen))
    x = torch.randn(4, 128, generator=gen)
    x[:, 7] *= 40  # one outlier channel, as Qwen2's activations have
    ref = x @ (rows.q.float() * rows.scale[:, None]).T
    default = (rows.linear(x) - ref).abs().mean()
    monkeypatch.setattr(kernels, "REDUCE_RANGE", True)
    seven_bits = (rows.linear(x) - ref).abs().mean()
    assert default < 0.7 * seven_bits


@pytest.mark.parametrize("gathers_int8", [False, True], ids=["float32-gathers", "int8-gathers"])
def test_a_static_ranking_is_packed_when_the_policy_is_built(int8_pair, gathers_int8, monkeypatch, tmp_path):
    """fr's ranking is gathered (and, where gathered rows are float32, its prefix packed for fbgemm) when the policy
    is built: the first draft step copies no row and runs from the pack, not after PACK_AFTER calls."""
    from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, make_policy as build_policy

    monkeypatch.setattr(Int8Rows, "gathers_int8", gathers_int8)
    target, draft = int8_pair
    rows = draft.head_rows
    rows._prefix_packs.clear(), rows._prefix_uses.clear(), rows.ordered._kept.clear()
    path = tmp_path / "map.pt"
    torch.save(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:40].tolist(), path)
    ctx = PolicyContext(draft.vocab_size, set(), "cpu", None, draft.info, target)
    policy = build_policy("fr", StrategyOptions(token_map=str(path)), ctx)
    assert len(rows.ordered._kept) == 1 and len(rows._prefix_packs) == (0 if gathers_int8 else 1)
    draft.reset()
    h = torch.randn(1, draft.hidden_size)
    part, cols = draft.head_logits(h, policy.active_ids(0))
    assert draft.rows_copied == 0 and torch.equal(cols, policy.selector.ids) and not rows._prefix_uses  # no counting: packed
    full, _ = draft.head_logits(h, ActiveSet.full(draft.vocab_size))
    assert (part - full[:, cols]).abs().max() < 0.05 * full.abs().max()
    again = build_policy("fr", StrategyOptions(token_map=str(path)), ctx)  # the next prompt's: a new tensor, kept rows
    assert again.selector.ranking is not policy.selector.ranking and len(rows.ordered._kept) == 1
