"""`jaxpar inspect --doctor`: why a layout is slow, from the compiler's own record.

XLA's SPMD partitioner reports an array it cannot reshard efficiently only as a line on the C++
stderr ("Involuntary full rematerialization", no source line). The doctor compiles the step with
that stream captured and with the partitioner's input module dumped, maps each warning to the
instruction, the array (a parameter of the train state), the model source line (the HLO's op
metadata), the logical axes and the two rules whose shardings conflict, and proposes a rule change
that it verifies by compiling again. It also lists the largest collectives with their source
lines and the rule that placed the array they move.

    jaxpar inspect --recipe gpt_tiny --mesh data=2,fsdp=2,tensor=2 --doctor
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import shlex
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jaxpar.data import sources as data_lib
from jaxpar.engine import collectives
from jaxpar.engine.rules import Preset, Rules
from jaxpar.worker.training import setup

REMAT_MARK = "Involuntary full rematerialization"
_WARNING = re.compile(
    r"cannot go from sharding (?P<src>.+?) to (?P<dst>.+?) efficiently for HLO operation "
    r"%(?P<name>[\w.\-]+) = (?P<shape>\S+) (?P<opcode>[\w\-]+)\("
)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\([^()]*\)|\S+) ([\w\-]+)\((.*)$")
_KINDS = tuple(collectives.KINDS)


# --------------------------------------------------------------------------- capture


@contextlib.contextmanager
def captured_stderr(echo: bool = True) -> Iterator[list[str]]:
    """Capture file descriptor 2 (where XLA's C++ logging goes) while the block runs; the list
    yielded holds the captured text afterwards. `echo`: copy it through to the real stderr as
    it arrives, so a fatal error's message is not lost with the process."""
    out: list[str] = []
    chunks: list[bytes] = []
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()

    def pump() -> None:
        while data := os.read(read, 65536):
            chunks.append(data)
            if echo:
                os.write(saved, data)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    os.dup2(write, 2)
    os.close(write)
    try:
        yield out
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: the pump sees the end
        thread.join()
        os.close(read)
        os.close(saved)
        out.append(b"".join(chunks).decode("utf-8", "replace"))


@dataclass
class Compiled:
    """A program compiled with its partitioner warnings and HLO modules kept."""

    compiled: object
    warnings: list[dict]  # parsed involuntary-rematerialization warnings
    before: str  # HLO text given to the SPMD partitioner (global shapes, shardings, metadata)
    after: str  # the optimised HLO text, with its stack-frame tables


def compile_captured(lowered, target=None) -> Compiled:
    """Compile `lowered` with stderr captured and the partitioner's input and the optimised
    module dumped (XLA debug options of this one compilation: nothing global changes). `target`
    (jaxpar.tools.targets.Target): lowered for its devices, compiled by its compiler; its
    failures raise its one-line errors."""
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"}
        if target is None:
            compiled, err = compile_warned(lowered, options)
        else:
            try:
                options.update(target.options())
                compiled, err = compile_warned(lowered, options, echo=False)
            except Exception as e:  # noqa: BLE001 - XLA's errors are RuntimeErrors of its own
                raise target.failure(e) from None
        # the TPU compiler names its pass tpu-spmd-partitioning
        before = _read_first(dump, "*before_*spmd-partitioning*.txt")
        after = _read_first(dump, "*after_optimizations.txt")
    if target is not None:  # a target's final module (TPU: past its codegen) has the frames too
        after = compiled.as_text()
    return Compiled(compiled, parse_warnings(err), before, after or compiled.as_text())


def compile_warned(lowered, options: dict | None = None, echo: bool = True) -> tuple[object, str]:
    """(compiled, stderr text of the compilation; `echo`: also copied to the real stderr). jax's
    persistent cache is bypassed: a program loaded from it is not partitioned again, so it would
    report no warnings. jax decides once per process whether the cache is in use, so the decision
    is reset around the compilation (the config switch alone has no effect after the process's
    first compilation)."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        with captured_stderr(echo) as err:
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()  # decided again, with the cache's own setting, next time
    return compiled, err[0]


def _read_first(folder: str, pattern: str) -> str:
    for path in sorted(glob.glob(os.path.join(folder, pattern))):
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    return ""


def parse_warnings(text: str) -> list[dict]:
    """The involuntary-rematerialization warnings of a stderr capture, one dict each."""
    out = []
    for line in text.splitlines():
        if REMAT_MARK not in line:
            continue
        m = _WARNING.search(line)
        if m:
            out.append(m.groupdict())
        else:
            out.append({"src": "", "dst": "", "name": "", "shape": "", "opcode": ""})
    return out


# --------------------------------------------------------------------------- HLO reading


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    sharding: str
    op_name: str
    frame: int | None


def _balanced_end(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_instrs(hlo: str) -> dict[str, Instr]:
    """Instructions of an HLO module by name (name, shape, opcode, operands, sharding, metadata)."""
    out: dict[str, Instr] = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        rest = m.group(4)
        close = _balanced_end("(" + rest, 0) - 1
        operands = re.findall(r"%([\w.\-]+)", rest[:close])
        attrs = rest[close:]
        sh = attrs.find("sharding={")
        sharding = attrs[sh + 9 : _balanced_end(attrs, sh + 9)] if sh >= 0 else ""
        op_name = re.search(r'op_name="([^"]*)"', attrs)
        frame = re.search(r"stack_frame_id=(\d+)", attrs)
        out[m.group(1)] = Instr(
            m.group(1), m.group(2), m.group(3), operands, sharding,
            op_name.group(1) if op_name else "", int(frame.group(1)) if frame else None,
        )  # fmt: skip
    return out


def _table(hlo: str, title: str) -> dict[int, str]:
    m = re.search(rf"^{title}\n((?:\d+ .*\n?)*)", hlo, re.M)
    if not m:
        return {}
    rows = (line.split(" ", 1) for line in m.group(1).splitlines() if line.strip())
    return {int(k): v for k, v in rows}


def source_lines(hlo: str) -> dict[int, str]:
    """stack_frame_id -> "file:line (function)" of the frame's innermost location."""
    files = {k: v.strip('"') for k, v in _table(hlo, "FileNames").items()}
    funcs = {k: v.strip('"') for k, v in _table(hlo, "FunctionNames").items()}
    locs = {}
    for k, v in _table(hlo, "FileLocations").items():
        f = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", v)
        if f:
            path = _short(files.get(int(f.group(1)), "?"))
            locs[k] = f"{path}:{f.group(3)} ({funcs.get(int(f.group(2)), '?')})"
    out = {}
    for k, v in _table(hlo, "StackFrames").items():
        loc = re.search(r"file_location_id=(\d+)", v)
        if loc and int(loc.group(1)) in locs:
            out[k] = locs[int(loc.group(1))]
    return out


def _short(path: str) -> str:
    """A path relative to the current directory when under it, else as given."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith("..") else rel


def _dims(shape: str) -> list[int]:
    m = re.match(r"[a-z0-9]+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def sharding_axes(sharding: str, mesh) -> tuple[tuple[str, ...], ...] | None:
    """Mesh axes of each dimension of an HLO sharding ("{devices=[1,2]<=[2] ...}"); None for a
    replicated, maximal, tuple or unreadable one."""
    m = re.search(r"devices=\[([\d,]+)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))", sharding)
    if not m or sharding.startswith("{{"):
        return None
    tiles = [int(d) for d in m.group(1).split(",")]
    if m.group(2):
        ids = np.arange(int(np.prod([int(d) for d in m.group(2).split(",")])))
        ids = ids.reshape([int(d) for d in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    else:
        ids = np.asarray([int(d) for d in m.group(4).split(",")])
    shape = tuple(mesh.shape[a] for a in mesh.axis_names)
    if ids.size != int(np.prod(tiles)) or ids.size != int(np.prod(shape)):
        return None
    ids = ids.reshape(tiles)
    extra = 1 if "last_tile_dim_replicate" in sharding else 0
    extra_dims = re.search(r"last_tile_dims=\{([^}]*)\}", sharding)
    if extra_dims:
        extra = len([t for t in extra_dims.group(1).split(",") if t.strip()])
    coords = np.unravel_index(ids, shape)
    out = []
    for d in range(len(tiles) - extra):
        out.append(
            tuple(
                a
                for a, c in zip(mesh.axis_names, coords, strict=True)
                if tiles[d] > 1 and np.any(np.diff(c, axis=d) != 0)
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------- the diagnosis


@dataclass
class Remat:
    """One involuntary full rematerialization, mapped back to the model."""

    op: str  # the instruction the warning names
    opcode: str
    instr: str  # the matching instruction of the partitioner's input ("" when none matched)
    op_name: str  # jax's name of the operation (jit(train_step)/.../gather)
    source: str  # model source line
    src_axes: tuple | None  # mesh axes per dimension it had
    dst_axes: tuple | None  # ... and needed
    moved: tuple[str, ...]  # mesh axes that change dimension
    arrays: list[tuple[str, tuple]] = field(default_factory=list)  # (state path, logical names)
    rules: list[str] = field(default_factory=list)  # the conflicting rules

    def lines(self) -> list[str]:
        arrays = ", ".join(f"`{p}` {lg}" for p, lg in self.arrays) or "an intermediate value"
        return [
            f"- involuntary full rematerialization of `{self.instr or self.op}` "
            f"({self.op_name or self.opcode}) at {self.source or 'an unknown source line'}",
            f"  array: {arrays}; sharding per dimension {_axes_text(self.src_axes)} -> "
            f"{_axes_text(self.dst_axes)} (mesh axes moved: {', '.join(self.moved) or '?'})",
            f"  conflicting rules: {'; '.join(self.rules) or 'none found'}",
        ]


def _axes_text(axes: tuple | None) -> str:
    if axes is None:
        return "(replicated)"
    return "(" + ", ".join("+".join(a) if a else "-" for a in axes) + ")"


def _state_names(session) -> dict[str, tuple[str, tuple, object]]:
    """HLO parameter name prefix -> (state path, logical names or (), abstract leaf)."""
    prog = session.program
    logical = {
        jax.tree_util.keystr(p): v
        for p, v in jax.tree_util.tree_leaves_with_path(
            prog.param_logical, is_leaf=lambda x: x is None or isinstance(x, tuple)
        )
    }
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(prog.abstract_state):
        key = jax.tree_util.keystr(path)
        params_key = key.removeprefix("['params']") if key.startswith("['params']") else None
        names = logical.get(params_key, ()) if params_key is not None else ()
        out[re.sub(r"\W", "_", "state" + key)] = (key, tuple(names or ()), leaf)
    return out


def _match(w: dict, instrs: dict[str, Instr]) -> Instr | None:
    """The partitioner-input instruction a warning is about: the same name, else the best of the
    instructions of the same opcode whose shape tiles the warning's and whose sharding is one
    of the two the warning names."""
    exact = instrs.get(w["name"])
    if exact is not None and exact.opcode == w["opcode"]:
        return exact
    want = _dims(w["shape"])
    best, score = None, 0
    for ins in instrs.values():
        dims = _dims(ins.shape)
        if len(dims) != len(want) or any(b % a or b < a for a, b in zip(want, dims, strict=True)):
            continue
        s = (2 if ins.opcode == w["opcode"] else 0) + (
            3 if ins.sharding in (w["src"], w["dst"]) else 0
        )
        s += 1 if dims == want else 0
        if s > score and s >= 3:
            best, score = ins, s
    return best


def _params_of(ins: Instr, instrs: dict[str, Instr], names: dict, depth: int = 6) -> list[str]:
    """State parameters an instruction reads, through up to `depth` operands."""
    found, todo, seen = [], [(ins.name, 0)], set()
    while todo:
        name, d = todo.pop(0)
        if name in seen or d > depth:
            continue
        seen.add(name)
        node = instrs.get(name)
        if node is None:
            continue
        if node.opcode == "parameter":
            base = re.sub(r"\.\d+$", "", name)
            if base in names and names[base][0] not in found:
                found.append(names[base][0])
            continue
        todo += [(o, d + 1) for o in node.operands]
    return found


def _rule_for(rules: Rules, name: str | None, axis: str) -> tuple | None:
    for rule in rules:
        axes = (rule[1],) if isinstance(rule[1], str) else tuple(rule[1] or ())
        if rule[0] == name and axis in axes:
            return rule
    return None


def diagnose_remats(c: Compiled, session, preset: Preset) -> list[Remat]:
    """Map each warning of a compilation to the array, source line, logical axes and rules."""
    instrs = parse_instrs(c.before)
    frames = source_lines(c.before)
    names = _state_names(session)
    by_path = {v[0]: v for v in names.values()}
    mesh = session.mesh
    out = []
    for w in c.warnings:
        ins = _match(w, instrs) if w["name"] else None
        src, dst = sharding_axes(w["src"], mesh), sharding_axes(w["dst"], mesh)
        moved = _moved(src, dst)
        r = Remat(
            w["name"], w["opcode"], ins.name if ins else "", ins.op_name if ins else "",
            frames.get(ins.frame, "") if ins and ins.frame is not None else "", src, dst, moved,
        )  # fmt: skip
        for path in _params_of(ins, instrs, names) if ins else []:
            _, logical, leaf = by_path[path]
            r.arrays.append((path, logical))
            spec = tuple(leaf.sharding.spec)
            for dim, entry in enumerate(spec):
                entry_axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
                for a in set(entry_axes) & set(moved):
                    name = logical[dim] if dim < len(logical) else None
                    rule = _rule_for(preset.params, name, a)
                    if rule and f"parameter rule {rule}" not in r.rules:
                        r.rules.append(f"parameter rule {rule} (`{path}` dim {dim})")
        for a in moved:
            for rule in preset.acts:
                if _rule_for((rule,), rule[0], a) and f"activation rule {rule}" not in r.rules:
                    r.rules.append(f"activation rule {rule}")
        out.append(r)
    return out


def _moved(src: tuple | None, dst: tuple | None) -> tuple[str, ...]:
    """Mesh axes sharding different dimensions before and after (else those on one side only)."""

    def where(axes):
        return {a: d for d, entry in enumerate(axes or ()) for a in entry}

    a, b = where(src), where(dst)
    both = tuple(x for x in a if x in b and a[x] != b[x])
    return both or tuple(sorted(set(a) ^ set(b)))


# --------------------------------------------------------------------------- proposals


@dataclass
class Proposal:
    text: str  # the change, in words
    preset: Preset
    remats_before: int
    remats_after: int
    wire_before: int
    wire_after: int
    temp_before: int
    temp_after: int
    args_before: int = 0
    args_after: int = 0
    first: tuple | None = None  # the parameter rule the change puts first (None: a rule dropped)

    def line(self) -> str:
        return (
            f"- proposal: {self.text} — recompiled: {self.remats_before} -> {self.remats_after} "
            f"involuntary rematerializations; collective bytes sent per device "
            f"{self.wire_before:,} -> {self.wire_after:,} (saved {self.wire_before - self.wire_after:,}); "
            f"temporaries {self.temp_before:,} -> {self.temp_after:,} bytes; arguments "
            f"{self.args_before:,} -> {self.args_after:,} bytes"
        )


def candidate_changes(remats: list[Remat], session, preset: Preset) -> list[tuple]:
    """Rule changes that could remove the conflicts: give the moved mesh axis to another
    dimension of the array (a rule placed first), or drop the parameter rule that placed it.
    Each: (the change in words, the preset with it, the rule placed first or None)."""
    out: list[tuple] = []
    names = {v[0]: v for v in _state_names(session).values()}
    for r in remats:
        for path, logical in r.arrays:
            spec = tuple(names[path][2].sharding.spec)
            spec = spec + (None,) * (len(logical) - len(spec))
            for a in r.moved:
                dims = [
                    d for d, e in enumerate(spec) if a in ((e,) if isinstance(e, str) else e or ())
                ]
                for d in dims:
                    rule = _rule_for(preset.params, logical[d], a)
                    for k, other in enumerate(logical):
                        if k == d or other is None:
                            continue
                        cur = (spec[k],) if isinstance(spec[k], str) else tuple(spec[k] or ())
                        new = (other, (*cur, a) if cur else a)
                        text = f"put parameter rule {new} first"
                        out.append(
                            (text, dataclasses.replace(preset, params=(new, *preset.params)), new)
                        )
                    if rule:
                        kept = tuple(x for x in preset.params if x != rule)
                        out.append(
                            (
                                f"drop parameter rule {rule}",
                                dataclasses.replace(preset, params=kept),
                                None,
                            )
                        )
    seen, unique = set(), []
    for item in out:
        if item[0] not in seen:
            seen.add(item[0])
            unique.append(item)
    return unique


def verify(cfg, preset: Preset, run_dir: str, devices=None, target=None) -> tuple[Compiled, object]:
    """Compile the train step of `cfg` on `preset` with warnings captured: (Compiled, session).
    `target`: for its devices (`devices` then defaults to them), by its compiler."""
    if target is not None and devices is None:
        devices = target.compile_devices()
    s = setup(cfg, preset, run_dir, devices=devices, create=False)
    return compile_captured(lower_step(s), target), s


def lower_step(s):
    """The train step lowered for the abstract state and one global batch (nothing allocated)."""
    spec = data_lib.batch_spec(s.source, s.cfg.data.global_batch)
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.program.batch_shardings[k])
        for k, v in spec.items()
    }
    return s.program.train_step.lower(s.program.abstract_state, batch)


def propose(cfg, preset: Preset, run_dir: str, remats, session, base: Compiled, devices=None,
            target=None):  # fmt: skip
    """Each candidate change compiled again; the ones that remove warnings, best first."""
    wire0 = collectives.total_wire_bytes(collectives.audit(base.compiled, session.mesh))
    mem0 = collectives.memory(base.compiled)
    found = []
    for text, p, first in candidate_changes(remats, session, preset):
        try:
            c, s = verify(cfg, p, run_dir, devices, target)
        except ValueError:  # the change does not divide some array (or does not fit the target)
            continue
        wire = collectives.total_wire_bytes(collectives.audit(c.compiled, s.mesh))
        mem = collectives.memory(c.compiled)
        prop = Proposal(text, p, len(base.warnings), len(c.warnings), wire0, wire, mem0["temps"],
                        mem["temps"], mem0["arguments"], mem["arguments"], first)  # fmt: skip
        if prop.remats_after < prop.remats_before:
            found.append(prop)
    # No warning left first; then the least memory (a rule dropped costs parameter sharding).
    return sorted(found, key=lambda q: (q.remats_after, q.args_after, q.wire_after))


def apply_lines(best: Proposal, command: str | None, cfg=None, presets=None) -> list[str]:
    """How to apply a proposal: a rule placed first is the recipe's `param_rules_first` (in the
    recipe, or --set on the command given), and a preset of `presets` ({name: Preset}: the
    built-in ones, jaxpar.meshes.PRESETS) of the same mesh that already puts it first is named;
    a dropped rule needs a preset of one's own."""
    if best.first is None:
        return [f"- apply the first with a preset whose parameter rules are {best.preset.params}"]
    have = [list(r) for r in getattr(cfg, "param_rules_first", ())]
    rules = [*have, [best.first[0], _json_axes(best.first[1])]]
    value = json.dumps(rules, separators=(",", ":"))
    out = [
        f"- apply the first: in the recipe, TrainConfig(param_rules_first=({best.first!r},)) "
        f"(parameter rules placed before the preset's)"
    ]
    if command is not None:
        out.append(f"  or run: {command} --set {shlex.quote('param_rules_first=' + value)}")
    names = presets_with_first(best.first, best.preset.mesh, presets)
    if names:
        out.append(f"  or use the built-in preset {' / '.join(names)} (same mesh), whose "
                   f"parameter rules already put it first: --mesh {names[0]}")  # fmt: skip
    return out


