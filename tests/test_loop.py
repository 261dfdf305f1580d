"""The speculative loop on tiny random models: lossless at temperature 0, correct cache rollback, exact sampling."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import tiny_qwen2
from sampling_checks import first_tokens_follow_the_target
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.selection import FullPolicy, SelectorPolicy, VocabPolicy
from dynvocab.runtime.selection.frequency import PositionSelector, StaticSelector
from dynvocab.runtime.selection.context.hybrid import HybridConfig, HybridPolicy
from dynvocab.runtime.selection.context.window import MicroSpecConfig, MicroSpecPolicy

pytestmark = pytest.mark.transformers_api  # CI runs it again at transformers' lower bound

VOCAB = 96


class ChangingPolicy(VocabPolicy):
    """A random active set per step, redrawn every cycle: stresses the packed head's incremental updates."""

    name = "random"

    def __init__(self, seed: int, size: int = 40):
        self.gen = torch.Generator().manual_seed(seed)
        self.size = size
        self._redraw()

    def _redraw(self):
        self.sets = [torch.randperm(VOCAB, generator=self.gen)[: self.size] for _ in range(8)]

    def active_ids(self, step, hidden=None, token=None):
        return ActiveSet.of(self.sets[step])

    def observe(self, cycle):
        self._redraw()


def tiny_graph(seed: int):
    """A random successor graph over the tiny vocabulary, as CSR (GraphTable)."""
    from dynvocab.artifacts import GraphTable

    gen = torch.Generator().manual_seed(seed)
    degree = torch.randint(0, 5, (VOCAB,), generator=gen)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), degree.cumsum(0)])
    indices = torch.randint(0, VOCAB, (int(indptr[-1]),), generator=gen).int()
    return GraphTable(indptr, indices, torch.rand(indices.numel(), generator=gen))


def greedy_case(seed: int, max_prompt: int = 12, max_new_tokens: int = 30) -> tuple[list[int], DecodeConfig]:
    """A random prompt (1 to ``max_prompt`` - 1 tokens) and greedy settings for ``seed``: γ 1..5, runner-up leaves on
    odd seeds."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, max_prompt, (1,), generator=gen)),), generator=gen).tolist()
    return prompt, DecodeConfig(gamma=1 + seed % 5, max_new_tokens=max_new_tokens, branch_below=0.8 if seed % 2 else 0.0)


def make_policy(kind: str, seed: int) -> VocabPolicy:
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    return {
        "full": lambda: FullPolicy(VOCAB),
        "fr": lambda: SelectorPolicy(StaticSelector(ranking[:50])),
        "fr-pa": lambda: SelectorPolicy(PositionSelector(ranking, 70)),
        "random": lambda: ChangingPolicy(seed),
        "microspec": lambda: MicroSpecPolicy(MicroSpecConfig(window=24), VOCAB, "cpu"),
        "hybrid": lambda: HybridPolicy(HybridConfig(core_size=12, window=16), VOCAB, "cpu", ranking, graph=tiny_graph(seed)),
    }[kind]()


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return CausalLM(target), DraftModel(draft)


@pytest.mark.parametrize("kind", ["full", "fr", "fr-pa", "random", "microspec", "hybrid"])
@pytest.mark.parametrize("seed", range(6))
def test_greedy_is_lossless(pair, kind, seed):
    target, draft = pair
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
    gamma = 1 + seed % 5
    cfg = DecodeConfig(gamma=gamma, max_new_tokens=30)
    eos = {int(torch.randint(0, VOCAB, (1,), generator=gen))} if seed % 2 else set()
    ar = speculative_generate(target, prompt, cfg, eos)
    spec = speculative_generate(target, prompt, cfg, eos, draft, make_policy(kind, seed), timing=True)
    assert spec.token_ids == ar.token_ids
    assert spec.metrics.cycles <= ar.metrics.cycles
    assert spec.metrics.new_tokens == len(ar.token_ids)
    m = spec.metrics
    assert 0.0 <= m.head_s <= m.draft_s and m.policy_s <= m.wall_s
    assert m.policy_s > 0 or m.cycles == 0  # every cycle asks and tells the policy


@pytest.mark.parametrize("seed", range(3))
def test_greedy_is_lossless_with_per_step_retrieval(pair, seed):
    """The hybrid's third segment (draft-head HNSW neighbours + graph successors) changes every draft step."""
    from dynvocab.builders.hnsw import HnswConfig, build_index

    target, draft = pair
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    index = build_index(HnswConfig(m=8, ef_construction=32, ef_search=32), draft.weight.detach())
    policy = HybridPolicy(
        HybridConfig(core_size=8, window=12, step_neighbours=4, step_ef=8), VOCAB, "cpu", ranking,
        graph=tiny_graph(seed), draft_hnsw=index,
    )
    cfg = DecodeConfig(gamma=4, max_new_tokens=30)
    prompt = [5 + seed, 9, 2]
    ar = speculative_generate(target, prompt, cfg, set())
    spec = speculative_generate(target, prompt, cfg, set(), draft, policy)
    assert spec.token_ids == ar.token_ids


