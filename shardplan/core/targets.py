"""Compile targets: the compiler exact mode judges a step with (jax-free).

``cpu`` is XLA:CPU on simulated devices (the default). The others are the compilers users run,
compiled offline with no accelerator through jax's topology API (FACTS.md, "Compiling for TPUs
and GPUs offline"):

- ``tpu-v5e:2x4``, ``tpu-v5p:2x2x2``, ``tpu-v6e:4x4``: XLA:TPU for a slice of that shape, named as
  TPU names it (one device per chip); needs ``jax[tpu]`` (``pip install 'shardplan[tpu]'``).
- ``h100:8``, ``h200:64``, ``a100-80gb:8``, ``b200:16``, or ``h100:8x8`` (hosts x GPUs per host;
  8 per host when one count is given): XLA:GPU for that many GPUs, each described to the compiler
  by :data:`GPUS` (datasheet facts, sources beside them); needs the CUDA plugin
  (``pip install 'shardplan[gpu]'``, no NVIDIA libraries or GPU).

Each target names its chip in ``shardplan.core.chips`` (``--chip`` must agree with it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shardplan.core import chips
from shardplan.core.meshes import closest
from shardplan.errors import as_error, error

JAX_VERSION = "0.10.2"  # the extras are pinned to the jax release shardplan is built on


# The compiler of each platform a target names (fast mode keeps a rule book per platform:
# shardplan/runtime/fast/books.py, COMPILERS).
COMPILER_NAMES = {"cpu": "XLA:CPU", "tpu": "XLA:TPU", "cuda": "XLA:GPU"}


@dataclass(frozen=True)
class Target:
    name: str  # as written by shardplan: "cpu", "tpu-v5p:2x2x2", "h100:2x8"
    platform: str  # "cpu", "tpu" or "cuda"
    chip: str | None  # its chip in shardplan.core.chips (None: XLA:CPU, no chip)
    devices: int | None  # devices it has (None: cpu, as many as the mesh)
    topology: str = ""  # TPU: "v5p:2x2x2"; GPU: "slices x hosts x per host", e.g. "1x2x8"

    @property
    def compiler(self) -> str:
        return COMPILER_NAMES[self.platform]

    @property
    def book(self) -> str:
        """Fast mode's rule book for this target (shardplan/runtime/fast/books.py, ``COMPILERS``): the
        platform's, or a TPU generation's where its compiler chooses otherwise (``tpu-v5p``,
        ``tpu-v6e``)."""
        return self.chip if self.chip in BOOKS else self.platform


@dataclass(frozen=True)
class GpuSpec:
    """What XLA:GPU's compiler is told about a GPU (its ``GpuDeviceInfoProto``) beyond the memory
    size and bandwidth, which are the chip registry's (``shardplan.core.chips``)."""

    description: str  # the device kind the driver reports
    sms: int
    clock_ghz: float  # boost clock
    l2_bytes: int
    compute_capability: tuple[int, int]
    shared_per_sm: int
    source: str


GPUS: dict[str, GpuSpec] = {
    "a100-80gb": GpuSpec(
        "NVIDIA A100-SXM4-80GB",
        108,
        1.41,
        40 * 2**20,
        (8, 0),
        167936,
        "NVIDIA A100 datasheet and whitepaper: 108 SMs, 1,410 MHz boost, 80 GB HBM2e at 2,039 GB/s, "
        "40 MB L2, sm_80, 164 KB shared memory per SM",
    ),
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3",
        132,
        1.98,
        50 * 2**20,
        (9, 0),
        233472,
        "NVIDIA H100 SXM datasheet and Hopper whitepaper: 132 SMs, 1,980 MHz boost, 80 GB HBM3 at "
        "3.35 TB/s, 50 MB L2, sm_90, 228 KB shared memory per SM",
    ),
    "h200": GpuSpec(
        "NVIDIA H200",
        132,
        1.98,
        50 * 2**20,
        (9, 0),
        233472,
        "NVIDIA H200 SXM datasheet: the H100's GH100 (132 SMs, 1,980 MHz, 50 MB L2, sm_90) with 141 GB "
        "HBM3e at 4.8 TB/s",
    ),
    "b200": GpuSpec(
        "NVIDIA B200",
        148,
        1.965,
        126 * 2**20,
        (10, 0),
        233472,
        "NVIDIA DGX B200 datasheet: 180 GB HBM3e per GPU at 8 TB/s; Blackwell: 148 SMs, 1,965 MHz, 126 MB L2, sm_100",
    ),
}

