"""What a bundle was built for: the identity of a model's vocabulary and LM head."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dynvocab.models import tokenizer_fingerprint

# Fields that decide whether a bundle fits a model; ``source`` is only a reminder of where it came from.
COMPARED = ("vocab_size", "tokenizer_sha256", "head_rows", "hidden_size")


@dataclass(frozen=True)
class ModelFingerprint:
    """Vocabulary size, tokenizer hash and LM-head shape of one model (target or draft)."""

    vocab_size: int  # len(tokenizer), added tokens included
    tokenizer_sha256: str  # dynvocab.models.tokenizer_fingerprint
    head_rows: int  # LM-head rows (often padded past the tokenizer)
    hidden_size: int  # LM-head columns
    source: str = ""

    @classmethod
    def of(cls, tokenizer, head_shape: tuple[int, int], source: str = "") -> "ModelFingerprint":
        """Fingerprint a tokenizer and an LM head of shape ``[rows, hidden]``."""
        rows, hidden = (int(x) for x in head_shape)
        return cls(len(tokenizer), tokenizer_fingerprint(tokenizer), rows, hidden, source)

    @classmethod
    def of_model(cls, tokenizer, model, source: str = "") -> "ModelFingerprint":
        """Fingerprint a loaded transformers causal LM (what the runtime passes to ``Bundle.check_models``)."""
        return cls.of(tokenizer, tuple(model.get_output_embeddings().weight.shape), source)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelFingerprint":
        """Inverse of :meth:`as_dict`."""
        return cls(**{k: data[k] for k in (*COMPARED, "source") if k in data})

    def as_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)

    def differences(self, other: "ModelFingerprint") -> list[str]:
        """Human-readable differences in the compared fields (empty when the models fit)."""
        out = []
        for key in COMPARED:
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine != theirs:
                if key == "tokenizer_sha256":
                    mine, theirs = mine[:12], theirs[:12]
                out.append(f"{key} {theirs} != {mine}")
        return out

    def describe(self) -> str:
        """One short line: source, vocabulary, head shape."""
        name = f"{self.source} · " if self.source else ""
        return f"{name}vocab {self.vocab_size:,} · head {self.head_rows:,}×{self.hidden_size} · tok {self.tokenizer_sha256[:12]}"
