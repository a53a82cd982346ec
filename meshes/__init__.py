"""Named layouts: a mesh spec plus parameter and activation rules (two small ordered tables).

`--mesh NAME` picks one; `--mesh data=2,tensor=4` builds an unnamed one with the default rules.
The default tables (jaxpar.engine.rules.PARAM_RULES / ACT_RULES) serve every layout, because unused
strategies are size-1 mesh axes; presets differ in the mesh shape and say what they are for.
"""

from __future__ import annotations

from jaxpar.engine.mesh import MeshSpec
from jaxpar.engine.rules import ACT_RULES, PARAM_RULES, Preset

P = MeshSpec.parse

# The token table's rows over tensor and fsdp together, not its `embed` columns over fsdp: where
# fsdp and another axis both split the batch, the lookup cannot take fsdp from the columns (XLA
# replicates the table: an involuntary full rematerialization; jaxpar inspect --doctor). Not in
# the default table: XLA's partitioner aborts on it under a pipeline.
VOCAB_SPLIT = (("vocab", ("tensor", "fsdp")), *PARAM_RULES)

PRESETS: dict[str, Preset] = {
    # One device: the 1x1x1x1 mesh, not a separate code path.
    "cpu1": Preset(P("data=1"), description="one device"),
    # 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8).
    "dp8": Preset(P("data=8"), description="pure data parallel"),
    "fsdp8": Preset(P("data=1,fsdp=8"), description="ZeRO-3: params + optimizer state 8 ways"),
    "dp2_tp4": Preset(P("data=2,tensor=4"), description="2 replicas x Megatron TP 4"),
    "dp4_tp2": Preset(P("data=4,tensor=2"), description="4 replicas x Megatron TP 2"),
    "dp2_fsdp2_tp2": Preset(P("data=2,fsdp=2,tensor=2"), VOCAB_SPLIT, description="DP x FSDP x TP"),
    "fsdp4_tp2": Preset(P("data=1,fsdp=4,tensor=2"), description="FSDP x TP"),
    # GPU and TPU layouts; multi-host ones put the processes on the batch axes (DCN).
    "h200x1": Preset(P("data=1"), description="one H200"),
    "h100x8": Preset(P("data=1,fsdp=8"), description="one 8xH100 node: FSDP over NVLink"),
    "h100x8_tp": Preset(P("data=1,fsdp=2,tensor=4"), description="8xH100: FSDP 2 x TP 4"),
    "h100x16": Preset(
        P("data=2,fsdp=8"), description="two 8xH100 nodes: DP across nodes", num_processes=2
    ),
    "v5e-8": Preset(P("data=1,fsdp=8"), description="TPU v5e-8 slice: FSDP over ICI"),
    "v5p-32": Preset(
        P("data=4,fsdp=4"), description="TPU v5p-32, 4 hosts: DP across, FSDP in", num_processes=4
    ),
    "v6e-16": Preset(
        P("data=2,fsdp=2,tensor=4"), description="TPU v6e-16 (4 hosts)", num_processes=4
    ),
    # Pipeline parallelism (jaxpar.parallel.pipeline; --set pipeline.schedule / microbatches / repeats).
    "pp2": Preset(P("data=1,pipeline=2"), description="2 pipeline stages (2 devices)"),
    "pp4": Preset(P("data=1,pipeline=4"), description="4 pipeline stages (4 devices)"),
    "dp4_pp2": Preset(P("data=4,pipeline=2"), description="4 replicas x 2 pipeline stages"),
    "dp2_pp4": Preset(P("data=2,pipeline=4"), description="2 replicas x 4 pipeline stages"),
    "dp2_tp2_pp2": Preset(P("data=2,tensor=2,pipeline=2"), description="DP x TP x PP"),
    "fsdp2_tp2_pp2": Preset(P("data=1,fsdp=2,tensor=2,pipeline=2"), description="FSDP x TP x PP"),
    # Context parallelism (long sequences; --set model.attention=ring|allgather|alltoall).
    "dp2_cp4": Preset(P("data=2,context=4"), description="2 replicas x sequence split 4 ways"),
    "fsdp2_cp2_tp2": Preset(
        P("data=1,fsdp=2,tensor=2,context=2"),
        VOCAB_SPLIT,
        description="FSDP x TP x sequence split 2 ways",
    ),
    # Expert parallelism (mixture-of-experts models: experts split, tokens sent by all-to-all).
    "dp2_ep4": Preset(P("data=2,expert=4"), description="2 replicas x experts split 4 ways"),
    "fsdp2_ep2_tp2": Preset(
        P("data=1,fsdp=2,tensor=2,expert=2"),
        VOCAB_SPLIT,
        description="FSDP x TP x experts split 2 ways",
    ),
}


def resolve(name_or_spec: str) -> Preset:
    """A preset by name, or an unnamed preset with the default rules for a mesh spec string."""
    if name_or_spec in PRESETS:
        return PRESETS[name_or_spec]
    if "=" in name_or_spec or not name_or_spec:
        return Preset(MeshSpec.parse(name_or_spec), PARAM_RULES, ACT_RULES)
    raise ValueError(
        f"unknown mesh preset {name_or_spec!r}; use one of {sorted(PRESETS)} or a spec like "
        f"'data=2,fsdp=2,tensor=2'"
    )
