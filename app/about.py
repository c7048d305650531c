"""What Help ▸ About says, without Qt (so the CLI could say it too).

The version is the installed package's, which pip writes from pyproject.toml's
`[project] version`: that one line is the only place it is set (the packaged app carries
the package's metadata for this).
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "understudy"
SUMMARY = ("A chat app for local language models that makes them faster with speculative "
           "decoding on MLX, and shows which of a small drafter's guesses the model kept.")


def app_version() -> str:
    """Understudy's version, or "unknown" when run from a checkout never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def mlx_version() -> str:
    """The MLX the engine runs on (the module's own, as the packaged app has no metadata)."""
    import mlx.core as mx

    return str(mx.__version__)


def about_details(model: str | None) -> list[str]:
    """The lines under the app's name: version, model, MLX."""
    return [f"Version {app_version()}",
            f"Model: {model}" if model else "Model: none loaded",
            f"MLX {mlx_version()}"]
