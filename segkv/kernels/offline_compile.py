"""Compile the attention kernels for a CUDA target on any machine, no GPU needed.

The installed Triton lowers a kernel for, e.g., Hopper (``sm_90a``) and its bundled ``ptxas``
assembles it. What comes back answers questions that otherwise cost device time: how many
shared-memory buffers the pipeliner gave the K/V tiles and whether its in-loop wait leaves the
next tile in flight (Triton IR), how much shared memory a launch needs (does it fit at all), and
registers and spills (how many programs fit on a multiprocessor). Triton's IR spelling differs
between versions; the helpers here accept the spellings of Triton 3.x.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# plan index arrays (int32) of the stage-1 kernels
INDEX_ARGS = frozenset({"page_table", "page_rows", "page_key_start", "work_pages",
                        "work_partial_start", "partial_row", "partial_offset", "partial_direct", "reduce_ptr",
                        "reduce_partials", "COUNTERS"})
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
# Hopper: 228 KB of shared memory per multiprocessor, at most 227 KB for one program
MAX_SHARED_PER_PROGRAM = 227 * 1024


@dataclass(frozen=True, slots=True)
class OfflineKernel:
    """One compiled kernel: its Triton GPU IR, PTX, shared memory (bytes) and, from ``ptxas -v``,
    registers per thread and spilled bytes (None when no ``ptxas`` ran)."""

    ttgir: str
    ptx: str
    shared: int
    registers: int | None
    spill_bytes: int | None

    def pipeline_buffers(self, rows: int, cols: int) -> int:
        """Slots of the largest shared-memory buffer of ``rows x cols`` tiles (K/V or latent):
        ``memdesc<S x rows x cols x ...>`` in the IR; 0 when there is none."""
        slots = [int(m) for m in re.findall(rf"memdesc<(\d+)x{rows}x{cols}x", self.ttgir)]
        return max(slots, default=0)

    def loop_waits(self) -> list[int]:
        """The ``num`` of every asynchronous-copy wait in the IR, in order (the in-loop wait leaves
        that many copy groups in flight; 0 waits for everything)."""
        return [int(n) for n in re.findall(r"async_wait[^\n]*?num\s*=\s*(\d+)", self.ttgir)]

    def _loop_lines(self) -> list[str]:
        """The IR lines inside its loops (a nested loop's once per enclosing loop)."""
        lines = self.ttgir.splitlines()
        inside = []
        for i, line in enumerate(lines):
            if "scf.for" not in line:
                continue
            indent = len(line) - len(line.lstrip())
            for body in lines[i + 1:]:
                if body.strip().startswith("}") and len(body) - len(body.lstrip()) == indent:
                    break
                inside.append(body)
        return inside

    def loop_reductions(self) -> int:
        """Reductions (``tt.reduce``: a row max or sum, across warps when the reduced dimension is
        split over them) inside the IR's loops."""
        return sum("tt.reduce" in line and "tt.reduce.return" not in line for line in self._loop_lines())

    def loop_shared_stores(self) -> int:
        """Tensors written to shared memory inside the IR's loops by the program itself
        (``local_alloc`` / ``local_store``: a layout change such as P's for the P.V product;
        the pipeliner's asynchronous copies are not counted)."""
        return sum("ttg.local_alloc %" in line or "ttg.local_store" in line for line in self._loop_lines())

    def mma_warps(self) -> list[list[int]]:
        """The ``warpsPerCTA`` of each MMA layout of the IR (warps per dimension of the products'
        results: a reduction along a dimension of 1 warp stays inside the warps)."""
        return [[int(n) for n in m.split(",")]
                for m in re.findall(r"nvidia_mma<\{[^}]*?warpsPerCTA = \[([\d, ]+)\]", self.ttgir)]

    def mma_chains(self) -> list[int]:
        """The dependent MMA chains of the IR's products, each in steps of 16 along the reduced
        dimension (a 16-deep k-loop of the MMA instructions per warp): a product whose accumulator
        is another product's result continues that one's chain. One entry per chain's last
        product, sorted. A chain's steps wait on each other's results, so with few warps per
        scheduler its length, not the step count, sets the time. ``tt.dot`` products only (the
        reduced dimension is the first operand's last); warp-group MMAs are not counted."""
        steps, ends = {}, {}
        for m in re.finditer(r"(%[\w.]+) = tt\.dot (%[\w.]+), %[\w.]+, (%[\w.]+)[^\n]*?"
                             r": tensor<(?:\d+x)*?(\d+)x[a-z]", self.ttgir):
            result, _, acc, k = m.groups()
            steps[result] = steps.get(acc, 0) + int(k) // 16
            ends.pop(acc, None)
            ends[result] = steps[result]
        return sorted(ends.values())


def pdl_order(ptx: str) -> list[str]:
    """A kernel's PDL instructions in program order: ``"wait"`` and ``"launch_dependents"``."""
    return re.findall(r"griddepcontrol\.(\w+)", ptx)


def timer_reads(ptx: str) -> dict[str, int]:
    """How often a kernel reads the GPU's timers (``kernels.attention.timeline``): ``globaltimer`` and ``clock64``."""
    return {"globaltimer": ptx.count("%globaltimer"), "clock64": ptx.count("%clock64")}


def _arg_type(name: str, pointers: dict[str, str]) -> str:
    if name in pointers:
        return pointers[name]
    if name in INDEX_ARGS:
        return "*i32"
    if name == "scale":
        return "fp32"
    return "i32"


def compile_offline(fn, constants: dict, *, pointers: dict[str, str], arch: int = 90, assemble: bool = True
                    ) -> OfflineKernel:
    """Compile jit function ``fn`` with ``constants`` (its constexprs plus ``num_warps``,
    ``num_stages`` and optionally ``maxnreg``, as the launchers' ``*_launch`` helpers return them)
    for CUDA capability ``arch``. ``pointers`` names the pointer arguments' types (``"*bf16"``);
    plan index arrays are int32 pointers, ``scale`` a float, everything else an int32; pointers,
    strides and the head count are assumed multiples of 16 as the JIT specialises them (16 or
    128 heads). ``assemble`` runs
    Triton's ``ptxas -v`` for registers and spills."""
    options = {k: constants[k] for k in LAUNCH_OPTIONS if k in constants}
    constexprs = {k: v for k, v in constants.items() if k not in LAUNCH_OPTIONS}
    params = inspect.signature(fn.fn).parameters
    # optional arguments left out (a default of None, e.g. timeline stamps) compile away, as at a launch
    constexprs.update({n: None for n, p in params.items()
                       if p.default is None and n not in constexprs and n not in pointers})
    # constexprs left out take their defaults (e.g. KEY_MASKS off), as at a launch
    constexprs.update({n: p.default for n, p in params.items()
                       if n not in constexprs and p.default is not inspect.Parameter.empty
                       and "constexpr" in str(p.annotation)})
    names = list(params)
    signature = {n: "constexpr" if n in constexprs else _arg_type(n, pointers) for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*") or n.startswith("stride") or n == "num_heads"}
    target = GPUTarget("cuda", arch, 32)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, aligned), target=target, options=options)
    ptx = compiled.asm["ptx"]
    registers = spills = None
    if assemble:
        registers, spills = _ptxas_usage(ptx, arch)
    return OfflineKernel(compiled.asm["ttgir"], ptx, compiled.metadata.shared, registers, spills)


