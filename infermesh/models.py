"""Build small, deterministic Llama-architecture checkpoints that vLLM loads by path.

Nothing can be downloaded from a model hub on the machines this project is developed and
tested on, so the local mesh serves checkpoints made here: a byte-level BPE tokenizer trained on
a fixed corpus, a Llama-3-style chat template, and random weights from a fixed seed saved as
safetensors. The "large" and the "small" model give a real degradation ladder (different
sizes, different speeds) while the loading code stays the one used for real hub models.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import paths

# Bump when the recipe changes so cached checkpoints are rebuilt.
RECIPE_VERSION = 1

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A service mesh routes every request between services and keeps the traffic observable.",
    "Interactive chat waits for the first token; batch jobs care about throughput.",
    "The GPU pool serves large language models with continuous batching.",
    "When the cache is full the server degrades to a smaller model instead of failing.",
    "Envoy runs the WebAssembly filter on every request and steers it to a cluster.",
    "Summaries, evaluations and backfills run as batch work overnight.",
    "Hello! How can I help you today? Tell me what you would like to know.",
    "The circuit breaker opens when the latency stays above its threshold.",
    "Tokens stream back to the client as server-sent events without buffering.",
    "Kubernetes schedules the pods on nodes with the right accelerators.",
    "Write a short poem about the sea, the wind and the stars at night.",
    "Numbers: one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9.",
    "Questions and answers, prompts and completions, system and user and assistant.",
    "The model ladder lists the primary model first and the lighter fallbacks after it.",
    "Recovery happens one step at a time once the pressure is gone for long enough.",
]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one local checkpoint. head_dim must be 64: vLLM's CPU attention rejects 16."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


LOCAL_MODELS: dict[str, ModelSpec] = {
    "tiny-llama-large": ModelSpec("tiny-llama-large", 512, 1536, 6, 8, 4, seed=1),
    "tiny-llama-small": ModelSpec("tiny-llama-small", 128, 384, 2, 2, 1, seed=2),
}


def _spec_digest(spec: ModelSpec) -> str:
    blob = json.dumps({"recipe": RECIPE_VERSION, "spec": asdict(spec), "corpus": CORPUS, "template": CHAT_TEMPLATE}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_path(name: str, root: Path | None = None) -> Path:
    return (root or paths.models_dir()) / name


def is_built(spec: ModelSpec, root: Path | None = None) -> bool:
    manifest = model_path(spec.name, root) / "infermesh-manifest.json"
    try:
        return json.loads(manifest.read_text())["digest"] == _spec_digest(spec)
    except (OSError, ValueError, KeyError):
        return False


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    fast.save_pretrained(out)
    return len(fast)


def build_model(spec: ModelSpec, root: Path | None = None, force: bool = False) -> Path:
    """Build one checkpoint into the cache (idempotent: an up-to-date one is kept)."""
    if spec.head_dim != 64:
        raise ValueError(f"{spec.name}: head_dim {spec.head_dim} (hidden_size/num_attention_heads) must be 64")
    dest = model_path(spec.name, root)
    if not force and is_built(spec, root):
        return dest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = _train_tokenizer(tmp)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # A larger spread than the default init keeps sampling from collapsing onto one token.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(tmp, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    (tmp / "infermesh-manifest.json").write_text(
        json.dumps({"name": spec.name, "digest": _spec_digest(spec), "parameters": params, "vocab_size": vocab}, indent=2)
    )
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def build_all(root: Path | None = None, force: bool = False, out=sys.stderr) -> dict[str, Path]:
    built = {}
    for spec in LOCAL_MODELS.values():
        t0 = time.monotonic()
        fresh = force or not is_built(spec, root)
        path = build_model(spec, root, force)
        verb = "built" if fresh else "up to date"
        print(f"infermesh: model {spec.name}: {verb} at {path} ({time.monotonic() - t0:.1f}s)", file=out, flush=True)
        built[spec.name] = path
    return built
