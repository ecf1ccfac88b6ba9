"""The built-in demo model (mlxspec/assets/demo/), so `mlxspec run` works offline."""

from pathlib import Path

DEMO_NAME = "mlxspec-demo"


def demo_model_path() -> Path:
    """Folder of the packaged demo checkpoint (config.json, model.safetensors, tokenizer)."""
    # The assets are plain files inside the package (wheels include them), so a
    # path relative to this module works for both source trees and installs.
    return Path(__file__).resolve().parent.parent / "assets" / "demo"
