"""kvquant-ext: KV-cache compression (KIVI, KCVT, GEAR, HQMQ and baselines) as torch
custom ops (``torch.ops.kvq.*``) with CPU and CUDA kernels.

>>> import kvquant_ext as kvq
>>> c = kvq.compress(keys, kvq.get_config("kivi-2"), role="key")
>>> c.decompress(), c.nbytes, c.bits_per_element
"""
from __future__ import annotations

import importlib

import torch  # noqa: F401  (must be imported before the extension library)

try:  # written by the build: the extension's flags and the argument sets its ops accept
    from ._build_config import BITS, HEAD_DIMS, MMA_HEAD_DIMS, TORCH_VERSION
    from ._build_config import WITH_CUDA as built_with_cuda
except ImportError as e:  # pragma: no cover  (a source tree that was never built)
    raise ImportError("kvquant_ext is not built (kvquant_ext/_build_config.py is missing); "
                      "install it with: pip install --no-build-isolation -e .") from e


def _check_torch(built: str, running: str) -> None:
    """The compiled ops link against the C++ ABI of the torch they were built with, which
    changes between minor releases: refuse another torch with a clear message (instead of
    an undefined-symbol error from the loader)."""
    def minor(v):
        return tuple(v.split("+")[0].split(".")[:2])
    if minor(built) != minor(running):
        raise ImportError(f"kvquant_ext was built against torch {built}, but torch {running} is "
                          f"installed; reinstall kvquant-ext against this torch (pip install "
                          f"--no-build-isolation kvquant-ext, from source) or install torch "
                          f"{'.'.join(minor(built))}.x")


_check_torch(TORCH_VERSION, torch.__version__)
from . import _ops as ops  # noqa: F401  (registers torch.ops.kvq.* and their fakes)
from ._ops import FLOAT_DTYPES as DTYPES  # the floating input dtypes, as torch dtypes
from ._ops import (dequantize, gear_compress, gear_decompress, hqmq_decode, hqmq_encode,
                   lowrank_power_iter, outlier_count, outlier_index_dtype, outlier_select,
                   quantize)
from . import gear, hqmq, streams  # noqa: F401  (each registers its formats on import)
from .attention import decode_attention, prefix_attention, uses_fused_kernel
from .cache import KVCache
from .paged import PagedKVCache
from .compressed import Compressed, FullPrecision, GroupQuantized
from .config import (PRESETS, CompressionConfig, FP16Config, FlexGenConfig, GEARConfig,
                     GroupQuantBase, GroupQuantConfig, HQMQConfig, KCVTConfig, KIVIConfig, PerTokenIntConfig,
                     QuantSpec, get_config, register_format, register_preset)
from .gear import GEARCompressed, GEARStream
from .hqmq import HQMQCompressed, HQMQStream, hqmq_secondary, hqmq_seed, med3_threshold

__version__ = "0.1.0"


def compress(x: torch.Tensor, config, role: str, *, check_finite: bool = True,
             layer_idx: int = 0) -> Compressed:
    """Compress a whole ``[B, H, T, D]`` block with ``config`` (or a preset name) as
    ``role`` ("key" or "value") of layer ``layer_idx`` (which only HQMQ's codebooks depend
    on), through the format registered for the config's class.  Returns an object with
    ``decompress()``, ``nbytes`` and ``bits_per_element``."""
    if isinstance(config, str):
        config = get_config(config)
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"argument 'config' must be a CompressionConfig or preset name, "
                        f"got {type(config).__name__}")
    return config.compress(x, role, check_finite=check_finite, layer_idx=layer_idx)


def __getattr__(name: str):
    # `kvq.hf` (needs transformers) and `kvq.cli` are imported on first use, so the core
    # package never imports transformers.
    if name in ("hf", "cli"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BITS", "DTYPES", "HEAD_DIMS", "MMA_HEAD_DIMS",
    "HQMQCompressed", "HQMQConfig", "HQMQStream", "hqmq_decode", "hqmq_encode", "hqmq_secondary",
    "PRESETS", "CompressionConfig", "Compressed", "FP16Config", "FlexGenConfig", "FullPrecision",
    "GroupQuantBase", "GroupQuantConfig", "GroupQuantized", "KCVTConfig", "KIVIConfig", "KVCache", "PagedKVCache",
    "PerTokenIntConfig", "QuantSpec", "compress", "decode_attention", "prefix_attention", "dequantize", "get_config", "quantize",
    "register_format", "register_preset", "uses_fused_kernel", "hqmq_seed", "med3_threshold",
    "GEARCompressed", "GEARConfig", "GEARStream", "gear_compress", "gear_decompress",
    "lowrank_power_iter", "outlier_count", "outlier_index_dtype", "outlier_select",
]