# TPU generations the topology API names ("v5p:2x2x2"), by their chip in shardplan.core.chips.
TPUS: dict[str, str] = {"tpu-v5e": "v5e", "tpu-v5p": "v5p", "tpu-v6e": "v6e"}
# chips whose compiler has a rule book of its own in fast mode: a TPU generation whose compiler
# chooses otherwise, GPUs whose matmuls split differently from the H100's (runtime/splitk.py)
BOOKS = frozenset({"tpu-v5p", "tpu-v6e", "a100-80gb", "b200"})
GPUS_PER_HOST = 8
MAX_2D = 16  # v5e and v6e slices are at most 16 x 16 chips (256)

INSTALL = {
    "tpu": f"pip install 'shardplan[tpu]'  (that is: pip install 'jax[tpu]=={JAX_VERSION}')",
    "cuda": f"pip install 'shardplan[gpu]'  (that is: pip install jax-cuda12-plugin=={JAX_VERSION} "
    f"jax-cuda12-pjrt=={JAX_VERSION})",
}

CPU = Target("cpu", "cpu", None, None)
_SHAPE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*)*$")
EXAMPLES = "cpu, tpu-v5e:2x4, tpu-v5p:2x2x2, tpu-v6e:4x4, h100:8, h200:2x8, a100-80gb:8, b200:8"


