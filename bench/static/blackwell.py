"""Blackwell: tcgen05 MMAs and their shapes, tensor memory, warp-specialized partitions."""

from __future__ import annotations

import re

from bench.static.sass import MMA, TMEM, loop_body, opcode

# K of one tcgen05.mma per kind (32 bytes of each A and B row: 16 halves, 8 tf32, 32 bytes of fp8 or int8).
_TCGEN05_K = {"f16": 16, "tf32": 8, "f8f6f4": 32, "i8": 32, "mxf8f6f4": 32, "mxf4": 64, "mxf4nvf4": 64}
_UTC_KIND = {"UTCHMMA": "f16", "UTCQMMA": "f8f6f4", "UTCIMMA": "i8", "UTCOMMA": "mxf4"}
_WORK = re.compile(r"\b(HGMMA|HMMA|UTC[A-Z]*MMA|LDTM|STTM|UTCCP|MUFU|UTMALDG|LDGSTS)\b")
_LOAD = re.compile(r"\b(UTMALDG|LDGSTS)\b")


def idesc_shape(idesc: int, kind: str) -> tuple[int, int, int]:
    """(M, N, K) of a tcgen05.mma from its 32-bit instruction descriptor (PTX ISA, tcgen05
    "Instruction descriptor"): N >> 3 in bits 17-22, M >> 4 in bits 24-28; K is the kind's (an A of
    format 2, bits 7-9, under kind::f16's opcode is tf32)."""
    if kind == "f16" and (idesc >> 7) & 7 == 2:
        kind = "tf32"
    return ((idesc >> 24) & 0x1F) << 4, ((idesc >> 17) & 0x3F) << 3, _TCGEN05_K.get(kind, 0)


def ptx_tcgen05(ptx: str) -> list[dict]:
    """Every tcgen05.mma of the PTX in order: kind, cta_group, (M, N, K) where its instruction descriptor
    is a constant (an immediate, or a register with one mov.b32 value), and whether A is read from
    tensor memory (P of P @ V kept there) rather than shared memory."""
    values: dict[str, set] = {}
    for reg, value in re.findall(r"\bmov\.b32\s+(%r\d+),\s*(-?\d+);", ptx):
        values.setdefault(reg, set()).add(int(value) & 0xFFFFFFFF)
    mmas = []
    for m in re.finditer(r"\btcgen05\.mma(\S*)\s+([^;]*);", ptx):
        modifiers, operands = m.group(1), [o.strip() for o in m.group(2).split(",")]
        kind = re.search(r"kind::(\w+)", modifiers)
        kind = kind.group(1) if kind else "f16"
        cta = re.search(r"cta_group::(\d)", modifiers)
        idesc = operands[3] if len(operands) > 3 else ""
        value = int(idesc, 0) if re.fullmatch(r"-?\d+|0x[0-9a-fA-F]+", idesc) else (
            next(iter(values[idesc])) if len(values.get(idesc, ())) == 1 else None)
        mmas.append({"kind": kind, "cta_group": int(cta.group(1)) if cta else 1,
                     "shape": idesc_shape(value, kind) if value is not None else None,
                     "a_in_tmem": bool(operands) and len(operands) > 1 and operands[1].startswith("[")})
    return mmas


def sass_idesc(sass: list[tuple[int, str]], i: int, loop: tuple[int, int] | None = None) -> int | None:
    """The instruction descriptor of the UTC*MMA at ``i``: the immediate of the UMOV that last wrote its
    idesc register before it (inside ``loop``: earlier in the body, then later in it round the back
    edge, then before the loop), or None where another instruction wrote it."""
    reg = re.search(r"idesc\[(UR\d+)\]", sass[i][1])
    if not reg:
        return None
    reg = reg.group(1)
    pair = f"UR{int(reg[2:]) - 1}"  # a 64-bit write to the register below writes this one too
    writes = re.compile(rf"^(?:@\S+\s+)?(\S+)\s+({reg}|{pair})\b")
    lo, hi = loop if loop else (i, i)
    order = [*range(i - 1, lo - 1, -1), *range(hi, i, -1), *range(lo - 1, -1, -1)] if loop else range(i - 1, -1, -1)
    for j in order:
        written = writes.match(sass[j][1])
        if not written or (written.group(2) == pair and ".64" not in written.group(1)):
            continue
        value = re.fullmatch(r"(?:@\S+\s+)?UMOV\s+\S+,\s*(0x[0-9a-f]+|\d+)", sass[j][1])
        return int(value.group(1), 0) if value and written.group(2) == reg else None
    return None


