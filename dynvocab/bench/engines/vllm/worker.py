"""The bench's hold on the draft head inside a vLLM worker: :class:`HeadBench`, the worker extension
(``LLM(worker_extension_cls=EXTENSION)``) whose methods the driver (:mod:`dynvocab.bench.engines.vllm.driver`) calls
by name through ``LLM.collective_rpc``, and :class:`HeadSwitch`, which switches a draft model's head entry points
between the plugin's selected head and vLLM's own full head and times them. Imports no vLLM module itself: it runs
where vLLM has already loaded the draft."""

from __future__ import annotations

import dataclasses
import time

HEAD_CALLS = ("compute_logits", "get_top_tokens")  # the draft's head entry points the bench switches and times
EXTENSION = "dynvocab.bench.engines.vllm.worker.HeadBench"  # LLM(worker_extension_cls=...)


def _drafter_model(worker):
    """The draft model inside ``worker``'s runner (vLLM's ``model_runner.drafter.model``)."""
    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None:
        raise RuntimeError("the engine has no drafter: the row has no speculative_config")
    return drafter.model


def full_head(model) -> dict:
    """vLLM's own head entry points of the draft ``model`` (name -> callable): for the plugin's classes, those of
    the vLLM class they extend (greedy: vLLM's local-argmax reduction, or the argmax of the mapped logits for an
    EAGLE-3 head with a draft vocabulary, ``draft_id_to_target_id``); for vLLM's own classes, theirs."""
    from dynvocab.serving.vllm.models import SelectedHeadMixin

    if not isinstance(model, SelectedHeadMixin):
        return {name: getattr(model, name) for name in HEAD_CALLS if hasattr(model, name)}
    base = super(SelectedHeadMixin, model)

    def top_tokens(hidden_states):
        if getattr(model, "draft_id_to_target_id", None) is not None:
            return base.compute_logits(hidden_states).argmax(dim=-1)
        return model.logits_processor.get_top_tokens(model.lm_head, hidden_states)

    return {"compute_logits": base.compute_logits, "get_top_tokens": top_tokens}


def _device_sync(tensor):
    """What waits for ``tensor``'s device to finish its queued work: nothing on a CPU (its calls are synchronous),
    the device's ``synchronize`` elsewhere, so a timer around a call measures the call, not its launch."""
    import torch

    kind = tensor.device.type
    if kind == "cpu":
        return lambda: None
    module = getattr(torch, kind, None)
    return module.synchronize if module is not None and hasattr(module, "synchronize") else (lambda: None)