def parse(text: str, where: str = "--target") -> Target:
    """A target name -> Target.

    Raises:
        ArgumentError: an unknown chip (with the nearest name), a missing or malformed shape.
    """
    name, _, shape = text.strip().lower().partition(":")
    if name == "cpu" and not shape:
        return CPU
    known = ["cpu", *TPUS, *GPUS]
    if name not in TPUS and name not in GPUS:
        near = closest(name, known)
        raise _bad(f"unknown target '{text}'", f"{near + ' ' if near else ''}targets: {EXAMPLES}", where)
    if not _SHAPE.match(shape):
        example = "tpu-v5p:2x2x2" if name in TPUS else f"{name}:8 or {name}:2x8"
        raise _bad(
            f"target '{text}' needs its size after ':' as dims joined by 'x'",
            f"e.g. {example}",
            where,
        )
    dims = [int(d) for d in shape.split("x")]
    if name in TPUS:
        if len(dims) not in (2, 3):
            raise _bad(f"TPU slice '{shape}' must have 2 (v5e, v6e) or 3 (v5p) dims", "e.g. tpu-v5p:2x2x2", where)
        return Target(f"{name}:{shape}", "tpu", name, math.prod(dims), f"{TPUS[name]}:{shape}")
    if len(dims) == 1:
        n = dims[0]
        hosts, per_host = (1, n) if n <= GPUS_PER_HOST else (n // GPUS_PER_HOST, GPUS_PER_HOST)
        if hosts * per_host != n:
            raise _bad(
                f"{n} GPUs do not fill hosts of {GPUS_PER_HOST}",
                f"give hosts x GPUs per host, e.g. {name}:{math.ceil(n / GPUS_PER_HOST)}x{GPUS_PER_HOST}",
                where,
            )
    elif len(dims) == 2:
        hosts, per_host = dims
    else:
        raise _bad(f"GPU target '{text}' takes a count or hosts x GPUs per host", f"e.g. {name}:2x8", where)
    return Target(f"{name}:{hosts}x{per_host}", "cuda", name, hosts * per_host, f"1x{hosts}x{per_host}")


def gpu_target_config(chip: str) -> str:
    """The ``GpuTargetConfig`` text proto XLA:GPU compiles against for ``chip`` (no GPU needed)."""
    g, figures = GPUS[chip], chips.lookup(chip)  # memory and bandwidth: the chip registry's datasheet figures
    major, minor = g.compute_capability
    return (
        "gpu_device_info {\n"
        "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n  shared_memory_per_block: 49152\n"
        f"  shared_memory_per_core: {g.shared_per_sm}\n  threads_per_core_limit: 2048\n"
        f"  core_count: {g.sms}\n  fpus_per_core: 128\n"
        "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n  block_dim_limit_z: 65535\n"
        f"  memory_bandwidth: {int(figures.hbm_bandwidth)}\n  l2_cache_size: {g.l2_bytes}\n"
        f"  clock_rate_ghz: {g.clock_ghz}\n  device_memory_size: {int(figures.hbm_bytes)}\n"
        f"  shared_memory_per_block_optin: {g.shared_per_sm - 1024}\n"
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
        "  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n"
        "}\n"
        'platform_name: "CUDA"\n'
        "dnn_version_info { major: 9 minor: 8 }\n"
        f'device_description_str: "{g.description}"\n'
    )


# The module each target compiler installs (found without importing it).
_PACKAGES = {"tpu": "libtpu", "cuda": "jax_plugins.xla_cuda12"}


def installed(target: Target) -> bool:
    """Whether the target's compiler is installed here (XLA:CPU always is); nothing is imported."""
    import importlib.util

    package = _PACKAGES.get(target.platform)
    try:
        return package is None or importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require_compiler(target: Target, where: str = "--target") -> None:
    """The target's compiler is installed (XLA:CPU always is).

    Raises:
        ArgumentError: it is not (``target-compiler-missing``; the hint is the ``pip install`` line).
    """
    package = _PACKAGES.get(target.platform)
    if not installed(target):
        raise as_error(
            [
                error(
                    "target-compiler-missing",
                    f"{target.compiler} is not installed here (no module {package}); --target {target.name} needs it",
                    INSTALL[target.platform],
                    path=where,
                )
            ]
        )


def tpu_slice(chip: str, chips_: int) -> str | None:
    """The slice shape of ``chips_`` chips of a TPU generation as its topology API names it, the most
    even one (None: no slice has that many): v5e and v6e are 2-D, hosts of 2 x 2 chips, so both
    dims even (8 chips: ``2x4``), at most 16 x 16; v5p is 3-D, hosts of 2 x 2 x 1, the first two dims even, the dims
    ascending where they can be (16 chips: ``2x2x4``; 4: ``2x2x1``). Read from
    ``jax.experimental.topologies.get_topology_desc`` with libtpu 0.0.42.1 (2026-12-07): ``v5e:1x2``,
    ``v5e:2x3`` and ``v5p:1x2x2`` are refused, ``v5p:2x2x3`` is a 12-chip slice."""
    shapes: list[tuple[int, ...]] = []
    for x in range(2, chips_ + 1, 2):
        for y in range(x, chips_ // x + 1, 2):
            rest, left = divmod(chips_, x * y)
            if left:
                continue
            if chip in ("tpu-v5e", "tpu-v6e"):
                if rest == 1 and y <= MAX_2D:
                    shapes.append((x, y))
            else:
                shapes.append((x, y, rest))
    if not shapes:
        return None
    best = min(shapes, key=lambda d: (max(d) / min(d), list(d) != sorted(d), d))
    return "x".join(map(str, best))


def for_chip(
    chip: str, devices: int, devices_per_host: int | None = None, tpus: bool = True
) -> tuple[Target | None, str]:
    """The target that compiles a plan for ``devices`` of ``chip`` as that chip's compiler does,
    where it is installed here; else None and why not (a line a user can act on). ``tpus``:
    False where a TPU's program is not to be judged (``suggest``'s default: see its docs)."""
    if chip in TPUS:
        if not tpus:
            return None, (
                f"XLA:TPU's windowed einsums (rings of collective-permutes inside its matmul loops, "
                f"which it overlaps) are timed one after another by shardplan's time model, which "
                f"would rank every plan that scatters gradients so far below the rest; name "
                f"--target {chip}:{tpu_slice(chip, devices) or '...'} to confirm with XLA:TPU anyway"
            )
        shape = tpu_slice(chip, devices)
        if shape is None:
            return None, f"no {chip} slice has {devices} chips"
        aim = parse(f"{chip}:{shape}")
    elif chip in GPUS:
        if devices_per_host and devices > devices_per_host:
            aim = parse(f"{chip}:{devices // devices_per_host}x{devices_per_host}")
        elif devices > GPUS_PER_HOST and devices % GPUS_PER_HOST:
            return None, f"{devices} {chip} GPUs do not fill hosts of {GPUS_PER_HOST}"
        else:
            aim = parse(f"{chip}:{devices}")
    else:
        return None, f"shardplan has no offline compiler for {chip}"
    if not installed(aim):
        return None, f"{aim.compiler} is not installed here: {INSTALL[aim.platform]}"
    return aim, ""


def agree(target: Target, chip: str | None, where: str = "--chip") -> None:
    """``--chip`` and the target name one chip (or the target is XLA:CPU, which has none).

    Raises:
        ArgumentError: they name different chips.
    """
    if chip is not None and target.chip is not None and chip != target.chip:
        raise _bad(
            f"--chip {chip} and --target {target.name} name different chips",
            f"drop --chip (the target's chip, {target.chip}, is used) or make them the same",
            where,
        )


def _bad(message: str, hint: str, where: str):
    return as_error([error("bad-target", message, hint, path=where)])