def inspect_command(recipe: str, mesh: str | None, overrides=(), target: str | None = None) -> str:
    """`jaxpar inspect ... --doctor` with the recipe, mesh, --set and --target as given."""
    out = f"jaxpar inspect --recipe {shlex.quote(recipe)}"
    out += f" --mesh {shlex.quote(mesh)}" if mesh is not None else ""
    out += "".join(f" --set {shlex.quote(o)}" for o in overrides)
    out += f" --target {shlex.quote(target)}" if target is not None else ""
    return out + " --doctor"


def _json_axes(axes):
    return axes if isinstance(axes, str) or axes is None else list(axes)


def presets_with_first(rule: tuple, mesh, presets=None) -> list[str]:
    """The presets of `presets` ({name: Preset}) of the same mesh sizes whose parameter rules
    start with `rule`."""

    def sizes(m) -> dict:
        return {a: n for a, n in m.sizes().items() if n != 1}

    want = sizes(mesh)
    out = []
    for name, p in (presets or {}).items():
        if p.params[:1] == (rule,) and sizes(p.mesh) == want:
            out.append(name)
    return out


# --------------------------------------------------------------------------- collectives


def largest_collectives(c: Compiled, session, preset: Preset, top: int = 8) -> list[dict]:
    """The `top` collectives by bytes moved per step, with source line and responsible rule."""
    colls = collectives.audit(c.compiled, session.mesh)
    instrs = [
        ins
        for ins in parse_instrs(c.after).values()
        if ins.opcode.removesuffix("-start").removeprefix("ragged-") in _KINDS
    ]
    frames = source_lines(c.after)
    if len(instrs) != len(colls):
        instrs = [None] * len(colls)
    rows = []
    for coll, ins in zip(colls, instrs, strict=True):
        rows.append(
            {
                "kind": coll.kind, "mesh_axes": coll.mesh_axes, "bytes": coll.bytes * coll.executions,
                "wire_bytes": round(coll.wire_bytes * coll.executions),
                "op_name": ins.op_name if ins else "",
                "source": frames.get(ins.frame, "") if ins and ins.frame is not None else "",
                "rule": _responsible(coll.mesh_axes, preset),
            }
        )  # fmt: skip
    rows.sort(key=lambda r: -r["wire_bytes"])
    return rows[:top]


