"""Run inside the Hugging Face peer environment (torch + transformers, no jaxpar): tiny random
models built in transformers, saved with `save_pretrained`, and their reference outputs.

    python hf_peer_script.py OUT
    python hf_peer_script.py check FOLDER TOKENS.npy OUT.npy [FOLDER TOKENS.npy OUT.npy ...]

The first writes, per model NAME, the folder OUT/NAME (config.json, safetensors) and OUT/NAME.npz:
`tokens` [8, 257] (logits are of tokens[:, :256]), `logits` [8, 256, V] float32, `prompt`
[1, 8] and `generated` [1, 32] (greedy `generate`, its smallest top-1/top-2 gap `margin`), and
for the models trained here `train_losses` (two AdamW steps on tokens[:, :65]). OUT/manifest.json
lists the models and the versions. `check` loads each FOLDER with
AutoModelForCausalLM.from_pretrained (a folder jaxpar exported) and writes its float32 logits on
the tokens of its TOKENS.npy ([rows, T] int) to its OUT.npy.
"""

import json
import os
import sys

import numpy as np
import torch
import transformers

SEQ = 256
ROWS = 8
PROMPT = 8
NEW = 32
TRAIN_T = 64
# torch.optim.AdamW of the training reference (the jaxpar side uses optax.adamw alike)
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

COMMON = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None,
)  # fmt: skip

LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip


def models():
    t = transformers
    return {
        # grouped-query attention, llama3 rope scaling, untied head, saved in 10 shards
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(
            **COMMON, intermediate_size=256, rope_theta=10000.0, rope_scaling=dict(LLAMA3),
            tie_word_embeddings=False), {"max_shard_size": "200KB"}, True),
        # tied embeddings, plain rope, one file
        "llama_tied": (t.LlamaForCausalLM, t.LlamaConfig(
            **{**COMMON, "num_key_value_heads": 8}, intermediate_size=192, rope_theta=500000.0,
            tie_word_embeddings=True), {}, False),
        # q/k norms, head_dim 32 != hidden_size / heads
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(
            **COMMON, intermediate_size=256, head_dim=32, rope_theta=1000000.0,
            tie_word_embeddings=False), {}, False),
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(
            **COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None), {}, False),
        "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            **COMMON, intermediate_size=256, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[], head_dim=16, rope_theta=1000000.0,
            tie_word_embeddings=False), {}, False),
    }  # fmt: skip


def randomize_norms(model) -> None:
    """Norm scales away from 1, so that a norm mapped to the wrong tensor shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)


def greedy(model, vocab: int, seed: int):
    """A prompt whose 32 greedy steps all have a clear winner (top-1 minus top-2 > 1e-3)."""
    for attempt in range(50):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        prompt = torch.randint(3, vocab, (1, PROMPT), generator=g)
        out = model.generate(
            prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
        top2 = torch.stack([s[0].topk(2).values for s in out.scores])
        margin = float((top2[:, 0] - top2[:, 1]).min())
        if margin > 1e-3:
            return prompt.numpy(), out.sequences[:, PROMPT:].numpy(), margin
    raise SystemExit("no prompt with a clear greedy path")


def train_losses(model, tokens: torch.Tensor) -> list[float]:
    """Two AdamW steps on one batch: the loss before each (mean next-token cross-entropy)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    inputs, targets = tokens[:, :TRAIN_T], tokens[:, 1 : TRAIN_T + 1]
    losses = []
    for _ in range(2):
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        )
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    names = []
    for seed, (name, (cls, config, save_kw, train)) in enumerate(models().items()):
        torch.manual_seed(seed)
        model = cls(config).float().eval()
        randomize_norms(model)
        model.save_pretrained(os.path.join(out, name), **save_kw)
        vocab = config.vocab_size
        g = torch.Generator().manual_seed(100 + seed)
        tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
        with torch.no_grad():
            logits = model(input_ids=tokens[:, :SEQ]).logits.float().numpy()
        prompt, generated, margin = greedy(model, vocab, seed)
        ref = {"tokens": tokens.numpy(), "logits": logits, "prompt": prompt,
               "generated": generated, "margin": np.float64(margin)}  # fmt: skip
        if train:
            ref["train_losses"] = np.array(train_losses(model, tokens), np.float64)
        if name == "llama_tied":  # the same weights stored as bf16
            model.to(torch.bfloat16).save_pretrained(os.path.join(out, f"{name}_bf16"))
        np.savez(os.path.join(out, f"{name}.npz"), **ref)
        names.append(name)
    manifest = {"models": names, "torch": torch.__version__,
                "transformers": transformers.__version__, "adamw": ADAMW, "train_t": TRAIN_T}  # fmt: skip
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


def check(triples: list[str]) -> None:
    for folder, tokens_file, out in zip(triples[::3], triples[1::3], triples[2::3], strict=True):
        tokens = torch.from_numpy(np.load(tokens_file)).long()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
        with torch.no_grad():
            np.save(out, model(input_ids=tokens).logits.float().numpy())


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if sys.argv[1] == "check":
        check(sys.argv[2:])
    else:
        main(sys.argv[1])
