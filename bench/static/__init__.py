"""`python -m bench static`: every Triton kernel of the project compiled for H100, A100 and B200 without
a GPU, read from ptxas and the SASS (``cli``'s docstring is the command's help). One concept a module:

- ``targets``: the GPUs compiled for (``Arch``, ``ARCHS``) and blocks per SM;
- ``driver``: the stand-in for Triton's CUDA driver (``compiling_for``), recording instead of launching;
- ``cases``: one launcher call on meta tensors (``Case``), the masks of real batches (``VARIANTS``),
  the multiply-adds each attention kernel needs, ``spill_free``;
- ``tutorial``: the yardsticks, the Triton tutorial's fused attention written here from its idea;
- ``sass``: reading the binary: Triton's ptxas and nvdisasm, MMA instructions, loops, instruction mix;
- ``blackwell``: tcgen05 MMAs and their shapes, tensor memory, warp-specialized partitions;
- ``analysis``: ``analyze``, one compiled kernel's row;
- ``run``: a case compiled for a target, and the sweep of cases a run compiles;
- ``tables``: static.json and static.md, and the environment they record;
- ``cli``: ``main``, the command line, and a case compiled in a fresh interpreter.
"""

from bench.static.analysis import analyze
from bench.static.blackwell import find_partitions, idesc_shape, ptx_tcgen05, sass_idesc, ttgir_partitions
from bench.static.cases import (ATTENTION_KERNELS, PARTITION_ENTRY_SPILL, VARIANTS, Case, launch_config, row_shape,
                                spill_free)
from bench.static.cli import main, run_in_subprocess
from bench.static.driver import Compiled, StandInDriver, compiling_for
from bench.static.run import can_compile, compile_case, sweep
from bench.static.sass import MMA, find_loops
from bench.static.tables import (DEFAULT_OUT, REPO, config_text, environment, markdown, markdown_document, overview_rows,
                                 write)
from bench.static.targets import ARCHS, Arch, blocks_per_sm

__all__ = ["ARCHS", "ATTENTION_KERNELS", "DEFAULT_OUT", "MMA", "PARTITION_ENTRY_SPILL", "REPO", "VARIANTS", "Arch",
           "Case", "Compiled", "StandInDriver", "analyze", "blocks_per_sm", "can_compile", "compile_case",
           "compiling_for", "config_text", "environment", "find_loops", "find_partitions", "idesc_shape",
           "launch_config", "main", "markdown", "markdown_document", "overview_rows", "ptx_tcgen05", "row_shape",
           "run_in_subprocess", "sass_idesc", "spill_free", "sweep", "ttgir_partitions", "write"]