def _responsible(axes: tuple[str, ...], preset: Preset) -> str:
    """The rules that place arrays on the mesh axes a collective spans."""
    found = [
        f"{kind} {rule}"
        for kind, table in (("parameter", preset.params), ("activation", preset.acts))
        for rule in table
        if set(axes) & set((rule[1],) if isinstance(rule[1], str) else tuple(rule[1] or ()))
    ]
    return "; ".join(found) or "-"


# --------------------------------------------------------------------------- report


def doctor(cfg, preset: Preset, run_dir: str, devices=None, propose_fixes: bool = True,
           target=None) -> dict:  # fmt: skip
    """Compile, diagnose, propose: {"remats", "proposals", "collectives"}. `target`
    (jaxpar.tools.targets.Target): the warnings of the target's own partitioner."""
    c, s = verify(cfg, preset, run_dir, devices, target)
    remats = diagnose_remats(c, s, preset)
    props = (
        propose(cfg, preset, run_dir, remats, s, c, devices, target)
        if remats and propose_fixes
        else []
    )
    return {
        "remats": remats, "proposals": props, "collectives": largest_collectives(c, s, preset),
        "compiled": c, "session": s,
    }  # fmt: skip


def doctor_lines(result: dict, command: str | None = None, cfg=None, presets=None) -> list[str]:
    """The doctor's section of a report (markdown). `command`: the inspect command that gave
    it (recipe, mesh, --set as given), for the command that applies the best change; `cfg`: its
    config (the rules it already puts first); `presets`: the named presets a fix may point to."""
    out = ["", "## doctor: SPMD partitioner warnings", ""]
    remats = result["remats"]
    if not remats:
        out.append("no involuntary rematerializations")
    for r in remats:
        out += r.lines()
    if remats:
        out.append("")
        props = result["proposals"]
        if props:
            out += [p.line() for p in props[:3]]
            out += apply_lines(props[0], command, cfg, presets)
        else:
            out.append("- no single rule change removed them (tried moving and dropping the rules)")
    out += ["", "## doctor: largest collectives (bytes sent per device per step)", "",
            "| kind | mesh axes | wire bytes | operation | source | rules placing arrays on these axes |",
            "|---|---|---:|---|---|---|"]  # fmt: skip
    for r in result["collectives"]:
        out.append(
            f"| {r['kind']} | {','.join(r['mesh_axes']) or '-'} | {r['wire_bytes']:,} | "
            f"{r['op_name'] or '?'} | {r['source'] or '?'} | {r['rule']} |"
        )
    return out
