"""A Hugging Face `config.json` as a jaxpar model config, and back.

    model = model_config(read_config(folder), folder)  # LlamaConfig or LlamaMoEConfig
    hf = hf_config(model)                               # config.json for `jaxpar export --format hf`
    cfg = recipe(folder)                                # `--recipe hf:DIR`: a TrainConfig

Architectures (`architectures[0]` of config.json): LlamaForCausalLM, MistralForCausalLM,
Qwen3ForCausalLM (dense) and MixtralForCausalLM, Qwen3MoeForCausalLM (every layer a mixture of
experts). Both spellings of the keys that changed are read: the hub's `rope_theta` and
`rope_scaling` ({"rope_type" or "type": "llama3", ...}) and transformers 5's `rope_parameters`;
Qwen3-MoE's `num_experts` (hub) and `num_local_experts` (transformers 5). Anything jaxpar's
Llama cannot compute exactly (biases, another activation, sliding-window attention shorter than
the context, rope scalings other than llama3, dense layers between MoE layers) is refused with
one line. The values are untrusted: each is type- and range-checked before a config is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from jaxpar.config import DataConfig, OptimConfig, TrainConfig, TrainLoopConfig
from jaxpar.rundir.runlog import read_json_object

CONFIG = "config.json"

# architecture -> (model_type, mixture of experts style or "", q/k norm)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "LlamaForCausalLM": ("llama", "", False),
    "MistralForCausalLM": ("mistral", "", False),
    "Qwen3ForCausalLM": ("qwen3", "", True),
    "MixtralForCausalLM": ("mixtral", "mixtral", False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe", True),
}
# Refused with their reason (the rest with the supported list).
UNSUPPORTED = {
    "Qwen2ForCausalLM": "its q/k/v projections have biases, which jaxpar's Llama does not hold",
    "Qwen2MoeForCausalLM": "its q/k/v projections have biases, which jaxpar's Llama does not hold",
}
SUPPORTED = ", ".join(ARCHITECTURES)

# `--recipe hf:DIR` and `jaxpar.from_hf` train and run at most this many positions by default
# (a long-context checkpoint's full window would size the KV cache and batches for it).
DEFAULT_MAX_SEQ = 2048
# Bounds of the sizes read from a config.json (a real model is far inside them).
LIMITS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12, "max_position_embeddings": 1 << 24, "num_experts": 1 << 14,
    "num_experts_per_tok": 1 << 14, "moe_intermediate_size": 1 << 20,
    "original_max_position_embeddings": 1 << 24, "sliding_window": 1 << 30,
}  # fmt: skip


def read_config(folder: str) -> dict:
    """config.json of a checkpoint folder (bounded, must be a JSON object)."""
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: no such folder; give a Hugging Face checkpoint folder")
    path = os.path.join(folder, CONFIG)
    if not os.path.exists(path):
        raise ValueError(
            f"{path}: missing; a Hugging Face checkpoint folder holds config.json and "
            f"*.safetensors (save_pretrained writes them)"
        )
    return read_json_object(path, "Hugging Face model config", "; download it again")


def architecture(hf: dict, where: str) -> str:
    """The supported architecture config.json names (ValueError with the supported list)."""
    archs = hf.get("architectures")
    name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if name is None:
        mt = hf.get("model_type")
        by_type = {v[0]: k for k, v in ARCHITECTURES.items()}
        name = by_type.get(mt) if isinstance(mt, str) else None
        if name is None:
            raise ValueError(
                f"{where}: names no architecture ('architectures' or a known 'model_type'); "
                f"jaxpar loads {SUPPORTED}"
            )
    if name in UNSUPPORTED:
        raise ValueError(f"{where}: {name} is not supported ({UNSUPPORTED[name]}); jaxpar loads "
                         f"{SUPPORTED}")  # fmt: skip
    if name not in ARCHITECTURES:
        raise ValueError(f"{where}: architecture {name[:80]!r} is not supported; jaxpar loads "
                         f"{SUPPORTED}")  # fmt: skip
    return name


def _int(hf: dict, key: str, where: str, default: Any = None, low: int = 1) -> int:
    v = hf.get(key, default)
    if v is None and default is not None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {key} is {str(v)[:40]!r}, not an integer")
    high = LIMITS.get(key, 1 << 30)
    if not low <= v <= high:
        raise ValueError(f"{where}: {key}={v} is out of range ({low}..{high})")
    return v


def _float(hf: dict, key: str, where: str, default: float | None = None) -> float:
    v = hf.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: {key} is {str(v)[:40]!r}, not a finite number > 0")
    return float(v)


def _bool(hf: dict, key: str, where: str, default: bool) -> bool:
    v = hf.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, bool):
        raise ValueError(f"{where}: {key} is {str(v)[:40]!r}, not true or false")
    return v


def _rope(hf: dict, where: str) -> dict:
    """LlamaConfig's rope fields from `rope_theta`/`rope_scaling` or `rope_parameters`."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where}: {key} is {str(value)[:40]!r}, not an object")
    params, scaling = params or {}, scaling or {}
    theta_src = {"rope_theta": hf["rope_theta"]} if hf.get("rope_theta") is not None else params
    out = {"rope_theta": _float(theta_src, "rope_theta", where, 10000.0)}
    spec = scaling or params
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return {**out, "rope_scaling": ""}
    if kind != "llama3":
        raise ValueError(
            f"{where}: rope scaling {str(kind)[:40]!r} is not supported (jaxpar computes the "
            f"default rotary embedding and Llama 3's 'llama3' scaling)"
        )
    return {
        **out, "rope_scaling": "llama3", "rope_factor": _float(spec, "factor", where),
        "rope_low_freq_factor": _float(spec, "low_freq_factor", where),
        "rope_high_freq_factor": _float(spec, "high_freq_factor", where),
        "rope_original_max_len": _int(spec, "original_max_position_embeddings", where),
    }  # fmt: skip


