"""The target's training answers written by vLLM (``train-draft --self-distill --distill-engine vllm``).

PyTorch generates a batch of prompts as one padded batch, one pass per new token. vLLM schedules many requests at
once with paged attention and no padding: on Gemma-3-270M, 32 requests in flight, it wrote 285 new tok/s against
PyTorch's 196 (docs/measurements/2026-11-29-train-gemma-distill-vllm.md). The
engine runs in a child process, the bench's driver (:mod:`dynvocab.bench.engines.vllm.driver`, a plain ``vllm`` row, its
engine core in the driver's process), started once for every :data:`SHARDS_PER_ENGINE` shards: an engine start
costs seconds, and a kill loses at most those shards. The shards, manifest and resume are
:mod:`dynvocab.builders.draft.distill`'s, the same as with PyTorch; the command (``dynvocab train-draft``) hands
the writer to the trainer, which knows it only as something that answers prompts.

Greedy answers are the target's argmax at each position, as PyTorch's are; in bfloat16 a near-tie may break
otherwise than PyTorch breaks it (another kernel, other batch shapes). The tests compare the two in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvocab.bench.engines.vllm import rows  # read at call time: one binding, wherever it is first imported

SHARDS_PER_ENGINE = 8  # shards whose prompts one engine answers before the shards are written


@dataclass(frozen=True)
class VllmWriter:
    """Answers prompts with a vLLM engine over the target's local ``folder``, run by ``python`` (an environment
    with vLLM and dynvocab)."""

    folder: str
    python: str
    shards_per_call: int = SHARDS_PER_ENGINE

    @classmethod
    def for_target(cls, target: str, python: str | None = None) -> VllmWriter:
        """The writer for ``target`` (a local folder or ``demo:NAME``) and ``--vllm-python``; refused in one line
        where vLLM cannot load the target or ``python`` cannot import vLLM."""
        return cls(rows.local_folder(target, "--target"), rows.find_vllm_python(python))

    def answers(self, prompts: list[list[int]], new_tokens: int, temperature: float, end_ids: list[int],
                in_flight: int, seed: int, dtype: str) -> list[list[int]]:
        """The target's continuation of each of ``prompts`` (up to ``new_tokens`` tokens, stopping at an end token),
        greedy at ``temperature`` 0 else sampled from the full distribution (seeded by ``seed``), with
        ``in_flight`` requests in the engine at a time, in ``dtype``."""
        longest = max(map(len, prompts))
        req = {
            "target": self.folder, "dtype": dtype, "prompts": prompts, "max_tokens": new_tokens,
            "temperature": temperature, "seed": seed, "rows": [{"name": "vllm"}], "concurrency": [in_flight],
            "stop_token_ids": list(end_ids), "max_model_len": -(-(longest + new_tokens + 16) // 128) * 128,
        }
        with rows.work_folder("dynvocab-distill-") as work:
            return rows.drive(self.python, req, work)[0]["token_ids"]