class HeadSwitch:
    """The bench's hold on one draft model: which head its entry points run (the plugin's selected head, or vLLM's
    own full head) and, when on, the time their calls and the selector's take. Installed once per draft, as the
    model's own ``compute_logits`` / ``get_top_tokens``."""

    def __init__(self, model):
        self.model = model
        self.selected = {name: getattr(model, name) for name in HEAD_CALLS if hasattr(model, name)}
        self.full = full_head(model)
        self.plugin = hasattr(model, "dynvocab")  # one of the plugin's classes (it holds a DraftHeadPolicy)
        self.strategy: str | None = None  # None: vLLM's own full head
        self.policies: dict[tuple, object] = {}  # (selector spec, bundle) -> its head policy, built once
        self._sync = None  # waits for the draft's device (found at the first timed call)
        self.log: list | None = None  # when kept: each head call's draft context and greedy tokens
        self._missed = 0  # the draft's rows without their request's context, at the last read
        self.reset(False)
        for name in self.selected:
            setattr(model, name, self._entry(name))

    def timed(self, fn, *args):
        """``(fn(*args), seconds)``, the device waited for before and after (:func:`_device_sync`, found once)."""
        if self._sync is None:
            self._sync = _device_sync(args[0])
        self._sync()
        start = time.perf_counter()
        out = fn(*args)
        self._sync()
        return out, time.perf_counter() - start

    def reset(self, on: bool) -> None:
        """Zero the timer (and the head's count of ids it multiplied); time the calls from now on when ``on``."""
        self.on, self.head_s, self.selector_s, self.calls, self.rows = on, 0.0, 0.0, 0, 0
        if self.plugin:
            self.model.dynvocab.head.scored = [0, 0]

    def _entry(self, name: str):
        def call(hidden_states):
            head = (self.full if self.strategy is None else self.selected)[name]
            if self.log is not None and name == "get_top_tokens":
                out = head(hidden_states)
                self.log.append({"top": out.tolist()})
                return out
            if not self.on:
                return head(hidden_states)
            out, seconds = self.timed(head, hidden_states)
            self.head_s += seconds
            self.calls += 1
            self.rows += int(hidden_states.shape[0])
            return out

        return call

    def switch(self, strategy: str | None, budget: int | None, bundle: str | None, timed: bool,
               ngram: list[int] | None = None) -> None:
        """Run ``strategy``'s selector from ``bundle`` (None: vLLM's own full head), a ``+ngram`` lookup over
        suffixes of ``ngram`` = [longest, shortest] tokens (None: the defaults); time the calls when ``timed``."""
        if strategy is not None:
            if not self.plugin:
                raise RuntimeError("the draft is not one of the plugin's classes; export it with --format vllm")
            from dynvocab.runtime.batched import SelectorSpec

            spec = SelectorSpec(strategy, budget, *(ngram or ()))
            key = (spec, bundle)
            if key not in self.policies:
                self.policies[key] = self._build(spec, bundle)
            policy = self.policies[key]
            if timed or self.log is not None:
                self._time_selector(policy)
            self.model.dynvocab = policy
        self.strategy = strategy
        self.reset(timed)

    def _build(self, spec, bundle: str):
        """The head policy of ``spec`` (a :class:`~dynvocab.runtime.batched.SelectorSpec`) from ``bundle``, prepared
        over the draft's rows as the plugin prepares it once the weights are loaded."""
        from dynvocab.artifacts.bundle import load_bundle
        from dynvocab.serving.vllm.head import policy_from_bundle

        with load_bundle(bundle) as b:
            policy = policy_from_bundle(b, spec, self.model.config,
                                        self.model.lm_head.weight.device)
        if getattr(self.model.lm_head, "tp_size", 1) == 1:
            policy.prepare(self.model.lm_head.weight)
        return policy

    def _time_selector(self, policy) -> None:
        """Time the policy's selector calls (a static set's selector is left as it is: its rows are packed once,
        and its call is a view of its ids)."""
        from dynvocab.runtime.selection.frequency import StaticSelector

        if not isinstance(policy.head.selector, (StaticSelector, _TimedSelector)):
            policy.head.selector = _TimedSelector(policy.head.selector, self)

    def keep_log(self) -> None:
        """Keep a log from now on: each context selector call's draft position, fed ids and windows (distinct ids),
        each greedy head call's tokens, and each ``+ngram`` lookup's request, tokens and drafts (read with
        :meth:`take_log`)."""
        self.log = []
        context = getattr(self.model, "dynvocab_context", None)
        if context is not None:
            context.lookups = []
        selector = getattr(getattr(self.model, "dynvocab", None), "head", None)
        if selector is not None and getattr(selector.selector, "reads_context", False):
            if not isinstance(selector.selector, _TimedSelector):
                selector.selector = _TimedSelector(selector.selector, self)

    def take_log(self) -> list:
        """The log since the last take, and what the plugin holds per request now (windows, or a selector's own
        per-request state) with the lookups since the last take, and the selector's counters where it keeps some
        (evospec's events and searches)."""
        out, self.log = self.log or [], []
        context = getattr(self.model, "dynvocab_context", None)
        lookups = []
        if context is not None and context.lookups is not None:
            lookups, context.lookups = context.lookups, []
        selector = getattr(getattr(getattr(self.model, "dynvocab", None), "head", None), "selector", None)
        own = getattr(selector, "held", None)
        held = None if context is None else max(context.held(), own() if callable(own) else 0)
        stats = getattr(selector, "stats", None)
        return out + [{"held": held, "lookups": lookups,
                       **({"selector": dataclasses.asdict(stats)} if dataclasses.is_dataclass(stats) else {})}]

    def read(self) -> dict:
        """The timer since the last switch (head and selector seconds, calls, rows), the rows that drafted without
        their request's context since the last read (``without_context``), and the ids the head scores per
        step (the selector's k; for a context selector, whose padded k overstates it, the distinct ids it multiplied
        per head call; the head's rows for the full head)."""
        from dynvocab.models.eagle.config import head_rows

        selected = self.strategy is not None
        ids = int(self.model.dynvocab.selector.k) if selected else head_rows(self.model.config)
        scored, calls = self.model.dynvocab.head.scored if self.plugin else (0, 0)
        if selected and calls and self.model.dynvocab.reads_context:  # the distinct ids multiplied per head call
            ids = round(scored / calls)
        context = getattr(self.model, "dynvocab_context", None)
        total = 0 if context is None else context.misses.total
        missed, self._missed = total - self._missed, total
        return {"head_s": self.head_s, "selector_s": self.selector_s if selected else 0.0, "calls": self.calls,
                "rows": self.rows, "ids": ids, "without_context": missed}