def _window(hf: dict, name: str, where: str) -> int:
    """The sliding window the checkpoint attends over (0: none)."""
    if name.startswith("Qwen3") and not hf.get("use_sliding_window", False):
        return 0
    layer_types = hf.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" not in layer_types and layer_types:
        return 0
    if hf.get("sliding_window") is None:
        return 0
    return _int(hf, "sliding_window", where)


def model_config(hf: dict, where: str, seq_len: int | None = None) -> Any:
    """The LlamaConfig (LlamaMoEConfig for MoE architectures) of a config.json dict.

    `seq_len`: the model's context; default max_position_embeddings, at most DEFAULT_MAX_SEQ and
    the sliding window. ValueError (one line naming the key) for anything not supported."""
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.models.llama_moe import LlamaMoEConfig

    name = architecture(hf, where)
    _, moe, qk_norm = ARCHITECTURES[name]
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {str(act)[:40]!r} is not supported (SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{where}: {key}=true is not supported (jaxpar's Llama has no biases)")
    d = _int(hf, "hidden_size", where)
    n = _int(hf, "num_attention_heads", where)
    k = _int(hf, "num_key_value_heads", where, default=n)
    if hf.get("head_dim") is not None:
        hd = _int(hf, "head_dim", where)
    else:  # transformers' default: d / n, but 128 for Qwen3's configs
        hd = 128 if name.startswith("Qwen3") else 0
    if not hd and d % n:
        raise ValueError(f"{where}: hidden_size {d} is not a multiple of num_attention_heads {n}")
    if n % k:
        raise ValueError(
            f"{where}: num_attention_heads {n} is not a multiple of num_key_value_heads {k}"
        )
    window = _window(hf, name, where)
    max_pos = _int(hf, "max_position_embeddings", where, default=2048)
    limit = min(x for x in (max_pos, window or max_pos, DEFAULT_MAX_SEQ))
    if seq_len is None:
        seq_len = limit
    elif window and seq_len > window:
        raise ValueError(
            f"{where}: sliding_window={window} is shorter than the context {seq_len}; jaxpar "
            f"computes full attention only, so use a seq_len <= {window}"
        )
    fields: dict[str, Any] = dict(
        vocab_size=_int(hf, "vocab_size", where), seq_len=seq_len, d_model=d,
        n_layers=_int(hf, "num_hidden_layers", where), n_heads=n, n_kv_heads=k,
        head_dim=0 if hd == d // n and not d % n else hd,
        d_mlp=_int(hf, "intermediate_size", where),
        norm_eps=_float(hf, "rms_norm_eps", where, 1e-6), qk_norm=qk_norm,
        tie_embeddings=_bool(hf, "tie_word_embeddings", where, False),
        sliding_window=window, init_std=_float(hf, "initializer_range", where, 0.02),
        **_rope(hf, where),
    )  # fmt: skip
    if not moe:
        return _build(LlamaConfig, fields, where)
    if moe == "mixtral":
        e = _int(hf, "num_local_experts", where)
        fields |= dict(d_expert=fields["d_mlp"], normalize_top_k=True)
    else:
        if hf.get("num_experts") is not None:
            e = _int(hf, "num_experts", where)
        else:
            e = _int(hf, "num_local_experts", where)
        step = _int(hf, "decoder_sparse_step", where, default=1)
        dense = hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ValueError(
                f"{where}: decoder_sparse_step={step}, mlp_only_layers={str(dense)[:40]}: jaxpar's "
                f"LlamaMoE has a mixture of experts on every layer (decoder_sparse_step=1, no "
                f"mlp_only_layers)"
            )
        fields |= dict(
            d_expert=_int(hf, "moe_intermediate_size", where),
            normalize_top_k=_bool(hf, "norm_topk_prob", where, False),
        )
    top_k = _int(hf, "num_experts_per_tok", where)
    if top_k > e:
        raise ValueError(f"{where}: num_experts_per_tok {top_k} is more than the {e} experts")
    fields |= dict(
        n_experts=e, top_k=top_k,
        capacity_factor=e / top_k,  # every expert can take every token: nothing is dropped
        moe_aux_weight=_float(hf, "router_aux_loss_coef", where, 0.001), router_z_weight=0.0,
    )  # fmt: skip
    return _build(LlamaMoEConfig, fields, where)


def _build(cls: type, fields: dict, where: str) -> Any:
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def hf_config(model: Any) -> dict:
    """config.json (hub spelling, read by transformers 4.4x and 5) of a jaxpar Llama-family
    model config; ValueError for a model no Hugging Face architecture holds exactly."""
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.models.llama_moe import LlamaMoEConfig

    if not isinstance(model, LlamaConfig):
        raise ValueError(
            f"a {type(model).__name__} model has no Hugging Face form; jaxpar exports the "
            f"Llama family (models/llama.py, models/llama_moe.py)"
        )
    moe = isinstance(model, LlamaMoEConfig)
    if moe and model.shared_expert_mlp:
        raise ValueError(
            "a LlamaMoE with a shared expert has no Hugging Face form jaxpar writes "
            "(Qwen2-MoE's also has q/k/v biases); export one without shared_expert_mlp"
        )
    if moe:
        if model.qk_norm:
            arch = "Qwen3MoeForCausalLM"
        elif model.normalize_top_k:
            arch = "MixtralForCausalLM"
        else:
            raise ValueError(
                "a LlamaMoE without q/k norm and with normalize_top_k=false has no Hugging Face "
                "form (Mixtral renormalises the top-k weights; Qwen3-MoE has q/k norm)"
            )
    else:
        arch = "Qwen3ForCausalLM" if model.qk_norm else "LlamaForCausalLM"
    mt = ARCHITECTURES[arch][0]
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": mt, "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "intermediate_size": model.d_mlp,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": model.hd, "hidden_act": "silu",
        "max_position_embeddings": model.seq_len, "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": model.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": model.init_std, "use_cache": True,
        "torch_dtype": "float32",
    }  # fmt: skip
    if model.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": model.rope_factor,
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_len,
        }  # fmt: skip
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = False
    if arch.startswith("Qwen3"):
        out |= {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": model.n_layers}  # fmt: skip
    if arch == "MixtralForCausalLM":
        out |= {"num_local_experts": model.n_experts, "num_experts_per_tok": model.top_k,
                "intermediate_size": model.d_expert, "sliding_window": None,
                "output_router_logits": False,
                "router_aux_loss_coef": model.moe_aux_weight}  # fmt: skip
    if arch == "Qwen3MoeForCausalLM":
        out |= {"num_experts": model.n_experts, "num_experts_per_tok": model.top_k,
                "moe_intermediate_size": model.d_expert, "norm_topk_prob": model.normalize_top_k,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
                "router_aux_loss_coef": model.moe_aux_weight}  # fmt: skip
    return out


# Fields that make a checkpoint's tensors and their meaning: a recipe whose model differs in one
# of them cannot start from the checkpoint. seq_len, init_std, the capacity, the auxiliary
# losses' weights and the layout choices (remat, attention, moe_impl) may differ.
ARCH_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "hd", "d_mlp", "norm_eps",
    "rope_theta", "rope_scaling", "qk_norm", "tie_embeddings",
)  # fmt: skip
LLAMA3_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_len")  # fmt: skip
MOE_FIELDS = ("n_experts", "top_k", "d_expert", "normalize_top_k", "shared_expert_mlp")


