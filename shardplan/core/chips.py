"""The registry of accelerators the step-time estimate knows: peak bf16 FLOP/s, HBM, and the
bandwidth each chip sustains for collectives over fast links (NVLink / ICI, ``@ici`` mesh
axes) and over the data-center network (``@dcn`` axes). Sources in docs/stepcost.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardplan.core.meshes import closest
from shardplan.errors import as_error, error


@dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s per chip, one direction, inside a host (NVLink) or slice (ICI)
    dcn_bandwidth: float  # bytes/s per chip across hosts or slices
    source: str
    # Latency: a collective over a group of n devices pays ``*_latency * ceil(log2 n)`` on top of
    # its bytes (tree and NVLS algorithms for small messages take log2 n steps), and each kernel
    # launch ``launch_s``. Sources in LATENCY_SOURCES.
    ici_latency: float = 3e-6
    dcn_latency: float = 8e-6
    launch_s: float = 1e-6


GPU_LATENCY = (3e-6, 8e-6, 1e-6)
TPU_LATENCY = (1.5e-6, 10e-6, 0.5e-6)


def _with_latency(c: Chip) -> Chip:
    ici, dcn, launch = TPU_LATENCY if c.name.startswith("tpu") else GPU_LATENCY
    return replace(c, ici_latency=ici, dcn_latency=dcn, launch_s=launch)


LATENCY_SOURCES = (
    "GPUs: an all-reduce of 1 KiB over 8 H100s with NVLink SHARP takes 5.45 us (microsoft/mscclpp "
    "PR 507, nccl-tests output) and NCCL's ring/tree all-reduce of 32 KiB about 18.7 us "
    "(kvcache-ai/Mooncake PR 3484): 3 us per doubling of the group, 9 us for 8 GPUs; across two "
    "hosts 15.6 us for 24 KiB on 16 GPUs with a tuned kernel (microsoft/mscclpp issue 210), "
    "NCCL's slower: 8 us per doubling, 32 us for 16 GPUs. A kernel launch under CUDA graphs "
    "(XLA:GPU's command buffers): 1 us, assumed. TPUs: 1.5 us per doubling over ICI, 10 us over "
    "DCN and 0.5 us per kernel, assumed (no published small-collective latency found)."
)


CHIPS: dict[str, Chip] = {
    c.name: _with_latency(c)
    for c in (
        Chip(
            "a100-80gb",
            312e12,
            80e9,
            2.039e12,
            300e9,
            25e9,
            "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s; HDR InfiniBand 200 Gb/s "
            "per GPU (DGX A100)",
        ),
        Chip(
            "h100",
            989e12,
            80e9,
            3.35e12,
            450e9,
            50e9,
            "NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s; "
            "NDR InfiniBand 400 Gb/s per GPU (DGX H100)",
        ),
        Chip(
            "h200",
            989e12,
            141e9,
            4.8e12,
            450e9,
            50e9,
            "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, NVLink 900 GB/s; NDR 400 Gb/s per GPU",
        ),
        Chip(
            "b200",
            2.25e15,
            180e9,
            8e12,
            900e9,
            50e9,
            "NVIDIA DGX B200 datasheet: 2.25 PFLOPS bf16 dense per GPU, 8 TB/s HBM3e, NVLink 1.8 TB/s; "
            "400 Gb/s per GPU",
        ),
        Chip(
            "tpu-v4",
            275e12,
            32 * 2**30,
            1.2e12,
            268e9,
            3.125e9,
            "Cloud TPU v4 docs: 275 TFLOPS bf16, 32 GiB and 1,200 GB/s HBM2, all-reduce bandwidth "
            "1.1 PB/s per 4096-chip pod (268 GB/s per chip)",
        ),
        Chip(
            "tpu-v5e",
            197e12,
            16e9,
            819e9,
            200e9,
            3.125e9,
            "Cloud TPU v5e docs: 197 TFLOPS bf16, 16 GB and 819 GB/s HBM2, 400 GB/s bidirectional ICI per chip, "
            "2 x 100 Gbps NIC per 8-chip host",
        ),
        Chip(
            "tpu-v5p",
            459e12,
            95e9,
            2.765e12,
            300e9,
            3.125e9,
            "Cloud TPU v5p docs: 459 TFLOPS bf16, 95 GB and 2,765 GB/s HBM2e, ICI 4,800 Gbps per chip",
        ),
        Chip(
            "tpu-v6e",
            918e12,
            32e9,
            1.638e12,
            400e9,
            3.125e9,
            "Cloud TPU v6e (Trillium) docs: 918 TFLOPS bf16, 32 GB and 1,638 GB/s HBM, 800 GB/s bidirectional ICI "
            "per chip",
        ),
    )
}


def lookup(name: str) -> Chip:
    chip = CHIPS.get(name)
    if chip is None:
        near = closest(name, CHIPS)
        raise as_error(
            [
                error(
                    "unknown-chip",
                    f"unknown chip '{name}'",
                    (near + " " if near else "") + f"chips: {', '.join(CHIPS)}",
                    path="--chip",
                )
            ]
        )
    return chip