def _bundled_tool(*names: str) -> str:
    """The first of ``names`` that Triton bundles (``backends/nvidia/bin``), else the bare name."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return next((os.path.join(bin_dir, n) for n in names if os.path.exists(os.path.join(bin_dir, n))), names[-1])


_BRANCH = re.compile(r"BRA[^`]*`\(\.(L_x_\d+)\)")  # a SASS branch and its target label


def sass_counts(ptx: str, arch: int = 90) -> dict:
    """Machine instructions of a kernel's PTX once assembled (bundled ``ptxas`` and ``nvdisasm``):
    ``{"total": n, "loops": [{"instructions", "mma", "ldmatrix", "barriers", "local", "skippable"}, ...]}``,
    a loop being the span from a backward branch's target to the branch, ``skippable`` the
    instructions its forward branches can jump over (``instructions - skippable``: the shortest
    path through an iteration). What the GPU issues per program and per tile: a latency-bound
    program with few warps per scheduler pays for each."""
    with tempfile.TemporaryDirectory() as tmp:
        _assemble(ptx, arch, tmp)
        text = subprocess.run([_bundled_tool("nvdisasm"), "-c", os.path.join(tmp, "kernel.o")], check=True,
                              capture_output=True, text=True).stdout
    code, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(code)
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if ins:
            code.append(ins.group(1))
    loops = []
    for i, ins in enumerate(code):
        target = _BRANCH.search(ins)
        if target and labels.get(target.group(1), i + 1) <= i:
            start = labels[target.group(1)]
            body = code[start:i + 1]
            count = lambda *ops: sum(any(op in x for op in ops) for x in body)  # noqa: E731
            jumps = [(start + j, labels[m.group(1)]) for j, x in enumerate(body)
                     if (m := _BRANCH.search(x)) and start + j < labels.get(m.group(1), -1) <= i]
            loops.append({"instructions": len(body), "mma": count("HMMA", "HGMMA"), "ldmatrix": count("LDSM"),
                          "barriers": count("BAR"), "local": count("LDL", "STL"),
                          "skippable": sum(to - at - 1 for at, to in jumps)})
    return {"total": len(code), "loops": loops}


def _assemble(ptx: str, arch: int, tmp: str) -> subprocess.CompletedProcess:
    """``ptx`` assembled by Triton's bundled ``ptxas -v`` into ``tmp/kernel.o`` (``sm_<arch>a`` from
    Hopper on); the finished process, its report in ``stderr``. A failure raises with ptxas's
    message."""
    path = os.path.join(tmp, "kernel.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    suffix = "a" if arch >= 90 else ""
    out = subprocess.run([_bundled_tool("ptxas-blackwell", "ptxas"), "-v", f"--gpu-name=sm_{arch}{suffix}", path,
                          "-o", os.path.join(tmp, "kernel.o")], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip()[-400:])
    return out


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """Registers per thread and spilled bytes (stores + loads) from Triton's bundled ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = _assemble(ptx, arch, tmp)
    registers = int(re.search(r"Used (\d+) registers", out.stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", out.stderr))
    return registers, spills


def compile_stage1(case: dict, launch=None) -> tuple[OfflineKernel, dict]:
    """A stage-1 attention kernel as its launcher would launch it, for one decode-shaped ``case``:
    ``{"kernel": "gqa" | "latent", "dtype": "bfloat16" | "float16" | "float32", "page_size": int,
    "rows": query rows per work item, "head_dim": int (gqa), "group": int (gqa, default 4),
    "heads": int (latent, default 16), "rank" / "rope": int (latent, default 512 / 64),
    "one_query": bool (latent, default False: the launch of a batch of one query row, whose value
    split is chosen per plan), "value_split": int (latent,
    default: the launcher's), "fast": bool (default False: the precision mode, ``fast`` or ``exact``),
    "assemble": bool (default False), "pdl": bool (default False: the
    programmatic-dependent-launch variant), "wide": bool (default False: int32 page offsets, as for
    caches of under 2^31 elements), "stamps": bool (gqa, default False: the variant that writes its
    programs' timelines, ``kernels.attention.timeline``)}``. ``launch``: a ``paged_attention.LaunchConfig``
    (default: the launcher's). Returns the compiled kernel and the launch constants used."""
    import torch

    from segkv.kernels.attention import mla_attention, paged_attention

    dtype = getattr(torch, case["dtype"])
    element = torch.empty((), dtype=dtype).element_size()
    t = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    common = {"OUT": "*fp32", "LSE": "*fp32", "FINAL": f"*{t}", "FINAL_LSE": "*fp32"}
    if case["kernel"] == "gqa":
        d = case["head_dim"]
        meta = paged_attention.stage1_launch(dtype=dtype, dk=d, dv=d, group=case.get("group", 4),
                                             page_size=case["page_size"], max_work_rows=case["rows"],
                                             element_size=element, launch=launch,
                                             cache_needs_int64=case.get("wide", False),
                                             fast=case.get("fast", False))
        fn, pointers = paged_attention._stage1_kernel, {"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", **common}
        if case.get("stamps"):
            pointers["STAMPS"] = "*i64"
    else:
        if "value_split" in case:
            launch = dataclasses.replace(launch or mla_attention.default_mla_launch_config(),
                                         value_split=case["value_split"])
        meta = mla_attention.mla_stage1_launch(dtype=dtype, rank=case.get("rank", 512), rope=case.get("rope", 64),
                                               num_heads=case.get("heads", 16), page_size=case["page_size"],
                                               max_work_rows=case["rows"], element_size=element,
                                               num_rows=1 if case.get("one_query") else None, launch=launch,
                                               cache_needs_int64=case.get("wide", False),
                                               fast=case.get("fast", False))
        fn, pointers = mla_attention._mla_stage1_kernel, {"Q": f"*{t}", "LAT": f"*{t}", **common}
        meta["FAST_PV"] = bool(case.get("fast", False))  # the launcher passes it beside the launch's constants
    meta = {**meta, "USE_PDL": bool(case.get("pdl", False))}
    return compile_offline(fn, meta, pointers=pointers, assemble=case.get("assemble", False)), meta


def stage1_report(case: dict, launch=None) -> dict:
    """:func:`compile_stage1`'s facts as plain values: shared bytes, registers, spills (None unless
    ``case["assemble"]``), the launch's warps and pipeline stages, the K/V (latent) tile buffers,
    the in-loop waits, the MMA kind, chains (:meth:`OfflineKernel.mma_chains`) and warps, the
    reductions and shared-memory writes in its loops, the PTX's ``ex2`` spellings and its 64-bit
    multiplies (``mul.lo.s64``: page offsets, and more of them with int64 ones); with ``case["sass"]``
    the machine instruction counts (:func:`sass_counts`), else None."""
    kernel, meta = compile_stage1(case, launch)
    sass = sass_counts(kernel.ptx) if case.get("sass") else None
    cols = (case.get("rank", 512) if case["kernel"] == "latent"
            else max(16, triton.next_power_of_2(case["head_dim"])))
    mma = "wgmma" if "wgmma" in kernel.ptx else "mma.sync" if "mma.sync" in kernel.ptx else "none"
    return {"case": case, "shared": kernel.shared, "registers": kernel.registers, "spill_bytes": kernel.spill_bytes,
            "num_warps": meta["num_warps"], "num_stages": meta["num_stages"],
            "buffers": kernel.pipeline_buffers(meta["BLOCK_N"], cols), "waits": kernel.loop_waits(), "mma": mma,
            "chains": kernel.mma_chains(), "loop_reductions": kernel.loop_reductions(),
            "loop_shared_stores": kernel.loop_shared_stores(), "mma_warps": kernel.mma_warps(),
            "ex2": sorted(set(re.findall(r"ex2\.[\w.]+", kernel.ptx))), "mul64": kernel.ptx.count("mul.lo.s64"),
            "timers": timer_reads(kernel.ptx), "sass": sass}


def merge_report(case: dict) -> dict:
    """The merge kernel with programmatic dependent launch for ``{"kernel": "merge", "dv": int,
    "stamps": bool}`` (bf16 output, the launcher's column
    and partial blocks): its PDL instructions in program order (``griddepcontrol.wait`` and
    ``.launch_dependents``) and timer reads (:func:`timer_reads`)."""
    from segkv.kernels.attention import paged_attention

    dv = case["dv"]
    block_dv = paged_attention.merge_block_dv(dv)
    meta = {"DV": dv, "BLOCK_DV": block_dv, "BLOCK_P": 16 if block_dv > 256 else 64, "USE_PDL": True,
            "num_warps": 4}
    pointers = {"PART_OUT": "*fp32", "PART_LSE": "*fp32", "OUT": "*bf16", "OUT_LSE": "*fp32"}
    if case.get("stamps"):
        pointers["STAMPS"] = "*i64"
    kernel = compile_offline(paged_attention._merge_kernel, meta, assemble=False, pointers=pointers)
    return {"case": case, "pdl": pdl_order(kernel.ptx), "timers": timer_reads(kernel.ptx)}


def _main() -> None:
    """``python -m segkv.kernels.offline_compile < cases.json``: :func:`stage1_report` (or, for
    ``"kernel": "merge"``, :func:`merge_report`) of each case, one JSON object per line. Run it
    without ``TRITON_INTERPRET`` (the interpreter's kernels cannot be compiled)."""
    import json
    import sys

    for case in json.load(sys.stdin):
        report = merge_report(case) if case["kernel"] == "merge" else stage1_report(case)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    _main()
