"""PyTorch caching-allocator settings as ordered option maps.

The job's torch may read any of three variable names (CUDA, HIP, the new
generic one; which depends on version and build), so a remedy sets all three
to the same string, built from the user's own options overlaid with ours.
"""

from __future__ import annotations

from collections.abc import Mapping

ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def parse_alloc_conf(text: str | None) -> dict[str, str]:
    """'a:1,b:2' -> {'a': '1', 'b': '2'} (order kept; malformed parts dropped)."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        key, sep, value = part.strip().partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def format_alloc_conf(options: Mapping[str, str]) -> str:
    return ",".join(f"{k}:{v}" for k, v in options.items())


def user_alloc_options(env: Mapping[str, str]) -> dict[str, str]:
    """The union of the options the user set under any of the names."""
    merged: dict[str, str] = {}
    for name in ALLOC_VARS:
        merged.update(parse_alloc_conf(env.get(name)))
    return merged


def merged_alloc_env(user_env: Mapping[str, str], ours: Mapping[str, str]) -> dict[str, str]:
    """Every allocator variable set to the user's options overlaid with ours.

    expandable_segments makes max_split_size_mb meaningless; when we set one
    of them the user's other is dropped so the string says what will happen.
    """
    options = user_alloc_options(user_env)
    if "expandable_segments" in ours:
        options.pop("max_split_size_mb", None)
    if "max_split_size_mb" in ours and options.get("expandable_segments", "").lower() == "true":
        options.pop("expandable_segments")
    options.update(ours)
    value = format_alloc_conf(options)
    return dict.fromkeys(ALLOC_VARS, value)
