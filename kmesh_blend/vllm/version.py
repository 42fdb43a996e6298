"""The vLLM versions kmesh-blend is tested with, and the check made at engine start.

The connector reaches into vLLM's V1 internals (runner classes, attention backends, scheduler
output fields); a release outside the tested range may move any of them. Such an engine starts
with reuse off: every annotated request is served on the stock path, its report's ``fallback``
naming the version and the range (one log line says so too). The install extras pin the same
range (``pyproject.toml``; a test keeps the two equal).
"""

from __future__ import annotations

__all__ = ["TESTED_VLLM", "unsupported_vllm"]

TESTED_VLLM = ">=0.32,<0.33"


def unsupported_vllm(version: str | None = None) -> str | None:
    """Why vLLM ``version`` (default: the installed one) is not served with reuse, or None."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        from kmesh_blend.vllm.seam.engine import installed_version

        version = installed_version()
    try:
        # A local or dev build of a tested release counts as that release.
        ok = Version(Version(version).base_version) in SpecifierSet(TESTED_VLLM)
    except InvalidVersion:
        ok = False
    return None if ok else f"vLLM {version} is outside the tested range {TESTED_VLLM}"