def test_draft_accepts_some_and_rejects_some(pair):
    """The tiny pair must exercise partial acceptance, or the lossless tests prove little."""
    target, draft = pair
    cfg = DecodeConfig(gamma=4, max_new_tokens=40)
    g = speculative_generate(target, [3, 1, 4, 1, 5], cfg, set(), draft, FullPolicy(draft.vocab_size))
    assert any(0 < n < cfg.gamma + 1 for n in g.cycle_lengths), g.cycle_lengths
    assert 1.0 < g.metrics.mean_accepted_length < cfg.gamma + 1


def test_kv_cache_after_rollback_matches_a_fresh_prefill(pair):
    target, draft = pair
    cfg = DecodeConfig(gamma=4, max_new_tokens=25)
    prompt = [7, 8, 9, 10]
    g = speculative_generate(target, prompt, cfg, set(), draft, make_policy("random", 3))
    seq = prompt + g.token_ids
    assert target.length == len(seq) - 1
    assert draft.length <= len(seq) - 1
    cached = target.logits(target.step(torch.tensor(seq[-1:])))
    fresh = target.model(torch.tensor([seq])).logits[0, -1:]
    torch.testing.assert_close(cached, fresh.float(), atol=1e-4, rtol=1e-4)
    dcached = draft.logits(draft.step(torch.tensor(seq[draft.length:])))[-1]
    dfresh = draft.model(torch.tensor([seq])).logits[0, -1]
    torch.testing.assert_close(dcached, dfresh.float(), atol=1e-4, rtol=1e-4)


def test_max_new_tokens_and_eos_stop_cleanly(pair):
    target, draft = pair
    prompt = [2, 4, 6]
    ar = speculative_generate(target, prompt, DecodeConfig(max_new_tokens=20), set())
    stop = ar.token_ids[7]
    first = ar.token_ids.index(stop)
    for gamma in (1, 3, 6):
        g = speculative_generate(
            target, prompt, DecodeConfig(gamma=gamma, max_new_tokens=20), {stop}, draft, FullPolicy(draft.vocab_size)
        )
        assert g.token_ids == ar.token_ids[: first + 1] and g.stopped_by_eos
        short = speculative_generate(
            target, prompt, DecodeConfig(gamma=gamma, max_new_tokens=5), set(), draft, FullPolicy(draft.vocab_size)
        )
        assert short.token_ids == ar.token_ids[:5]


def test_sampling_follows_the_target_distribution(pair):
    """First sampled token over many seeds, with q restricted to a subset, vs the target's p (chi-square)."""
    target, draft = pair
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:30]
    cfg = DecodeConfig(gamma=3, max_new_tokens=2, temperature=1.5)
    first_tokens_follow_the_target(target, [5, 9, 13], cfg, draft, lambda: SelectorPolicy(StaticSelector(ranking)))


def test_sampling_is_reproducible_with_a_seed(pair):
    target, draft = pair
    cfg = DecodeConfig(gamma=3, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=11)
    a = speculative_generate(target, [1, 2, 3], cfg, set(), draft, FullPolicy(draft.vocab_size))
    b = speculative_generate(target, [1, 2, 3], cfg, set(), draft, FullPolicy(draft.vocab_size))
    assert a.token_ids == b.token_ids


def test_padded_vocabularies_are_matched_on_shared_ids():
    """A draft with fewer head rows than the target: it proposes only shared ids; output still exact."""
    padded = tiny_qwen2(vocab=VOCAB + 8, seed=5)
    with torch.no_grad():
        padded.lm_head.weight[VOCAB:] = 0.0  # padding rows carry no token, as in real padded heads
    target = CausalLM(padded)
    draft = DraftModel(tiny_qwen2(vocab=VOCAB, seed=6), vocab_rows=VOCAB)
    cfg = DecodeConfig(gamma=3, max_new_tokens=20)
    ar = speculative_generate(target, [1, 2], cfg, set())
    assert max(ar.token_ids) < VOCAB
    g = speculative_generate(target, [1, 2], cfg, set(), draft, FullPolicy(draft.vocab_size))
    assert g.token_ids == ar.token_ids


def test_without_timing_the_loop_reads_no_clock_per_step(pair, monkeypatch):
    """Timing off: the loop reads the clock twice per generation (wall time), never per draft step or cycle."""
    import dynvocab.runtime.decoding.loop as loop
    import dynvocab.runtime.decoding.timing as timing

    target, draft = pair
    reads = []
    clock = time.perf_counter
    fake = type("T", (), {"perf_counter": staticmethod(lambda: reads.append(1) or clock())})
    monkeypatch.setattr(loop, "time", fake)
    monkeypatch.setattr(timing, "time", fake)
    g = speculative_generate(target, [1, 2, 3], DecodeConfig(gamma=4, max_new_tokens=30, stop_below=0), set(), draft,
                             FullPolicy(draft.vocab_size))
    assert g.metrics.draft_steps > g.metrics.cycles > 1
    assert len(reads) == 2 and g.metrics.wall_s > 0
    assert g.metrics.draft_s == g.metrics.head_s == g.metrics.verify_s == 0.0
    reads.clear()
    timed = speculative_generate(target, [1, 2, 3], DecodeConfig(gamma=4, max_new_tokens=30, stop_below=0), set(), draft,
                                 FullPolicy(draft.vocab_size), timing=True)
    assert timed.token_ids == g.token_ids and len(reads) > 2 * timed.metrics.draft_steps
    assert 0 < timed.metrics.head_s <= timed.metrics.draft_s


