"""jaxpar.hf without transformers: config.json mapping both ways, the tensor-name mapping of any
slice, the checked safetensors reader (what it reads, and each refusal in one line), and the
folder writer (atomic, sharded, the tokenizer). Checkpoints here are written by jaxpar.hf.save
from random parameters."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jaxpar.engine import model as model_lib
from jaxpar.engine.mesh import make_mesh
from jaxpar.hf import config as hf_config
from jaxpar.hf import load as hf_load
from jaxpar.hf import names as hf_names
from jaxpar.hf import save as hf_save
from jaxpar.hf import tensors
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.llama_moe import LlamaMoEConfig
from jaxpar.parallel.program import param_shardings

LLAMA = LlamaConfig(
    vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48,
    norm_eps=1e-5, rope_theta=10000.0, rope_scaling="llama3", rope_original_max_len=16,
)  # fmt: skip
QWEN3 = LlamaConfig(
    vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
    d_mlp=48, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_embeddings=True,
)  # fmt: skip
MIXTRAL = LlamaMoEConfig(
    vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=24,
    n_experts=4, top_k=2, d_expert=24, capacity_factor=2.0, router_z_weight=0.0,
)  # fmt: skip
QWEN3_MOE = LlamaMoEConfig(
    vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
    d_mlp=48, qk_norm=True, n_experts=4, top_k=2, d_expert=16, normalize_top_k=False,
    capacity_factor=2.0, router_z_weight=0.0,
)  # fmt: skip
SHARED_EXPERT = LlamaMoEConfig(
    vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4,
    top_k=2, d_expert=16, shared_expert_mlp=24,
)  # fmt: skip


def random_params(model, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        path: rng.standard_normal(spec.shape).astype(np.float32)
        for path, spec in hf_names.specs(model).items()
    }


def nested(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        d = out
        for key in path[:-1]:
            d = d.setdefault(key, {})
        d[path[-1]] = value
    return out


def write(tmp_path, model, name="ckpt", shard_bytes=hf_save.DEFAULT_SHARD_BYTES, **kw):
    flat = random_params(model)
    out = str(tmp_path / name)
    hf_save.write_folder(out, model, nested(flat), shard_bytes=shard_bytes, **kw)
    return out, flat


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None and k.startswith("-"):
            cfg.pop(k[1:], None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)


# ---- config.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model", [LLAMA, QWEN3, MIXTRAL, QWEN3_MOE], ids=["llama", "qwen3", "mixtral", "qwen3_moe"]
)
def test_config_round_trip(model):
    hf = hf_config.hf_config(model)
    back = hf_config.model_config(hf, "config.json", seq_len=model.seq_len)
    assert hf_config.differences(model, back) == []
    assert back.seq_len == model.seq_len and back.hd == model.hd


def test_both_spellings_of_the_changed_keys_read_alike():
    hub = hf_config.hf_config(LLAMA)  # rope_theta + rope_scaling {"rope_type": ...}
    old = {**hub, "rope_scaling": {**hub["rope_scaling"], "type": "llama3"}}
    del old["rope_scaling"]["rope_type"]
    v5 = {k: v for k, v in hub.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**hub["rope_scaling"], "rope_theta": hub["rope_theta"]}
    got = [hf_config.model_config(h, "c", seq_len=32) for h in (hub, old, v5)]
    assert got[0] == got[1] == got[2] == LLAMA
    moe = hf_config.hf_config(QWEN3_MOE)
    local = {k: v for k, v in moe.items() if k != "num_experts"} | {"num_local_experts": 4}
    a, b = (hf_config.model_config(h, "c", seq_len=32) for h in (moe, local))
    assert a == b and a.n_experts == 4 and not a.normalize_top_k
    mixtral = hf_config.model_config(hf_config.hf_config(MIXTRAL), "c")
    assert mixtral.normalize_top_k and mixtral.capacity_factor == 4 / 2  # nothing dropped


def test_the_context_is_capped_by_default_and_by_a_sliding_window():
    hf = hf_config.hf_config(LLAMA) | {"max_position_embeddings": 131072}
    assert hf_config.model_config(hf, "c").seq_len == hf_config.DEFAULT_MAX_SEQ
    mistral = hf | {"architectures": ["MistralForCausalLM"], "sliding_window": 64}
    assert hf_config.model_config(mistral, "c").seq_len == 64
    with pytest.raises(ValueError, match="sliding_window=64 is shorter than the context 128"):
        hf_config.model_config(mistral, "c", seq_len=128)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM is not supported (its q/k/v"),
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported; jaxpar "
         "loads LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
         "Qwen3MoeForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"hidden_size": "32"}, "hidden_size is '32', not an integer"),
        ({"vocab_size": 1 << 30}, "vocab_size=1073741824 is out of range"),
        ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads 3"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps is 'nan', not a finite number > 0"),
    ],
)  # fmt: skip
def test_config_refusals_are_one_line(change, message):
    with pytest.raises(ValueError, match=None) as e:
        hf_config.model_config(hf_config.hf_config(LLAMA) | change, "DIR/config.json")
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]: jaxpar's LlamaMoE has a mixture of"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 4 experts"),
    ],
)
def test_moe_refusals(change, message):
    with pytest.raises(ValueError, match="DIR/config.json: ") as e:
        hf_config.model_config(hf_config.hf_config(QWEN3_MOE) | change, "DIR/config.json")
    assert message in str(e.value)


def test_models_without_a_hugging_face_form_are_refused():
    from jaxpar.models.gpt import GPTConfig

    with pytest.raises(ValueError, match="a GPTConfig model has no Hugging Face form"):
        hf_config.hf_config(GPTConfig())
    with pytest.raises(ValueError, match="shared expert has no Hugging Face form"):
        hf_config.hf_config(SHARED_EXPERT)


def test_differences_name_the_fields():
    other = LlamaConfig(
        **{**vars(LLAMA), "n_layers": 3, "d_mlp": 64, "seq_len": 16, "remat": "block"}
    )
    assert hf_config.differences(other, LLAMA) == ["n_layers: 3 → 2", "d_mlp: 64 → 48"]
    assert hf_config.differences(MIXTRAL, LLAMA) == ["model: LlamaMoEConfig → LlamaConfig"]


# ---- names: any slice of a parameter from the tensors' slices --------------------------------


@pytest.mark.parametrize("model", [LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, SHARED_EXPERT])
def test_any_block_of_a_parameter_is_assembled_from_its_tensors(model):
    rng = np.random.default_rng(1)
    abstract = nnx_params(model)
    for path, spec in hf_names.specs(model).items():
        assert abstract[path] == spec.shape, path  # the mapping is the model's own layout
        value = rng.standard_normal(spec.shape).astype(np.float32)
        hf = dict(hf_names.to_hf(spec, value))
        assert {k: v.shape for k, v in hf.items()} == {n: spec.hf_shape for _, n in spec.hf_names()}

        def read(name, ranges, hf=hf):
            return hf[name][tuple(slice(r.start, r.stop) for r in ranges)]

        assert np.array_equal(hf_names.block(spec, (), read), value)
        for _ in range(10):
            index = []
            for n in spec.shape:
                a = int(rng.integers(0, n))
                index.append(slice(a, int(rng.integers(a + 1, n + 1))))
            got = hf_names.block(spec, tuple(index), read)
            assert np.array_equal(got, value[tuple(index)]), (path, index)


def nnx_params(model) -> dict:
    from flax import nnx

    pure = nnx.to_pure_dict(model_lib.abstract(model, 0).params)
    return {p: tuple(v.shape) for p, v in hf_load._paths(pure)}


def test_a_block_reads_only_its_layers_and_rows(tmp_path):
    """w_q[1:2, :, 2:4] (layer 1, heads 2 and 3) reads only layer 1's q_proj, and of it only
    those heads' rows; the token table's rows 8..16 read those 8 rows."""
    folder, _ = write(tmp_path, LLAMA)
    with hf_load.open_folder(folder) as f:
        specs = hf_names.specs(f.model)
        reads = []

        def read(name, ranges):
            reads.append((name, [(r.start, r.stop) for r in ranges]))
            return f.reader.read(name, ranges)

        hf_names.block(specs[("blocks", "w_q")], (slice(1, 2), slice(None), slice(2, 4)), read)
        assert reads == [("model.layers.1.self_attn.q_proj.weight", [(16, 32), (0, 32)])]
        reads.clear()
        hf_names.block(specs[("tok_emb",)], (slice(8, 16),), read)
        assert reads == [("model.embed_tokens.weight", [(8, 16), (0, 32)])]
        before = f.reader.bytes_read
        f.reader.read("model.embed_tokens.weight", [range(8, 16), range(0, 4)])
        assert f.reader.bytes_read - before == 8 * 32 * 4  # the rows, not the whole table


# ---- the checked reader and its refusals ----------------------------------------------------


def test_a_folder_loads_bitwise_onto_any_sharding(tmp_path):
    folder, flat = write(tmp_path, QWEN3_MOE, shard_bytes=40_000)
    assert os.path.exists(os.path.join(folder, hf_load.INDEX))
    from jaxpar import meshes

    for layout in ("dp8", "fsdp8", "data=2,expert=4", "data=4,tensor=2"):
        p = meshes.resolve(layout)
        mesh = make_mesh(p.mesh)
        sh = param_shardings(model_lib.abstract(QWEN3_MOE, 0).params, p.params, mesh)
        with hf_load.open_folder(folder) as f:
            params = hf_load.load_params(f, sh)
            read = f.reader.bytes_read
        total = sum(v.nbytes for v in flat.values())
        assert read == total, (layout, read, total)  # each tensor once, whatever the layout
        for path, value in hf_load._paths(params):
            assert value.sharding == dict(hf_load._paths(sh))[path]
            assert np.array_equal(np.asarray(value), flat[path]), (layout, path)


def test_large_stacked_parameters_are_placed_layer_by_layer(tmp_path):
    """Past the host budget a stacked parameter is copied into its devices one layer at a time:
    the same arrays, each tensor still read once."""
    folder, flat = write(tmp_path, QWEN3_MOE)
    from jaxpar import meshes

    for layout in ("fsdp8", "dp4_pp2"):
        p = meshes.resolve(layout)
        mesh = make_mesh(p.mesh)
        sh = param_shardings(model_lib.abstract(QWEN3_MOE, 0).params, p.params, mesh)
        with hf_load.open_folder(folder) as f:
            params = hf_load.load_params(f, sh, host_bytes=0)
            assert f.reader.bytes_read == sum(v.nbytes for v in flat.values())
        for path, value in hf_load._paths(params):
            assert value.sharding == dict(hf_load._paths(sh))[path]
            assert np.array_equal(np.asarray(value), flat[path]), (layout, path)


def test_bfloat16_and_float16_files_load_as_float32_with_one_notice(tmp_path, capfd):
    folder, flat = write(tmp_path, LLAMA)
    bf16 = _narrow_copy(folder, str(tmp_path / "bf16"), "BF16")
    f16 = _narrow_copy(folder, str(tmp_path / "f16"), "F16")
    mesh = make_mesh("data=1", jax.devices()[:1])
    sh = jax.tree.map(
        lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        nested(flat),
    )
    import ml_dtypes

    for where, narrow in ((bf16, ml_dtypes.bfloat16), (f16, np.float16)):
        with hf_load.open_folder(where) as f:
            params = hf_load.load_params(f, sh)
        for path, value in hf_load._paths(params):
            assert value.dtype == np.float32
            want = flat[path].astype(narrow).astype(np.float32)
            assert np.array_equal(np.asarray(value), want), path
    err = capfd.readouterr().err.splitlines()
    assert [x for x in err if "holds" in x] == [
        f"jaxpar: {bf16} holds bfloat16 tensors; loading them as float32 (the parameters' dtype)",
        f"jaxpar: {f16} holds float16 tensors; loading them as float32 (the parameters' dtype)",
    ]


def _narrow_copy(folder: str, out: str, dtype: str) -> str:
    """The folder with its tensors stored as BF16 or F16 (a writer of our own for the test)."""
    import shutil

    import ml_dtypes

    shutil.copytree(folder, out)
    path = os.path.join(out, "model.safetensors")
    header = tensors.read_header(path)
    reader = tensors.Reader(header)
    arrays = {n: reader.read(n, [range(e.shape[0])] + [range(d) for d in e.shape[1:]])
              for n, e in header.items()}  # fmt: skip
    reader.close()
    np_dtype = ml_dtypes.bfloat16 if dtype == "BF16" else np.float16
    obj, offset, blobs = {}, 0, []
    for n, a in arrays.items():
        b = a.astype(np_dtype).tobytes()
        obj[n] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    head = json.dumps(obj).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    return out


def refused(folder: str, message: str, **open_kw) -> str:
    with pytest.raises(ValueError) as e:
        hf_load.open_folder(folder, **open_kw)
    text = str(e.value)
    assert message in text and "\n" not in text, text
    return text


def test_a_missing_shard_is_named(tmp_path):
    folder, _ = write(tmp_path, LLAMA, shard_bytes=20_000)
    shards = sorted(n for n in os.listdir(folder) if n.startswith("model-"))
    os.remove(os.path.join(folder, shards[1]))
    refused(folder, f"{os.path.join(folder, shards[1])}: missing (model.safetensors.index.json "
                    f"places")  # fmt: skip


def test_a_truncated_shard_is_named(tmp_path):
    folder, _ = write(tmp_path, LLAMA, shard_bytes=20_000)
    shard = os.path.join(folder, sorted(n for n in os.listdir(folder) if n.startswith("model-"))[2])
    size = os.path.getsize(shard)
    os.truncate(shard, size - 100)
    refused(folder, f"{shard}: {size - 100:,} bytes but its header places tensors up to byte "
                    f"{size:,} (truncated); download it again")  # fmt: skip
    os.truncate(shard, 5)
    refused(folder, f"{shard}: 5 bytes, too short for a safetensors header (truncated)")


def test_a_shape_that_disagrees_with_config_json_is_named(tmp_path):
    folder, _ = write(tmp_path, LLAMA)
    edit_config(folder, intermediate_size=40)
    refused(folder, f"{folder}/model.safetensors: model.layers.0.mlp.gate_proj.weight is [48, 32] "
                    "but config.json makes it [40, 32]; config.json and the weights are of "
                    "different models")  # fmt: skip


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: (1 << 40).to_bytes(8, "little") + b[8:], "header of 1,099,511,627,776 bytes"),
        (lambda b: b[:8] + b"[" + b[9:], "header is not JSON"),
        (lambda b: b.replace(b'"F32"', b'"F64"', 1), "is F64, not one of F32, BF16, F16"),
        (lambda b: b.replace(b'"F32"', b'"I32"', 1), "is I32, not one of F32, BF16, F16"),
        (lambda b: b + b"\0" * 16, "16 bytes past its last tensor"),
    ],
)
def test_damaged_headers_are_refused(tmp_path, damage, message):
    folder, _ = write(tmp_path, LLAMA)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        f.write(damage(blob))
    refused(folder, message)


def test_tensors_config_json_does_not_describe_are_refused(tmp_path):
    folder, flat = write(tmp_path, LLAMA)
    edit_config(folder, num_hidden_layers=1)
    refused(folder, "tensors model.layers.1.")  # layer 1 is not part of a 1-layer model
    edit_config(folder, num_hidden_layers=3)
    refused(folder, "tensors model.layers.2.")
    edit_config(folder, num_hidden_layers=2, architectures=["Qwen3ForCausalLM"])
    refused(folder, "tensors model.layers.0.self_attn.q_norm.weight, model.layers.1.self_attn."
                    "q_norm.weight, model.layers.0.self_attn.k_norm.weight and 1 more are missing; "
                    "config.json describes another model than the weights")  # fmt: skip


def test_a_tied_head_must_be_the_token_table(tmp_path):
    folder, flat = write(tmp_path, LLAMA)
    edit_config(folder, tie_word_embeddings=True)
    refused(folder, "lm_head.weight differs from model.embed_tokens.weight but config.json says "
                    "tie_word_embeddings: true")  # fmt: skip


def test_no_safetensors_and_an_index_escaping_the_folder(tmp_path):
    folder, _ = write(tmp_path, LLAMA)
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "pytorch_model.bin"))
    refused(folder, "no model.safetensors or model.safetensors.index.json (it holds "
                    "pytorch_model.bin: convert them with save_pretrained")  # fmt: skip
    with open(os.path.join(folder, hf_load.INDEX), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "../model.safetensors"}}, f)
    refused(folder, "'model.norm.weight' maps to '../model.safetensors', not a file name")


def test_the_recipes_model_must_match_the_folder(tmp_path):
    folder, _ = write(tmp_path, LLAMA)
    bigger = LlamaConfig(**{**vars(LLAMA), "n_layers": 3, "vocab_size": 128})
    refused(folder, "config.json differs from the recipe's model (vocab_size: 128 → 64; "
                    "n_layers: 3 → 2): the weights cannot start that model", expect=bigger)  # fmt: skip


def test_source_folder():
    assert hf_load.source_folder("hf:/a/b") == "/a/b"
    for bad in ("/a/b", "hf:", "gs://x"):
        with pytest.raises(ValueError, match="give hf:DIR"):
            hf_load.source_folder(bad)


# ---- the writer ------------------------------------------------------------------------------


def test_the_writer_shards_copies_the_tokenizer_and_is_atomic(tmp_path, monkeypatch):
    tok = tmp_path / "data"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    folder, flat = write(tmp_path, MIXTRAL, shard_bytes=30_000, tokenizer_dir=str(tok))
    names = sorted(os.listdir(folder))
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {"config.json", "generation_config.json", hf_load.INDEX, "tokenizer.json",
            "tokenizer_config.json"} <= set(names)  # fmt: skip
    with open(os.path.join(folder, hf_load.INDEX)) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(hf_names.hf_tensors(MIXTRAL))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in flat.values())
    with hf_load.open_folder(folder) as f:
        assert f.model == hf_config.model_config(hf_config.hf_config(MIXTRAL), "c", seq_len=32)
    # --force replaces it only once the new folder is complete; a failure leaves the old one
    before = sorted(os.listdir(folder))
    calls = []

    def failing(path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(path, *a, **kw)

    real = tensors.write
    monkeypatch.setattr(tensors, "write", failing)
    with pytest.raises(OSError):
        hf_save.write_folder(folder, MIXTRAL, nested(flat), shard_bytes=30_000, force=True)
    assert sorted(os.listdir(folder)) == before
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []  # no temporary left
    with pytest.raises(ValueError, match="exists; pass --force to replace it"):
        hf_save.write_folder(folder, MIXTRAL, nested(flat))


def test_parse_size():
    assert hf_save.parse_size("2GiB") == 2 << 30
    assert hf_save.parse_size("500MB") == 500_000_000
    assert hf_save.parse_size("4096") == 4096
    for bad in ("0", "-1MB", "2XB", "lots", "nan"):
        with pytest.raises(ValueError, match="--shard-size"):
            hf_save.parse_size(bad)