class _TimedSelector:
    """A changing set's selector that adds its calls' time to the switch's ``selector_s``."""

    def __init__(self, selector, switch: HeadSwitch):
        self.inner, self.switch, self.k = selector, switch, selector.k

    def __call__(self, hidden):
        out, seconds = self.switch.timed(self.inner, hidden)
        self.switch.selector_s += seconds
        return out

    def select(self, hidden, ctx):
        """A context selector's call, timed, and logged where the switch keeps a log."""
        out, seconds = self.switch.timed(self.inner.select, hidden, ctx)
        self.switch.selector_s += seconds
        if self.switch.log is not None:
            self.switch.log.append({
                "step": ctx.step, "fed": None if ctx.fed is None else ctx.fed.tolist(),
                "windows": None if ctx.windows is None else [sorted(set(w.tolist())) for w in ctx.windows]})
        return out

    def __getattr__(self, name: str):
        """The inner selector's other entry points (``select_union``), timed as a call; its attributes as they
        are."""
        inner = getattr(self.inner, name)
        if name != "select_union":
            return inner

        def timed(hidden):
            out, seconds = self.switch.timed(inner, hidden)
            self.switch.selector_s += seconds
            return out

        return timed


class HeadBench:
    """Worker methods the driver calls by name through ``LLM.collective_rpc`` (vLLM mixes this class into its
    worker: ``worker_extension_cls``); each runs on every rank, ``self`` the worker."""

    def dynvocab_switch_head(self, strategy: str | None, budget: int | None, bundle: str | None, timed: bool,
                             ngram: list[int] | None = None) -> str:
        """Run the draft's head with ``strategy`` from ``bundle`` (None: the draft's own full head), timed when
        ``timed``, a ``+ngram`` strategy's lookup over suffixes of ``ngram`` = [longest, shortest] tokens (None:
        the defaults); returns what the head now runs."""
        _switch(self).switch(strategy, budget, bundle, timed, ngram)
        return strategy or "full"

    def dynvocab_keep_log(self) -> None:
        """Keep a log of the draft head's context from now on (:meth:`HeadSwitch.keep_log`)."""
        _switch(self).keep_log()

    def dynvocab_take_log(self) -> list:
        """The head's log since the last take (:meth:`HeadSwitch.take_log`)."""
        return _switch(self).take_log()

    def dynvocab_read_timer(self) -> dict:
        """The head timer since the last switch or read, and the ids the head scores per step; the timer is zeroed
        (still on if it was)."""
        switch = _switch(self)
        out = switch.read()
        switch.reset(switch.on)
        return out

    def dynvocab_probe_head(self, rows: int, seed: int) -> dict:
        """A check of the plugin's head on ``rows`` random hidden states (the same on every rank): each row's set,
        ``get_top_tokens``, and where the rank has the full rows, the ids where ``compute_logits`` is finite, its
        argmax, and the largest gap between the set's logits and the full head's at the same ids."""
        import torch

        switch = _switch(self)
        model = switch.model
        weight = model.lm_head.weight
        g = torch.Generator().manual_seed(seed)
        hidden = (torch.randn(rows, weight.shape[1], generator=g) * 4).to(weight.device, weight.dtype)
        with torch.inference_mode():
            _, ids = model._selected(hidden)
            logits = switch.selected["compute_logits"](hidden)
            top = switch.selected["get_top_tokens"](hidden)
            full = switch.full["compute_logits"](hidden)
        out = {"sets": [sorted(set(r.tolist())) for r in ids], "top": top.tolist()}
        if logits is not None:  # None on the ranks a tensor-parallel gather leaves without the full rows
            out.update(finite=[torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits],
                       argmax=logits.argmax(dim=-1).tolist(), vocab=int(logits.shape[1]),
                       max_gap=max(float((logits[i, ids[i]] - full[i, ids[i]]).abs().max()) for i in range(rows)))
        return out


_SWITCHES: dict[int, HeadSwitch] = {}  # id(draft model) -> its switch, in this worker process


def _switch(worker) -> HeadSwitch:
    """The :class:`HeadSwitch` of ``worker``'s draft model, installed on first use."""
    model = _drafter_model(worker)
    if id(model) not in _SWITCHES:
        _SWITCHES[id(model)] = HeadSwitch(model)
    return _SWITCHES[id(model)]
