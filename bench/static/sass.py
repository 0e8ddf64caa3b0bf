"""Reading the binary: ptxas and nvdisasm as the installed Triton ships them, and the SASS's MMAs,
loops and instruction mix."""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from pathlib import Path


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


@functools.lru_cache(maxsize=None)
def ptxas(capability: int) -> str:
    """The ptxas Triton itself uses for this target (3.9: the legacy one below sm_90, else
    ptxas-blackwell; older Triton: one ptxas)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            return get_ptxas(capability).path
        except TypeError:  # Triton versions whose get_ptxas takes no architecture
            return get_ptxas().path
    except ImportError:
        return _tool("ptxas")


@functools.lru_cache(maxsize=None)
def ptxas_flags(path: str) -> tuple[str, ...]:
    """The flags of Triton's own ptxas call that change code generation: -lineinfo always, and
    --regAllocOptLevel=2 where Triton passes it (its workaround for ptxas 13)."""
    import inspect

    from triton.backends.nvidia import compiler

    flags = ["-lineinfo"]
    if "regAllocOptLevel=2" in inspect.getsource(compiler):
        flags.append("--regAllocOptLevel=2")
    return tuple(flags)


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr


# HGMMA: Hopper's warpgroup MMA (wgmma), its shape in the opcode (HGMMA.64x128x16.F32.BF16); HMMA:
# mma.sync (HMMA.16816.F32.BF16). Blackwell's tcgen05.mma is UTC*MMA with no shape in the opcode
# ("UTCHMMA gdesc[UR16], gdesc[UR24], tmem[UR12], tmem[UR48], idesc[UR49], !UPT"; A from tensor memory:
# "UTCHMMA tmem[UR14], gdesc[...], ..."): UTCHMMA for kind::f16 and kind::tf32, UTCQMMA for kind::f8f6f4,
# UTCIMMA for kind::i8 (ptxas 13, Triton 3.9); UTCOMMA (kind::mxf4) not seen here. Its M and N are in
# the instruction descriptor, a uniform register (idesc[URn]) set by a UMOV.
MMA = re.compile(r"\b(HGMMA|HMMA|UTC[A-Z]*MMA)\b(?:\.(\S+))?")
# Blackwell's tensor memory: LDTM / STTM (tcgen05.ld / .st, registers <-> tensor memory), UTCCP (tcgen05.cp,
# shared -> tensor memory); UTCBAR is tcgen05.commit (an mbarrier arrives when the issued MMAs are done).
TMEM = re.compile(r"\b(LDTM|STTM|UTCCP|UTCSHIFT)\b")
COPY = {"TMA": re.compile(r"\bUTMALDG\b"), "cp.async": re.compile(r"\bLDGSTS\b"), "ld.global": re.compile(r"\bLDG\b")}


def disassemble(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's code, and labels as (address, '.L_x_n:')."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = run([_tool("nvdisasm"), "-c", str(path)])
    lines, pending = [], []
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            address = int(m.group(1), 16)
            lines.extend((address, name + ":") for name in pending)
            pending = []
            lines.append((address, m.group(2).strip()))
    return lines


def opcode(instruction: str) -> str:
    """The opcode without predicate and modifiers: '@!P0 BRA `(.L_x_3)' -> 'BRA'."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def mma_macs(instruction: str) -> int:
    """Multiply-adds one warp's (HMMA) or one warpgroup's (HGMMA) instruction performs."""
    kind, shape = MMA.search(instruction).groups()
    if kind == "HGMMA":
        m, n, k = (int(x) for x in shape.split(".")[0].split("x"))
        return m * n * k
    if kind == "HMMA":
        digits = shape.split(".")[0]  # 16816 = m16 n8 k16; 1688 = m16 n8 k8
        return 16 * 8 * int(digits[3:])
    return 0


def find_loops(sass: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) index ranges of the code's loops: every backward branch closes one, except a
    jump back from code past an EXIT (ptxas puts the retry loops of mbarrier waits, TMA's among
    them, after the function's end; each jumps back to where its wait resumes)."""
    labels = {text[:-1]: i for i, (_, text) in enumerate(sass) if text.endswith(":")}
    loops = []
    for i, (_, text) in enumerate(sass):
        if opcode(text) == "BRA":
            target = re.search(r"\(?(\.L_x_\d+)\)?", text)
            if target and labels.get(target.group(1), i) < i:
                first = labels[target.group(1)]
                if not any(t.split()[:1] == ["EXIT"] for _, t in sass[first:i]):
                    loops.append((first, i))
    return loops


def hot_loop(sass):
    """The innermost loop with the most MMA instructions (ties: the shortest), or None."""
    def mmas(lo, hi):
        return sum(1 for _, t in sass[lo:hi + 1] if MMA.search(t))

    loops = [(lo, hi) for lo, hi in find_loops(sass) if mmas(lo, hi)]
    innermost = [(lo, hi) for lo, hi in loops
                 if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in loops)]
    if not innermost:
        return None
    return min(innermost, key=lambda r: (-mmas(*r), r[1] - r[0]))


def loop_body(sass, loop) -> list[str]:
    """The instructions of ``loop`` (an index range of ``sass``), labels left out."""
    return [t for _, t in sass[loop[0]:loop[1] + 1] if not t.endswith(":")]


def instruction_mix(instructions: list[str]) -> dict:
    groups = {"mma": 0, "exp2/mufu": 0, "fp32 math": 0, "async copy": 0, "shared ld/st": 0, "tensor memory": 0,
              "global ld/st": 0, "local ld/st": 0, "sync/wait": 0, "other": 0}
    for text in instructions:
        op = opcode(text)
        if MMA.search(text):
            groups["mma"] += 1
        elif op == "MUFU":
            groups["exp2/mufu"] += 1
        elif op in ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "F2FP", "FMUL2", "FADD2", "FFMA2"):
            groups["fp32 math"] += 1
        elif op in ("LDGSTS", "UTMALDG"):
            groups["async copy"] += 1
        elif op in ("LDS", "STS", "LDSM", "STSM"):
            groups["shared ld/st"] += 1
        elif TMEM.search(text):
            groups["tensor memory"] += 1
        elif op in ("LDG", "STG", "UTMASTG"):
            groups["global ld/st"] += 1
        elif op in ("LDL", "STL"):  # spilled registers
            groups["local ld/st"] += 1
        elif op in ("WARPGROUP", "BAR", "SYNCS", "DEPBAR", "WARPSYNC", "ARRIVES", "UTMACCTL", "UTCBAR"):
            groups["sync/wait"] += 1
        else:
            groups["other"] += 1
    return groups


_FP32_OPS = ("FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2")


def fp32_ops(instructions: list[str]) -> dict:
    """Counts of fp32 multiply-adds, multiplies and adds (the paired forms of sm_100 where present):
    compiled without floating-point fusion, an FFMA becomes an FMUL and an FADD."""
    counts = {name: 0 for name in _FP32_OPS}
    for text in instructions:
        op = opcode(text)
        if op in counts:
            counts[op] += 1
    return {name: n for name, n in counts.items() if n or len(name) == 4}