def differences(recipe_model: Any, folder_model: Any) -> list[str]:
    """`field: recipe's → folder's` for every field that decides the checkpoint's tensors or
    their meaning (ARCH_FIELDS; the llama3 scaling's and the experts' fields when they apply),
    plus a context longer than the folder's sliding window."""
    from jaxpar.models.llama_moe import LlamaMoEConfig

    a, b = recipe_model, folder_model
    if type(a).__name__ != type(b).__name__:
        return [f"model: {type(a).__name__} → {type(b).__name__}"]
    moe = isinstance(b, LlamaMoEConfig)
    names = [f for f in ARCH_FIELDS if not (moe and f == "d_mlp")]
    if "llama3" in (a.rope_scaling, b.rope_scaling):
        names += LLAMA3_FIELDS
    if moe:
        names += MOE_FIELDS
    out = [
        f"{f}: {getattr(a, f)} → {getattr(b, f)}" for f in names if getattr(a, f) != getattr(b, f)
    ]
    if b.sliding_window and a.seq_len > b.sliding_window:
        out.append(f"seq_len: {a.seq_len} > the folder's sliding_window {b.sliding_window}")
    return out


def recipe_name(folder: str) -> str:
    base = os.path.basename(os.path.normpath(os.path.abspath(folder)))
    return "hf-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.")[:64] or "model")


def recipe(folder: str, seq_len: int | None = None) -> TrainConfig:
    """`--recipe hf:DIR`: the folder's model (config.json) with the tiny recipes' data and
    schedule (stdlib_text bytes, 16 rows, 200 steps, warm-up 20, evaluation every 100) at a
    fine-tuning learning rate (1e-4). The context is max_position_embeddings, at most 2048 and
    the sliding window (`seq_len` to choose); data.seq_len follows it."""
    model = model_config(read_config(folder), os.path.join(folder, CONFIG), seq_len)
    return TrainConfig(
        name=recipe_name(folder),
        model=model,
        data=DataConfig(source="stdlib_text", global_batch=16, seq_len=model.seq_len),
        optim=OptimConfig(lr=1e-4, warmup_steps=20),
        train=TrainLoopConfig(steps=200, eval_every=100, eval_batches=2),
    )


def with_seq_len(cfg: TrainConfig, seq_len: int) -> TrainConfig:
    """`cfg` with the model's and the data's seq_len set together."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, seq_len=seq_len),
        data=dataclasses.replace(cfg.data, seq_len=seq_len),
    )