def tcgen05_macs(sass, indices, loop, ptx_mmas) -> tuple[int, list] | None:
    """Multiply-adds a CTA's tcgen05 MMAs at ``indices`` of the SASS execute (each is issued once per
    CTA, by one thread; with cta_group::2 a pair of CTAs shares each), and their shapes; None where
    a shape is unknown. A shape comes from the SASS instruction descriptor, else from the PTX where
    all its tcgen05.mma share one."""
    ptx_shapes = {(m["kind"], m["shape"]) for m in ptx_mmas}
    pair = 2 if any(m["cta_group"] == 2 for m in ptx_mmas) else 1
    total, shapes = 0, []
    for i in indices:
        kind = _UTC_KIND.get(MMA.search(sass[i][1]).group(1), "f16")
        idesc = sass_idesc(sass, i, loop)
        if idesc is not None:
            shape = idesc_shape(idesc, kind)
        elif len(ptx_shapes) == 1 and None not in next(iter(ptx_shapes)):
            shape = next(iter(ptx_shapes))[1]
        else:
            return None
        if not all(shape):
            return None
        total += shape[0] * shape[1] * shape[2] // pair
        shapes.append(shape)
    return total, shapes


def ttgir_partitions(ttgir: str) -> list[dict]:
    """The partitions a warp-specialized kernel declares (TTGIR ``ttg.warp_specialize``): per partition
    its warps, the registers it asks for and its role (mma: issues the MMAs; load: the TMA or cp.async
    copies; compute: the rest, softmax and the accumulator's corrections among it). Empty where none."""
    if "ttg.warp_specialize" not in ttgir:
        return []
    requested = [[int(x) for x in group.split(",")]
                 for group in re.findall(r"requestedRegisters = array<i32:\s*([\d,\s]+)>", ttgir)]
    parts, op = [], -1
    for header in re.finditer(r"\bpartition(\d+)\(.*?\)\s*num_warps\((\d+)\)", ttgir):
        index = int(header.group(1))
        op += index == 0
        end = ttgir.find("ttg.warp_return", header.end())
        body = ttgir[header.end():end if end >= 0 else None]
        role = ("mma" if re.search(r"tc_gen5_mma|warp_group_dot", body) else
                "load" if re.search(r"async_tma_copy_global_to_local|async_copy_global_to_local|async_tma_gather", body)
                else "compute")
        regs = requested[op][index] if op < len(requested) and index < len(requested[op]) else None
        parts.append({"partition": index, "warps": int(header.group(2)), "requested_registers": regs, "role": role,
                      "op": op})
    return parts


def _reachable(sass: list[tuple[int, str]], start: int, labels: dict) -> set[int]:
    """Indices of the SASS reachable from ``start`` along fall-through and branches (BRX, the warp
    dispatch of a warp-specialized kernel, is not followed)."""
    seen, todo = set(), [start]
    while todo:
        i = todo.pop()
        while i < len(sass) and i not in seen:
            seen.add(i)
            text = sass[i][1]
            if text.endswith(":"):
                i += 1
                continue
            words = text.split()
            conditional = words[0].startswith("@") or (len(words) > 2 and re.match(r"!?U?P[T\d]", words[1]))
            op = opcode(text)
            target = re.search(r"`\((\.L_x_\d+)\)", text)
            if op == "BRA" and target and target.group(1) in labels:
                todo.append(labels[target.group(1)])
            if op in ("BRA", "BRX", "EXIT", "RET", "JMP", "JMX") and not conditional:
                break
            i += 1
    return seen


def _sass_partitions(sass: list[tuple[int, str]]) -> tuple[set[int], list[dict]]:
    """A warp-specialized kernel's SASS by partition: the default partition's code (reachable from the
    entry; it includes the dispatch, where the other warps wait for work and jump, BRX, to their
    partition's code), and in the jump's order (Triton numbers the partitions of each warp-specialized
    loop in turn) each branch target with the code it reaches (not the default's), its role from its
    code (mma: issues the MMAs; load: the TMA or cp.async copies; compute: the rest) unless it does no
    work (a warpgroup's padding warps)."""
    labels = {text[:-1]: i for i, (_, text) in enumerate(sass) if text.endswith(":")}
    default = _reachable(sass, 0, labels)
    regions = []
    for _, text in sass:
        if opcode(text) != "BRX" or "BRANCH_TARGETS" not in text:
            continue
        for name in re.findall(r"\.L_x_\d+", text.split("BRANCH_TARGETS", 1)[1]):
            if name not in labels:
                continue
            mine = _reachable(sass, labels[name], labels) - default
            code = [sass[i][1] for i in sorted(mine) if not sass[i][1].endswith(":")]
            if not any(_WORK.search(t) for t in code):
                continue
            role = ("mma" if any(MMA.search(t) for t in code) else "load" if any(_LOAD.search(t) for t in code)
                    else "compute")
            regions.append({"indices": mine, "role": role})
    return default, regions


