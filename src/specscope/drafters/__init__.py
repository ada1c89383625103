"""Drafters, one file each, behind the protocol in base.py."""

from .base import Draft, Drafter
from .ngram import NgramDrafter
from .none import NoDrafter
from .oracle import OracleDrafter

METHODS = ("none", "ngram", "oracle")

__all__ = ["Draft", "Drafter", "NgramDrafter", "NoDrafter", "OracleDrafter", "METHODS"]
