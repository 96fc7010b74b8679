"""Checks beside the pipeline: does each patch apply, conflict, or live upstream already?"""

from .check import Outcome, PatchResult, VersionReport, check_tree, exit_code

__all__ = ["Outcome", "PatchResult", "VersionReport", "check_tree", "exit_code"]