def test_cuda_section_timing_in_a_real_run_waits_once_per_cycle(pair, monkeypatch):
    """The loop times its sections as on a GPU (events that stand in for CUDA's, stamped with the CPU clock): it
    waits on an event once per cycle, never per step, calls no ``torch.cuda.synchronize``, and its sections fit in
    the wall time (head inside draft; prefill, draft and verify apart)."""
    import dynvocab.runtime.decoding.loop as loop
    from dynvocab.runtime.decoding.timing import SectionTimer

    target, draft = pair
    waits, syncs, events = [], [], []

    class Event:
        def __init__(self, enable_timing=False):
            events.append(self)

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            waits.append(self)

        def elapsed_time(self, end):
            return 1000.0 * (end.t - self.t)  # milliseconds

    class GpuTimer(SectionTimer):
        def __init__(self, device, enabled):
            super().__init__(torch.device("cuda"), enabled)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    monkeypatch.setattr(loop, "SectionTimer", GpuTimer)
    cfg = DecodeConfig(gamma=4, max_new_tokens=30, stop_below=0)
    g = speculative_generate(target, [1, 2, 3], cfg, set(), draft, make_policy("random", 1), timing=True)
    m = g.metrics
    assert m.draft_steps > m.cycles > 1
    assert len(waits) == m.cycles and syncs == []  # once per cycle (the prefill flushed with the first cycle)
    assert len(events) > 4 * m.draft_steps  # marks were events, recorded per step
    assert 0 < m.head_s <= m.draft_s and m.policy_s > 0 and m.verify_s > 0 and m.prefill_s > 0
    assert m.prefill_s + m.draft_s + m.verify_s <= m.wall_s


def test_microspec_prefill_reads_only_the_prompt_positions_its_window_can_hold(pair):
    """The window keeps ``window`` entries, which the top-K_pre of the last window / K_pre prompt positions fill:
    the loop computes the target's logits there only (not a [L, V] product over a long history), and the output
    is still the target's own."""
    target, draft = pair
    seen = []

    class Recording(MicroSpecPolicy):
        def prefill(self, prompt_ids, target_logits, target_hidden):
            seen.append((target_logits, target_hidden))
            super().prefill(prompt_ids, target_logits, target_hidden)

    policy = Recording(MicroSpecConfig(window=6, k_pre=3), VOCAB, "cpu")
    prompt, cfg = list(range(1, 11)), DecodeConfig(max_new_tokens=12)
    spec = speculative_generate(target, prompt, cfg, set(), draft, policy)
    logits, hidden = seen[0]
    assert policy.prefill_logit_rows == 2 and hidden.shape[0] == len(prompt) - 1 and logits.shape[0] == 2
    assert torch.equal(logits, target.logits(hidden[-2:]))
    assert spec.token_ids == speculative_generate(target, prompt, cfg, set()).token_ids


@pytest.mark.parametrize("positions", [0, 4])
def test_microspec_prefill_positions_bound_the_logits_and_zero_computes_none(pair, positions):
    """``--prefill-positions`` sets how many of the last prompt positions' top-K_pre join the window: that many
    rows of logits, none at 0 (the window then starts from the prompt's tokens, as the vLLM plugin's does); the
    output is the target's own either way."""
    target, draft = pair
    seen = []

    class Recording(MicroSpecPolicy):
        def prefill(self, prompt_ids, target_logits, target_hidden):
            super().prefill(prompt_ids, target_logits, target_hidden)
            seen.append((target_logits, set(self.window[0].tolist())))

    policy = Recording(MicroSpecConfig(window=60, k_pre=3, prefill_positions=positions), VOCAB, "cpu")
    prompt, cfg = list(range(1, 11)), DecodeConfig(max_new_tokens=12)
    spec = speculative_generate(target, prompt, cfg, set(), draft, policy)
    logits, window = seen[0]
    assert (logits is None and window == set(prompt)) if positions == 0 else logits.shape[0] == positions
    assert set(prompt) <= window
    assert spec.token_ids == speculative_generate(target, prompt, cfg, set()).token_ids


def test_hybrid_seeds_its_window_from_the_prompts_tokens_by_default_and_computes_no_prompt_logits(pair):
    """Hybrid's default ``prefill_positions`` is 0 (as the plugin's window): no [positions, V] product at prefill;
    ``--prefill-positions`` turns MicroSpec's seeding back on."""
    ranking = torch.arange(VOCAB)
    default = HybridPolicy(HybridConfig(core_size=12, window=16), VOCAB, "cpu", ranking)
    asked = HybridPolicy(HybridConfig(core_size=12, window=16, prefill_positions=3), VOCAB, "cpu", ranking)
    assert (default.prefill_logits, asked.prefill_logits, asked.prefill_logit_rows) == (False, True, 3)
