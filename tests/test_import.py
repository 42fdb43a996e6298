"""`import kmesh_blend` must stay light: no vLLM, FlashInfer or torch at import time."""

import json
import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_does_not_pull_heavy_dependencies() -> None:
    loaded = _modules_after("import kmesh_blend")
    assert "kmesh_blend" in loaded
    for heavy in ("vllm", "flashinfer", "torch", "lmcache", "triton"):
        assert heavy not in loaded, f"`import kmesh_blend` imported {heavy}"


def test_models_package_does_not_import_vllm() -> None:
    loaded = _modules_after("import kmesh_blend.models, kmesh_blend.testing")
    assert "torch" in loaded  # the guard above can fail: this import does load torch
    assert "vllm" not in loaded and "flashinfer" not in loaded


def test_public_api_is_exported() -> None:
    import kmesh_blend

    assert kmesh_blend.KMeshConfig().recompute_ratio == 0.15
    assert set(kmesh_blend.__all__) >= {"KMeshConfig", "ConfigError"}


def test_the_vllm_plugin_entry_point_stays_light() -> None:
    """vLLM runs the plugin in every process, its API server included: registering imports
    neither torch nor vLLM (the runner modules are wrapped when vLLM imports them)."""
    loaded = _modules_after(
        "from kmesh_blend.vllm.plugin import register; register()\n"
        "from kmesh_blend.vllm.seam import REPORT; assert 'plugin' in REPORT.found"
    )
    for heavy in ("vllm", "torch", "lmcache"):
        assert heavy not in loaded, f"the plugin imported {heavy}"
