"""The series: our patches, parsed, checked for safety, and applied in memory."""

from .apply import HunkFailure, VirtualTree, apply_file_patch
from .patch import FilePatch, Hunk, Patch, Series, load_series, parse_patch

__all__ = [
    "FilePatch",
    "Hunk",
    "HunkFailure",
    "Patch",
    "Series",
    "VirtualTree",
    "apply_file_patch",
    "load_series",
    "parse_patch",
]
