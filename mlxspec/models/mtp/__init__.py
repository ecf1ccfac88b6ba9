"""Native multi-token-prediction (MTP / NextN) heads shipped inside checkpoints."""

from .weights import MTPWeights, find_mtp_weights

__all__ = ["MTPWeights", "find_mtp_weights"]