def _registers_at(sass, indices: set[int], at: int | None) -> int | None:
    """The register count setmaxnreg (USETMAXREG) last set before index ``at`` (the partition's loop) in
    this partition's code, else the first it sets there."""
    marks = [i for i in sorted(indices) if opcode(sass[i][1]) == "USETMAXREG"]
    before = [i for i in marks if at is not None and i < at]
    chosen = before[-1] if before else marks[0] if marks else None
    return int(sass[chosen][1].split()[-1], 0) if chosen is not None else None


def _partition_loop(sass, loops, indices: set[int]):
    """The steady-state loop of a partition's code: of its innermost loops that do work (MMA, tensor
    memory, MUFU, tile copies), the one with the most MMAs, then the most work, then the shortest (of
    the masked and unmasked loops of a causal kernel, the unmasked)."""
    def count(a, b, rx):
        return sum(1 for _, t in sass[a:b + 1] if rx.search(t))

    mine = [(a, b) for a, b in loops if a in indices and b in indices and count(a, b, _WORK)]
    innermost = [(a, b) for a, b in mine if not any((x, y) != (a, b) and a <= x and y <= b for x, y in mine)]
    if not innermost:
        return None
    return min(innermost, key=lambda r: (-count(*r, MMA), -count(*r, _WORK), r[1] - r[0]))


def tmem_counts(code: list[str]) -> dict:
    """Tensor-memory instructions by opcode (LDTM, STTM, UTCCP)."""
    counts: dict[str, int] = {}
    for text in code:
        if m := TMEM.search(text):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def find_partitions(sass, loops, declared: list[dict], ttgir: str) -> list[dict]:
    """A warp-specialized kernel's partitions, the default first: role, warps, registers (setmaxnreg's
    count in the SASS where its loop runs), the TTGIR's requested count, which warp-specialized loop
    of the source (``op``: a causal kernel has two) and the partition's loop (index range, or None).
    The SASS partitions are the declared ones in order where their roles agree, else matched by role
    and registers (``op`` then unknown)."""
    default_code, regions = _sass_partitions(sass)
    if not regions:
        return []
    warps = re.search(r'"ttg.num-warps"\s*=\s*(\d+)', ttgir)
    loop = _partition_loop(sass, loops, default_code)
    default = {"partition": "default", "role": "compute", "warps": int(warps.group(1)) if warps else None,
               "registers": _registers_at(sass, default_code, loop[0] if loop else None),
               "requested_registers": None, "op": None, "loop": loop}
    if loop and any(MMA.search(t) for t in loop_body(sass, loop)):
        default["role"] = "mma"
    in_order = len(regions) == len(declared) and all(r["role"] == d["role"] for r, d in zip(regions, declared))
    parts, unused = [default], list(declared)
    for k, region in enumerate(regions):
        loop = _partition_loop(sass, loops, region["indices"])
        registers = _registers_at(sass, region["indices"], loop[0] if loop else None)
        if in_order:
            match = declared[k]
        else:
            same = [d for d in unused if d["role"] == region["role"]]
            match = next((d for d in same if d["requested_registers"] == registers), same[0] if same else None)
            if match:
                unused.remove(match)
        parts.append({"partition": match["partition"] if match else None, "role": region["role"],
                      "warps": match["warps"] if match else None, "registers": registers,
                      "requested_registers": match["requested_registers"] if match else None,
                      "op": match["op"] if match and in_order else None, "loop": loop})
    for part in parts:
        part["loop_instructions"] = len(loop_body(sass, part["loop"])) if part["loop"] else 0
    return parts


def steady_state(sass, partitions: list[dict]) -> tuple[tuple[int, int] | None, list[dict]]:
    """The hot loop of a warp-specialized kernel and the partitions that run beside it: the MMA
    partition's loop with the most MMAs (ties: the first warp-specialized loop of the source, a causal
    kernel's unmasked one), with the default partition and the other partitions of its loop."""
    def mmas(part):
        return sum(1 for t in loop_body(sass, part["loop"]) if MMA.search(t)) if part["loop"] else 0

    workers = [p for p in partitions[1:] if p["role"] == "mma" and p["loop"]]
    if not workers:
        return None, partitions
    best = min(workers, key=lambda p: (-mmas(p), p["op"] if p["op"] is not None else 0))
    if best["op"] is None:
        return best["loop"], partitions
    return best["loop"], [partitions[0]] + [p for p in partitions[1:] if p["op"] == best["op"]]
